//! The basic filesystems (`/proc`, `/sys`, `/dev`, ...) mounted only where nothing is
//! mounted yet, and the record of what this process mounted, so the shutdown unmounts
//! exactly those and never a mount that belongs to the host or a test namespace.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::mount::{mount, MsFlags};

use crate::{debug, warn};

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

pub(super) fn mounted_now() -> Vec<PathBuf> {
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

/// Records a completed switch-root: the shutdown remounts `/` read-only, and a `/tmp`
/// of ours stayed behind on the initramfs.
pub(super) fn record_switch_root() {
    if let Ok(mut s) = SWITCHED_ROOT.lock() {
        *s = true;
    }
    if let Ok(mut ours) = OURS.lock() {
        // The moved mounts keep their paths relative to the new root; /tmp (if ours) was
        // left behind on the initramfs.
        ours.retain(|p| p != Path::new("/tmp"));
    }
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
}
