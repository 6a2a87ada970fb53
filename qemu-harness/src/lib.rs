//! `qemu-harness`: runs one micro-VM the way a platform would, for tests, benchmarks and
//! the demo.
//!
//! - [`kernel`]: the cached guest kernel and its modules.
//! - [`qemu`]: the QEMU command line (q35, shared memfd memory, vhost-user vsock) and the
//!   KVM-or-TCG decision, made by trying.
//! - [`process`]: supervised child processes that never outlive the harness.
//! - [`hybrid`]: host-to-guest connections through the VM's hybrid vsock socket.
//! - [`vm`]: [`VmSpec`] and [`Vm`]: boot, wait for ready, connect, clean up.
//! - [`load`]: the benchmark's client workloads (RTT, bulk, setups, burst) against a Unix
//!   or vsock address, run by the host bench and, inside guests, by `guest-probe load`.
//! - [`stop`]: ending a VM: the control port's `stop`, the ACPI power button and
//!   Ctrl-Alt-Del through [`qmp`], and waiting for QEMU's exit.
//!
//! The guest test program `guest-probe` (`src/bin/guest-probe.rs`) is built from this
//! package for musl and runs inside guests as the app. See `docs/HARNESS.md`.

pub mod hybrid;
pub mod kernel;
pub mod load;
pub mod process;
pub mod qemu;
pub mod qmp;
pub mod stop;
pub mod swtpm;
pub mod vm;

use std::path::Path;
use std::time::Duration;

pub use kernel::Kernel;
pub use qemu::{Accel, UserNet};
pub use stop::StopReport;
pub use vm::{Image, Ready, RelaySpec, Vm, VmSpec};

/// A harness error: what failed, and the console or log lines that explain it.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A tool or file the harness needs is not there.
    #[error("missing: {what} (run scripts/setup.sh)")]
    Missing {
        /// What is missing.
        what: String,
    },
    /// The image could not be built.
    #[error("image: {0}")]
    Image(#[from] vm_image::initramfs::ImageError),
    /// A process could not be started.
    #[error("cannot start {what}: {source}")]
    Spawn {
        /// The program.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A process the VM depends on ended.
    #[error("{name} exited ({status}); last lines:\n{log_tail}")]
    ProcessDied {
        /// Which one.
        name: String,
        /// Its status.
        status: String,
        /// The end of its log (and of the console).
        log_tail: String,
    },
    /// Something did not happen in time.
    #[error("timed out after {after:?} waiting for {what}; last lines:\n{tail}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The timeout.
        after: Duration,
        /// The end of the console or log.
        tail: String,
    },
    /// A host-to-guest connection failed.
    #[error("cannot connect to guest port {port}: {source}; console:\n{tail}")]
    Connect {
        /// The guest port.
        port: u32,
        /// The cause.
        #[source]
        source: std::io::Error,
        /// The end of the console.
        tail: String,
    },
    /// A QMP command failed (no socket, no greeting, or QEMU refused it).
    #[error("QMP {command}: {detail}")]
    Qmp {
        /// The command.
        command: String,
        /// What went wrong.
        detail: String,
    },
    /// File system I/O on the run directory.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl HarnessError {
    fn io(path: &Path, source: std::io::Error) -> Self {
        HarnessError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}
