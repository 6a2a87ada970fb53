//! The ACPI power button: what QEMU's `system_powerdown`, libvirt's `virsh shutdown`,
//! KubeVirt's graceful stop and Cloud Hypervisor's `power-button` press.
//!
//! # Design
//!
//! The kernel turns a press of the ACPI power button into nothing but a `KEY_POWER` key
//! event on an input device (the `button` driver's "Power Button"), readable through
//! `evdev` as `/dev/input/eventN`. Both drivers are modules in Debian's cloud kernels; the
//! image builder adds them to the module set, and guest-init loads them with the rest
//! during boot. By the time the supervisor starts, the nodes exist: the `button` driver
//! registers its input device when it binds, `evdev` attaches to every registered device
//! when it loads, and devtmpfs creates each node before the registration returns.
//!
//! [`watch`] therefore scans `/dev/input/event*` once. A device qualifies when its
//! key-capability bitmap (`EVIOCGBIT(EV_KEY)`) contains `KEY_POWER`; its name
//! (`EVIOCGNAME`) is only printed. Each qualifying device is opened
//! `O_RDONLY | O_NONBLOCK | O_CLOEXEC` and registered with the runtime's reactor
//! ([`AsyncFd`]): one small task per device on the one runtime thread, woken by epoll only
//! when the kernel has events, so there is no polling and no thread per device. A task
//! reads whole `struct input_event` records ([`parse_events`]) and, at the first
//! `EV_KEY`/`KEY_POWER` press (value 1), sends one message on the channel the supervisor
//! listens to; the supervisor then runs the same orderly shutdown as for SIGTERM, with the
//! reason `power button`.
//!
//! No device is not an error: Firecracker has no ACPI and so no power button, and an
//! ordinary (non-PID 1) guest-init never looks, since the host's input devices are not its
//! business. A device that cannot be opened or read is logged and left alone; the other
//! ways to stop the VM still work.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::mpsc::UnboundedSender;

use crate::{debug, info, warn};

/// `EV_KEY`: a key or button changed state.
pub const EV_KEY: u16 = 1;
/// `KEY_POWER`: the power button's key code.
pub const KEY_POWER: u16 = 116;
/// `KEY_MAX` (0x2ff): the key-capability bitmap has `KEY_MAX / 8 + 1` bytes.
const KEY_BITMAP_BYTES: usize = 0x2ff / 8 + 1;
/// `sizeof(struct input_event)` on 64-bit Linux: a `struct timeval` (16 bytes), then
/// `__u16 type`, `__u16 code` and `__s32 value`.
pub const EVENT_SIZE: usize = 24;

// EVIOCGNAME(len) = _IOC(_IOC_READ, 'E', 0x06, len).
nix::ioctl_read_buf!(eviocgname, b'E', 0x06, u8);
// EVIOCGBIT(EV_KEY, len) = _IOC(_IOC_READ, 'E', 0x20 + EV_KEY, len).
nix::ioctl_read_buf!(eviocgbit_key, b'E', 0x21, u8);

/// One input device that reports `KEY_POWER`.
#[derive(Debug)]
pub struct PowerDevice {
    /// Its node, e.g. `/dev/input/event1`.
    pub path: PathBuf,
    /// The kernel's name for it, e.g. `Power Button`.
    pub name: String,
    fd: OwnedFd,
}

/// Whether a key-capability bitmap (as `EVIOCGBIT(EV_KEY)` fills it) has `code`.
pub fn has_key(bitmap: &[u8], code: u16) -> bool {
    let code = usize::from(code);
    bitmap
        .get(code / 8)
        .is_some_and(|byte| byte & (1 << (code % 8)) != 0)
}

/// Whether `buf`, a sequence of whole `struct input_event` records, holds a press of the
/// power button (`EV_KEY`, `KEY_POWER`, value 1). A trailing partial record is ignored
/// (the kernel never returns one).
pub fn parse_events(buf: &[u8]) -> bool {
    buf.chunks_exact(EVENT_SIZE).any(|ev| {
        let kind = u16::from_ne_bytes([ev[16], ev[17]]);
        let code = u16::from_ne_bytes([ev[18], ev[19]]);
        let value = i32::from_ne_bytes([ev[20], ev[21], ev[22], ev[23]]);
        kind == EV_KEY && code == KEY_POWER && value == 1
    })
}

/// Opens `path` and keeps it if it reports `KEY_POWER`. `Ok(None)`: not a power button.
fn probe(path: &Path) -> nix::Result<Option<PowerDevice>> {
    let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    let fd = nix::fcntl::open(path, flags, Mode::empty())?;
    let mut keys = [0u8; KEY_BITMAP_BYTES];
    // SAFETY: `fd` is an open descriptor we own; the ioctl writes at most `keys.len()`
    // bytes (the length is encoded in the request) into the local buffer.
    unsafe { eviocgbit_key(fd.as_raw_fd(), &mut keys) }?;
    if !has_key(&keys, KEY_POWER) {
        return Ok(None);
    }
    let mut name = [0u8; 64];
    // SAFETY: as above; EVIOCGNAME writes at most `name.len()` bytes, NUL-terminated or
    // truncated, into the local buffer.
    let name = match unsafe { eviocgname(fd.as_raw_fd(), &mut name) } {
        Ok(_) => {
            let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
            String::from_utf8_lossy(&name[..end]).into_owned()
        }
        Err(_) => String::from("?"),
    };
    Ok(Some(PowerDevice {
        path: path.to_owned(),
        name,
        fd,
    }))
}

/// The `event*` devices under `dir` (normally `/dev/input`) that report `KEY_POWER`, in
/// name order. Devices that cannot be opened or asked are skipped with a debug line.
pub fn find(dir: &Path) -> Vec<PowerDevice> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("event"))
        .map(|e| e.path())
        .collect();
    paths.sort();
    paths
        .into_iter()
        .filter_map(|p| match probe(&p) {
            Ok(d) => d,
            Err(e) => {
                debug!("power button: {}: {e}", p.display());
                None
            }
        })
        .collect()
}

/// Starts watching every power button under `/dev/input` (PID 1 only); each press sends
/// `()` on `tx`. Returns how many devices are watched. Must run inside the runtime.
pub fn watch(tx: UnboundedSender<()>) -> usize {
    if !crate::shutdown::is_pid1() {
        return 0;
    }
    let devices = find(Path::new("/dev/input"));
    if devices.is_empty() {
        debug!("power button: no input device reports KEY_POWER; not watching");
    }
    let mut watched = 0;
    for dev in devices {
        let (path, name) = (dev.path.clone(), dev.name.clone());
        // SAFETY: `dev.fd` is an open descriptor that the `AsyncFd` takes ownership of; an
        // `OwnedFd` always returns the same descriptor and closes it only when dropped,
        // which is after the `AsyncFd` deregisters it.
        let registered = unsafe { AsyncFd::register_with_interest(dev.fd, Interest::READABLE) };
        match registered.map_err(|e| e.into_parts().1) {
            Ok(fd) => {
                info!("power button: watching {} ({name})", path.display());
                tokio::spawn(read_presses(fd, path, tx.clone()));
                watched += 1;
            }
            Err(e) => warn!("power button: {}: cannot watch: {e}", path.display()),
        }
    }
    watched
}

/// Reads events until the first press, then reports it and ends.
async fn read_presses(fd: AsyncFd<OwnedFd>, path: PathBuf, tx: UnboundedSender<()>) {
    let mut buf = [0u8; EVENT_SIZE * 32];
    loop {
        let mut guard = match fd.readable().await {
            Ok(g) => g,
            Err(e) => {
                warn!("power button: {}: {e}; no longer watched", path.display());
                return;
            }
        };
        match guard.try_io(|fd| nix::unistd::read(fd.get_ref(), &mut buf).map_err(Into::into)) {
            Ok(Ok(0)) => {
                debug!("power button: {}: end of file", path.display());
                return;
            }
            Ok(Ok(n)) => {
                if parse_events(&buf[..n]) {
                    let _ = tx.send(());
                    return;
                }
            }
            Ok(Err(e)) => {
                warn!(
                    "power button: {}: read: {e}; no longer watched",
                    path.display()
                );
                return;
            }
            // Spurious wake-up: the readiness was cleared, wait again.
            Err(_would_block) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: u16, code: u16, value: i32) -> Vec<u8> {
        let mut v = vec![0u8; 16];
        v.extend(kind.to_ne_bytes());
        v.extend(code.to_ne_bytes());
        v.extend(value.to_ne_bytes());
        v
    }

    #[test]
    fn only_a_power_key_press_counts() {
        // What the button driver sends for one press: key down, sync, key up, sync.
        let mut press = event(EV_KEY, KEY_POWER, 1);
        press.extend(event(0, 0, 0));
        press.extend(event(EV_KEY, KEY_POWER, 0));
        assert!(parse_events(&press));
        assert!(!parse_events(&event(EV_KEY, KEY_POWER, 0)), "release only");
        assert!(!parse_events(&event(EV_KEY, 115, 1)), "volume up");
        assert!(!parse_events(&event(2, KEY_POWER, 1)), "EV_REL, not a key");
        assert!(!parse_events(
            &event(EV_KEY, KEY_POWER, 1)[..EVENT_SIZE - 1]
        ));
    }

    #[test]
    fn the_capability_bitmap_is_read_bit_by_bit() {
        let mut keys = [0u8; KEY_BITMAP_BYTES];
        assert!(!has_key(&keys, KEY_POWER));
        keys[14] = 1 << 4; // 116 = 14 * 8 + 4
        assert!(has_key(&keys, KEY_POWER));
        assert!(!has_key(&keys, 115) && !has_key(&keys, 117));
        assert!(!has_key(&keys[..10], KEY_POWER), "short bitmap");
    }

    #[test]
    fn a_missing_input_directory_finds_nothing() {
        let dir = tempfile::tempdir().unwrap();
        assert!(find(&dir.path().join("input")).is_empty());
        std::fs::write(dir.path().join("event0"), b"not a device").unwrap();
        assert!(find(dir.path()).is_empty(), "a plain file is no device");
    }
}
