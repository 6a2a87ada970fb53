//! One connected stream socket, whatever its transport.
//!
//! Every accepted or dialled connection (Unix, vsock, TCP) becomes a [`Conn`]: a
//! non-blocking socket descriptor registered with tokio. One descriptor type instead of
//! tokio's three stream types, because the pump ([`crate::pump`]) waits for readiness
//! *before* it takes a buffer, so an idle connection holds no buffer at all, and it can
//! move bytes with `splice(2)` later; both need the raw descriptor. With one type the
//! pump, the filters and the admission code are written once.
//!
//! Writes use `MSG_NOSIGNAL`: a vanished peer is an `EPIPE` for that one connection,
//! never a `SIGPIPE` for the whole process (which, for PID 1, would be fatal).
//!
//! On a vsock socket each `send` carries at most [`VSOCK_MAX_SEND`] bytes. The guest
//! kernel turns one `send` into packets of up to 64 KiB, and since the 2025 change
//! "vsock/virtio: Allocate nonlinear SKBs for handling large transmit buffers" (in Linux
//! 6.17 and Debian's 6.12 kernels) a packet over about 32 KiB leaves the guest split over
//! several virtqueue descriptors. Device back ends that expect a header and one data
//! descriptor, vhost-device-vsock 0.3.0 among them, drop such a packet
//! (`DescriptorLengthTooSmall`) and the connection stalls. Sends of 16 KiB stay in one
//! descriptor on every kernel, cost a few more system calls per 64 KiB chunk, and change
//! nothing the peer sees: a stream has no message boundaries to keep.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{ready, Context, Poll};

use nix::sys::socket::{self, AddressFamily, MsgFlags, SockaddrLike};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use crate::pool::PooledBuf;

/// The most bytes one `send` puts on a vsock socket (see the module documentation).
pub const VSOCK_MAX_SEND: usize = 16 * 1024;

/// How many bytes one `send` on `fd` may carry: [`VSOCK_MAX_SEND`] for vsock, else no
/// limit.
fn send_limit(fd: &OwnedFd) -> usize {
    if family(fd) == Some(AddressFamily::Vsock) {
        VSOCK_MAX_SEND
    } else {
        usize::MAX
    }
}

/// The address family of a socket.
fn family(fd: &OwnedFd) -> Option<AddressFamily> {
    socket::getsockname::<socket::SockaddrStorage>(fd.as_raw_fd())
        .ok()
        .and_then(|a| a.family())
}

/// Registers a descriptor with the tokio reactor.
pub(crate) fn register(fd: OwnedFd, interest: Interest) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an `OwnedFd` is an open descriptor that it alone closes, and `as_raw_fd`
    // returns the same number for its whole life; the `AsyncFd` takes ownership of it, so
    // the descriptor stays open and unchanged until the `AsyncFd` is dropped or unwrapped.
    Ok(unsafe { AsyncFd::register_with_interest(fd, interest) }?)
}

/// Sets `O_NONBLOCK` on a descriptor, keeping its other status flags.
pub(crate) fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL)?;
    let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFL(flags))?;
    Ok(())
}

/// One connected stream socket: non-blocking, registered with tokio, closed on drop.
///
/// It implements [`AsyncRead`] and [`AsyncWrite`] for ordinary protocol code; the pump uses
/// its readiness methods directly so that it holds no buffer while a connection is idle.
///
/// **No reactor turn before the first byte.** tokio learns a new descriptor's readiness
/// only from the reactor's next `epoll_wait`, so a connection that waited for readiness
/// before its first `send` and its first `recv` would spend a turn of the event loop per
/// new connection before any byte could move (the profile of connection setup showed it:
/// see `docs/BENCHMARKS.md`). Two facts the kernel guarantees make that wait unnecessary:
/// an established stream socket on which nothing has been sent has an empty send queue,
/// so it can take data ([`Conn::writable`] returns at once until the first write), and a
/// `recv` that finds nothing says so with `EAGAIN` ([`Conn::read_pooled`] tries once
/// before it waits, the first time).
#[derive(Debug)]
pub struct Conn {
    fd: AsyncFd<OwnedFd>,
    /// The most bytes one `send` may carry ([`send_limit`]).
    max_send: usize,
    /// Established, and nothing has been written on it yet: its send queue is empty.
    unwritten: AtomicBool,
    /// Nothing has been read from it yet: the first read tries before it waits.
    unread: AtomicBool,
    /// A Unix stream socket: the pump may `splice` to and from it ([`crate::splice`]).
    splices: bool,
}

impl Conn {
    /// Registers a connected stream socket. It is switched to non-blocking mode.
    pub fn from_owned(fd: OwnedFd) -> io::Result<Self> {
        set_nonblocking(&fd)?;
        let max_send = send_limit(&fd);
        let splices = family(&fd) == Some(AddressFamily::Unix)
            && socket::getsockopt(&fd, socket::sockopt::SockType).ok()
                == Some(socket::SockType::Stream);
        Conn::register(fd, max_send, splices)
    }

    /// Registers a connected stream socket that is already non-blocking and whose family
    /// the caller knows (it just accepted or dialled it, as a stream socket): three system
    /// calls fewer per connection than [`Conn::from_owned`].
    pub(crate) fn from_nonblocking(fd: OwnedFd, family: AddressFamily) -> io::Result<Self> {
        let max_send = if family == AddressFamily::Vsock {
            VSOCK_MAX_SEND
        } else {
            usize::MAX
        };
        Conn::register(fd, max_send, family == AddressFamily::Unix)
    }

    fn register(fd: OwnedFd, max_send: usize, splices: bool) -> io::Result<Self> {
        Ok(Conn {
            fd: register(fd, Interest::READABLE | Interest::WRITABLE)?,
            max_send,
            unwritten: AtomicBool::new(true),
            unread: AtomicBool::new(true),
            splices,
        })
    }

    /// Whether this is a Unix stream socket, which the pump may `splice` to and from.
    pub fn splices(&self) -> bool {
        self.splices
    }

    /// The registered descriptor, for [`crate::splice`].
    pub(crate) fn async_fd(&self) -> &AsyncFd<OwnedFd> {
        &self.fd
    }

    /// Whether nothing had been written yet; from now on, something has.
    pub(crate) fn take_unwritten(&self) -> bool {
        self.unwritten.swap(false, Ordering::Relaxed)
    }

    /// Whether nothing had been read yet; from now on, something has.
    pub(crate) fn take_unread(&self) -> bool {
        self.unread.swap(false, Ordering::Relaxed)
    }

    /// Waits for a non-blocking connect in progress to finish, and reports its outcome.
    pub(crate) async fn connected(&self) -> io::Result<()> {
        self.fd.writable().await?.retain_ready();
        let err: i32 = socket::getsockopt(self.fd.get_ref(), socket::sockopt::SocketError)?;
        if err != 0 {
            return Err(io::Error::from_raw_os_error(err));
        }
        Ok(())
    }

    /// A connected pair of `AF_UNIX` `SOCK_SEQPACKET` sockets. Every `send` is one record
    /// and every `recv` returns one, so a chunk written in two calls is seen as two reads,
    /// where stream reads coalesce whatever has arrived. For tests that must see how a
    /// relay writes.
    pub fn seqpacket_pair() -> io::Result<(Conn, Conn)> {
        let (a, b) = socket::socketpair(
            socket::AddressFamily::Unix,
            socket::SockType::SeqPacket,
            None,
            socket::SockFlag::SOCK_CLOEXEC | socket::SockFlag::SOCK_NONBLOCK,
        )?;
        Ok((Conn::from_owned(a)?, Conn::from_owned(b)?))
    }

    /// Registers a connected standard-library Unix stream.
    pub fn from_std_unix(s: std::os::unix::net::UnixStream) -> io::Result<Self> {
        Conn::from_owned(OwnedFd::from(s))
    }

    /// Reads once: waits until the socket is readable, then returns what one `recv` gives.
    /// `Ok(0)` is end of stream.
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.unread.store(false, Ordering::Relaxed);
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
        if self.take_unread() {
            // The first read: try before waiting (see the type's documentation).
            let mut buf = PooledBuf::take();
            match recv(self.as_fd(), buf.spare_mut()) {
                Ok(0) => return Ok(None),
                Ok(n) => {
                    buf.set_len(n);
                    return Ok(Some(buf));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
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
    /// A connection on which nothing has been written yet can: it returns at once.
    pub async fn writable(&self) -> io::Result<()> {
        if self.unwritten.load(Ordering::Relaxed) {
            return Ok(());
        }
        self.fd.writable().await.map(drop)
    }

    /// Writes all of `buf` before returning, waiting for the peer as needed.
    pub async fn write_all(&self, mut buf: &[u8]) -> io::Result<()> {
        if !buf.is_empty() && self.take_unwritten() {
            // The first write: the send queue is empty, so send before waiting.
            let part = &buf[..buf.len().min(self.max_send)];
            match send(self.as_fd(), part) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        while !buf.is_empty() {
            let mut guard = self.fd.writable().await?;
            let part = &buf[..buf.len().min(self.max_send)];
            match guard.try_io(|fd| send(fd.get_ref().as_fd(), part)) {
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

    /// Waits until the peer has closed the connection entirely (`EPOLLHUP`: nothing
    /// written here can ever be read again), as opposed to a half-close, after which the
    /// peer may still read. Used once the other direction has ended, so that a relay
    /// whose far end has gone stops waiting for data nobody can receive.
    ///
    /// It watches a duplicate of the descriptor, registered on its own, so waiting here
    /// never takes readiness away from this connection's own reads and writes.
    pub async fn peer_gone(&self) -> io::Result<()> {
        let dup = self.fd.get_ref().try_clone()?;
        let watch = register(dup, Interest::WRITABLE)?;
        loop {
            let mut guard = watch.writable().await?;
            if guard.ready().is_write_closed() {
                return Ok(());
            }
            // Writable but still connected: wait for the next change of state. The
            // closed state, once it comes, is never cleared, so it cannot be missed.
            guard.clear_ready();
        }
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
        self.unread.store(false, Ordering::Relaxed);
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
        self.unwritten.store(false, Ordering::Relaxed);
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            let part = &buf[..buf.len().min(self.max_send)];
            match guard.try_io(|fd| send(fd.get_ref().as_fd(), part)) {
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
    use crate::endpoint::Endpoint;
    use std::future::Future;

    /// Polls a future once: its output if it completed without waiting for anything (in
    /// particular, without a turn of the reactor), else `None`.
    fn first_poll<F: Future>(f: F) -> Option<F::Output> {
        let mut f = std::pin::pin!(f);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match f.as_mut().poll(&mut cx) {
            Poll::Ready(v) => Some(v),
            Poll::Pending => None,
        }
    }

    /// A new connection's first bytes move in the same turn of the event loop that made
    /// it: the dial completes in the call, the first write needs no writability report and
    /// the first read no readability report. (Waiting for either costs a reactor turn per
    /// connection; the benchmark's connection setup figure showed it.)
    #[tokio::test]
    async fn a_new_connection_moves_bytes_without_a_reactor_turn() {
        let dir = tempfile::tempdir().unwrap();
        let ep = Endpoint::Unix(dir.path().join("s"));
        let l = ep.listen().unwrap();
        let client = first_poll(ep.connect())
            .expect("a Unix connect completes in the call")
            .unwrap();
        first_poll(client.writable())
            .expect("nothing written yet: writable at once")
            .unwrap();
        first_poll(client.write_all(b"first"))
            .expect("the first write waited for the reactor")
            .unwrap();
        let (server, _) = l.try_accept().unwrap().expect("the connection is queued");
        let chunk = first_poll(server.read_pooled())
            .expect("the first read waited for the reactor")
            .unwrap()
            .unwrap();
        assert_eq!(&chunk[..], b"first");
        // Once something was written, writability is the reactor's to report again.
        assert!(
            first_poll(server.write_all(b"x")).is_some(),
            "the server's first write"
        );
        let mut buf = [0u8; 8];
        assert_eq!(client.read(&mut buf).await.unwrap(), 1);
    }

    /// The shortcut is for the first read only, and an empty socket still waits.
    #[tokio::test]
    async fn a_first_read_with_nothing_queued_waits() {
        let (a, b) = Conn::seqpacket_pair().unwrap();
        let read = a.read_pooled();
        let mut read = std::pin::pin!(read);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(read.as_mut().poll(&mut cx).is_pending());
        b.write_all(b"late").await.unwrap();
        let chunk = read.await.unwrap().unwrap();
        assert_eq!(&chunk[..], b"late");
    }

    #[test]
    fn only_vsock_sends_are_capped() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(send_limit(&OwnedFd::from(a)), usize::MAX);
        match socket::socket(
            socket::AddressFamily::Vsock,
            socket::SockType::Stream,
            socket::SockFlag::empty(),
            None,
        ) {
            Ok(fd) => assert_eq!(send_limit(&fd), VSOCK_MAX_SEND),
            // The VM tests cover vsock where the host has no AF_VSOCK.
            Err(e) => eprintln!("no AF_VSOCK on this host ({e}); vsock half not run"),
        }
    }
}
