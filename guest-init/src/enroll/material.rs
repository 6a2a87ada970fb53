//! Bootstrap material: who this VM is and the one secret that lets it enroll.
//!
//! The platform stages, per clone, a small JSON object (format version 1):
//!
//! ```json
//! {"version": 1,
//!  "workspace_namespace": "team-a", "workspace_name": "ws1",
//!  "workspace_uid": "0b4c5e2a-...", "vm_uid": "9f0e...",
//!  "revocation_epoch": 18446744073709551615,
//!  "token": "<43..256 characters of A-Z a-z 0-9 - _>",
//!  "expires_at": 1790000000,
//!  "enrollment_port": 5002}
//! ```
//!
//! `expires_at` is Unix seconds. It arrives either as a file (mode 0600, owned by root, on
//! the image or a config disk; see [`read_file`]) or as a one-time push from the host on a
//! port the guest listens on (see [`receive_push`]).
//!
//! Parsing is strict because this is the input that decides the VM's identity: at most
//! [`MAX_MATERIAL_BYTES`], every field required, unknown fields rejected (a misspelt
//! `revocation_epoc` must not silently become epoch 0), the epoch a full-range `u64`, and
//! every string checked against the alphabet the identity URI needs.
//!
//! **The token is secret.** It lives in a [`Token`], whose buffer is wiped on drop and
//! which has no `Display` and a `Debug` that prints `<redacted>`. Parse errors never quote
//! input: `serde_json`'s messages can contain the offending value (`invalid type: string
//! "..."`), so they are rewritten to keep only our own field names (see [`redact`]). The
//! token never enters argv, the environment, the kernel command line or a log line; the
//! file it came from is not deleted (it may be on a read-only config disk), so its
//! protection is its mode and the root-only directory it sits in.
//!
//! Threat: a loose or planted bootstrap file (mode, owner and symlink checks), a token
//! leaking through logs or errors, ambiguous or partial input changing the identity, and
//! a push listener deleting whatever file sits at its path.

use std::fmt;
use std::io;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Deserializer};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use super::identity::Identity;
use vm_transport::{Conn, Endpoint, Peer};

/// The largest bootstrap document accepted.
pub const MAX_MATERIAL_BYTES: usize = 4096;

/// The bootstrap format version this build reads.
pub const MATERIAL_VERSION: u32 = 1;

/// Shortest and longest token.
pub const TOKEN_LEN: std::ops::RangeInclusive<usize> = 32..=256;

/// The fields of version 1, the only names an error message may quote.
const FIELDS: &[&str] = &[
    "version",
    "workspace_namespace",
    "workspace_name",
    "workspace_uid",
    "vm_uid",
    "revocation_epoch",
    "token",
    "expires_at",
    "enrollment_port",
];

/// The bootstrap token. Wiped on drop; never printed.
pub struct Token(Zeroizing<String>);

impl Token {
    /// The token's characters, for the one place that sends them.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Hex SHA-256 of the token: what the service and the guest's records keep.
    pub fn sha256_hex(&self) -> String {
        hex(&Sha256::digest(self.0.as_bytes()))
    }

    fn check(&self) -> Result<(), String> {
        let t = self.0.as_str();
        if !TOKEN_LEN.contains(&t.len()) {
            return Err(format!(
                "token: must be {} to {} characters long",
                TOKEN_LEN.start(),
                TOKEN_LEN.end()
            ));
        }
        if !t
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(
                "token: only A-Z, a-z, 0-9, '-' and '_' are allowed (base64url or hex)".into(),
            );
        }
        Ok(())
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl<'de> Deserialize<'de> for Token {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // serde_json hands a borrowed &str for strings without escapes (the only ones the
        // token alphabet allows), so no intermediate copy outlives this call.
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Token;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Token, E> {
                let mut s = Zeroizing::new(String::with_capacity(v.len()));
                s.push_str(v);
                Ok(Token(s))
            }
        }
        d.deserialize_str(V)
    }
}

/// Parsed, checked bootstrap material.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Material {
    /// Format version; must be [`MATERIAL_VERSION`].
    pub version: u32,
    /// Workspace namespace.
    pub workspace_namespace: String,
    /// Workspace name.
    pub workspace_name: String,
    /// Workspace UID.
    pub workspace_uid: String,
    /// VM UID.
    pub vm_uid: String,
    /// Revocation epoch (full `u64` range).
    pub revocation_epoch: u64,
    /// The secret token.
    pub token: Token,
    /// When the token expires, Unix seconds.
    pub expires_at: u64,
    /// The enrollment service's vsock port on the host (CID 2).
    pub enrollment_port: u32,
}

/// Bootstrap material that cannot be used. Messages never contain input values.
#[derive(Debug, thiserror::Error)]
pub enum MaterialError {
    /// The file or push could not be read.
    #[error("bootstrap material {origin}: {reason}")]
    Read {
        /// Where it came from.
        origin: String,
        /// Why (no input value).
        reason: String,
    },
    /// Too large.
    #[error("bootstrap material {origin}: larger than {MAX_MATERIAL_BYTES} bytes; provision the documented JSON object only")]
    Oversized {
        /// Where it came from.
        origin: String,
    },
    /// Not the documented JSON.
    #[error("bootstrap material {origin}: {reason}")]
    Invalid {
        /// Where it came from.
        origin: String,
        /// What is wrong, naming the field.
        reason: String,
    },
}

impl Material {
    /// Parses and checks a bootstrap document. `origin` (a path or peer) goes into errors.
    pub fn parse(bytes: &[u8], origin: &str) -> Result<Material, MaterialError> {
        if bytes.len() > MAX_MATERIAL_BYTES {
            return Err(MaterialError::Oversized {
                origin: origin.into(),
            });
        }
        let invalid = |reason: String| MaterialError::Invalid {
            origin: origin.into(),
            reason,
        };
        let m: Material = serde_json::from_slice(bytes).map_err(|e| {
            invalid(format!(
                "{} (line {}, column {}); see docs/ENROLLMENT.md for the format",
                redact(&e.to_string()),
                e.line(),
                e.column()
            ))
        })?;
        if m.version != MATERIAL_VERSION {
            return Err(invalid(format!(
                "version: {} is not supported; this guest-init reads version {MATERIAL_VERSION}",
                m.version
            )));
        }
        m.identity().check().map_err(invalid)?;
        m.token.check().map_err(invalid)?;
        if m.enrollment_port == 0 || m.enrollment_port == u32::MAX {
            return Err(invalid(
                "enrollment_port: must be a vsock port from 1 to 4294967294".into(),
            ));
        }
        Ok(m)
    }

    /// The identity this material asks for.
    pub fn identity(&self) -> Identity {
        Identity {
            workspace_namespace: self.workspace_namespace.clone(),
            workspace_name: self.workspace_name.clone(),
            workspace_uid: self.workspace_uid.clone(),
            vm_uid: self.vm_uid.clone(),
            epoch: self.revocation_epoch,
        }
    }
}

/// Rewrites a `serde_json` message so that only our own field names survive: any other text
/// in backticks or quotes (an input value, an unknown key) becomes `<redacted>`.
///
/// The one piece of input a message quotes is its first quoted text, and that text may
/// itself hold quote characters (a key such as ``a`b``): it runs to the last quote before
/// serde's own `, expected ...` (which lists only our names), or to the message's last
/// quote. Pairing quotes one by one instead let such a key's middle through unredacted
/// (found by the fuzz target `bootstrap_material`).
pub fn redact(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    let Some(i) = msg.find(['`', '"']) else {
        return msg.to_string();
    };
    let q = msg.as_bytes()[i] as char;
    out.push_str(&msg[..i]);
    let tail = msg
        .rfind(", expected")
        .filter(|&e| e > i)
        .unwrap_or(msg.len());
    let mut rest = match msg[..tail].rfind(q).filter(|&j| j > i) {
        Some(j) => {
            let inner = &msg[i + 1..j];
            if FIELDS.contains(&inner) {
                out.push(q);
                out.push_str(inner);
                out.push(q);
            } else {
                out.push_str("<redacted>");
            }
            &msg[j + 1..]
        }
        None => {
            out.push_str("<redacted>");
            return out;
        }
    };
    // The rest is serde's own text: pair its quotes.
    while let Some(i) = rest.find(['`', '"']) {
        let q = rest.as_bytes()[i] as char;
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        match after.find(q) {
            Some(j) => {
                let inner = &after[..j];
                if FIELDS.contains(&inner) {
                    out.push(q);
                    out.push_str(inner);
                    out.push(q);
                } else {
                    out.push_str("<redacted>");
                }
                rest = &after[j + 1..];
            }
            None => {
                out.push_str("<redacted>");
                rest = "";
            }
        }
    }
    out.push_str(rest);
    // Unquoted values (`invalid type: integer 5`) are numbers or literals, never the
    // token, whose alphabet makes it a JSON string.
    out
}

/// Reads bootstrap material from a file: regular, not a symlink, owned by root (the
/// effective uid), mode 0600 or stricter, at most [`MAX_MATERIAL_BYTES`].
/// `Ok(None)` when the file does not exist.
pub fn read_file(path: &Path) -> Result<Option<Material>, MaterialError> {
    let origin = path.display().to_string();
    let bytes = match super::files::read_bounded(path, MAX_MATERIAL_BYTES, true) {
        Ok(Some(b)) => b,
        Ok(None) => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
            return Err(MaterialError::Oversized { origin })
        }
        Err(e) => {
            return Err(MaterialError::Read {
                origin,
                reason: e.to_string(),
            })
        }
    };
    Material::parse(&bytes, &origin).map(Some)
}

/// Waits for the host to push bootstrap material once, on `listen`.
///
/// Only the host may push: on vsock the peer's CID must be 2 (the kernel sets it, the peer
/// cannot), on a Unix socket the peer must be root. The host writes the JSON and shuts
/// down its write side; the guest answers `ok\n` or `error <reason>\n` (a reason without
/// input values). A bad push is answered and the guest keeps listening, so one mistaken
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
fn remove_stale_socket(path: &Path) -> io::Result<()> {
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

/// Reads to end of stream; `None` if more than [`MAX_MATERIAL_BYTES`] arrive.
async fn read_to_end_bounded(conn: &Conn) -> io::Result<Option<Zeroizing<Vec<u8>>>> {
    let mut buf = Zeroizing::new(vec![0u8; MAX_MATERIAL_BYTES + 1]);
    let mut len = 0;
    loop {
        if len > MAX_MATERIAL_BYTES {
            return Ok(None);
        }
        let n = conn.read(&mut buf[len..]).await?;
        if n == 0 {
            break;
        }
        len += n;
    }
    let mut out = Zeroizing::new(Vec::with_capacity(len));
    out.extend_from_slice(&buf[..len]);
    Ok(Some(out))
}

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "tok_SECRETSECRETSECRETSECRETSECRET0123";

    fn doc(extra: &str) -> String {
        format!(
            r#"{{"version":1,"workspace_namespace":"team-a","workspace_name":"ws1",
            "workspace_uid":"u-1","vm_uid":"vm-1","revocation_epoch":18446744073709551615,
            "token":"{TOKEN}","expires_at":1790000000,"enrollment_port":5002{extra}}}"#
        )
    }

    #[test]
    fn full_range_epoch_parses() {
        let m = Material::parse(doc("").as_bytes(), "test").unwrap();
        assert_eq!(m.revocation_epoch, u64::MAX);
        assert_eq!(m.token.expose(), TOKEN);
        assert!(!format!("{m:?}").contains(TOKEN));
    }

    #[test]
    fn unknown_fields_are_rejected_by_name() {
        let e = Material::parse(doc(r#","revocation_epoc":3"#).as_bytes(), "test").unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("unknown field") && s.contains("<redacted>"),
            "{s}"
        );
    }

    #[test]
    fn errors_never_quote_the_token() {
        // The token's value in a wrong place or with a wrong type.
        for bad in [
            doc("").replace("\"token\"", &format!("\"{TOKEN}\"")),
            doc("").replace("\"vm-1\"", &format!("\"{TOKEN}\"")),
            doc("").replace("\"u-1\"", &format!("[\"{TOKEN}\"]")),
            doc("").replace("\"team-a\"", &format!("\"{TOKEN}\"")),
            doc("").replace("5002", &format!("\"{TOKEN}\"")),
        ] {
            let e = Material::parse(bad.as_bytes(), "test")
                .unwrap_err()
                .to_string();
            assert!(!e.contains(TOKEN), "{e}");
        }
    }

    /// Regression (fuzz target `bootstrap_material`): a key holding backticks let the text
    /// between them through, token-like characters included.
    #[test]
    fn quotes_inside_quoted_input_do_not_unredact_it() {
        let crash = "{\"ve_____`````__tov".to_string()
            + &"t".repeat(42)
            + "____\":2,\""
            + &"t".repeat(32)
            + "\":90}";
        for bad in [
            crash,
            doc("").replace("\"vm_uid\"", &format!("\"a`{TOKEN}`b\"")),
            doc("").replace("\"vm-1\"", &format!("\"a\\\"{TOKEN}\\\"b\"")),
            doc("").replace("\"vm-1\"", &format!("\"a\\\"{TOKEN}\\\", expected b\"")),
        ] {
            let e = Material::parse(bad.as_bytes(), "test")
                .unwrap_err()
                .to_string();
            assert!(!e.contains("tttt") && !e.contains("SECRET"), "{bad}: {e}");
        }
        assert_eq!(
            redact("unknown field `a`b`, expected one of `version`, `token`"),
            "unknown field <redacted>, expected one of `version`, `token`"
        );
        assert_eq!(redact("missing field `token`"), "missing field `token`");
    }

    #[test]
    fn bad_values_name_their_field() {
        let cases = [
            (doc("").replace("\"vm-1\"", "\"a:b\""), "vm_uid"),
            (doc("").replace("5002", "0"), "enrollment_port"),
            (doc("").replace(TOKEN, "short"), "token"),
            (doc("").replace("\"version\":1", "\"version\":2"), "version"),
            (
                doc("").replace("18446744073709551615", "18446744073709551616"),
                "line",
            ),
            (doc("").replace("18446744073709551615", "-1"), "line"),
        ];
        for (bad, field) in cases {
            let e = Material::parse(bad.as_bytes(), "test")
                .unwrap_err()
                .to_string();
            assert!(e.contains(field), "{field}: {e}");
        }
    }

    #[test]
    fn oversized_is_refused_before_parsing() {
        let big = doc(&format!(r#","pad":"{}""#, "x".repeat(MAX_MATERIAL_BYTES)));
        assert!(matches!(
            Material::parse(big.as_bytes(), "test"),
            Err(MaterialError::Oversized { .. })
        ));
    }
}
