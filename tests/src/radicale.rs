//! Radicale 3.9 (from `.cache/venv`, installed by `scripts/setup.sh`) as a test fixture.
//!
//! Radicale runs natively with its stock Dovecot backend (`[auth] type = dovecot`): its
//! `dovecot_socket` is whatever the test gives, usually a guest-init forwarder listener,
//! so the sign-in goes Radicale → forwarder → host-relay → Dovecot exactly as in a VM.
//! With `remote_ip_source = X-Remote-Addr` Radicale takes the `rip` it sends from that
//! request header, which lets a test make every request come "from" the VM's gateway
//! (10.0.2.2), as Radicale behind QEMU's NAT sees it.
//!
//! Radicale reads Dovecot's greeting and each reply with one `recv(1024)` and gives the
//! auth socket 5 s: it is a sharp test of "bytes unchanged, never split".
//!
//! It listens on a free loopback port, writes its collections and log into a temporary
//! directory, and is stopped (SIGTERM, then SIGKILL) on drop.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::util;

/// The Radicale executable in the cache's virtualenv.
pub fn binary() -> PathBuf {
    util::cache_dir().join("venv/bin/radicale")
}

/// What to start.
#[derive(Clone, Debug)]
pub struct RadicaleOptions {
    /// The Dovecot auth socket Radicale dials.
    pub dovecot_socket: PathBuf,
    /// `Some("X-Remote-Addr")` to take `rip` from that header.
    pub remote_ip_source: Option<String>,
}

/// A running Radicale; stopped on drop.
#[derive(Debug)]
pub struct Radicale {
    dir: tempfile::TempDir,
    child: Child,
    addr: SocketAddr,
}

impl Radicale {
    /// Whether Radicale is installed in the cache's virtualenv.
    pub fn available() -> bool {
        binary().exists()
    }

    /// Starts Radicale and waits until it accepts HTTP connections.
    pub fn start(opts: &RadicaleOptions) -> io::Result<Radicale> {
        let dir = tempfile::Builder::new().prefix("radicale-").tempdir()?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let mut conf = format!(
            "[server]\nhosts = {addr}\n\n[auth]\ntype = dovecot\ndovecot_socket = {}\n",
            opts.dovecot_socket.display()
        );
        if let Some(src) = &opts.remote_ip_source {
            conf.push_str(&format!("remote_ip_source = {src}\n"));
        }
        conf.push_str(&format!(
            "\n[storage]\nfilesystem_folder = {}/collections\n\n[rights]\ntype = owner_only\n\n[logging]\nlevel = info\n",
            dir.path().display()
        ));
        let conf_path = dir.path().join("config");
        std::fs::write(&conf_path, conf)?;
        let log = std::fs::File::create(dir.path().join("radicale.log"))?;
        let child = Command::new(binary())
            .arg("--config")
            .arg(&conf_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let mut me = Radicale { dir, child, addr };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if TcpStream::connect(me.addr).is_ok() {
                return Ok(me);
            }
            if let Some(status) = me.child.try_wait()? {
                return Err(io::Error::other(format!(
                    "radicale exited ({status}): {}",
                    me.log()
                )));
            }
            if Instant::now() > deadline {
                return Err(io::Error::other(format!(
                    "radicale did not listen within 30 s: {}",
                    me.log()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Radicale's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The fixture's directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Radicale's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("radicale.log")).unwrap_or_default()
    }

    /// See [`propfind`].
    pub fn propfind(
        &self,
        user: &str,
        password: &str,
        headers: &[(&str, &str)],
    ) -> io::Result<u16> {
        propfind(self.addr, user, password, headers)
    }
}

/// `PROPFIND /<user>/` at Radicale's `addr` with Basic credentials and optional extra
/// headers; returns the HTTP status code (207 when signed in, 401 when not).
pub fn propfind(
    addr: SocketAddr,
    user: &str,
    password: &str,
    headers: &[(&str, &str)],
) -> io::Result<u16> {
    {
        use base64::Engine;
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        let mut req = format!(
            "PROPFIND /{user}/ HTTP/1.1\r\nHost: {}\r\nAuthorization: Basic {auth}\r\nDepth: 0\r\nContent-Length: 0\r\nConnection: close\r\n",
            addr
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        s.write_all(req.as_bytes())?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp)?;
        let head = String::from_utf8_lossy(&resp);
        head.split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| io::Error::other(format!("no HTTP status in {head:?}")))
    }
}

impl Drop for Radicale {
    fn drop(&mut self) {
        crate::util::stop_child(&mut self.child, Duration::from_secs(5));
    }
}
