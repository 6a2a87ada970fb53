//! `exec`: one command as a listed user, to its deadline, with capped output.
//!
//! See [`super::ops`] for the wire format and [`super::jobs`] for how the job is started,
//! reaped and killed. The user is resolved by name in the guest's `/etc/passwd` and must
//! be listed in the agent's `exec_users`; its uid and primary gid are set and the
//! supplementary groups dropped (the standard library's `setgroups(0)` when root spawns
//! with a uid). The job gets `/dev/null` as stdin, `/` as working directory, and only
//! `PATH`, `HOME` and `USER` in its environment: nothing of PID 1's.
//!
//! Threat: exec as an unlisted user or as root by accident (refused unless listed by name),
//! inherited environment or descriptors leaking into the job (cleared; std closes the rest
//! with CLOEXEC), a job or its children outliving the deadline (group SIGKILL), and a
//! chatty job exhausting memory (each stream capped at [`MAX_OUTPUT`], the rest drained).

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use tokio::io::AsyncReadExt;

use super::jobs;
use super::ops::{Answer, Code, DEFAULT_DEADLINE, MAX_OUTPUT};
use crate::supervisor::Exit;

/// Runs `argv` as `user` if `allowed` lists it; returns the answer.
pub async fn run(
    user: &str,
    argv: &[String],
    deadline_ms: Option<u64>,
    allowed: &[String],
) -> Answer {
    if !allowed.iter().any(|u| u == user) {
        return Answer::error(
            Code::UserNotAllowed,
            format!("user {user:?} is not in the agent's exec_users"),
        );
    }
    let pw = match nix::unistd::User::from_name(user) {
        Ok(Some(pw)) => pw,
        Ok(None) => {
            return Answer::error(
                Code::UserNotAllowed,
                format!("user {user:?} does not exist in this guest's /etc/passwd"),
            )
        }
        Err(e) => return Answer::error(Code::ExecFailed, format!("cannot look up {user:?}: {e}")),
    };
    let deadline = deadline_ms.map_or(DEFAULT_DEADLINE, Duration::from_millis);
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", &pw.dir)
        .env("USER", user)
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .uid(pw.uid.as_raw())
        .gid(pw.gid.as_raw())
        .process_group(0);
    let (mut child, exited) = match jobs::spawn(&mut cmd) {
        Ok(c) => c,
        Err(e) => return Answer::error(Code::ExecFailed, format!("cannot start {}: {e}", argv[0])),
    };
    let pid = child.id();
    crate::info!(
        "agent: job {pid} started as {user} (deadline {} ms): {}",
        deadline.as_millis(),
        argv[0]
    );
    let started = Instant::now();
    // Read from the start, on their own tasks: a job must never block on a full pipe.
    let out = tokio::spawn(capture(child.stdout.take()));
    let err = tokio::spawn(capture(child.stderr.take()));
    drop(child);
    let guard = KillOnDrop(Some(pid));
    let (exit, timed_out) = match tokio::time::timeout(deadline, exited).await {
        Ok(Ok(exit)) => (Some(exit), false),
        Ok(Err(_)) => (None, false),
        Err(_) => {
            crate::warn!(
                "agent: job {pid} passed its deadline of {} ms; killing its process group",
                deadline.as_millis()
            );
            jobs::kill(pid);
            (None, true)
        }
    };
    guard.disarm();
    // The group is dead or done: the pipes end (a grandchild that escaped the group could
    // hold them, so the reads are bounded in time too).
    let (out, out_cut) = collect(out).await;
    let (err, err_cut) = collect(err).await;
    let b64 = base64::engine::general_purpose::STANDARD;
    crate::info!(
        "agent: job {pid} ended after {} ms ({})",
        started.elapsed().as_millis(),
        if timed_out {
            "killed at its deadline".to_string()
        } else {
            describe(exit)
        }
    );
    Answer::ok(serde_json::json!({
        "exit_code": match exit { Some(Exit::Code(c)) => Some(c), _ => None },
        "signal": match exit { Some(Exit::Signal(s)) => Some(s as i32), _ => None },
        "timed_out": timed_out,
        "stdout": b64.encode(&out),
        "stderr": b64.encode(&err),
        "truncated": out_cut || err_cut,
    }))
}

/// A capture task's result, waited for briefly once the job is over.
async fn collect(
    task: tokio::task::JoinHandle<std::io::Result<(Vec<u8>, bool)>>,
) -> (Vec<u8>, bool) {
    let abort = task.abort_handle();
    match tokio::time::timeout(Duration::from_secs(2), task).await {
        Ok(Ok(Ok(r))) => r,
        Ok(_) => (Vec::new(), false),
        Err(_) => {
            abort.abort();
            (Vec::new(), true)
        }
    }
}

fn describe(exit: Option<Exit>) -> String {
    match exit {
        Some(Exit::Code(c)) => format!("status {c}"),
        Some(Exit::Signal(s)) => format!("signal {}", s.as_str()),
        None => "status unknown".into(),
    }
}

/// Kills the job's group if the request's task is dropped (the connection was closed).
struct KillOnDrop(Option<u32>);

impl KillOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            crate::warn!(
                "agent: job {pid} killed (its process group): its connection ended or its identity was revoked"
            );
            jobs::kill(pid);
        }
    }
}

/// Reads a pipe to its end, keeping at most [`MAX_OUTPUT`] bytes; says whether more came.
async fn capture<P: std::os::fd::AsFd + Into<std::os::fd::OwnedFd>>(
    pipe: Option<P>,
) -> std::io::Result<(Vec<u8>, bool)> {
    let Some(p) = pipe else {
        return Ok((Vec::new(), false));
    };
    let fd: std::os::fd::OwnedFd = p.into();
    let mut rx = tokio::net::unix::pipe::Receiver::from_owned_fd(fd)?;
    let mut kept = Vec::new();
    let mut cut = false;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = rx.read(&mut buf).await?;
        if n == 0 {
            return Ok((kept, cut));
        }
        let room = MAX_OUTPUT - kept.len();
        kept.extend_from_slice(&buf[..n.min(room)]);
        cut |= n > room;
    }
}
