//! VM test 7, part 2: a reboot in the middle of enrollment resumes with the identical CSR,
//! because the guest's enrollment state lives on a virtio-blk disk.
//!
//! # What runs
//!
//! The same path as `enroll_vm.rs` — QEMU (TCG), the Debian guest kernel,
//! vhost-device-vsock, the static musl `guest-init` as PID 1, `host-relay` in
//! per-VM-socket mode on vsock port 5002 in front of the reference enrollment service —
//! with one difference: the guest's root is an ext4 disk on virtio-blk (`/dev/vda`),
//! built with `vm_image::rootdisk` from a directory holding the bootstrap material
//! (root, `0600`) and the app (`guest-probe`). guest-init switches root into it before
//! enrolling, so its state directory (`/var/lib/guest-init/enroll`: key, exact CSR,
//! `pending.json`) is on that disk. The initramfs holds only guest-init, its configuration
//! and the kernel modules.
//!
//! # The scenario
//!
//! 1. **Boot 1.** The service is told to stall after committing (`stall_after_commit`):
//!    it receives the guest's CSR, issues and commits the certificate, and holds back the
//!    answer. Once it has stalled, QEMU is killed with SIGKILL — no orderly shutdown, no
//!    `sync`, no unmount: for the guest this is a power cut mid-enrollment. The guest's
//!    per-attempt timeout is long (120 s), so it cannot give up and retry (and so
//!    succeed) inside boot 1 before the kill.
//! 2. **Between boots**, the disk is inspected on a *copy* (the journal replayed there by
//!    `e2fsck`, the original untouched so the guest's own kernel does the recovery in
//!    boot 2): the key (`0600`), the CSR byte-identical to what the service received, and
//!    `pending.json` are there; no certificate, no `enrolled.json`.
//! 3. **Boot 2**, from the same disk image (a new QEMU, vsock backend and relay: what a
//!    platform restarting a VM does). The guest logs that it resumes the pending
//!    enrollment, the service records a second request whose CSR is byte-identical to
//!    boot 1's and answers it with the certificate committed in boot 1, the app starts
//!    only after that, and after an orderly stop the disk holds that very certificate,
//!    the unchanged key and CSR, and `enrolled.json` in place of `pending.json`.
//!
//! # Why it can fail
//!
//! If guest-init made a new key or CSR after the reboot — state on a tmpfs, not written
//! before the send, or not `fsync`ed (the guest page cache dies with QEMU) — boot 2's CSR
//! would differ, the service would answer `csr_mismatch`, and both the CSR comparison and
//! the ready line fail. If the certificate were not the committed one, the comparison of
//! the disk's `.crt` with the service's ledger fails.
//!
//! # The disk's cache mode
//!
//! The harness attaches disks with `cache=unsafe`: QEMU ignores the guest's flushes, but
//! every write the guest's block layer completed is already in the host's page cache
//! (QEMU completes a write once `pwrite` to the image returns). Killing QEMU therefore
//! loses exactly what the guest had not yet written out — the guest's own page cache —
//! which is what the guest's `fsync` defends against, as with `cache=writeback`. Only a
//! host crash would tell the modes apart, and that is not what this test simulates.
//!
//! Needs QEMU, the guest kernel, vhost-device-vsock, e2fsprogs (`mke2fs`, `debugfs`,
//! `e2fsck`) and root (the disk's files must be owned by root for guest-init to accept
//! the bootstrap file); without them it prints `SKIPPED` (or fails under `REQUIRE_ALL=1`).

use std::collections::BTreeMap;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use e2e::enroll_service::EnrollService;
use e2e::util::{
    e2fs_tool, host_bin, musl_bin, on_each_kernel, require, require_vm_host, test_kernels,
};
use guest_init::enroll::identity::Identity;
use p256::pkcs8::DecodePrivateKey;
use qemu_harness::process::tail;
use qemu_harness::{Image, Kernel, RelaySpec, Vm, VmSpec};
use serde_json::json;
use sha2::{Digest, Sha256};
use vm_image::initramfs::InitramfsSpec;
use vm_image::rootdisk::RootDiskSpec;

const ENROLL_PORT: u32 = 5002;
const CONTROL_PORT: u32 = 1024;
const APP_UID: u32 = 20001;
const PROBE: &str = "/bin/guest-probe";
const BOOTSTRAP: &str = "/etc/guest-init/bootstrap.json";
const STATE_DIR: &str = "/var/lib/guest-init/enroll";
const VM_UID: &str = "vm-1";
const TOKEN: &str = "tok_REBOOT_SECRET_0123456789abcdefghijklmnopqrstuv";

/// Generous: boot-to-ready under TCG on this shared machine has been 7 to 20 s.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);

/// Everything the test needs, or `None` after `require` skipped (or failed).
struct Tools {
    debugfs: PathBuf,
    e2fsck: PathBuf,
}

fn check_requirements() -> Option<Tools> {
    let debugfs = e2fs_tool("debugfs");
    let e2fsck = e2fs_tool("e2fsck");
    let ok = require_vm_host()
        && require(
            e2fs_tool("mke2fs").is_some() && debugfs.is_some() && e2fsck.is_some(),
            "e2fsprogs: mke2fs, debugfs, e2fsck (apt-get install e2fsprogs)",
        )
        && require(
            nix::unistd::geteuid().is_root(),
            "root (the root disk's bootstrap file must be owned by root; CI runs as root)",
        );
    ok.then(|| Tools {
        debugfs: debugfs.unwrap_or_default(),
        e2fsck: e2fsck.unwrap_or_default(),
    })
}

/// The directory tree that becomes the guest's root disk: the app, the bootstrap
/// material (root, `0600`, in a `0700` directory) and the mount points guest-init uses.
fn populate_root(root: &Path, probe: &Path, material: &[u8]) {
    for (dir, mode) in [
        ("bin", 0o755),
        ("etc", 0o755),
        ("etc/guest-init", 0o700),
        ("dev", 0o755),
        ("proc", 0o555),
        ("sys", 0o555),
        ("run", 0o755),
        ("tmp", 0o1777),
        ("var/lib", 0o755),
    ] {
        let p = root.join(dir);
        std::fs::create_dir_all(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let app = root.join(&PROBE[1..]);
    std::fs::copy(probe, &app).unwrap();
    std::fs::set_permissions(&app, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(root.join(&BOOTSTRAP[1..]))
        .unwrap();
    std::io::Write::write_all(&mut f, material).unwrap();
}

/// One file of the state directory as the disk holds it.
#[derive(Debug)]
struct DiskFile {
    mode: u32,
    uid: u32,
    bytes: Vec<u8>,
}

/// The state directory read from the disk image: its mode (if it exists) and its files.
#[derive(Debug, Default)]
struct DiskState {
    dir_mode: Option<u32>,
    files: BTreeMap<String, DiskFile>,
}

impl DiskState {
    fn names_ending(&self, ext: &str) -> Vec<&str> {
        self.files
            .keys()
            .filter(|n| n.ends_with(ext))
            .map(|n| n.as_str())
            .collect()
    }

    fn only(&self, ext: &str) -> &DiskFile {
        let names = self.names_ending(ext);
        assert_eq!(names.len(), 1, "want exactly one {ext} file: {names:?}");
        &self.files[names[0]]
    }

    fn listing(&self) -> String {
        self.files
            .iter()
            .map(|(n, f)| format!("{n} {:o} uid {} {} bytes", f.mode, f.uid, f.bytes.len()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `ls -p` lines of debugfs: `/inode/mode/uid/gid/name/size/`.
fn parse_ls(out: &str) -> Vec<(String, u32, u32)> {
    out.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split('/').collect();
            if f.len() < 7 || !f[0].is_empty() {
                return None;
            }
            let mode = u32::from_str_radix(f[2], 8).ok()?;
            let uid = f[3].parse().ok()?;
            Some((f[5].to_string(), mode, uid))
        })
        .collect()
}

fn run(cmd: &mut Command) -> std::process::Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Reads the enrollment state directory from `image` without touching it: the image is
/// copied (sparse), `e2fsck` replays the journal on the copy (a killed guest leaves the
/// last transactions only in the journal), and `debugfs` reads the files out of it.
fn read_state(tools: &Tools, image: &Path, scratch: &Path) -> DiskState {
    let copy = scratch.join("inspect.ext4");
    let _ = std::fs::remove_file(&copy);
    let out = run(Command::new("cp")
        .arg("--sparse=always")
        .arg(image)
        .arg(&copy));
    assert!(out.status.success(), "cp: {out:?}");
    // 0: clean; 1: errors corrected (the journal replay counts). 4 and up: damaged.
    let out = run(Command::new(&tools.e2fsck).arg("-fy").arg(&copy));
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "e2fsck finds the guest's file system damaged ({:?}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let debugfs = |req: &str| -> String {
        let out = run(Command::new(&tools.debugfs).arg("-R").arg(req).arg(&copy));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let (parent, leaf) = STATE_DIR.rsplit_once('/').unwrap();
    let mut state = DiskState {
        dir_mode: parse_ls(&debugfs(&format!("ls -p {parent}")))
            .into_iter()
            .find(|(n, _, _)| n == leaf)
            .map(|(_, m, _)| m),
        ..DiskState::default()
    };
    if state.dir_mode.is_none() {
        return state;
    }
    for (name, mode, uid) in parse_ls(&debugfs(&format!("ls -p {STATE_DIR}"))) {
        if name == "." || name == ".." || mode & 0o170000 != 0o100000 {
            continue;
        }
        let dump = scratch.join("dump");
        let _ = std::fs::remove_file(&dump);
        debugfs(&format!("dump {STATE_DIR}/{name} {}", dump.display()));
        let bytes = std::fs::read(&dump)
            .unwrap_or_else(|e| panic!("debugfs could not dump {STATE_DIR}/{name}: {e}"));
        state.files.insert(name, DiskFile { mode, uid, bytes });
    }
    state
}

fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// Polls `f` every 50 ms until it holds, or fails naming `what` with the console.
fn wait_until(vm: &mut Vm, what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(
            vm.is_running(),
            "QEMU ended while waiting for {what}:\n{}",
            tail(&vm.console(), 40)
        );
        assert!(
            Instant::now() < deadline,
            "gave up after {timeout:?} waiting for {what}:\n{}",
            tail(&vm.console(), 40)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The VM: the initramfs (guest-init, configuration, modules) and the root disk.
fn vm_spec(name: &str, kernel: &Kernel, guest_init: &Path, disk: &Path, svc_sock: &Path) -> VmSpec {
    let mut modules: Vec<&str> = vm_image::VSOCK_MODULES.to_vec();
    modules.extend(["virtio_blk", "ext4"]);
    let config = json!({
        "version": 1,
        "hostname": "vm-enroll-reboot",
        "log_level": "debug",
        "modules": modules,
        "root": { "device": "/dev/vda", "fstype": "ext4", "wait_ms": 20000 },
        "app": {
            "command": [PROBE, "zombies", "0", "--then-sleep"],
            "user": APP_UID,
            "group": APP_UID,
            "workdir": "/tmp"
        },
        "control": { "listen": { "vsock": { "cid": u32::MAX, "port": CONTROL_PORT } } },
        "shutdown": { "grace_period_ms": 5000 },
        "enrollment": {
            "bootstrap": { "file": BOOTSTRAP },
            "key_store": "file",
            "state_dir": STATE_DIR,
            // Long enough that boot 1 cannot time out and retry before the test kills it.
            "timeout_ms": 120_000,
            "retry": { "initial_ms": 200, "max_ms": 2000, "max_attempts": 30 }
        }
    });
    let mut spec = VmSpec::new(
        name,
        Image::Initramfs(Box::new(InitramfsSpec::new(guest_init, config))),
    );
    spec.kernel = Some(kernel.clone());
    spec.disks = vec![(disk.to_path_buf(), false)];
    spec.ready_timeout = BOOT_TIMEOUT;
    spec.relay_bin = Some(host_bin("host-relay"));
    spec.relays.push(RelaySpec {
        name: "enroll".into(),
        config: json!({
            "app": "app-a",
            "vm": {"id": VM_UID},
            "transport": {"per_vm_socket": {"vsock_uds": spec.vsock_uds()}},
            "services": [{
                "name": "enrollment",
                "port": ENROLL_PORT,
                "upstream": { "unix": svc_sock },
            }],
        }),
        wait_for: vec![spec.port_socket(ENROLL_PORT)],
    });
    spec
}

/// The secrets scan: neither the token nor the private key (DER or scalar, hex or
/// base64, or any PEM line of it) in anything the guest or the relay printed.
fn assert_no_secrets(outputs: &[(&str, String)], key_der: &[u8]) {
    let hex = |b: &[u8]| -> String { b.iter().map(|x| format!("{x:02x}")).collect() };
    let b64 = base64::engine::general_purpose::STANDARD;
    let scalar = p256::ecdsa::SigningKey::from_pkcs8_der(key_der)
        .expect("the disk's key is PKCS#8 P-256")
        .to_bytes()
        .to_vec();
    let mut needles = vec![("token".to_string(), TOKEN.to_string())];
    for (what, bytes) in [("key DER", key_der.to_vec()), ("key scalar", scalar)] {
        needles.push((format!("{what} hex"), hex(&bytes)));
        needles.push((format!("{what} HEX"), hex(&bytes).to_uppercase()));
        needles.push((format!("{what} base64"), b64.encode(&bytes)));
        needles.push((
            format!("{what} base64url"),
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&bytes),
        ));
    }
    for line in b64.encode(key_der).as_bytes().chunks(64) {
        needles.push(("key PEM line".into(), String::from_utf8_lossy(line).into()));
    }
    for (source, out) in outputs {
        for (what, n) in &needles {
            // The message names what leaked and where, never the secret itself.
            assert!(!out.contains(n.as_str()), "{what} appears in the {source}");
        }
        assert!(
            !out.contains("PRIVATE KEY"),
            "a PEM private key appears in the {source}"
        );
    }
}

#[test]
fn a_reboot_mid_enrollment_resumes_from_the_virtio_blk_disk_with_the_identical_csr() {
    let _l = crate::support::heavy_lock();
    let Some(tools) = check_requirements() else {
        return;
    };
    let Some(kernels) = test_kernels() else {
        return;
    };
    let guest_init = musl_bin("guest-init");
    let probe = musl_bin("guest-probe");
    on_each_kernel(&kernels, |kernel| {
        // The service, its endpoint for this VM, and the token bound to the VM's identity.
        let svc = EnrollService::start().unwrap();
        let work = tempfile::tempdir().unwrap();
        let svc_sock = work.path().join("svc-vm-1.sock");
        svc.listen_vm(VM_UID, &svc_sock).unwrap();
        let id = Identity {
            workspace_namespace: "team-a".into(),
            workspace_name: "ws1".into(),
            workspace_uid: "0b4c5e2a-1111-2222-3333-444455556666".into(),
            vm_uid: VM_UID.into(),
            epoch: 7,
        };
        let expires = svc
            .register(TOKEN, &id, Duration::from_secs(15 * 60))
            .unwrap();
        let material = json!({
            "version": 1,
            "workspace_namespace": id.workspace_namespace,
            "workspace_name": id.workspace_name,
            "workspace_uid": id.workspace_uid,
            "vm_uid": id.vm_uid,
            "revocation_epoch": id.epoch,
            "token": TOKEN,
            "expires_at": expires,
            "enrollment_port": ENROLL_PORT,
            "management_ca": svc.management_ca_b64(),
        });

        // The root disk: the app and the bootstrap material; the guest adds its state.
        let tree = work.path().join("root");
        populate_root(&tree, &probe, material.to_string().as_bytes());
        let disk = work.path().join("root.ext4");
        vm_image::rootdisk::build(
            &RootDiskSpec {
                source: tree,
                size_mib: 32,
                label: "enroll-reboot".into(),
                normalize_times: false,
            },
            &disk,
        )
        .unwrap_or_else(|e| panic!("root disk: {e}"));
        let fresh = read_state(&tools, &disk, work.path());
        assert!(
            fresh.dir_mode.is_none(),
            "the fresh disk already has a state directory: {fresh:?}"
        );

        // Boot 1: the service commits the CSR and never answers; then the power goes.
        svc.stall_after_commit();
        let boot1_started = Instant::now();
        let mut vm1 = Vm::boot(vm_spec(
            "enroll-reboot-1",
            kernel,
            &guest_init,
            &disk,
            &svc_sock,
        ))
        .unwrap_or_else(|e| panic!("boot 1: {e}"));
        wait_until(
            &mut vm1,
            "the service to commit boot 1's CSR and stall",
            BOOT_TIMEOUT,
            || svc.stalled() == 1,
        );
        let boot1_to_stall = boot1_started.elapsed();
        let qemu_pid = vm1
            .pids()
            .into_iter()
            .find(|(n, _)| n == "qemu")
            .map(|(_, p)| p)
            .expect("QEMU's pid");
        // A power cut: SIGKILL, no stop request. QEMU is our unreaped child, so its pid
        // cannot have been reused.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(qemu_pid).unwrap()),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("SIGKILL QEMU");
        let status = vm1
            .wait_exit(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("QEMU did not die of SIGKILL: {e}"));
        assert_eq!(status.signal(), Some(9), "QEMU ended otherwise: {status:?}");
        let console1 = vm1.console();
        let relay1 = vm1.relay_log("enroll");
        assert!(
            console1.contains("switched root to /dev/vda"),
            "boot 1 did not run on the disk:\n{}",
            tail(&console1, 40)
        );
        assert!(
            console1.contains("enroll: new file key ") && console1.contains(" persisted"),
            "boot 1 did not make and persist a key and CSR:\n{}",
            tail(&console1, 40)
        );
        assert!(
            !console1.contains("enroll: enrolled ")
                && !console1.contains(qemu_harness::vm::READY_MARK),
            "boot 1 got its certificate before the kill: the reboot was not mid-enrollment:\n{}",
            tail(&console1, 40)
        );
        drop(vm1);

        // The stalled request completes into the dead connection and is recorded.
        let committed = svc
            .committed_cert(TOKEN)
            .expect("boot 1's CSR was committed");
        svc.release_stall();
        let deadline = Instant::now() + Duration::from_secs(60);
        while svc.requests().is_empty() {
            assert!(
                Instant::now() < deadline,
                "the stalled request was never recorded"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let first = svc.requests();
        assert_eq!(
            first.len(),
            1,
            "boot 1 sent more than one request: {first:?}"
        );
        let csr1 = first[0]
            .csr
            .clone()
            .expect("boot 1's request carried a CSR");
        assert_eq!(first[0].vm_uid, VM_UID);
        assert_eq!(first[0].cert.as_deref(), Some(committed.as_slice()));

        // The disk after the power cut: key, exact CSR and pending state, no certificate.
        let between = read_state(&tools, &disk, work.path());
        assert_eq!(
            between.dir_mode,
            Some(0o040700),
            "state directory after boot 1: {between:?}"
        );
        let key1 = between.only(".key");
        assert_eq!(
            (key1.mode, key1.uid),
            (0o100600, 0),
            "the key file is not root-only"
        );
        let key1 = key1.bytes.clone();
        assert!(
            between.only(".csr").bytes == csr1,
            "the CSR on the disk (sha256 {}) is not the one the service received (sha256 {})",
            sha(&between.only(".csr").bytes),
            sha(&csr1)
        );
        assert!(
            between.files.contains_key("pending.json")
                && !between.files.contains_key("enrolled.json")
                && between.names_ending(".crt").is_empty(),
            "after boot 1 the disk should hold a pending enrollment and no certificate: {}",
            between.listing()
        );

        // Boot 2 from the same disk: the guest resends the same CSR and gets the certificate.
        let mut vm2 = Vm::boot(vm_spec(
            "enroll-reboot-2",
            kernel,
            &guest_init,
            &disk,
            &svc_sock,
        ))
        .unwrap_or_else(|e| panic!("boot 2: {e}"));
        let ready = vm2.wait_ready();
        let console2 = vm2.console();
        assert!(
            ready.is_ok(),
            "boot 2 never got ready: {ready:?}\n{}",
            tail(&console2, 60)
        );
        assert!(
            console2.contains("enroll: resuming the pending enrollment of ")
                && !console2.contains("enroll: new file key "),
            "boot 2 did not resume the pending enrollment:\n{}",
            tail(&console2, 60)
        );
        let enrolled = console2
            .find("guest-init: enroll: enrolled ")
            .unwrap_or_else(|| panic!("no enrollment line in boot 2:\n{console2}"));
        let ready_at = console2.find(qemu_harness::vm::READY_MARK).unwrap();
        assert!(
            enrolled < ready_at,
            "the app started before enrollment:\n{console2}"
        );
        let reqs = svc.requests();
        assert_eq!(
            reqs.len(),
            2,
            "want boot 1's request and one resend: {reqs:?}"
        );
        let csr2 = reqs[1].csr.clone().expect("boot 2's request carried a CSR");
        assert!(
            csr2 == csr1,
            "boot 2 sent another CSR (sha256 {}) than boot 1 (sha256 {})",
            sha(&csr2),
            sha(&csr1)
        );
        assert!(reqs[1].code.is_none(), "boot 2 was refused: {:?}", reqs[1]);
        assert_eq!(reqs[1].vm_uid, VM_UID);
        assert!(
            reqs[1].cert.as_deref() == Some(committed.as_slice()),
            "boot 2 was answered with another certificate than the one committed in boot 1"
        );
        let relay2 = vm2.relay_log("enroll");
        // For a person reading the log (not asserted: timings belong to benchmarks).
        eprintln!(
            "[enroll_vm_reboot] boot 1: QEMU start to the service's stall {:.2} s, then SIGKILL; \
         boot 2: boot-to-ready {:.2} s; CSR sha256 {} sent in both boots; certificate \
         sha256 {}",
            boot1_to_stall.as_secs_f64(),
            vm2.ready().map_or(0.0, |r| r.boot_to_ready.as_secs_f64()),
            sha(&csr1),
            sha(&committed)
        );

        let report = vm2.stop().unwrap_or_else(|e| panic!("stop: {e}"));
        assert!(report.clean(), "{report:?}\n{}", tail(&vm2.console(), 40));
        let console2 = vm2.console();
        for bad in ["Kernel panic", "Attempted to kill init"] {
            assert!(!console2.contains(bad), "{bad}:\n{console2}");
        }
        drop(vm2);

        // The disk now holds the committed certificate for the unchanged key and CSR.
        let after = read_state(&tools, &disk, work.path());
        assert!(
            after.only(".key").bytes == key1,
            "the key changed across the reboot"
        );
        assert!(
            after.only(".csr").bytes == csr1,
            "the CSR changed across the reboot"
        );
        assert!(
            after.only(".crt").bytes == committed,
            "the guest stored another certificate (sha256 {}) than the one committed in boot 1 \
         (sha256 {})",
            sha(&after.only(".crt").bytes),
            sha(&committed)
        );
        assert!(
            after.files.contains_key("enrolled.json") && !after.files.contains_key("pending.json"),
            "after boot 2 the enrollment should be complete: {}",
            after.listing()
        );

        assert_no_secrets(
            &[
                ("boot 1 console", console1),
                ("boot 1 relay log", relay1),
                ("boot 2 console", console2),
                ("boot 2 relay log", relay2),
            ],
            &key1,
        );
    });
}
