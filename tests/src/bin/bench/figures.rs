//! Figures 1-5 and 8: the socket workloads on every path, the real sign-in, key + CSR.
//!
//! Figures 1-4 run in interleaved rounds: in each round every figure is measured on every
//! path, and the order of the paths rotates from round to round, so drift in the machine's
//! speed (other tenants, other builds) spreads over all paths instead of biasing one. Each
//! round yields one value per figure and path (for latencies, that round's p50 and p99);
//! the table quotes the median over rounds.
//!
//! A path that cannot be set up (a tool missing, a binary not built) or a workload that
//! fails is recorded as a note and leaves its values `n/a`; the other paths still run.
//! The burst's peak RSS is read from `/proc/<pid>/status` (`VmHWM`, the high-water mark
//! since the process started) once all rounds are done, so it covers the whole run.

use std::path::Path;

use qemu_harness::load;

use super::echo::EchoServer;
use super::paths::{self, Kind, Route};
use super::report::{fmt_ratio, ratio, Row};
use super::stats::{median, percentile};
use super::Settings;

/// Per-path lists of per-round values for one metric.
#[derive(Default)]
struct Series([Vec<f64>; 4]);

impl Series {
    fn push(&mut self, k: Kind, v: f64) {
        self.0[index(k)].push(v);
    }
    fn medians(&self) -> [Option<f64>; 4] {
        [
            median(&self.0[0]),
            median(&self.0[1]),
            median(&self.0[2]),
            median(&self.0[3]),
        ]
    }
}

fn index(k: Kind) -> usize {
    Kind::ALL.iter().position(|x| *x == k).unwrap_or(0)
}

/// Starts the four paths in front of `service`; a path that cannot start is `None` and
/// explained in `notes`.
fn routes(
    dir: &Path,
    service: &Path,
    tag: &str,
    s: &Settings,
    notes: &mut Vec<String>,
) -> [Option<Route>; 4] {
    let direct = s.wants(Kind::Direct).then(|| paths::direct(service));
    let chain = match s
        .wants(Kind::Chain)
        .then(|| super::chain::start(dir, tag, service))
    {
        None => None,
        Some(Ok(r)) => Some(r),
        Some(Err(e)) => {
            notes.push(format!("{tag}: chain path not measured: {e}"));
            None
        }
    };
    let socat = if !s.wants(Kind::Socat) {
        None
    } else if e2e::util::have_program("socat") {
        match paths::socat(dir, service, tag) {
            Ok(r) => Some(r),
            Err(e) => {
                notes.push(format!("{tag}: socat path not measured: {e}"));
                None
            }
        }
    } else {
        notes.push(format!(
            "{tag}: socat path not measured: socat is not installed (apt-get install socat)"
        ));
        None
    };
    let naive = match s
        .wants(Kind::Naive)
        .then(|| paths::naive(dir, service, tag))
    {
        None => None,
        Some(Ok(r)) => Some(r),
        Some(Err(e)) => {
            notes.push(format!("{tag}: naive path not measured: {e}"));
            None
        }
    };
    [direct, chain, naive, socat]
}

/// The order of the paths in round `round`.
fn order(round: usize) -> [usize; 4] {
    [0, 1, 2, 3].map(|i| (round + i) % 4)
}

/// The chain's ratios to the three other paths, as the table prints them.
fn chain_ratios([d, c, n, so]: [Option<f64>; 4]) -> String {
    format!(
        "{} {} {}",
        fmt_ratio("chain/direct", ratio(c, d)),
        fmt_ratio("chain/naive", ratio(c, n)),
        fmt_ratio("chain/socat", ratio(c, so))
    )
}

fn note_once(notes: &mut Vec<String>, msg: String) {
    if !notes.contains(&msg) {
        notes.push(msg);
    }
}

/// How many slices one window of figures 1-3 is cut into (about 100 ms each).
fn slices(s: &Settings) -> usize {
    (s.window_ms / 100).max(1) as usize
}

/// Runs `each` on every path, `slices` times over, the paths taking turns slice by slice
/// (in the round's order). On this shared machine other people's builds come and go
/// within seconds; taking turns every 100 ms puts every path through the same load, so
/// the ratios between paths stay meaningful when the absolute numbers do not. A path
/// whose workload fails is noted once and sits out the rest of the figure.
fn interleave(
    routes: &[Option<Route>; 4],
    round: usize,
    slices: usize,
    notes: &mut Vec<String>,
    fig: &str,
    mut each: impl FnMut(&Route, usize) -> std::io::Result<()>,
) {
    let mut failed = [false; 4];
    for _ in 0..slices {
        for i in order(round) {
            let Some(r) = &routes[i] else { continue };
            if failed[i] {
                continue;
            }
            if let Err(e) = each(r, i) {
                failed[i] = true;
                note_once(notes, format!("figure {fig} on {}: {e}", r.kind.name()));
            }
        }
    }
}

/// Figures 1-4.
pub fn sockets(dir: &Path, s: &Settings, notes: &mut Vec<String>) -> anyhow::Result<Vec<Row>> {
    let echo = EchoServer::start(&dir.join("echo.sock"))?;
    let routes = routes(dir, echo.path(), "echo", s, notes);
    let (mut rtt50, mut rtt99, mut bulk) =
        (Series::default(), Series::default(), Series::default());
    let (mut cps, mut set50, mut set99) = (Series::default(), Series::default(), Series::default());
    let (mut burst_ok, mut burst_ms) = (Series::default(), Series::default());
    let burst_rounds = s.rounds.min(3);
    for round in 0..s.rounds {
        eprintln!("bench: figures 1-4, round {} of {}", round + 1, s.rounds);
        let slices = slices(s);
        let slice = s.window() / slices as u32;
        if s.wants_figure("1") {
            let mut v: [Vec<f64>; 4] = Default::default();
            interleave(&routes, round, slices, notes, "1", |r, i| {
                v[i].extend(load::rtt(&r.target(), slice)?);
                Ok(())
            });
            for (i, v) in v.iter().enumerate().filter(|(_, v)| !v.is_empty()) {
                rtt50.push(Kind::ALL[i], percentile(v, 50.0).unwrap_or(f64::NAN));
                rtt99.push(Kind::ALL[i], percentile(v, 99.0).unwrap_or(f64::NAN));
            }
        }
        if s.wants_figure("2") {
            // Longer slices: a bulk connection needs a moment to reach its pace.
            let (n, len) = ((slices / 3).max(1), slice * 3);
            let mut v: [Vec<f64>; 4] = Default::default();
            interleave(&routes, round, n, notes, "2", |r, i| {
                v[i].push(load::bulk(&r.target(), len)?);
                Ok(())
            });
            for (i, v) in v.iter().enumerate().filter(|(_, v)| !v.is_empty()) {
                // Slices of equal length: the mean rate is the rate over all of them.
                bulk.push(Kind::ALL[i], v.iter().sum::<f64>() / v.len() as f64);
            }
        }
        if s.wants_figure("3") {
            let mut v: [(Vec<f64>, Vec<f64>); 4] = Default::default();
            interleave(&routes, round, slices, notes, "3", |r, i| {
                let (samples, rate) = load::setup(&r.target(), slice)?;
                v[i].0.extend(samples);
                v[i].1.push(rate);
                Ok(())
            });
            for (i, (t, rates)) in v.iter().enumerate().filter(|(_, v)| !v.1.is_empty()) {
                let k = Kind::ALL[i];
                cps.push(k, rates.iter().sum::<f64>() / rates.len() as f64);
                set50.push(k, percentile(t, 50.0).unwrap_or(f64::NAN));
                set99.push(k, percentile(t, 99.0).unwrap_or(f64::NAN));
            }
        }
        if round < burst_rounds && s.wants_figure("4") {
            for i in order(round) {
                let Some(r) = &routes[i] else { continue };
                let b = load::burst(&r.target(), s.burst, s.burst_threads);
                burst_ok.push(r.kind, b.ok as f64);
                if b.ok < b.total {
                    notes.push(format!(
                        "figure 4 round {}: {} of {} connections failed on {}",
                        round + 1,
                        b.total - b.ok,
                        b.total,
                        r.kind.name()
                    ));
                }
                burst_ms.push(r.kind, b.millis);
                // Let the relays (and socat's per-connection processes) wind down so the
                // next measurement starts from a quiet machine.
                std::thread::sleep(std::time::Duration::from_millis(300));
            }
        }
    }
    let hwm_mib = |k: Kind, pid: fn(&Route) -> Option<u32>| {
        routes[index(k)]
            .as_ref()
            .and_then(pid)
            .and_then(|p| paths::status_kib(p, "VmHWM"))
            .map(|k| k as f64 / 1024.0)
    };
    let relay = |r: &Route| r.relay_pid;
    let fwd = |r: &Route| r.forwarder_pid;
    let relay_hwm =
        [Kind::Direct, Kind::Chain, Kind::Naive, Kind::Socat].map(|k| hwm_mib(k, relay));
    let fwd_hwm = [Kind::Direct, Kind::Chain, Kind::Naive, Kind::Socat].map(|k| hwm_mib(k, fwd));

    let v = rtt50.medians();
    let [_, c, n, so] = v;
    let mut rows = vec![Row::new("1", "RTT p50 (64 B ping-pong)", "us", v)
        .ratios(chain_ratios(v))
        .target(
            "chain <= naive and <= 0.7x socat",
            both(
                ratio(c, n).map(|r| r <= 1.0),
                ratio(c, so).map(|r| r <= 0.7),
            ),
        )];
    let v = rtt99.medians();
    rows.push(Row::new("1", "RTT p99 (64 B ping-pong)", "us", v).ratios(chain_ratios(v)));
    let v = bulk.medians();
    let [d, c, n, _] = v;
    rows.push(
        Row::new("2", "bulk, 1 MiB writes, echoed", "MiB/s", v)
            .ratios(chain_ratios(v))
            .target(
                "chain >= 0.5x direct and >= 2x naive",
                both(ratio(c, d).map(|r| r >= 0.5), ratio(c, n).map(|r| r >= 2.0)),
            ),
    );
    let v = cps.medians();
    let [_, c, n, so] = v;
    rows.push(
        Row::new("3", "setup rate (connect, echo, close)", "conn/s", v)
            .ratios(chain_ratios(v))
            .target(
                "chain >= 1.2x naive and >= 6x socat",
                both(
                    ratio(c, n).map(|r| r >= 1.2),
                    ratio(c, so).map(|r| r >= 6.0),
                ),
            ),
    );
    let v = set50.medians();
    rows.push(Row::new("3", "setup time p50", "us", v).ratios(chain_ratios(v)));
    let v = set99.medians();
    rows.push(Row::new("3", "setup time p99", "us", v).ratios(chain_ratios(v)));
    // The worst round counts for success: "all must succeed" means in every burst.
    let worst = |k: Kind| burst_ok.0[index(k)].iter().copied().reduce(f64::min);
    let ok = Kind::ALL.map(worst);
    rows.push(
        Row::new(
            "4",
            format!("burst: succeeded of {} (worst round)", s.burst),
            "conns",
            ok,
        )
        .target(
            format!("chain {0} of {0}", s.burst),
            ok[index(Kind::Chain)].map(|v| v as usize == s.burst),
        ),
    );
    rows.push(Row::new("4", "burst: total time", "ms", burst_ms.medians()));
    let c = relay_hwm[index(Kind::Chain)];
    rows.push(
        Row::new(
            "4",
            "peak RSS, host-relay (others: 2nd hop)",
            "MiB",
            relay_hwm,
        )
        .target("chain <= 48 MiB", c.map(|v| v <= 48.0)),
    );
    rows.push(Row::new(
        "4",
        "peak RSS, forwarder (others: 1st hop)",
        "MiB",
        fwd_hwm,
    ));
    if routes[index(Kind::Socat)].is_some() {
        notes.push(
            "figure 4: socat forks one process per connection and hop; its RSS column is \
             the listening parent only, not the thousands of children"
                .into(),
        );
    }
    Ok(rows)
}

fn both(a: Option<bool>, b: Option<bool>) -> Option<bool> {
    Some(a? && b?)
}

/// Figure 5: sign-ins against a real Dovecot, on each path, interleaved.
pub fn sign_in(dir: &Path, s: &Settings, notes: &mut Vec<String>) -> Vec<Row> {
    let empty = |notes: &mut Vec<String>, why: String| {
        notes.push(format!("figure 5 not measured: {why}"));
        vec![
            Row::new("5", "sign-in p50 (Dovecot AUTH)", "ms", [None; 4])
                .target("chain <= 1.2x direct", None),
            Row::new("5", "sign-in p99 (Dovecot AUTH)", "ms", [None; 4]),
        ]
    };
    if !e2e::dovecot::Dovecot::available() {
        return empty(
            notes,
            "Dovecot is not installed (apt-get install dovecot-core)".into(),
        );
    }
    let dovecot = match e2e::dovecot::Dovecot::start(&e2e::dovecot::DovecotOptions::default()) {
        Ok(d) => d,
        Err(e) => return empty(notes, format!("Dovecot did not start: {e}")),
    };
    let routes = routes(dir, &dovecot.auth_client(), "auth", s, notes);
    let (mut p50, mut p99) = (Series::default(), Series::default());
    for round in 0..s.rounds {
        eprintln!("bench: figure 5, round {} of {}", round + 1, s.rounds);
        for i in order(round) {
            let Some(r) = &routes[i] else { continue };
            match super::dovecot::sign_ins(&r.entry, s.sign_ins) {
                Ok(v) => {
                    p50.push(r.kind, percentile(&v, 50.0).unwrap_or(f64::NAN));
                    p99.push(r.kind, percentile(&v, 99.0).unwrap_or(f64::NAN));
                }
                Err(e) => note_once(notes, format!("figure 5 on {}: {e}", r.kind.name())),
            }
        }
    }
    drop(routes);
    drop(dovecot);
    let v = p50.medians();
    let [d, c, _, _] = v;
    let mut rows = vec![Row::new("5", "sign-in p50 (Dovecot AUTH)", "ms", v)
        .ratios(chain_ratios(v))
        .target("chain <= 1.2x direct", ratio(c, d).map(|r| r <= 1.2))];
    let v = p99.medians();
    rows.push(Row::new("5", "sign-in p99 (Dovecot AUTH)", "ms", v).ratios(chain_ratios(v)));
    rows
}

/// Figure 8: key generation plus CSR.
pub fn keygen(s: &Settings, notes: &mut Vec<String>) -> Vec<Row> {
    let v = match super::keygen::keygen_csr(s.keygens) {
        Ok(v) => median(&v),
        Err(e) => {
            notes.push(format!("figure 8 not measured: {e}"));
            None
        }
    };
    vec![Row::new(
        "8",
        format!("P-256 keygen + CSR, median of {}", s.keygens),
        "ms",
        [None, v, None, None],
    )
    .target("<= 5 ms", v.map(|v| v <= 5.0))]
}
