//! `guest-init`: PID 1 and agent of a micro-VM.
//!
//! The same binary runs as PID 1 of a VM (it mounts, loads modules, supervises the app and
//! powers off) and as an ordinary process (a subreaper supervisor that exits with the app's
//! status), so every behaviour is testable without a VM. See `docs/DESIGN.md` for the
//! whole picture and `docs/CONFIG.md` for the configuration.
//!
//! The socket plumbing it shares with `host-relay` (endpoints, the pump, publishing Unix
//! sockets, the accept loop) is the `vm-transport` crate.
//!
//! Modules, from the bottom up:
//! - [`log`]: one timestamped console line per event.
//! - [`forward`]: the app's unchanged socket paths forwarded to the host, and host-to-guest
//!   exports.
//! - [`ids`]: users and groups by name or number.
//! - [`config`]: the JSON configuration and its validation.
//! - [`boot`]: early mounts, hostname, loopback, kernel modules, switch-root.
//! - [`app`]: starting the app as its user, with capabilities dropped.
//! - [`supervisor`]: reaping, restarts, signal handling; [`shutdown`]: the orderly end.
//! - [`control`]: the host's stop request over vsock; [`power_button`]: the ACPI power
//!   button (`KEY_POWER` through evdev) as another way to ask for the orderly end.
//! - [`panic`]: a panic in PID 1 becomes a logged, orderly power-off.
//! - [`enroll`]: the VM's key and certificate through bootstrap-token enrollment.
//! - [`agent`]: the authenticated management channel (mutual TLS 1.3 with the enrolled
//!   certificate and the pinned management CA): `status`, `stop`, `exec`.

pub mod log;

pub mod agent;
pub mod app;
pub mod boot;
pub mod config;
pub mod control;
pub mod enroll;
pub mod forward;
pub mod ids;
pub mod panic;
pub mod power_button;
pub mod shutdown;
pub mod supervisor;
