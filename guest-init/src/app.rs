//! Starting the app: its own user, session, environment and directory, with no privileges.
//!
//! Threat: the app is the least trusted code in the VM. PID 1 runs as root with every
//! capability; whatever the app inherits from it, a compromised app could use to take over
//! the VM (and from there whatever the VM's vsock ports reach). So the child gives up
//! everything before `execve`, and the order matters:
//!
//! 1. `setsid()`: a new session and process group, so the shutdown can signal the app and
//!    all it started with one `kill(-pgid)`, and the console's job control is not shared.
//! 2. Bounding set cleared (needs `CAP_SETPCAP`, so while still root): nothing the app
//!    execs can gain a capability back, not even a setuid-root or file-capability binary.
//! 3. Ambient set cleared.
//! 4. `setgroups`, `setresgid`, `setresuid`: real, effective and saved ids all change, so
//!    the app cannot switch back. Leaving uid 0 clears the permitted and effective sets.
//! 5. Inheritable, effective and permitted sets cleared explicitly (this matters when the
//!    configured user is root: root without capabilities cannot undo steps 2-4).
//! 6. `PR_SET_NO_NEW_PRIVS`: `execve` can never grant privileges again (setuid bits and
//!    file capabilities are ignored).
//! 7. `chdir(workdir)` as the app's user, so a directory the user may not enter fails the
//!    start instead of being entered with root's rights.
//!
//! The environment is cleared and only the configured variables are set (plus a default
//! `PATH`): PID 1's own environment comes from the kernel command line and is not the app's.
//! Standard input is `/dev/null`; output goes to the console like guest-init's own.
//!
//! The child is created with `std::process::Command` and a `pre_exec` hook, never with
//! `tokio::process`: tokio's child reaper would race the supervisor's `waitpid(-1)` loop
//! for the exit status. The returned `Child` handle is dropped; the supervisor reaps.
//!
//! Everything the hook needs (the capability list, the ids, the C path of the directory)
//! is prepared before `fork`, so the hook itself only makes system calls: after `fork`
//! only async-signal-safe work is allowed.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use caps::{CapSet, Capability};
use nix::unistd::{Gid, Pid, Uid};

use crate::config::{AppConfig, ConfigError, Credentials, DEFAULT_APP_PATH};

/// The app could not be started.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The configuration does not resolve (user, group).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `fork`, the privilege drop or `execve` failed.
    #[error("cannot start {program:?} as uid {uid} gid {gid} in {workdir}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The uid it was to run as.
        uid: u32,
        /// The gid it was to run as.
        gid: u32,
        /// The working directory.
        workdir: String,
        /// The cause (from the privilege drop, `chdir` or `execve`).
        #[source]
        source: io::Error,
    },
}

/// Everything needed to start the app, resolved once.
#[derive(Clone, Debug)]
pub struct AppSpec {
    argv: Vec<String>,
    env: Vec<(String, String)>,
    workdir: PathBuf,
    creds: Credentials,
    nofile: Option<(u64, u64)>,
}

impl AppSpec {
    /// Resolves the configuration (ids through the passwd and group databases).
    pub fn from_config(cfg: &AppConfig) -> Result<Self, AppError> {
        let creds = cfg.resolve_ids()?;
        let mut env: Vec<(String, String)> = cfg
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if !cfg.env.contains_key("PATH") {
            env.push(("PATH".into(), DEFAULT_APP_PATH.into()));
        }
        Ok(AppSpec {
            argv: cfg.command.clone(),
            env,
            workdir: cfg.workdir.clone(),
            creds,
            nofile: None,
        })
    }

    /// Gives the app this open-descriptor limit (soft, hard) instead of the supervisor's.
    /// PID 1 raises its own limit for forwarding bursts; the app gets the limits it would
    /// have had natively, the ones PID 1 started with.
    pub fn with_nofile_limit(mut self, limit: (u64, u64)) -> Self {
        self.nofile = Some(limit);
        self
    }

    /// The resolved credentials.
    pub fn credentials(&self) -> &Credentials {
        &self.creds
    }

    /// Starts the app; returns its pid, which is also its process group id.
    pub fn spawn(&self) -> Result<Pid, AppError> {
        let spawn_err = |source| AppError::Spawn {
            program: self.argv.first().cloned().unwrap_or_default(),
            uid: self.creds.uid,
            gid: self.creds.gid,
            workdir: self.workdir.display().to_string(),
            source,
        };
        let workdir = CString::new(self.workdir.as_os_str().as_bytes())
            .map_err(|_| spawn_err(io::ErrorKind::InvalidInput.into()))?;
        let all_caps: Vec<Capability> = caps::all().into_iter().collect();
        let uid = Uid::from_raw(self.creds.uid);
        let gid = Gid::from_raw(self.creds.gid);
        let groups: Vec<Gid> = self
            .creds
            .groups
            .iter()
            .map(|g| Gid::from_raw(*g))
            .collect();

        let nofile = self.nofile;
        let mut cmd = Command::new(&self.argv[0]);
        cmd.args(&self.argv[1..])
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null());
        // SAFETY: the closure runs in the forked child before `execve`. It only makes
        // system calls on values prepared above (no allocation on the success path, no
        // locks), which is what may be done between `fork` and `exec`.
        unsafe {
            cmd.pre_exec(move || {
                if let Some((soft, hard)) = nofile {
                    nix::sys::resource::setrlimit(
                        nix::sys::resource::Resource::RLIMIT_NOFILE,
                        soft,
                        hard,
                    )
                    .map_err(errno)?;
                }
                drop_privileges(&all_caps, uid, gid, &groups, &workdir)
            });
        }
        let child = cmd.spawn().map_err(spawn_err)?;
        // Dropping `Child` neither waits nor kills: the supervisor's waitpid loop reaps it.
        Ok(Pid::from_raw(child.id() as i32))
    }
}

fn errno(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// Runs in the child between `fork` and `execve`; see the module documentation for the
/// order and the reasons.
fn drop_privileges(
    all_caps: &[Capability],
    uid: Uid,
    gid: Gid,
    groups: &[Gid],
    workdir: &CString,
) -> io::Result<()> {
    nix::unistd::setsid().map_err(errno)?;
    for c in all_caps {
        if caps::has_cap(None, CapSet::Bounding, *c).unwrap_or(false) {
            caps::drop(None, CapSet::Bounding, *c)
                .map_err(|_| io::Error::from_raw_os_error(libc::EPERM))?;
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(|_| io::Error::last_os_error())?;
    nix::unistd::setgroups(groups).map_err(errno)?;
    nix::unistd::setresgid(gid, gid, gid).map_err(errno)?;
    nix::unistd::setresuid(uid, uid, uid).map_err(errno)?;
    for set in [CapSet::Inheritable, CapSet::Effective, CapSet::Permitted] {
        caps::clear(None, set).map_err(|_| io::Error::last_os_error())?;
    }
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) takes no pointers; it only sets a
    // flag on the calling thread.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    nix::unistd::chdir(workdir.as_c_str()).map_err(errno)?;
    Ok(())
}
