//! A real Dovecot 2.3 (Debian's `dovecot-core`) as a test fixture.
//!
//! Each [`Dovecot`] is a private instance in a temporary directory: its own `base_dir`,
//! state, log file, `instance_name`, a passwd-file with the users the test asks for, and
//! the auth-client listeners it asks for (the shared `auth-client`, and per-app ones such
//! as `auth_app_a` — never ending a name in `-login`, `-master`, `-userdb`, `-token` or
//! `-tokenlogin`, which Dovecot 2.3 reads as a listener type). It runs in the foreground
//! (`dovecot -F`) as a child of the test and is stopped on drop.
//!
//! Facts the configuration depends on (measured, see the project's Dovecot notes): the
//! directory must be mode 755 and the users file 644, because the auth worker runs as user
//! `dovecot`; an empty `listen =` is fatal, so it is left out; `protocols = none` starts
//! only the auth machinery. For bursts of 1,000 concurrent sign-ins the client limits
//! (`default_client_limit`, `service auth { client_limit }`) are raised to
//! [`CLIENT_LIMIT`], and the child's open-file limit is raised to its hard limit so
//! Dovecot accepts those limits.
//!
//! With [`DovecotOptions::log_requests`], `auth_verbose` and `auth_debug` log each request's
//! fields (`client in: AUTH ... rip=<addr> ... resp=<hidden>`: Dovecot hides credentials),
//! so a test can check which client address Dovecot was given; `auth_verbose_passwords`
//! stays at its default, `no`, so passwords never reach the log.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The client limit the fixture configures (connections per auth process).
pub const CLIENT_LIMIT: u32 = 4096;

/// Dovecot's binary.
pub const DOVECOT: &str = "/usr/sbin/dovecot";

/// One auth-client listener.
#[derive(Clone, Debug)]
pub struct AuthListener {
    /// Name inside the fixture's run directory (e.g. `auth_app_a`), or an absolute path.
    pub name: String,
    /// Octal mode, e.g. `"0666"`.
    pub mode: String,
}

impl AuthListener {
    /// A listener anyone may open (tests run as root; access control is not under test).
    pub fn open(name: &str) -> Self {
        AuthListener {
            name: name.into(),
            mode: "0666".into(),
        }
    }
}

/// What to start.
#[derive(Clone, Debug)]
pub struct DovecotOptions {
    /// `(user, password)` pairs for the passwd-file.
    pub users: Vec<(String, String)>,
    /// Auth-client listeners; `auth-client` is always there.
    pub listeners: Vec<AuthListener>,
    /// Log every request's fields (`auth_verbose`, `auth_debug`) as evidence of what the
    /// relay passed on.
    pub log_requests: bool,
    /// Keep Dovecot's stock client limits (1,000 connections per auth process, shared by
    /// every app) instead of raising them to [`CLIENT_LIMIT`].
    pub stock_limits: bool,
}

impl Default for DovecotOptions {
    fn default() -> Self {
        DovecotOptions {
            users: vec![
                ("alice".into(), "secret123".into()),
                ("bob".into(), "hunter22".into()),
            ],
            listeners: Vec::new(),
            log_requests: false,
            stock_limits: false,
        }
    }
}

/// A running Dovecot; stopped on drop.
#[derive(Debug)]
pub struct Dovecot {
    dir: tempfile::TempDir,
    child: Child,
    listeners: Vec<AuthListener>,
}

impl Dovecot {
    /// `dovecot --version`.
    pub fn version() -> io::Result<String> {
        let out = Command::new(DOVECOT)
            .arg("--version")
            .output()
            .map_err(|e| {
                io::Error::other(format!("{DOVECOT}: {e} (apt-get install dovecot-core)"))
            })?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Whether Dovecot is installed.
    pub fn available() -> bool {
        Path::new(DOVECOT).exists()
    }

    /// Starts Dovecot and waits until every listener's socket exists.
    pub fn start(opts: &DovecotOptions) -> io::Result<Dovecot> {
        let dir = tempfile::Builder::new().prefix("dovecot-").tempdir()?;
        let d = dir.path();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
        let users: String = opts
            .users
            .iter()
            .map(|(u, p)| format!("{u}:{{PLAIN}}{p}::::::\n"))
            .collect();
        let users_path = d.join("users");
        std::fs::write(&users_path, users)?;
        std::fs::set_permissions(&users_path, std::fs::Permissions::from_mode(0o644))?;
        let mut listeners = vec![AuthListener::open("auth-client")];
        listeners.extend(opts.listeners.iter().cloned());
        let unix_listeners: String = listeners
            .iter()
            .map(|l| {
                format!(
                    "  unix_listener {} {{\n    mode = {}\n  }}\n",
                    l.name, l.mode
                )
            })
            .collect();
        let instance = d
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let logging = if opts.log_requests {
            "auth_verbose = yes\nauth_debug = yes\n"
        } else {
            ""
        };
        let (default_limit, auth_limit, anvil) = if opts.stock_limits {
            (String::new(), String::new(), String::new())
        } else {
            let limit = CLIENT_LIMIT + 100;
            (
                format!("default_client_limit = {CLIENT_LIMIT}\n"),
                format!("  client_limit = {limit}\n"),
                format!("service anvil {{\n  client_limit = {limit}\n}}\n"),
            )
        };
        let conf = format!(
            "base_dir = {d}/run\nstate_dir = {d}/state\ninstance_name = fixture-{instance}\n\
             protocols = none\nssl = no\nlog_path = {d}/dovecot.log\n\
             auth_mechanisms = plain login\n{logging}\
             {default_limit}\
             passdb {{\n  driver = passwd-file\n  args = scheme=PLAIN username_format=%u {d}/users\n}}\n\
             userdb {{\n  driver = static\n  args = uid=65534 gid=65534 home=/nonexistent\n}}\n\
             service auth {{\n{auth_limit}{unix_listeners}}}\n\
             {anvil}",
            d = d.display(),
        );
        std::fs::write(d.join("dovecot.conf"), conf)?;
        let mut cmd = Command::new(DOVECOT);
        cmd.arg("-F")
            .arg("-c")
            .arg(d.join("dovecot.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("stderr.log"))?);
        // SAFETY: the closure runs in the forked child before exec and only calls
        // getrlimit/setrlimit, which are async-signal-safe system calls.
        unsafe {
            cmd.pre_exec(|| {
                let mut r = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 {
                    r.rlim_cur = r.rlim_max;
                    libc::setrlimit(libc::RLIMIT_NOFILE, &r);
                }
                Ok(())
            });
        }
        let child = cmd.spawn()?;
        let mut me = Dovecot {
            dir,
            child,
            listeners,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if me.listeners.iter().all(|l| me.socket(&l.name).exists()) {
                return Ok(me);
            }
            if let Some(status) = me.child.try_wait()? {
                return Err(io::Error::other(format!(
                    "dovecot exited ({status}) before its sockets appeared: {}{}",
                    std::fs::read_to_string(me.dir.path().join("stderr.log")).unwrap_or_default(),
                    me.log()
                )));
            }
            if Instant::now() > deadline {
                return Err(io::Error::other(format!(
                    "dovecot sockets did not appear within 20 s: {}",
                    me.log()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The path of a listener by name (or the absolute path itself).
    pub fn socket(&self, name: &str) -> PathBuf {
        if Path::new(name).is_absolute() {
            PathBuf::from(name)
        } else {
            self.dir.path().join("run").join(name)
        }
    }

    /// The shared `auth-client` socket.
    pub fn auth_client(&self) -> PathBuf {
        self.socket("auth-client")
    }

    /// The fixture's directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Dovecot's log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("dovecot.log")
    }

    /// Dovecot's log so far.
    /// The pid of Dovecot's `auth` process, the one that holds every auth-client
    /// connection (a child of this instance's master), once it has started.
    pub fn auth_pid(&self) -> Option<u32> {
        let master = self.child.id();
        std::fs::read_dir("/proc").ok()?.find_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // "<pid> (<comm>) <state> <ppid> ..."; comm may hold spaces, so split at ')'.
            let (head, rest) = stat.rsplit_once(')')?;
            let comm = head.split_once('(')?.1;
            let ppid: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
            (comm == "auth" && ppid == master).then_some(pid)
        })
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }
}

impl Drop for Dovecot {
    fn drop(&mut self) {
        crate::util::stop_child(&mut self.child, Duration::from_secs(10));
    }
}

/// The outcome of one sign-in over the auth-client protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SignIn {
    /// `OK` line received.
    Ok,
    /// `FAIL` line received (the whole line, for diagnosis).
    Fail(String),
}

/// Signs in once over the Dovecot auth-client protocol at `socket` (PLAIN), adding
/// `extra` parameters (e.g. `rip=10.0.2.2`) before `resp=`, as Radicale does. Reads the
/// greeting through `DONE`, then one reply line.
pub async fn sign_in(
    socket: &Path,
    user: &str,
    password: &str,
    extra: &[&str],
) -> io::Result<SignIn> {
    use base64::Engine;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let stream = tokio::net::UnixStream::connect(socket).await?;
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let mut line = String::new();
    loop {
        line.clear();
        if rd.read_line(&mut line).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "closed during greeting",
            ));
        }
        if line == "DONE\n" {
            break;
        }
    }
    let resp = base64::engine::general_purpose::STANDARD.encode(format!("\0{user}\0{password}"));
    let mut params = String::from("service=test");
    for e in extra {
        params.push('\t');
        params.push_str(e);
    }
    wr.write_all(
        format!(
            "VERSION\t1\t2\nCPID\t{}\nAUTH\t1\tPLAIN\t{params}\tresp={resp}\n",
            std::process::id()
        )
        .as_bytes(),
    )
    .await?;
    line.clear();
    if rd.read_line(&mut line).await? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "closed before the reply",
        ));
    }
    if line.starts_with("OK\t1") {
        Ok(SignIn::Ok)
    } else {
        Ok(SignIn::Fail(line.trim_end().to_string()))
    }
}
