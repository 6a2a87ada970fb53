//! A minimal HTTP/1.1 client for talking to Radicale through QEMU's host port forward.
//!
//! The tests need a status code and nothing else, over plain TCP on loopback, so this is a
//! few lines over `std::net::TcpStream` rather than an HTTP library: one request per
//! connection (`Connection: close`), read to the end, parse the status line. Credentials
//! go in a `Basic` header built here and never printed: [`Reply`] holds only the status
//! line and headers.
//!
//! QEMU's user networking accepts a forwarded connection on the host before the guest has
//! a listener, then closes it; so "the port accepts" means nothing. [`wait_ready`] waits
//! until a request gets a *status line* back, which only Radicale itself can send.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use base64::Engine as _;

/// What came back.
#[derive(Clone, Debug)]
pub struct Reply {
    /// The status code, e.g. 207.
    pub status: u16,
    /// The status line and headers (no body).
    pub head: String,
    /// How long the request took.
    pub elapsed: Duration,
}

/// Sends one request and reads the whole reply.
///
/// `auth` is `(user, password)` for a `Basic` header. `timeout` bounds connect, each read
/// and each write.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    auth: Option<(&str, &str)>,
    extra_headers: &[(&str, &str)],
    timeout: Duration,
) -> io::Result<Reply> {
    let start = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: microvm-e2e\r\n\
         Content-Length: 0\r\nConnection: close\r\n"
    );
    if let Some((user, password)) = auth {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        req.push_str(&format!("Authorization: Basic {token}\r\n"));
    }
    for (k, v) in extra_headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let head = text.split("\r\n\r\n").next().unwrap_or("").to_string();
    let status = parse_status(&head).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            if buf.is_empty() {
                "connection closed without a reply (nothing listening behind the port forward yet?)"
                    .to_string()
            } else {
                format!(
                    "no HTTP status line in {:?}",
                    head.lines().next().unwrap_or("")
                )
            },
        )
    })?;
    Ok(Reply {
        status,
        head,
        elapsed: start.elapsed(),
    })
}

/// The status code of `HTTP/1.x NNN ...`.
pub fn parse_status(head: &str) -> Option<u16> {
    let line = head.lines().next()?;
    let mut parts = line.split_whitespace();
    let version = parts.next()?;
    if !version.starts_with("HTTP/1.") {
        return None;
    }
    parts.next()?.parse().ok()
}

/// A `PROPFIND` of the principal's home with `Depth: 0`: what a CalDAV client does first
/// after signing in. Radicale answers 207 when the sign-in succeeds, 401 when not.
pub fn sign_in(
    addr: SocketAddr,
    user: &str,
    password: &str,
    timeout: Duration,
) -> io::Result<Reply> {
    request(
        addr,
        "PROPFIND",
        &format!("/{user}/"),
        Some((user, password)),
        &[("Depth", "0")],
        timeout,
    )
}

/// Waits until the server behind `addr` answers an unauthenticated `GET /.web/` with any
/// status line; returns how long it took, or the last error at `deadline`.
pub fn wait_ready(addr: SocketAddr, deadline: Instant) -> Result<Duration, String> {
    let start = Instant::now();
    let mut last = String::from("no attempt made");
    while Instant::now() < deadline {
        match request(addr, "GET", "/.web/", None, &[], Duration::from_secs(5)) {
            Ok(_) => return Ok(start.elapsed()),
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn status_line_parses_and_garbage_does_not() {
        assert_eq!(parse_status("HTTP/1.0 207 Multi-Status\r\nX: y"), Some(207));
        assert_eq!(parse_status("HTTP/1.1 401 Unauthorized"), Some(401));
        assert_eq!(parse_status("SSH-2.0-OpenSSH"), None);
        assert_eq!(parse_status(""), None);
    }

    #[test]
    fn request_sends_basic_auth_and_reads_the_status() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut got = Vec::new();
            let mut b = [0u8; 1024];
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = c.read(&mut b).unwrap();
                got.extend_from_slice(&b[..n]);
            }
            c.write_all(b"HTTP/1.0 207 Multi-Status\r\nContent-Length: 0\r\n\r\n")
                .unwrap();
            String::from_utf8(got).unwrap()
        });
        let r = sign_in(addr, "alice", "secret123", Duration::from_secs(5)).unwrap();
        assert_eq!(r.status, 207);
        let req = server.join().unwrap();
        assert!(req.starts_with("PROPFIND /alice/ HTTP/1.1\r\n"), "{req}");
        // base64("alice:secret123")
        assert!(
            req.contains("Authorization: Basic YWxpY2U6c2VjcmV0MTIz\r\n"),
            "{req}"
        );
        assert!(req.contains("Depth: 0\r\n"), "{req}");
    }

    #[test]
    fn a_closed_connection_is_not_ready() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        // Like QEMU's port forward with no guest listener: accept, then close without a
        // reply. (The request is read first, so the close is a clean EOF, not a reset.)
        std::thread::spawn(move || {
            while let Ok((mut c, _)) = l.accept() {
                let mut got = Vec::new();
                let mut b = [0u8; 1024];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut b) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got.extend_from_slice(&b[..n]),
                    }
                }
                drop(c);
            }
        });
        let err = wait_ready(addr, Instant::now() + Duration::from_millis(600)).unwrap_err();
        assert!(err.contains("without a reply"), "{err}");
    }
}
