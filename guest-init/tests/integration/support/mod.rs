//! Helpers shared by guest-init's integration tests: the binary, scratch directories,
//! requirement checks and a console-capturing runner for guest-init as an ordinary process
//! or as PID 1 of a fresh PID + mount (+ UTS + network) namespace.
//!
//! Scratch directories never live under `/tmp` or `/run`: as PID 1, guest-init mounts a
//! fresh tmpfs on each (in its private mount namespace) when nothing is mounted there,
//! which would hide a test's files from the app. They go under Cargo's target tmp dir, or
//! `/var/tmp` when the checkout itself is under `/tmp` (a CI clone may well be).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub mod forward;

/// The guest-init binary under test.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_guest-init")
}

/// A scratch directory that guest-init's own mounts cannot hide (see the module doc).
pub fn scratch() -> tempfile::TempDir {
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let hidden = target.starts_with("/tmp") || target.starts_with("/run");
    let base = if hidden {
        Path::new("/var/tmp")
    } else {
        target
    };
    tempfile::tempdir_in(base).expect("scratch dir")
}

/// Writes `json` as `guest-init.json` in `dir` and returns its path.
pub fn write_config(dir: &Path, json: &serde_json::Value) -> PathBuf {
    let p = dir.join("guest-init.json");
    std::fs::write(&p, serde_json::to_vec_pretty(json).unwrap()).unwrap();
    p
}

/// Writes an executable shell script.
pub fn write_script(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    // Other tests' app users (uid 20001) must be able to enter the scratch dir.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    p
}

/// `true` when the requirement holds; otherwise fails under `REQUIRE_ALL=1` or prints
/// `SKIPPED: <why>` and returns false.
pub fn require(ok: bool, why: &str) -> bool {
    if ok {
        return true;
    }
    if std::env::var("REQUIRE_ALL").as_deref() == Ok("1") {
        panic!("missing requirement (REQUIRE_ALL=1): {why}");
    }
    println!("SKIPPED: {why}");
    false
}

/// Root and the `unshare` tool, needed to run guest-init as PID 1 of a namespace.
pub fn require_namespaces() -> bool {
    require(
        nix::unistd::geteuid().is_root(),
        "PID-1 tests need root (to create PID and mount namespaces)",
    ) && require(
        Command::new("unshare")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false),
        "the `unshare` tool (util-linux) is not installed",
    )
}

/// A running guest-init whose console (stderr) is captured.
pub struct Running {
    pub child: Child,
    console: Arc<Mutex<String>>,
    pub pid1: bool,
}

/// Upper bound for any single wait in these tests: a hang fails the test instead of
/// blocking the run. It is a safety net, never an assertion about speed.
pub const HANG: Duration = Duration::from_secs(90);

impl Running {
    fn spawn(mut cmd: Command, pid1: bool) -> Running {
        cmd.stdin(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn guest-init");
        let console = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let c = console.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut c = c.lock().unwrap();
                c.push_str(&line);
                c.push('\n');
            }
        });
        Running {
            child,
            console,
            pid1,
        }
    }

    /// guest-init as an ordinary process.
    pub fn ordinary(config: &Path) -> Running {
        let mut cmd = Command::new(bin());
        cmd.arg("--config").arg(config);
        Running::spawn(cmd, false)
    }

    /// guest-init as an ordinary process started with this open-file limit (soft, hard).
    pub fn ordinary_with_nofile(config: &Path, soft: u64, hard: u64) -> Running {
        let mut cmd = Command::new("prlimit");
        cmd.arg(format!("--nofile={soft}:{hard}"))
            .arg("--")
            .arg(bin())
            .arg("--config")
            .arg(config);
        Running::spawn(cmd, false)
    }

    /// guest-init as PID 1 of fresh PID, mount, UTS and network namespaces.
    pub fn pid1(config: &Path) -> Running {
        let config = config.to_str().expect("a UTF-8 config path");
        Running::pid1_args(&["--config", config])
    }

    /// guest-init as PID 1 with arbitrary arguments (what a kernel command line may pass).
    pub fn pid1_args(args: &[&str]) -> Running {
        let mut cmd = Command::new("unshare");
        cmd.args([
            "--fork",
            "--pid",
            "--mount",
            "--mount-proc",
            "--uts",
            "--net",
        ])
        .arg(bin())
        .args(args);
        Running::spawn(cmd, true)
    }

    /// The console so far.
    pub fn console(&self) -> String {
        self.console.lock().unwrap().clone()
    }

    /// Waits until the console contains `needle`.
    pub fn wait_for_line(&self, needle: &str) {
        let deadline = Instant::now() + HANG;
        while !self.console().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "no {needle:?} on the console:\n{}",
                self.console()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The host-side pid of guest-init (for PID 1: the namespace's init, unshare's child).
    pub fn guest_init_pid(&self) -> i32 {
        let outer = self.child.id() as i32;
        if !self.pid1 {
            return outer;
        }
        let deadline = Instant::now() + HANG;
        loop {
            for ent in std::fs::read_dir("/proc").unwrap().flatten() {
                let Some(pid) = ent.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                    continue;
                };
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                let ppid = stat
                    .rfind(')')
                    .and_then(|i| stat[i + 1..].split_whitespace().nth(1))
                    .and_then(|s| s.parse::<i32>().ok());
                if ppid == Some(outer) {
                    return pid;
                }
            }
            assert!(Instant::now() < deadline, "unshare's child not found");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends a signal to guest-init.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.guest_init_pid()), sig)
            .expect("signal guest-init");
    }

    /// Waits for the end; returns the status and the whole console.
    pub fn wait(mut self) -> (ExitStatus, String) {
        let deadline = Instant::now() + HANG;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                // Let the reader thread drain the pipe.
                std::thread::sleep(Duration::from_millis(50));
                return (st, self.console());
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("guest-init did not end; console:\n{}", self.console());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Waits until a file exists (written by the app).
pub fn wait_for_file(p: &Path) {
    let deadline = Instant::now() + HANG;
    while !p.exists() {
        assert!(Instant::now() < deadline, "{} never appeared", p.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Reads a file the app wrote, trimmed; empty if it does not exist.
pub fn read(p: &Path) -> String {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// The orderly power-off as seen from outside a PID namespace: `reboot(RB_POWER_OFF)` in a
/// PID namespace kills its init as if by SIGINT, and `unshare` re-raises that signal.
pub fn assert_powered_off(st: ExitStatus, console: &str) {
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        st.signal(),
        Some(libc::SIGINT),
        "expected the namespace's poweroff (SIGINT), got {st:?}; console:\n{console}"
    );
    let last = console.lines().last().unwrap_or_default();
    assert!(
        last.ends_with("guest-init: powering off"),
        "the last console line must be the power-off line, got {last:?}; console:\n{console}"
    );
    assert!(
        !console.contains("panicked at") && !console.contains("Aborted"),
        "a Rust panic message or abort reached the console:\n{console}"
    );
}

/// A management CA certificate (EC P-256, self-signed through guest-init's own signer),
/// standard base64 of its DER: what bootstrap material pins in `management_ca`.
pub fn management_ca_b64() -> String {
    use base64::Engine;
    use guest_init::enroll::keystore::{P256Key, RcgenSigner};
    let key = P256Key::generate("test").expect("generate a CA key");
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name
        .push(rcgen::DnType::CommonName, "test management CA");
    p.serial_number = Some(vec![1].into());
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    p.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign];
    let cert = p.self_signed(&RcgenSigner(&key)).expect("self-sign the CA");
    base64::engine::general_purpose::STANDARD.encode(cert.der())
}
