//! Stream endpoints: where a connection is accepted and where it is dialled.
//!
//! The guest forwards between three transports: Unix sockets (the app's unchanged paths,
//! and the stand-in for vsock in tests), vsock (the VM boundary) and TCP (a guest service
//! the host reaches). The host relay uses the same types. One [`Endpoint`] enum names
//! them in configuration and on command lines; dialling one gives a [`Conn`], binding one
//! gives a descriptor that [`crate::listener`] or [`crate::publish`] turns into a
//! listener.
//!
//! Vsock is plain `AF_VSOCK` through `nix` rather than `tokio-vsock`: it is three system
//! calls, and the raw descriptor is all [`Conn`] and the pump want.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use nix::sys::socket::{
    self, AddressFamily, SockFlag, SockType, SockaddrStorage, UnixAddr, VsockAddr,
};
use serde::{Deserialize, Serialize};

use crate::conn::Conn;
use crate::listener::Listener;
use crate::vsock::VMADDR_PORT_ANY;

/// The longest pause between connect attempts while a Unix listener's backlog is full.
const BACKLOG_FULL_MAX_PAUSE: Duration = Duration::from_millis(50);

/// Where a stream connection is made or accepted.
///
/// In JSON: `{"unix": "/run/x.sock"}`, `{"vsock": {"cid": 2, "port": 5001}}`,
/// `{"tcp": "127.0.0.1:5232"}`. On a command line: `unix:/run/x.sock`, `vsock:2:5001`,
/// `tcp:127.0.0.1:5232`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Endpoint {
    /// A Unix stream socket at an absolute path.
    Unix(PathBuf),
    /// A vsock address. To listen, `cid` is usually `u32::MAX` (`VMADDR_CID_ANY`).
    Vsock {
        /// Context id: 2 is the host, 1 is local loopback, guests are 3 and above.
        cid: u32,
        /// Port.
        port: u32,
    },
    /// A TCP address.
    Tcp(SocketAddr),
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
            Endpoint::Vsock { cid, port } => write!(f, "vsock:{cid}:{port}"),
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

/// An endpoint string that could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid endpoint {input:?}: {reason}; expected unix:/abs/path, vsock:CID:PORT or tcp:HOST:PORT")]
pub struct ParseEndpointError {
    input: String,
    reason: &'static str,
}

impl FromStr for Endpoint {
    type Err = ParseEndpointError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseEndpointError {
            input: s.to_owned(),
            reason,
        };
        let (scheme, rest) = s.split_once(':').ok_or_else(|| err("missing scheme"))?;
        match scheme {
            "unix" => {
                let p = PathBuf::from(rest);
                if !p.is_absolute() {
                    return Err(err("a unix path must be absolute"));
                }
                Ok(Endpoint::Unix(p))
            }
            "vsock" => {
                let (cid, port) = rest.split_once(':').ok_or_else(|| err("missing port"))?;
                Ok(Endpoint::Vsock {
                    cid: cid.parse().map_err(|_| err("CID is not a 32-bit number"))?,
                    port: port
                        .parse()
                        .map_err(|_| err("port is not a 32-bit number"))?,
                })
            }
            "tcp" => Ok(Endpoint::Tcp(
                rest.parse().map_err(|_| err("not an IP:port address"))?,
            )),
            _ => Err(err("unknown scheme")),
        }
    }
}

impl Endpoint {
    /// Checks what can be checked without touching the system; `field` names the
    /// configuration field in the message.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            Endpoint::Unix(p) if !p.is_absolute() => match p.to_str() {
                // The endpoint syntax of other fields (and of the logs) where a plain path
                // is expected.
                Some(s) if s.starts_with("unix:/") => Err(format!(
                    "unix path {s} is relative: this field takes a plain path; write {}",
                    &s["unix:".len()..]
                )),
                _ => Err(format!(
                    "unix path {} is relative; use an absolute path",
                    p.display()
                )),
            },
            Endpoint::Unix(p) if p.as_os_str().len() >= 108 => Err(format!(
                "unix path {} is longer than the 107 bytes a socket address holds",
                p.display()
            )),
            Endpoint::Vsock { port, .. } if *port == VMADDR_PORT_ANY => {
                Err("vsock port 4294967295 (VMADDR_PORT_ANY) cannot be dialled".into())
            }
            _ => Ok(()),
        }
    }

    /// Dials the endpoint. The returned connection is non-blocking and registered.
    pub async fn connect(&self) -> io::Result<Conn> {
        self.connect_with(None).await
    }

    /// The family of the sockets [`Endpoint::connect`] makes.
    pub fn family(&self) -> AddressFamily {
        match self {
            Endpoint::Unix(_) => AddressFamily::Unix,
            Endpoint::Tcp(SocketAddr::V4(_)) => AddressFamily::Inet,
            Endpoint::Tcp(SocketAddr::V6(_)) => AddressFamily::Inet6,
            Endpoint::Vsock { .. } => AddressFamily::Vsock,
        }
    }

    /// [`Endpoint::connect`] with, for its first attempt, a socket opened beforehand: a
    /// non-blocking stream socket of [`Endpoint::family`] (the accept loop's reserve,
    /// [`crate::accept::Options::reserve`]). A TCP dial makes its own.
    pub async fn connect_with(&self, mut reserved: Option<OwnedFd>) -> io::Result<Conn> {
        let mut socket = |family| match reserved.take() {
            Some(fd) => Ok(fd),
            None => new_socket(family),
        };
        match self {
            Endpoint::Unix(path) => {
                // A Unix connect completes in the call (the new connection is queued on
                // the listener at once), so there is no writability to wait for: the
                // connection can carry bytes as soon as this returns. A full listen
                // backlog makes a non-blocking Unix connect fail with EAGAIN, where the
                // blocking connect an app makes natively waits for room. Wait the same
                // way, so a burst is queued rather than refused; the caller bounds the
                // whole connect with its own timeout.
                let addr = UnixAddr::new(path.as_path())?;
                let mut pause = Duration::from_millis(1);
                loop {
                    let fd = socket(AddressFamily::Unix)?;
                    match socket::connect(fd.as_raw_fd(), &addr) {
                        Ok(()) => return Conn::from_dialled(fd, AddressFamily::Unix),
                        Err(nix::errno::Errno::EAGAIN) => {
                            drop(fd);
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(BACKLOG_FULL_MAX_PAUSE);
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            Endpoint::Tcp(addr) => {
                let s = tokio::net::TcpStream::connect(addr).await?;
                s.set_nodelay(true)?;
                Conn::from_owned(OwnedFd::from(s.into_std()?))
            }
            Endpoint::Vsock { cid, port } => {
                let fd = socket(AddressFamily::Vsock)?;
                let addr = VsockAddr::new(*cid, *port);
                let in_progress = match socket::connect(fd.as_raw_fd(), &addr) {
                    Ok(()) => false,
                    Err(nix::errno::Errno::EINPROGRESS) => true,
                    Err(e) => return Err(e.into()),
                };
                let conn = Conn::from_dialled(fd, AddressFamily::Vsock)?;
                if in_progress {
                    conn.connected().await?;
                }
                Ok(conn)
            }
        }
    }

    /// Binds and listens with the full backlog ([`crate::listener::listen`]). A Unix path
    /// must not exist, and the file gets the process's umask; services publish Unix
    /// sockets with [`crate::publish`] instead.
    pub fn listen(&self) -> io::Result<Listener> {
        crate::listener::listen(self)
    }

    /// Binds and listens with an explicit backlog.
    pub fn listen_with_backlog(&self, backlog: i32) -> io::Result<Listener> {
        let fd = self.bind()?;
        crate::listener::listen_with_backlog(&fd, backlog)?;
        Listener::from_listening_fd(fd, self.clone())
    }

    /// Creates a non-blocking socket bound to the endpoint, not yet listening. A Unix
    /// socket file is made with the process's umask: to publish one with a chosen owner and
    /// mode, use [`crate::publish`] instead.
    pub fn bind(&self) -> io::Result<OwnedFd> {
        Ok(match self {
            Endpoint::Unix(path) => {
                let fd = new_socket(AddressFamily::Unix)?;
                socket::bind(fd.as_raw_fd(), &UnixAddr::new(path.as_path())?)?;
                fd
            }
            Endpoint::Vsock { cid, port } => {
                let fd = new_socket(AddressFamily::Vsock)?;
                socket::bind(fd.as_raw_fd(), &VsockAddr::new(*cid, *port))?;
                fd
            }
            Endpoint::Tcp(addr) => {
                let family = if addr.is_ipv4() {
                    AddressFamily::Inet
                } else {
                    AddressFamily::Inet6
                };
                let fd = new_socket(family)?;
                socket::setsockopt(&fd, socket::sockopt::ReuseAddr, &true)?;
                socket::bind(fd.as_raw_fd(), &SockaddrStorage::from(*addr))?;
                fd
            }
        })
    }

    /// The Unix path, if this is a Unix endpoint.
    pub fn unix_path(&self) -> Option<&Path> {
        match self {
            Endpoint::Unix(p) => Some(p),
            _ => None,
        }
    }
}

pub(crate) fn new_socket(family: AddressFamily) -> io::Result<OwnedFd> {
    Ok(socket::socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_endpoints() {
        for s in [
            "unix:/run/a.sock",
            "vsock:2:5001",
            "tcp:127.0.0.1:5232",
            "tcp:[::1]:80",
        ] {
            let e: Endpoint = s.parse().unwrap();
            assert_eq!(e.to_string(), s);
        }
        assert!("unix:relative".parse::<Endpoint>().is_err());
        assert!("vsock:2".parse::<Endpoint>().is_err());
        assert!("vsock:x:1".parse::<Endpoint>().is_err());
        assert!("http://x".parse::<Endpoint>().is_err());
    }

    #[test]
    fn validate_names_what_is_wrong_and_accepts_the_rest() {
        let unix = |p: &str| Endpoint::Unix(p.into());
        let err = unix("run/x.sock").validate().unwrap_err();
        assert!(err.contains("relative; use an absolute path"), "{err}");
        // The endpoint syntax where a plain path belongs: the fix is spelled out.
        let err = unix("unix:/run/x.sock").validate().unwrap_err();
        assert!(
            err.contains("takes a plain path; write /run/x.sock"),
            "{err}"
        );
        // sun_path holds 108 bytes with its NUL: 107 fit, 108 do not.
        let fits = format!("/{}", "a".repeat(106));
        assert_eq!(unix(&fits).validate(), Ok(()));
        let err = unix(&format!("{fits}b")).validate().unwrap_err();
        assert!(err.contains("longer than the 107 bytes"), "{err}");
        let err = Endpoint::Vsock {
            cid: 2,
            port: VMADDR_PORT_ANY,
        }
        .validate()
        .unwrap_err();
        assert!(err.contains("cannot be dialled"), "{err}");
        assert_eq!(Endpoint::Vsock { cid: 2, port: 5001 }.validate(), Ok(()));
        assert_eq!(
            "tcp:127.0.0.1:80".parse::<Endpoint>().unwrap().validate(),
            Ok(())
        );
        assert_eq!(unix("/run/x.sock").validate(), Ok(()));
    }

    #[test]
    fn unix_path_only_for_unix_endpoints() {
        let p = Path::new("/run/x.sock");
        assert_eq!(Endpoint::Unix(p.into()).unix_path(), Some(p));
        assert_eq!(Endpoint::Vsock { cid: 2, port: 1 }.unix_path(), None);
        assert_eq!(
            "tcp:127.0.0.1:80".parse::<Endpoint>().unwrap().unix_path(),
            None
        );
    }

    #[test]
    fn new_sockets_are_nonblocking_and_close_on_exec_as_the_kernel_reports() {
        use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
        let fd = new_socket(AddressFamily::Unix).unwrap();
        let fl = OFlag::from_bits_truncate(fcntl(&fd, FcntlArg::F_GETFL).unwrap());
        assert!(fl.contains(OFlag::O_NONBLOCK));
        let fd_flags = FdFlag::from_bits_truncate(fcntl(&fd, FcntlArg::F_GETFD).unwrap());
        assert!(fd_flags.contains(FdFlag::FD_CLOEXEC));
    }

    /// The accept loop's reserve is the socket the dial uses, as the kernel names it
    /// (`socket:[inode]` in `/proc/self/fd`): the reserve costs no socket of its own.
    #[tokio::test]
    async fn a_reserved_socket_is_the_one_dialled() {
        let dir = tempfile::tempdir().unwrap();
        let ep = Endpoint::Unix(dir.path().join("s"));
        let _l = ep.listen().unwrap();
        let reserved = new_socket(ep.family()).unwrap();
        let name = |fd: i32| std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap();
        let before = name(reserved.as_raw_fd());
        let conn = ep.connect_with(Some(reserved)).await.unwrap();
        assert_eq!(
            name(conn.as_raw_fd()),
            before,
            "the dial made a socket of its own"
        );
    }

    #[test]
    fn json_form() {
        let e: Endpoint = serde_json::from_str(r#"{"vsock":{"cid":2,"port":5001}}"#).unwrap();
        assert_eq!(e, Endpoint::Vsock { cid: 2, port: 5001 });
        let e: Endpoint = serde_json::from_str(r#"{"unix":"/run/x"}"#).unwrap();
        assert_eq!(e, Endpoint::Unix("/run/x".into()));
        assert!(serde_json::from_str::<Endpoint>(r#"{"pipe":"/x"}"#).is_err());
    }
}
