//! The echo service every path ends at.
//!
//! All three paths (direct, chain, socat chain) end at this same service, so a difference
//! between paths is the cost of the hops and nothing else. It is deliberately plain and
//! fast: blocking sockets, one thread per connection (a small stack, one 64 KiB heap
//! buffer), so the service costs the same on every path and never becomes the
//! bottleneck being measured.
//!
//! The listener is created with a 4,096 backlog (the kernel's `somaxconn` here) instead of
//! the standard library's 128: a burst of 5,000 connects would otherwise be throttled by
//! the service rather than by the path under test. When the process runs out of
//! descriptors (`EMFILE`) the accept loop waits briefly and retries; it never ends, so one
//! bad moment costs latency, not the rest of the run.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};

/// Binds a Unix stream listener at `path` with the 4096 backlog of
/// [`vm_transport::listener`] (not nix's `Backlog`, which refuses anything above 128).
pub fn listen(path: &Path) -> io::Result<UnixListener> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    socket::bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    vm_transport::listener::listen_on(&fd)?;
    Ok(UnixListener::from(fd))
}

/// Connects to a Unix socket; the connect, and later reads and writes, give up after
/// `timeout` (a full backlog makes a blocking Unix connect wait, and a broken path must
/// end as a counted failure, never as a hung benchmark).
pub fn connect(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let tv = nix::sys::time::TimeVal::new(timeout.as_secs() as _, timeout.subsec_micros() as _);
    socket::setsockopt(&fd, socket::sockopt::SendTimeout, &tv)?;
    socket::setsockopt(&fd, socket::sockopt::ReceiveTimeout, &tv)?;
    socket::connect(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    // SAFETY: `into_raw_fd` gives up ownership of an open, connected socket, which the
    // new `OwnedFd` alone now owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd.into_raw_fd()) };
    Ok(UnixStream::from(fd))
}

/// A running echo service.
#[derive(Debug)]
pub struct EchoServer {
    path: PathBuf,
}

impl EchoServer {
    /// Starts the service at `path`; it runs until the process exits.
    pub fn start(path: &Path) -> io::Result<Self> {
        let listener = listen(path)?;
        std::thread::Builder::new()
            .name("echo-accept".into())
            .spawn(move || accept_loop(listener))?;
        Ok(EchoServer {
            path: path.to_path_buf(),
        })
    }

    /// Where clients connect.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn accept_loop(listener: UnixListener) {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                let spawned = std::thread::Builder::new()
                    .stack_size(128 * 1024)
                    .spawn(move || echo(stream));
                if spawned.is_err() {
                    // Out of threads: this one connection is dropped (its client counts a
                    // failure); the loop goes on.
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

fn echo(mut stream: UnixStream) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if stream.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echoes_bytes_back() {
        let dir = tempfile::tempdir().unwrap();
        let s = EchoServer::start(&dir.path().join("echo")).unwrap();
        let mut c = connect(s.path(), Duration::from_secs(5)).unwrap();
        c.write_all(b"ping").unwrap();
        let mut b = [0u8; 4];
        c.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"ping");
    }
}
