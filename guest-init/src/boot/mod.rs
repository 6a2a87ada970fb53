//! Early boot: the steps a VM's PID 1 owes the system before the app can run.
//!
//! The kernel hands PID 1 an initramfs and nothing else: no `/proc`, no `/dev` nodes beyond
//! what `CONFIG_DEVTMPFS_MOUNT` provides, a loopback interface that is down, and drivers
//! that are modules (virtio and vsock are modules in Debian's kernels). This module does, in
//! order:
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
//!
//! The steps live in submodules: `mounts` (with the shutdown's [`unmount_ours`]), `net`,
//! `modules` and `root`; their functions are re-exported here, so callers write
//! `boot::<step>`.

use std::io;
use std::path::PathBuf;

mod modules;
mod mounts;
mod net;
mod root;

pub use modules::{load_module, load_modules, ModuleOutcome};
pub use mounts::{mount_basics, mount_points, unmount_ours};
pub use net::{configure_network, interface_up, loopback_up, netmask, set_hostname};
pub use root::switch_root;

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
