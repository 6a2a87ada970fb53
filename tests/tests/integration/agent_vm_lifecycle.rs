//! The agent's lifecycle inside a real micro-VM with a vTPM: QEMU (TCG), the Debian guest
//! kernel, vhost-device-vsock, swtpm on `tpm-crb`, the static musl `guest-init` as PID 1
//! with `key_store: "tpm"` and a **push** bootstrap source, `host-relay` in front of the
//! reference enrollment service. One boot per kernel carries, in order:
//!
//! 1. **Push and enroll.** The host pushes the material for epoch 3 through the VMM's
//!    hybrid socket (`CONNECT 1026`); the guest makes its key in the TPM and enrolls. No
//!    bootstrap file exists in the image: the token only ever lived in the push.
//! 2. **Refusals**, each with its reason at the client and on the console: no client
//!    certificate (`CertificateRequired` / `no client certificate`), an expired one
//!    (`CertificateExpired` / `expired client certificate`), a reader asking for `exec`
//!    (`role_not_allowed` / `RoleNotAllowed: role reader does not allow exec`).
//! 3. **Renewal** over mutual TLS through host-relay's enrollment port, of a 120 s
//!    certificate at 67 % of its lifetime: a new handshake from the host is served a new
//!    certificate (other serial, later notAfter) for the same public key (the TPM key); the
//!    service recorded it as a renewal (mutual TLS, no token: the token was single-use and
//!    is spent).
//! 4. **Epoch raise while an `exec` runs.** A `tick` job (appends to `/tmp/tick` every
//!    100 ms) runs over the agent; the test sees the file grow, then registers and pushes
//!    the material for epoch 4. The job's connection ends without an answer, the file
//!    stops growing (the job is dead, seen through its effect), the console logs the
//!    connection closed and the job killed before `serving as <epoch 4>`, and a new
//!    handshake is served the epoch-4 certificate, for a new public key.
//! 5. **`stop` over the agent**: the answer `stopping`, then QEMU exits 0 (orderly
//!    power-off).
//! 6. **No secret in any log**: neither token, nor a private key, on the console or in
//!    the relay's log.
//!
//! Measured (printed, not asserted): the time from the push to the first handshake served
//! the new epoch's certificate, and from the guest's first renewal attempt to the renewed
//! line, as the host sees them (TCG).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use e2e::enroll_service::EnrollService;
use e2e::operator::{exchange, Credential};
use e2e::util::{have_program, require};
use host_relay::agent_client::GuestAuthorizer;
use qemu_harness::process::tail;
use qemu_harness::Vm;
use serde_json::{json, Value};

use crate::agent_vm::{agent_section, write_current};
use crate::vm_guest::{
    accounts, each_kernel, guest_config, identity, initramfs_vm, material, service, AGENT_PORT,
    ENROLL_PORT, PROBE,
};

const PUSH_PORT: u32 = 1026;
const TOKEN_3: &str = "tok_LIFECYCLE_EPOCH3_0123456789abcdefghijklmnop";
const TOKEN_4: &str = "tok_LIFECYCLE_EPOCH4_0123456789abcdefghijklmnop";
const TICK: &str = "/tmp/tick";
/// Issued certificates live 120 s; the reference service backdates notBefore by 60 s, so
/// at 67 % the guest renews about 20 s after it enrolled.
const LIFETIME: Duration = Duration::from_secs(120);

/// One agent call over the VMM's hybrid socket with the host's peer-authorizer (the
/// management CA and the current-identity file): the answer and the certificate served.
struct Agent<'a> {
    svc: &'a EnrollService,
    current: &'a Path,
    vsock_uds: PathBuf,
}

impl Agent<'_> {
    fn call(&self, cred: Option<&Credential>, request: Value) -> Result<(Value, Vec<u8>), String> {
        // The host client's own verifier: the peer-authorizer, and only ECDSA P-256 (ring).
        let authorizer = GuestAuthorizer::new(self.svc.ca_der().to_vec(), self.current.into());
        let algorithms = peer_verify::only_scheme(
            rustls::crypto::ring::default_provider().signature_verification_algorithms,
            rustls::SignatureScheme::ECDSA_NISTP256_SHA256,
        )
        .unwrap();
        let verifier = peer_verify::PeerVerifier::new(authorizer, algorithms);
        let sock =
            qemu_harness::hybrid::connect(&self.vsock_uds, AGENT_PORT, Duration::from_secs(30))
                .map_err(|e| format!("cannot reach the agent: {e}"))?;
        exchange(sock, cred, Arc::new(verifier), &request.to_string())
    }

    /// The size of `path` in the guest, asked of `guest-probe size` run by `cred`.
    fn size(&self, cred: &Credential, path: &str) -> String {
        let (answer, _) = self
            .call(
                Some(cred),
                json!({"v": 1, "op": "exec", "user": "nobody", "argv": [PROBE, "size", path]}),
            )
            .unwrap_or_else(|e| panic!("size {path}: {e}"));
        let out = base64::engine::general_purpose::STANDARD
            .decode(answer["result"]["stdout"].as_str().unwrap_or_default())
            .unwrap();
        let out = String::from_utf8_lossy(&out);
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("guest-probe: size {path} ")))
            .unwrap_or_else(|| panic!("no size in {answer}"))
            .to_string()
    }
}

/// Pushes `doc` to the guest's push listener through the hybrid socket; the guest must
/// answer `ok`. No half-close: vhost-device-vsock would make it a full close and the
/// answer would be lost; the guest ends the read at the object's end.
fn push(vm: &mut Vm, doc: &str) {
    let mut s = vm
        .connect(PUSH_PORT, Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("no push listener: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s.write_all(doc.as_bytes()).unwrap();
    let mut answer = String::new();
    let read = std::io::BufRead::read_line(&mut std::io::BufReader::new(&mut s), &mut answer);
    assert!(
        read.is_ok() && answer == "ok\n",
        "push answered {answer:?} ({read:?}):\n{}",
        tail(&vm.console(), 40)
    );
}

/// Serial, notAfter and public key of a DER certificate.
fn cert_facts(der: &[u8]) -> (Vec<u8>, i64, Vec<u8>) {
    let (_, c) = x509_parser::parse_x509_certificate(der).expect("a DER certificate");
    (
        c.raw_serial().to_vec(),
        c.validity().not_after.timestamp(),
        c.public_key().subject_public_key.data.to_vec(),
    )
}

/// Waits for a console line containing `text`; returns it.
fn console_line(vm: &mut Vm, text: &str, timeout: Duration) -> String {
    vm.wait_for_console(text, timeout)
        .unwrap_or_else(|e| panic!("{e}"))
}

fn ok(answer: &Value) -> &Value {
    assert_eq!(answer["status"], "ok", "{answer}");
    &answer["result"]
}

#[test]
fn the_agent_refuses_renews_rotates_on_a_pushed_epoch_and_stops_in_a_vm_with_a_tpm() {
    let _l = crate::support::heavy_lock();
    let swtpm = require(have_program("swtpm"), "swtpm (apt-get install swtpm)");
    each_kernel(swtpm, |kernel, bins| {
        let work = tempfile::tempdir().unwrap();
        let (svc, svc_sock) = service(work.path());
        svc.set_cert_lifetime(LIFETIME);
        let id3 = identity(3);
        let material3 = material(&svc, TOKEN_3, &id3);
        let mut config = guest_config(
            "vm-agent-life",
            vm_image::VSOCK_MODULES,
            json!({
                "bootstrap": { "push": { "listen": { "vsock": { "cid": u32::MAX, "port": PUSH_PORT } } } },
                "service": { "vsock": { "cid": 2, "port": ENROLL_PORT } },
                "management_ca": svc.management_ca_b64(),
                "key_store": "tpm",
                "retry": { "initial_ms": 200, "max_ms": 2000, "max_attempts": 30 },
                "renew_at_percent_of_lifetime": 67
            }),
        );
        config["control"]["with_agent"] = json!(true);
        config["agent"] = agent_section();
        let mut spec = initramfs_vm("agent-life", kernel, bins, config, accounts(), &svc_sock);
        spec.tpm_state = Some(work.path().join("tpm"));
        spec.ready_timeout = Duration::from_secs(300);

        // 1. Push, enroll (TPM key), ready.
        let mut vm = Vm::boot(spec).expect("boot");
        push(&mut vm, &material3.to_string());
        let ready = vm.wait_ready();
        assert!(ready.is_ok(), "no ready line: {ready:?}\n{}", vm.console());
        console_line(&mut vm, "enroll: new tpm key ", Duration::from_secs(5));
        let enrolled = svc.committed_cert(TOKEN_3).expect("epoch 3 enrolled");
        let (serial_a, not_after_a, key_a) = cert_facts(&enrolled);

        let current = work.path().join("current.json");
        write_current(&current, &id3, 3);
        let agent = Agent {
            svc: &svc,
            current: &current,
            vsock_uds: vm.spec().vsock_uds(),
        };
        let operator = svc.issue_operator("urn:hop3:operator:ops:role:operator", -60, 3600);
        let (status, _) = agent
            .call(Some(&operator), json!({"v": 1, "op": "status"}))
            .unwrap();
        assert_eq!(ok(&status)["identity"], id3.uri());

        // 2. Refusals, each with its reason at the client and on the console.
        let expired = svc.issue_operator("urn:hop3:operator:bob:role:operator", -7200, -60);
        for (what, cred, client_sees, guest_logs) in [
            (
                "no client certificate",
                None,
                "CertificateRequired",
                "no client certificate",
            ),
            (
                "expired",
                Some(&expired),
                "CertificateExpired",
                "expired client certificate",
            ),
        ] {
            let e = match agent.call(cred, json!({"v": 1, "op": "status"})) {
                Err(e) => e,
                Ok((answer, _)) => panic!("{what}: admitted, answered {answer}"),
            };
            assert!(e.contains(client_sees), "{what}: the client saw {e}");
            let line = console_line(&mut vm, guest_logs, Duration::from_secs(30));
            assert!(line.contains("agent: refused vsock:2:"), "{what}: {line}");
        }
        let reader = svc.issue_operator("urn:hop3:operator:dave:role:reader", -60, 3600);
        let (answer, _) = agent
            .call(
                Some(&reader),
                json!({"v": 1, "op": "exec", "user": "nobody", "argv": [PROBE, "size", TICK]}),
            )
            .unwrap();
        assert_eq!(answer["code"], "role_not_allowed", "{answer}");
        console_line(
            &mut vm,
            "RoleNotAllowed: role reader does not allow exec",
            Duration::from_secs(30),
        );

        // 3. Renewal: same key, new certificate, served on a new handshake.
        console_line(&mut vm, "renew: attempt 1 for ", Duration::from_secs(240));
        let t = Instant::now();
        console_line(&mut vm, "renew: renewed ", Duration::from_secs(120));
        let renewal_seen = t.elapsed();
        let (status, served) = agent
            .call(Some(&operator), json!({"v": 1, "op": "status"}))
            .unwrap();
        assert_eq!(ok(&status)["epoch"], 3, "{status}");
        let (serial_b, not_after_b, key_b) = cert_facts(&served);
        assert!(key_b == key_a, "the renewed certificate is for another key");
        assert!(
            serial_b != serial_a,
            "the agent still serves the enrolled certificate"
        );
        assert!(not_after_b > not_after_a, "{not_after_b} <= {not_after_a}");
        let renewals: Vec<_> = svc.requests().into_iter().filter(|r| r.renewal).collect();
        assert!(
            renewals
                .iter()
                .any(|r| r.code.is_none() && r.cert.as_deref() == Some(served.as_slice())),
            "the served certificate is not one the service renewed: {renewals:?}"
        );
        assert_eq!(
            svc.requests().iter().filter(|r| !r.renewal).count(),
            1,
            "a second token enrollment: renewal used bootstrap authority"
        );

        // 4. Epoch raise while a job runs: the job is seen running (its file grows).
        let id4 = identity(4);
        let (answer, push_to_served, served4) = std::thread::scope(|scope| {
            let job = scope.spawn(|| {
                agent.call(
                    Some(&operator),
                    json!({"v": 1, "op": "exec", "user": "nobody", "deadline_ms": 120_000,
                           "argv": [PROBE, "tick", TICK]}),
                )
            });
            let deadline = Instant::now() + Duration::from_secs(60);
            while agent.size(&operator, TICK) == "missing" {
                assert!(Instant::now() < deadline, "the job never started");
                std::thread::sleep(Duration::from_millis(200));
            }
            let s1: u64 = agent.size(&operator, TICK).parse().unwrap();
            std::thread::sleep(Duration::from_secs(1));
            let s2: u64 = agent.size(&operator, TICK).parse().unwrap();
            assert!(s2 > s1, "the job does not tick ({s1} then {s2})");

            // The platform raises the epoch: registers and pushes epoch 4's material, and
            // the controller's current identity moves to epoch 4.
            let material4 = material(&svc, TOKEN_4, &id4);
            let t = Instant::now();
            push(&mut vm, &material4.to_string());
            write_current(&current, &id4, 4);
            // New handshakes: refused by the host while the guest still serves epoch 3,
            // then served epoch 4's certificate.
            let deadline = Instant::now() + Duration::from_secs(240);
            let served4 = loop {
                match agent.call(Some(&operator), json!({"v": 1, "op": "status"})) {
                    Ok((status, served)) => {
                        assert_eq!(ok(&status)["identity"], id4.uri(), "{status}");
                        break served;
                    }
                    Err(e) => assert!(
                        Instant::now() < deadline,
                        "no handshake with epoch 4's certificate: {e}"
                    ),
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            let push_to_served = t.elapsed();
            // The job is gone: its file stopped growing.
            let s3 = agent.size(&operator, TICK);
            std::thread::sleep(Duration::from_secs(1));
            let s4 = agent.size(&operator, TICK);
            assert_eq!(
                s3, s4,
                "the old identity's job still ticks after the rotation"
            );
            (job.join().unwrap(), push_to_served, served4)
        });
        assert!(
            answer.is_err(),
            "the old identity's exec connection answered: {answer:?}"
        );
        let console = vm.console();
        let at = |what: &str| {
            console
                .find(what)
                .unwrap_or_else(|| panic!("no {what:?} on the console:\n{}", tail(&console, 60)))
        };
        let closed = at("agent: closed the connection from vsock:2:");
        assert!(
            console[closed..]
                .lines()
                .next()
                .unwrap()
                .contains(&format!("opened under {}", id3.uri())),
            "{}",
            tail(&console, 60)
        );
        let killed = at("killed (its process group)");
        let serving = at(&format!("agent: serving as {} from now on", id4.uri()));
        assert!(
            closed < serving && killed < serving,
            "the new certificate was served before the old connection closed and its job died:\n{}",
            tail(&console, 60)
        );
        let (_, _, key_c) = cert_facts(&served4);
        assert!(key_c != key_a, "epoch 4's certificate is for the old key");

        // 5. `stop` over the agent: an orderly power-off.
        let (answer, _) = agent
            .call(Some(&operator), json!({"v": 1, "op": "stop"}))
            .unwrap();
        assert_eq!(ok(&answer)["stopping"], true, "{answer}");
        let exit = vm.wait_exit(Duration::from_secs(120));
        let console = vm.console();
        assert!(
            exit.as_ref().is_ok_and(|s| s.success()),
            "no orderly power-off after stop: {exit:?}\n{}",
            tail(&console, 40)
        );
        for bad in ["Kernel panic", "Attempted to kill init"] {
            assert!(!console.contains(bad), "{bad}:\n{console}");
        }

        // 6. No token or private key in any log.
        let relay = vm.relay_log("enroll");
        for (what, log) in [("console", &console), ("relay log", &relay)] {
            for secret in [TOKEN_3, TOKEN_4, "PRIVATE KEY"] {
                assert!(!log.contains(secret), "{secret:?} in the {what}");
            }
            for (_, key) in [&operator, &reader, &expired] {
                let b64 = base64::engine::general_purpose::STANDARD.encode(key);
                assert!(!log.contains(&b64[..40]), "an operator key in the {what}");
            }
        }
        eprintln!(
            "agent lifecycle under TCG ({}): push to the new epoch's certificate served {:.2} s; renewal (first attempt to renewed line) {:.2} s",
            kernel.version,
            push_to_served.as_secs_f64(),
            renewal_seen.as_secs_f64()
        );
    });
}
