//! Enrollment inside a real micro-VM: QEMU (TCG), the Debian guest kernel,
//! vhost-device-vsock, the static musl `guest-init` as PID 1 with an `enrollment` section,
//! and `host-relay` in per-VM-socket mode on port 5002 in front of the reference
//! enrollment service.
//!
//! The guest reads its bootstrap file (root, 0600, in the initramfs), makes its key and
//! CSR, dials vsock CID 2 port 5002; vhost-device-vsock turns that into a connection to
//! `<vm.vsock>_5002`, where host-relay admits it (only this VM's VMM can reach that socket)
//! and connects to the service's socket for `vm-1`. PID 1 starts the app only after the
//! certificate is verified and published, so the ready line proves the order.
//!
//! One VM per test binary run, under a process-wide lock like the other VM tests.

use qemu_harness::Vm;
use serde_json::json;

use crate::vm_guest::{
    each_kernel, guest_config, identity, initramfs_vm, material, service, BOOTSTRAP,
};

#[test]
fn vm_enrolls_through_vsock_and_host_relay_before_the_app_starts() {
    let _l = crate::support::heavy_lock();
    each_kernel(true, |kernel, bins| {
        let svc_dir = tempfile::tempdir().unwrap();
        let (svc, svc_sock) = service(svc_dir.path());
        let id = identity(u64::MAX);
        let token = "tok_VM_SECRET_0123456789abcdefghijklmnopqrstuv";
        let material = material(&svc, token, &id);

        let config = guest_config(
            "vm-enroll",
            vm_image::VSOCK_MODULES,
            json!({
                "bootstrap": { "file": BOOTSTRAP },
                "retry": { "initial_ms": 200, "max_ms": 2000, "max_attempts": 30 }
            }),
        );
        let vm_spec = initramfs_vm(
            "enroll",
            kernel,
            bins,
            config,
            vec![(BOOTSTRAP, material.to_string().into_bytes(), 0o600)],
            &svc_sock,
        );

        let mut vm = Vm::boot(vm_spec).expect("boot");
        let ready = vm.wait_ready();
        let console = vm.console();
        assert!(ready.is_ok(), "no ready line: {ready:?}\n{console}");

        // Enrolled, then the app: the enrollment lines come before the ready line.
        let enrolled = console
            .find("guest-init: enroll: enrolled ")
            .unwrap_or_else(|| panic!("no enrollment line:\n{console}"));
        let ready_at = console.find(qemu_harness::vm::READY_MARK).unwrap();
        assert!(
            enrolled < ready_at,
            "the app started before enrollment:\n{console}"
        );
        assert!(console.contains(&id.uri()), "{console}");

        // The service saw exactly this VM (from the socket the relay used) and committed.
        let reqs = svc.requests();
        assert_eq!(reqs.len(), 1, "{reqs:?}");
        assert_eq!(reqs[0].vm_uid, "vm-1");
        assert!(reqs[0].code.is_none(), "{reqs:?}");
        assert!(svc.committed_cert(token).is_some());

        // Secrets: the token never reaches the console or the relay's log (debug logging on).
        assert!(!console.contains(token), "token on the console:\n{console}");
        assert!(!vm.relay_log("enroll").contains(token));

        let report = vm.stop().expect("stop");
        assert!(report.clean(), "{report:?}\n{}", vm.console());
        let console = vm.console();
        for bad in ["Kernel panic", "Attempted to kill init"] {
            assert!(!console.contains(bad), "{bad}:\n{console}");
        }
    });
}
