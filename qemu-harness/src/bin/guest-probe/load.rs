//! `guest-probe load`: the benchmark's workloads inside a guest, against several paths in
//! turns, for the VM comparison of forwarders (`bench`'s VM table).
//!
//! ```text
//! guest-probe load --path guest-init=/run/bench/echo.sock --path socat=/tmp/socat.sock \
//!     --path vsock=vsock:2:6001 --socat BIN --socat-listen /tmp/socat.sock --socat-to 2:6001 \
//!     --rounds R --window-ms W --burst N --burst-threads T [--perf BIN [--perf-ms MS]]
//! ```
//!
//! Each `--path NAME=TARGET` is a way to the same host echo service: a Unix socket a
//! forwarder publishes in the guest, or a vsock address the app dials itself. With
//! `--socat`, the probe first starts socat as a forwarder
//! (`UNIX-LISTEN:<listen>,fork,backlog=4096 VSOCK-CONNECT:<cid>:<port>`, the same options
//! as the host bench's socat hops) as its own child, so socat runs as the app's user, and
//! stops it at the end.
//!
//! The workloads are the host bench's own (`qemu_harness::load`): RTT of 64-byte
//! ping-pongs, connect + echo + close, and a burst of N connections held open together;
//! bulk is 256 KiB chunks written and echoed back in turns (`load::bulk_exchange`: the
//! host's both-ways-at-once bulk stalls in vhost-device-vsock 0.3.0 on every path). As on the host, every round cuts each figure's window
//! into slices of about 100 ms (bulk: 300 ms) and the paths take turns slice by slice in
//! an order rotated per round, so a slow moment of the (shared, TCG) machine falls on all
//! paths alike; the bursts run once per path per round with a pause between. A path
//! whose workload fails sits out the rest of that figure, with an `error` line.
//!
//! Output, one line per round and path (the host takes medians over rounds):
//! `guest-probe: load round=R path=NAME rtt_p50_us=.. rtt_p99_us=.. bulk_mibs=..
//! setup_rate=.. setup_p50_us=.. setup_p99_us=.. burst_ok=.. burst_total=.. burst_ms=..`
//! (a field that could not be measured is left out), then, with `--perf`, the profile of
//! each path's round trip (`guest-probe/profile.rs`), then `guest-probe: load finished`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use qemu_harness::load::{self, percentile, Target};

use super::say;

/// Bytes per bulk exchange (`qemu_harness::load::bulk_exchange` says why in turns).
const BULK_CHUNK: usize = 256 * 1024;

/// What `load` was asked to do.
#[derive(Debug)]
pub struct Plan {
    /// The paths, by name.
    pub paths: Vec<(String, Target)>,
    /// Rounds.
    pub rounds: usize,
    /// One figure's window per round.
    pub window: Duration,
    /// Connections per burst.
    pub burst: usize,
    /// Threads opening a burst.
    pub burst_threads: usize,
    /// socat as a forwarder: (binary, listen path, vsock cid, vsock port).
    pub socat: Option<(String, String, u32, u32)>,
    /// `perf` to profile each path's round trip with, after the rounds, for this long.
    pub perf: Option<(String, Duration)>,
}

impl Plan {
    /// Reads the plan from `opt` (one value) and `all` (every value) of the options.
    pub fn parse(
        opt: impl Fn(&str) -> Option<String>,
        all: impl Fn(&str) -> Vec<String>,
    ) -> Result<Plan, String> {
        let mut paths = Vec::new();
        for p in all("--path") {
            let (name, to) = p
                .split_once('=')
                .ok_or(format!("--path {p:?}: expected NAME=TARGET"))?;
            let to = Target::parse(to).ok_or(format!(
                "--path {p:?}: TARGET is an absolute path or vsock:CID:PORT"
            ))?;
            paths.push((name.to_string(), to));
        }
        if paths.is_empty() {
            return Err("load needs at least one --path NAME=TARGET".into());
        }
        let num = |name: &str, default: usize| -> Result<usize, String> {
            match opt(name) {
                None => Ok(default),
                Some(v) => v.parse().ok().filter(|n| *n > 0).ok_or(format!(
                    "{name} {v:?}: expected a whole number of at least 1"
                )),
            }
        };
        let socat = match (opt("--socat"), opt("--socat-listen"), opt("--socat-to")) {
            (None, None, None) => None,
            (Some(bin), Some(listen), Some(to)) => {
                let (cid, port) = to
                    .split_once(':')
                    .and_then(|(c, p)| Some((c.parse().ok()?, p.parse().ok()?)))
                    .ok_or(format!("--socat-to {to:?}: expected CID:PORT"))?;
                Some((bin, listen, cid, port))
            }
            _ => return Err("--socat needs --socat-listen PATH and --socat-to CID:PORT".into()),
        };
        Ok(Plan {
            paths,
            rounds: num("--rounds", 3)?,
            window: Duration::from_millis(num("--window-ms", 1500)? as u64),
            burst: num("--burst", 1000)?,
            burst_threads: num("--burst-threads", 8)?,
            perf: match opt("--perf") {
                Some(p) => Some((p, Duration::from_millis(num("--perf-ms", 3000)? as u64))),
                None => None,
            },
            socat,
        })
    }
}

/// One round's figures on one path.
#[derive(Debug, Default)]
struct Figures {
    rtt: Vec<f64>,
    bulk: Vec<f64>,
    setups: Vec<f64>,
    rates: Vec<f64>,
    burst: Option<load::Burst>,
}

impl Figures {
    fn line(&self, round: usize, name: &str) -> String {
        let mut out = format!("load round={round} path={name}");
        let mut field = |key: &str, v: Option<f64>| {
            if let Some(v) = v.filter(|v| v.is_finite()) {
                out.push_str(&format!(" {key}={v:.2}"));
            }
        };
        let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        field("rtt_p50_us", percentile(&self.rtt, 50.0));
        field("rtt_p99_us", percentile(&self.rtt, 99.0));
        // Slices of equal length: the mean rate is the rate over all of them.
        field("bulk_mibs", mean(&self.bulk));
        field("setup_rate", mean(&self.rates));
        field("setup_p50_us", percentile(&self.setups, 50.0));
        field("setup_p99_us", percentile(&self.setups, 99.0));
        if let Some(b) = &self.burst {
            field("burst_ok", Some(b.ok as f64));
            field("burst_total", Some(b.total as f64));
            field("burst_ms", Some(b.millis));
        }
        out
    }
}

/// Runs `each` on every path `slices` times over, the paths taking turns in the round's
/// rotated order; a path whose workload fails is reported once and sits out the rest.
fn interleave(
    plan: &Plan,
    round: usize,
    slices: usize,
    fig: &str,
    figs: &mut [Figures],
    mut each: impl FnMut(&Target, &mut Figures) -> std::io::Result<()>,
) {
    let n = plan.paths.len();
    let mut failed = vec![false; n];
    for _ in 0..slices {
        for i in (0..n).map(|k| (round + k) % n) {
            if failed[i] {
                continue;
            }
            if let Err(e) = each(&plan.paths[i].1, &mut figs[i]) {
                failed[i] = true;
                say!(
                    "load error round={} path={} fig={fig}: {e}",
                    round + 1,
                    plan.paths[i].0
                );
            }
        }
    }
}

/// Starts socat as a forwarder and waits until its socket accepts a connection.
fn start_socat(bin: &str, listen: &str, cid: u32, port: u32) -> Result<Child, String> {
    let _ = std::fs::remove_file(listen);
    let child = Command::new(bin)
        .arg(format!("UNIX-LISTEN:{listen},fork,backlog=4096"))
        .arg(format!("VSOCK-CONNECT:{cid}:{port}"))
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start socat {bin}: {e}"))?;
    say!("load socat started pid={}", child.id());
    Ok(child)
}

/// Waits until `to` accepts a connection (a forwarder that has just started).
fn wait_accepting(to: &Target, within: Duration) -> Result<(), String> {
    let deadline = Instant::now() + within;
    loop {
        match to.connect(Duration::from_secs(10)) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!("{to:?} accepts no connection: {e}"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Runs the plan; true when every path took part in every figure of every round and
/// every burst connection echoed.
pub fn run(plan: &Plan) -> bool {
    match vm_transport::fdlimit::raise_fd_limit() {
        Ok(n) => say!("load open-file limit {n}"),
        Err(e) => say!("load cannot raise the open-file limit: {e}"),
    }
    let mut socat = None;
    if let Some((bin, listen, cid, port)) = &plan.socat {
        match start_socat(bin, listen, *cid, *port) {
            Ok(c) => socat = Some(c),
            Err(e) => say!("load error: {e}"),
        }
    }
    let mut ok = true;
    for (name, to) in &plan.paths {
        if let Err(e) = wait_accepting(to, Duration::from_secs(60)) {
            say!("load error path={name}: {e}");
            ok = false;
        }
    }
    let slices = ((plan.window.as_millis() / 100) as usize).max(1);
    let slice = plan.window / slices as u32;
    for round in 0..plan.rounds {
        let mut figs: Vec<Figures> = plan.paths.iter().map(|_| Figures::default()).collect();
        interleave(plan, round, slices, "rtt", &mut figs, |to, f| {
            f.rtt.extend(load::rtt(to, slice)?);
            Ok(())
        });
        // Longer slices: a bulk connection needs a moment to reach its pace.
        let (n, len) = ((slices / 3).max(1), slice * 3);
        interleave(plan, round, n, "bulk", &mut figs, |to, f| {
            f.bulk.push(load::bulk_exchange(to, len, BULK_CHUNK)?);
            Ok(())
        });
        interleave(plan, round, slices, "setup", &mut figs, |to, f| {
            let (samples, rate) = load::setup(to, slice)?;
            f.setups.extend(samples);
            f.rates.push(rate);
            Ok(())
        });
        let n = plan.paths.len();
        for i in (0..n).map(|k| (round + k) % n) {
            let (name, to) = &plan.paths[i];
            let b = load::burst(to, plan.burst, plan.burst_threads);
            if let Some(e) = &b.first_error {
                say!(
                    "load burst round={} path={name}: {} of {} failed, first: {e}",
                    round + 1,
                    b.total - b.ok,
                    b.total
                );
            }
            figs[i].burst = Some(b);
            // Let the forwarders (and socat's per-connection processes) wind down.
            std::thread::sleep(Duration::from_millis(500));
        }
        for (i, (name, _)) in plan.paths.iter().enumerate() {
            let f = &figs[i];
            ok &= !f.rtt.is_empty()
                && !f.bulk.is_empty()
                && !f.rates.is_empty()
                && f.burst.as_ref().is_some_and(|b| b.ok == b.total);
            say!("{}", f.line(round + 1, name));
        }
    }
    if let Some((perf, window)) = &plan.perf {
        let paths: Vec<(String, String)> = plan
            .paths
            .iter()
            .map(|(name, to)| (name.clone(), to.to_string()))
            .collect();
        super::profile::run(perf, &paths, window.as_millis() as u64);
    }
    if let Some(mut c) = socat {
        // SIGKILL: socat inherited this process's blocked SIGTERM (`block_term`).
        let _ = c.kill();
        let _ = c.wait();
    }
    say!("load finished");
    ok
}
