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
//! credentials. [`drop_to`] refuses to run once a second thread exists, and refuses too
//! when `/proc/self/status` cannot say how many threads there are: assuming "one" would
//! let a thread keep the old credentials unnoticed.
//!
//! **Ids are not enough: capabilities.** The kernel clears a process's capabilities when
//! its uids go from "some 0" to "all non-zero". A relay started as a *non-root* user with
//! ambient capabilities (a natural hardening: `CAP_SETUID`, `CAP_SETGID` and nothing else)
//! never had a uid 0, so `setresuid` leaves its capabilities in place, and with
//! `CAP_SETUID` it could become root again. The same holds for a root start under
//! `SECBIT_KEEP_CAPS` or `SECBIT_NO_SETUID_FIXUP`. So [`drop_to`] clears the ambient set
//! before the drop, clears the effective, permitted and inheritable sets after it (lowering
//! one's own capabilities needs no privilege), sets `no_new_privs` so no later `execve`
//! of a set-uid or file-capability binary can raise them again, and then *verifies*: the
//! ids, the groups, and that the effective, permitted, inheritable and ambient sets are
//! empty. Any difference is an error, and the relay does not start.
//!
//! **Not root by another name.** [`check_run_as`] refuses uid 0, gid 0 and group 0 in
//! `run_as`: the upstream would see root's uid or root's group, not the app.
//!
//! After the drop the process cannot regain root (saved ids are set too, no capability is
//! left), so a compromise of the relay through a guest's bytes yields the app's own rights
//! only.

use nix::errno::Errno;
use nix::unistd::{self, Gid, Uid};

use crate::config::RunAs;

/// A `run_as` that would not make the process the app.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct RunAsError {
    /// The offending field, e.g. `run_as.gid` or `run_as.groups[1]`.
    pub field: String,
    /// Why, and what to do instead.
    pub reason: &'static str,
}

/// Why the process could not become the app.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    /// `run_as` names root's uid, gid or group.
    #[error("refusing run_as: {0}")]
    RunAs(#[from] RunAsError),
    /// Threads exist that would keep the old credentials.
    #[error("cannot drop privileges: the process already has {0} threads; drop before starting the runtime")]
    Threads(usize),
    /// The thread count could not be read; the drop is refused rather than guessed.
    #[error("cannot drop privileges: cannot count this process's threads from /proc/self/status ({0}); mount /proc in the relay's namespace")]
    ThreadCount(String),
    /// A system call failed.
    #[error("cannot become uid {uid} gid {gid}: {call} failed: {source} (the relay must start as root, or with CAP_SETUID and CAP_SETGID, to use run_as)")]
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
    /// Capabilities survived the drop: the process could regain what it gave up.
    #[error(
        "capabilities remain after dropping to uid {uid}: {left}; refusing to serve with them"
    )]
    CapsRemain {
        /// uid asked for.
        uid: u32,
        /// The non-empty sets, e.g. `effective=0xc0 ambient=0xc0`.
        left: String,
    },
}

/// Refuses a `run_as` that names root's uid, gid or a root group. The configuration calls
/// this at validation; [`drop_to`] calls it again before touching anything.
pub fn check_run_as(run_as: &RunAs) -> Result<(), RunAsError> {
    if run_as.uid == 0 {
        return Err(RunAsError {
            field: "run_as.uid".into(),
            reason: "0 is root: the service would see root, not the app; give the app's uid or omit run_as",
        });
    }
    if run_as.gid == 0 {
        return Err(RunAsError {
            field: "run_as.gid".into(),
            reason:
                "0 is the root group: the service would see root's group and the relay would keep \
                     access to root-group files; give the app's own primary gid",
        });
    }
    if let Some(i) = run_as.groups.iter().position(|g| *g == 0) {
        return Err(RunAsError {
            field: format!("run_as.groups[{i}]"),
            reason: "0 is the root group: the relay would keep root's group rights; remove it \
                     from the supplementary groups",
        });
    }
    Ok(())
}

/// Number of threads of this process (from `/proc/self/status`). An unreadable or
/// unparsable file is an error, never "one thread".
pub fn thread_count() -> Result<usize, PrivilegeError> {
    threads_from(std::fs::read_to_string("/proc/self/status"))
}

/// The `Threads:` value of a `/proc/<pid>/status` read.
fn threads_from(status: std::io::Result<String>) -> Result<usize, PrivilegeError> {
    let status = status.map_err(|e| PrivilegeError::ThreadCount(e.to_string()))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| PrivilegeError::ThreadCount("no parsable Threads: line".into()))
}

/// The calling thread's capability sets, each as a 64-bit mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CapSets {
    /// Effective set.
    pub effective: u64,
    /// Permitted set.
    pub permitted: u64,
    /// Inheritable set.
    pub inheritable: u64,
    /// Ambient set.
    pub ambient: u64,
}

impl CapSets {
    /// The non-empty sets as `name=0xMASK`, space separated; empty if all are empty.
    pub fn non_empty(&self) -> String {
        [
            ("effective", self.effective),
            ("permitted", self.permitted),
            ("inheritable", self.inheritable),
            ("ambient", self.ambient),
        ]
        .iter()
        .filter(|(_, m)| *m != 0)
        .map(|(n, m)| format!("{n}={m:#x}"))
        .collect::<Vec<_>>()
        .join(" ")
    }
}

/// `struct __user_cap_header_struct` (linux/capability.h).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct` (linux/capability.h); version 3 uses two of them.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// `_LINUX_CAPABILITY_VERSION_3`: 64-bit sets in two 32-bit halves.
const CAP_VERSION_3: u32 = 0x2008_0522;

/// Reads the calling thread's capability sets: `capget(2)` for effective, permitted and
/// inheritable, `PR_CAP_AMBIENT_IS_SET` for each capability of the ambient set.
pub fn current_caps() -> Result<CapSets, Errno> {
    let mut header = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget reads `header` and writes two `__user_cap_data_struct`s to `data`, as
    // `_LINUX_CAPABILITY_VERSION_3` defines; both are live, correctly laid out (#[repr(C)])
    // and large enough.
    let r = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut CapHeader,
            data.as_mut_ptr(),
        )
    };
    Errno::result(r)?;
    let join = |f: fn(&CapData) -> u32| u64::from(f(&data[0])) | (u64::from(f(&data[1])) << 32);
    let mut ambient = 0u64;
    for cap in 0..64u64 {
        // SAFETY: prctl with integer arguments only; PR_CAP_AMBIENT_IS_SET reads nothing
        // from memory.
        let r = unsafe {
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_IS_SET as libc::c_ulong,
                cap as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            )
        };
        match r {
            1 => ambient |= 1 << cap,
            0 => {}
            // EINVAL: past the kernel's last capability; the rest do not exist.
            _ if Errno::last() == Errno::EINVAL && cap > 0 => break,
            _ => return Err(Errno::last()),
        }
    }
    Ok(CapSets {
        effective: join(|d| d.effective),
        permitted: join(|d| d.permitted),
        inheritable: join(|d| d.inheritable),
        ambient,
    })
}

/// Empties the calling thread's effective, permitted and inheritable sets. Lowering one's
/// own capabilities needs none.
fn clear_caps() -> Result<(), Errno> {
    let mut header = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let data = [CapData::default(); 2];
    // SAFETY: capset reads `header` and two `__user_cap_data_struct`s from `data`; both
    // are live and #[repr(C)] as `_LINUX_CAPABILITY_VERSION_3` defines.
    let r = unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    };
    Errno::result(r).map(drop)
}

/// `prctl` with integer arguments, as a `Result`.
fn prctl(option: libc::c_int, arg2: libc::c_ulong) -> Result<(), Errno> {
    // SAFETY: the options used here (PR_CAP_AMBIENT_CLEAR_ALL, PR_SET_NO_NEW_PRIVS) take
    // integer arguments only and read or write no memory of ours.
    let r = unsafe {
        libc::prctl(
            option,
            arg2,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    Errno::result(r).map(drop)
}

/// Whether the ids read back after the drop are the ones `run_as` asked for: every one of
/// real, effective and saved uid and gid, and the supplementary groups as a set (`run_as`
/// may list them in any order, with repeats).
fn ids_match(run_as: &RunAs, uids: [u32; 3], gids: [u32; 3], groups: &[u32]) -> bool {
    let mut have = groups.to_vec();
    have.sort_unstable();
    have.dedup();
    let mut want = run_as.groups.clone();
    want.sort_unstable();
    want.dedup();
    uids == [run_as.uid; 3] && gids == [run_as.gid; 3] && have == want
}

/// Sets supplementary groups, then real/effective/saved gid, then uid; empties every
/// capability set; and verifies all of it.
pub fn drop_to(run_as: &RunAs) -> Result<(), PrivilegeError> {
    check_run_as(run_as)?;
    let threads = thread_count()?;
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
    // Ambient capabilities would survive into any execve; they go first. The effective
    // and permitted sets are still needed for the id changes below.
    prctl(
        libc::PR_CAP_AMBIENT,
        libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
    )
    .map_err(|e| call("prctl(PR_CAP_AMBIENT_CLEAR_ALL)", e))?;
    let groups: Vec<Gid> = run_as.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    unistd::setgroups(&groups).map_err(|e| call("setgroups", e))?;
    let g = Gid::from_raw(gid);
    unistd::setresgid(g, g, g).map_err(|e| call("setresgid", e))?;
    let u = Uid::from_raw(uid);
    unistd::setresuid(u, u, u).map_err(|e| call("setresuid", e))?;
    // From root the kernel has just emptied the sets; from a non-root start with
    // capabilities (or under SECBIT_KEEP_CAPS) it has not.
    clear_caps().map_err(|e| call("capset", e))?;
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1).map_err(|e| call("prctl(PR_SET_NO_NEW_PRIVS)", e))?;

    let ru = unistd::getresuid().map_err(|e| call("getresuid", e))?;
    let rg = unistd::getresgid().map_err(|e| call("getresgid", e))?;
    let have: Vec<u32> = unistd::getgroups()
        .map_err(|e| call("getgroups", e))?
        .iter()
        .map(|g| g.as_raw())
        .collect();
    let uids = [ru.real, ru.effective, ru.saved].map(Uid::as_raw);
    let gids = [rg.real, rg.effective, rg.saved].map(Gid::as_raw);
    if !ids_match(run_as, uids, gids, &have) {
        return Err(PrivilegeError::Mismatch {
            uid,
            gid,
            groups: run_as.groups.clone(),
        });
    }
    let caps = current_caps().map_err(|e| call("capget", e))?;
    if caps != CapSets::default() {
        return Err(PrivilegeError::CapsRemain {
            uid,
            left: caps.non_empty(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_as(uid: u32, gid: u32, groups: &[u32]) -> RunAs {
        RunAs {
            uid,
            gid,
            groups: groups.to_vec(),
        }
    }

    #[test]
    fn check_run_as_refuses_root_uid_gid_and_group() {
        assert_eq!(
            check_run_as(&run_as(0, 0, &[])).unwrap_err().field,
            "run_as.uid"
        );
        let e = check_run_as(&run_as(1000, 0, &[])).unwrap_err();
        assert_eq!(e.field, "run_as.gid");
        assert!(
            e.to_string().starts_with("run_as.gid: 0 is the root group"),
            "{e}"
        );
        let e = check_run_as(&run_as(1000, 1000, &[5, 0])).unwrap_err();
        assert_eq!(e.field, "run_as.groups[1]");
        assert!(e.to_string().contains("remove it"), "{e}");
        assert!(check_run_as(&run_as(1000, 1000, &[5, 6])).is_ok());
    }

    #[test]
    fn drop_to_refuses_gid_0_and_group_0_before_touching_anything() {
        // Runs in the test process itself: the refusal must come before any system call
        // (it would otherwise fail on the thread count or, worse, drop the test runner).
        let e = drop_to(&run_as(1000, 0, &[])).unwrap_err();
        assert!(e.to_string().contains("run_as.gid"), "{e}");
        let e = drop_to(&run_as(1000, 1000, &[0])).unwrap_err();
        assert!(e.to_string().contains("run_as.groups[0]"), "{e}");
    }

    #[test]
    fn thread_count_is_read_never_assumed() {
        let read = |s: &str| threads_from(Ok(s.to_owned()));
        assert_eq!(read("Name:\tx\nThreads:\t3\n").unwrap(), 3);
        for bad in ["Name:\tx\n", "Threads:\tmany\n"] {
            let e = read(bad).unwrap_err();
            assert!(matches!(e, PrivilegeError::ThreadCount(_)), "{bad:?}: {e}");
        }
        let unreadable = threads_from(Err(std::io::ErrorKind::PermissionDenied.into()));
        let e = unreadable.unwrap_err().to_string();
        assert!(
            e.contains("/proc/self/status") && e.contains("mount /proc"),
            "{e}"
        );
    }

    #[test]
    fn caps_are_named_when_left() {
        let c = CapSets {
            effective: 0xc0,
            ambient: 0xc0,
            ..CapSets::default()
        };
        assert_eq!(c.non_empty(), "effective=0xc0 ambient=0xc0");
        assert_eq!(CapSets::default().non_empty(), "");
    }

    /// Exit codes of the forked child in [`a_non_root_start_with_ambient_setuid_cannot_regain_root`].
    const SETUP_FAILED: i32 = 10;
    const CAPS_LEFT: i32 = 30;
    const BECAME_ROOT: i32 = 40;
    const NOT_REFUSED_NOR_CLEAN: i32 = 50;
    const MISREAD: i32 = 60;
    const NO_NEW_PRIVS_OFF: i32 = 70;

    /// The child: become uid/gid 65534 keeping CAP_SETUID and CAP_SETGID in the effective,
    /// permitted, inheritable and ambient sets (what `setpriv --reuid=65534 --regid=65534
    /// --inh-caps=+setuid,+setgid --ambient-caps=+setuid,+setgid` gives a relay), then drop
    /// to 65533 and try to become root again. Returns the exit code.
    fn ambient_setuid_child() -> i32 {
        const SETUID: u32 = 7; // CAP_SETUID
        const SETGID: u32 = 6; // CAP_SETGID
        let keep = (1u32 << SETUID) | (1u32 << SETGID);
        if prctl(libc::PR_SET_KEEPCAPS, 1).is_err() {
            return SETUP_FAILED;
        }
        let (nobody_u, nobody_g) = (Uid::from_raw(65534), Gid::from_raw(65534));
        if unistd::setgroups(&[]).is_err()
            || unistd::setresgid(nobody_g, nobody_g, nobody_g).is_err()
            || unistd::setresuid(nobody_u, nobody_u, nobody_u).is_err()
        {
            return SETUP_FAILED;
        }
        let mut header = CapHeader {
            version: CAP_VERSION_3,
            pid: 0,
        };
        let data = [
            CapData {
                effective: keep,
                permitted: keep,
                inheritable: keep,
            },
            CapData::default(),
        ];
        // SAFETY: as in `clear_caps`: a live header and two #[repr(C)] data structs.
        let r = unsafe {
            libc::syscall(
                libc::SYS_capset,
                &mut header as *mut CapHeader,
                data.as_ptr(),
            )
        };
        if r != 0 {
            return SETUP_FAILED;
        }
        for cap in [SETUID, SETGID] {
            // SAFETY: integer-only prctl.
            let r = unsafe {
                libc::prctl(
                    libc::PR_CAP_AMBIENT,
                    libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong,
                    cap as libc::c_ulong,
                    0 as libc::c_ulong,
                    0 as libc::c_ulong,
                )
            };
            if r != 0 {
                return SETUP_FAILED;
            }
        }
        let k = u64::from(keep);
        let expected = CapSets {
            effective: k,
            permitted: k,
            inheritable: k,
            ambient: k,
        };
        if kernel_caps() != Some(expected) {
            return SETUP_FAILED;
        }
        // What the relay reads must be what the kernel reports, ambient set included.
        if current_caps() != Ok(expected) {
            return MISREAD;
        }
        let result = drop_to(&run_as(65533, 65533, &[]));
        let became_root = unistd::setuid(Uid::from_raw(0)).is_ok()
            || unistd::getresuid().is_ok_and(|r| r.effective.is_root());
        if became_root {
            return BECAME_ROOT;
        }
        // Lowering one's own sets needs no privilege: the drop must succeed, and the kernel
        // must show every set empty and no_new_privs on.
        match result {
            Ok(()) if kernel_caps() != Some(CapSets::default()) => CAPS_LEFT,
            Ok(()) if status_field("NoNewPrivs").as_deref() != Some("1") => NO_NEW_PRIVS_OFF,
            Ok(()) => 0,
            Err(_) => NOT_REFUSED_NOR_CLEAN,
        }
    }

    /// A field of this thread's `/proc/thread-self/status`: the kernel's view.
    fn status_field(name: &str) -> Option<String> {
        let status = std::fs::read_to_string("/proc/thread-self/status").ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_owned())
    }

    /// This thread's capability sets as the kernel reports them in `/proc`.
    fn kernel_caps() -> Option<CapSets> {
        let mask = |n| u64::from_str_radix(&status_field(n)?, 16).ok();
        Some(CapSets {
            effective: mask("CapEff")?,
            permitted: mask("CapPrm")?,
            inheritable: mask("CapInh")?,
            ambient: mask("CapAmb")?,
        })
    }

    #[test]
    fn the_caps_read_are_the_kernels() {
        // Whatever this runner holds (as root here: bits above 31 too, which the upper
        // half of capget's answer carries), the two views must agree.
        assert_eq!(Some(current_caps().unwrap()), kernel_caps());
    }

    #[test]
    fn threads_are_counted_and_a_second_thread_refuses_the_drop() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || rx.recv());
        let n = thread_count().unwrap();
        assert!(n >= 2, "{n} threads counted while two run");
        // Refused before anything is touched (ids that are not root's, so a regression
        // would show as this runner losing root, failing every later test).
        let e = drop_to(&run_as(65533, 65533, &[])).unwrap_err();
        assert!(matches!(e, PrivilegeError::Threads(t) if t >= 2), "{e}");
        tx.send(()).unwrap();
        other.join().unwrap().unwrap();
    }

    #[test]
    fn ids_must_all_match_after_the_drop() {
        let want = run_as(1000, 1001, &[7, 5, 7]);
        let ok = |u: [u32; 3], g: [u32; 3], groups: &[u32]| ids_match(&want, u, g, groups);
        assert!(ok([1000; 3], [1001; 3], &[5, 7]));
        assert!(ok([1000; 3], [1001; 3], &[7, 5]));
        for u in [[0, 1000, 1000], [1000, 0, 1000], [1000, 1000, 0]] {
            assert!(!ok(u, [1001; 3], &[5, 7]), "uids {u:?}");
        }
        for g in [[0, 1001, 1001], [1001, 0, 1001], [1001, 1001, 0]] {
            assert!(!ok([1000; 3], g, &[5, 7]), "gids {g:?}");
        }
        assert!(!ok([1000; 3], [1001; 3], &[5]), "a group missing");
        assert!(!ok([1000; 3], [1001; 3], &[0, 5, 7]), "a group kept");
        assert!(!ok([1000; 3], [1001; 3], &[]), "no groups");
    }

    #[test]
    fn a_non_root_start_with_ambient_setuid_cannot_regain_root() {
        if !Uid::effective().is_root() {
            eprintln!("skipped: needs root to give a child ambient CAP_SETUID");
            return;
        }
        // SAFETY: the child is single-threaded (fork copies only the calling thread) and
        // does nothing but system calls and small allocations (glibc's fork resets the
        // malloc locks in the child) before `_exit`; it never returns into the test runner.
        match unsafe { unistd::fork() }.expect("fork") {
            unistd::ForkResult::Child => {
                let code = std::panic::catch_unwind(ambient_setuid_child).unwrap_or(99);
                // SAFETY: ends the child at once, without running the runner's exit code.
                unsafe { libc::_exit(code) }
            }
            unistd::ForkResult::Parent { child } => {
                let status = nix::sys::wait::waitpid(child, None).expect("waitpid");
                let code = match status {
                    nix::sys::wait::WaitStatus::Exited(_, c) => c,
                    other => panic!("child ended by {other:?}"),
                };
                assert_ne!(
                    code, SETUP_FAILED,
                    "could not set up the non-root start with ambient caps"
                );
                assert_ne!(
                    code, BECAME_ROOT,
                    "after the drop, setuid(0) succeeded: root regained"
                );
                assert_ne!(code, MISREAD, "current_caps disagrees with /proc");
                assert_ne!(code, CAPS_LEFT, "the drop succeeded with capabilities left");
                assert_ne!(
                    code, NO_NEW_PRIVS_OFF,
                    "no_new_privs is not set after the drop"
                );
                assert_eq!(code, 0, "the drop failed for another reason");
            }
        }
    }
}
