//! Renewal authenticated by the enrolled machine: the real guest-init supervisor enrolls
//! through the real host-relay, its bootstrap material is deleted, and it renews over
//! mutual TLS with its enrolled certificate at two thirds of a short (120 s) lifetime.

use e2e::operator::{self, ServerCert};

use super::*;
use e2e::util::spawn_guest_init_logged;

/// Issued certificates live 120 s; the reference service backdates notBefore by 60 s, so
/// a guest renewing at 67 % renews about 20 s after it enrolled.
const LIFETIME: Duration = Duration::from_secs(120);

/// A running supervisor guest (app: a long sleep; agent on `agent.sock`).
struct Running {
    child: Child,
    log: PathBuf,
}

impl Running {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn wait_log(&self, what: &str) {
        e2e::util::wait_in_log(&self.log, what, 1, Duration::from_secs(120));
    }

    /// Ends the guest (SIGTERM: the orderly shutdown) and records its output.
    fn stop(mut self, env: &mut Env) -> String {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
        let text = self.log();
        env.output.push(text.clone());
        env.collect_keys();
        text
    }
}

impl Env {
    /// Enrolls `id` in a long-lived supervisor with an agent, then deletes the bootstrap
    /// material (the token is gone from the guest). Returns the guest and its first
    /// certificate.
    fn enroll_and_forget_token(&mut self, id: &Identity) -> (Running, Vec<u8>) {
        self.svc.set_cert_lifetime(LIFETIME);
        self.provision(id);
        let cfg = self.path("renew.json");
        std::fs::write(
            &cfg,
            serde_json::json!({
                "version": 1,
                "log_level": "debug",
                "app": {"command": ["/bin/sleep", "600"], "user": 0},
                "enrollment": {
                    "bootstrap": {"file": self.path("bootstrap.json")},
                    "state_dir": self.state(),
                    "publish_dir": self.publish(),
                    "service": {"unix": self.guest_sock},
                    "management_ca": self.svc.management_ca_b64(),
                    "timeout_ms": 10000,
                    "retry": {"initial_ms": 100, "max_ms": 1000, "max_attempts": 5},
                    "renew_at_percent_of_lifetime": 67,
                },
                "agent": {"listen": {"unix": self.path("agent.sock")}},
            })
            .to_string(),
        )
        .unwrap();
        let log = self.path("guest.log");
        let child = spawn_guest_init_logged(&cfg, &log);
        let g = Running { child, log };
        g.wait_log("agent: listening at");
        self.collect_keys();
        std::fs::remove_file(self.path("bootstrap.json")).unwrap();
        let first = self.published();
        (g, first)
    }

    fn renewals(&self) -> Vec<e2e::enroll_service::RequestRecord> {
        self.svc
            .requests()
            .into_iter()
            .filter(|r| r.renewal)
            .collect()
    }

    /// No token anywhere the guest keeps state or publishes, nor in its environment or
    /// command line.
    fn assert_token_gone(&self, pid: u32) {
        let mut places = Vec::new();
        for dir in [self.state(), self.publish()] {
            for e in std::fs::read_dir(&dir).unwrap().flatten() {
                places.push((
                    e.path().display().to_string(),
                    std::fs::read(e.path()).unwrap_or_default(),
                ));
            }
        }
        for f in ["environ", "cmdline"] {
            let p = format!("/proc/{pid}/{f}");
            places.push((p.clone(), std::fs::read(&p).unwrap()));
        }
        assert!(!self.path("bootstrap.json").exists());
        for t in &self.tokens {
            for (what, bytes) in &places {
                assert!(
                    !bytes.windows(t.len()).any(|w| w == t.as_bytes()),
                    "the token is in {what}"
                );
            }
        }
    }
}

/// The certificate the agent presents on a new handshake (a reader operator's status
/// call), checked by ring to be signed by the certificate's key.
fn agent_presents(env: &Env) -> Vec<u8> {
    let reader = env
        .svc
        .issue_operator("urn:hop3:operator:alice:role:reader", -60, 3600);
    let server = ServerCert::capture();
    let answer = operator::call(
        &env.path("agent.sock"),
        Some(&reader),
        server.clone(),
        r#"{"v":1,"op":"status"}"#,
    );
    assert_eq!(
        answer.as_ref().map(|a| &a["status"]),
        Ok(&"ok".into()),
        "status: {answer:?}"
    );
    server.seen().expect("a server certificate")
}

fn validity(der: &[u8]) -> (i64, i64) {
    let (_, c) = X509Certificate::from_der(der).unwrap();
    (
        c.validity().not_before.timestamp(),
        c.validity().not_after.timestamp(),
    )
}

#[test]
fn renewal_without_the_token_gives_a_new_certificate_for_the_same_key_and_the_agent_serves_it() {
    let mut env = Env::new(&[VM], VM);
    let id = identity(VM, 7);
    let (g, first) = env.enroll_and_forget_token(&id);
    assert_eq!(agent_presents(&env), first);
    // The schedule, from the certificate itself: 67 % of notBefore..notAfter.
    let (nb, na) = validity(&first);
    g.wait_log(&format!(
        "renewing at {} (67% of its lifetime)",
        nb + (na - nb) * 67 / 100
    ));

    g.wait_log("renew: renewed");
    env.assert_token_gone(g.child.id());
    let renewals = env.renewals();
    assert_eq!(renewals.len(), 1, "one renewal: {renewals:?}");
    let renewed = renewals[0]
        .cert
        .clone()
        .expect("the service issued a certificate");
    assert_ne!(renewed, first);
    assert_eq!(cert_key(&renewed), cert_key(&first), "the same key");
    assert_eq!(cert_uris(&renewed), vec![id.uri()]);
    assert!(
        validity(&renewed).1 > na,
        "the renewal extends the lifetime"
    );
    // Stored durably in the slot, published, and served on new handshakes.
    let crts = env.files_with(".crt");
    assert_eq!(crts.len(), 1, "{crts:?}");
    assert_eq!(std::fs::read(env.state().join(&crts[0])).unwrap(), renewed);
    assert_eq!(env.published(), renewed);
    assert_eq!(agent_presents(&env), renewed);
    // The enrollment CSR was the only token-bearing request.
    assert_eq!(env.svc.requests().iter().filter(|r| !r.renewal).count(), 1);

    let out = g.stop(&mut env);
    assert!(out.contains("renew: attempt 1 for"), "{out}");
    env.assert_no_secrets();
}

#[test]
fn renewal_after_an_epoch_raise_is_refused_for_good_and_the_current_certificate_stays() {
    let mut env = Env::new(&[VM], VM);
    let id = identity(VM, 7);
    let (g, first) = env.enroll_and_forget_token(&id);
    // The controller raises the epoch: the enrolled identity is no longer current.
    env.svc.set_current(&identity(VM, 8));

    g.wait_log("renew: refused for");
    let log = g.log();
    assert!(log.contains("(final, identity_changed)"), "{log}");
    assert!(log.contains("new bootstrap material"), "{log}");
    let renewals = env.renewals();
    assert_eq!(renewals.len(), 1, "{renewals:?}");
    assert_eq!(renewals[0].code, Some(ErrorCode::IdentityChanged));
    assert!(renewals[0].cert.is_none());
    // Final: no second attempt; the current certificate stays published and served.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(env.renewals().len(), 1);
    assert_eq!(env.published(), first);
    assert_eq!(agent_presents(&env), first);
    assert!(
        g.log().matches("renew: attempt").count() == 1,
        "{}",
        g.log()
    );

    g.stop(&mut env);
    env.assert_no_secrets();
}

#[test]
fn a_service_outage_is_retried_with_backoff_and_the_current_certificate_stays_in_use() {
    let mut env = Env::new(&[VM], VM);
    let id = identity(VM, 7);
    let (g, first) = env.enroll_and_forget_token(&id);
    // The service goes away: host-relay can no longer reach its socket.
    let svc_sock = env.path(&format!("svc-{VM}.sock"));
    std::fs::remove_file(&svc_sock).unwrap();

    g.wait_log("renew: attempt 3 for");
    let log = g.log();
    assert!(log.matches("failed (retryable)").count() >= 2, "{log}");
    assert!(
        log.contains("the current certificate stays in use"),
        "{log}"
    );
    assert!(!log.contains("renew: renewed"), "{log}");
    assert_eq!(env.published(), first);
    assert_eq!(agent_presents(&env), first);

    // The service comes back: the next attempt renews.
    env.svc.listen_vm(VM, &svc_sock).unwrap();
    g.wait_log("renew: renewed");
    let renewed = env.published();
    assert_ne!(renewed, first);
    assert_eq!(cert_key(&renewed), cert_key(&first));
    assert_eq!(agent_presents(&env), renewed);

    g.stop(&mut env);
    env.assert_no_secrets();
}
