//! `bench`: measures this project's forwarding path against a direct Unix socket and
//! against a socat chain, in one run, and prints the table the benchmark issue asks for.
//!
//! ```text
//! cargo run --release -p e2e-tests --bin bench -- --json bench-results.json [--quick]
//! ```
//!
//! Design:
//! - **Same service, same client, four paths.** Every path ends at one in-process echo
//!   service ([`echo`]) and is driven by the same client code
//!   (`qemu_harness::load`, which the in-guest probe runs too); only the hops differ
//!   ([`paths`], [`chain`]).
//! - **Interleaved rounds, medians.** These machines are noisy. Each round measures every
//!   figure on every path, in an order rotated per round, and the table quotes the median
//!   of the rounds ([`stats`]), so a slow moment hurts one sample of each path rather than
//!   one whole path.
//! - **Numbers never fail.** A benchmark is not a test: a missed target is reported as
//!   `MISS`, and the process exits 0. It exits non-zero only when it could not run at all
//!   (bad arguments, no temporary directory, the JSON file cannot be written).
//! - **Real parts.** The chain runs the real `guest-init` and `host-relay` binaries; the
//!   sign-in figure runs a real Dovecot. A part that is missing makes its values `n/a`
//!   with a note saying what is missing, never a made-up number.
//!
//! Figures 1-5 are in [`figures`], 6-7 ([`guest`]) start the static musl `guest-init`
//! itself, figure 8 ([`keygen`]) times key generation and CSR creation; [`vm`] boots
//! micro-VMs for the VM path under TCG, reported as a separate, informative table;
//! [`report`] renders the tables and the JSON.

mod chain;
mod dovecot;
mod echo;
mod figures;
mod guest;
mod keygen;
mod naive;
mod paths;
mod report;
mod stats;
mod vm;
mod vm_fwd;
mod vm_profile;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};

/// How much to measure.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Settings {
    /// Interleaved rounds per figure.
    pub rounds: usize,
    /// Duration of one timed workload (figures 1-3), in milliseconds.
    pub window_ms: u64,
    /// Connections in one burst (figure 4).
    pub burst: usize,
    /// Client threads opening the burst.
    pub burst_threads: usize,
    /// Sign-ins per path per round (figure 5).
    pub sign_ins: usize,
    /// Start-to-ready repetitions (figure 7).
    pub starts: usize,
    /// Key + CSR repetitions (figure 8).
    pub keygens: usize,
    /// VM boots for the VM path under TCG (0: not measured).
    pub vm_boots: usize,
    /// In-guest sign-ins per VM boot.
    pub vm_sign_ins: usize,
    /// Rounds of the VM forwarder comparison per boot.
    pub vm_rounds: usize,
    /// One figure's window per round in the VM forwarder comparison, in milliseconds.
    pub vm_window_ms: u64,
    /// Connections in one in-guest burst.
    pub vm_burst: usize,
    /// Guest threads opening the in-guest burst.
    pub vm_burst_threads: usize,
    /// Profile each forwarder's round trip inside the guest with `perf` (`--vm-profile`).
    pub vm_profile: bool,
    /// The paths to measure (`--paths`); all by default.
    pub paths: Vec<String>,
    /// The figures to measure (`--figures`, "1" to "8"); all by default.
    pub figures: Vec<String>,
}

impl Settings {
    fn full() -> Self {
        Settings {
            rounds: 5,
            window_ms: 1500,
            burst: 5000,
            burst_threads: 16,
            sign_ins: 200,
            starts: 20,
            keygens: 100,
            vm_boots: 3,
            vm_sign_ins: 200,
            vm_rounds: 3,
            vm_window_ms: 1500,
            vm_burst: 1000,
            vm_burst_threads: 8,
            vm_profile: false,
            paths: all_paths(),
            figures: all_figures(),
        }
    }

    fn quick() -> Self {
        Settings {
            rounds: 3,
            window_ms: 400,
            burst: 5000,
            burst_threads: 16,
            sign_ins: 50,
            starts: 5,
            keygens: 20,
            vm_boots: 1,
            vm_sign_ins: 50,
            vm_rounds: 2,
            vm_window_ms: 600,
            vm_burst: 1000,
            vm_burst_threads: 8,
            vm_profile: false,
            paths: all_paths(),
            figures: all_figures(),
        }
    }

    /// What CI runs to keep the command working: every code path, tiny amounts.
    fn smoke() -> Self {
        Settings {
            rounds: 1,
            window_ms: 40,
            burst: 50,
            burst_threads: 4,
            sign_ins: 3,
            starts: 2,
            keygens: 3,
            vm_boots: 1,
            vm_sign_ins: 3,
            // Short windows, but the full burst: 1,000 of 1,000 is what CI keeps true.
            vm_rounds: 1,
            vm_window_ms: 200,
            vm_burst: 1000,
            vm_burst_threads: 8,
            vm_profile: false,
            paths: all_paths(),
            figures: all_figures(),
        }
    }

    /// Whether a path is selected.
    pub fn wants(&self, kind: paths::Kind) -> bool {
        self.paths.iter().any(|p| p == kind.name())
    }

    /// Whether a figure is selected.
    pub fn wants_figure(&self, fig: &str) -> bool {
        self.figures.iter().any(|f| f == fig)
    }

    /// The duration of one timed workload.
    pub fn window(&self) -> Duration {
        Duration::from_millis(self.window_ms)
    }
}

fn all_figures() -> Vec<String> {
    (1..=8).map(|f| f.to_string()).collect()
}

fn all_paths() -> Vec<String> {
    paths::Kind::ALL
        .iter()
        .map(|k| k.name().to_string())
        .collect()
}

const USAGE: &str =
    "usage: bench [--json FILE] [--quick | --smoke] [--rounds N] [--burst N] [--paths LIST]
  --json FILE   also write the table as JSON to FILE
  --quick       fewer and shorter rounds (about a minute)
  --smoke       a tiny run that exercises every figure (CI)
  --rounds N    interleaved rounds per figure (default 5)
  --burst N     connections in the burst of figure 4 (default 5000)
  --paths LIST  comma-separated subset of direct,chain,naive,socat (e.g. to profile one)
  --figures LIST  comma-separated subset of 1-8 (e.g. 3 to profile connection setup)
  --vm-boots N  VM boots for the VM path under TCG (default 3; 0 skips it)
  --vm          the VM path only (in-guest sign-ins and the forwarder comparison)
  --vm-profile  also profile each forwarder's round trip in the guest with the host's perf";

fn parse_args() -> anyhow::Result<(Settings, Option<PathBuf>)> {
    let mut args = std::env::args().skip(1);
    let mut settings = Settings::full();
    let mut json = None;
    let (mut rounds, mut burst, mut only, mut vm_boots) = (None, None, None, None);
    let mut figures = None;
    let mut vm_only = false;
    let mut vm_profile = false;
    while let Some(a) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .with_context(|| format!("{name} needs a value\n{USAGE}"))
        };
        match a.as_str() {
            "--json" => json = Some(PathBuf::from(value("--json")?)),
            "--quick" => settings = Settings::quick(),
            "--vm" => vm_only = true,
            "--vm-profile" => vm_profile = true,
            "--smoke" => settings = Settings::smoke(),
            "--rounds" => {
                let v = value("--rounds")?;
                rounds = Some(positive("--rounds", &v)?);
            }
            "--burst" => {
                let v = value("--burst")?;
                burst = Some(positive("--burst", &v)?);
            }
            "--vm-boots" => {
                let v = value("--vm-boots")?;
                vm_boots = Some(v.parse::<usize>().map_err(|_| {
                    anyhow::anyhow!(
                        "--vm-boots {v:?}: expected a whole number (0 skips the VM path)"
                    )
                })?);
            }
            "--paths" => {
                let v = value("--paths")?;
                let list: Vec<String> = v.split(',').map(str::to_string).collect();
                for p in &list {
                    if !all_paths().contains(p) {
                        bail!("--paths: unknown path {p:?}; choose from direct,chain,naive,socat");
                    }
                }
                only = Some(list);
            }
            "--figures" => {
                let v = value("--figures")?;
                let list: Vec<String> = v.split(',').map(str::to_string).collect();
                for f in &list {
                    if !all_figures().contains(f) {
                        bail!("--figures: unknown figure {f:?}; choose from 1,2,3,4,5,6,7,8");
                    }
                }
                figures = Some(list);
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if let Some(r) = rounds {
        settings.rounds = r;
    }
    if let Some(b) = burst {
        settings.burst = b;
    }
    if let Some(p) = only {
        settings.paths = p;
    }
    if let Some(f) = figures {
        settings.figures = f;
    }
    if let Some(b) = vm_boots {
        settings.vm_boots = b;
    }
    settings.vm_profile = vm_profile;
    if vm_profile && settings.vm_boots == 0 {
        bail!("--vm-profile profiles the VM forwarders: it does not go with --vm-boots 0");
    }
    if vm_only {
        if settings.figures != all_figures() || settings.vm_boots == 0 {
            bail!("--vm measures the VM path only: it takes neither --figures nor --vm-boots 0");
        }
        settings.figures = Vec::new();
    }
    Ok((settings, json))
}

fn positive(name: &str, v: &str) -> anyhow::Result<usize> {
    match v.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => bail!("{name} {v:?}: expected a whole number of at least 1"),
    }
}

/// Raises this process's descriptor limit to the hard limit; children inherit it.
fn raise_nofile() -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((_, hard)) => {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
            hard
        }
        Err(_) => 0,
    }
}

fn machine() -> serde_json::Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default();
    let kernel = nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default();
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    serde_json::json!({ "nproc": nproc, "cpu": cpu, "kernel": kernel })
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(naive::SUBCOMMAND) {
        let [_, listen, target] = &args[..] else {
            bail!("usage: bench {} LISTEN_PATH TARGET_PATH", naive::SUBCOMMAND);
        };
        return naive::run(listen.as_ref(), target.into());
    }
    let (settings, json) = parse_args()?;
    let nofile = raise_nofile();
    let machine = machine();
    eprintln!("bench: machine {machine}, RLIMIT_NOFILE {nofile}, settings {settings:?}");
    let dir = tempfile::Builder::new()
        .prefix("bench-")
        .tempdir()
        .context("cannot create a temporary directory")?;
    let mut notes = Vec::new();
    let wants = |figs: &[&str]| figs.iter().any(|f| settings.wants_figure(f));
    let mut rows = Vec::new();
    if wants(&["1", "2", "3", "4"]) {
        rows.extend(figures::sockets(dir.path(), &settings, &mut notes)?);
    }
    if wants(&["5"]) {
        rows.extend(figures::sign_in(dir.path(), &settings, &mut notes));
    }
    if wants(&["6", "7"]) {
        rows.extend(guest::figures(dir.path(), &settings, &mut notes));
    }
    if wants(&["8"]) {
        rows.extend(figures::keygen(&settings, &mut notes));
    }
    let mut profile = Vec::new();
    let (vm_rows, fwd_rows) = if settings.vm_boots > 0 {
        (
            vm::figures(&settings, &mut notes),
            vm_fwd::figures(dir.path(), &settings, &mut notes, &mut profile),
        )
    } else {
        (Vec::new(), Vec::new())
    };

    println!("{}", report::render(&rows));
    if !vm_rows.is_empty() {
        println!("VM path under QEMU/TCG (informative only: TCG speed says little about KVM)\n");
        println!("{}", report::render(&vm_rows));
    }
    if !fwd_rows.is_empty() {
        println!(
            "VM forwarders under QEMU/TCG, in the same guest through the same host relay \
             (ratios between forwarders are the figures; absolute values are TCG's)\n"
        );
        println!("{}", report::render_with(&fwd_rows, vm_fwd::COLUMNS));
    }
    if !profile.is_empty() {
        println!("VM forwarders: in-guest profile of each path's 64 B round trip (--vm-profile)\n");
        for l in &profile {
            println!("{l}");
        }
        println!();
    }
    for n in &notes {
        println!("note: {n}");
    }
    if let Some(path) = json {
        let doc = serde_json::json!({
            "machine": machine,
            "settings": settings,
            "rlimit_nofile": nofile,
            "rows": rows,
            "vm_rows": vm_rows,
            "vm_forwarder_rows": fwd_rows,
            "vm_forwarder_profile": profile,
            "notes": notes,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("cannot write --json file {}", path.display()))?;
        eprintln!("bench: wrote {}", path.display());
    }
    Ok(())
}
