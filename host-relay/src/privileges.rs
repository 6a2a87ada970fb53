//! Becoming the app: caller identity option (b), a per-app process.
//!
//! **Threat.** A service that authorises native callers by `SO_PEERCRED` (per-app Unix
//! users, ADR 055) must see a VM's app exactly as it would see the native app — never as
//! root, and never as another app. The kernel fills `SO_PEERCRED` from the credentials of
//! the thread that calls `connect()`. So the relay dials each upstream with the app's uid,
//! gid and supplementary groups.
//!
//! **Why the whole process, not per thread.** Linux credentials are per thread, and glibc
//! and musl make `setresuid` process-wide by signalling every thread; the raw system calls
//! change only the calling thread. Per-thread credentials inside a shared multi-app
//! runtime would tie each connect to a thread that tokio may move work off, and one missed
//! switch would connect as the wrong app. One process per app avoids the question: it
//! binds every listener while it is still root, then drops *everything* to the app's ids,
//! before the tokio runtime exists, so every thread it ever has is born with the app's
//! credentials. [`drop_to`] refuses to run once a second thread exists, and checks the
//! result with `getres[ug]id` and `getgroups`.
//!
//! After the drop the process cannot regain root (saved ids are set too), so a compromise
//! of the relay through a guest's bytes yields the app's own rights only.

use nix::unistd::{self, Gid, Uid};

use crate::config::RunAs;

/// Why the process could not become the app.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    /// Threads exist that would keep the old credentials.
    #[error("cannot drop privileges: the process already has {0} threads; drop before starting the runtime")]
    Threads(usize),
    /// A system call failed.
    #[error("cannot become uid {uid} gid {gid}: {call} failed: {source} (the relay must start as root to use run_as)")]
    Call {
        /// uid asked for.
        uid: u32,
        /// gid asked for.
        gid: u32,
        /// Which call.
        call: &'static str,
        /// The cause.
        #[source]
        source: nix::Error,
    },
    /// The call succeeded but the credentials are not the ones asked for.
    #[error("credentials after dropping are not uid {uid} gid {gid} groups {groups:?}")]
    Mismatch {
        /// uid asked for.
        uid: u32,
        /// gid asked for.
        gid: u32,
        /// groups asked for.
        groups: Vec<u32>,
    },
}

/// Number of threads of this process (from `/proc/self/status`).
pub fn thread_count() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(1)
}

/// Sets supplementary groups, then real/effective/saved gid, then uid, and verifies them.
pub fn drop_to(run_as: &RunAs) -> Result<(), PrivilegeError> {
    let threads = thread_count();
    if threads > 1 {
        return Err(PrivilegeError::Threads(threads));
    }
    let (uid, gid) = (run_as.uid, run_as.gid);
    let call = |call, source| PrivilegeError::Call {
        uid,
        gid,
        call,
        source,
    };
    let groups: Vec<Gid> = run_as.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    unistd::setgroups(&groups).map_err(|e| call("setgroups", e))?;
    let g = Gid::from_raw(gid);
    unistd::setresgid(g, g, g).map_err(|e| call("setresgid", e))?;
    let u = Uid::from_raw(uid);
    unistd::setresuid(u, u, u).map_err(|e| call("setresuid", e))?;
    let ru = unistd::getresuid().map_err(|e| call("getresuid", e))?;
    let rg = unistd::getresgid().map_err(|e| call("getresgid", e))?;
    let mut have: Vec<u32> = unistd::getgroups()
        .map_err(|e| call("getgroups", e))?
        .iter()
        .map(|g| g.as_raw())
        .collect();
    have.sort_unstable();
    let mut want = run_as.groups.clone();
    want.sort_unstable();
    want.dedup();
    have.dedup();
    let ids_ok =
        [ru.real, ru.effective, ru.saved] == [u; 3] && [rg.real, rg.effective, rg.saved] == [g; 3];
    if !ids_ok || have != want {
        return Err(PrivilegeError::Mismatch {
            uid,
            gid,
            groups: run_as.groups.clone(),
        });
    }
    Ok(())
}
