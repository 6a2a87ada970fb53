//! Building the enrolling micro-VMs that the `agent_vm*` and `enroll_vm*` tests boot, in
//! one place: the identity they enroll as, the reference service with this VM's endpoint,
//! guest-init's configuration around an `enrollment` section, and the `host-relay` in
//! per-VM-socket mode that carries the guest's enrollment port (5002) to the service.
//!
//! Every one of these VMs is QEMU (TCG) with the Debian guest kernel, vhost-device-vsock,
//! the static musl `guest-init` as PID 1 and `guest-probe` as the app; a test adds what is
//! its own (an agent section, a root disk, a vTPM, a push source) to what is built here.

use std::path::{Path, PathBuf};

use e2e::enroll_service::EnrollService;
use e2e::util::{host_bin, musl_bin, on_each_kernel, require_vm_host, test_kernels};
use guest_init::enroll::identity::Identity;
use qemu_harness::{Image, Kernel, RelaySpec, VmSpec};
use serde_json::{json, Value};
use vm_image::initramfs::{ExtraFile, InitramfsSpec, Source};

pub(crate) const ENROLL_PORT: u32 = 5002;
pub(crate) const CONTROL_PORT: u32 = 1024;
pub(crate) const AGENT_PORT: u32 = 1025;
pub(crate) const APP_UID: u32 = 20001;
pub(crate) const PROBE: &str = "/bin/guest-probe";
pub(crate) const BOOTSTRAP: &str = "/etc/guest-init/bootstrap.json";
pub(crate) const VM_UID: &str = "vm-1";

/// Runs `body` on each guest kernel with the musl `guest-init` and `guest-probe`, when
/// `ready` (the test's own requirements, already checked with `require`) holds and this
/// host can run VMs; otherwise returns (the requirement skipped or failed the test).
pub(crate) fn each_kernel(ready: bool, mut body: impl FnMut(&Kernel, (&Path, &Path))) {
    if !ready || !require_vm_host() {
        return;
    }
    let Some(kernels) = test_kernels() else {
        return;
    };
    let guest_init = musl_bin("guest-init");
    let probe = musl_bin("guest-probe");
    on_each_kernel(&kernels, |kernel| body(kernel, (&guest_init, &probe)));
}

/// The identity every one of these VMs enrolls as, at `epoch`.
pub(crate) fn identity(epoch: u64) -> Identity {
    Identity {
        workspace_namespace: "team-a".into(),
        workspace_name: "ws1".into(),
        workspace_uid: "0b4c5e2a-1111-2222-3333-444455556666".into(),
        vm_uid: VM_UID.into(),
        epoch,
    }
}

/// The reference service, with the endpoint for [`VM_UID`] at `work/svc-vm-1.sock` (the
/// relay's upstream: the service knows the VM by the socket the connection came in on).
pub(crate) fn service(work: &Path) -> (EnrollService, PathBuf) {
    let svc = EnrollService::start().unwrap();
    let sock = work.join("svc-vm-1.sock");
    svc.listen_vm(VM_UID, &sock).unwrap();
    (svc, sock)
}

/// Registers `token` for `id` (valid 15 minutes) and returns the bootstrap material for it,
/// naming [`ENROLL_PORT`].
pub(crate) fn material(svc: &EnrollService, token: &str, id: &Identity) -> Value {
    let expires = svc
        .register(token, id, std::time::Duration::from_secs(15 * 60))
        .unwrap();
    svc.material_json(token, id, expires, ENROLL_PORT)
}

/// guest-init's configuration: `guest-probe` as the app (uid [`APP_UID`], waiting for
/// SIGTERM), the control port, a 5 s grace period, debug logging, `modules`, and
/// `enrollment`. A test adds its own sections (`agent`, `root`) to the value.
pub(crate) fn guest_config(hostname: &str, modules: &[&str], enrollment: Value) -> Value {
    json!({
        "version": 1,
        "hostname": hostname,
        "log_level": "debug",
        "modules": modules,
        "app": {
            "command": [PROBE, "zombies", "0", "--then-sleep"],
            "user": APP_UID,
            "group": APP_UID,
            "workdir": "/tmp"
        },
        "control": { "listen": { "vsock": { "cid": u32::MAX, "port": CONTROL_PORT } } },
        "shutdown": { "grace_period_ms": 5000 },
        "enrollment": enrollment,
    })
}

/// Runs `spec`'s VM with `host-relay` in per-VM-socket mode (relay log `enroll`) in front
/// of the service's endpoint `svc_sock`, as the service `enrollment` on [`ENROLL_PORT`].
pub(crate) fn add_enroll_relay(spec: &mut VmSpec, svc_sock: &Path) {
    spec.relay_bin = Some(host_bin("host-relay"));
    let config = json!({
        "app": "app-a",
        "vm": { "id": VM_UID },
        "transport": { "per_vm_socket": { "vsock_uds": spec.vsock_uds() } },
        "services": [{
            "name": "enrollment",
            "port": ENROLL_PORT,
            "upstream": { "unix": svc_sock },
        }],
    });
    let wait_for = vec![spec.port_socket(ENROLL_PORT)];
    spec.relays.push(RelaySpec {
        name: "enroll".into(),
        config,
        wait_for,
    });
}

/// A VM whose whole root is the initramfs: guest-init with `config`, `guest-probe` at
/// [`PROBE`] and `files` (guest path, content, mode), on `kernel`, with the enrollment
/// relay in front of `svc_sock`.
pub(crate) fn initramfs_vm(
    name: &str,
    kernel: &Kernel,
    (guest_init, probe): (&Path, &Path),
    config: Value,
    files: Vec<(&str, Vec<u8>, u32)>,
    svc_sock: &Path,
) -> VmSpec {
    let mut spec = InitramfsSpec::new(guest_init, config);
    spec.files.push(ExtraFile {
        guest_path: PROBE.into(),
        source: Source::Host(probe.to_path_buf()),
        mode: 0o755,
    });
    for (path, bytes, mode) in files {
        spec.files.push(ExtraFile {
            guest_path: path.into(),
            source: Source::Bytes(bytes),
            mode,
        });
    }
    let mut vm = VmSpec::new(name, Image::Initramfs(Box::new(spec)));
    vm.kernel = Some(kernel.clone());
    add_enroll_relay(&mut vm, svc_sock);
    vm
}

/// The accounts an agent's `exec` can name: root and `nobody` (`/etc/passwd`,
/// `/etc/group`), as [`initramfs_vm`] files.
pub(crate) fn accounts() -> Vec<(&'static str, Vec<u8>, u32)> {
    vec![
        (
            "/etc/passwd",
            b"root:x:0:0:root:/:/bin/false\nnobody:x:65534:65534:nobody:/:/bin/false\n".to_vec(),
            0o644,
        ),
        (
            "/etc/group",
            b"root:x:0:\nnogroup:x:65534:\n".to_vec(),
            0o644,
        ),
    ]
}
