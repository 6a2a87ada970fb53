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
use std::task::{ready, Context, Poll};

use nix::sys::socket::{self, MsgFlags, SockaddrLike};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use crate::pool::PooledBuf;

/// The most bytes one `send` puts on a vsock socket (see the module documentation).
pub const VSOCK_MAX_SEND: usize = 16 * 1024;

/// How many bytes one `send` on `fd` may carry: [`VSOCK_MAX_SEND`] for vsock, else no
/// limit.
fn send_limit(fd: &OwnedFd) -> usize {
    let family = socket::getsockname::<socket::SockaddrStorage>(fd.as_raw_fd())
        .ok()
        .and_then(|a| a.family());
    if family == Some(socket::AddressFamily::Vsock) {
        VSOCK_MAX_SEND
    } else {
        usize::MAX
    }
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
#[derive(Debug)]
pub struct Conn {
    fd: AsyncFd<OwnedFd>,
    /// The most bytes one `send` may carry ([`send_limit`]).
    max_send: usize,
}

impl Conn {
    /// Registers a connected stream socket. It is switched to non-blocking mode.
    pub fn from_owned(fd: OwnedFd) -> io::Result<Self> {
        set_nonblocking(&fd)?;
        let max_send = send_limit(&fd);
        Ok(Conn {
            fd: register(fd, Interest::READABLE | Interest::WRITABLE)?,
            max_send,
        })
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
