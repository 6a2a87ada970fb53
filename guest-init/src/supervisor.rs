//! Supervision: start everything, reap every child, restart the app, and turn every way of
//! ending into one call to the orderly shutdown.
//!
//! **Reaping.** PID 1 inherits every orphan in the VM; in ordinary mode guest-init makes
//! itself a child subreaper (`PR_SET_CHILD_SUBREAPER`) so the app's orphans come to it
//! instead of escaping to the host's init. On each SIGCHLD the supervisor drains
//! `waitpid(-1, WNOHANG)` until nothing is left to reap, and recognises the app's pid
//! *inside* that loop: signals coalesce, so one SIGCHLD may stand for the app and a hundred
//! orphans at once, and a supervisor that only waits for its main child (catatonit #4)
//! either leaks zombies or misses the app's end.
//!
//! **Signals.** SIGTERM, SIGINT (what the kernel sends PID 1 for Ctrl-Alt-Del once
//! `reboot(RB_DISABLE_CAD)` is set), SIGPWR, the host's `stop` on the control port and a
//! press of the ACPI power button (`crate::power_button`, as PID 1) all end `live` with a
//! [`Reason`], and [`run`] then runs the one shutdown path. SIGHUP,
//! SIGUSR1 and SIGUSR2 are forwarded to the app process (reload, log rotation), not its
//! whole group. Handlers are installed before the app starts, so no signal finds PID 1
//! without a handler (for PID 1 such a signal would simply be dropped by the kernel).
//!
//! **Restarts.** With `restart.policy = on-failure`, a non-zero exit or a death by signal
//! restarts the app after a delay that starts at `initial_backoff_ms` and doubles up to
//! `max_backoff_ms`, at most `max_restarts` times. Signals are still handled during the
//! delay. An exit with status 0, or the last allowed failure, ends the app for good.
//!
//! **Lifetimes.** The forwarders and the control port stay up until the shutdown is over,
//! not just until it begins: during the grace period the app may still need its forwarded
//! sockets to finish a request or deliver its last words to the host.
//!
//! **Readiness.** `ready in <ms> ms (...)` is printed once the forwarders are listening
//! (`forward::start` returned), the control port listens, enrollment is done and the app
//! has been spawned; the time is measured from guest-init's first instruction in `main`.

use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, Signal as Stream, SignalKind};
use tokio::sync::mpsc;

use crate::app::AppSpec;
use crate::config::{Config, RestartPolicy};
use crate::shutdown::{self, Reason};
use crate::{debug, error, info, warn};

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this status.
    Code(i32),
    /// A signal killed it.
    Signal(Signal),
}

impl Exit {
    /// The shell convention: the status, or 128 + the signal number.
    pub fn code(self) -> i32 {
        match self {
            Exit::Code(c) => c,
            Exit::Signal(s) => 128 + s as i32,
        }
    }

    /// Whether it counts as a failure for the restart policy.
    pub fn failed(self) -> bool {
        self != Exit::Code(0)
    }
}

/// What one drain of `waitpid` found.
#[derive(Debug, Default)]
pub struct Reaped {
    /// The app's end, if the app was among the reaped.
    pub app: Option<Exit>,
    /// How many other processes (orphans) were reaped.
    pub orphans: usize,
    /// No child is left at all (`ECHILD`).
    pub no_children: bool,
}

/// Drains `waitpid(-1, WNOHANG)` until nothing more is ready, noting the app's end.
pub fn reap(app: Option<Pid>) -> Reaped {
    let mut r = Reaped::default();
    loop {
        let (pid, exit) = match waitpid(None::<Pid>, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => return r,
            Ok(WaitStatus::Exited(pid, code)) => (pid, Exit::Code(code)),
            Ok(WaitStatus::Signaled(pid, sig, _)) => (pid, Exit::Signal(sig)),
            Ok(_) => continue,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::ECHILD) => {
                r.no_children = true;
                return r;
            }
            Err(e) => {
                warn!("waitpid: {e}");
                return r;
            }
        };
        if Some(pid) == app {
            r.app = Some(exit);
        } else if crate::agent::jobs::reaped(pid, exit) {
            debug!("reaped agent job pid={pid}");
        } else {
            r.orphans += 1;
            match exit {
                Exit::Code(c) => debug!("reaped pid={pid} status={c}"),
                Exit::Signal(s) => debug!("reaped pid={pid} signal={}", s.as_str()),
            }
        }
    }
}

/// Makes this process a child subreaper (ordinary mode): orphans below it re-parent to it.
pub fn become_subreaper() -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) takes no pointers; it sets a process flag.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

struct Signals {
    term: Stream,
    int: Stream,
    pwr: Stream,
    chld: Stream,
    hup: Stream,
    usr1: Stream,
    usr2: Stream,
}

impl Signals {
    fn install() -> std::io::Result<Self> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            pwr: signal(SignalKind::from_raw(libc::SIGPWR))?,
            chld: signal(SignalKind::child())?,
            hup: signal(SignalKind::hangup())?,
            usr1: signal(SignalKind::user_defined1())?,
            usr2: signal(SignalKind::user_defined2())?,
        })
    }
}

fn fatal(msg: impl std::fmt::Display) -> Reason {
    error!("fatal: {msg}");
    Reason::Fatal
}

fn backoff(cfg: &crate::config::RestartConfig, restart_no: u32) -> Duration {
    let factor = 1u64 << restart_no.saturating_sub(1).min(20);
    Duration::from_millis(
        cfg.initial_backoff_ms
            .saturating_mul(factor)
            .min(cfg.max_backoff_ms),
    )
}

/// What must stay alive until the shutdown is complete: the forwarders keep serving the
/// app's in-flight requests during the grace period, and the control port keeps answering.
#[derive(Default)]
struct Keep {
    _forwarders: Option<crate::forward::Forwarders>,
    _control: Option<tokio::task::JoinHandle<()>>,
    _agent: Option<tokio::task::JoinHandle<()>>,
    _reenroll: Option<tokio::task::JoinHandle<()>>,
    _renew: Option<tokio::task::JoinHandle<()>>,
}

/// Runs the VM's whole life: start-up, supervision and the orderly shutdown. `started` is
/// when `main` began. As PID 1 it never returns; otherwise it returns the exit code.
pub async fn run(cfg: &Config, started: Instant) -> i32 {
    let mut keep = Keep::default();
    let reason = live(cfg, started, &mut keep).await;
    let code = shut_down(reason).await;
    drop(keep);
    code
}

/// Everything up to the moment the VM must end; says why.
async fn live(cfg: &Config, started: Instant, keep: &mut Keep) -> Reason {
    let mut sigs = match Signals::install() {
        Ok(s) => s,
        Err(e) => return fatal(format_args!("cannot install signal handlers: {e}")),
    };
    let (stop_tx, mut stop_rx) = mpsc::unbounded_channel();
    if let Some(c) = &cfg.control {
        match crate::control::start(&c.listen, stop_tx.clone()) {
            Ok(h) => keep._control = Some(h),
            Err(e) => return fatal(format_args!("control.listen: {e}")),
        }
    }
    // The power button is watched from here on, before the app starts: a VMM may press it
    // at any time after boot.
    let (power_tx, mut power_rx) = mpsc::unbounded_channel();
    crate::power_button::watch(power_tx);
    // Every forwarded connection holds two descriptors, and the kernel starts init with a
    // soft limit of 1024: lift it to the hard limit (4096 for init, above the VMMs' 1023
    // vsock connections per VM). The app gets the original limits back (`AppSpec`).
    let app_nofile = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE);
    if let Err(e) = vm_transport::fdlimit::raise_fd_limit() {
        warn!("cannot raise the open-file limit for forwarding: {e}");
    }
    match crate::forward::start(&cfg.services, &cfg.exports).await {
        Ok(f) => keep._forwarders = Some(f),
        Err(e) => return fatal(e),
    }
    if let Some(en) = &cfg.enrollment {
        if let Err(e) = crate::enroll::boot_step(en).await {
            return fatal(format_args!("enrollment: {e}"));
        }
        let mut agent = None;
        if let Some(a) = &cfg.agent {
            match start_agent(a, en, started, stop_tx.clone()) {
                Ok((task, handle)) => {
                    keep._agent = Some(task);
                    agent = Some(handle);
                }
                Err(e) => return fatal(e),
            }
        }
        keep._renew = Some(tokio::spawn(crate::enroll::renew::run(
            en.clone(),
            agent.clone(),
        )));
        if matches!(en.bootstrap, crate::enroll::BootstrapSource::Push { .. }) {
            keep._reenroll = Some(tokio::spawn(reenroll_on_push(en.clone(), agent)));
        }
    }
    let spec = match AppSpec::from_config(&cfg.app) {
        Ok(s) => match app_nofile {
            Ok(limit) => s.with_nofile_limit(limit),
            Err(_) => s,
        },
        Err(e) => return fatal(e),
    };
    let mut app = match spec.spawn() {
        Ok(p) => p,
        Err(e) => return fatal(format_args!("app: {e}")),
    };
    shutdown::set_app(Some(app));
    info!(
        "ready in {} ms (services={} exports={} app_pid={app})",
        started.elapsed().as_millis(),
        cfg.services.len(),
        cfg.exports.len()
    );
    if cfg.debug_panic_after_ready {
        panic!("debug_panic_after_ready is set: a deliberate panic to test the panic path");
    }

    let restart = &cfg.app.restart;
    let mut restarts = 0u32;
    let mut restart_at: Option<tokio::time::Instant> = None;
    // The app may have ended before the SIGCHLD stream saw it; drain once now.
    let mut pending_reap = true;
    loop {
        if pending_reap {
            pending_reap = false;
            let r = reap(shutdown::app());
            if let Some(exit) = r.app {
                let again = restart.policy == RestartPolicy::OnFailure
                    && exit.failed()
                    && restarts < restart.max_restarts;
                if !again {
                    shutdown::app_ended(exit);
                    return Reason::AppEnded;
                }
                shutdown::set_app(None);
                restarts += 1;
                let delay = backoff(restart, restarts);
                warn!(
                    "app failed ({}); restart {restarts} of {} in {} ms",
                    match exit {
                        Exit::Code(c) => format!("status={c}"),
                        Exit::Signal(s) => format!("signal={}", s.as_str()),
                    },
                    restart.max_restarts,
                    delay.as_millis()
                );
                restart_at = Some(tokio::time::Instant::now() + delay);
            }
        }
        let restart_sleep = async {
            match restart_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = sigs.chld.recv() => pending_reap = true,
            _ = sigs.term.recv() => return Reason::Signal(Signal::SIGTERM),
            _ = sigs.int.recv() => return Reason::Signal(Signal::SIGINT),
            _ = sigs.pwr.recv() => return Reason::Signal(Signal::SIGPWR),
            Some(()) = stop_rx.recv() => return Reason::HostRequest,
            Some(()) = power_rx.recv() => return Reason::PowerButton,
            _ = sigs.hup.recv() => forward_signal(Signal::SIGHUP),
            _ = sigs.usr1.recv() => forward_signal(Signal::SIGUSR1),
            _ = sigs.usr2.recv() => forward_signal(Signal::SIGUSR2),
            _ = restart_sleep => {
                restart_at = None;
                match spec.spawn() {
                    Ok(p) => {
                        app = p;
                        shutdown::set_app(Some(app));
                        info!("app restarted: app_pid={app}");
                    }
                    Err(e) => return fatal(format_args!("app: restart: {e}")),
                }
            }
        }
    }
}

/// Starts the agent with the credentials enrollment left in force.
fn start_agent(
    cfg: &crate::agent::AgentConfig,
    en: &crate::enroll::EnrollConfig,
    started: Instant,
    stop: mpsc::UnboundedSender<()>,
) -> Result<(tokio::task::JoinHandle<()>, crate::agent::Handle), String> {
    let c = crate::enroll::credentials(en).map_err(|e| format!("agent: {e}"))?;
    let ctx = crate::agent::Context {
        ca: c.ca.clone(),
        served: crate::agent::Served::from_credentials(c),
        started,
        stop,
        exec_users: cfg.exec_users.clone(),
    };
    crate::agent::start(cfg, ctx).map_err(|e| e.to_string())
}

/// With a push source, enrollment goes on after boot: each pushed document is enrolled,
/// and when it changes the identity (a raised epoch: a new key and certificate) the agent
/// rotates to it. A refused document changes nothing.
async fn reenroll_on_push(en: crate::enroll::EnrollConfig, agent: Option<crate::agent::Handle>) {
    loop {
        match crate::enroll::next_push(&en).await {
            Ok(Some(c)) => {
                if let Some(a) = &agent {
                    a.rotate(crate::agent::Served::from_credentials(c)).await;
                }
            }
            Ok(None) => {}
            Err(e) => {
                warn!("enroll: pushed material not enrolled ({e}); the current identity stays");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

fn forward_signal(sig: Signal) {
    if let Some(app) = shutdown::app() {
        debug!("forwarding {} to the app (pid {app})", sig.as_str());
        if let Err(e) = kill(app, sig) {
            warn!("forwarding {} to the app: {e}", sig.as_str());
        }
    }
}

/// The shutdown with the runtime still running: the forwarders keep serving while the app
/// finishes its work during the grace period. Returns the exit code (ordinary mode only).
async fn shut_down(reason: Reason) -> i32 {
    if !shutdown::begin(reason) {
        return shutdown::finish(false);
    }
    let deadline = Instant::now() + shutdown::grace();
    let all_gone = loop {
        if shutdown::reap_step() {
            break true;
        }
        if Instant::now() >= deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    shutdown::finish(all_gone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell_convention() {
        assert_eq!(Exit::Code(3).code(), 3);
        assert_eq!(Exit::Signal(Signal::SIGKILL).code(), 137);
        assert!(!Exit::Code(0).failed());
        assert!(Exit::Code(1).failed());
        assert!(Exit::Signal(Signal::SIGTERM).failed());
    }

    #[test]
    fn backoff_doubles_up_to_the_maximum() {
        let cfg = crate::config::RestartConfig {
            policy: RestartPolicy::OnFailure,
            max_restarts: 10,
            initial_backoff_ms: 100,
            max_backoff_ms: 1000,
        };
        let ms: Vec<u128> = (1..=6).map(|n| backoff(&cfg, n).as_millis()).collect();
        assert_eq!(ms, vec![100, 200, 400, 800, 1000, 1000]);
    }
}
