//! `guest-probe load ... --perf BIN`: a profile of each path's 64-byte round trip, taken
//! inside the guest with the host's own `perf` carried into the image (`bench --vm-profile`).
//!
//! Per path, three runs of the same workload, `guest-probe rtt TARGET MS` (the load's
//! [`load::rtt`], which prints how many round trips it made), each under one `perf`:
//!
//! 1. `perf stat -a -e cpu-clock,context-switches,raw_syscalls:sys_enter`: the whole
//!    guest's CPU time, context switches and system calls, divided by the round trips;
//! 2. `perf trace -s --errno-summary -a`: system calls per process and per call, with the
//!    errors (`EAGAIN`) counted by kind, divided by the round trips;
//! 3. `perf record -e cpu-clock -a -g` (the software clock: TCG has no PMU), then
//!    `perf report --no-children` sorted by comm and dso (the kernel/user split per
//!    process) and by comm, dso and symbol (the top entries), and `--children` for the
//!    kernel's entry points (each system call with everything below it, scheduling,
//!    interrupts, work items) per process.
//!
//! Three runs rather than one because `perf trace` intercepts every system call and would
//! swamp the time profile. Everything is printed as `guest-probe: profile path=NAME KIND|
//! TEXT` lines; the host collects them (`tests/src/bin/bench/vm_profile.rs`).
//!
//! Needs, from the guest's boot: `kernel.perf_event_paranoid=-1` (system-wide events and
//! tracepoints for an unprivileged app) and tracefs mounted where the app can read the
//! syscall tracepoints' ids and formats ([`pre_init`]). Any step that fails prints an
//! `error` line and the next one runs; profiling never fails the load.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use qemu_harness::load::{self, Target};

use super::say;

/// Where the pre-init mounts tracefs (one of the mount points `perf` looks at).
const TRACEFS: &str = "/tracing";
/// The environment variable (a kernel command-line `NAME=VALUE` reaches init's
/// environment) naming the group that may read tracefs.
pub const TRACEFS_GID_ENV: &str = "GUEST_PROBE_TRACEFS_GID";
/// One `perf report` of the time profile.
struct Report {
    /// The line prefix.
    kind: &'static str,
    /// Time in a function's callees counts for it too (`--children`).
    children: bool,
    sort: &'static str,
    /// Keep only entries naming one of these (all when empty)...
    only: &'static [&'static str],
    /// ... and at most this many.
    keep: usize,
}

/// Self time per process and dso (the kernel/user split), the top symbols by self time,
/// and the kernel's entry points with everything below them: time per system call,
/// scheduling, interrupts and work items.
const REPORTS: [Report; 3] = [
    Report {
        kind: "dso",
        children: false,
        sort: "comm,dso",
        only: &[],
        keep: 20,
    },
    Report {
        kind: "sym",
        children: false,
        sort: "comm,dso,sym",
        only: &[],
        keep: 40,
    },
    Report {
        kind: "entry",
        children: true,
        sort: "comm,sym",
        only: &[
            "[k] __x64_sys_",
            "[k] do_syscall_64",
            "[k] schedule",
            "[k] asm_sysvec_",
            "[k] asm_common_interrupt",
            "[k] process_one_work",
            "[k] exit_to_user_mode_prepare",
        ],
        keep: 40,
    },
];

/// As PID 1 (`rdinit=/bin/guest-probe`): mounts tracefs at [`TRACEFS`] for the group in
/// [`TRACEFS_GID_ENV`], then becomes `/init` (guest-init, still PID 1). guest-init drops
/// every capability from its app, so the app cannot mount it itself.
pub fn pre_init() -> ! {
    let gid = std::env::var(TRACEFS_GID_ENV).unwrap_or_else(|_| "0".into());
    let _ = std::fs::create_dir(TRACEFS);
    let opts = format!("gid={gid},mode=0755");
    let c = |s: &str| std::ffi::CString::new(s).expect("no NUL in a constant");
    let (src, dir, data) = (c("tracefs"), c(TRACEFS), c(&opts));
    // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            dir.as_ptr(),
            src.as_ptr(),
            0,
            data.as_ptr().cast(),
        )
    };
    if rc == 0 {
        say!("profile pre-init: tracefs at {TRACEFS} ({opts})");
    } else {
        let e = std::io::Error::last_os_error();
        say!("profile pre-init: error: cannot mount tracefs: {e}");
    }
    let init = c("/init");
    let argv = [init.as_ptr(), std::ptr::null()];
    // SAFETY: execv(3) with a NUL-terminated path and a NULL-terminated argv of
    // NUL-terminated strings, all alive across the call; it returns only on failure.
    unsafe { libc::execv(init.as_ptr(), argv.as_ptr()) };
    // Nothing else can be PID 1 here: say why and let the kernel panic on our exit.
    let e = std::io::Error::last_os_error();
    say!("profile pre-init: error: cannot exec /init: {e}");
    std::process::exit(1)
}

/// `guest-probe rtt TARGET MS`: round trips on `TARGET` for `MS` milliseconds; prints
/// `rtt n=N` (the warm-up echoes included: everything the profile saw).
pub fn rtt_once(target: &str, ms: u64) -> bool {
    let Some(to) = Target::parse(target) else {
        say!("rtt error: {target:?} is not a target");
        return false;
    };
    match load::rtt(&to, Duration::from_millis(ms)) {
        Ok(samples) => {
            let p50 = load::percentile(&samples, 50.0).unwrap_or(f64::NAN);
            say!("rtt n={} p50_us={p50:.1}", samples.len() + load::RTT_WARMUP);
            true
        }
        Err(e) => {
            say!("rtt error: {e}");
            false
        }
    }
}

/// Profiles every path's round trip, one after the other.
pub fn run(perf: &str, paths: &[(String, String)], ms: u64) {
    let exe =
        std::env::current_exe().map_or("/bin/guest-probe".into(), |p| p.display().to_string());
    for (name, target) in paths {
        let p = Profiler {
            perf,
            exe: &exe,
            name,
            target,
            ms,
        };
        p.stat();
        p.trace();
        p.record();
    }
    say!("profile finished");
}

struct Profiler<'a> {
    perf: &'a str,
    exe: &'a str,
    name: &'a str,
    target: &'a str,
    ms: u64,
}

impl Profiler<'_> {
    fn out(&self, kind: &str, text: &str) {
        say!("profile path={} {kind}| {text}", self.name);
    }

    /// Runs `perf ARGS -- guest-probe rtt TARGET MS`; returns the round trips made.
    fn under_perf(&self, what: &str, args: &[&str]) -> Option<u64> {
        let ms = self.ms.to_string();
        let out = self.perf(
            args.iter()
                .copied()
                .chain(["--", self.exe, "rtt", self.target, &ms]),
        );
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                self.out("error", &format!("{what}: {e}"));
                return None;
            }
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let n = stdout.lines().find_map(|l| {
            l.split("rtt n=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        });
        if !out.status.success() || n.is_none() {
            self.out(
                "error",
                &format!(
                    "{what}: {} {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            );
            return None;
        }
        if let Some(l) = stdout.lines().find(|l| l.contains("rtt n=")) {
            self.out(what, l.trim_start_matches("guest-probe: "));
        }
        n
    }

    fn perf<'s>(&self, args: impl IntoIterator<Item = &'s str>) -> std::io::Result<Output> {
        Command::new(self.perf)
            .args(args)
            // perf keeps per-user state under $HOME; the app's environment has none.
            .env("HOME", "/tmp")
            .output()
    }

    /// The whole guest's CPU time, context switches and system calls per round trip.
    fn stat(&self) {
        let file = format!("/tmp/perf-stat-{}.csv", self.name);
        let events = "cpu-clock,context-switches,raw_syscalls:sys_enter";
        let Some(n) = self.under_perf(
            "stat",
            &["stat", "-a", "-x", ",", "-e", events, "-o", &file],
        ) else {
            return;
        };
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for (event, value, unit) in parse_stat(&text) {
            let per = value / n as f64;
            let per = if unit == "msec" {
                format!("{:.1} us", per * 1000.0)
            } else {
                format!("{per:.2}")
            };
            self.out(
                "stat",
                &format!("{event} total={value:.0}{unit} per_rtt={per}"),
            );
        }
    }

    /// System calls per process and call (`perf trace -s`), per round trip.
    fn trace(&self) {
        let file = format!("/tmp/perf-trace-{}.txt", self.name);
        let Some(n) = self.under_perf(
            "trace",
            &["trace", "-s", "--errno-summary", "-a", "-o", &file],
        ) else {
            return;
        };
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for s in parse_trace_summary(&text) {
            self.out(
                "syscalls",
                &format!(
                    "comm={} syscall={} calls={} errors={} per_rtt={:.2} errors_per_rtt={:.2} \
                     avg_us={:.1} {}",
                    s.comm,
                    s.syscall,
                    s.calls,
                    s.errors,
                    s.calls as f64 / n as f64,
                    s.errors as f64 / n as f64,
                    s.total_ms * 1000.0 / s.calls.max(1) as f64,
                    s.errnos
                ),
            );
        }
    }

    /// A time profile: where the CPU went, per process and dso, and the top symbols.
    fn record(&self) {
        let file = format!("/tmp/perf-{}.data", self.name);
        let args = [
            "record",
            "-e",
            "cpu-clock",
            "-F",
            "999",
            "-a",
            "-g",
            "-N",
            "-o",
            &file,
        ];
        if self.under_perf("record", &args).is_none() {
            return;
        }
        for r in REPORTS {
            let cumulate = if r.children {
                "--children"
            } else {
                "--no-children"
            };
            let args = [
                "report", "-i", &file, "--stdio", cumulate, "-g", "none", "--sort", r.sort,
            ];
            match self.perf(args) {
                Ok(out) if out.status.success() => {
                    let text = String::from_utf8_lossy(&out.stdout);
                    for l in report_lines(&text, r.only).take(r.keep) {
                        self.out(r.kind, l);
                    }
                }
                Ok(out) => self.out(
                    "error",
                    &format!(
                        "report {}: {}",
                        r.sort,
                        String::from_utf8_lossy(&out.stderr).trim()
                    ),
                ),
                Err(e) => self.out("error", &format!("report {}: {e}", r.sort)),
            }
        }
        let _ = std::fs::remove_file(Path::new(&file));
    }
}

/// `perf stat -x ,` lines: (event, value, unit); comments and unsupported counters skipped.
fn parse_stat(text: &str) -> Vec<(String, f64, String)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let value = f.first()?.parse().ok()?;
            Some((f.get(2)?.to_string(), value, f.get(1)?.to_string()))
        })
        .collect()
}

/// One row of a `perf trace -s` summary.
#[derive(Debug, PartialEq)]
struct SyscallCount {
    comm: String,
    syscall: String,
    calls: u64,
    errors: u64,
    /// Time in the call, all calls together, in milliseconds (inflated by the tracing).
    total_ms: f64,
    /// `ERRNO:count` per error kind (`--errno-summary`), space-separated.
    errnos: String,
}

/// Reads `perf trace -s` output: a ` comm (pid), N events, P%` header per thread, then
/// rows `syscall calls errors total min avg max stddev`.
fn parse_trace_summary(text: &str) -> Vec<SyscallCount> {
    let mut comm = String::new();
    let mut out: Vec<SyscallCount> = Vec::new();
    for l in text.lines() {
        if l.contains(" events, ") {
            comm = l.trim().split(" (").next().unwrap_or("").to_string();
            continue;
        }
        let w: Vec<&str> = l.split_whitespace().collect();
        if let (&[errno, count], Some(last)) = (&w[..], out.last_mut()) {
            if let (Some(errno), Ok(count)) = (errno.strip_suffix(':'), count.parse::<u64>()) {
                let sep = if last.errnos.is_empty() { "" } else { " " };
                last.errnos.push_str(&format!("{sep}{errno}:{count}"));
                continue;
            }
        }
        if let [syscall, calls, errors, total, ..] = w[..] {
            if let (Ok(calls), Ok(errors), Ok(total_ms)) =
                (calls.parse(), errors.parse(), total.parse())
            {
                out.push(SyscallCount {
                    comm: comm.clone(),
                    syscall: syscall.to_string(),
                    calls,
                    errors,
                    total_ms,
                    errnos: String::new(),
                });
            }
        }
    }
    out
}

/// The entries of a `perf report --stdio` (no comments, no blank lines), only those
/// naming one of `only` when it is not empty.
fn report_lines<'t>(text: &'t str, only: &'t [&str]) -> impl Iterator<Item = &'t str> {
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .filter(|l| only.is_empty() || only.iter().any(|o| l.contains(o)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_perf_stat_csv() {
        let text =
            "# started on Tue\n\n3001.50,msec,cpu-clock,3001500000,100.00,1.000,CPUs utilized\n\
                    12000,,context-switches,3001500000,100.00,4.0,K/sec\n\
                    <not counted>,,raw_syscalls:sys_enter,0,100.00,,\n";
        let s = parse_stat(text);
        assert_eq!(s.len(), 2, "{s:?}");
        assert_eq!(s[0], ("cpu-clock".into(), 3001.5, "msec".into()));
        assert_eq!(s[1].0, "context-switches");
    }

    #[test]
    fn report_lines_skip_comments_and_keep_the_entries_asked_for() {
        let text = "# Samples: 3K\n#\n\n    40.00%     0.00%  init  [k] __x64_sys_recvfrom\n\
                    30.00%    30.00%  init  [k] finish_task_switch\n\
                    20.00%     0.00%  init  [k] schedule\n";
        assert_eq!(report_lines(text, &[]).count(), 3);
        let entries: Vec<&str> = report_lines(text, REPORTS[2].only).collect();
        assert_eq!(entries.len(), 2, "{entries:?}");
        assert!(entries[0].contains("__x64_sys_recvfrom"));
    }

    #[test]
    fn reads_perf_trace_summary() {
        let text = "\n Summary of events:\n\n guest-init (1), 9000 events, 40.1%\n\n\
   syscall            calls  errors  total       min       avg       max       stddev\n\
                                     (msec)    (msec)    (msec)    (msec)        (%)\n\
   --------------- --------  ------ -------- --------- --------- ---------     ------\n\
   recvfrom            3000   1000    12.345     0.001     0.004     0.100      1.00%\n\
\t\t\t\tEAGAIN: 1000\n\
   epoll_wait          1500      0    99.000     0.010     0.066     1.000      2.00%\n\n\
 socat (77), 10 events, 0.1%\n\n\
   read                   5      0     0.010     0.001     0.002     0.003      1.00%\n";
        let s = parse_trace_summary(text);
        assert_eq!(s.len(), 3, "{s:?}");
        assert_eq!(
            s[0],
            SyscallCount {
                comm: "guest-init".into(),
                syscall: "recvfrom".into(),
                calls: 3000,
                errors: 1000,
                total_ms: 12.345,
                errnos: "EAGAIN:1000".into()
            }
        );
        assert_eq!((s[2].comm.as_str(), s[2].calls), ("socat", 5));
        assert_eq!(s[1].errnos, "");
    }
}
