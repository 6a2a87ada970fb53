//! Shared by the `relay_*` tests: a `host-relay` process with its log, the
//! guest-side forwarder (guest-init's library) standing in for a VM, and a recording
//! service that notes who connected where.
//!
//! The relay runs as the real binary (`host-relay run --config`), so what is tested is
//! what ships: configuration loading, binding, dropping privileges, signals, log lines.
//! Its stderr is collected line by line; tests wait for its `ready` line before
//! connecting and assert on its `admitted` / `refused` lines.

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::MutexGuard;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use e2e::util;

/// A running `host-relay run`.
pub struct RelayProc {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl RelayProc {
    /// Writes `config` to `dir/<name>.json`, starts the relay and waits for `ready`.
    pub fn start(dir: &Path, name: &str, config: &serde_json::Value) -> RelayProc {
        let path = dir.join(format!("{name}.json"));
        std::fs::write(&path, serde_json::to_vec_pretty(config).unwrap()).unwrap();
        let mut child = Command::new(util::host_bin("host-relay"))
            .args(["run", "--config"])
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn host-relay");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        let mut me = RelayProc { child, lines };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !me.log().contains(" ready ") {
            if let Ok(Some(status)) = me.child.try_wait() {
                // Let the reader thread collect the last lines.
                std::thread::sleep(Duration::from_millis(100));
                panic!("host-relay exited ({status}) before ready:\n{}", me.log());
            }
            assert!(
                Instant::now() < deadline,
                "host-relay not ready:\n{}",
                me.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        me
    }

    /// Everything the relay logged so far.
    pub fn log(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// Waits until a log line contains every one of `needles`; returns that line.
    pub fn wait_for_line(&self, needles: &[&str]) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(l) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|l| needles.iter().all(|n| l.contains(n)))
            {
                return l.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no log line with {needles:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn stop(mut self) -> ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "host-relay did not stop on SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for RelayProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A config for one app in per-VM-socket mode with a dovecot-auth service on 5001 and
/// the undeclared platform service `agent` on 5003.
pub fn per_vm_config(
    app: &str,
    vsock_uds: &Path,
    upstream: &Path,
    dovecot: serde_json::Value,
) -> serde_json::Value {
    // The platform's per-app address pool; every dovecot-auth service must name it.
    let mut dovecot = dovecot;
    if dovecot.get("reserved_networks").is_none() {
        dovecot["reserved_networks"] = serde_json::json!(["100.64.0.0/10"]);
    }
    serde_json::json!({
        "app": app,
        "vm": {"id": format!("vm-{app}"), "gateways": ["10.0.2.2"]},
        "transport": {"per_vm_socket": {"vsock_uds": vsock_uds}},
        "services": [{"name": "dovecot-auth", "port": 5001, "kind": "dovecot-auth",
                      "upstream": {"unix": upstream}, "dovecot": dovecot}],
        "undeclared": [{"name": "agent", "port": 5003}]
    })
}

/// The hybrid-vsock socket a guest's connection to host port `port` arrives on.
pub fn port_path(vsock_uds: &Path, port: u32) -> PathBuf {
    PathBuf::from(format!("{}_{port}", vsock_uds.display()))
}

/// Starts guest-init's forwarder (the guest side): the app's socket at `listen`,
/// forwarded to `target` (the VMM's `<uds>_<port>`, standing in for vsock CID 2).
pub async fn forwarder(listen: &Path, target: &Path) -> guest_init::forward::Forwarders {
    let spec: guest_init::forward::ServiceSpec = serde_json::from_value(serde_json::json!({
        "name": "dovecot-auth", "listen": listen, "target": {"unix": target}, "mode": "0666"
    }))
    .unwrap();
    guest_init::forward::start(&[spec], &[])
        .await
        .expect("start the guest-init forwarder")
}

/// Raises this process's open-file limit to its hard limit (bursts hold many sockets).
pub fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
}

/// One connection a [`Recorder`] saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    /// Which endpoint it arrived on.
    pub endpoint: String,
    /// `SO_PEERCRED` uid and gid.
    pub uid: u32,
    /// gid.
    pub gid: u32,
    /// The first line it sent.
    pub first_line: String,
}

/// A stand-in service with several endpoints (e.g. one per app) that records, for every
/// connection, the endpoint, the caller's `SO_PEERCRED` and the first line, then answers
/// `hello <endpoint>\n`.
pub struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Recorder {
    /// Listens at each `(name, path)`; sockets are mode 0666.
    pub fn start(endpoints: &[(&str, PathBuf)]) -> Recorder {
        use std::io::Write;
        use std::os::unix::fs::PermissionsExt;
        let seen = Arc::new(Mutex::new(Vec::new()));
        for (name, path) in endpoints {
            let l = UnixListener::bind(path).unwrap();
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).unwrap();
            let (name, seen) = (name.to_string(), seen.clone());
            std::thread::spawn(move || {
                for s in l.incoming() {
                    let Ok(mut s) = s else { continue };
                    let (name, seen) = (name.clone(), seen.clone());
                    std::thread::spawn(move || {
                        let cred = nix::sys::socket::getsockopt(
                            &s,
                            nix::sys::socket::sockopt::PeerCredentials,
                        )
                        .unwrap();
                        let mut first_line = String::new();
                        let _ = BufReader::new(&s).read_line(&mut first_line);
                        seen.lock().unwrap().push(Seen {
                            endpoint: name.clone(),
                            uid: cred.uid(),
                            gid: cred.gid(),
                            first_line: first_line.trim_end().to_string(),
                        });
                        let _ = s.write_all(format!("hello {name}\n").as_bytes());
                    });
                }
            });
        }
        Recorder { seen }
    }

    /// What was seen so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// Connects to `path`, sends `line`, and returns what comes back until EOF (or an error).
pub fn exchange(path: &Path, line: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(path)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    s.write_all(line.as_bytes())?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// One machine-heavy test at a time in this binary: every VM (QEMU under TCG takes a whole
/// core) and every burst. They were separate test binaries once, which cargo runs one
/// after another; in one binary they would otherwise run side by side and starve each
/// other's timeouts. Light tests still run in parallel.
pub fn heavy_lock() -> MutexGuard<'static, ()> {
    static HEAVY: Mutex<()> = Mutex::new(());
    HEAVY.lock().unwrap_or_else(|e| e.into_inner())
}
