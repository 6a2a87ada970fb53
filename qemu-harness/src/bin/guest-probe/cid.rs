//! `cid-test`: host-relay in CID mode inside the guest over `vsock_loopback` (peer CID 1),
//! once per configuration, reporting whether each admitted or refused a loopback
//! connection. Kept apart from `guest-probe.rs` to keep each file short.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{exchange, say, serve_echo, vsock_connect};

pub(super) fn cid_test(relay: &str, port: u32, echo: &str, configs: &[(String, String)]) -> bool {
    if let Err(e) = serve_echo(echo) {
        say!("cid-test cannot serve echo at {echo}: {e}");
        return false;
    }
    for (label, config) in configs {
        let log_path = format!("/tmp/relay-{label}.log");
        let log = match std::fs::File::create(&log_path) {
            Ok(f) => f,
            Err(e) => {
                say!("cid-test {label}: cannot create {log_path}: {e}");
                return false;
            }
        };
        let err = log.try_clone().ok();
        let mut cmd = Command::new(relay);
        // SAFETY: runs in the forked child before exec and only calls sigprocmask-style
        // functions on a local set, which are async-signal-safe. This probe blocks SIGTERM
        // (it takes it with sigwait); the relay must not inherit that mask, or it could
        // never be stopped.
        unsafe {
            cmd.pre_exec(|| {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGTERM);
                libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
                Ok(())
            });
        }
        let mut child = match cmd
            .args(["run", "--config", config])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(err.map(Stdio::from).unwrap_or_else(Stdio::null))
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                say!("cid-test {label}: cannot start {relay}: {e}");
                return false;
            }
        };
        // Wait until the relay accepts on the port (a connect to an unbound loopback port
        // fails at once), then see what happens to our bytes.
        let deadline = Instant::now() + Duration::from_secs(30);
        let outcome = loop {
            match vsock_connect(1, port) {
                Ok(mut s) => {
                    let msg = format!("ping-{label}\n");
                    break match exchange(&mut s, msg.as_bytes()) {
                        Ok(Some(d)) if d == msg.as_bytes() => "admitted echo ok".to_string(),
                        Ok(Some(d)) => format!("admitted but got {} unexpected bytes", d.len()),
                        Ok(None) => "refused (closed without data)".to_string(),
                        Err(e) => format!("error {e}"),
                    };
                }
                Err(e) if Instant::now() > deadline => break format!("no listener: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
            if let Ok(Some(st)) = child.try_wait() {
                break format!("relay exited early: {st}");
            }
        };
        say!("cid-test {label} {outcome}");
        // SAFETY: kill(2) on our own unreaped child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(child.try_wait(), Ok(None)) {
            if Instant::now() > deadline {
                say!("cid-test {label}: relay ignored SIGTERM for 10 s; killing it");
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.wait();
        for line in std::fs::read_to_string(&log_path)
            .unwrap_or_default()
            .lines()
        {
            say!("relay-{label}: {line}");
        }
    }
    true
}
