//! Figure 5: real sign-ins against a real Dovecot, the way Radicale makes them.
//!
//! Dovecot 2.3 is started in a temporary directory with a passwd-file user (the recipe in
//! `/work/shared/notes/dovecot-and-radicale.md`), listening on its `auth-client` socket.
//! One sign-in is what Radicale 3.9's dovecot backend does per HTTP request: connect,
//! read the greeting up to `DONE`, send `VERSION` and `CPID`, send one
//! `AUTH ... PLAIN service=radicale rip=127.0.0.1 resp=<base64>` line, read the `OK`
//! line, close. The password is a benchmark-only constant for a throwaway user, never a
//! real secret, and it is not printed.
//!
//! Only correct passwords are sent: a failure would add Dovecot's 2 s failure delay and
//! measure that instead of the path.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;

use super::echo::connect;

/// A Dovecot started for the benchmark; stopped on drop.
#[derive(Debug)]
pub struct Dovecot {
    child: Child,
    socket: PathBuf,
}

/// Whether Dovecot is installed.
pub fn available() -> bool {
    Path::new("/usr/sbin/dovecot").exists()
}

impl Dovecot {
    /// Starts Dovecot in `dir` and waits for its `auth-client` socket.
    pub fn start(dir: &Path) -> io::Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
        let users = dir.join("users");
        std::fs::write(&users, "alice:{PLAIN}secret123::::::\n")?;
        std::fs::set_permissions(&users, std::fs::Permissions::from_mode(0o644))?;
        let d = dir.display();
        let conf = format!(
            "base_dir = {d}/run\nstate_dir = {d}/state\ninstance_name = bench-{pid}\n\
             protocols = none\nssl = no\nlog_path = {d}/dovecot.log\n\
             auth_mechanisms = plain login\n\
             passdb {{\n  driver = passwd-file\n  args = scheme=PLAIN username_format=%u {users}\n}}\n\
             userdb {{\n  driver = static\n  args = uid=65534 gid=65534 home=/nonexistent\n}}\n\
             service auth {{\n  unix_listener auth-client {{\n    mode = 0666\n  }}\n}}\n",
            pid = std::process::id(),
            users = users.display(),
        );
        let conf_path = dir.join("dovecot.conf");
        std::fs::write(&conf_path, conf)?;
        let mut child = Command::new("/usr/sbin/dovecot")
            .arg("-F")
            .arg("-c")
            .arg(&conf_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let socket = dir.join("run/auth-client");
        if let Err(e) = super::paths::wait_for_socket(&socket, &mut child, "dovecot") {
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(dir.join("dovecot.log")).unwrap_or_default();
            return Err(io::Error::other(format!("{e}; dovecot.log: {log}")));
        }
        Ok(Dovecot { child, socket })
    }

    /// The `auth-client` socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for Dovecot {
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
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_until(s: &mut impl Read, buf: &mut Vec<u8>, end: &[u8]) -> io::Result<()> {
    let mut chunk = [0u8; 1024];
    while !buf.windows(end.len()).any(|w| w == end) {
        match s.read(&mut chunk)? {
            0 => return Err(io::Error::other("auth server closed the connection early")),
            n => buf.extend_from_slice(&chunk[..n]),
        }
    }
    Ok(())
}

/// One Radicale-style sign-in through `socket`; `Ok` only when Dovecot said `OK`.
pub fn sign_in(socket: &Path) -> io::Result<()> {
    let mut s = connect(socket, Duration::from_secs(10))?;
    let mut greeting = Vec::new();
    read_until(&mut s, &mut greeting, b"DONE\n")?;
    s.write_all(format!("VERSION\t1\t1\nCPID\t{}\n", std::process::id()).as_bytes())?;
    let resp = base64::engine::general_purpose::STANDARD.encode(b"\0alice\0secret123");
    s.write_all(
        format!("AUTH\t1\tPLAIN\tservice=radicale\trip=127.0.0.1\tresp={resp}\n").as_bytes(),
    )?;
    let mut reply = Vec::new();
    read_until(&mut s, &mut reply, b"\n")?;
    if reply.starts_with(b"OK\t1\t") {
        Ok(())
    } else {
        let line = String::from_utf8_lossy(&reply);
        let first = line.split('\t').next().unwrap_or("");
        Err(io::Error::other(format!(
            "sign-in refused: Dovecot answered {first:?}"
        )))
    }
}

/// `n` sign-ins; milliseconds per sign-in.
pub fn sign_ins(socket: &Path, n: usize) -> io::Result<Vec<f64>> {
    sign_in(socket)?;
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        sign_in(socket)?;
        samples.push(super::stats::millis(t.elapsed()));
    }
    Ok(samples)
}
