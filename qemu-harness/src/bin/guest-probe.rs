//! `guest-probe`: a small static program that runs inside test guests, as the app or as a
//! helper, and reports what it saw as `guest-probe: ...` lines on stdout (the console).
//!
//! It speaks to the guest side of the system the way real apps do, so the VM tests can
//! check behaviour end to end without a shell or an interpreter in the guest:
//!
//! - `signin --socket PATH --try USER:PASS [--try ...]`: Dovecot auth exactly as Radicale
//!   does it — one `recv(1024)` for the whole greeting, one for the reply — and prints
//!   `signin USER OK` or `signin USER FAIL` per attempt.
//! - `burst N --socket PATH --try USER:PASS`: N concurrent sign-ins (threads released
//!   together); prints `burst ok=.. fail=.. err=..`.
//! - `signin-timed N --socket PATH --try USER:PASS`: N sign-ins one after another, each
//!   timed in the guest; prints `signin-timed ok=.. fail=.. err=.. p50_us=.. p99_us=..`
//!   (the benchmark's in-guest figure; the first sign-in, which also warms the path, is
//!   included).
//! - `serve-echo PATH`: a Unix echo server (a guest service the host reaches).
//! - `zombies N`: makes N orphans that die at once (zombies for PID 1 to reap), then
//!   watches `/proc` and prints how many zombies are left (`guest-probe/zombies.rs`).
//! - `last-words --socket PATH --words TEXT`: waits for SIGTERM, then writes TEXT and a
//!   newline to PATH, waits for the host's `ack` line, and exits 0.
//! - `vsock-connect --cid C --port P [--port P...]`: AF_VSOCK connects; prints what happened
//!   to each.
//! - `cid-test --relay BIN --port P --echo PATH --config LABEL=FILE ...`: runs host-relay in
//!   CID mode inside the guest over `vsock_loopback` (peer CID 1) once per config, and
//!   prints whether each admitted or refused a loopback connection (`guest-probe/cid.rs`).
//! - `load --path NAME=TARGET ... [--socat BIN --socat-listen PATH --socat-to CID:PORT]
//!   [--rounds R] [--window-ms W] [--burst N] [--burst-threads T]`: the benchmark's RTT,
//!   bulk, setup and burst workloads against each path in turns, one line per round and
//!   path (`guest-probe/load.rs`); with `--perf BIN`, then a profile of each path's round
//!   trip (`guest-probe/profile.rs`).
//! - `rtt TARGET MS`: 64-byte round trips on TARGET for MS milliseconds; prints `rtt n=..`
//!   (the workload `load --perf` runs under `perf`).
//! - As PID 1 (`rdinit=/bin/guest-probe`, for `load --perf`): mounts tracefs for the app
//!   and execs `/init` (`guest-probe/profile.rs`).
//! - `write-and-wait PATH SIZE [--ignore-term]`: writes SIZE bytes of a fixed pattern to
//!   PATH without `fsync`, then waits for SIGTERM (or ignores it), for the data-safety tests
//!   of every way of stopping (`guest-probe/write_wait.rs`).
//! - `tick PATH`: appends a line to PATH every 100 ms, forever; `size PATH`: prints
//!   `size PATH N` — a job whose life the host watches from outside (`guest-probe/tick.rs`).
//!
//! A trailing `--then-sleep` makes it wait for SIGTERM after the action (exit 0), so the
//! app stays up until the host stops the VM. Exit status: 0 when the action's expectation
//! held, 1 otherwise, 2 on bad usage.
//!
//! Secrets: passwords are test fixtures, but still never printed.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

fn say(msg: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "guest-probe: {msg}");
    let _ = out.flush();
}

macro_rules! say {
    ($($t:tt)*) => { say(format_args!($($t)*)) };
}

// The crate root looks for modules beside itself: point at this binary's own directory.
#[path = "guest-probe/cid.rs"]
mod cid;
#[path = "guest-probe/load.rs"]
mod loadgen;
#[path = "guest-probe/profile.rs"]
mod profile;
#[path = "guest-probe/tick.rs"]
mod tick;
#[path = "guest-probe/write_wait.rs"]
mod write_wait;
#[path = "guest-probe/zombies.rs"]
mod zombies;

fn usage(msg: &str) -> ExitCode {
    eprintln!("guest-probe: usage error: {msg}");
    ExitCode::from(2)
}

/// Blocks SIGTERM in this thread (threads spawned later inherit it) so `wait_term` can
/// take it synchronously.
fn block_term() {
    // SAFETY: plain libc calls on a local, zero-initialised sigset_t.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

fn wait_term() {
    // SAFETY: as in `block_term`; sigwait writes the signal number into a local.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        let mut sig = 0;
        libc::sigwait(&set, &mut sig);
    }
}

fn b64(input: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[derive(Debug, PartialEq)]
enum Signin {
    Ok,
    Fail,
    Error(String),
}

/// One sign-in the way Radicale 3.9's dovecot backend does it.
fn signin(socket: &str, user: &str, pass: &str) -> Signin {
    let run = || -> std::io::Result<Signin> {
        let mut s = UnixStream::connect(socket)?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        let mut buf = [0u8; 1024];
        // ONE recv for the whole greeting, as Radicale does.
        let n = s.read(&mut buf)?;
        let greeting = String::from_utf8_lossy(&buf[..n]).into_owned();
        if !greeting.contains("VERSION\t1\t") || !greeting.ends_with("DONE\n") {
            return Ok(Signin::Error(format!(
                "broken server handshake ({n} bytes in one recv)"
            )));
        }
        if !greeting.contains("MECH\tPLAIN") {
            return Ok(Signin::Error("no PLAIN mechanism".into()));
        }
        s.write_all(format!("VERSION\t1\t1\nCPID\t{}\n", std::process::id()).as_bytes())?;
        let resp = b64(format!("\0{user}\0{pass}").as_bytes());
        s.write_all(
            format!("AUTH\t1\tPLAIN\tservice=radicale\trip=10.0.2.2\tresp={resp}\n").as_bytes(),
        )?;
        let n = s.read(&mut buf)?;
        let reply = String::from_utf8_lossy(&buf[..n]);
        Ok(if reply.starts_with("OK\t1") {
            Signin::Ok
        } else if reply.starts_with("FAIL\t1") {
            Signin::Fail
        } else {
            Signin::Error(format!("unexpected reply ({n} bytes)"))
        })
    };
    run().unwrap_or_else(|e| Signin::Error(e.to_string()))
}

/// An `AF_VSOCK` connection to `cid:port` (the shared client's dial).
fn vsock_connect(cid: u32, port: u32) -> std::io::Result<UnixStream> {
    qemu_harness::load::Target::Vsock { cid, port }.connect(Duration::from_secs(30))
}

/// Sends `msg`, reads what comes back within 10 s: `Ok(Some(reply))`, or `Ok(None)` when
/// the peer closed without a byte.
fn exchange(s: &mut UnixStream, msg: &[u8]) -> std::io::Result<Option<Vec<u8>>> {
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    // A refused connection may already be closed: a failed write is a refusal too.
    if let Err(e) = s.write_all(msg) {
        if matches!(
            e.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        ) {
            return Ok(None);
        }
        return Err(e);
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while got.len() < msg.len() {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => return Err(e),
        }
    }
    Ok(if got.is_empty() { None } else { Some(got) })
}

fn serve_echo(path: &str) -> std::io::Result<()> {
    let _ = std::fs::remove_file(path);
    if let Some(dir) = std::path::Path::new(path).parent() {
        std::fs::create_dir_all(dir)?;
    }
    let l = UnixListener::bind(path)?;
    say!("serve-echo listening at {path}");
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                loop {
                    match c.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if c.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
            });
        }
    });
    Ok(())
}

fn last_words(socket: &str, words: &str) -> bool {
    let present = |p: &str| {
        if std::path::Path::new(p).exists() {
            "present"
        } else {
            "MISSING"
        }
    };
    say!(
        "last-words waiting for SIGTERM (socket {socket} {})",
        present(socket)
    );
    wait_term();
    say!("last-words got SIGTERM (socket {})", present(socket));
    let run = || -> std::io::Result<String> {
        let mut s = UnixStream::connect(socket)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        s.write_all(words.as_bytes())?;
        s.write_all(b"\n")?;
        // Wait for the host's acknowledgement: the bytes arrived before we go.
        let mut ack = Vec::new();
        let mut b = [0u8; 1];
        while s.read(&mut b)? == 1 && b[0] != b'\n' {
            ack.push(b[0]);
        }
        Ok(String::from_utf8_lossy(&ack).into_owned())
    };
    match run() {
        Ok(ack) => {
            say!("last-words sent, host said {ack:?}");
            ack == "ack"
        }
        Err(e) => {
            say!("last-words failed: {e}");
            false
        }
    }
}

fn vsock_probe(cid: u32, port: u32) -> bool {
    match vsock_connect(cid, port) {
        Ok(mut s) => match exchange(&mut s, b"hello\n") {
            Ok(None) => {
                say!("vsock-connect {cid}:{port} closed without data");
                true
            }
            Ok(Some(d)) => {
                say!("vsock-connect {cid}:{port} got {} bytes", d.len());
                true
            }
            Err(e) => {
                say!("vsock-connect {cid}:{port} error after connect: {e}");
                true
            }
        },
        Err(e) => {
            say!("vsock-connect {cid}:{port} failed: {e}");
            true
        }
    }
}

/// `SUBCOMMAND N --socket PATH --try USER:PASS` → (N, PATH, USER, PASS).
fn count_socket_try(
    args: &[String],
    opt: impl Fn(&str) -> Option<String>,
) -> Option<(usize, String, String, String)> {
    let n = args.get(1)?.parse().ok()?;
    let t = opt("--try")?;
    let (user, pass) = t.split_once(':')?;
    Some((n, opt("--socket")?, user.to_string(), pass.to_string()))
}

fn main() -> ExitCode {
    if std::process::id() == 1 {
        // `rdinit=/bin/guest-probe`: the profiling pre-init, which becomes guest-init.
        profile::pre_init();
    }
    block_term();
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let then_sleep = args.last().is_some_and(|a| a == "--then-sleep");
    if then_sleep {
        args.pop();
    }
    let Some(cmd) = args.first().cloned() else {
        return usage("no subcommand (signin, burst, signin-timed, serve-echo, zombies, last-words, vsock-connect, cid-test, load, write-and-wait)");
    };
    let opt = |name: &str| -> Option<String> {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let all = |name: &str| -> Vec<String> {
        args.windows(2)
            .filter(|w| w[0] == name)
            .map(|w| w[1].clone())
            .collect()
    };
    let ok = match cmd.as_str() {
        "signin" => {
            let Some(socket) = opt("--socket") else {
                return usage("signin needs --socket PATH");
            };
            let mut ok = true;
            for t in all("--try") {
                let Some((user, pass)) = t.split_once(':') else {
                    return usage("--try USER:PASS");
                };
                match signin(&socket, user, pass) {
                    Signin::Ok => say!("signin {user} OK"),
                    Signin::Fail => say!("signin {user} FAIL"),
                    Signin::Error(e) => {
                        say!("signin {user} ERROR {e}");
                        ok = false;
                    }
                }
            }
            ok
        }
        "burst" => {
            let Some((n, socket, user, pass)) = count_socket_try(&args, opt) else {
                return usage("burst N --socket PATH --try USER:PASS");
            };
            let (user, pass) = (user.as_str(), pass.as_str());
            let barrier = Arc::new(Barrier::new(n));
            let start = Instant::now();
            let handles: Vec<_> = (0..n)
                .map(|_| {
                    let (b, s, u, p) = (
                        barrier.clone(),
                        socket.clone(),
                        user.to_string(),
                        pass.to_string(),
                    );
                    std::thread::Builder::new()
                        .stack_size(128 * 1024)
                        .spawn(move || {
                            b.wait();
                            signin(&s, &u, &p)
                        })
                })
                .collect();
            let (mut okc, mut fail, mut err) = (0, 0, 0);
            let mut first_err = None;
            for h in handles {
                match h
                    .map_err(|e| e.to_string())
                    .and_then(|h| h.join().map_err(|_| "panic".into()))
                {
                    Ok(Signin::Ok) => okc += 1,
                    Ok(Signin::Fail) => fail += 1,
                    Ok(Signin::Error(e)) => {
                        err += 1;
                        first_err.get_or_insert(e);
                    }
                    Err(e) => {
                        err += 1;
                        first_err.get_or_insert(e);
                    }
                }
            }
            say!(
                "burst ok={okc} fail={fail} err={err} in {} ms{}",
                start.elapsed().as_millis(),
                first_err
                    .map(|e| format!(" (first error: {e})"))
                    .unwrap_or_default()
            );
            okc == n
        }
        "signin-timed" => {
            let Some((n, socket, user, pass)) = count_socket_try(&args, opt) else {
                return usage("signin-timed N --socket PATH --try USER:PASS");
            };
            let (user, pass) = (user.as_str(), pass.as_str());
            let (mut okc, mut fail, mut err) = (0, 0, 0);
            let mut micros = Vec::with_capacity(n);
            let mut first_err = None;
            for _ in 0..n {
                let t = Instant::now();
                match signin(&socket, user, pass) {
                    Signin::Ok => {
                        okc += 1;
                        micros.push(t.elapsed().as_micros());
                    }
                    Signin::Fail => fail += 1,
                    Signin::Error(e) => {
                        err += 1;
                        first_err.get_or_insert(e);
                    }
                }
            }
            micros.sort_unstable();
            // Nearest rank, as the host side's percentiles.
            let pct = |p: usize| -> u128 {
                match micros.len() {
                    0 => 0,
                    len => micros[((p * len).div_ceil(100)).clamp(1, len) - 1],
                }
            };
            say!(
                "signin-timed ok={okc} fail={fail} err={err} p50_us={} p99_us={}{}",
                pct(50),
                pct(99),
                first_err
                    .map(|e| format!(" (first error: {e})"))
                    .unwrap_or_default()
            );
            okc == n
        }
        "serve-echo" => {
            let Some(path) = args.get(1) else {
                return usage("serve-echo PATH");
            };
            match serve_echo(path) {
                Ok(()) => {
                    wait_term();
                    true
                }
                Err(e) => {
                    say!("serve-echo failed: {e}");
                    false
                }
            }
        }
        "zombies" => {
            let Some(n) = args.get(1).and_then(|n| n.parse().ok()) else {
                return usage("zombies N");
            };
            zombies::zombies(n)
        }
        "last-words" => {
            let (Some(socket), Some(words)) = (opt("--socket"), opt("--words")) else {
                return usage("last-words --socket PATH --words TEXT");
            };
            return if last_words(&socket, &words) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            };
        }
        "vsock-connect" => {
            let cid = opt("--cid").and_then(|c| c.parse().ok());
            let ports: Vec<u32> = all("--port")
                .iter()
                .filter_map(|p| p.parse().ok())
                .collect();
            let Some(cid) = cid.filter(|_| !ports.is_empty()) else {
                return usage("vsock-connect --cid C --port P [--port P...]");
            };
            ports.iter().all(|p| vsock_probe(cid, *p))
        }
        "cid-test" => {
            let (Some(relay), Some(port), Some(echo)) = (
                opt("--relay"),
                opt("--port").and_then(|p| p.parse().ok()),
                opt("--echo"),
            ) else {
                return usage("cid-test --relay BIN --port P --echo PATH --config LABEL=FILE...");
            };
            let configs: Vec<(String, String)> = all("--config")
                .iter()
                .filter_map(|c| {
                    c.split_once('=')
                        .map(|(a, b)| (a.to_string(), b.to_string()))
                })
                .collect();
            cid::cid_test(&relay, port, &echo, &configs)
        }
        "load" => match loadgen::Plan::parse(opt, all) {
            Ok(plan) => loadgen::run(&plan),
            Err(e) => return usage(&e),
        },
        "rtt" => {
            let (Some(target), Some(ms)) = (args.get(1), args.get(2).and_then(|n| n.parse().ok()))
            else {
                return usage("rtt TARGET MS");
            };
            return if profile::rtt_once(target, ms) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            };
        }
        "write-and-wait" => {
            let (Some(path), Some(size)) = (args.get(1), args.get(2).and_then(|n| n.parse().ok()))
            else {
                return usage("write-and-wait PATH SIZE [--ignore-term]");
            };
            let ignore = args.iter().any(|a| a == "--ignore-term");
            return if write_wait::run(path, size, ignore) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            };
        }
        "tick" => {
            let Some(path) = args.get(1) else {
                return usage("tick PATH");
            };
            tick::tick(path)
        }
        "size" => {
            let Some(path) = args.get(1) else {
                return usage("size PATH");
            };
            tick::size(path)
        }
        other => return usage(&format!("unknown subcommand {other:?}")),
    };
    say!("{cmd} done: {}", if ok { "pass" } else { "FAILED" });
    if then_sleep {
        wait_term();
        say!("SIGTERM, exiting");
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_radicale_bytes() {
        // From the notes: Radicale sent resp=AGFsaWNlAHNlY3JldDEyMw== for alice/secret123.
        assert_eq!(b64(b"\0alice\0secret123"), "AGFsaWNlAHNlY3JldDEyMw==");
        assert_eq!(b64(b"ab"), "YWI=");
        assert_eq!(b64(b"abc"), "YWJj");
    }
}
