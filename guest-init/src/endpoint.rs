//! Stream endpoints: where a connection is accepted and where it is dialled.
//!
//! The guest forwards between three transports: Unix sockets (the app's unchanged paths,
//! and the stand-in for vsock in tests), vsock (the VM boundary) and TCP (a guest service
//! the host reaches). The host relay uses the same types. One [`Endpoint`] enum names
//! them in configuration, and every accepted or dialled connection becomes a [`Conn`]: a
//! non-blocking socket descriptor registered with tokio.
//!
//! Why one descriptor type instead of tokio's three stream types: the pump
//! ([`crate::pump`]) waits for readiness *before* it takes a buffer, so an idle connection
//! holds no buffer at all, and it can later move bytes with `splice(2)`. Both need the raw
//! descriptor; with one type the pump, the filters and the admission code are written once.
//! Vsock is plain `AF_VSOCK` through `nix` rather than `tokio-vsock` for the same reason:
//! it is three system calls, and the descriptor is all the pump wants.
//!
//! Listeners are created with an explicit backlog (default [`DEFAULT_BACKLOG`]): the
//! standard library's listeners use 128, and the peers' failures show what a small
//! backlog does to a burst (socat's 5; Firecracker stalls its whole vsock device while a
//! host `connect()` waits for a full backlog). The kernel caps it at `net.core.somaxconn`.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::str::FromStr;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use nix::sys::socket::{
    self, AddressFamily, Backlog, MsgFlags, SockFlag, SockType, SockaddrLike, SockaddrStorage,
    UnixAddr, VsockAddr,
};
use serde::{Deserialize, Serialize};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use crate::pump::PooledBuf;

/// The backlog listeners ask for. The kernel caps it at `net.core.somaxconn` (4096 here).
pub const DEFAULT_BACKLOG: i32 = 4096;

/// The longest pause between connect attempts while a Unix listener's backlog is full.
const BACKLOG_FULL_MAX_PAUSE: Duration = Duration::from_millis(50);

/// The host's CID, as every guest dials it.
pub const VMADDR_CID_HOST: u32 = 2;

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

/// Who is on the other end of an accepted connection, as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peer {
    /// A Unix socket peer (its address is usually unnamed).
    Unix,
    /// A vsock peer: its CID is set by the kernel, never by the peer.
    Vsock {
        /// The peer's context id.
        cid: u32,
        /// The peer's port.
        port: u32,
    },
    /// A TCP peer.
    Tcp(SocketAddr),
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Unix => f.write_str("unix"),
            Peer::Vsock { cid, port } => write!(f, "vsock:{cid}:{port}"),
            Peer::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
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
            Endpoint::Vsock { port, .. } if *port == u32::MAX => {
                Err("vsock port 4294967295 (VMADDR_PORT_ANY) cannot be dialled".into())
            }
            _ => Ok(()),
        }
    }

    /// Dials the endpoint. The returned connection is non-blocking and registered.
    pub async fn connect(&self) -> io::Result<Conn> {
        match self {
            Endpoint::Unix(path) => {
                // A full listen backlog makes a non-blocking Unix connect fail with EAGAIN,
                // where the blocking connect an app makes natively waits for room. Wait the
                // same way, so a burst is queued rather than refused; the caller bounds the
                // whole connect with its own timeout.
                let mut pause = Duration::from_millis(1);
                loop {
                    match tokio::net::UnixStream::connect(path).await {
                        Ok(s) => return Conn::from_owned(OwnedFd::from(s.into_std()?)),
                        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(BACKLOG_FULL_MAX_PAUSE);
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            Endpoint::Tcp(addr) => {
                let s = tokio::net::TcpStream::connect(addr).await?;
                s.set_nodelay(true)?;
                Conn::from_owned(OwnedFd::from(s.into_std()?))
            }
            Endpoint::Vsock { cid, port } => {
                let fd = new_socket(AddressFamily::Vsock)?;
                let addr = VsockAddr::new(*cid, *port);
                match socket::connect(fd.as_raw_fd(), &addr) {
                    Ok(()) => {}
                    Err(nix::errno::Errno::EINPROGRESS) => {}
                    Err(e) => return Err(e.into()),
                }
                let conn = Conn::from_owned(fd)?;
                conn.fd.writable().await?.retain_ready();
                let err: i32 =
                    socket::getsockopt(&conn.fd.get_ref(), socket::sockopt::SocketError)?;
                if err != 0 {
                    return Err(io::Error::from_raw_os_error(err));
                }
                Ok(conn)
            }
        }
    }

    /// Binds and listens with [`DEFAULT_BACKLOG`]. A Unix path must not exist; callers
    /// remove stale sockets and create parents themselves (they know what is safe to remove).
    pub fn listen(&self) -> io::Result<Listener> {
        self.listen_with_backlog(DEFAULT_BACKLOG)
    }

    /// Binds and listens with an explicit backlog.
    pub fn listen_with_backlog(&self, backlog: i32) -> io::Result<Listener> {
        let fd = self.bind()?;
        let backlog = Backlog::new(backlog.clamp(1, i32::MAX)).unwrap_or(Backlog::MAXCONN);
        socket::listen(&fd, backlog)?;
        Ok(Listener {
            fd: register(fd, Interest::READABLE)?,
            endpoint: self.clone(),
        })
    }

    /// Creates a non-blocking socket bound to the endpoint, not yet listening. Callers that
    /// publish a Unix socket set its owner and mode between this and [`listen_on`], so it is
    /// never reachable with default permissions.
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

/// Starts listening on a socket from [`Endpoint::bind`] with [`DEFAULT_BACKLOG`].
pub fn listen_on(fd: &OwnedFd) -> io::Result<()> {
    let backlog = Backlog::new(DEFAULT_BACKLOG).unwrap_or(Backlog::MAXCONN);
    Ok(socket::listen(fd, backlog)?)
}

/// Registers a descriptor with the tokio reactor.
fn register(fd: OwnedFd, interest: Interest) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an `OwnedFd` is an open descriptor that it alone closes, and `as_raw_fd`
    // returns the same number for its whole life; the `AsyncFd` takes ownership of it, so
    // the descriptor stays open and unchanged until the `AsyncFd` is dropped or unwrapped.
    Ok(unsafe { AsyncFd::register_with_interest(fd, interest) }?)
}

fn new_socket(family: AddressFamily) -> io::Result<OwnedFd> {
    Ok(socket::socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

/// A listening socket.
#[derive(Debug)]
pub struct Listener {
    fd: AsyncFd<OwnedFd>,
    endpoint: Endpoint,
}

impl Listener {
    /// Wraps an already listening socket (for example one inherited from a supervisor).
    pub fn from_listening_fd(fd: OwnedFd, endpoint: Endpoint) -> io::Result<Self> {
        nix::fcntl::fcntl(
            &fd,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        )?;
        Ok(Listener {
            fd: register(fd, Interest::READABLE)?,
            endpoint,
        })
    }

    /// The endpoint this listener was bound to.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Accepts one connection. Errors are returned as they are (`EMFILE`, `ENFILE`,
    /// `ENOBUFS`, `ECONNABORTED`...): the caller's accept loop decides whether to back
    /// off; nothing here ends a loop.
    pub async fn accept(&self) -> io::Result<(Conn, Peer)> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.try_io(|fd| {
                socket::accept4(
                    fd.as_raw_fd(),
                    SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
                )
                .map_err(io::Error::from)
            }) {
                Ok(Ok(raw)) => {
                    // SAFETY: accept4 just returned this descriptor and nothing else owns it.
                    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                    let peer = peer_of(&fd);
                    return Ok((Conn::from_owned(fd)?, peer));
                }
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsRawFd for Listener {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.get_ref().as_raw_fd()
    }
}

fn peer_of(fd: &OwnedFd) -> Peer {
    match socket::getpeername::<SockaddrStorage>(fd.as_raw_fd()) {
        Ok(addr) => match addr.family() {
            Some(AddressFamily::Vsock) => match addr.as_vsock_addr() {
                Some(v) => Peer::Vsock {
                    cid: v.cid(),
                    port: v.port(),
                },
                None => Peer::Unix,
            },
            Some(AddressFamily::Inet) => addr
                .as_sockaddr_in()
                .map(|a| Peer::Tcp(SocketAddr::V4((*a).into())))
                .unwrap_or(Peer::Unix),
            Some(AddressFamily::Inet6) => addr
                .as_sockaddr_in6()
                .map(|a| Peer::Tcp(SocketAddr::V6((*a).into())))
                .unwrap_or(Peer::Unix),
            _ => Peer::Unix,
        },
        Err(_) => Peer::Unix,
    }
}

/// One connected stream socket: non-blocking, registered with tokio, closed on drop.
///
/// It implements [`AsyncRead`] and [`AsyncWrite`] for ordinary protocol code; the pump uses
/// its readiness methods directly so that it holds no buffer while a connection is idle.
#[derive(Debug)]
pub struct Conn {
    fd: AsyncFd<OwnedFd>,
}

impl Conn {
    /// Registers a connected stream socket. It is switched to non-blocking mode.
    pub fn from_owned(fd: OwnedFd) -> io::Result<Self> {
        let flags = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_GETFL)?;
        let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(flags))?;
        Ok(Conn {
            fd: register(fd, Interest::READABLE | Interest::WRITABLE)?,
        })
    }

    /// Registers a connected standard-library Unix stream.
    pub fn from_std_unix(s: std::os::unix::net::UnixStream) -> io::Result<Self> {
        Conn::from_owned(OwnedFd::from(s))
    }

    /// Reads once: waits until the socket is readable, then returns what one `recv` gives.
    /// `Ok(0)` is end of stream.
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.try_io(|fd| recv(fd.get_ref().as_fd(), buf)) {
                Ok(r) => return r,
                Err(_would_block) => continue,
            }
        }
    }

    /// Waits until data (or end of stream, or an error) is pending, and only then takes a
    /// buffer from the pool and reads into it. An idle connection therefore holds no
    /// buffer. `Ok(None)` is end of stream.
    pub async fn read_pooled(&self) -> io::Result<Option<PooledBuf>> {
        loop {
            let mut guard = self.fd.readable().await?;
            let mut buf = PooledBuf::take();
            match guard.try_io(|fd| recv(fd.get_ref().as_fd(), buf.spare_mut())) {
                Ok(Ok(0)) => return Ok(None),
                Ok(Ok(n)) => {
                    buf.set_len(n);
                    return Ok(Some(buf));
                }
                Ok(Err(e)) => return Err(e),
                // The buffer goes back to the pool on drop; wait for readiness again.
                Err(_would_block) => continue,
            }
        }
    }

    /// Waits until the socket can take data (or has failed, so that a write would report
    /// why). The readiness is kept, so a `write_all` right after sends without waiting.
    pub async fn writable(&self) -> io::Result<()> {
        self.fd.writable().await.map(drop)
    }

    /// Writes all of `buf` before returning, waiting for the peer as needed.
    pub async fn write_all(&self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            let mut guard = self.fd.writable().await?;
            match guard.try_io(|fd| send(fd.get_ref().as_fd(), buf)) {
                Ok(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(Ok(n)) => buf = &buf[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }

    /// Half-closes the sending side (`shutdown(SHUT_WR)`). A peer that is already gone is
    /// not an error: there is nobody left to tell.
    pub fn shutdown_write(&self) -> io::Result<()> {
        match socket::shutdown(self.fd.get_ref().as_raw_fd(), socket::Shutdown::Write) {
            Ok(()) | Err(nix::errno::Errno::ENOTCONN) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The peer's credentials (`SO_PEERCRED`), for Unix sockets.
    pub fn peer_cred(&self) -> io::Result<socket::UnixCredentials> {
        Ok(socket::getsockopt(
            self.fd.get_ref(),
            socket::sockopt::PeerCredentials,
        )?)
    }

    /// Gives the descriptor back, deregistered from tokio.
    pub fn into_owned_fd(self) -> OwnedFd {
        self.fd.into_inner()
    }
}

impl AsRawFd for Conn {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.get_ref().as_raw_fd()
    }
}

impl AsFd for Conn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.get_ref().as_fd()
    }
}

fn recv(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    Ok(socket::recv(fd.as_raw_fd(), buf, MsgFlags::empty())?)
}

fn send(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    // MSG_NOSIGNAL: a vanished peer is an EPIPE for this connection, never a SIGPIPE.
    Ok(socket::send(fd.as_raw_fd(), buf, MsgFlags::MSG_NOSIGNAL)?)
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| recv(fd.get_ref().as_fd(), unfilled)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            match guard.try_io(|fd| send(fd.get_ref().as_fd(), buf)) {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.shutdown_write())
    }
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
    fn json_form() {
        let e: Endpoint = serde_json::from_str(r#"{"vsock":{"cid":2,"port":5001}}"#).unwrap();
        assert_eq!(e, Endpoint::Vsock { cid: 2, port: 5001 });
        let e: Endpoint = serde_json::from_str(r#"{"unix":"/run/x"}"#).unwrap();
        assert_eq!(e, Endpoint::Unix("/run/x".into()));
        assert!(serde_json::from_str::<Endpoint>(r#"{"pipe":"/x"}"#).is_err());
    }

    #[tokio::test]
    async fn a_full_backlog_makes_connect_wait_as_a_blocking_connect_would() {
        let dir = tempfile::tempdir().unwrap();
        let ep = Endpoint::Unix(dir.path().join("s"));
        let l = ep.listen_with_backlog(1).unwrap();
        // Fill the queue without accepting: a connect must then wait, never fail.
        let mut held = Vec::new();
        loop {
            match tokio::time::timeout(Duration::from_millis(200), ep.connect()).await {
                Ok(Ok(c)) => held.push(c),
                Ok(Err(e)) => panic!("connect to a full backlog failed instead of waiting: {e}"),
                Err(_still_waiting) => break,
            }
            assert!(held.len() < 64, "the backlog never filled");
        }
        // Once the listener accepts, a waiting connect goes through.
        let accepting = tokio::spawn(async move {
            let mut keep = Vec::new();
            while let Ok((c, _)) = l.accept().await {
                keep.push(c);
            }
        });
        tokio::time::timeout(Duration::from_secs(30), ep.connect())
            .await
            .expect("connect kept waiting after the listener accepted")
            .expect("connect");
        accepting.abort();
    }

    #[tokio::test]
    async fn unix_round_trip_and_half_close() {
        let dir = tempfile::tempdir().unwrap();
        let ep = Endpoint::Unix(dir.path().join("s"));
        let l = ep.listen().unwrap();
        let (client, server) = tokio::join!(ep.connect(), l.accept());
        let (client, (server, peer)) = (client.unwrap(), server.unwrap());
        assert_eq!(peer, Peer::Unix);
        client.write_all(b"hello").await.unwrap();
        client.shutdown_write().unwrap();
        let mut buf = [0u8; 16];
        let n = server.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(server.read(&mut buf).await.unwrap(), 0);
        server.write_all(b"back").await.unwrap();
        let n = client.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"back");
        assert_eq!(
            client.peer_cred().unwrap().uid(),
            nix::unistd::getuid().as_raw()
        );
    }
}
