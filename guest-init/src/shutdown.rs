//! The orderly end: every way out of guest-init goes through here.
//!
//! Whether the app ended, the host asked, a signal came, the configuration was bad or the
//! code panicked, the end is the same sequence:
//!
//! 1. `shutdown: <reason>` on the console.
//! 2. SIGTERM to the app's process group first (the app gets to stop its own children in
//!    its own order), then to every other process: as PID 1 every process in `/proc`, in
//!    ordinary mode the descendants found through `/proc` (a test supervisor must never
//!    signal the host's other processes). The app's group is skipped the second time:
//!    many servers take a second SIGTERM as "stop now, skip the graceful part", so
//!    `kill(-1)` is not used for SIGTERM. Grandchildren that left the app's process group
//!    (daemons, `setsid` children) get it too: tini #180 and dumb-init #212 show what
//!    happens otherwise.
//! 3. Up to `shutdown.grace_period_ms` for them to exit, reaping all the while, so that an
//!    app exiting early ends the wait early.
//! 4. SIGKILL to whatever remains (`kill(-1)` as PID 1), and reap until no child is left.
//! 5. `sync()`. As PID 1: unmount what boot mounted and, after a switch-root, remount `/`
//!    read-only; then `powering off` / `rebooting` and `reboot(RB_POWER_OFF)` or
//!    `reboot(RB_AUTOBOOT)` (Firecracker mode). PID 1 never returns from here: if
//!    `reboot(2)` itself failed, it sleeps forever rather than exit and panic the kernel.
//!    In ordinary mode it returns the exit code: the app's status (128 + signal if it was
//!    killed), or 1 for a fatal error or a panic.
//!
//! Two drivers share these steps: the supervisor runs steps 2-3 asynchronously, so the
//! forwarders keep serving the app while it finishes in-flight work, and then
//! [`finish`]; the panic hook and fatal errors use [`run_blocking`], which needs no
//! runtime. State the steps need (the app's pid, the plan) is kept in process-wide atomics
//! so a panic anywhere can reach it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::config::ShutdownAction;
use crate::supervisor::{reap, Exit};
use crate::{debug, info, warn};

/// Why the shutdown began (printed as `shutdown: <reason>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// A signal asked for it (SIGTERM, SIGINT = Ctrl-Alt-Del, SIGPWR).
    Signal(Signal),
    /// The host's `stop` on the control port.
    HostRequest,
    /// The ACPI power button (`KEY_POWER` from an input device).
    PowerButton,
    /// The app ended for good.
    AppEnded,
    /// A fatal error (already logged as `error: fatal: ...`).
    Fatal,
    /// A panic (already logged).
    Panic,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::Signal(s) => write!(f, "signal {}", s.as_str()),
            Reason::HostRequest => f.write_str("host request"),
            Reason::PowerButton => f.write_str("power button"),
            Reason::AppEnded => f.write_str("app ended"),
            Reason::Fatal => f.write_str("fatal error"),
            Reason::Panic => f.write_str("panic"),
        }
    }
}

static OWNER: AtomicI32 = AtomicI32::new(0);
static PID1: AtomicBool = AtomicBool::new(false);
static GRACE_MS: AtomicU64 = AtomicU64::new(5000);
static REBOOT: AtomicBool = AtomicBool::new(false);
static APP_PID: AtomicI32 = AtomicI32::new(0);
/// The app's last exit status; `-1` while unknown.
static APP_STATUS: AtomicI32 = AtomicI32::new(-1);
static STARTED: AtomicBool = AtomicBool::new(false);
/// 0 = none, 1 = fatal, 2 = panic: what decides the ordinary-mode exit code.
static FAILURE: AtomicU8 = AtomicU8::new(0);

/// Records who runs the shutdown and in which mode. Called first thing in `main`.
pub fn init(pid1: bool) {
    OWNER.store(std::process::id() as i32, Ordering::SeqCst);
    PID1.store(pid1, Ordering::SeqCst);
}

/// Whether this process is PID 1 (as recorded by [`init`]).
pub fn is_pid1() -> bool {
    PID1.load(Ordering::SeqCst)
}

/// Whether the calling process is the one that called [`init`] (not a forked child).
pub fn is_owner() -> bool {
    OWNER.load(Ordering::SeqCst) == std::process::id() as i32
}

/// Applies the configured grace period and action.
pub fn configure(grace_period_ms: u64, action: ShutdownAction) {
    GRACE_MS.store(grace_period_ms, Ordering::SeqCst);
    REBOOT.store(action == ShutdownAction::Reboot, Ordering::SeqCst);
}

/// Records the running app's pid (also its process group id).
pub fn set_app(pid: Option<Pid>) {
    APP_PID.store(pid.map_or(0, Pid::as_raw), Ordering::SeqCst);
}

/// The running app's pid, if one runs.
pub fn app() -> Option<Pid> {
    match APP_PID.load(Ordering::SeqCst) {
        0 => None,
        p => Some(Pid::from_raw(p)),
    }
}

/// Records how the app ended, prints the contract line and forgets its pid.
pub fn app_ended(exit: Exit) {
    APP_STATUS.store(exit.code(), Ordering::SeqCst);
    APP_PID.store(0, Ordering::SeqCst);
    match exit {
        Exit::Code(c) => info!("app exited status={c}"),
        Exit::Signal(s) => info!("app killed signal={}", s.as_str()),
    }
}

fn note_failure(reason: Reason) {
    let code = match reason {
        Reason::Fatal => 1,
        Reason::Panic => 2,
        _ => return,
    };
    FAILURE.fetch_max(code, Ordering::SeqCst);
}

/// Step 1-2: logs the reason and sends SIGTERM. Returns false if a shutdown was already
/// under way (the caller then goes straight to [`finish`]).
pub fn begin(reason: Reason) -> bool {
    note_failure(reason);
    if STARTED.swap(true, Ordering::SeqCst) {
        warn!("shutdown: {reason} while already shutting down");
        return false;
    }
    info!("shutdown: {reason}");
    let app = app();
    if let Some(app) = app {
        // The app's process group: the app and the children it did not move away.
        let _ = kill(Pid::from_raw(-app.as_raw()), Signal::SIGTERM);
    }
    // Everyone else, but not the app's group a second time: many servers treat a second
    // SIGTERM as "stop now, skip the graceful part".
    signal_others(Signal::SIGTERM, app);
    true
}

/// The grace period.
pub fn grace() -> Duration {
    Duration::from_millis(GRACE_MS.load(Ordering::SeqCst))
}

/// Reaps what has exited; true when no child is left. Reports the app's end.
pub fn reap_step() -> bool {
    let r = reap(app());
    if let Some(exit) = r.app {
        app_ended(exit);
    }
    r.no_children
}

/// Sends `sig` to every process but this one and those in process group `skip_group`:
/// as PID 1 every process in the system (or PID namespace), otherwise the descendants.
/// SIGKILL as PID 1 uses `kill(-1)`, which no process can dodge by forking meanwhile.
fn signal_others(sig: Signal, skip_group: Option<Pid>) {
    let own = nix::unistd::getpid();
    if is_pid1() && skip_group.is_none() {
        let _ = kill(Pid::from_raw(-1), sig); // ESRCH: nobody left.
        return;
    }
    let table = processes();
    let targets: Vec<&Proc> = if is_pid1() {
        table.iter().filter(|p| p.pid != own).collect()
    } else {
        let below: HashSet<Pid> = descendants_in(&table, own).into_iter().collect();
        table.iter().filter(|p| below.contains(&p.pid)).collect()
    };
    for p in targets {
        if Some(p.pgrp) != skip_group {
            let _ = kill(p.pid, sig);
        }
    }
}

/// One row of the process table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Proc {
    /// Process id.
    pub pid: Pid,
    /// Parent process id.
    pub ppid: Pid,
    /// Process group id.
    pub pgrp: Pid,
}

/// The process table, read from `/proc/<pid>/stat`.
pub fn processes() -> Vec<Proc> {
    let mut out = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for ent in dir.flatten() {
            let Some(pid) = ent.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if let Some(p) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .as_deref()
                .and_then(parse_stat)
            {
                out.push(p);
            }
        }
    }
    out
}

/// Every process below `root` in the parent tree.
pub fn descendants(root: Pid) -> Vec<Pid> {
    descendants_in(&processes(), root)
}

fn descendants_in(table: &[Proc], root: Pid) -> Vec<Pid> {
    let mut children: HashMap<Pid, Vec<Pid>> = HashMap::new();
    for p in table {
        children.entry(p.ppid).or_default().push(p.pid);
    }
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        for &c in children.get(&p).map(Vec::as_slice).unwrap_or_default() {
            if seen.insert(c) {
                out.push(c);
                stack.push(c);
            }
        }
    }
    out
}

/// Pid, parent and process group from a `/proc/<pid>/stat` line (the command name may
/// contain spaces and parentheses, so fields are counted from the last `)`).
pub fn parse_stat(stat: &str) -> Option<Proc> {
    let pid = stat.split(' ').next()?.parse().ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_ascii_whitespace().skip(1);
    let ppid = f.next()?.parse().ok()?;
    let pgrp = f.next()?.parse().ok()?;
    Some(Proc {
        pid: Pid::from_raw(pid),
        ppid: Pid::from_raw(ppid),
        pgrp: Pid::from_raw(pgrp),
    })
}

/// Step 3 without a runtime: waits up to the grace period, reaping. True if all are gone.
pub fn wait_blocking(deadline: Instant) -> bool {
    loop {
        if reap_step() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Steps 4-5: SIGKILL what remains, reap, sync, and end. Returns the exit code only in
/// ordinary mode; as PID 1 it never returns.
pub fn finish(all_gone: bool) -> i32 {
    if !all_gone {
        warn!(
            "shutdown: grace period of {} ms over; sending SIGKILL to the remaining processes",
            grace().as_millis()
        );
        if let Some(app) = app() {
            let _ = kill(Pid::from_raw(-app.as_raw()), Signal::SIGKILL);
        }
        signal_others(Signal::SIGKILL, None);
        // A process in uninterruptible sleep may take a moment; never wait forever.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !reap_step() {
            if Instant::now() >= deadline {
                warn!("shutdown: some processes did not die after SIGKILL; going on");
                break;
            }
            // Late children of dying parents re-parent to us; keep killing them.
            signal_others(Signal::SIGKILL, None);
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    nix::unistd::sync();
    if !is_pid1() {
        let code = match FAILURE.load(Ordering::SeqCst) {
            0 => match APP_STATUS.load(Ordering::SeqCst) {
                -1 => 1,
                s => s,
            },
            _ => 1,
        };
        debug!("exiting with status {code}");
        return code;
    }
    crate::boot::unmount_ours();
    nix::unistd::sync();
    let reboot = REBOOT.load(Ordering::SeqCst);
    if reboot {
        info!("rebooting");
        let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
    } else {
        info!("powering off");
        let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    }
    // reboot(2) returned: it failed (no CAP_SYS_BOOT?). PID 1 must not exit.
    crate::error!(
        "reboot(2) failed: {}; halting here",
        std::io::Error::last_os_error()
    );
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// The whole sequence without a runtime (panic hook, fatal errors before or outside the
/// supervisor). Returns the exit code in ordinary mode only.
pub fn run_blocking(reason: Reason) -> i32 {
    if !begin(reason) {
        return finish(false);
    }
    let all_gone = wait_blocking(Instant::now() + grace());
    finish(all_gone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_are_parsed_past_odd_names() {
        let p = |pid, ppid, pgrp| Proc {
            pid: Pid::from_raw(pid),
            ppid: Pid::from_raw(ppid),
            pgrp: Pid::from_raw(pgrp),
        };
        assert_eq!(parse_stat("42 (sh) S 7 40 40 0"), Some(p(42, 7, 40)));
        assert_eq!(parse_stat("42 (a) b (c)) R 9 1 1 0"), Some(p(42, 9, 1)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn descendants_include_grandchildren() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .spawn()
            .unwrap();
        let me = nix::unistd::getpid();
        let cpid = Pid::from_raw(child.id() as i32);
        // The grandchild appears once the shell has forked.
        for _ in 0..500 {
            if !descendants(cpid).is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let found = descendants(me);
        assert!(found.contains(&cpid), "{found:?}");
        let grand: Vec<_> = descendants(cpid);
        assert_eq!(grand.len(), 1, "the shell's sleep: {grand:?}");
        for p in grand {
            let _ = kill(p, Signal::SIGKILL);
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// The app's group gets SIGTERM once, from `kill(-pgid)`; the sweep over the other
    /// processes must skip it. SIGCONT stands in for SIGTERM: it is harmless to the other
    /// tests' children, which the sweep (over this test process's descendants) reaches too.
    #[test]
    fn the_sweep_skips_the_apps_group() {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let spawn = |script: String| {
            std::process::Command::new("sh")
                .args(["-c", &script])
                .process_group(0)
                .spawn()
                .unwrap()
        };
        let mut app = spawn(format!(
            "trap 'echo cont >> {d}/app.log' CONT; trap 'echo usr1 >> {d}/app.log' USR1; \
             touch {d}/app.ready; while ! grep -q usr1 {d}/app.log 2>/dev/null; do sleep 0.02; done"
        ));
        let mut other = spawn(format!(
            "trap 'echo cont > {d}/other.log' CONT; touch {d}/other.ready; \
             while [ ! -s {d}/other.log ]; do sleep 0.02; done"
        ));
        for f in ["app.ready", "other.ready"] {
            while !dir.path().join(f).exists() {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let app_pid = Pid::from_raw(app.id() as i32);
        signal_others(Signal::SIGCONT, Some(app_pid));
        assert!(other.wait().unwrap().success());
        // SIGUSR1 is sent after SIGCONT would have been: the shell runs every pending trap
        // before it sees `usr1` in its log, so a wrongly sent SIGCONT shows up as well.
        kill(app_pid, Signal::SIGUSR1).unwrap();
        assert!(app.wait().unwrap().success());
        let log = std::fs::read_to_string(dir.path().join("app.log")).unwrap();
        assert_eq!(log, "usr1\n", "the sweep signalled the app's group");
    }

    #[test]
    fn reasons_print_as_the_contract_says() {
        assert_eq!(
            Reason::Signal(Signal::SIGTERM).to_string(),
            "signal SIGTERM"
        );
        assert_eq!(Reason::HostRequest.to_string(), "host request");
        assert_eq!(Reason::PowerButton.to_string(), "power button");
        assert_eq!(Reason::AppEnded.to_string(), "app ended");
        assert_eq!(Reason::Fatal.to_string(), "fatal error");
        assert_eq!(Reason::Panic.to_string(), "panic");
    }
}
