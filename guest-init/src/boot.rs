//! Early boot: the steps a VM's PID 1 owes the system before the app can run.
//!
//! The kernel hands PID 1 an initramfs and nothing else: no `/proc`, no `/dev` nodes beyond
//! what `CONFIG_DEVTMPFS_MOUNT` provides, a loopback interface that is down, and drivers
//! that are modules (virtio and vsock are modules in Debian's kernels; see
//! `shared/notes/vm-and-vsock.md`). This module does, in order:
//!
//! 1. [`mount_basics`]: `/proc`, `/sys`, `/dev` (devtmpfs), `/dev/pts`, `/dev/shm`, `/run`,
//!    `/tmp` and cgroup2 at `/sys/fs/cgroup`, each **only if nothing is mounted there yet**
//!    (`/proc/self/mountinfo` says). The kernel or a previous root may have mounted some,
//!    and the same code runs again after a switch-root. A failure is a warning: an app may
//!    not need `/dev/shm`, and a missing `/proc` shows up clearly later.
//! 2. [`set_hostname`] and [`loopback_up`]: `lo` comes up with `SIOCSIFFLAGS` on an
//!    `AF_INET` socket, so no `ip` binary has to be in the image.
//! 3. [`load_modules`]: `finit_module(2)` on `modules_dir/<name>.ko`, in the configured
//!    order (the image builder resolves dependencies). `EEXIST` means already loaded; a
//!    missing file for a module that `/sys/module/<name>` shows as built in is fine too.
//! 4. [`configure_network`]: optional static IPv4 on one interface with `SIOCSIFADDR`,
//!    `SIOCSIFNETMASK`, `SIOCSIFFLAGS` and a default route with `SIOCADDRT`.
//! 5. [`switch_root`]: optional. The root device (a virtio-blk ext4 disk) is mounted at
//!    `/newroot`; `/dev`, `/proc`, `/sys` and `/run` are moved into it with `MS_MOVE`
//!    (their sub-mounts go along); then `chdir("/newroot")`, `mount(".", "/", MS_MOVE)`,
//!    `chroot(".")`, `chdir("/")`: the classic `switch_root` sequence. Unlike
//!    util-linux's `switch_root`, PID 1 does **not** exec a new init: it continues as the
//!    same process with the configuration already loaded, so the disk needs no copy of
//!    guest-init. The initramfs's files are not deleted (they are a few megabytes at most,
//!    guest-init and its modules); `/tmp` is mounted afresh on the new root by calling
//!    [`mount_basics`] again.
//!
//! Every step is skipped when guest-init is not PID 1: an ordinary process must never
//! remount, rename or reconfigure the host it runs on. The mounts this module made are
//! remembered so the shutdown unmounts exactly those (and never, say, the host's `/tmp` in
//! a test namespace).

use std::ffi::CString;
use std::fs;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};

use crate::config::{NetworkConfig, RootConfig};
use crate::{debug, info, warn};

/// A boot step that failed.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// A kernel module could not be loaded.
    #[error("module {name}: cannot load {path}: {source}")]
    Module {
        /// The module name.
        name: String,
        /// The file tried.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Network configuration failed.
    #[error("network.{field}: {what}: {source}")]
    Network {
        /// The configuration field concerned.
        field: &'static str,
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The switch to the root device failed.
    #[error("root: {what}: {source}")]
    Root {
        /// The step that failed.
        what: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Another system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// The mounts this process made, innermost last; the shutdown unmounts them in reverse.
static OURS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Whether the root filesystem is one this process mounted (a switch-root happened).
static SWITCHED_ROOT: Mutex<bool> = Mutex::new(false);

struct Basic {
    target: &'static str,
    fstype: &'static str,
    flags: MsFlags,
    data: &'static str,
}

const NOSUID_NODEV_NOEXEC: MsFlags = MsFlags::MS_NOSUID
    .union(MsFlags::MS_NODEV)
    .union(MsFlags::MS_NOEXEC);

const BASICS: &[Basic] = &[
    Basic {
        target: "/proc",
        fstype: "proc",
        flags: NOSUID_NODEV_NOEXEC,
        data: "",
    },
    Basic {
        target: "/sys",
        fstype: "sysfs",
        flags: NOSUID_NODEV_NOEXEC,
        data: "",
    },
    Basic {
        target: "/dev",
        fstype: "devtmpfs",
        flags: MsFlags::MS_NOSUID,
        data: "mode=0755",
    },
    Basic {
        target: "/dev/pts",
        fstype: "devpts",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NOEXEC),
        data: "mode=0620,ptmxmode=0666",
    },
    Basic {
        target: "/dev/shm",
        fstype: "tmpfs",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV),
        data: "mode=1777",
    },
    Basic {
        target: "/run",
        fstype: "tmpfs",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV),
        data: "mode=0755",
    },
    Basic {
        target: "/tmp",
        fstype: "tmpfs",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV),
        data: "mode=1777",
    },
    Basic {
        target: "/sys/fs/cgroup",
        fstype: "cgroup2",
        flags: NOSUID_NODEV_NOEXEC,
        data: "",
    },
];

/// The mount points in a `/proc/self/mountinfo` text (field 5, octal escapes decoded).
pub fn mount_points(mountinfo: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_octal(p)))
        .collect()
}

fn unescape_octal(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn mounted_now() -> Vec<PathBuf> {
    fs::read_to_string("/proc/self/mountinfo")
        .map(|s| mount_points(&s))
        .unwrap_or_default()
}

/// Mounts each basic filesystem that is not mounted yet. Returns the mount points it
/// mounted. Failures are logged as warnings.
pub fn mount_basics() -> Vec<PathBuf> {
    let mut done = Vec::new();
    for b in BASICS {
        // Re-read each time: mounting /proc makes mountinfo readable for the rest.
        let present = mounted_now();
        let target = Path::new(b.target);
        if present.iter().any(|p| p == target) {
            continue;
        }
        if let Err(e) = fs::create_dir_all(target) {
            warn!("mount {}: cannot create the directory: {e}", b.target);
            continue;
        }
        let data = (!b.data.is_empty()).then_some(b.data);
        match mount(Some(b.fstype), target, Some(b.fstype), b.flags, data) {
            Ok(()) => {
                debug!("mounted {} on {}", b.fstype, b.target);
                done.push(target.to_owned());
            }
            // EBUSY: mounted after all (mountinfo was unreadable before /proc existed).
            Err(nix::errno::Errno::EBUSY) => {}
            Err(e) => warn!("mount {} on {}: {e}", b.fstype, b.target),
        }
    }
    if let Ok(mut ours) = OURS.lock() {
        ours.extend(done.iter().cloned());
    }
    done
}

/// Sets the hostname.
pub fn set_hostname(name: &str) -> Result<(), BootError> {
    nix::unistd::sethostname(name).map_err(|e| BootError::Sys {
        what: format!("hostname: cannot set {name:?}"),
        source: e.into(),
    })
}

fn inet_socket() -> io::Result<std::os::fd::OwnedFd> {
    Ok(nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

fn ifreq_for(name: &str) -> io::Result<libc::ifreq> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "interface name must be 1 to 15 bytes",
        ));
    }
    // SAFETY: `ifreq` is a plain C struct (a name array and a union of plain data); all
    // zero bytes is a valid value for every member.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Ok(req)
}

fn ioctl_ifreq(
    sock: &impl AsRawFd,
    request: libc::c_ulong,
    req: &mut libc::ifreq,
) -> io::Result<()> {
    // SAFETY: every request passed here (SIOC[GS]IFFLAGS, SIOCSIFADDR, SIOCSIFNETMASK) reads
    // and writes at most one `struct ifreq`, and `req` points to a valid, exclusively
    // borrowed one for the duration of the call.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), request as _, req as *mut libc::ifreq) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Sets `IFF_UP` (and `IFF_RUNNING`) on an interface.
pub fn interface_up(name: &str) -> io::Result<()> {
    let sock = inet_socket()?;
    let mut req = ifreq_for(name)?;
    ioctl_ifreq(&sock, libc::SIOCGIFFLAGS as _, &mut req)?;
    // SAFETY: SIOCGIFFLAGS just filled `ifru_flags`, the member read here.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    ioctl_ifreq(&sock, libc::SIOCSIFFLAGS as _, &mut req)
}

/// Brings up the loopback interface.
pub fn loopback_up() -> Result<(), BootError> {
    interface_up("lo").map_err(|source| BootError::Sys {
        what: "cannot bring up lo".into(),
        source,
    })
}

fn sockaddr_in(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `sockaddr_in` and `sockaddr` are both 16-byte plain C structs; the kernel
    // reads a `sockaddr` that holds a `sockaddr_in` exactly this way.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// The IPv4 netmask of a prefix length.
pub fn netmask(prefix: u8) -> Ipv4Addr {
    let bits = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix.min(32)))
    };
    Ipv4Addr::from(bits)
}

/// Configures one interface with a static IPv4 address and an optional default route.
/// Waits up to `wait_ms` for the interface to appear (its driver may have just loaded).
pub fn configure_network(net: &NetworkConfig) -> Result<(), BootError> {
    let (addr, prefix) = net.parsed_address().map_err(|r| BootError::Network {
        field: "address",
        what: r,
        source: io::ErrorKind::InvalidInput.into(),
    })?;
    let name = net.interface.as_str();
    let deadline = Instant::now() + Duration::from_millis(net.wait_ms);
    while nix::net::if_::if_nametoindex(name).is_err() {
        if Instant::now() >= deadline {
            return Err(BootError::Network {
                field: "interface",
                what: format!(
                    "interface {name} did not appear within {} ms; check its driver module is in `modules`",
                    net.wait_ms
                ),
                source: io::ErrorKind::NotFound.into(),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let err = |field: &'static str, what: String| {
        move |source: io::Error| BootError::Network {
            field,
            what,
            source,
        }
    };
    let sock = inet_socket().map_err(err("interface", "socket".into()))?;
    let mut req = ifreq_for(name).map_err(err("interface", name.into()))?;
    req.ifr_ifru.ifru_addr = sockaddr_in(addr);
    ioctl_ifreq(&sock, libc::SIOCSIFADDR as _, &mut req)
        .map_err(err("address", format!("SIOCSIFADDR {addr} on {name}")))?;
    let mut req = ifreq_for(name).map_err(err("interface", name.into()))?;
    req.ifr_ifru.ifru_netmask = sockaddr_in(netmask(prefix));
    ioctl_ifreq(&sock, libc::SIOCSIFNETMASK as _, &mut req).map_err(err(
        "address",
        format!("SIOCSIFNETMASK /{prefix} on {name}"),
    ))?;
    interface_up(name).map_err(err("interface", format!("bringing {name} up")))?;
    if let Some(gw) = net.gateway {
        // SAFETY: `rtentry` is a plain C struct; all zero bytes (null `rt_dev`, zero
        // addresses) is a valid value.
        let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
        rt.rt_dst = sockaddr_in(Ipv4Addr::UNSPECIFIED);
        rt.rt_genmask = sockaddr_in(Ipv4Addr::UNSPECIFIED);
        rt.rt_gateway = sockaddr_in(gw);
        rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
        // SAFETY: SIOCADDRT reads one `struct rtentry`; `rt` is valid for the call and its
        // `rt_dev` is null (the kernel picks the interface from the gateway's subnet).
        let r = unsafe {
            libc::ioctl(
                sock.as_raw_fd(),
                libc::SIOCADDRT as _,
                &mut rt as *mut libc::rtentry,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            // A default route that already exists (a second boot step) is fine.
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(BootError::Network {
                    field: "gateway",
                    what: format!("SIOCADDRT default via {gw}"),
                    source: e,
                });
            }
        }
    }
    info!(
        "network: {name} {addr}/{prefix}{}",
        net.gateway.map(|g| format!(" via {g}")).unwrap_or_default()
    );
    Ok(())
}

/// How one module load ended.
#[derive(Debug, PartialEq, Eq)]
pub enum ModuleOutcome {
    /// `finit_module` loaded it.
    Loaded,
    /// It was loaded already (`EEXIST`).
    AlreadyLoaded,
    /// No file, but the kernel has it built in.
    BuiltIn,
}

/// Loads one module from `dir/<name>.ko`; `sys_module` is normally `/sys/module`.
pub fn load_module(name: &str, dir: &Path, sys_module: &Path) -> Result<ModuleOutcome, BootError> {
    let path = dir.join(format!("{name}.ko"));
    let file = match fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // Built-in modules appear in /sys/module (with dashes or underscores).
            let alt = name.replace('-', "_");
            if sys_module.join(name).exists() || sys_module.join(&alt).exists() {
                return Ok(ModuleOutcome::BuiltIn);
            }
            return Err(BootError::Module {
                name: name.into(),
                path,
                source: e,
            });
        }
        Err(e) => {
            return Err(BootError::Module {
                name: name.into(),
                path,
                source: e,
            })
        }
    };
    let params = CString::default();
    match nix::kmod::finit_module(&file, &params, nix::kmod::ModuleInitFlags::empty()) {
        Ok(()) => Ok(ModuleOutcome::Loaded),
        Err(nix::errno::Errno::EEXIST) => Ok(ModuleOutcome::AlreadyLoaded),
        Err(e) => Err(BootError::Module {
            name: name.into(),
            path,
            source: e.into(),
        }),
    }
}

/// Loads the modules in order. Each failure is logged; the first is returned after all
/// were tried (a later module may still load, and the app may not need the failed one).
pub fn load_modules(names: &[String], dir: &Path) -> Result<(), BootError> {
    let start = Instant::now();
    let mut first_err = None;
    let mut loaded = 0;
    for name in names {
        match load_module(name, dir, Path::new("/sys/module")) {
            Ok(ModuleOutcome::Loaded) => loaded += 1,
            Ok(other) => debug!("module {name}: {other:?}"),
            Err(e) => {
                crate::error!("{e}");
                first_err.get_or_insert(e);
            }
        }
    }
    if !names.is_empty() {
        info!(
            "modules: {loaded} of {} loaded in {} ms",
            names.len(),
            start.elapsed().as_millis()
        );
    }
    first_err.map_or(Ok(()), Err)
}

fn root_err(what: impl Into<String>) -> impl FnOnce(nix::errno::Errno) -> BootError {
    let what = what.into();
    move |e| BootError::Root {
        what,
        source: e.into(),
    }
}

/// Mounts the root device and makes it `/`, as described in the module documentation.
pub fn switch_root(root: &RootConfig) -> Result<(), BootError> {
    let deadline = Instant::now() + Duration::from_millis(root.wait_ms);
    while !root.device.exists() {
        if Instant::now() >= deadline {
            return Err(BootError::Root {
                what: format!(
                    "device {} did not appear within {} ms; check root.device and that its driver (virtio_blk) is in `modules`",
                    root.device.display(),
                    root.wait_ms
                ),
                source: io::ErrorKind::NotFound.into(),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let new = Path::new("/newroot");
    fs::create_dir_all(new).map_err(|source| BootError::Root {
        what: "cannot create /newroot".into(),
        source,
    })?;
    let mut flags = MsFlags::empty();
    if root.read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    let data = (!root.options.is_empty()).then_some(root.options.as_str());
    mount(
        Some(root.device.as_path()),
        new,
        Some(root.fstype.as_str()),
        flags,
        data,
    )
    .map_err(root_err(format!(
        "cannot mount {} ({}) on /newroot",
        root.device.display(),
        root.fstype
    )))?;
    let present = mounted_now();
    for d in ["/dev", "/proc", "/sys", "/run"] {
        if !present.iter().any(|p| p == Path::new(d)) {
            continue;
        }
        let target = new.join(&d[1..]);
        fs::create_dir_all(&target).map_err(|source| BootError::Root {
            what: format!("cannot create {}", target.display()),
            source,
        })?;
        mount(
            Some(d),
            &target,
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .map_err(root_err(format!("cannot move {d} into the new root")))?;
    }
    nix::unistd::chdir(new).map_err(root_err("chdir /newroot"))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(root_err("cannot move /newroot to /"))?;
    nix::unistd::chroot(".").map_err(root_err("chroot"))?;
    nix::unistd::chdir("/").map_err(root_err("chdir /"))?;
    if let Ok(mut s) = SWITCHED_ROOT.lock() {
        *s = true;
    }
    if let Ok(mut ours) = OURS.lock() {
        // The moved mounts keep their paths relative to the new root; /tmp (if ours) was
        // left behind on the initramfs.
        ours.retain(|p| p != Path::new("/tmp"));
    }
    info!(
        "switched root to {} ({})",
        root.device.display(),
        root.fstype
    );
    Ok(())
}

/// Unmounts what [`mount_basics`] mounted, innermost first, and remounts the root
/// read-only if it is a disk this process mounted. Errors are logged and ignored: the
/// shutdown goes on regardless.
pub fn unmount_ours() {
    let ours: Vec<PathBuf> = OURS.lock().map(|v| v.clone()).unwrap_or_default();
    // /proc, /sys and /dev stay: the final steps and the kernel's own messages need none,
    // but unmounting them while other mounts still sit below them would fail anyway.
    for p in ours.iter().rev() {
        if ["/proc", "/sys", "/dev"].iter().any(|k| p == Path::new(k)) {
            continue;
        }
        if let Err(e) = nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH) {
            debug!("unmount {}: {e}", p.display());
        }
    }
    let switched = SWITCHED_ROOT.lock().map(|s| *s).unwrap_or(false);
    if switched {
        let r = mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            None::<&str>,
        );
        if let Err(e) = r {
            warn!("remount / read-only: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_points_are_parsed() {
        let text = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
                    23 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw\n\
                    24 22 0:6 / /mnt/with\\040space rw - tmpfs tmpfs rw\n";
        assert_eq!(
            mount_points(text),
            vec![
                PathBuf::from("/"),
                PathBuf::from("/dev"),
                PathBuf::from("/mnt/with space")
            ]
        );
    }

    #[test]
    fn netmasks() {
        assert_eq!(netmask(24), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(netmask(0), Ipv4Addr::new(0, 0, 0, 0));
        assert_eq!(netmask(32), Ipv4Addr::new(255, 255, 255, 255));
        assert_eq!(netmask(9), Ipv4Addr::new(255, 128, 0, 0));
    }

    #[test]
    fn missing_module_file_is_fine_only_when_built_in() {
        let modules = tempfile::tempdir().unwrap();
        let sys = tempfile::tempdir().unwrap();
        std::fs::create_dir(sys.path().join("tpm_crb")).unwrap();
        assert_eq!(
            load_module("tpm_crb", modules.path(), sys.path()).unwrap(),
            ModuleOutcome::BuiltIn
        );
        let e = load_module("virtio_nope", modules.path(), sys.path()).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("virtio_nope") && msg.contains("virtio_nope.ko"),
            "{msg}"
        );
    }

    #[test]
    fn a_file_that_is_not_a_module_is_an_error_naming_it() {
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED: finit_module needs root");
            return;
        }
        let modules = tempfile::tempdir().unwrap();
        std::fs::write(modules.path().join("junk.ko"), b"not an ELF file").unwrap();
        let e = load_module("junk", modules.path(), Path::new("/nonexistent")).unwrap_err();
        assert!(e.to_string().contains("module junk"), "{e}");
    }

    #[test]
    fn bad_interface_names_are_refused() {
        assert!(ifreq_for("").is_err());
        assert!(ifreq_for("a-very-long-interface-name").is_err());
        assert!(ifreq_for("eth0").is_ok());
    }
}
