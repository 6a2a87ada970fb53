//! The enrollment wire protocol, version 1.
//!
//! One request and one response, each a single JSON object on one line (`\n`-terminated,
//! at most [`MAX_LINE`] bytes including the newline), over one stream connection: vsock
//! CID 2 on the bootstrap material's `enrollment_port` in a VM (host-relay carries it to
//! the service's per-VM endpoint), a Unix socket in tests. The guest writes the request;
//! the service writes the response and closes.
//!
//! Request:
//! ```json
//! {"v":1,"op":"enroll","token":"<bootstrap token>","csr":"<base64 DER CSR>"}
//! ```
//! Responses:
//! ```json
//! {"v":1,"status":"ok","certificate":"<base64 DER certificate>"}
//! {"v":1,"status":"error","code":"expired","message":"bootstrap token expired"}
//! ```
//!
//! Error codes ([`ErrorCode`]) are either **retryable** — `unavailable`, `timeout`, `busy`:
//! the client retries with capped exponential backoff, re-sending the identical bytes — or
//! **final** — `expired` (the token, or on a retry the certificate already issued for this
//! CSR), `csr_mismatch` (another CSR is already enrolled for this token), `identity_mismatch`
//! (the caller's VM or the CSR's identity differs from the token's binding),
//! `identity_changed`, `capacity_exhausted`, `denied` (unknown token), `bad_request`,
//! `unsupported_version`. A code this client does not know is final. The calling VM is never
//! named in the request: the service learns it out of band from the relay endpoint the
//! connection arrived on.
//!
//! Why the two later codes are final:
//! - `identity_changed`: the token's binding is no longer the workspace's *current* identity
//!   (the VM was reset, so its VM UID changed, or the revocation epoch was raised), found at
//!   enroll, on a retry, or after the commit (the result is then withheld). The identity
//!   only moves forward, so the same token and CSR can never succeed again; only new
//!   material can. A current-identity source that cannot be reached is not this code: it is
//!   `unavailable` (retryable; nothing is issued meanwhile, so it still fails closed).
//! - `capacity_exhausted`: the service's ledger is full and it denies rather than evict a
//!   credential. Space comes back only when the platform acts or entries age out (minutes,
//!   beyond a client's retry budget); retrying would only add load, and the material stays
//!   valid for a later run.
//!
//! The request's `Debug` redacts the token. `message` is for people; clients branch only on
//! `code`.

use std::borrow::Cow;
use std::fmt;
use std::io;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt};

/// The protocol version.
pub const VERSION: u32 = 1;

/// The longest line either side accepts, newline included.
pub const MAX_LINE: usize = 16 * 1024;

/// The only operation of version 1.
pub const OP_ENROLL: &str = "enroll";

/// The request.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request<'a> {
    /// Protocol version ([`VERSION`]).
    pub v: u32,
    /// Operation ([`OP_ENROLL`]).
    pub op: Cow<'a, str>,
    /// The bootstrap token (secret).
    pub token: Cow<'a, str>,
    /// The CSR, standard base64 of its DER.
    pub csr: Cow<'a, str>,
}

impl fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("v", &self.v)
            .field("op", &self.op)
            .field("token", &"<redacted>")
            .field("csr", &self.csr)
            .finish()
    }
}

/// Whether a response is a success.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// A certificate follows.
    Ok,
    /// `code` and `message` say why not.
    Error,
}

/// Why the service said no.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Retryable: the service (or what it depends on) is not available now.
    Unavailable,
    /// Retryable: the service gave up waiting.
    Timeout,
    /// Retryable: too many requests now.
    Busy,
    /// Final: the token has expired (or, on a retry, the certificate issued for the CSR).
    Expired,
    /// Final: another CSR is already enrolled for this token.
    CsrMismatch,
    /// Final: the caller's VM or the CSR's identity does not match the token's binding.
    IdentityMismatch,
    /// Final: the token's binding is no longer the workspace's current identity (a reset
    /// changed the VM UID, or the epoch was raised).
    IdentityChanged,
    /// Final: the service's ledger is full; it denies rather than evicting credentials.
    CapacityExhausted,
    /// Final: the token is not known.
    Denied,
    /// Final: the request is malformed (including a CSR whose signature does not verify).
    BadRequest,
    /// Final: the request's version is not supported.
    UnsupportedVersion,
    /// Final: a code this client does not know.
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    /// Whether the client should retry.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::Unavailable | ErrorCode::Timeout | ErrorCode::Busy
        )
    }

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Timeout => "timeout",
            ErrorCode::Busy => "busy",
            ErrorCode::Expired => "expired",
            ErrorCode::CsrMismatch => "csr_mismatch",
            ErrorCode::IdentityMismatch => "identity_mismatch",
            ErrorCode::IdentityChanged => "identity_changed",
            ErrorCode::CapacityExhausted => "capacity_exhausted",
            ErrorCode::Denied => "denied",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::UnsupportedVersion => "unsupported_version",
            ErrorCode::Unknown => "unknown",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The response. Unknown fields are ignored, so a later minor addition does not break
/// version-1 clients.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Response {
    /// Protocol version.
    pub v: u32,
    /// Success or error.
    pub status: Status,
    /// On success: standard base64 of the DER certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<String>,
    /// On error: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<ErrorCode>,
    /// On error: a human-readable explanation (never secrets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl Response {
    /// A success carrying `cert_der`.
    pub fn ok(cert_der: &[u8]) -> Response {
        use base64::Engine;
        Response {
            v: VERSION,
            status: Status::Ok,
            certificate: Some(base64::engine::general_purpose::STANDARD.encode(cert_der)),
            code: None,
            message: None,
        }
    }

    /// An error.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Response {
        Response {
            v: VERSION,
            status: Status::Error,
            certificate: None,
            code: Some(code),
            message: Some(message.into()),
        }
    }

    /// The line to send (with its newline).
    pub fn to_line(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

/// Reads one `\n`-terminated line of at most `max` bytes (newline included) and returns it
/// without the newline. End of stream before the newline and an over-long line are errors.
/// Reads byte chunks but never past the newline's chunk; callers use one line per stream.
pub async fn read_line<R: AsyncRead + Unpin>(r: &mut R, max: usize) -> io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(max.min(4096));
    let mut chunk = [0u8; 2048];
    loop {
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer closed before a complete line",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.iter().position(|&b| b == b'\n') {
            if i + 1 > max {
                break;
            }
            buf.truncate(i);
            return Ok(buf);
        }
        if buf.len() >= max {
            break;
        }
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        format!("line longer than {max} bytes"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_classify_and_unknown_is_final() {
        for (s, retry) in [
            ("unavailable", true),
            ("timeout", true),
            ("busy", true),
            ("expired", false),
            ("csr_mismatch", false),
            ("identity_mismatch", false),
            ("identity_changed", false),
            ("capacity_exhausted", false),
            ("bad_request", false),
            ("something_new", false),
        ] {
            let r: Response =
                serde_json::from_str(&format!(r#"{{"v":1,"status":"error","code":"{s}"}}"#))
                    .unwrap();
            let code = r.code.unwrap();
            assert_eq!(code.retryable(), retry, "{s}");
            if s != "something_new" {
                assert_eq!(code.as_str(), s, "a known code must keep its wire name");
            }
        }
    }

    #[test]
    fn request_debug_redacts_the_token() {
        let r = Request {
            v: 1,
            op: "enroll".into(),
            token: "SECRET-TOKEN".into(),
            csr: "x".into(),
        };
        assert!(!format!("{r:?}").contains("SECRET-TOKEN"));
    }

    #[tokio::test]
    async fn lines_are_bounded() {
        let mut ok: &[u8] = b"abc\nrest";
        assert_eq!(read_line(&mut ok, 10).await.unwrap(), b"abc");
        let mut long: &[u8] = b"0123456789abc\n";
        assert!(read_line(&mut long, 10).await.is_err());
        let mut eof: &[u8] = b"abc";
        assert!(read_line(&mut eof, 10).await.is_err());
    }
}
