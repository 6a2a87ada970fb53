//! The agent end to end, host-level: the real `guest-init` binary as an ordinary process
//! (a subreaper supervisor with an app), enrolled through the reference service, serving
//! its management listener on a Unix socket (in a VM it is vsock; the admission of CID 2
//! is the control port's, tested there). The client is an independent TLS 1.3 stack
//! (rustls with ring) presenting operator certificates issued by the service's CA, the
//! management CA the material pins.
//!
//! What is asserted: status, exec (as a listed user, exit status, output, deadline kill),
//! stop; each refusal with its own reason, as the client sees it (the TLS alert, or the
//! JSON error) and as the guest logs it; no secret in the guest's log.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use base64::Engine;
use e2e::enroll_service::EnrollService;
use e2e::operator::{self, Credential, ServerCert};
use e2e::util::{host_bin, spawn_guest_init_logged};
use guest_init::enroll::identity::Identity;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

const TOKEN: &str = "tok_AGENT_SECRET_0123456789abcdefghijklmnopqrstuv";

struct Guest {
    dir: tempfile::TempDir,
    svc: EnrollService,
    child: Option<Child>,
    id: Identity,
}

impl Guest {
    /// Enrolls a guest-init supervisor (bootstrap file) with an agent on `agent.sock`.
    fn start() -> Guest {
        Guest::start_with(false)
    }

    /// As [`Guest::start`]; with `push`, the material is pushed (and later pushes
    /// re-enroll).
    fn start_with(push: bool) -> Guest {
        let dir = tempfile::tempdir().unwrap();
        let svc = EnrollService::start().unwrap();
        let svc_sock = dir.path().join("svc.sock");
        svc.listen_vm("vm-1", &svc_sock).unwrap();
        let id = Identity {
            workspace_namespace: "team-a".into(),
            workspace_name: "ws1".into(),
            workspace_uid: "0b4c5e2a-1111-2222-3333-444455556666".into(),
            vm_uid: "vm-1".into(),
            epoch: 7,
        };
        let expires = svc.register(TOKEN, &id, Duration::from_secs(600)).unwrap();
        let material = svc.material_json(TOKEN, &id, expires, 5002);
        let boot = dir.path().join("bootstrap.json");
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&boot)
            .unwrap()
            .write_all(material.to_string().as_bytes())
            .unwrap();
        let cfg = dir.path().join("guest.json");
        std::fs::write(
            &cfg,
            serde_json::json!({
                "version": 1,
                "log_level": "debug",
                "app": {"command": ["/bin/sleep", "600"], "user": 0},
                "enrollment": {
                    "bootstrap": if push {
                        serde_json::json!({"push": {"listen": {"unix": dir.path().join("push.sock")}}})
                    } else {
                        serde_json::json!({"file": boot})
                    },
                    "management_ca": svc.management_ca_b64(),
                    "state_dir": dir.path().join("state"),
                    "publish_dir": dir.path().join("identity"),
                    "service": {"unix": svc_sock},
                },
                "agent": {
                    "listen": {"unix": dir.path().join("agent.sock")},
                    "exec_users": ["nobody"],
                },
            })
            .to_string(),
        )
        .unwrap();
        let child = spawn_guest_init_logged(&cfg, &dir.path().join("guest.log"));
        let g = Guest {
            dir,
            svc,
            child: Some(child),
            id,
        };
        if push {
            g.push(&material.to_string());
        }
        g.wait_log("agent: listening at");
        g
    }

    /// Pushes bootstrap material to the guest (as root) and checks it was taken.
    fn push(&self, doc: &str) {
        let sock = self.dir.path().join("push.sock");
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut s = loop {
            match std::os::unix::net::UnixStream::connect(&sock) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => panic!("no push listener: {e}\n{}", self.log()),
            }
        };
        s.write_all(doc.as_bytes()).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert_eq!(answer, "ok\n", "{}", self.log());
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("guest.log")).unwrap_or_default()
    }

    fn wait_log(&self, what: &str) {
        e2e::util::wait_in_log(
            &self.dir.path().join("guest.log"),
            what,
            1,
            Duration::from_secs(60),
        );
    }

    fn sock(&self) -> PathBuf {
        self.dir.path().join("agent.sock")
    }

    /// The certificate the guest published (what it must present).
    fn published(&self) -> Vec<u8> {
        let pem = std::fs::read_to_string(self.dir.path().join("identity/cert.pem")).unwrap();
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        base64::engine::general_purpose::STANDARD
            .decode(body)
            .unwrap()
    }

    /// Sends `request` with `client` (certificate and key) and returns the answer's JSON,
    /// or the TLS error the client saw. The guest must present exactly the certificate it
    /// published, and sign the handshake with its key.
    fn call(
        &self,
        client: Option<&Credential>,
        request: &str,
    ) -> Result<serde_json::Value, String> {
        operator::call(
            &self.sock(),
            client,
            ServerCert::pinned(self.published()),
            request,
        )
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn ok(answer: &serde_json::Value) -> &serde_json::Value {
    assert_eq!(answer["status"], "ok", "{answer}");
    &answer["result"]
}

fn b64(v: &serde_json::Value) -> String {
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap())
            .unwrap(),
    )
    .unwrap()
}

#[test]
fn status_exec_and_stop_over_mutual_tls() {
    let g = Guest::start();
    let operator = g
        .svc
        .issue_operator("urn:hop3:operator:alice:role:operator", -60, 3600);

    let status = g.call(Some(&operator), r#"{"v":1,"op":"status"}"#).unwrap();
    let r = ok(&status);
    assert_eq!(r["identity"], g.id.uri());
    assert_eq!(r["epoch"], 7);
    assert!(r["app"].as_str().unwrap().starts_with("running"), "{r}");
    assert!(r["not_after"].as_i64().unwrap() > 0);

    // As a listed user: its uid, both streams, the exit status.
    let exec = g
        .call(
            Some(&operator),
            r#"{"v":1,"op":"exec","user":"nobody","argv":["/bin/sh","-c","id -u; echo oops >&2; exit 3"]}"#,
        )
        .unwrap();
    let r = ok(&exec);
    let nobody = nix::unistd::User::from_name("nobody").unwrap().unwrap();
    assert_eq!(b64(&r["stdout"]), format!("{}\n", nobody.uid));
    assert_eq!(b64(&r["stderr"]), "oops\n");
    assert_eq!(r["exit_code"], 3);
    assert_eq!(r["timed_out"], false);

    // Past its deadline: killed, with whatever it forked.
    let exec = g
        .call(
            Some(&operator),
            r#"{"v":1,"op":"exec","user":"nobody","argv":["/bin/sh","-c","/bin/sleep 31.25 & /bin/sleep 31.5"],"deadline_ms":500}"#,
        )
        .unwrap();
    let r = ok(&exec);
    assert_eq!(r["timed_out"], true, "{r}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while sleeping("31.25") || sleeping("31.5") {
        assert!(
            Instant::now() < deadline,
            "the job's processes outlived its deadline"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(g
        .log()
        .contains("passed its deadline of 500 ms; killing its process group"));

    // A user that is not listed, even root.
    let e = g
        .call(
            Some(&operator),
            r#"{"v":1,"op":"exec","user":"root","argv":["/bin/id"]}"#,
        )
        .unwrap();
    assert_eq!(e["code"], "user_not_allowed", "{e}");

    // Stop: the orderly shutdown.
    let stop = g.call(Some(&operator), r#"{"v":1,"op":"stop"}"#).unwrap();
    assert_eq!(ok(&stop)["stopping"], true);
    g.wait_log("shutdown");
    assert!(!g.log().contains(TOKEN), "the token is in the guest's log");
}

/// Whether a process with exactly this `sleep` argument runs.
fn sleeping(arg: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
        std::fs::read(e.path().join("cmdline"))
            .map(|c| c == format!("/bin/sleep\0{arg}\0").as_bytes())
            .unwrap_or(false)
    })
}

#[test]
fn each_refusal_has_its_own_reason() {
    let g = Guest::start();
    let rogue = EnrollService::start().unwrap();
    let cases: Vec<(&str, Option<Credential>, &str, &str)> = vec![
        (
            "no client certificate",
            None,
            "CertificateRequired",
            "no client certificate",
        ),
        (
            "another CA",
            Some(rogue.issue_operator("urn:hop3:operator:mallory:role:operator", -60, 3600)),
            "UnknownCA",
            "wrong CA",
        ),
        (
            "expired",
            Some(
                g.svc
                    .issue_operator("urn:hop3:operator:bob:role:operator", -7200, -60),
            ),
            "CertificateExpired",
            "expired client certificate",
        ),
        (
            "not for client authentication",
            Some(g.svc.issue_with_usages(
                "urn:hop3:operator:erin:role:operator",
                -60,
                3600,
                vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth],
            )),
            "UnsupportedCertificate",
            "not an operator certificate",
        ),
        (
            "no role",
            Some(g.svc.issue_operator("urn:hop3:operator:carol", -60, 3600)),
            "AccessDenied",
            "no accepted role",
        ),
    ];
    for (what, client, alert, logged) in cases {
        let e = g
            .call(client.as_ref(), r#"{"v":1,"op":"status"}"#)
            .expect_err(what);
        assert!(e.contains(alert), "{what}: the client saw {e}");
        g.wait_log(&format!("refused unix: {logged}"));
    }

    // After the handshake: a reader may not exec; a malformed request.
    let reader = g
        .svc
        .issue_operator("urn:hop3:operator:dave:role:reader", -60, 3600);
    ok(&g.call(Some(&reader), r#"{"v":1,"op":"status"}"#).unwrap());
    let e = g
        .call(
            Some(&reader),
            r#"{"v":1,"op":"exec","user":"nobody","argv":["/bin/id"]}"#,
        )
        .unwrap();
    assert_eq!(e["code"], "role_not_allowed", "{e}");
    let e = g
        .call(Some(&reader), r#"{"v":1,"op":"status","x":1}"#)
        .unwrap();
    assert_eq!(e["code"], "malformed_request", "{e}");
    let log = g.log();
    assert!(
        log.contains("RoleNotAllowed: role reader does not allow exec"),
        "{log}"
    );
    assert!(log.contains("MalformedRequest"), "{log}");
}

fn pem(label: &str, der: &[u8]) -> String {
    let b = base64::engine::general_purpose::STANDARD.encode(der);
    let lines: Vec<&str> = b
        .as_bytes()
        .chunks(64)
        .map(|c| std::str::from_utf8(c).unwrap())
        .collect();
    format!(
        "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
        lines.join("\n")
    )
}

/// `host-relay agent` against the guest, with the current identity as `current` says.
fn host_client(g: &Guest, operator: &Credential, current: &str, op: &[&str]) -> (i32, String) {
    let d = g.dir.path();
    std::fs::write(d.join("op.crt"), pem("CERTIFICATE", &operator.0)).unwrap();
    std::fs::write(d.join("op.key"), pem("PRIVATE KEY", &operator.1)).unwrap();
    std::fs::write(d.join("ca.crt"), pem("CERTIFICATE", g.svc.ca_der())).unwrap();
    std::fs::write(d.join("current.json"), current).unwrap();
    let out = Command::new(host_bin("host-relay"))
        .arg("agent")
        .arg("--unix")
        .arg(g.sock())
        .args(["--cert", "op.crt", "--key", "op.key", "--ca", "ca.crt"])
        .args(["--current-identity", "current.json"])
        .args(op)
        .current_dir(d)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn current(id: &Identity, vm_uid: &str, epoch: u64) -> String {
    serde_json::json!({
        "workspace_namespace": id.workspace_namespace,
        "workspace_name": id.workspace_name,
        "workspace_uid": id.workspace_uid,
        "vm_uid": vm_uid,
        "epoch": epoch,
    })
    .to_string()
}

#[test]
fn the_host_client_talks_only_to_the_current_identity() {
    let g = Guest::start();
    let operator = g
        .svc
        .issue_operator("urn:hop3:operator:ops:role:operator", -60, 3600);
    let served = || g.log().matches("agent: ops (operator) from unix").count();

    let (code, out) = host_client(&g, &operator, &current(&g.id, "vm-1", 7), &["status"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(&g.id.uri()), "{out}");
    let (code, out) = host_client(
        &g,
        &operator,
        &current(&g.id, "vm-1", 7),
        &["exec", "--user", "nobody", "--", "/bin/echo", "hello"],
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(&base64::engine::general_purpose::STANDARD.encode("hello\n")));
    assert_eq!(served(), 2);

    // The controller raised the epoch, or reset the VM: the guest's certificate is for a
    // generation that is no longer current. Refused before any request is sent.
    for (current, why) in [
        (current(&g.id, "vm-1", 8), "epoch:8"),
        (current(&g.id, "vm-2", 7), "vm:vm-2"),
        ("{\"epoch\": 7".to_string(), "not the documented JSON"),
        (
            current(&g.id, "vm-1", 7).replace("\"vm-1\"", "\"vm/1\""),
            "vm_uid",
        ),
    ] {
        let (code, out) = host_client(&g, &operator, &current, &["stop"]);
        assert_eq!(code, 2, "{current}: {out}");
        assert!(
            out.contains("handshake refused") && out.contains(why),
            "{out}"
        );
    }
    std::fs::remove_file(g.dir.path().join("current.json")).unwrap();
    let out = Command::new(host_bin("host-relay"))
        .arg("agent")
        .arg("--unix")
        .arg(g.sock())
        .args(["--cert", "op.crt", "--key", "op.key", "--ca", "ca.crt"])
        .args(["--current-identity", "current.json", "stop"])
        .current_dir(g.dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
    assert_eq!(served(), 2, "a request reached the guest");
    assert!(!g.log().contains("shutdown"), "the VM was stopped");

    // One client, many handshakes (as a long-lived operator tool would): the second
    // handshake after the epoch raise must be judged afresh, not resumed.
    let path = g.dir.path().join("current.json");
    std::fs::write(&path, current(&g.id, "vm-1", 7)).unwrap();
    let client = host_relay::agent_client::Client::new(
        vec![CertificateDer::from(operator.0.clone())],
        PrivateKeyDer::Pkcs8(operator.1.clone().into()),
        g.svc.ca_der().to_vec(),
        path.clone(),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let target = host_relay::agent_client::Target::Endpoint(vm_transport::Endpoint::Unix(g.sock()));
    let status = r#"{"v":1,"op":"status"}"#;
    rt.block_on(client.call(&target, status)).unwrap();
    std::fs::write(&path, current(&g.id, "vm-1", 8)).unwrap();
    match rt.block_on(client.call(&target, status)) {
        Err(host_relay::agent_client::CallError::Refused(e)) => {
            assert!(e.to_string().contains("epoch:8"), "{e}")
        }
        other => panic!("a resumed session skipped the authorizer: {other:?}"),
    }
}

#[test]
fn an_epoch_raise_closes_the_old_connections_kills_their_jobs_and_swaps_the_certificate() {
    let g = Guest::start_with(true);
    let operator = g
        .svc
        .issue_operator("urn:hop3:operator:ops:role:operator", -60, 3600);
    let old_cert = g.published();

    // A job running under the old identity, on its own connection.
    let running = std::thread::scope(|scope| {
        let job = scope.spawn(|| {
            g.call(
                Some(&operator),
                r#"{"v":1,"op":"exec","user":"nobody","argv":["/bin/sleep","37.5"],"deadline_ms":60000}"#,
            )
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while !sleeping("37.5") {
            assert!(
                Instant::now() < deadline,
                "the job never started:\n{}",
                g.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }

        // The platform raises the epoch and pushes new material.
        let raised = Identity {
            epoch: 8,
            ..g.id.clone()
        };
        let token = "tok_AGENT_RAISED_0123456789abcdefghijklmnopqrstuv";
        let expires = g
            .svc
            .register(token, &raised, Duration::from_secs(600))
            .unwrap();
        g.push(
            &g.svc
                .material_json(token, &raised, expires, 5002)
                .to_string(),
        );
        g.wait_log(&format!("agent: serving as {} from now on", raised.uri()));
        (job.join().unwrap(), raised)
    });
    let (answer, raised) = running;

    // 1. the old connection was closed without an answer; 2. its job was killed.
    assert!(
        answer.is_err(),
        "the old identity's job answered: {answer:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while sleeping("37.5") {
        assert!(
            Instant::now() < deadline,
            "the old identity's job still runs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = g.log();
    let closed = log
        .find(&format!(
            "closed the connection from unix opened under {}",
            g.id.uri()
        ))
        .unwrap_or_else(|| panic!("no close logged:\n{log}"));
    let killed = log
        .find("killed (its process group)")
        .unwrap_or_else(|| panic!("no kill logged:\n{log}"));
    let serving = log.find("agent: serving as").unwrap();
    assert!(closed < serving && killed < serving, "{log}");

    // 3. new handshakes get the new certificate: the client pins what the guest now
    // publishes, so the old certificate would fail the handshake.
    let new_cert = g.published();
    assert_ne!(new_cert, old_cert);
    let status = g.call(Some(&operator), r#"{"v":1,"op":"status"}"#).unwrap();
    assert_eq!(ok(&status)["identity"], raised.uri());
    assert_eq!(ok(&status)["epoch"], 8);
    assert!(!g.log().contains(TOKEN));
}

mod limits;
