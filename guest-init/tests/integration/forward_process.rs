//! Forwarding observed from outside a process: its console lines, and its behaviour when
//! the process runs out of descriptors.
//!
//! The forwarder runs in a child process (this test binary re-executed with the ignored
//! `child_forwarder` entry point), so the test can read the console lines it writes to its
//! stderr and can lower *its* descriptor limit without starving the test itself.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;

use crate::support::forward::*;
use guest_init::forward::{self, ServiceSpec};

const CHILD_ENV: &str = "FORWARD_TEST_CHILD";
const READY: &str = "FORWARD_CHILD_READY";

/// Not a test: the body of the child process the tests below start. It starts the
/// forwarders described in `$FORWARD_TEST_CHILD`, optionally leaves itself only a few
/// spare descriptors, says `FORWARD_CHILD_READY` on stdout and serves until stdin closes.
#[test]
#[ignore = "run by the other tests in this file as their child process"]
fn child_forwarder() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (services, spare_fds): (Vec<ServiceSpec>, Option<u64>) =
        serde_json::from_str(&spec).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let _fwd = forward::start(&services, &[]).await.unwrap();
        // Let the accept loops take their first step (each reserves a descriptor), so the
        // parent counts a settled process.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        if let Some(spare) = spare_fds {
            // New descriptors take the lowest free number below the limit: pick the limit
            // that leaves exactly `spare` free numbers. (`read_dir` lists its own
            // descriptor too, which is closed again afterwards: a free number.)
            let mut open: Vec<u64> = std::fs::read_dir("/proc/self/fd")
                .unwrap()
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
                .collect();
            open.sort_unstable();
            open.pop(); // the highest is read_dir's own
            let mut limit = 0;
            while limit - open.iter().filter(|&&fd| fd < limit).count() as u64 != spare {
                limit += 1;
            }
            nix::sys::resource::setrlimit(
                nix::sys::resource::Resource::RLIMIT_NOFILE,
                limit,
                limit,
            )
            .unwrap();
        }
        println!("{READY}");
        std::io::stdout().flush().unwrap();
        // Serve until the parent closes our stdin.
        tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
        })
        .await
        .unwrap();
    });
}

/// A running child forwarder; killed when dropped.
struct ChildForwarder {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl ChildForwarder {
    fn start(services: &[ServiceSpec], spare_fds: Option<u64>) -> Self {
        let spec = serde_json::to_string(&(services, spare_fds)).unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "forward_process::child_forwarder",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx2.send(line);
            }
        });
        let stdout = child.stdout.take().unwrap();
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.contains(READY) {
                    let _ = ready_tx.send(());
                }
            }
        });
        let mut me = ChildForwarder {
            child,
            stdin,
            lines,
            seen: Vec::new(),
        };
        if ready_rx.recv_timeout(HANG).is_err() {
            me.drain();
            panic!(
                "the child forwarder did not get ready; its stderr:\n{}",
                me.seen.join("\n")
            );
        }
        drop(tx);
        me
    }

    fn drain(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            self.seen.push(l);
        }
    }

    /// Waits for a console line that satisfies `want`, returning it.
    fn wait_line(&mut self, what: &str, want: impl Fn(&str) -> bool) -> String {
        if let Some(l) = self.seen.iter().find(|l| want(l)) {
            return l.clone();
        }
        let deadline = std::time::Instant::now() + HANG;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if want(&l) {
                        return l;
                    }
                }
                Err(_) => panic!("no console line {what}; saw:\n{}", self.seen.join("\n")),
            }
        }
    }
}

impl Drop for ChildForwarder {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An echo service on a Unix path, one thread per connection, closing after the caller's
/// end of stream.
fn echo_server(path: &Path) {
    let l = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
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
}

fn connect(path: &Path) -> UnixStream {
    let c = UnixStream::connect(path).unwrap();
    c.set_read_timeout(Some(HANG)).unwrap();
    c
}

fn echo_once(c: &mut UnixStream, msg: &[u8]) {
    c.write_all(msg).unwrap();
    let mut got = vec![0u8; msg.len()];
    c.read_exact(&mut got).unwrap();
    assert_eq!(got, msg);
}

fn paths(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("app.sock"), dir.join("host.sock"))
}

#[test]
fn a_dead_target_is_logged_once_with_service_and_target_then_served_when_up() {
    let dir = tempfile::tempdir().unwrap();
    let (app, host) = paths(dir.path());
    let mut spec = service("dead-svc", &app, unix(&host));
    spec.dial = quick_dial();
    let mut child = ChildForwarder::start(&[spec], None);
    child.wait_line("announcing the listener", |l| {
        l.contains("guest-init: service dead-svc: listening at unix:")
    });

    let mut c = connect(&app);
    c.write_all(b"hello?").unwrap();
    let mut buf = [0u8; 16];
    match c.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.raw_os_error() == Some(libc::ECONNRESET) => {}
        other => panic!("expected the connection to be closed, got {other:?}"),
    }
    let target = format!("unix:{}", host.display());
    let line = child.wait_line("about the dead target", |l| l.contains("cannot reach"));
    assert!(
        line.contains("error: service dead-svc: cannot reach"),
        "{line}"
    );
    assert!(line.contains(&target), "{line}");
    assert!(line.contains("gave up after 3 attempts"), "{line}");
    assert!(line.contains("No such file or directory"), "{line}");

    echo_server(&host);
    let mut c = connect(&app);
    echo_once(&mut c, b"and now?");
}

#[test]
fn the_accept_loop_survives_running_out_of_descriptors() {
    let dir = tempfile::tempdir().unwrap();
    let (app, host) = paths(dir.path());
    echo_server(&host);
    // Two spare descriptors: exactly one relayed connection (caller + target) at a time.
    let mut child = ChildForwarder::start(&[service("tight", &app, unix(&host))], Some(2));

    let mut first = connect(&app);
    echo_once(&mut first, b"first");
    // These two wait in the backlog: accepting them fails with EMFILE for now.
    let mut second = connect(&app);
    second.write_all(b"second").unwrap();
    let mut third = connect(&app);
    third.write_all(b"third").unwrap();
    let line = child.wait_line("about EMFILE", |l| l.contains("accept failed"));
    assert!(
        line.contains("warning: service tight: accept failed (out of resources)"),
        "{line}"
    );
    assert!(line.contains("Too many open files"), "{line}");

    // Freeing the first connection's descriptors lets the loop take the next one, and so on.
    drop(first);
    let mut got = [0u8; 6];
    second.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"second");
    drop(second);
    let mut got = [0u8; 5];
    third.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"third");
    // Still serving.
    drop(third);
    let mut fourth = connect(&app);
    echo_once(&mut fourth, b"fourth");
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn an_idle_connection_costs_two_descriptors() {
    vm_transport::fdlimit::raise_fd_limit().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (app, host) = paths(dir.path());
    // The target accepts and holds every connection without reading.
    let l = UnixListener::bind(&host).unwrap();
    let (tx, accepted) = mpsc::channel();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in l.incoming() {
            held.push(c.unwrap());
            let _ = tx.send(held.len());
        }
    });
    let child = ChildForwarder::start(&[service("cost", &app, unix(&host))], None);
    let pid = child.child.id();
    let (fds_before, rss_before) = (fd_count(pid), rss_kib(pid));
    const N: usize = 500;
    let mut clients = Vec::new();
    for _ in 0..N {
        clients.push(connect(&app));
    }
    for _ in 0..N {
        accepted.recv_timeout(HANG).expect("target accepts");
    }
    // Every connection is now relayed: accepted and dialled. The relay holds the caller's
    // socket and the target's, nothing else (no pipe pairs, no timers with descriptors).
    let fds_after = fd_count(pid);
    assert_eq!(fds_after - fds_before, 2 * N, "descriptors per connection");
    let rss_after = rss_kib(pid);
    println!(
        "MEASURED: {N} idle relayed connections: +{} descriptors, RSS {} KiB -> {} KiB ({:.1} KiB per connection)",
        fds_after - fds_before,
        rss_before,
        rss_after,
        (rss_after.saturating_sub(rss_before)) as f64 / N as f64
    );
    drop(clients);
}
