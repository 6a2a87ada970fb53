//! Enrollment end to end: the real `guest-init enroll` against the reference enrollment
//! service, through the real `host-relay run` in Unix mode.
//!
//! Topology per test: the service listens on one Unix socket per registered VM
//! (`svc-<vm>.sock`); host-relay, configured for VM `vm-1` in Unix mode, listens on the
//! guest-facing socket (`relay.sock`, what would be vsock port 5002 in a VM) and connects
//! each connection to that VM's service socket, so the service learns the calling VM from
//! the socket the connection arrived on. guest-init's `enrollment.service` points at the
//! relay's socket (in a VM it is vsock CID 2 and the material's port).
//!
//! Every guest run has debug logging on; each test ends by scanning everything the guest
//! and the relay printed for the token and the key in hex, base64 and PEM forms.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use e2e::enroll_service::EnrollService;
use e2e::util::host_bin;
use guest_init::enroll::identity::Identity;
use guest_init::enroll::ErrorCode;
use p256::pkcs8::DecodePrivateKey;
use x509_parser::prelude::*;

/// The reference service's seed-002 denials (current identity, expired issued
/// certificate, capacity) as the guest sees them.
mod denials;
/// The pinned management CA (a second CA on the enrollment port) and the guest clock.
mod pinned_ca;
/// Renewal over mutual TLS with the enrolled key, without the token.
mod renewal;
/// The state machine with the TPM store (swtpm, no VM).
mod tpm;

const VM: &str = "vm-1";

fn identity(vm: &str, epoch: u64) -> Identity {
    Identity {
        workspace_namespace: "team-a".into(),
        workspace_name: "ws1".into(),
        workspace_uid: "0b4c5e2a-1111-2222-3333-444455556666".into(),
        vm_uid: vm.into(),
        epoch,
    }
}

fn new_token(tag: &str) -> String {
    // Distinct per test and call; the alphabet of a base64url token.
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("tok_{tag}_{n}_SECRETVALUEabcdefghijklmnop")
}

struct Env {
    dir: tempfile::TempDir,
    svc: EnrollService,
    relay: Option<Child>,
    relay_log: PathBuf,
    guest_sock: PathBuf,
    /// Every byte any guest run printed.
    output: Vec<String>,
    /// Every token used.
    tokens: Vec<String>,
    /// Every key file seen (DER), for the secrets scan.
    keys: Vec<Vec<u8>>,
    /// The key store the guest uses (`file` or `memory`).
    key_store: &'static str,
}

impl Env {
    /// The service with sockets for `vms`, and host-relay for VM `relay_vm` in front.
    fn new(vms: &[&str], relay_vm: &str) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let svc = EnrollService::start().unwrap();
        for vm in vms {
            svc.listen_vm(vm, &dir.path().join(format!("svc-{vm}.sock")))
                .unwrap();
        }
        let guest_sock = dir.path().join("relay.sock");
        let relay_cfg = dir.path().join("relay.json");
        std::fs::write(
            &relay_cfg,
            serde_json::json!({
                "app": "enroll",
                "vm": {"id": relay_vm},
                "transport": {"unix": {"listen": {"enrollment": guest_sock}}},
                "services": [{
                    "name": "enrollment",
                    "port": 5002,
                    "upstream": {"unix": dir.path().join(format!("svc-{relay_vm}.sock"))},
                }],
            })
            .to_string(),
        )
        .unwrap();
        let relay_log = dir.path().join("relay.log");
        let log = std::fs::File::create(&relay_log).unwrap();
        let relay = Command::new(host_bin("host-relay"))
            .args(["run", "--config"])
            .arg(&relay_cfg)
            .env("RUST_LOG", "debug")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start host-relay");
        let mut env = Env {
            dir,
            svc,
            relay: Some(relay),
            relay_log,
            guest_sock,
            output: Vec::new(),
            tokens: Vec::new(),
            keys: Vec::new(),
            key_store: "file",
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !env.guest_sock.exists() {
            if let Some(st) = env.relay.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "host-relay exited ({st}) before listening: {}",
                    std::fs::read_to_string(&env.relay_log).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "host-relay never created {:?}",
                env.guest_sock
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        env
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn state(&self) -> PathBuf {
        self.path("state")
    }

    fn publish(&self) -> PathBuf {
        self.path("identity")
    }

    fn config(&self) -> PathBuf {
        let p = self.path("guest.json");
        if !p.exists() {
            std::fs::write(
                &p,
                serde_json::json!({
                    "log_level": "debug",
                    "enrollment": {
                        "bootstrap": {"file": self.path("bootstrap.json")},
                        "key_store": self.key_store,
                        "state_dir": self.state(),
                        "publish_dir": self.publish(),
                        "service": {"unix": self.guest_sock},
                        "timeout_ms": 60000,
                        "retry": {"initial_ms": 10, "max_ms": 50, "max_attempts": 5},
                    }
                })
                .to_string(),
            )
            .unwrap();
        }
        p
    }

    /// Registers a token (lifetime 10 min) and writes the bootstrap file (0600).
    fn provision(&mut self, id: &Identity) -> String {
        let (token, expires) = self.register("t", id, Duration::from_secs(600));
        self.write_material(&token, id, expires);
        token
    }

    /// A new token (tagged `tag`) registered with the service for `id`, valid for
    /// `lifetime`; returns it and its expiry.
    fn register(&self, tag: &str, id: &Identity, lifetime: Duration) -> (String, u64) {
        let token = new_token(tag);
        let expires = self.svc.register(&token, id, lifetime).unwrap();
        (token, expires)
    }

    fn write_material(&mut self, token: &str, id: &Identity, expires: u64) {
        let doc = self.material_doc(token, id, expires);
        write_bootstrap(&self.path("bootstrap.json"), doc.as_bytes());
    }

    /// A full guest-init configuration (an app and the `enrollment` section) for running
    /// guest-init as the long-lived supervisor, the way PID 1 enrolls at boot. `bootstrap`
    /// is the section's `bootstrap` value.
    fn supervisor_config(&self, bootstrap: serde_json::Value) -> PathBuf {
        let p = self.path("supervisor.json");
        std::fs::write(
            &p,
            serde_json::json!({
                "version": 1,
                "log_level": "debug",
                "app": {"command": ["/bin/true"], "user": 0},
                "enrollment": {
                    "bootstrap": bootstrap,
                    "key_store": self.key_store,
                    "state_dir": self.state(),
                    "publish_dir": self.publish(),
                    "service": {"unix": self.guest_sock},
                    "timeout_ms": 60000,
                    "retry": {"initial_ms": 10, "max_ms": 50, "max_attempts": 5},
                }
            })
            .to_string(),
        )
        .unwrap();
        p
    }

    /// Runs guest-init as the supervisor (`guest-init --config FILE`, an app of
    /// `/bin/true`) to the end: one boot. Returns its exit code and output.
    fn run_supervisor(&mut self) -> (i32, String) {
        let cfg = self.supervisor_config(serde_json::json!({"file": self.path("bootstrap.json")}));
        let mut c = Command::new(host_bin("guest-init"));
        c.arg("--config").arg(cfg);
        self.run(c)
    }

    /// Writes a push configuration for `guest-init enroll` (listening on `push.sock`).
    fn push_config(&self) -> PathBuf {
        let p = self.path("guest.json");
        std::fs::write(
            &p,
            serde_json::json!({
                "log_level": "debug",
                "enrollment": {
                    "bootstrap": {"push": {"listen": {"unix": self.path("push.sock")}}},
                    "key_store": self.key_store,
                    "state_dir": self.state(),
                    "publish_dir": self.publish(),
                    "service": {"unix": self.guest_sock},
                    "management_ca": self.svc.management_ca_b64(),
                    "timeout_ms": 60000,
                    "retry": {"initial_ms": 10, "max_ms": 50, "max_attempts": 5},
                }
            })
            .to_string(),
        )
        .unwrap();
        p
    }

    /// A bootstrap document for `id` and `token` (what the platform stages or pushes).
    fn material_doc(&mut self, token: &str, id: &Identity, expires: u64) -> String {
        self.tokens.push(token.to_owned());
        self.svc.material_json(token, id, expires, 5002).to_string()
    }

    fn guest(&self) -> Command {
        let mut c = Command::new(host_bin("guest-init"));
        c.args(["enroll", "--config"]).arg(self.config());
        c
    }

    /// Runs `guest-init enroll` to the end; returns its exit code and output.
    fn run_guest(&mut self) -> (i32, String) {
        self.run(self.guest())
    }

    /// Runs `cmd` (a guest-init) to the end and records its output; returns its exit code
    /// and output.
    fn run(&mut self, mut cmd: Command) -> (i32, String) {
        let out = cmd.output().expect("run guest-init");
        self.record(out)
    }

    /// Records a finished guest's output (for the secrets scan) and its key files.
    fn record(&mut self, out: std::process::Output) -> (i32, String) {
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        self.output.push(text.clone());
        self.collect_keys();
        (out.status.code().unwrap_or(-1), text)
    }

    fn spawn_guest(&self) -> Child {
        self.guest()
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn guest-init")
    }

    fn finish(&mut self, child: Child) -> (i32, String) {
        let out = child.wait_with_output().unwrap();
        self.record(out)
    }

    fn files_with(&self, ext: &str) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.state())
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.ends_with(ext) && !n.starts_with('.'))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    fn collect_keys(&mut self) {
        for k in self.files_with(".key") {
            if let Ok(der) = std::fs::read(self.state().join(&k)) {
                if !self.keys.contains(&der) {
                    self.keys.push(der);
                }
            }
        }
    }

    fn published(&self) -> Vec<u8> {
        let pem = std::fs::read_to_string(self.publish().join("cert.pem")).unwrap();
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        base64::engine::general_purpose::STANDARD
            .decode(body)
            .unwrap()
    }

    /// The secrets scan: no token and no key (DER or scalar) in any form, anywhere the
    /// guest or the relay printed.
    fn assert_no_secrets(&mut self) {
        if let Some(mut r) = self.relay.take() {
            let _ = r.kill();
            let _ = r.wait();
        }
        let mut outputs = self.output.clone();
        outputs.push(std::fs::read_to_string(&self.relay_log).unwrap_or_default());
        let mut needles: Vec<(String, String)> = Vec::new();
        for t in &self.tokens {
            needles.push(("token".into(), t.clone()));
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        for der in &self.keys {
            let sk = p256::ecdsa::SigningKey::from_pkcs8_der(der).unwrap();
            let scalar = sk.to_bytes().to_vec();
            for (what, bytes) in [("key DER", der.clone()), ("key scalar", scalar)] {
                needles.push((format!("{what} hex"), hex(&bytes)));
                needles.push((format!("{what} HEX"), hex(&bytes).to_uppercase()));
                needles.push((format!("{what} base64"), b64.encode(&bytes)));
                needles.push((
                    format!("{what} base64url"),
                    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&bytes),
                ));
                needles.push((
                    format!("{what} raw"),
                    String::from_utf8_lossy(&bytes).into(),
                ));
            }
            // PEM: the base64 body in 64-column lines; any line of it is a leak.
            for line in b64.encode(der).as_bytes().chunks(64) {
                needles.push(("key PEM line".into(), String::from_utf8_lossy(line).into()));
            }
        }
        for out in &outputs {
            for (what, n) in &needles {
                if n.len() >= 16 {
                    assert!(
                        !out.contains(n.as_str()),
                        "{what} appears in output:\n{out}"
                    );
                }
            }
            assert!(!out.contains("BEGIN PRIVATE KEY") && !out.contains("BEGIN EC PRIVATE KEY"));
        }
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some(mut r) = self.relay.take() {
            let _ = r.kill();
            let _ = r.wait();
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn write_bootstrap(path: &Path, bytes: &[u8]) {
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .unwrap();
    f.write_all(bytes).unwrap();
}

/// Pushes `doc` to the guest's push socket as root and returns the guest's answer.
///
/// Between two pushes the guest closes its listener, removes the stale socket file and
/// opens a new one: a connect in that window is refused or finds no file, so it is retried
/// (bounded).
fn push(sock: &Path, doc: &str) -> String {
    use std::io::Read;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut s = loop {
        match std::os::unix::net::UnixStream::connect(sock) {
            Ok(s) => break s,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                ) =>
            {
                assert!(Instant::now() < deadline, "the guest never listened again");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("connect {}: {e}", sock.display()),
        }
    };
    s.write_all(doc.as_bytes()).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer
}

/// The distinct CSRs the service has received.
fn distinct_csrs(svc: &EnrollService) -> Vec<Vec<u8>> {
    let mut csrs: Vec<Vec<u8>> = Vec::new();
    for c in svc.requests().into_iter().filter_map(|r| r.csr) {
        if !csrs.contains(&c) {
            csrs.push(c);
        }
    }
    csrs
}

fn cert_uris(der: &[u8]) -> Vec<String> {
    let (_, c) = X509Certificate::from_der(der).unwrap();
    c.subject_alternative_name()
        .unwrap()
        .map(|s| {
            s.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    GeneralName::URI(u) => Some(u.to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

fn cert_key(der: &[u8]) -> Vec<u8> {
    let (_, c) = X509Certificate::from_der(der).unwrap();
    c.public_key().subject_public_key.data.to_vec()
}

fn key_public(der: &[u8]) -> Vec<u8> {
    let sk = p256::ecdsa::SigningKey::from_pkcs8_der(der).unwrap();
    sk.verifying_key().to_sec1_point(false).as_bytes().to_vec()
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn fresh_guest_enrolls_and_a_second_run_changes_nothing() {
    let mut env = Env::new(&[VM], VM);
    let id = identity(VM, 0);
    let token = env.provision(&id);
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("enroll: enrolled"), "{out}");

    // One key, one CSR, one certificate, all private; the certificate is ours and names us.
    let keys = env.files_with(".key");
    assert_eq!(keys.len(), 1);
    assert_eq!(env.files_with(".csr").len(), 1);
    let key_der = std::fs::read(env.state().join(&keys[0])).unwrap();
    let cert = env.published();
    assert_eq!(Some(cert.clone()), env.svc.committed_cert(&token));
    assert_eq!(cert_key(&cert), key_public(&key_der));
    assert_eq!(cert_uris(&cert), vec![id.uri()]);
    let stored = std::fs::read(env.state().join(keys[0].replace(".key", ".crt"))).unwrap();
    assert_eq!(stored, cert);
    assert!(!env.state().join("pending.json").exists());

    // Already enrolled: no new request, same key.
    let before = env.svc.requests().len();
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("already enrolled"), "{out}");
    assert_eq!(env.svc.requests().len(), before);
    assert_eq!(env.files_with(".key"), keys);
    env.assert_no_secrets();
}

#[test]
fn killed_between_send_and_receive_resends_the_identical_csr_and_gets_the_identical_cert() {
    let mut env = Env::new(&[VM], VM);
    let id = identity(VM, 3);
    let token = env.provision(&id);
    env.svc.stall_after_commit();
    let mut child = env.spawn_guest();
    // The service has committed the CSR and holds back the answer.
    wait_until("the service to commit and stall", || env.svc.stalled() == 1);
    child.kill().unwrap();
    let (code, _) = env.finish(child);
    assert_ne!(code, 0);
    // The key and the exact CSR were persisted before the send.
    assert!(env.state().join("pending.json").exists());
    let csr_files = env.files_with(".csr");
    assert_eq!(csr_files.len(), 1);
    let csr_on_disk = std::fs::read(env.state().join(&csr_files[0])).unwrap();
    let committed = env.svc.committed_cert(&token).expect("committed");
    env.svc.release_stall();

    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("resuming the pending enrollment"), "{out}");
    let csrs: Vec<Vec<u8>> = env
        .svc
        .requests()
        .into_iter()
        .filter_map(|r| r.csr)
        .collect();
    assert!(csrs.len() >= 2, "expected the original and the retry");
    assert!(
        csrs.iter().all(|c| *c == csr_on_disk),
        "a retry sent different CSR bytes"
    );
    assert_eq!(env.published(), committed);
    assert_eq!(env.files_with(".key").len(), 1);
    env.assert_no_secrets();
}

#[test]
fn two_attempts_at_once_produce_one_csr() {
    let mut env = Env::new(&[VM], VM);
    let token = env.provision(&identity(VM, 1));
    let a = env.spawn_guest();
    let b = env.spawn_guest();
    let (ca, oa) = env.finish(a);
    let (cb, ob) = env.finish(b);
    assert_eq!((ca, cb), (0, 0), "{oa}\n{ob}");
    let mut csrs: Vec<Vec<u8>> = env
        .svc
        .requests()
        .into_iter()
        .filter_map(|r| r.csr)
        .collect();
    csrs.dedup();
    assert_eq!(csrs.len(), 1, "two different CSRs were sent");
    assert_eq!(env.files_with(".csr").len(), 1);
    assert_eq!(env.files_with(".key").len(), 1);
    assert_eq!(Some(env.published()), env.svc.committed_cert(&token));
    env.assert_no_secrets();
}

#[test]
fn expired_token_is_final_and_makes_no_second_key() {
    let mut env = Env::new(&[VM], VM);
    let id = identity(VM, 0);
    let (token, expires) = env.register("exp", &id, Duration::from_secs(60));
    env.write_material(&token, &id, expires);
    env.svc.advance_clock(Duration::from_secs(120));
    let (code, out) = env.run_guest();
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("denied (expired)"), "{out}");
    // Final: exactly one attempt, no retries.
    assert_eq!(env.svc.requests().len(), 1);
    let keys = env.files_with(".key");
    assert_eq!(keys.len(), 1);
    let (code, out) = env.run_guest();
    assert_eq!(code, 3, "{out}");
    assert_eq!(
        env.files_with(".key"),
        keys,
        "a second key was made for the same token"
    );
    assert_eq!(env.files_with(".csr").len(), 1);
    assert!(!env.publish().join("cert.pem").exists());
    env.assert_no_secrets();
}

#[test]
fn raised_epoch_gives_a_new_key_and_cert_and_removes_the_old_key_and_lower_epoch_is_refused() {
    let mut env = Env::new(&[VM], VM);
    env.provision(&identity(VM, 1));
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    let old_keys = env.files_with(".key");
    let old_cert = env.published();

    let id2 = identity(VM, 2);
    env.provision(&id2);
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    let new_keys = env.files_with(".key");
    assert_eq!(new_keys.len(), 1);
    assert_ne!(
        new_keys, old_keys,
        "the old key was reused for the new identity"
    );
    assert!(
        !env.state().join(&old_keys[0]).exists(),
        "old key file still there"
    );
    let new_cert = env.published();
    assert_ne!(new_cert, old_cert);
    assert_eq!(cert_uris(&new_cert), vec![id2.uri()]);
    let key_der = std::fs::read(env.state().join(&new_keys[0])).unwrap();
    assert_eq!(cert_key(&new_cert), key_public(&key_der));

    // A lower epoch, even with a valid registered token, is refused locally.
    let requests = env.svc.requests().len();
    env.provision(&identity(VM, 1));
    let (code, out) = env.run_guest();
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("lower than the enrolled epoch 2"), "{out}");
    assert_eq!(
        env.svc.requests().len(),
        requests,
        "a refused epoch reached the service"
    );
    assert_eq!(env.files_with(".key"), new_keys);
    assert_eq!(env.published(), new_cert);
    env.assert_no_secrets();
}

#[test]
fn a_different_vm_uid_gives_a_new_key() {
    let mut env = Env::new(&[VM], VM);
    env.provision(&identity(VM, 5));
    assert_eq!(env.run_guest().0, 0);
    let old_keys = env.files_with(".key");
    // Same epoch, new VM incarnation: a fresh key (the relay still serves this socket as
    // vm-1, so the service sees a mismatch; the guest must still never reuse the key).
    env.provision(&identity("vm-2", 5));
    let (code, out) = env.run_guest();
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("identity_mismatch"), "{out}");
    let keys = env.files_with(".key");
    assert_eq!(keys.len(), 2, "old (still enrolled) and new (pending) keys");
    assert!(keys.iter().any(|k| !old_keys.contains(k)));
    env.assert_no_secrets();
}

#[test]
fn epoch_u64_max_works() {
    let mut env = Env::new(&[VM], VM);
    let id = identity(VM, u64::MAX);
    env.provision(&id);
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    let uris = cert_uris(&env.published());
    assert_eq!(uris, vec![id.uri()]);
    assert!(uris[0].ends_with(":epoch:18446744073709551615"));
    env.assert_no_secrets();
}

#[test]
fn the_callers_vm_must_match_the_token_binding() {
    // The relay serves vm-2; the token is bound to vm-1.
    let mut env = Env::new(&[VM, "vm-2"], "vm-2");
    env.provision(&identity(VM, 0));
    let (code, out) = env.run_guest();
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("identity_mismatch"), "{out}");
    assert_eq!(env.svc.requests()[0].vm_uid, "vm-2");
    assert!(!env.publish().join("cert.pem").exists());
    env.assert_no_secrets();
}

#[test]
fn retryable_errors_are_retried_with_the_same_bytes() {
    let mut env = Env::new(&[VM], VM);
    env.provision(&identity(VM, 0));
    env.svc.fail_next(2, ErrorCode::Unavailable);
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    let reqs = env.svc.requests();
    assert_eq!(reqs.len(), 3);
    assert_eq!(reqs[0].code, Some(ErrorCode::Unavailable));
    assert!(reqs.iter().all(|r| r.csr == reqs[0].csr));
    env.assert_no_secrets();
}

#[test]
fn key_is_private_and_the_app_user_cannot_read_it() {
    let mut env = Env::new(&[VM], VM);
    env.provision(&identity(VM, 0));
    assert_eq!(env.run_guest().0, 0);
    let state = env.state();
    assert_eq!(std::fs::metadata(&state).unwrap().mode() & 0o7777, 0o700);
    assert_eq!(std::fs::metadata(&state).unwrap().uid(), 0);
    let key = state.join(&env.files_with(".key")[0]);
    let md = std::fs::metadata(&key).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o600);
    assert_eq!(md.uid(), 0);
    // Let uid 20001 traverse the temp dir, so only the state dir's own mode protects it.
    std::fs::set_permissions(env.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let as_app = |path: &Path| {
        Command::new("cat")
            .arg(path)
            .uid(20001)
            .gid(20001)
            .output()
            .unwrap()
    };
    let out = as_app(&key);
    assert!(!out.status.success(), "uid 20001 read the key");
    assert!(out.stdout.is_empty());
    // The control: the published certificate is readable by the same user.
    let out = as_app(&env.publish().join("cert.pem"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("BEGIN CERTIFICATE"));
    env.assert_no_secrets();
}

#[test]
fn memory_store_keeps_the_key_off_disk_and_needs_fresh_material_per_boot() {
    // The memory store is for the long-lived guest-init (PID 1 in a VM); each supervisor
    // run here is one boot, so its key dies with it.
    let mut env = Env::new(&[VM], VM);
    env.key_store = "memory";
    let id = identity(VM, 4);
    env.provision(&id);
    let (code, out) = env.run_supervisor();
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("key store memory"), "{out}");
    assert!(
        env.files_with(".key").is_empty(),
        "a memory-store key reached the disk"
    );
    let first = env.published();
    assert_eq!(cert_uris(&first), vec![id.uri()]);

    // The next boot: the key is gone. The same token cannot enroll a second key (the
    // service commits one CSR per token), and the guest says so.
    let (code, out) = env.run_supervisor();
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("no longer holds the enrolled key"), "{out}");
    assert!(out.contains("csr_mismatch"), "{out}");

    // Fresh material for the boot: enrolls with a new key.
    env.provision(&id);
    let (code, out) = env.run_supervisor();
    assert_eq!(code, 0, "{out}");
    let second = env.published();
    assert_ne!(cert_key(&second), cert_key(&first));
    assert!(env.files_with(".key").is_empty());
    env.assert_no_secrets();
}

#[test]
fn memory_store_keeps_the_epoch_floor_across_a_restart() {
    // Finding A: the memory store loses its key at every boot, and the epoch floor must
    // not go with it. Enroll at epoch 5, restart, offer epoch 4 (with a token the service
    // would honour): refused locally, naming both epochs.
    let mut env = Env::new(&[VM], VM);
    env.key_store = "memory";
    env.provision(&identity(VM, 5));
    let (code, out) = env.run_supervisor();
    assert_eq!(code, 0, "{out}");
    let cert = env.published();

    let requests = env.svc.requests().len();
    env.provision(&identity(VM, 4));
    let (code, out) = env.run_supervisor();
    assert_ne!(code, 0, "epoch 4 was accepted after epoch 5: {out}");
    assert!(
        out.contains("revocation epoch 4") && out.contains("epoch 5"),
        "the refusal must name both epochs: {out}"
    );
    assert_eq!(
        env.svc.requests().len(),
        requests,
        "a refused epoch reached the service"
    );
    assert_eq!(env.published(), cert, "the published certificate changed");
    env.assert_no_secrets();
}

#[test]
fn the_enroll_subcommand_refuses_the_memory_store() {
    let mut env = Env::new(&[VM], VM);
    env.key_store = "memory";
    env.provision(&identity(VM, 1));
    let (code, out) = env.run_guest();
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("key_store"), "{out}");
    assert!(env.svc.requests().is_empty(), "it reached the service");
    assert!(!env.publish().join("cert.pem").exists());
    env.assert_no_secrets();
}

#[test]
fn refused_material_at_the_top_epoch_is_no_floor() {
    // Finding B: material the service refuses (here an unregistered token at epoch
    // 2^64-1) leaves at most an unconfirmed pending record, which must not act as a floor.
    let mut env = Env::new(&[VM], VM);
    let rogue = new_token("rogue");
    env.write_material(&rogue, &identity(VM, u64::MAX), 4_000_000_000);
    let (code, out) = env.run_guest();
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("denied (denied)"), "{out}");

    let id = identity(VM, 5);
    env.provision(&id);
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "the refused material blocked enrollment: {out}");
    assert_eq!(cert_uris(&env.published()), vec![id.uri()]);
    assert_eq!(
        env.files_with(".key").len(),
        1,
        "the refused key is left over"
    );
    env.assert_no_secrets();
}

#[test]
fn a_rogue_push_at_the_top_epoch_only_delays_enrollment() {
    // Finding B: any host process may push. A rogue push at epoch 2^64-1 is refused by the
    // service; the guest discards it and waits for another push, and the legitimate
    // material at epoch 5 then enrolls.
    let mut env = Env::new(&[VM], VM);
    let cfg = env.push_config();
    let sock = env.path("push.sock");
    let mut child = Command::new(host_bin("guest-init"))
        .args(["enroll", "--config"])
        .arg(&cfg)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn guest-init");
    let wait_for_socket = |child: &mut Child| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !sock.exists() {
            if let Some(st) = child.try_wait().unwrap() {
                return Err(st);
            }
            assert!(Instant::now() < deadline, "no push socket");
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    };
    wait_for_socket(&mut child).expect("guest-init exited before listening");
    let rogue = new_token("rogue");
    let doc = env.material_doc(&rogue, &identity(VM, u64::MAX), 4_000_000_000);
    assert_eq!(push(&sock, &doc), "ok\n");
    wait_until("the service to refuse the rogue material", || {
        env.svc
            .requests()
            .iter()
            .any(|r| r.code == Some(ErrorCode::Denied))
    });
    if let Err(st) = wait_for_socket(&mut child) {
        let (_, out) = env.finish(child);
        panic!("guest-init gave up after the rogue push ({st}): {out}");
    }

    let id = identity(VM, 5);
    let (token, expires) = env.register("legit", &id, Duration::from_secs(600));
    let doc = env.material_doc(&token, &id, expires);
    assert_eq!(push(&sock, &doc), "ok\n");
    let (code, out) = env.finish(child);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("waiting for another push"), "{out}");
    let cert = env.published();
    assert_eq!(cert_uris(&cert), vec![id.uri()]);
    assert_eq!(Some(cert), env.svc.committed_cert(&token));
    assert_eq!(
        env.files_with(".key").len(),
        1,
        "the rogue key is left over"
    );
    assert!(!env.state().join("pending.json").exists());
    env.assert_no_secrets();
}

#[test]
fn an_unwritable_publish_dir_never_makes_a_second_csr() {
    // Finding C: a failure to publish is not a bad certificate. It must fail the run, and
    // never lead to a new key and a second CSR for the already-used token.
    let mut env = Env::new(&[VM], VM);
    env.provision(&identity(VM, 2));
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    let keys = env.files_with(".key");
    // A regular file where the publish directory should be.
    std::fs::remove_dir_all(env.publish()).unwrap();
    std::fs::write(env.publish(), b"in the way").unwrap();
    let (code, out) = env.run_guest();
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("identity"),
        "the error must name the path: {out}"
    );
    assert_eq!(
        distinct_csrs(&env.svc).len(),
        1,
        "a second CSR was sent: {out}"
    );
    assert_eq!(env.files_with(".key"), keys, "a new key was made");

    // Once the directory is back, the same material republishes without a request.
    let requests = env.svc.requests().len();
    std::fs::remove_file(env.publish()).unwrap();
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("already enrolled"), "{out}");
    assert_eq!(env.svc.requests().len(), requests);
    env.assert_no_secrets();
}

#[test]
fn a_damaged_certificate_is_fetched_again_with_the_stored_csr() {
    // Finding C, the one case that goes back to the service: the enrolled certificate
    // fails verification. The guest re-sends the stored CSR with the stored key (the
    // service answers an identical CSR with the identical certificate); it never makes a
    // new key and a second CSR for the already-used token.
    let mut env = Env::new(&[VM], VM);
    let token = env.provision(&identity(VM, 6));
    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    let keys = env.files_with(".key");
    let crt = env.state().join(&env.files_with(".crt")[0]);
    let mut f = std::fs::OpenOptions::new().write(true).open(&crt).unwrap();
    f.write_all(b"garbage").unwrap();
    drop(f);

    let (code, out) = env.run_guest();
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("re-sending the stored CSR"), "{out}");
    assert_eq!(
        distinct_csrs(&env.svc).len(),
        1,
        "a second CSR was sent: {out}"
    );
    assert_eq!(env.files_with(".key"), keys, "a new key was made");
    assert_eq!(
        Some(std::fs::read(&crt).unwrap()),
        env.svc.committed_cert(&token)
    );
    assert_eq!(Some(env.published()), env.svc.committed_cert(&token));
    env.assert_no_secrets();
}

/// Spawns `guest-init enroll` with the push configuration and waits until it listens.
fn spawn_push_guest(env: &Env) -> Child {
    let cfg = env.push_config();
    let sock = env.path("push.sock");
    let mut child = Command::new(host_bin("guest-init"))
        .args(["enroll", "--config"])
        .arg(&cfg)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn guest-init");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !sock.exists() {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("guest-init exited ({st}) before listening");
        }
        assert!(Instant::now() < deadline, "no push socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn a_rogue_push_for_the_pending_identity_does_not_cost_the_pending_csr() {
    // The crash window: the service committed the legitimate CSR, the guest died before
    // the answer. After the restart a rogue pusher is first, with the same identity and
    // its own token: the guest resumes the pending CSR under the rogue token, the service
    // refuses it, and the pending record must survive, so the legitimate push then gets
    // the committed certificate instead of a `csr_mismatch` for a second key.
    let mut env = Env::new(&[VM], VM);
    let id = identity(VM, 7);
    let (token, expires) = env.register("legit", &id, Duration::from_secs(600));
    let legit = env.material_doc(&token, &id, expires);
    let sock = env.path("push.sock");

    env.svc.stall_after_commit();
    let mut child = spawn_push_guest(&env);
    assert_eq!(push(&sock, &legit), "ok\n");
    wait_until("the service to commit and stall", || env.svc.stalled() == 1);
    child.kill().unwrap();
    let _ = env.finish(child);
    env.svc.release_stall();
    let committed = env.svc.committed_cert(&token).expect("committed");
    let pending = std::fs::read(env.state().join("pending.json")).unwrap();

    let mut child = spawn_push_guest(&env);
    let rogue = new_token("rogue");
    let doc = env.material_doc(&rogue, &id, 4_000_000_000);
    assert_eq!(push(&sock, &doc), "ok\n");
    wait_until("the service to refuse the rogue token", || {
        env.svc
            .requests()
            .iter()
            .any(|r| r.code == Some(ErrorCode::Denied))
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while !sock.exists() {
        if child.try_wait().unwrap().is_some() {
            let (_, out) = env.finish(child);
            panic!("guest-init gave up after the rogue push: {out}");
        }
        assert!(Instant::now() < deadline, "no second push socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        std::fs::read(env.state().join("pending.json")).unwrap(),
        pending,
        "the refused push changed the pending record"
    );

    assert_eq!(push(&sock, &legit), "ok\n");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            let (_, out) = env.finish(child);
            panic!("the legitimate push did not enroll: {out}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, out) = env.finish(child);
    assert_eq!(code, 0, "{out}");
    assert_eq!(distinct_csrs(&env.svc).len(), 1, "a second CSR was sent");
    assert_eq!(env.published(), committed);
    env.assert_no_secrets();
}
