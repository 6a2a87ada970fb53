//! The host's Dovecot for the Radicale VM: a real Dovecot 2.3 in a temporary directory,
//! with a passwd-file user and logging that shows each sign-in request's `rip`.
//!
//! The recipe is the one in `/work/shared/notes/dovecot-and-radicale.md`: `base_dir`,
//! `state_dir` and `log_path` in the directory, `protocols = none`, the auth service's
//! `auth-client` listener. What this scenario adds is **logging as evidence**:
//! `auth_verbose = yes` logs each failure with the request's remote address
//! (`passwd-file(alice,<rip>,...)`), and `auth_debug = yes` logs each request's fields
//! (`client in: AUTH ... rip=<addr> ... resp=<hidden>`: Dovecot hides the credentials), so
//! a test can check which client address Dovecot was given. `auth_verbose_passwords` stays
//! at its default, `no`: passwords never reach the log.
//!
//! The directory is `0755` and the users file `0644`: Dovecot's auth worker runs as user
//! `dovecot` and otherwise answers `temp_fail`. Dropping the handle stops Dovecot
//! (SIGTERM to the master, SIGKILL after 5 s) and reaps it.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Where Debian installs Dovecot.
pub const DOVECOT: &str = "/usr/sbin/dovecot";

/// A running Dovecot.
#[derive(Debug)]
pub struct HostDovecot {
    child: Child,
    /// The `auth-client` socket (mode 0666).
    pub auth_client: PathBuf,
    /// The log file.
    pub log_path: PathBuf,
    /// `dovecot --version`.
    pub version: String,
}

impl HostDovecot {
    /// Starts Dovecot in `dir` with `users` (name, password) and waits for its socket.
    pub fn start(dir: &Path, users: &[(&str, &str)]) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
        let users_file = dir.join("users");
        let mut text = String::new();
        for (u, p) in users {
            text.push_str(&format!("{u}:{{PLAIN}}{p}::::::\n"));
        }
        std::fs::write(&users_file, text)?;
        std::fs::set_permissions(&users_file, std::fs::Permissions::from_mode(0o644))?;
        let d = dir.display();
        static COUNT: AtomicU32 = AtomicU32::new(0);
        let instance = format!(
            "radicale-vm-{}-{}",
            std::process::id(),
            COUNT.fetch_add(1, Ordering::Relaxed)
        );
        let conf = format!(
            "base_dir = {d}/run\nstate_dir = {d}/state\ninstance_name = {instance}\n\
             protocols = none\nssl = no\nlog_path = {d}/dovecot.log\n\
             auth_mechanisms = plain login\n\
             auth_verbose = yes\nauth_debug = yes\n\
             passdb {{\n  driver = passwd-file\n  args = scheme=PLAIN username_format=%u {users}\n}}\n\
             userdb {{\n  driver = static\n  args = uid=65534 gid=65534 home=/nonexistent\n}}\n\
             service auth {{\n  unix_listener auth-client {{\n    mode = 0666\n  }}\n}}\n",
            users = users_file.display(),
        );
        let conf_path = dir.join("dovecot.conf");
        std::fs::write(&conf_path, conf)?;
        let version = Command::new(DOVECOT)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .map_err(|e| {
                io::Error::other(format!("{DOVECOT}: {e} (apt-get install dovecot-core)"))
            })?;
        let mut child = Command::new(DOVECOT)
            .arg("-F")
            .arg("-c")
            .arg(&conf_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let auth_client = dir.join("run/auth-client");
        let log_path = dir.join("dovecot.log");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !auth_client.exists() {
            let died = child.try_wait()?;
            if died.is_some() || Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(io::Error::other(format!(
                    "dovecot did not create {} ({}); dovecot.log: {}",
                    auth_client.display(),
                    match died {
                        Some(s) => format!("exited {s}"),
                        None => "timed out after 20 s".into(),
                    },
                    log.trim()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(HostDovecot {
            child,
            auth_client,
            log_path,
            version,
        })
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

impl Drop for HostDovecot {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
