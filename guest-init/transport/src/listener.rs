//! Listening sockets: the backlog, accepting, and who the peer is.
//!
//! **The backlog is asked of the kernel directly.** Listeners ask for [`BACKLOG`]
//! (4096). The standard library's listeners use 128, and nix's `Backlog::new` refuses
//! anything above `libc::SOMAXCONN` (128), so code that falls back to its `MAXCONN`
//! silently gets 128 as well. A backlog of 128 is not a detail: an app that connects
//! non-blocking (Python with a socket timeout, as Radicale's Dovecot client does; Go,
//! Node, asyncio) gets `EAGAIN` after about 128 quick connects where the native service's
//! socket takes thousands, and Firecracker's VMM stalls its whole vsock device while its
//! blocking host `connect()` waits for room. So `listen(2)` is called through `libc` with
//! the number itself; the kernel caps it at `net.core.somaxconn` (4096 by default since
//! Linux 5.4). Tests check the queue from outside, by counting non-blocking connects a
//! paused listener takes and by reading `ss`.
//!
//! **Accepting returns errors as they are.** [`Listener::accept`] never decides whether
//! an error ends anything; [`crate::accept`] holds the one table of which errors are
//! skipped and which back off.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{self, AddressFamily, SockFlag, SockaddrLike, SockaddrStorage};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::conn::{register, set_nonblocking, Conn};
use crate::endpoint::Endpoint;

/// The backlog every listener asks for. The kernel caps it at `net.core.somaxconn`.
pub const BACKLOG: i32 = 4096;

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

/// Starts listening on a bound socket with [`BACKLOG`].
pub fn listen_on(fd: &OwnedFd) -> io::Result<()> {
    listen_with_backlog(fd, BACKLOG)
}

/// Starts listening with an explicit backlog (tests use small ones to fill a queue).
pub fn listen_with_backlog(fd: &OwnedFd, backlog: i32) -> io::Result<()> {
    // Not nix's `listen`: its `Backlog` type refuses values above 128 (see the module doc).
    // SAFETY: `listen` takes a descriptor and an integer and touches no memory of ours;
    // `fd` is an open socket descriptor borrowed for the duration of the call.
    let r = unsafe { libc::listen(fd.as_raw_fd(), backlog.max(1)) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Binds `endpoint` and listens with [`BACKLOG`]. A Unix path must not exist, and the
/// socket file gets the process's umask: services publish Unix sockets with
/// [`crate::publish`] instead, which sets owner and mode and handles what is in the way.
pub fn listen(endpoint: &Endpoint) -> io::Result<Listener> {
    let fd = endpoint.bind()?;
    listen_on(&fd)?;
    Listener::from_listening_fd(fd, endpoint.clone())
}

/// A listening socket.
#[derive(Debug)]
pub struct Listener {
    fd: AsyncFd<OwnedFd>,
    endpoint: Endpoint,
}

impl Listener {
    /// Wraps a listening socket (bound and listened on here, or inherited).
    pub fn from_listening_fd(fd: OwnedFd, endpoint: Endpoint) -> io::Result<Self> {
        set_nonblocking(&fd)?;
        Ok(Listener {
            fd: register(fd, Interest::READABLE)?,
            endpoint,
        })
    }

    /// The listening descriptor's readiness, for the accept loop ([`crate::accept`]),
    /// which drains the queue under one readiness guard.
    pub(crate) fn readiness(&self) -> &AsyncFd<OwnedFd> {
        &self.fd
    }

    /// The endpoint this listener was bound to.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Accepts one connection if one is queued, without waiting: `Ok(None)` when the
    /// queue is empty. Errors are returned as they are.
    pub fn try_accept(&self) -> io::Result<Option<(Conn, Peer)>> {
        match socket::accept4(
            self.fd.get_ref().as_raw_fd(),
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        ) {
            Ok(raw) => {
                // SAFETY: accept4 just returned this descriptor and nothing else owns it.
                let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                // accept4 made it non-blocking, and its family is the listener's. A Unix
                // peer has no address worth a `getpeername`.
                let (family, peer) = match &self.endpoint {
                    Endpoint::Unix(_) => (AddressFamily::Unix, Peer::Unix),
                    Endpoint::Vsock { .. } => (AddressFamily::Vsock, peer_of(&fd)),
                    Endpoint::Tcp(a) if a.is_ipv4() => (AddressFamily::Inet, peer_of(&fd)),
                    Endpoint::Tcp(_) => (AddressFamily::Inet6, peer_of(&fd)),
                };
                Ok(Some((Conn::from_accepted(fd, family)?, peer)))
            }
            Err(nix::errno::Errno::EAGAIN) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Accepts one connection, waiting for one. Errors are returned as they are
    /// (`EMFILE`, `ENFILE`, `ENOBUFS`, `ECONNABORTED`...): the caller's accept loop
    /// ([`crate::accept`]) decides whether to back off; nothing here ends a loop.
    pub async fn accept(&self) -> io::Result<(Conn, Peer)> {
        loop {
            let mut guard = self.fd.readable().await?;
            let accepted = guard.try_io(|_| {
                self.try_accept()?
                    .ok_or_else(|| io::ErrorKind::WouldBlock.into())
            });
            match accepted {
                Ok(r) => return r,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::time::Duration;

    /// Connects non-blocking, as Python with a timeout, Go, Node and asyncio do, until the
    /// kernel says the queue is full (`EAGAIN`) or `max` connections are queued.
    pub(crate) fn queue_nonblocking(path: &Path, max: usize) -> (Vec<OwnedFd>, Option<io::Error>) {
        let mut held = Vec::new();
        let addr = socket::UnixAddr::new(path).unwrap();
        while held.len() < max {
            let fd = socket::socket(
                AddressFamily::Unix,
                socket::SockType::Stream,
                SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
                None,
            )
            .unwrap();
            match socket::connect(fd.as_raw_fd(), &addr) {
                Ok(()) => held.push(fd),
                Err(e) => return (held, Some(e.into())),
            }
        }
        (held, None)
    }

    #[test]
    fn a_paused_listener_queues_thousands_of_nonblocking_connects() {
        crate::fdlimit::raise_fd_limit().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let ep = Endpoint::Unix(path.clone());
        // No runtime, nobody accepting: the kernel's queue is all there is.
        let fd = ep.bind().unwrap();
        listen_on(&fd).unwrap();
        let (held, err) = queue_nonblocking(&path, 2000);
        assert_eq!(
            held.len(),
            2000,
            "the kernel refused non-blocking connect number {} ({:?}): the listen backlog \
             is smaller than the {BACKLOG} asked for",
            held.len() + 1,
            err
        );
    }

    #[tokio::test]
    async fn a_full_backlog_makes_connect_wait_as_a_blocking_connect_would() {
        let dir = tempfile::tempdir().unwrap();
        let ep = Endpoint::Unix(dir.path().join("s"));
        let fd = ep.bind().unwrap();
        listen_with_backlog(&fd, 1).unwrap();
        let l = Listener::from_listening_fd(fd, ep.clone()).unwrap();
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
        let l = listen(&ep).unwrap();
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
