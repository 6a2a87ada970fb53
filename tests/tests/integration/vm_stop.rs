//! Every way a VMM stops a VM, in a real micro-VM, and no data lost on any of them.
//!
//! Each test boots real QEMU with the Debian guest kernel, vhost-device-vsock and
//! guest-init as PID 1, switched into an ext4 root disk on virtio-blk. The app is
//! `guest-probe write-and-wait`: it writes a 1 MiB file of a known pattern to the disk
//! **without `fsync`** and keeps running. Then the test stops the VM one way and checks,
//! for that way:
//!
//! - the console's own reason (`guest-init: shutdown: <reason>`);
//! - that the app got SIGTERM (or, when it ignores it, SIGKILL after the grace period);
//! - the end: `powering off` (the kernel's `reboot: Power down`), or `rebooting` (the
//!   kernel's `reboot: Restarting system`), which QEMU's `-no-reboot` turns into its exit;
//! - QEMU's exit status 0, by itself, within the stop timeout (never killed);
//! - the disk afterwards, read from the host with e2fsprogs and no mount: the file is
//!   there, whole and byte for byte, and the file system needs no journal recovery (the
//!   read-only remount happened; `dumpe2fs -h`). Without guest-init's `sync` and
//!   remount the unsynced bytes would still be in the guest's page cache at power-off.
//!
//! The ways (`docs/VMMS.md` maps them to each VMM):
//!
//! 1. QMP `system_powerdown`: the ACPI power button (QEMU, libvirt, KubeVirt, Cloud
//!    Hypervisor); guest-init reads `KEY_POWER` from the `button` driver's input device.
//! 2. QMP `send-key ctrl-alt-delete` through the i8042: the kernel sends PID 1 SIGINT.
//! 3. The same Ctrl-Alt-Del with `shutdown.action: "reboot"`: Firecracker's
//!    `SendCtrlAltDel` on a guest that can only end by rebooting; `-no-reboot` makes the
//!    reboot end QEMU as it ends a Firecracker VM.
//! 4. guest-init's control port `stop`.
//! 5. An app that ignores SIGTERM, stopped through the control port: SIGKILL after the
//!    grace period, and the file is still there.
//!
//! VMs run one at a time (a process-wide lock; two cores, TCG). Missing tools fail under
//! `REQUIRE_ALL=1` and skip otherwise (`e2e::util::require`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use e2e::util::{cache_dir, e2fs_tool, musl_bin, require, require_vm_host};
use qemu_harness::{Image, StopReport, Vm, VmSpec};
use serde_json::json;
use vm_image::initramfs::InitramfsSpec;
use vm_image::rootdisk::RootDiskSpec;

const PROBE: &str = "/bin/guest-probe";
const DATA_FILE: &str = "/data/unsynced.bin";
const DATA_SIZE: usize = 1 << 20;
const CONTROL_PORT: u32 = 1024;
const APP_UID: u32 = 20001;
/// How long an orderly stop may take under TCG before QEMU is killed (and the test fails).
const STOP_TIMEOUT: Duration = Duration::from_secs(90);
const GUEST_ACTION_TIMEOUT: Duration = Duration::from_secs(300);

/// How the test stops the VM.
#[derive(Clone, Copy, Debug)]
enum Way {
    PowerButton,
    CtrlAltDel,
    ControlPort,
}

/// One case: the way, the app's behaviour, guest-init's shutdown settings, what to expect.
struct Case {
    name: &'static str,
    way: Way,
    ignore_term: bool,
    action: &'static str,
    grace_ms: u64,
    /// guest-init's console line with the reason.
    reason: &'static str,
    /// guest-init's and the kernel's last lines.
    end: [&'static str; 2],
}

/// The tools, or `None` after `require` skipped (it fails under `REQUIRE_ALL=1`).
fn tools() -> Option<(PathBuf, PathBuf)> {
    let cache = cache_dir();
    let debugfs = e2fs_tool("debugfs");
    let dumpe2fs = e2fs_tool("dumpe2fs");
    let ok = require_vm_host()
        && require(
            cache.join("kernel/current/vmlinuz").is_file(),
            "the guest kernel (.cache/kernel/current/vmlinuz)",
        )
        && require(
            e2fs_tool("mke2fs").is_some() && debugfs.is_some() && dumpe2fs.is_some(),
            "e2fsprogs: mke2fs, debugfs, dumpe2fs (apt-get install e2fsprogs)",
        );
    ok.then(|| (debugfs.unwrap_or_default(), dumpe2fs.unwrap_or_default()))
}

/// What `guest-probe write-and-wait` writes (its `pattern`): byte `i` is `i*31+7 mod 251`.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + 7) % 251) as u8).collect()
}

/// The root disk: the app, an empty world-writable `/data`, the mount points.
fn root_disk(work: &Path) -> PathBuf {
    let tree = work.join("root");
    for (dir, mode) in [
        ("bin", 0o755),
        ("data", 0o1777),
        ("dev", 0o755),
        ("proc", 0o555),
        ("sys", 0o555),
        ("run", 0o755),
        ("tmp", 0o1777),
    ] {
        let p = tree.join(dir);
        std::fs::create_dir_all(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let app = tree.join(&PROBE[1..]);
    std::fs::copy(musl_bin("guest-probe"), &app).unwrap();
    std::fs::set_permissions(&app, std::fs::Permissions::from_mode(0o755)).unwrap();
    let disk = work.join("root.ext4");
    vm_image::rootdisk::build(
        &RootDiskSpec {
            source: tree,
            size_mib: 32,
            label: "vm-stop".into(),
            normalize_times: false,
        },
        &disk,
    )
    .unwrap_or_else(|e| panic!("root disk: {e}"));
    disk
}

fn vm_spec(case: &Case, disk: &Path) -> VmSpec {
    let mut modules: Vec<&str> = vm_image::VSOCK_MODULES.to_vec();
    modules.extend(["virtio_blk", "ext4"]);
    let size = DATA_SIZE.to_string();
    let mut command = vec![PROBE, "write-and-wait", DATA_FILE, &size];
    if case.ignore_term {
        command.push("--ignore-term");
    }
    let config = json!({
        "version": 1,
        "hostname": "vm-stop",
        "modules": modules,
        "root": { "device": "/dev/vda", "fstype": "ext4", "wait_ms": 20000 },
        "app": { "command": command, "user": APP_UID, "group": APP_UID, "workdir": "/tmp" },
        "control": { "listen": { "vsock": { "cid": u32::MAX, "port": CONTROL_PORT } } },
        "shutdown": { "grace_period_ms": case.grace_ms, "action": case.action }
    });
    let spec = InitramfsSpec::new(musl_bin("guest-init"), config);
    let mut vm = VmSpec::new(case.name, Image::Initramfs(Box::new(spec)));
    vm.disks = vec![(disk.to_path_buf(), false)];
    vm.stop_timeout = STOP_TIMEOUT;
    vm
}

fn run(tool: &Path, args: &[&str], disk: &Path) -> Vec<u8> {
    let out = Command::new(tool)
        .args(args)
        .arg(disk)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", tool.display()));
    assert!(out.status.success(), "{} {args:?}: {out:?}", tool.display());
    out.stdout
}

/// The disk after the VM ended: cleanly unmounted (no journal to replay) and holding the
/// app's file whole.
fn assert_disk_holds_the_file(debugfs: &Path, dumpe2fs: &Path, disk: &Path) {
    let header = String::from_utf8_lossy(&run(dumpe2fs, &["-h"], disk)).into_owned();
    let line = |key: &str| {
        header
            .lines()
            .find(|l| l.starts_with(key))
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        !line("Filesystem features:").contains("needs_recovery"),
        "the root file system was not remounted read-only before the end:\n{header}"
    );
    assert!(
        line("Filesystem state:").ends_with(" clean"),
        "the root file system is not clean:\n{header}"
    );
    let got = run(debugfs, &["-R", &format!("cat {DATA_FILE}")], disk);
    assert_eq!(
        got.len(),
        DATA_SIZE,
        "{DATA_FILE} on the disk has {} bytes, the app wrote {DATA_SIZE}",
        got.len()
    );
    let want = pattern(DATA_SIZE);
    if let Some(at) = got.iter().zip(&want).position(|(a, b)| a != b) {
        panic!("{DATA_FILE} on the disk differs from what the app wrote at byte {at}");
    }
}

fn stop_case(case: Case) {
    let _l = crate::support::heavy_lock();
    let Some((debugfs, dumpe2fs)) = tools() else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let disk = root_disk(work.path());
    let mut vm = Vm::start(vm_spec(&case, &disk)).expect("boot to ready");
    vm.wait_for_console("write-and-wait wrote", GUEST_ACTION_TIMEOUT)
        .expect("the app wrote its file");
    if matches!(case.way, Way::PowerButton) {
        let console = vm.console();
        assert!(
            console.contains("guest-init: power button: watching /dev/input/event"),
            "guest-init watches no power button:\n{console}"
        );
        for l in console
            .lines()
            .filter(|l| l.contains("power button: watching"))
        {
            eprintln!("[vm_stop] {l}");
        }
    }
    let report: StopReport = match case.way {
        Way::PowerButton => vm.power_button(),
        Way::CtrlAltDel => vm.ctrl_alt_del(),
        Way::ControlPort => vm.stop(),
    }
    .expect("the stop request");
    eprintln!(
        "[vm_stop] {}: {:?} took {:.2} s to QEMU's exit",
        case.name,
        case.way,
        report.elapsed.as_secs_f64()
    );
    let console = vm.console();
    assert!(
        report.clean(),
        "QEMU did not exit 0 by itself within {STOP_TIMEOUT:?}: {report:?}\n{console}"
    );
    assert!(
        console.contains(case.reason),
        "no {:?} on the console:\n{console}",
        case.reason
    );
    let app_end = if case.ignore_term {
        [
            "guest-probe: write-and-wait got SIGTERM; ignoring it",
            "sending SIGKILL to the remaining processes",
            "guest-init: app killed signal=SIGKILL",
        ]
    } else {
        [
            "guest-probe: write-and-wait got SIGTERM",
            "guest-init: app exited status=0",
            "guest-init: app exited status=0",
        ]
    };
    for want in app_end.iter().chain(&case.end) {
        assert!(
            console.contains(want),
            "no {want:?} on the console:\n{console}"
        );
    }
    for bad in ["Kernel panic", "Attempted to kill init"] {
        assert!(!console.contains(bad), "console shows {bad:?}:\n{console}");
    }
    drop(vm);
    assert_disk_holds_the_file(&debugfs, &dumpe2fs, &disk);
}

const POWER_OFF: [&str; 2] = ["guest-init: powering off", "reboot: Power down"];

// 1. The ACPI power button: QEMU's system_powerdown, libvirt, KubeVirt, Cloud Hypervisor.
#[test]
fn vm_stop_power_button() {
    stop_case(Case {
        name: "stop-power-button",
        way: Way::PowerButton,
        ignore_term: false,
        action: "poweroff",
        grace_ms: 10_000,
        reason: "guest-init: shutdown: power button",
        end: POWER_OFF,
    });
}

// 2. Ctrl-Alt-Del through the i8042 keyboard: SIGINT to PID 1.
#[test]
fn vm_stop_ctrl_alt_del() {
    stop_case(Case {
        name: "stop-ctrl-alt-del",
        way: Way::CtrlAltDel,
        ignore_term: false,
        action: "poweroff",
        grace_ms: 10_000,
        reason: "guest-init: shutdown: signal SIGINT",
        end: POWER_OFF,
    });
}

// 3. Firecracker: Ctrl-Alt-Del, and the VM ends by rebooting (`-no-reboot` ends QEMU).
#[test]
fn vm_stop_reboot_action_ends_like_firecracker() {
    stop_case(Case {
        name: "stop-reboot",
        way: Way::CtrlAltDel,
        ignore_term: false,
        action: "reboot",
        grace_ms: 10_000,
        reason: "guest-init: shutdown: signal SIGINT",
        end: ["guest-init: rebooting", "reboot: Restarting system"],
    });
}

// 4. guest-init's own control port.
#[test]
fn vm_stop_control_port() {
    stop_case(Case {
        name: "stop-control-port",
        way: Way::ControlPort,
        ignore_term: false,
        action: "poweroff",
        grace_ms: 10_000,
        reason: "guest-init: shutdown: host request",
        end: POWER_OFF,
    });
}

// 5. An app that ignores SIGTERM: SIGKILL after the grace period, the file still whole.
#[test]
fn vm_stop_sigterm_ignoring_app_is_killed_after_grace() {
    stop_case(Case {
        name: "stop-sigkill",
        way: Way::ControlPort,
        ignore_term: true,
        action: "poweroff",
        grace_ms: 2_000,
        reason: "guest-init: shutdown: host request",
        end: POWER_OFF,
    });
}
