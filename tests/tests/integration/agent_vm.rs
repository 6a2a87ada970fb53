//! The agent inside a real micro-VM: QEMU (TCG), the Debian guest kernel,
//! vhost-device-vsock, the static musl `guest-init` as PID 1 enrolled through host-relay and
//! the reference service, its agent on vsock port 1025. The operator's client is
//! `host_relay::agent_client` (the code behind `host-relay agent`), reaching the agent
//! through the VMM's hybrid socket (`CONNECT 1025`), with its peer-authorizer reading the
//! current identity.
//!
//! Asserted: status names the enrolled identity; exec as a listed user returns its output
//! and status; exec past its deadline is killed; a client from another CA is refused; an
//! epoch raised in the current-identity file makes the client refuse the guest. Measured
//! (printed, not asserted: timings are not test assertions): the median of 50 status round
//! trips (a full handshake each) and of 50 exec round trips, host to guest, under TCG.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine;
use e2e::enroll_service::EnrollService;
use e2e::util::{host_bin, musl_bin, on_each_kernel, require_vm_host, test_kernels};
use guest_init::enroll::identity::Identity;
use host_relay::agent_client::{CallError, Client, Target};
use qemu_harness::{Image, RelaySpec, Vm, VmSpec};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::json;
use vm_image::initramfs::{ExtraFile, InitramfsSpec, Source};

const ENROLL_PORT: u32 = 5002;
const CONTROL_PORT: u32 = 1024;
const AGENT_PORT: u32 = 1025;
const APP_UID: u32 = 20001;
const PROBE: &str = "/bin/guest-probe";
const BOOTSTRAP: &str = "/etc/guest-init/bootstrap.json";
const TOKEN: &str = "tok_AGENTVM_SECRET_0123456789abcdefghijklmnopq";

/// An operator client with a certificate from `issuer`'s CA, trusting the guest's
/// certificate from `management`'s CA.
fn client(issuer: &EnrollService, management: &EnrollService, uri: &str, current: &Path) -> Client {
    let (cert, key) = issuer.issue_operator(uri, -60, 3600);
    Client::new(
        vec![CertificateDer::from(cert)],
        PrivateKeyDer::Pkcs8(key.into()),
        management.ca_der().to_vec(),
        current.to_path_buf(),
    )
    .unwrap()
}

fn write_current(path: &Path, id: &Identity, epoch: u64) {
    std::fs::write(
        path,
        json!({
            "workspace_namespace": id.workspace_namespace,
            "workspace_name": id.workspace_name,
            "workspace_uid": id.workspace_uid,
            "vm_uid": id.vm_uid,
            "epoch": epoch,
        })
        .to_string(),
    )
    .unwrap();
}

fn median_ms(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1000.0
}

#[test]
fn the_agent_serves_operators_over_vsock_and_the_host_checks_the_current_identity() {
    let _l = crate::support::heavy_lock();
    if !require_vm_host() {
        return;
    }
    let Some(kernels) = test_kernels() else {
        return;
    };
    let guest_init = musl_bin("guest-init");
    let probe = musl_bin("guest-probe");
    on_each_kernel(&kernels, |kernel| {
        let svc = EnrollService::start().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let svc_sock: PathBuf = dir.path().join("svc-vm-1.sock");
        svc.listen_vm("vm-1", &svc_sock).unwrap();
        let id = Identity {
            workspace_namespace: "team-a".into(),
            workspace_name: "ws1".into(),
            workspace_uid: "0b4c5e2a-1111-2222-3333-444455556666".into(),
            vm_uid: "vm-1".into(),
            epoch: 3,
        };
        let expires = svc
            .register(TOKEN, &id, Duration::from_secs(15 * 60))
            .unwrap();
        let material = svc.material_json(TOKEN, &id, expires, ENROLL_PORT);
        let config = json!({
            "version": 1,
            "hostname": "vm-agent",
            "log_level": "debug",
            "modules": vm_image::VSOCK_MODULES,
            "app": {
                "command": [PROBE, "zombies", "0", "--then-sleep"],
                "user": APP_UID,
                "group": APP_UID,
                "workdir": "/tmp"
            },
            "control": {
                "listen": { "vsock": { "cid": u32::MAX, "port": CONTROL_PORT } },
                "with_agent": true
            },
            "shutdown": { "grace_period_ms": 5000 },
            "enrollment": {
                "bootstrap": { "file": BOOTSTRAP },
                "retry": { "initial_ms": 200, "max_ms": 2000, "max_attempts": 30 }
            },
            "agent": {
                "listen": { "vsock": { "cid": u32::MAX, "port": AGENT_PORT } },
                "exec_users": ["nobody"]
            }
        });
        let mut spec = InitramfsSpec::new(&guest_init, config);
        for (path, bytes, mode) in [
            (BOOTSTRAP, material.to_string().into_bytes(), 0o600),
            (
                "/etc/passwd",
                b"root:x:0:0:root:/:/bin/false\nnobody:x:65534:65534:nobody:/:/bin/false\n"
                    .to_vec(),
                0o644,
            ),
            (
                "/etc/group",
                b"root:x:0:\nnogroup:x:65534:\n".to_vec(),
                0o644,
            ),
        ] {
            spec.files.push(ExtraFile {
                guest_path: path.into(),
                source: Source::Bytes(bytes),
                mode,
            });
        }
        spec.files.push(ExtraFile {
            guest_path: PROBE.into(),
            source: Source::Host(probe.clone()),
            mode: 0o755,
        });
        let mut vm_spec = VmSpec::new("agent", Image::Initramfs(Box::new(spec)));
        vm_spec.kernel = Some(kernel.clone());
        vm_spec.relay_bin = Some(host_bin("host-relay"));
        vm_spec.relays.push(RelaySpec {
            name: "enroll".into(),
            config: json!({
                "app": "app-a",
                "vm": { "id": "vm-1" },
                "transport": { "per_vm_socket": { "vsock_uds": vm_spec.vsock_uds() } },
                "services": [{
                    "name": "enrollment",
                    "port": ENROLL_PORT,
                    "upstream": { "unix": svc_sock },
                }],
            }),
            wait_for: vec![vm_spec.port_socket(ENROLL_PORT)],
        });
        let target = Target::Hybrid(vm_spec.vsock_uds(), AGENT_PORT);

        let mut vm = Vm::boot(vm_spec).expect("boot");
        let ready = vm.wait_ready();
        assert!(ready.is_ok(), "no ready line: {ready:?}\n{}", vm.console());
        let current = dir.path().join("current.json");
        write_current(&current, &id, 3);
        let operator = client(&svc, &svc, "urn:hop3:operator:ops:role:operator", &current);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let call = |c: &Client, req: serde_json::Value| -> Result<serde_json::Value, CallError> {
            rt.block_on(c.call(&target, &req.to_string()))
                .map(|a| serde_json::from_str(&a).unwrap())
        };

        let status = call(&operator, json!({"v": 1, "op": "status"})).unwrap();
        assert_eq!(status["result"]["identity"], id.uri(), "{status}");

        let exec = call(
            &operator,
            json!({"v": 1, "op": "exec", "user": "nobody", "argv": [PROBE, "zombies", "0"]}),
        )
        .unwrap();
        assert_eq!(exec["result"]["exit_code"], 0, "{exec}");
        let out = base64::engine::general_purpose::STANDARD
            .decode(exec["result"]["stdout"].as_str().unwrap())
            .unwrap();
        assert!(
            String::from_utf8_lossy(&out).contains("guest-probe"),
            "{exec}"
        );

        let killed = call(
            &operator,
            json!({"v": 1, "op": "exec", "user": "nobody", "deadline_ms": 1000,
                   "argv": [PROBE, "write-and-wait", "/tmp/w", "16", "--ignore-term"]}),
        )
        .unwrap();
        assert_eq!(killed["result"]["timed_out"], true, "{killed}");

        // A client from another CA: refused by the guest.
        let rogue = EnrollService::start().unwrap();
        let stranger = client(&rogue, &svc, "urn:hop3:operator:x:role:operator", &current);
        assert!(call(&stranger, json!({"v": 1, "op": "status"})).is_err());
        vm.wait_for_console("refused vsock:2:", Duration::from_secs(30))
            .map(|line| assert!(line.contains("wrong CA"), "{line}"))
            .unwrap_or_else(|e| panic!("{e}"));

        // Measured: a full handshake and status, and an exec, host to guest (TCG).
        let mut handshakes = Vec::new();
        let mut execs = Vec::new();
        for _ in 0..50 {
            let t = Instant::now();
            call(&operator, json!({"v": 1, "op": "status"})).unwrap();
            handshakes.push(t.elapsed());
            let t = Instant::now();
            call(
                &operator,
                json!({"v": 1, "op": "exec", "user": "nobody", "argv": [PROBE, "zombies", "0"]}),
            )
            .unwrap();
            execs.push(t.elapsed());
        }
        eprintln!(
            "agent under TCG ({}): handshake+status median {:.1} ms, exec round trip median {:.1} ms (50 each)",
            kernel.version,
            median_ms(handshakes),
            median_ms(execs)
        );

        // The controller raised the epoch: the host refuses the guest's certificate.
        write_current(&current, &id, 4);
        match call(&operator, json!({"v": 1, "op": "stop"})) {
            Err(CallError::Refused(e)) => assert!(e.to_string().contains("epoch:4"), "{e}"),
            other => panic!("the stale guest was not refused: {other:?}"),
        }

        assert!(!vm.console().contains(TOKEN));
        let report = vm.stop().expect("stop");
        assert!(report.clean(), "{report:?}\n{}", vm.console());
    });
}
