//! Child processes the harness starts (vhost-device-vsock, host-relay, QEMU) and how they
//! end.
//!
//! # Design
//!
//! Every child is wrapped in a [`Child`] that owns it: dropping the wrapper ends the
//! process (SIGTERM, a short grace, then SIGKILL) and reaps it, so a failing test — which
//! unwinds through `Drop` — leaves no stray process behind. As a second line of defence
//! each child is started with `PR_SET_PDEATHSIG(SIGKILL)`: if the harness process itself
//! dies without unwinding (killed, or aborted), the kernel kills the children. (The death
//! signal is tied to the *thread* that spawned the child, so a `Vm` should be created and
//! dropped on the same thread — which is how tests and the CLI use it.)
//!
//! Each child's stdout and stderr go to a log file in the VM's run directory; errors quote
//! the file's last lines, so a failure explains itself.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::HarnessError;

/// A supervised child process.
#[derive(Debug)]
pub struct Child {
    name: String,
    child: std::process::Child,
    log: PathBuf,
    status: Option<ExitStatus>,
}

impl Child {
    /// Starts `cmd` with its output in `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> std::io::Result<Self> {
        let out = File::create(log)?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        // SAFETY: the closure runs in the forked child before exec and calls only prctl(2),
        // which is async-signal-safe; it touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn()?;
        Ok(Self {
            name: name.to_string(),
            child,
            log: log.to_path_buf(),
            status: None,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The log's content.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The exit status if it has ended (non-blocking).
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// Waits up to `timeout` for it to end.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_status() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `sig` if it is still running.
    pub fn signal(&mut self, sig: i32) {
        if self.try_status().is_none() {
            let pid = self.child.id() as libc::pid_t;
            // SAFETY: kill(2) has no memory-safety preconditions; the pid is our own
            // unreaped child, so it cannot have been recycled for another process.
            unsafe {
                libc::kill(pid, sig);
            }
        }
    }

    /// Ends it: SIGTERM, up to `grace` to exit, then SIGKILL. Returns its status and
    /// whether SIGKILL was needed.
    pub fn terminate(&mut self, grace: Duration) -> (Option<ExitStatus>, bool) {
        if let Some(s) = self.try_status() {
            return (Some(s), false);
        }
        self.signal(libc::SIGTERM);
        if let Some(s) = self.wait_timeout(grace) {
            return (Some(s), false);
        }
        (self.kill(), true)
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        if self.try_status().is_none() {
            let _ = self.child.kill();
            self.status = self.child.wait().ok();
        }
        self.status
    }

    /// The child's name (for messages).
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.terminate(Duration::from_secs(2));
    }
}

/// A log excerpt for an error: all of it when short, else its first 10 lines (where a
/// program's own error message usually is, before any backtrace) and its last 30.
pub fn excerpt(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    if lines.len() <= 40 {
        return lines.join("\n");
    }
    format!(
        "{}\n[... {} lines ...]\n{}",
        lines[..10].join("\n"),
        lines.len() - 40,
        lines[lines.len() - 30..].join("\n")
    )
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Waits until `child` has created `path`; fails at once if the child dies, or after
/// `timeout`, quoting the child's log.
pub(crate) fn wait_for_path(
    path: &Path,
    timeout: Duration,
    child: &mut Child,
) -> Result<(), HarnessError> {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        if let Some(status) = child.try_status() {
            return Err(HarnessError::ProcessDied {
                name: child.name().to_string(),
                status: status.to_string(),
                log_tail: excerpt(&child.log()),
            });
        }
        if Instant::now() >= deadline {
            return Err(HarnessError::Timeout {
                what: format!("{} to create {}", child.name(), path.display()),
                after: timeout,
                tail: tail(&child.log(), 40),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alive(pid: u32) -> bool {
        // A reaped child's /proc entry is gone.
        Path::new(&format!("/proc/{pid}")).exists()
    }

    #[test]
    fn dropping_a_child_ends_and_reaps_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("sleep");
        cmd.arg("600");
        let child = Child::spawn("sleeper", cmd, &dir.path().join("log")).unwrap();
        let pid = child.pid();
        assert!(alive(pid));
        drop(child);
        assert!(!alive(pid), "the child outlived its owner");
    }

    #[test]
    fn terminate_escalates_to_sigkill_for_a_child_ignoring_sigterm() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "trap '' TERM; echo started; while :; do sleep 1; done",
        ]);
        let mut child = Child::spawn("stubborn", cmd, &dir.path().join("log")).unwrap();
        // Wait until the trap is installed.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !child.log().contains("started") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let (status, killed) = child.terminate(Duration::from_millis(300));
        assert!(
            killed,
            "SIGTERM was ignored, so SIGKILL must have been needed"
        );
        assert!(status.is_some());
    }

    #[test]
    fn output_goes_to_the_log_and_tail_keeps_the_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo one; echo two >&2; echo three"]);
        let mut child = Child::spawn("echo", cmd, &dir.path().join("log")).unwrap();
        assert!(child
            .wait_timeout(Duration::from_secs(10))
            .unwrap()
            .success());
        assert_eq!(tail(&child.log(), 2), "two\nthree");
        let long: String = (0..100).map(|i| format!("line {i}\n")).collect();
        let e = excerpt(&long);
        assert!(e.starts_with("line 0\nline 1\n"), "{e}");
        assert!(
            e.contains("[... 60 lines ...]") && e.ends_with("line 99"),
            "{e}"
        );
    }
}
