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
use std::sync::OnceLock;
use std::task::{ready, Context, Poll};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{self, AddressFamily, MsgFlags, SockaddrLike};
use tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};
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
/// **Writes are tried, not waited for; only reads are watched.** The socket is registered
/// for readability alone. A stream socket's `EPOLLOUT` is edge-triggered by every bit of
/// room the peer makes, so a socket registered for writability wakes its process each
/// time the peer reads what was sent: one wake-up for nothing per message and hop, as
/// many as the wake-ups that carry data (the system-call trace of a relayed echo in
/// `docs/BENCHMARKS.md` showed them). Instead a write is simply tried; only when one finds
/// the socket full (`EAGAIN`) is a duplicate of the descriptor registered for
/// writability, kept from then on, and waited on until a write goes through
/// ([`Conn::write_with`]). Until a write has found the socket full, [`Conn::writable`]
/// returns at once. This also means no reactor turn before a new connection's first byte:
/// tokio learns a new descriptor's readiness only from the reactor's next `epoll_wait`,
/// and an established socket can take data at once.
///
/// **No reactor turn before the first read either.** A `recv` that finds nothing says so
/// with `EAGAIN`, so [`Conn::read_pooled`] tries once before it waits, the first time, on
/// an accepted connection (whose caller has usually sent by then).
///
/// **No `EAGAIN` after a short read.** A stream `recv` (Unix, vsock, TCP) copies from
/// the receive queue until the buffer is full or the queue is empty, so a read that
/// returns less than the buffer's room has emptied the queue: the readiness is cleared
/// there, as tokio's own streams do, instead of by one more `recv` that fails with
/// `EAGAIN` (one system call per message and hop: the setup profile in
/// `docs/BENCHMARKS.md` counted them). Bytes or an end that arrive after the `recv` are a
/// newer readiness event, which clearing the one observed does not remove, and tokio
/// never clears the closed state.
#[derive(Debug)]
pub struct Conn {
    /// The socket, registered for readability only.
    fd: AsyncFd<OwnedFd>,
    /// A duplicate of the socket registered for writability, made the first time a write
    /// finds the socket full and kept from then on. Boxed: most connections never need
    /// one, and every byte of a `Conn` counts thousands of times in a burst.
    write_watch: OnceLock<Box<AsyncFd<OwnedFd>>>,
    /// The last write found the socket full, and none has gone through since.
    full: AtomicBool,
    /// The most bytes one `send` may carry ([`send_limit`]), kept in 32 bits: a `Conn`
    /// exists thousands of times over in a burst.
    max_send: u32,
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
    /// the caller knows (it just accepted it, as a stream socket): three system calls
    /// fewer per connection than [`Conn::from_owned`].
    pub(crate) fn from_accepted(fd: OwnedFd, family: AddressFamily) -> io::Result<Self> {
        let max_send = if family == AddressFamily::Vsock {
            VSOCK_MAX_SEND
        } else {
            usize::MAX
        };
        Conn::register(fd, max_send, family == AddressFamily::Unix)
    }

    /// [`Conn::from_accepted`] for a socket this process just dialled. Its first read
    /// waits for a readiness report instead of trying at once: a caller has usually sent
    /// its first bytes by the time it is accepted, but a service that has only just
    /// accepted cannot have answered yet, so trying would only cost an `EAGAIN`.
    pub(crate) fn from_dialled(fd: OwnedFd, family: AddressFamily) -> io::Result<Self> {
        let conn = Conn::from_accepted(fd, family)?;
        conn.unread.store(false, Ordering::Relaxed);
        Ok(conn)
    }

    fn register(fd: OwnedFd, max_send: usize, splices: bool) -> io::Result<Self> {
        let max_send = u32::try_from(max_send).unwrap_or(u32::MAX);
        Ok(Conn {
            fd: register(fd, Interest::READABLE)?,
            write_watch: OnceLock::new(),
            full: AtomicBool::new(false),
            max_send,
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

    /// Whether nothing had been read yet; from now on, something has.
    pub(crate) fn take_unread(&self) -> bool {
        self.unread.swap(false, Ordering::Relaxed)
    }

    /// Waits for a non-blocking connect in progress to finish, and reports its outcome.
    /// It watches a duplicate registered for writability only while it waits (see
    /// [`watch`]), so the connection does not keep waking on room once established.
    pub(crate) async fn connected(&self) -> io::Result<()> {
        watch(self.fd.get_ref(), Interest::WRITABLE)?
            .writable()
            .await?
            .retain_ready();
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
                Ok(Ok(n)) => {
                    if n > 0 && n < buf.len() {
                        // A short read emptied the receive queue (see the type's docs).
                        guard.clear_ready();
                    }
                    return Ok(n);
                }
                Ok(Err(e)) => return Err(e),
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
            let room = buf.spare_mut().len();
            match guard.try_io(|fd| recv(fd.get_ref().as_fd(), buf.spare_mut())) {
                Ok(Ok(0)) => return Ok(None),
                Ok(Ok(n)) => {
                    if n < room {
                        // A short read emptied the receive queue (see the type's
                        // documentation): wait for the kernel's next report rather than
                        // learn it from an `EAGAIN`.
                        guard.clear_ready();
                    }
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
    /// why): at once unless the last write found it full, else until the kernel reports
    /// room. The readiness is kept, so a `write_all` right after sends without waiting.
    pub async fn writable(&self) -> io::Result<()> {
        if !self.full.load(Ordering::Relaxed) {
            return Ok(());
        }
        self.write_watch()?.writable().await.map(drop)
    }

    /// Writes with `op` (a `send`, or a `splice` into this socket) and returns what it
    /// returns: at once unless the last write found the socket full; after an `EAGAIN`,
    /// once the kernel reports room (see the type's documentation).
    pub(crate) async fn write_with(
        &self,
        mut op: impl FnMut(BorrowedFd<'_>) -> io::Result<usize>,
    ) -> io::Result<usize> {
        if let Some(done) = self.try_write(&mut op) {
            return done;
        }
        let watch = self.write_watch()?;
        loop {
            let mut guard = watch.writable().await?;
            if let Some(done) = self.write_on_room(&mut guard, &mut op) {
                return done;
            }
        }
    }

    /// The write tried at once: its outcome, or `None` when the socket is known full or
    /// the write found it full (it is marked so), and the caller must wait for room.
    fn try_write(
        &self,
        op: &mut impl FnMut(BorrowedFd<'_>) -> io::Result<usize>,
    ) -> Option<io::Result<usize>> {
        if self.full.load(Ordering::Relaxed) {
            return None;
        }
        match op(self.as_fd()) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.full.store(true, Ordering::Relaxed);
                None
            }
            done => Some(done),
        }
    }

    /// The write tried once the write watch reported room: its outcome, or `None` (and
    /// the report cleared) when the room was gone again.
    fn write_on_room(
        &self,
        guard: &mut AsyncFdReadyGuard<'_, OwnedFd>,
        op: &mut impl FnMut(BorrowedFd<'_>) -> io::Result<usize>,
    ) -> Option<io::Result<usize>> {
        let done = guard.try_io(|_| op(self.as_fd())).ok()?;
        self.full.store(false, Ordering::Relaxed);
        Some(done)
    }

    /// The duplicate registered for writability, made on first use.
    fn write_watch(&self) -> io::Result<&AsyncFd<OwnedFd>> {
        if let Some(w) = self.write_watch.get() {
            return Ok(w);
        }
        let w = Box::new(watch(self.fd.get_ref(), Interest::WRITABLE)?);
        Ok(self.write_watch.get_or_init(|| w))
    }

    /// Writes all of `buf` before returning, waiting for the peer as needed.
    pub async fn write_all(&self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            let part = &buf[..buf.len().min(self.max_send as usize)];
            match self.write_with(|fd| send(fd, part)).await? {
                0 => return Err(io::ErrorKind::WriteZero.into()),
                n => buf = &buf[n..],
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
        let watch = watch(self.fd.get_ref(), Interest::WRITABLE)?;
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

    /// Whether the peer has closed the connection entirely (`POLLHUP`), asked of the
    /// kernel now, without waiting: [`Conn::peer_gone`] without the reactor turn, for the
    /// moment a direction ends.
    pub fn hung_up(&self) -> bool {
        let mut fds = [PollFd::new(self.as_fd(), PollFlags::empty())];
        matches!(poll(&mut fds, PollTimeout::ZERO), Ok(1))
            && fds[0]
                .revents()
                .is_some_and(|r| r.contains(PollFlags::POLLHUP))
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

/// A duplicate of `fd` registered with `interest` on its own: waiting on it never takes
/// readiness away from the connection's own registration, and dropping it deregisters
/// and closes only the duplicate.
fn watch(fd: &OwnedFd, interest: Interest) -> io::Result<AsyncFd<OwnedFd>> {
    register(fd.try_clone()?, interest)
}

fn recv(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    #[cfg(test)]
    tests::RECVS.with(|n| n.set(n.get() + 1));
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
        // `Conn::write_with`, as a poll.
        let part = &buf[..buf.len().min(self.max_send as usize)];
        let mut op = |fd: BorrowedFd<'_>| send(fd, part);
        if let Some(done) = self.try_write(&mut op) {
            return Poll::Ready(done);
        }
        let watch = self.write_watch()?;
        loop {
            let mut guard = ready!(watch.poll_write_ready(cx))?;
            if let Some(done) = self.write_on_room(&mut guard, &mut op) {
                return Poll::Ready(done);
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
mod tests;
