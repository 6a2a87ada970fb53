//! Host-initiated connections to a guest over hybrid vsock (`CONNECT <port>\n` / `OK ...\n`).
//!
//! Firecracker, Cloud Hypervisor and vhost-device-vsock expose a guest's vsock on the host
//! as one Unix socket: the host connects, writes `CONNECT <port>\n`, and the VMM answers
//! `OK <n>\n` once the guest accepted; from then on the stream *is* the guest connection.
//! Three facts shape this client (see `docs/RELAY.md` and the project's vsock notes):
//! - **Read the reply byte by byte, up to `\n`, and not one byte further.** The bytes after
//!   `\n` are the guest's; a buffered reader would swallow them. Only the `OK ` prefix is
//!   checked: Firecracker and Cloud Hypervisor answer with a host-side port, vhost-device-
//!   vsock with the guest port.
//! - **Retry while the guest is not ready**, with a bounded, growing backoff: before the
//!   guest's driver is up the VMM resets the connection (ECONNRESET, EPIPE); with no
//!   listener in the guest yet it closes without `OK`; before the VMM is up the socket is
//!   missing or refuses. Each is retried until the deadline. Any other reply is a refusal
//!   and is not retried.
//! - **Never close between `CONNECT` and `OK`-or-EOF.** vhost-device-vsock 0.3.0 panics
//!   and exits when a client does. So the deadline is checked only *between* attempts; an
//!   attempt in progress waits for its reply or the VMM's close.

use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::conn::Conn;
use crate::endpoint::Endpoint;

/// Longest reply line accepted (`OK 1073741824\n` is 14 bytes).
pub const MAX_REPLY: usize = 64;

/// How hard to try.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    /// Give up starting new attempts after this long.
    pub timeout: Duration,
    /// First pause between attempts; it doubles up to `max_backoff`.
    pub initial_backoff: Duration,
    /// Longest pause between attempts.
    pub max_backoff: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            timeout: Duration::from_secs(10),
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(500),
        }
    }
}

/// The outcome of one attempt.
enum Attempt {
    Connected(Conn),
    /// The guest (or VMM) is not ready: try again.
    NotReady(io::Error),
}

/// Connects to guest `port` through the VMM's hybrid vsock socket `uds`.
pub async fn connect(uds: &Path, port: u32, opts: &ConnectOptions) -> io::Result<Conn> {
    let deadline = Instant::now() + opts.timeout;
    let mut backoff = opts.initial_backoff;
    loop {
        let last = match attempt(uds, port).await? {
            Attempt::Connected(c) => return Ok(c),
            Attempt::NotReady(e) => e,
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "guest port {port} via {} not ready after {:?}: {last}",
                    uds.display(),
                    opts.timeout
                ),
            ));
        }
        tokio::time::sleep(backoff.min(deadline - now)).await;
        backoff = (backoff * 2).min(opts.max_backoff);
    }
}

fn retryable(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NotFound
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionAborted
    )
}

async fn attempt(uds: &Path, port: u32) -> io::Result<Attempt> {
    let conn = match Endpoint::Unix(uds.to_path_buf()).connect().await {
        Ok(c) => c,
        Err(e) if retryable(&e) => return Ok(Attempt::NotReady(e)),
        Err(e) => return Err(e),
    };
    match handshake(&conn, port).await {
        Ok(()) => Ok(Attempt::Connected(conn)),
        Err(e) if retryable(&e) => Ok(Attempt::NotReady(e)),
        Err(e) => Err(e),
    }
}

/// Sends `CONNECT <port>\n` and reads the reply one byte at a time through its `\n`.
async fn handshake(conn: &Conn, port: u32) -> io::Result<()> {
    conn.write_all(format!("CONNECT {port}\n").as_bytes())
        .await?;
    let mut reply = Vec::with_capacity(16);
    let mut byte = [0u8; 1];
    loop {
        if conn.read(&mut byte).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "closed before OK (no guest listener yet?)",
            ));
        }
        if byte[0] == b'\n' {
            break;
        }
        reply.push(byte[0]);
        if reply.len() > MAX_REPLY {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("reply to CONNECT {port} longer than {MAX_REPLY} bytes without a newline"),
            ));
        }
    }
    parse_reply(&reply, port)
}

/// Judges the VMM's reply line to `CONNECT <port>` (`line` without its `\n`): `Ok` for
/// `OK <anything>`, otherwise a final refusal (`PermissionDenied`, which [`connect`] does
/// not retry) or, over [`MAX_REPLY`] bytes, `InvalidData`. Pure; the fuzz target
/// `hybrid_reply` drives it.
pub fn parse_reply(line: &[u8], port: u32) -> io::Result<()> {
    if line.len() > MAX_REPLY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("reply to CONNECT {port} longer than {MAX_REPLY} bytes without a newline"),
        ));
    }
    if line.starts_with(b"OK ") {
        Ok(())
    } else {
        Err(io::Error::new(
            // A refusal is final: a kind `retryable` does not retry.
            io::ErrorKind::PermissionDenied,
            format!(
                "CONNECT {port} refused: reply {:?} does not start with \"OK \"",
                String::from_utf8_lossy(line)
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn opts() -> ConnectOptions {
        ConnectOptions {
            timeout: Duration::from_secs(20),
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(50),
        }
    }

    /// Reads the CONNECT line the way a VMM does: byte by byte.
    fn read_line(s: &mut std::os::unix::net::UnixStream) -> String {
        use std::io::Read;
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while s.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
            line.push(b[0]);
        }
        String::from_utf8(line).unwrap()
    }

    #[test]
    fn replies_are_judged_by_their_ok_prefix() {
        assert!(parse_reply(b"OK 1073741824", 1024).is_ok());
        assert!(parse_reply(b"OK ", 1024).is_ok());
        for bad in [
            &b"OKAY 1"[..],
            b"OK",
            b"",
            b"ok 5",
            b" OK 5",
            b"ERR no listener",
        ] {
            let e = parse_reply(bad, 7).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{bad:?}");
        }
        let long = [b'O'; MAX_REPLY + 1];
        assert_eq!(
            parse_reply(&long, 7).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
    }

    #[tokio::test]
    async fn bytes_after_ok_belong_to_the_guest() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vm.vsock");
        let l = UnixListener::bind(&uds).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let line = read_line(&mut s);
            // The reply and the guest's first bytes arrive in one segment.
            s.write_all(b"OK 1073741824\nhello from guest").unwrap();
            line
        });
        let conn = connect(&uds, 1024, &opts()).await.unwrap();
        assert_eq!(server.join().unwrap(), "CONNECT 1024");
        let mut buf = [0u8; 64];
        let mut got = Vec::new();
        while got.len() < 16 {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "stream ended early");
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, b"hello from guest");
    }

    #[tokio::test]
    async fn retries_until_the_guest_is_ready() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vm.vsock");
        let attempts = Arc::new(AtomicUsize::new(0));
        let seen = attempts.clone();
        let uds2 = uds.clone();
        let server = std::thread::spawn(move || {
            // The VMM is not up yet: no socket at all for a moment.
            std::thread::sleep(Duration::from_millis(100));
            let l = UnixListener::bind(&uds2).unwrap();
            // Guest driver not up: reset. Then: no guest listener, close without OK.
            for round in 0..4 {
                let (mut s, _) = l.accept().unwrap();
                seen.fetch_add(1, Ordering::SeqCst);
                assert_eq!(read_line(&mut s), "CONNECT 5000");
                if round % 2 == 0 {
                    s.shutdown(std::net::Shutdown::Both).unwrap();
                }
                drop(s);
            }
            let (mut s, _) = l.accept().unwrap();
            seen.fetch_add(1, Ordering::SeqCst);
            assert_eq!(read_line(&mut s), "CONNECT 5000");
            s.write_all(b"OK 5000\n").unwrap();
            s
        });
        let conn = connect(&uds, 5000, &opts()).await.unwrap();
        let _s = server.join().unwrap();
        assert_eq!(attempts.load(Ordering::SeqCst), 5);
        drop(conn);
    }

    #[tokio::test]
    async fn a_non_ok_reply_is_refused_without_retry() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vm.vsock");
        let l = UnixListener::bind(&uds).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            read_line(&mut s);
            s.write_all(b"OKAY 1\n").unwrap();
            l.set_nonblocking(true).unwrap();
            std::thread::sleep(Duration::from_millis(200));
            // No second attempt arrived.
            l.accept().is_err()
        });
        let err = connect(&uds, 7, &opts()).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("OKAY 1"), "{err}");
        assert!(server.join().unwrap(), "a refusal must not be retried");
    }

    #[tokio::test]
    async fn gives_up_at_the_deadline_and_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("missing.vsock");
        let o = ConnectOptions {
            timeout: Duration::from_millis(100),
            ..opts()
        };
        let err = connect(&uds, 7, &o).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("missing.vsock"), "{err}");
    }

    #[tokio::test]
    async fn an_endless_reply_is_refused() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vm.vsock");
        let l = UnixListener::bind(&uds).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            read_line(&mut s);
            let _ = s.write_all(&[b'O'; MAX_REPLY + 10]);
            s
        });
        let err = connect(&uds, 7, &opts()).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        drop(server.join().unwrap());
    }
}
