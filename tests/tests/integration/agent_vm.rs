//! The agent inside a real micro-VM: QEMU (TCG), the Debian guest kernel,
//! vhost-device-vsock, the static musl `guest-init` as PID 1 enrolled through host-relay and
//! the reference service, its agent on vsock port 1025. The operator's client is
//! `host_relay::agent_client` (the code behind `host-relay agent`), reaching the agent
//! through the VMM's hybrid socket (`CONNECT 1025`), with its peer-authorizer reading the
//! current identity.
//!
//! Asserted: status names the enrolled identity; exec as a listed user returns its output
//! and status; exec past its deadline is killed; a client from another CA is refused; a
//! current-identity file naming another VM UID, then a raised epoch, makes the client refuse
//! the guest. Measured
//! (printed, not asserted: timings are not test assertions): the median of 50 status round
//! trips (a full handshake each) and of 50 exec round trips, host to guest, under TCG.

use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine;
use e2e::enroll_service::EnrollService;
use guest_init::enroll::identity::Identity;
use host_relay::agent_client::{CallError, Client, Target};
use qemu_harness::Vm;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::json;

use crate::vm_guest::{
    accounts, each_kernel, guest_config, identity, initramfs_vm, material, service, AGENT_PORT,
    BOOTSTRAP, PROBE,
};

const TOKEN: &str = "tok_AGENTVM_SECRET_0123456789abcdefghijklmnopq";

/// An operator client with a certificate from `issuer`'s CA, trusting the guest's
/// certificate from `management`'s CA.
pub(crate) fn client(
    issuer: &EnrollService,
    management: &EnrollService,
    uri: &str,
    current: &Path,
) -> Client {
    let (cert, key) = issuer.issue_operator(uri, -60, 3600);
    Client::new(
        vec![CertificateDer::from(cert)],
        PrivateKeyDer::Pkcs8(key.into()),
        management.ca_der().to_vec(),
        current.to_path_buf(),
    )
    .unwrap()
}

pub(crate) fn write_current(path: &Path, id: &Identity, epoch: u64) {
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

/// The agent's section: vsock port [`AGENT_PORT`], `exec` as `nobody` only.
pub(crate) fn agent_section() -> serde_json::Value {
    json!({
        "listen": { "vsock": { "cid": u32::MAX, "port": AGENT_PORT } },
        "exec_users": ["nobody"]
    })
}

fn median_ms(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1000.0
}

#[test]
fn the_agent_serves_operators_over_vsock_and_the_host_checks_the_current_identity() {
    let _l = crate::support::heavy_lock();
    each_kernel(true, |kernel, bins| {
        let dir = tempfile::tempdir().unwrap();
        let (svc, svc_sock) = service(dir.path());
        let id = identity(3);
        let material = material(&svc, TOKEN, &id);
        let mut config = guest_config(
            "vm-agent",
            vm_image::VSOCK_MODULES,
            json!({
                "bootstrap": { "file": BOOTSTRAP },
                "retry": { "initial_ms": 200, "max_ms": 2000, "max_attempts": 30 }
            }),
        );
        config["control"]["with_agent"] = json!(true);
        config["agent"] = agent_section();
        let mut files = accounts();
        files.push((BOOTSTRAP, material.to_string().into_bytes(), 0o600));
        let vm_spec = initramfs_vm("agent", kernel, bins, config, files, &svc_sock);
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

        // The controller moved the workspace to another VM: the host refuses this guest,
        // then serves it again once the file names it (the file is read on each handshake).
        let moved = Identity {
            vm_uid: "vm-2".into(),
            ..id.clone()
        };
        write_current(&current, &moved, 3);
        match call(&operator, json!({"v": 1, "op": "status"})) {
            Err(CallError::Refused(e)) => assert!(e.to_string().contains("vm-2"), "{e}"),
            other => panic!("a guest of another VM UID was not refused: {other:?}"),
        }
        write_current(&current, &id, 3);
        call(&operator, json!({"v": 1, "op": "status"})).expect("served again");

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
