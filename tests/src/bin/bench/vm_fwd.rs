//! The VM path, side by side: three ways for an app in the same TCG guest to reach the
//! same host service through the same host relay, measured by the same in-guest client.
//!
//! ```text
//! guest-init: probe ─unix /run/bench/echo.sock─▶ guest-init ─┐
//! socat:      probe ─unix /tmp/socat-echo.sock─▶ socat ──────┼─AF_VSOCK 2:6001─▶ vhost-device-vsock
//! vsock:      probe ─────────────────────────────────────────┘   ─<uds>_6001─▶ host-relay ─▶ echo
//! ```
//!
//! - **guest-init's forwarder**: the service guest-init (PID 1) publishes at
//!   `/run/bench/echo.sock`, forwarding to vsock CID 2 port 6001.
//! - **socat as the forwarder**: Debian's socat (it has `VSOCK-CONNECT`), started by the
//!   probe as `UNIX-LISTEN:/tmp/socat-echo.sock,fork,backlog=4096 VSOCK-CONNECT:2:6001`.
//!   socat is dynamically linked, so the image carries it with the shared libraries `ldd`
//!   names and the loader, each at its host path ([`socat_files`]): the real program, not
//!   a rebuild.
//! - **vsock directly**: the probe dials CID 2 port 6001 itself, the floor for any
//!   forwarder in the guest.
//!
//! On the host, one `host-relay` (per-VM socket mode, the echo service with the same
//! `max_upstream` as the host chain) serves port 6001 for all three, in front of the
//! bench's own echo service ([`super::echo`]). The app is `guest-probe load`
//! (`qemu-harness/src/bin/guest-probe/load.rs`), which runs the host bench's workloads
//! (`qemu_harness::load`) against the three paths in turns, 100 ms slices in an order
//! rotated per round, and prints one console line per round and path; this module reads
//! those lines and quotes medians over all rounds of all boots (the burst: the worst
//! round). Under TCG the absolute numbers mean little; the ratios between forwarders in
//! the same guest do, and they carry the targets: guest-init's forwarder at least as good
//! as socat's on every figure, and every connection of the burst echoed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use qemu_harness::{Image, RelaySpec, Vm, VmSpec};
use serde_json::json;
use vm_image::initramfs::{ExtraFile, InitramfsSpec, Source};

use super::chain::{relay_config, Binaries, PORT_BASE};
use super::echo::EchoServer;
use super::report::{fmt_ratio, ratio, Row};
use super::stats::median;
use super::vm::PROBE;
use super::Settings;

const SOCAT: &str = "/usr/bin/socat";
const FORWARDER_PATH: &str = "/run/bench/echo.sock";
const SOCAT_PATH: &str = "/tmp/socat-echo.sock";
/// The probe's names of the three paths, in the table's column order (direct, chain,
/// naive, socat; naive has no VM counterpart).
const PATHS: [Option<&str>; 4] = [Some("vsock"), Some("guest-init"), None, Some("socat")];
/// The column names of the printed table.
pub const COLUMNS: [Option<&str>; 4] = [Some("vsock"), Some("guest-init"), None, Some("socat")];
/// Guest RAM: socat forks a process per connection, a thousand of them in the burst.
const MEMORY_MIB: u32 = 1024;

/// One `guest-probe: load round=.. path=..` line: the path's name and its fields.
#[derive(Debug, Default, Clone, PartialEq)]
struct Line {
    path: String,
    fields: Vec<(String, f64)>,
}

impl Line {
    fn get(&self, key: &str) -> Option<f64> {
        self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }
}

/// Parses a probe line (`... load round=R path=NAME key=value ...`).
fn parse_line(line: &str) -> Option<Line> {
    let rest = line.split("guest-probe: load round=").nth(1)?;
    let mut out = Line::default();
    for word in rest.split_whitespace().skip(1) {
        let (k, v) = word.split_once('=')?;
        if k == "path" {
            out.path = v.to_string();
        } else {
            out.fields.push((k.to_string(), v.parse().ok()?));
        }
    }
    (!out.path.is_empty()).then_some(out)
}

/// socat and what it needs to run in the guest, with the binary at [`SOCAT`].
pub fn socat_files() -> Result<Vec<ExtraFile>, String> {
    let host = which("socat").ok_or("socat is not installed (apt-get install socat)")?;
    host_program(&host, SOCAT)
}

/// A dynamically linked host program and what it needs to run in the guest: the binary
/// at `guest_path`, every shared library `ldd` lists and the loader, each at the path
/// `ldd` printed (the paths the loader searches by default).
pub fn host_program(host: &Path, guest_path: &str) -> Result<Vec<ExtraFile>, String> {
    let out = Command::new("ldd")
        .arg(host)
        .output()
        .map_err(|e| format!("cannot run ldd on {}: {e}", host.display()))?;
    if !out.status.success() {
        return Err(format!("ldd {} failed", host.display()));
    }
    let mut files = vec![ExtraFile {
        guest_path: guest_path.into(),
        source: Source::Host(host.to_path_buf()),
        mode: 0o755,
    }];
    let libs = ldd_paths(&String::from_utf8_lossy(&out.stdout))
        .map_err(|e| format!("{}: {e}", host.display()))?;
    for lib in libs {
        files.push(ExtraFile {
            guest_path: lib.clone(),
            source: Source::Host(lib.into()),
            mode: 0o755,
        });
    }
    Ok(files)
}

/// The file paths in `ldd` output (libraries and the loader; not the vDSO).
fn ldd_paths(out: &str) -> Result<Vec<String>, String> {
    let mut paths = Vec::new();
    for line in out.lines().map(str::trim) {
        if line.contains("not found") {
            return Err(format!("needs a library that is missing: {line}"));
        }
        let path = match line.split_once("=>") {
            Some((_, right)) => right.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            paths.push(p.to_string());
        }
    }
    Ok(paths)
}

pub fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(program))
        .find(|p| p.is_file())
}

/// guest-init's configuration: the vsock modules, the echo service at
/// [`FORWARDER_PATH`], and the probe as the app (profiling each path after its rounds
/// with `profile`).
fn guest_config(s: &Settings, profile: bool) -> serde_json::Value {
    let port = PORT_BASE;
    let mut command: Vec<String> = [PROBE, "load"].map(String::from).to_vec();
    for arg in [
        format!("guest-init={FORWARDER_PATH}"),
        format!("socat={SOCAT_PATH}"),
        format!("vsock=vsock:2:{port}"),
    ] {
        command.extend(["--path".into(), arg]);
    }
    for (k, v) in [
        ("--socat", SOCAT.to_string()),
        ("--socat-listen", SOCAT_PATH.into()),
        ("--socat-to", format!("2:{port}")),
        ("--rounds", s.vm_rounds.to_string()),
        ("--window-ms", s.vm_window_ms.to_string()),
        ("--burst", s.vm_burst.to_string()),
        ("--burst-threads", s.vm_burst_threads.to_string()),
    ] {
        command.extend([k.to_string(), v]);
    }
    if profile {
        command.extend(["--perf".into(), super::vm_profile::GUEST_PERF.into()]);
    }
    command.push("--then-sleep".into());
    super::vm::probe_guest_config(json!(command), "echo", FORWARDER_PATH, port)
}

/// What one boot printed: the probe's lines, its error lines (as notes) and, when
/// profiling, the profile's lines.
type BootOutput = (Vec<Line>, Vec<String>, Vec<String>);

/// Host programs the guest image carries: socat, and `perf` when profiling.
struct Carried {
    socat: Vec<ExtraFile>,
    perf: Option<Vec<ExtraFile>>,
}

/// Boots one VM and waits for the probe to finish.
fn boot(
    bins: &Binaries,
    carried: &Carried,
    echo: &Path,
    s: &Settings,
) -> Result<BootOutput, String> {
    let profile = carried.perf.is_some();
    let mut image = InitramfsSpec::new(&bins.guest_init, guest_config(s, profile));
    image.files.push(ExtraFile {
        guest_path: PROBE.into(),
        source: Source::Host(bins.guest_probe.clone()),
        mode: 0o755,
    });
    image.files.extend(carried.socat.iter().cloned());
    image.files.extend(carried.perf.iter().flatten().cloned());
    let mut spec = VmSpec::new("bench-fwd", Image::Initramfs(Box::new(image)));
    if profile {
        spec.cmdline_extra = super::vm_profile::cmdline();
    }
    spec.memory_mib = MEMORY_MIB;
    spec.relay_bin = Some(bins.host_relay.clone());
    spec.progress = false;
    spec.relays = vec![RelaySpec {
        name: "echo".into(),
        config: relay_config("echo", &spec.vsock_uds(), PORT_BASE, echo),
        wait_for: vec![spec.port_socket(PORT_BASE)],
    }];
    // Per round and path: three figures of one window, and a burst (at most 30 s for its
    // echoes, see `load::burst`, plus its connects). TCG is slow and the machine shared:
    // allow five times that, and two minutes for the boot.
    let per_round = 3 * (3 * s.vm_window_ms + 20_000);
    let mut timeout = Duration::from_millis(120_000 + 5 * per_round * s.vm_rounds as u64);
    if profile {
        timeout += Duration::from_millis(super::vm_profile::EXTRA_TIMEOUT_MS);
    }
    let mut vm = Vm::start(spec).map_err(|e| e.to_string())?;
    vm.wait_for_console("guest-probe: load finished", timeout)
        .map_err(|e| e.to_string())?;
    let console = vm.console();
    let stop = vm.stop().map_err(|e| e.to_string())?;
    if !stop.clean() {
        return Err(format!("the VM did not stop cleanly: {stop:?}"));
    }
    let lines = console.lines().filter_map(parse_line).collect();
    let errors = console
        .lines()
        .filter(|l| l.contains("guest-probe: load error") || l.contains("guest-probe: load burst"))
        .map(|l| format!("VM forwarders: {}", l.trim()))
        .collect();
    Ok((lines, errors, super::vm_profile::lines(&console)))
}

/// The forwarder rows: `s.vm_boots` boots of `s.vm_rounds` rounds each; with
/// `--vm-profile`, the profile lines of every boot go to `profile`.
pub fn figures(
    dir: &Path,
    s: &Settings,
    notes: &mut Vec<String>,
    profile: &mut Vec<String>,
) -> Vec<Row> {
    let mut lines = Vec::new();
    match prepare(dir, s, notes) {
        Err(e) => notes.push(format!("VM forwarders not measured: {e}")),
        Ok((bins, carried, echo)) => {
            for i in 0..s.vm_boots {
                eprintln!("bench: VM forwarders, boot {} of {}", i + 1, s.vm_boots);
                match boot(&bins, &carried, echo.path(), s) {
                    Ok((l, errors, p)) => {
                        lines.extend(l);
                        notes.extend(errors);
                        profile.extend(p);
                    }
                    Err(e) => notes.push(format!("VM forwarders boot {} failed: {e}", i + 1)),
                }
            }
        }
    }
    rows(&lines, s.vm_burst)
}

fn prepare(
    dir: &Path,
    s: &Settings,
    notes: &mut Vec<String>,
) -> Result<(Binaries, Carried, EchoServer), String> {
    let have_socat = which("socat").is_some();
    let bins = super::vm::preflight(&[(have_socat, "socat (apt-get install socat)")])?;
    let socat = socat_files()?;
    // Profiling is an extra: without perf the comparison runs as always.
    let perf = match s.vm_profile.then(super::vm_profile::files) {
        Some(Err(e)) => {
            notes.push(format!("--vm-profile skipped: {e}"));
            None
        }
        Some(Ok(files)) => Some(files),
        None => None,
    };
    let echo = EchoServer::start(&dir.join("vm-echo.sock"))
        .map_err(|e| format!("cannot start the echo service: {e}"))?;
    Ok((bins, Carried { socat, perf }, echo))
}

/// Medians over every round of `key` per path; with `worst`, the smallest value.
fn column(lines: &[Line], key: &str, worst: bool) -> [Option<f64>; 4] {
    PATHS.map(|p| {
        let p = p?;
        let v: Vec<f64> = lines
            .iter()
            .filter(|l| l.path == p)
            .filter_map(|l| l.get(key))
            .collect();
        if worst {
            v.into_iter().reduce(f64::min)
        } else {
            median(&v)
        }
    })
}

fn fwd_ratios([v, g, _, so]: [Option<f64>; 4]) -> String {
    format!(
        "{} {}",
        fmt_ratio("guest-init/socat", ratio(g, so)),
        fmt_ratio("guest-init/vsock", ratio(g, v))
    )
}

fn rows(lines: &[Line], burst: usize) -> Vec<Row> {
    let row = |metric: &str, unit: &'static str, key: &str| {
        let v = column(lines, key, false);
        Row::new("VM", metric, unit, v).ratios(fwd_ratios(v))
    };
    // Lower is better for times, higher for rates.
    let at_least_socat = |r: Row, higher: bool| {
        let pass = match (r.chain, r.socat) {
            (Some(g), Some(so)) => Some(if higher { g >= so } else { g <= so }),
            _ => None,
        };
        let target = if higher {
            "guest-init >= socat"
        } else {
            "guest-init <= socat"
        };
        r.target(target, pass)
    };
    let ok = column(lines, "burst_ok", true);
    vec![
        at_least_socat(
            row("in-guest RTT p50 (64 B ping-pong)", "us", "rtt_p50_us"),
            false,
        ),
        row("in-guest RTT p99 (64 B ping-pong)", "us", "rtt_p99_us"),
        at_least_socat(
            row(
                "in-guest bulk, 256 KiB echoed in turns",
                "MiB/s",
                "bulk_mibs",
            ),
            true,
        ),
        at_least_socat(
            row(
                "in-guest setup rate (connect, echo, close)",
                "conn/s",
                "setup_rate",
            ),
            true,
        ),
        row("in-guest setup time p50", "us", "setup_p50_us"),
        Row::new(
            "VM",
            format!("in-guest burst: succeeded of {burst} (worst round)"),
            "conns",
            ok,
        )
        .target(
            format!("guest-init {burst} of {burst}"),
            ok[1].map(|v| v as usize == burst),
        ),
        row("in-guest burst: total time", "ms", "burst_ms"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_probe_lines() {
        let l = "[ 9.1] guest-probe: load round=2 path=guest-init rtt_p50_us=812.50 \
                 bulk_mibs=31.20 burst_ok=1000.00 burst_total=1000.00";
        let line = parse_line(l).unwrap();
        assert_eq!(line.path, "guest-init");
        assert_eq!(line.get("rtt_p50_us"), Some(812.5));
        assert_eq!(line.get("burst_ok"), Some(1000.0));
        assert_eq!(line.get("setup_rate"), None);
        assert_eq!(parse_line("guest-probe: load round=1 rtt_p50_us=1"), None);
        assert_eq!(
            parse_line("guest-probe: load round=1 path=x rtt=fast"),
            None
        );
        assert_eq!(parse_line("guest-probe: load finished"), None);
    }

    #[test]
    fn rows_take_medians_and_the_worst_burst() {
        let line = |path: &str, rtt: f64, ok: f64| Line {
            path: path.into(),
            fields: vec![("rtt_p50_us".into(), rtt), ("burst_ok".into(), ok)],
        };
        let lines = [
            line("guest-init", 100.0, 1000.0),
            line("guest-init", 300.0, 999.0),
            line("guest-init", 200.0, 1000.0),
            line("socat", 400.0, 1000.0),
        ];
        let r = rows(&lines, 1000);
        assert_eq!(r[0].chain, Some(200.0));
        assert_eq!(r[0].socat, Some(400.0));
        assert_eq!(r[0].pass, Some(true));
        assert!(
            r[0].ratios.contains("guest-init/socat=0.50"),
            "{}",
            r[0].ratios
        );
        assert_eq!(r[0].direct, None);
        let burst = r
            .iter()
            .find(|r| r.metric.contains("burst: succeeded"))
            .unwrap();
        assert_eq!((burst.chain, burst.pass), (Some(999.0), Some(false)));
        // Nothing measured: no verdict, never a pass.
        assert!(rows(&[], 1000).iter().all(|r| r.pass.is_none()));
    }

    #[test]
    fn ldd_output_gives_libraries_and_the_loader() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        assert_eq!(
            ldd_paths(out).unwrap(),
            [
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
        );
        assert!(ldd_paths("\tlibwrap.so.0 => not found\n")
            .unwrap_err()
            .contains("libwrap"));
    }
}
