//! Support for the enrollment VM tests whose guest root is an ext4 disk on virtio-blk
//! (`enroll_vm_reboot`, `enroll_vm_tpm`): the requirements, the root tree with the
//! bootstrap material, the VM specification, reading the enrollment state back out of the
//! disk image without touching it, and a power cut.

use std::collections::BTreeMap;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use e2e::enroll_service::EnrollService;
use e2e::util::{e2fs_tool, require, require_vm_host};
use qemu_harness::process::tail;
use qemu_harness::{Image, Kernel, Vm, VmSpec};
use serde_json::json;
use sha2::{Digest, Sha256};
use vm_image::initramfs::InitramfsSpec;
use vm_image::rootdisk::RootDiskSpec;

use crate::vm_guest::{add_enroll_relay, guest_config, identity, material, service};

pub(crate) use crate::vm_guest::{BOOTSTRAP, PROBE, VM_UID};
pub(crate) const STATE_DIR: &str = "/var/lib/guest-init/enroll";

/// Generous: boot-to-ready under TCG on this shared machine has been 7 to 20 s.
pub(crate) const BOOT_TIMEOUT: Duration = Duration::from_secs(300);

/// Everything the test needs, or `None` after `require` skipped (or failed).
pub(crate) struct Tools {
    pub(crate) debugfs: PathBuf,
    pub(crate) e2fsck: PathBuf,
}

pub(crate) fn check_requirements() -> Option<Tools> {
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
pub(crate) fn populate_root(root: &Path, probe: &Path, material: &[u8]) {
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
pub(crate) struct DiskFile {
    pub(crate) mode: u32,
    pub(crate) uid: u32,
    pub(crate) bytes: Vec<u8>,
}

/// The state directory read from the disk image: its mode (if it exists) and its files.
#[derive(Debug, Default)]
pub(crate) struct DiskState {
    pub(crate) dir_mode: Option<u32>,
    pub(crate) files: BTreeMap<String, DiskFile>,
}

impl DiskState {
    pub(crate) fn names_ending(&self, ext: &str) -> Vec<&str> {
        self.files
            .keys()
            .filter(|n| n.ends_with(ext))
            .map(|n| n.as_str())
            .collect()
    }

    pub(crate) fn only(&self, ext: &str) -> &DiskFile {
        let names = self.names_ending(ext);
        assert_eq!(names.len(), 1, "want exactly one {ext} file: {names:?}");
        &self.files[names[0]]
    }

    pub(crate) fn listing(&self) -> String {
        self.files
            .iter()
            .map(|(n, f)| format!("{n} {:o} uid {} {} bytes", f.mode, f.uid, f.bytes.len()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `ls -p` lines of debugfs: `/inode/mode/uid/gid/name/size/`.
pub(crate) fn parse_ls(out: &str) -> Vec<(String, u32, u32)> {
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

pub(crate) fn run(cmd: &mut Command) -> std::process::Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Reads the enrollment state directory from `image` without touching it: the image is
/// copied (sparse), `e2fsck` replays the journal on the copy (a killed guest leaves the
/// last transactions only in the journal), and `debugfs` reads the files out of it.
pub(crate) fn read_state(tools: &Tools, image: &Path, scratch: &Path) -> DiskState {
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

pub(crate) fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// Polls `f` every 50 ms until it holds, or fails naming `what` with the console.
pub(crate) fn wait_until(vm: &mut Vm, what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
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

/// The VM: the initramfs (guest-init, configuration, modules) and the root disk, with
/// enrollment's `key_store` set to `key_store`.
pub(crate) fn vm_spec(
    name: &str,
    kernel: &Kernel,
    guest_init: &Path,
    disk: &Path,
    svc_sock: &Path,
    key_store: &str,
) -> VmSpec {
    let mut modules: Vec<&str> = vm_image::VSOCK_MODULES.to_vec();
    modules.extend(["virtio_blk", "ext4"]);
    let mut config = guest_config(
        "vm-enroll-reboot",
        &modules,
        json!({
            "bootstrap": { "file": BOOTSTRAP },
            "key_store": key_store,
            "state_dir": STATE_DIR,
            // Long enough that boot 1 cannot time out and retry before the test kills it.
            "timeout_ms": 120_000,
            "retry": { "initial_ms": 200, "max_ms": 2000, "max_attempts": 30 }
        }),
    );
    config["root"] = json!({ "device": "/dev/vda", "fstype": "ext4", "wait_ms": 20000 });
    let mut spec = VmSpec::new(
        name,
        Image::Initramfs(Box::new(InitramfsSpec::new(guest_init, config))),
    );
    spec.kernel = Some(kernel.clone());
    spec.disks = vec![(disk.to_path_buf(), false)];
    spec.ready_timeout = BOOT_TIMEOUT;
    add_enroll_relay(&mut spec, svc_sock);
    spec
}

/// A power cut: SIGKILL to QEMU (no stop request, no sync), then waits for it to die.
pub(crate) fn power_cut(vm: &mut Vm) {
    let qemu_pid = vm
        .pids()
        .into_iter()
        .find(|(n, _)| n == "qemu")
        .map(|(_, p)| p)
        .expect("QEMU's pid");
    // QEMU is our unreaped child, so its pid cannot have been reused.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(qemu_pid).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL QEMU");
    let status = vm
        .wait_exit(Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("QEMU did not die of SIGKILL: {e}"));
    assert_eq!(status.signal(), Some(9), "QEMU ended otherwise: {status:?}");
}

/// The reference service with an endpoint for [`VM_UID`] and `token` registered for its
/// identity (epoch 7), and a fresh root disk holding the app and that bootstrap material.
pub(crate) fn service_and_disk(
    tools: &Tools,
    work: &Path,
    probe: &Path,
    token: &str,
) -> (EnrollService, PathBuf, PathBuf) {
    // The service, its endpoint for this VM, and the token bound to the VM's identity.
    let (svc, svc_sock) = service(work);
    let id = identity(7);
    let material = material(&svc, token, &id);

    // The root disk: the app and the bootstrap material; the guest adds its state.
    let tree = work.join("root");
    populate_root(&tree, probe, material.to_string().as_bytes());
    let disk = work.join("root.ext4");
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
    let fresh = read_state(tools, &disk, work);
    assert!(
        fresh.dir_mode.is_none(),
        "the fresh disk already has a state directory: {fresh:?}"
    );
    (svc, svc_sock, disk)
}

/// Boots `spec` after a power cut mid-enrollment and checks that the guest resumed: it
/// says so and makes no new `store` key, enrolls before the app starts, and the service's
/// second request carries the byte-identical CSR `csr1` and was answered with `committed`.
/// Returns the running VM.
pub(crate) fn boot_resumes(
    spec: VmSpec,
    store: &str,
    svc: &EnrollService,
    csr1: &[u8],
    committed: &[u8],
) -> Vm {
    let mut vm = Vm::boot(spec).unwrap_or_else(|e| panic!("boot 2: {e}"));
    let ready = vm.wait_ready();
    let console = vm.console();
    assert!(
        ready.is_ok(),
        "boot 2 never got ready: {ready:?}\n{}",
        tail(&console, 60)
    );
    assert!(
        console.contains("enroll: resuming the pending enrollment of ")
            && !console.contains(&format!("enroll: new {store} key ")),
        "boot 2 did not resume the pending enrollment:\n{}",
        tail(&console, 60)
    );
    let enrolled = console
        .find("guest-init: enroll: enrolled ")
        .unwrap_or_else(|| panic!("no enrollment line in boot 2:\n{console}"));
    let ready_at = console.find(qemu_harness::vm::READY_MARK).unwrap();
    assert!(
        enrolled < ready_at,
        "the app started before enrollment:\n{console}"
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
        sha(csr1)
    );
    assert!(reqs[1].code.is_none(), "boot 2 was refused: {:?}", reqs[1]);
    assert_eq!(reqs[1].vm_uid, VM_UID);
    assert!(
        reqs[1].cert.as_deref() == Some(committed),
        "boot 2 was answered with another certificate than the one committed in boot 1"
    );
    vm
}

/// After a power cut while the service stalled after committing `token`'s CSR: lets the
/// stalled request complete (into the dead connection), checks it was the only one, from
/// [`VM_UID`], answered with the committed certificate, and returns that certificate and
/// the CSR.
pub(crate) fn release_the_committed_request(
    svc: &EnrollService,
    token: &str,
) -> (Vec<u8>, Vec<u8>) {
    let committed = svc
        .committed_cert(token)
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
    (committed, csr1)
}
