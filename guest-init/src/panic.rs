//! A panic in PID 1 becomes a logged, orderly power-off.
//!
//! If PID 1 exits or dies, the kernel panics ("Attempted to kill init!") and the VM's
//! console ends with a kernel stack trace instead of a reason, the app gets no SIGTERM
//! and no filesystem is synced. So guest-init installs a panic hook that runs *before*
//! any unwinding (and before `abort` with `panic = "abort"`, which is why the release
//! profile may use either strategy):
//!
//! 1. it logs `error: panic: <message> at <file>:<line>` as one console line;
//! 2. it runs the orderly shutdown synchronously ([`crate::shutdown::run_blocking`]):
//!    SIGTERM, grace period, SIGKILL, sync, unmount, `reboot(2)`. As PID 1 that call
//!    never returns; in ordinary mode the hook exits with status 1.
//!
//! Fatal errors that are not panics (a configuration that does not parse, a root device
//! that cannot be mounted, a listener that cannot bind) take the same road through
//! [`fatal`]: `error: fatal: <message>`, then the shutdown.
//!
//! The hook must not run in a forked child (between `fork` and `exec` of the app, a panic
//! is impossible by construction, but the check is cheap): there it would signal every
//! process as if it were PID 1. A child only `_exit`s.
//!
//! **Testing hook.** The configuration field `debug_panic_after_ready: true` makes the
//! supervisor panic right after the ready line, so the tests can prove that a panic ends
//! in the power-off path and never in a kernel panic. It is off by default, documented in
//! `docs/CONFIG.md`, and does nothing but end the VM (which the configuration's author
//! can do anyway).

use crate::error;
use crate::shutdown::{self, Reason};

/// Installs the panic hook. Call after [`shutdown::init`].
pub fn install() {
    std::panic::set_hook(Box::new(|info| {
        if !shutdown::is_owner() {
            // SAFETY: `_exit` takes no pointers and ends the process at once; it is the
            // only safe way out of a forked child.
            unsafe { libc::_exit(127) };
        }
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(non-text payload)");
        match info.location() {
            Some(l) => error!("panic: {msg} at {}:{}", l.file(), l.line()),
            None => error!("panic: {msg}"),
        }
        let code = shutdown::run_blocking(Reason::Panic);
        std::process::exit(code);
    }));
}

/// Logs `error: fatal: <msg>` and runs the orderly shutdown; as PID 1 it never returns,
/// otherwise it exits with status 1.
pub fn fatal(msg: impl std::fmt::Display) -> ! {
    error!("fatal: {msg}");
    let code = shutdown::run_blocking(Reason::Fatal);
    std::process::exit(code)
}
