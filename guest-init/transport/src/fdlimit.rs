//! The open-file limit, lifted for bursts.
//!
//! Every forwarded connection holds two descriptors; the usual soft limit of 1024 would
//! cap a burst at about 500 connections, an artificial limit a relay should lift once at
//! start. It is process-wide and inherited, so callers decide when (guest-init gives the
//! app its original limits back).

use std::io;

use nix::sys::resource::{getrlimit, setrlimit, Resource};

/// Raises this process's soft limit on open descriptors to its hard limit and returns the
/// new soft limit.
pub fn raise_fd_limit() -> io::Result<u64> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok(hard.max(soft))
}
