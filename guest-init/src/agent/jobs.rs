//! `exec` jobs: started, watched to their deadline, killed, their exit status collected.
//!
//! guest-init reaps every child itself (`waitpid(-1)` in the supervisor, as PID 1 or as a
//! subreaper), so a job's exit status cannot come from tokio's or std's child handle: the
//! supervisor would take it first. Instead a job's pid is registered *while the fork is
//! under way* ([`spawn`] holds the registry's lock across `spawn`, and the supervisor's
//! [`reaped`] call takes the same lock), so even a job that exits at once is handed to its
//! waiter, never lost as an "orphan".
//!
//! A job runs in its own process group; at its deadline, or when the agent kills it
//! ([`kill`]), the whole group gets SIGKILL, so a job cannot outlive its deadline by
//! forking.
//!
//! Threat: a job outliving its deadline or its operator's identity (group kill), a job's
//! exit status being lost to the reaper race (registration under the lock), and output
//! exhausting the guest's memory (the caller caps it; see [`super::exec`]).

use std::collections::BTreeMap;
use std::io;
use std::process::Command;
use std::sync::Mutex;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::sync::oneshot;

use crate::supervisor::Exit;

static WAITERS: Mutex<BTreeMap<i32, oneshot::Sender<Exit>>> = Mutex::new(BTreeMap::new());

fn waiters() -> std::sync::MutexGuard<'static, BTreeMap<i32, oneshot::Sender<Exit>>> {
    WAITERS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Spawns `cmd` (which must set its own process group) and registers it before the
/// supervisor can reap it. Returns the child (for its pipes) and the exit's receiver.
pub fn spawn(cmd: &mut Command) -> io::Result<(std::process::Child, oneshot::Receiver<Exit>)> {
    let mut w = waiters();
    let child = cmd.spawn()?;
    let (tx, rx) = oneshot::channel();
    w.insert(child.id() as i32, tx);
    Ok((child, rx))
}

/// Called by the supervisor for every reaped pid: `true` if it was a job (its waiter gets
/// the exit).
pub fn reaped(pid: Pid, exit: Exit) -> bool {
    match waiters().remove(&pid.as_raw()) {
        Some(tx) => {
            let _ = tx.send(exit);
            true
        }
        None => false,
    }
}

/// SIGKILLs the job's whole process group (its pid is the group id).
pub fn kill(pid: u32) {
    if let Err(e) = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL) {
        if e != nix::errno::Errno::ESRCH {
            crate::warn!("agent: cannot kill job group {pid}: {e}");
        }
    }
}
