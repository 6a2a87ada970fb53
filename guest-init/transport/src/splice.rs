//! `splice(2)` between two Unix stream sockets: the pump's copy-free path.
//!
//! Where both ends of a direction are Unix stream sockets (the host relay's hybrid-vsock
//! socket and its service, the forwarder's app socket and a Unix target) and the flow is
//! a bulk one (a read filled a whole pooled buffer), the pump moves the rest of it
//! socket → pipe → socket with `splice`, and the bytes never enter our address space.
//! Since Linux 6.5 a splice into a Unix socket hands the pipe's pages over
//! (`MSG_SPLICE_PAGES`), and a splice out of one takes the pages of the sender's
//! buffers, so a relayed chunk costs page references, not two copies of the bytes.
//! Vsock is left on the buffered path: the guest kernel's vsock has no `splice_read`
//! (it would copy anyway), and a splice into it builds packets as large as the pipe's
//! pages allow, which the 16 KiB send limit of [`crate::conn`] exists to prevent.
//!
//! The contract of [`crate::pump`] holds unchanged:
//! - **Byte-exact, one chunk whole.** What one `splice` takes from the source is spliced
//!   out in full, in order, before the next is taken.
//! - **Idle or blocked costs no pipe.** The direction waits for its destination, then for
//!   its source, and only then takes a pipe from a shared pool; an empty pipe goes back
//!   at once. A pipe stays out only while a chunk is in flight, and across a wait only
//!   when the destination took part of one, as a buffer does on the buffered path. Each
//!   pipe is two descriptors; the pool keeps at most [`PIPES_KEEP`] free ones, and when
//!   no pipe can be made (out of descriptors) the chunk goes through a pooled buffer
//!   instead, so a splice never fails a connection the buffered path would carry.
//! - **Chunks adapt.** A direction starts at [`CHUNK_MIN`] per splice; while the source
//!   keeps filling whole chunks (a bulk flow) the chunk doubles up to [`CHUNK_MAX`],
//!   growing the pipe as needed, and it drops back as soon as a splice comes up short.
//!   Pipes hold pages only while bytes are in them, so a large pipe in the pool costs
//!   no memory.
//! - **Errors.** A vanished peer is `EPIPE` (Rust ignores `SIGPIPE`, and PID 1 never
//!   gets signals it has no handler for), ending that direction only.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;

use nix::fcntl::{self, FcntlArg, OFlag, SpliceFFlags};

use crate::conn::Conn;

/// The first chunk of every direction, and the default capacity of a pipe (16 pages).
pub const CHUNK_MIN: usize = 64 * 1024;
/// The largest chunk a bulk flow grows to.
pub const CHUNK_MAX: usize = 512 * 1024;
/// How many free pipes the pool keeps (two descriptors each).
pub const PIPES_KEEP: usize = 16;

/// A pipe's two ends and its capacity.
#[derive(Debug)]
struct Ends {
    read: OwnedFd,
    write: OwnedFd,
    capacity: usize,
}

static PIPES: Mutex<Vec<Ends>> = Mutex::new(Vec::new());

/// A pipe on loan from the pool. It returns there when dropped empty; a pipe that still
/// holds bytes (its direction ended in an error) is closed instead.
#[derive(Debug)]
pub(crate) struct Pipe {
    ends: Option<Ends>,
    /// Bytes in the pipe now.
    held: usize,
}

impl Pipe {
    /// Takes a free pipe from the pool, or makes one.
    fn take() -> io::Result<Pipe> {
        let reused = PIPES.lock().ok().and_then(|mut p| p.pop());
        let ends = match reused {
            Some(e) => e,
            None => {
                let (read, write) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
                Ends {
                    read,
                    write,
                    capacity: CHUNK_MIN,
                }
            }
        };
        Ok(Pipe {
            ends: Some(ends),
            held: 0,
        })
    }

    /// Grows the pipe to hold `want` bytes if it can; returns what it holds.
    fn reserve(&mut self, want: usize) -> usize {
        let Some(e) = self.ends.as_mut() else {
            return 0;
        };
        if e.capacity < want {
            let size = i32::try_from(want).unwrap_or(i32::MAX);
            if let Ok(got) = fcntl::fcntl(&e.write, FcntlArg::F_SETPIPE_SZ(size)) {
                e.capacity = usize::try_from(got).unwrap_or(e.capacity);
            }
        }
        e.capacity
    }

    fn ends(&self) -> io::Result<&Ends> {
        self.ends
            .as_ref()
            .ok_or_else(|| io::Error::other("pipe already returned"))
    }
}

impl Drop for Pipe {
    fn drop(&mut self) {
        if let (Some(ends), 0) = (self.ends.take(), self.held) {
            if let Ok(mut pool) = PIPES.lock() {
                if pool.len() < PIPES_KEEP {
                    pool.push(ends);
                }
            }
        }
    }
}

/// Number of free pipes in the pool now (for tests and diagnostics).
pub fn pipes_free() -> usize {
    PIPES.lock().map(|p| p.len()).unwrap_or(0)
}

fn splice(from: impl AsFd, to: impl AsFd, len: usize) -> io::Result<usize> {
    Ok(fcntl::splice(
        from,
        None,
        to,
        None,
        len,
        SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK,
    )?)
}

/// Copies one direction between two Unix stream sockets until end of stream or an error
/// (the caller half-closes `to`). Returns the bytes moved.
pub(crate) async fn copy(from: &Conn, to: &Conn) -> io::Result<u64> {
    let mut total = 0u64;
    let mut chunk = CHUNK_MIN;
    loop {
        // Destination first, so nothing is taken before it can be written.
        to.writable().await?;
        let (pipe, n) = match splice_in(from, chunk).await? {
            In::End => return Ok(total),
            In::Pipe(pipe, n) => (pipe, n),
            In::Buffered(buf) => {
                // No pipe could be made: this chunk goes through a pooled buffer.
                to.write_all(&buf).await?;
                total += buf.len() as u64;
                continue;
            }
        };
        splice_out(pipe, to).await?;
        total += n as u64;
        chunk = if n >= chunk {
            (chunk * 2).min(CHUNK_MAX)
        } else {
            CHUNK_MIN
        };
    }
}

/// What one read of the source gave.
enum In {
    End,
    Pipe(Pipe, usize),
    Buffered(crate::pool::PooledBuf),
}

/// Waits until the source has data (or has ended), then takes a pipe and splices up to
/// `chunk` bytes into it.
async fn splice_in(from: &Conn, chunk: usize) -> io::Result<In> {
    if from.take_unread() {
        // The first read tries before it waits (see `Conn`).
        if let Ok(mut pipe) = Pipe::take() {
            let len = chunk.min(pipe.reserve(chunk));
            match splice(from, &pipe.ends()?.write, len) {
                Ok(0) => return Ok(In::End),
                Ok(n) => {
                    pipe.held = n;
                    return Ok(In::Pipe(pipe, n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    }
    loop {
        let mut guard = from.async_fd().readable().await?;
        let mut pipe = match Pipe::take() {
            Ok(p) => p,
            Err(_) => {
                drop(guard);
                return Ok(match from.read_pooled().await? {
                    Some(buf) => In::Buffered(buf),
                    None => In::End,
                });
            }
        };
        let len = chunk.min(pipe.reserve(chunk));
        let write_end = &pipe.ends()?.write;
        match guard.try_io(|fd| splice(fd.get_ref(), write_end, len)) {
            Ok(Ok(0)) => return Ok(In::End),
            Ok(Ok(n)) => {
                pipe.held = n;
                return Ok(In::Pipe(pipe, n));
            }
            Ok(Err(e)) => return Err(e),
            // Nothing after all: the pipe goes back to the pool; wait again.
            Err(_would_block) => continue,
        }
    }
}

/// Splices everything in `pipe` into `to`, waiting for room as needed.
async fn splice_out(mut pipe: Pipe, to: &Conn) -> io::Result<()> {
    while pipe.held > 0 {
        let held = pipe.held;
        let read_end = &pipe.ends()?.read;
        match to.write_with(|fd| splice(read_end, fd, held)).await? {
            0 => return Err(io::ErrorKind::WriteZero.into()),
            n => pipe.held -= n,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::pair;
    use std::time::Duration;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len as u32).map(|i| (i * 31 % 253) as u8).collect()
    }

    #[tokio::test]
    async fn only_unix_streams_splice() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = pair(dir.path(), "s").await;
        assert!(a.splices() && b.splices());
        let (std_a, _std_b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(Conn::from_std_unix(std_a).unwrap().splices());
        let (p, q) = Conn::seqpacket_pair().unwrap();
        assert!(
            !p.splices() && !q.splices(),
            "records must keep their boundaries"
        );
    }

    /// A destination that reads slowly, in small pieces, takes each chunk in many partial
    /// splices; every byte still arrives once, in order, and the end is passed on.
    #[tokio::test]
    async fn partial_writes_deliver_every_byte_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let (client, relay_a) = pair(dir.path(), "a").await;
        let (relay_b, server) = pair(dir.path(), "b").await;
        let pump = tokio::spawn(async move { copy(&relay_a, &relay_b).await });
        let data = pattern(3 << 20);
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            client.write_all(&sent).await.unwrap();
            client.shutdown_write().unwrap();
            client
        });
        let mut got = Vec::new();
        let mut buf = vec![0u8; 7000];
        loop {
            let n = server.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            if got.len() % 5 == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        assert_eq!(got.len(), data.len());
        assert!(got == data, "bytes changed or reordered on the splice path");
        assert_eq!(pump.await.unwrap().unwrap(), data.len() as u64);
        drop(writer.await.unwrap());
    }

    /// The destination's peer is gone: the direction ends with an error (no signal, no
    /// hang), and the pipe that still held bytes is not returned to the pool dirty.
    #[tokio::test]
    async fn a_vanished_destination_ends_the_direction_with_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (client, relay_a) = pair(dir.path(), "a").await;
        let (relay_b, server) = pair(dir.path(), "b").await;
        drop(server);
        let pump = tokio::spawn(async move { copy(&relay_a, &relay_b).await });
        // Keep writing until the pump gives up and closes its side.
        let chunk = pattern(64 * 1024);
        let writer = tokio::spawn(async move { while client.write_all(&chunk).await.is_ok() {} });
        let result = tokio::time::timeout(Duration::from_secs(30), pump)
            .await
            .expect("the pump kept a direction whose destination had gone")
            .unwrap();
        writer.await.unwrap();
        let e = result.expect_err("writing to a closed peer must fail");
        assert!(
            matches!(e.raw_os_error(), Some(libc::EPIPE) | Some(libc::ECONNRESET)),
            "{e}"
        );
        // Every pipe in the pool is empty: a fresh splice through one moves exact bytes.
        let (c2, r2) = pair(dir.path(), "c").await;
        let (r3, s3) = pair(dir.path(), "d").await;
        let t = tokio::spawn(async move { crate::pump::copy(&r2, &r3).await });
        c2.write_all(b"clean").await.unwrap();
        c2.shutdown_write().unwrap();
        let mut buf = [0u8; 16];
        let n = s3.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"clean");
        assert_eq!(s3.read(&mut buf).await.unwrap(), 0);
        assert_eq!(t.await.unwrap().unwrap(), 5);
    }

    /// A pipe goes back to the pool once its chunk is out; the pool stays bounded.
    #[tokio::test]
    async fn pipes_return_to_a_bounded_pool() {
        let held: Vec<Pipe> = (0..PIPES_KEEP + 4).map(|_| Pipe::take().unwrap()).collect();
        drop(held);
        assert!(pipes_free() <= PIPES_KEEP);
        let mut p = Pipe::take().unwrap();
        assert!(p.reserve(CHUNK_MAX) >= CHUNK_MIN);
        p.held = 1;
        let before = pipes_free();
        drop(p);
        assert!(pipes_free() <= before, "a pipe holding bytes was pooled");
    }
}
