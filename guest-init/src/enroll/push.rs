//! The one-time bootstrap push: the host hands the guest its material over a socket.
//!
//! The guest listens (vsock in a VM, a Unix socket in tests); the host connects and writes
//! the JSON object; the guest reads until the object closes (or end of stream) and answers
//! `ok\n` or `error <reason>\n`. The document is parsed by [`Material::parse`] like a
//! file's. The end of the object, not a half-close, ends the document: vhost-device-vsock
//! turns the host's `shutdown(SHUT_WR)` into a full close, which would lose the answer.
//!
//! Threat: a peer other than the host pushing (vsock CID check, root check on Unix), a
//! refused pusher never seeing its answer (the rest of its input is drained, bounded), a
//! flood holding the listener (bounded reads, answered on their own tasks), a token in a
//! refused push lingering in memory (wiped buffers), and the listener deleting whatever
//! file sits at its path (only a stale socket is replaced).

use std::io;
use std::path::Path;
use std::time::Duration;

use zeroize::Zeroizing;

use super::material::{Material, MaterialError, MAX_MATERIAL_BYTES};
use vm_transport::{Conn, Endpoint, Peer};

/// Waits for the host to push bootstrap material once, on `listen`.
///
/// Only the host may push: on vsock the peer's CID must be 2 (the kernel sets it, the peer
/// cannot), on a Unix socket the peer must be root. The host writes the JSON object (a
/// half-close after it is allowed, not needed); the guest answers `ok\n` or
/// `error <reason>\n` (a reason without input values). A bad push is answered and the guest keeps listening, so one mistaken
/// connection cannot make the VM give up; the first good one ends the wait. The material
/// is kept in memory only: a restarted guest needs a new push.
///
/// CID 2 is *any* process on the host (under vhost-vsock, unprivileged users included),
/// so a pushed document is not trusted to be the platform's: the caller sends it only to
/// the configured service, and goes back to waiting if the service refuses it
/// (see [`super::run`]).
///
/// A Unix `listen` path may hold only a stale socket (one nobody listens on), which is
/// replaced; a regular file, a directory, a symlink or a live socket there is refused,
/// never removed.
pub async fn receive_push(listen: &Endpoint, read_timeout: Duration) -> io::Result<Material> {
    if let Some(p) = listen.unix_path() {
        remove_stale_socket(p)?;
    }
    let listener = listen.listen_with_backlog(4)?;
    let result = loop {
        let (conn, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                crate::warn!("enroll: bootstrap push accept on {listen} failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if let Err(why) = admit_pusher(&conn, &peer) {
            crate::warn!("enroll: refused bootstrap push from {peer}: {why}");
            // Answered on its own task: a stream of refused peers must not delay the host.
            tokio::spawn(answer_error(conn, why));
            continue;
        }
        let origin = format!("pushed by {peer} on {listen}");
        let parsed = match tokio::time::timeout(read_timeout, read_to_end_bounded(&conn)).await {
            Err(_) => Err(format!("{origin}: not received within {read_timeout:?}")),
            Ok(Err(e)) => Err(format!("{origin}: {e}")),
            Ok(Ok(None)) => Err(MaterialError::Oversized { origin }.to_string()),
            Ok(Ok(Some(bytes))) => Material::parse(&bytes, &origin).map_err(|e| e.to_string()),
        };
        match parsed {
            Ok(m) => {
                let _ = conn.write_all(b"ok\n").await;
                break m;
            }
            Err(why) => {
                crate::warn!("enroll: {why}");
                answer_error(conn, why).await;
            }
        }
    };
    drop(listener);
    if let Some(p) = listen.unix_path() {
        let _ = std::fs::remove_file(p);
    }
    Ok(result)
}

/// Makes room for the push socket at `path`: nothing there is fine; a socket nobody
/// listens on (left by an earlier run) is removed; anything else — a regular file, a
/// directory, a symlink, a socket something still listens on — is refused, never removed.
pub(crate) fn remove_stale_socket(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let md = match std::fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !md.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "bootstrap.push.listen: {} exists and is not a socket; remove it or choose another path",
                path.display()
            ),
        ));
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => std::fs::remove_file(path),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "bootstrap.push.listen: something is listening on {} already; stop it or choose another path",
                path.display()
            ),
        )),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!(
                "bootstrap.push.listen: cannot tell whether the socket {} is stale: {e}; remove it if nothing uses it",
                path.display()
            ),
        )),
    }
}

fn admit_pusher(conn: &Conn, peer: &Peer) -> Result<(), String> {
    match peer {
        Peer::Vsock { cid, .. } if *cid == vm_transport::vsock::VMADDR_CID_HOST => Ok(()),
        Peer::Vsock { cid, .. } => Err(format!("peer CID {cid} is not the host (2)")),
        Peer::Unix => match conn.peer_cred() {
            Ok(c) if c.uid() == 0 => Ok(()),
            Ok(c) => Err(format!("peer uid {} is not root", c.uid())),
            Err(e) => Err(format!("cannot read peer credentials: {e}")),
        },
        Peer::Tcp(_) => Err("TCP peers cannot push bootstrap material".into()),
    }
}

/// Answers `error <why>` and lets the pusher read it.
///
/// Closing a Unix socket with unread input resets the connection, and a pusher still
/// writing its document then sees `EPIPE` or `ECONNRESET` and never reads the answer. So
/// the write side is shut and the rest of the input is read and discarded (into a buffer
/// wiped afterwards: a refused peer may have sent a token), bounded in bytes and time so a
/// flood cannot hold the connection open.
async fn answer_error(conn: Conn, why: String) {
    let _ = conn.write_all(format!("error {why}\n").as_bytes()).await;
    let _ = conn.shutdown_write();
    let mut sink = Zeroizing::new([0u8; 4096]);
    let _ = tokio::time::timeout(Duration::from_secs(3), async {
        for _ in 0..16 {
            if !matches!(conn.read(&mut sink[..]).await, Ok(n) if n > 0) {
                break;
            }
        }
    })
    .await;
}

/// Reads until the JSON object the pusher sends is complete, or to end of stream; `None`
/// if more than [`MAX_MATERIAL_BYTES`] arrive.
///
/// The end of the object ends the read, so a pusher need not half-close: vhost-device-vsock
/// (and Firecracker) turn the host's `shutdown(SHUT_WR)` into a full close, and a pusher
/// that half-closed there never reads its answer (found by the agent's VM test). A pusher
/// that half-closes still works where the transport carries it.
async fn read_to_end_bounded(conn: &Conn) -> io::Result<Option<Zeroizing<Vec<u8>>>> {
    let mut buf = Zeroizing::new(vec![0u8; MAX_MATERIAL_BYTES + 1]);
    let mut len = 0;
    let mut object = ObjectEnd::default();
    loop {
        if len > MAX_MATERIAL_BYTES {
            return Ok(None);
        }
        let n = conn.read(&mut buf[len..]).await?;
        if n == 0 {
            break;
        }
        let done = object.feed(&buf[len..len + n]);
        len += n;
        if done {
            break;
        }
    }
    let mut out = Zeroizing::new(Vec::with_capacity(len));
    out.extend_from_slice(&buf[..len]);
    Ok(Some(out))
}

/// Finds where a JSON object ends in a stream of bytes fed piece by piece: depth of `{}`
/// and `[]` outside strings, with string escapes. Copies nothing (the bytes may hold a
/// token); a stream that does not start with `{` never ends here (end of stream or the
/// read timeout does, and the parser names what is wrong).
#[derive(Default)]
struct ObjectEnd {
    started: bool,
    depth: usize,
    in_string: bool,
    escaped: bool,
    not_an_object: bool,
}

impl ObjectEnd {
    /// Feeds the next bytes; true once the top-level object has closed.
    fn feed(&mut self, bytes: &[u8]) -> bool {
        for &b in bytes {
            if self.not_an_object {
                return false;
            }
            if !self.started {
                match b {
                    b' ' | b'\t' | b'\r' | b'\n' => continue,
                    b'{' => {
                        self.started = true;
                        self.depth = 1;
                        continue;
                    }
                    _ => {
                        self.not_an_object = true;
                        return false;
                    }
                }
            }
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        return true;
                    }
                }
                _ => {}
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::ObjectEnd;

    fn ends(pieces: &[&str]) -> bool {
        let mut o = ObjectEnd::default();
        pieces.iter().any(|p| o.feed(p.as_bytes()))
    }

    #[test]
    fn the_object_ends_at_its_closing_brace_in_any_split() {
        let doc = r#" {"a":{"b":[1,{"c":"}]{\"\\"}]},"t":"x"}"#;
        assert!(ends(&[doc]));
        for i in 0..doc.len() {
            assert!(ends(&[&doc[..i], &doc[i..]]), "split at {i}");
            assert!(!ends(&[&doc[..i]]), "ended early at {i}");
        }
        let bytes: Vec<String> = doc.chars().map(String::from).collect();
        let pieces: Vec<&str> = bytes.iter().map(String::as_str).collect();
        assert!(ends(&pieces));
    }

    #[test]
    fn braces_in_strings_and_non_objects_do_not_end_it() {
        assert!(!ends(&[r#"{"a":"}"#]));
        assert!(!ends(&[r#"{"a":"\"}"#]));
        assert!(!ends(&["[1]", "{}"]));
        assert!(!ends(&["x{}"]));
        assert!(!ends(&["   "]));
    }
}
