//! The QEMU command line, and choosing between KVM and TCG.
//!
//! # Design
//!
//! One machine shape, the one measured to work with vhost-device-vsock (see
//! `docs/HARNESS.md`): `q35`, guest RAM from a **shared memfd** memory backend (mandatory:
//! vhost-user needs the backend to map guest memory; without `share=on` the guest's connects
//! silently time out), `vhost-user-vsock-pci` on the backend's socket, no default devices,
//! the serial console into a file, `-no-reboot` so a guest reboot or panic ends QEMU, and a
//! QMP socket through which the harness presses the power button or Ctrl-Alt-Del.
//!
//! **KVM or TCG, detected by trying.** `/dev/kvm` existing proves little: on a host that is
//! itself a VM with restricted KVM, guests hang or abort. So [`Accel::Auto`] boots the real
//! guest kernel once under KVM with no initramfs and `panic=-1`: a working KVM runs it to
//! its "VFS: Unable to mount root fs" panic and QEMU exits within seconds; a broken one
//! hangs, errors or dies. The answer is cached per kernel and QEMU in the cache directory
//! (delete `<cache>/accel-*` to probe again). `QEMU_ACCEL=kvm|tcg` overrides.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::process::Child;

/// The accelerator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation.
    Kvm,
    /// QEMU's software emulation.
    Tcg,
    /// KVM if it demonstrably boots the kernel here, else TCG.
    Auto,
}

impl Accel {
    /// The name QEMU's `-accel` takes.
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg | Accel::Auto => "tcg",
        }
    }
}

/// A user-mode network with host port forwards (the guest sees the host as 10.0.2.2).
#[derive(Clone, Debug)]
pub struct UserNet {
    /// `(host address:port, guest port)` TCP forwards, e.g. `("127.0.0.1:18080", 5232)`.
    pub forwards: Vec<(String, u16)>,
}

/// Everything the command line is made from.
#[derive(Clone, Debug)]
pub struct QemuArgs {
    /// `qemu-system-x86_64` or a path.
    pub binary: PathBuf,
    /// The resolved accelerator (not `Auto`).
    pub accel: Accel,
    /// Guest RAM in MiB.
    pub memory_mib: u32,
    /// vCPUs.
    pub cpus: u32,
    /// The kernel image.
    pub kernel: PathBuf,
    /// The initramfs.
    pub initrd: PathBuf,
    /// The kernel command line.
    pub cmdline: String,
    /// vhost-device-vsock's vhost-user socket.
    pub vhost_socket: PathBuf,
    /// Serial console file.
    pub console: PathBuf,
    /// Raw disk images, as virtio-blk (`/dev/vda`, `/dev/vdb`...), with read-only flags.
    pub disks: Vec<(PathBuf, bool)>,
    /// User networking.
    pub net: Option<UserNet>,
    /// A QMP server socket (`-qmp unix:PATH,server=on,wait=off`) for the harness's buttons.
    pub qmp: Option<PathBuf>,
    /// swtpm's control socket: a TPM 2.0 on `tpm-crb` (`-tpmdev emulator`).
    pub tpm: Option<PathBuf>,
}

impl QemuArgs {
    /// The command.
    pub fn command(&self) -> Command {
        let mut c = Command::new(&self.binary);
        c.args(["-accel", self.accel.name()]);
        if self.accel == Accel::Kvm {
            c.args(["-cpu", "host"]);
        }
        c.args(["-machine", "q35,memory-backend=mem"])
            .arg("-object")
            .arg(format!(
                "memory-backend-memfd,id=mem,size={}M,share=on",
                self.memory_mib
            ))
            .args(["-m", &format!("{}M", self.memory_mib)])
            .args(["-smp", &self.cpus.to_string()])
            .args(["-nodefaults", "-no-user-config", "-display", "none"])
            .args(["-no-reboot"])
            .arg("-chardev")
            .arg(format!("socket,id=vu,path={}", self.vhost_socket.display()))
            .args(["-device", "vhost-user-vsock-pci,chardev=vu"])
            .arg("-serial")
            .arg(format!("file:{}", self.console.display()))
            .arg("-kernel")
            .arg(&self.kernel)
            .arg("-initrd")
            .arg(&self.initrd)
            .arg("-append")
            .arg(&self.cmdline);
        if let Some(qmp) = &self.qmp {
            c.arg("-qmp")
                .arg(format!("unix:{},server=on,wait=off", qmp.display()));
        }
        if let Some(tpm) = &self.tpm {
            c.arg("-chardev")
                .arg(format!("socket,id=chrtpm,path={}", tpm.display()))
                .args(["-tpmdev", "emulator,id=tpm0,chardev=chrtpm"])
                .args(["-device", "tpm-crb,tpmdev=tpm0"]);
        }
        for (i, (path, ro)) in self.disks.iter().enumerate() {
            c.arg("-drive").arg(format!(
                "file={},if=none,id=disk{i},format=raw,cache=unsafe{}",
                path.display(),
                if *ro { ",readonly=on" } else { "" }
            ));
            c.args(["-device", &format!("virtio-blk-pci,drive=disk{i}")]);
        }
        match &self.net {
            Some(net) => {
                let mut nic = String::from("user,model=virtio-net-pci");
                for (host, guest) in &net.forwards {
                    let (addr, port) = host.rsplit_once(':').unwrap_or(("127.0.0.1", host));
                    nic.push_str(&format!(",hostfwd=tcp:{addr}:{port}-:{guest}"));
                }
                c.args(["-nic", &nic]);
            }
            None => {
                c.args(["-nic", "none"]);
            }
        }
        c
    }
}

/// Resolves `Auto` (and `QEMU_ACCEL`) to KVM or TCG. See the module documentation.
pub fn resolve_accel(
    requested: Accel,
    qemu: &Path,
    kernel: &Path,
    cache: &Path,
    run_dir: &Path,
) -> Accel {
    let env = std::env::var("QEMU_ACCEL").ok();
    resolve_accel_with(env.as_deref(), requested, qemu, kernel, cache, run_dir)
}

/// What `QEMU_ACCEL` asks for: `Ok(None)` when unset or empty, an error naming the
/// accepted values otherwise.
pub fn accel_override(value: Option<&str>) -> Result<Option<Accel>, String> {
    match value {
        None | Some("") => Ok(None),
        Some("kvm") => Ok(Some(Accel::Kvm)),
        Some("tcg") => Ok(Some(Accel::Tcg)),
        Some(other) => Err(format!(
            "QEMU_ACCEL={other:?} is not an accelerator; use kvm or tcg, or unset it to detect"
        )),
    }
}

/// [`resolve_accel`] with the environment variable's value passed in.
pub fn resolve_accel_with(
    env: Option<&str>,
    requested: Accel,
    qemu: &Path,
    kernel: &Path,
    cache: &Path,
    run_dir: &Path,
) -> Accel {
    match accel_override(env) {
        Ok(Some(a)) => return a,
        Ok(None) => {}
        // The harness has no error path here; say so loudly and detect instead.
        Err(e) => eprintln!("qemu-harness: {e}; ignoring it"),
    }
    if requested != Accel::Auto {
        return requested;
    }
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return Accel::Tcg;
    }
    let key = format!(
        "accel-{}",
        kernel
            .parent()
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .unwrap_or("kernel")
    );
    let cached = cache.join(key);
    match std::fs::read_to_string(&cached).as_deref().map(str::trim) {
        Ok("kvm") => return Accel::Kvm,
        Ok("tcg") => return Accel::Tcg,
        _ => {}
    }
    let works = probe_kvm(qemu, kernel, run_dir);
    let answer = if works { Accel::Kvm } else { Accel::Tcg };
    let _ = std::fs::write(&cached, answer.name());
    answer
}

/// Boots `kernel` under KVM without an initramfs: true when it runs to its root-mount panic.
fn probe_kvm(qemu: &Path, kernel: &Path, run_dir: &Path) -> bool {
    let console = run_dir.join("kvm-probe.console");
    let mut c = Command::new(qemu);
    c.args([
        "-accel", "kvm", "-cpu", "host", "-machine", "q35", "-m", "256M",
    ])
    .args([
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
    ])
    .arg("-serial")
    .arg(format!("file:{}", console.display()))
    .arg("-kernel")
    .arg(kernel)
    .args(["-append", "console=ttyS0 panic=-1"]);
    let Ok(mut child) = Child::spawn("kvm-probe", c, &run_dir.join("kvm-probe.log")) else {
        return false;
    };
    let status = child.wait_timeout(Duration::from_secs(30));
    child.kill();
    let text = std::fs::read_to_string(&console).unwrap_or_default();
    status.is_some_and(|s| s.success()) && text.contains("Kernel panic")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> QemuArgs {
        QemuArgs {
            binary: "qemu-system-x86_64".into(),
            accel: Accel::Tcg,
            memory_mib: 256,
            cpus: 1,
            kernel: "/k/vmlinuz".into(),
            initrd: "/r/initrd".into(),
            cmdline: "console=ttyS0".into(),
            vhost_socket: "/r/vhost.sock".into(),
            console: "/r/console.log".into(),
            disks: vec![("/r/root.ext4".into(), true)],
            net: Some(UserNet {
                forwards: vec![("127.0.0.1:18080".into(), 5232)],
            }),
            qmp: Some("/r/qmp.sock".into()),
            tpm: None,
        }
    }

    fn argv(a: &QemuArgs) -> Vec<String> {
        a.command()
            .get_args()
            .map(|s| s.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn guest_memory_is_a_shared_memfd_the_size_of_ram() {
        // vhost-user cannot reach guest memory otherwise: the guest's connects time out.
        let v = argv(&args());
        assert!(
            v.contains(&"memory-backend-memfd,id=mem,size=256M,share=on".to_string()),
            "{v:?}"
        );
        assert!(v.contains(&"q35,memory-backend=mem".to_string()), "{v:?}");
        assert!(v.contains(&"256M".to_string()), "{v:?}");
    }

    #[test]
    fn vsock_console_disks_and_network_are_wired() {
        let v = argv(&args()).join(" ");
        for want in [
            "-chardev socket,id=vu,path=/r/vhost.sock",
            "-device vhost-user-vsock-pci,chardev=vu",
            "-serial file:/r/console.log",
            "-no-reboot",
            "-accel tcg",
            "file=/r/root.ext4,if=none,id=disk0,format=raw,cache=unsafe,readonly=on",
            "virtio-blk-pci,drive=disk0",
            "user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:18080-:5232",
            "-qmp unix:/r/qmp.sock,server=on,wait=off",
        ] {
            assert!(v.contains(want), "missing {want:?} in {v}");
        }
        let mut a = args();
        a.net = None;
        a.accel = Accel::Kvm;
        let v = argv(&a).join(" ");
        assert!(
            v.contains("-nic none") && v.contains("-accel kvm -cpu host"),
            "{v}"
        );
        assert!(!v.contains("-tpmdev"), "no TPM unless asked: {v}");
    }

    #[test]
    fn a_vtpm_is_swtpm_on_tpm_crb() {
        let mut a = args();
        a.tpm = Some("/r/swtpm.sock".into());
        let v = argv(&a).join(" ");
        assert!(
            v.contains(
                "-chardev socket,id=chrtpm,path=/r/swtpm.sock -tpmdev emulator,id=tpm0,chardev=chrtpm -device tpm-crb,tpmdev=tpm0"
            ),
            "{v}"
        );
    }

    #[test]
    fn qemu_accel_env_overrides_detection() {
        assert_eq!(accel_override(None), Ok(None));
        assert_eq!(accel_override(Some("")), Ok(None));
        assert_eq!(accel_override(Some("kvm")), Ok(Some(Accel::Kvm)));
        assert_eq!(accel_override(Some("tcg")), Ok(Some(Accel::Tcg)));
        let e = accel_override(Some("KVM")).unwrap_err();
        assert!(e.contains("QEMU_ACCEL") && e.contains("kvm or tcg"), "{e}");
        // The variable wins over what the caller asked for, and over detection: with it
        // set, nothing is probed (the QEMU and kernel paths do not even exist).
        let dir = tempfile::tempdir().unwrap();
        let none = dir.path().join("missing");
        for (env, requested, want) in [
            ("kvm", Accel::Tcg, Accel::Kvm),
            ("tcg", Accel::Kvm, Accel::Tcg),
            ("kvm", Accel::Auto, Accel::Kvm),
        ] {
            let got =
                resolve_accel_with(Some(env), requested, &none, &none, dir.path(), dir.path());
            assert_eq!(got, want, "QEMU_ACCEL={env} with {requested:?}");
        }
        // Unset: an explicit request is kept as it is.
        let got = resolve_accel_with(None, Accel::Kvm, &none, &none, dir.path(), dir.path());
        assert_eq!(got, Accel::Kvm);
        assert!(
            std::fs::read_dir(dir.path()).unwrap().next().is_none(),
            "nothing probed or cached"
        );
    }
}
