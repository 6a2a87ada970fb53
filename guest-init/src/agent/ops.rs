//! The agent's operations and their wire format.
//!
//! One request and one response per TLS stream, each a single JSON object on one line
//! (`\n`-terminated, at most [`MAX_REQUEST`] bytes for the request):
//!
//! ```json
//! {"v":1,"op":"status"}
//! {"v":1,"op":"stop"}
//! {"v":1,"op":"exec","user":"app","argv":["/bin/sh","-c","id"],"deadline_ms":20000}
//! ```
//!
//! Responses are `{"v":1,"status":"ok",...}` with the operation's fields, or
//! `{"v":1,"status":"error","code":CODE,"message":TEXT}` with `CODE` one of
//! `malformed_request`, `role_not_allowed`, `user_not_allowed`, `exec_failed`.
//!
//! `exec` runs `argv` (no shell unless asked for) as a user named in the agent's
//! `exec_users` list (resolved through the guest's `/etc/passwd`; root only if listed),
//! in its own process group, with stdin from `/dev/null`, an environment of `PATH`,
//! `HOME` and `USER` only, and a deadline (default [`DEFAULT_DEADLINE`], at most
//! [`MAX_DEADLINE`]). At the deadline the whole process group is killed (SIGKILL) and the
//! answer says `timed_out`. stdout and stderr are each kept up to [`MAX_OUTPUT`] bytes
//! (base64 in the answer, `truncated` set if more came; the rest is read and dropped so the
//! job never blocks on a full pipe).
//!
//! Threat: a request that is not what it seems (strict JSON, unknown fields refused, bounded
//! size), a job outliving its deadline or its connection's identity (killed by process
//! group), a job flooding the guest's memory through its output (capped), and exec as an
//! arbitrary user (only listed users; root only by name in the list).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The protocol version.
pub const VERSION: u32 = 1;
/// The longest request line, newline included.
pub const MAX_REQUEST: usize = 64 * 1024;
/// The default `exec` deadline.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(20);
/// The longest `exec` deadline a request may ask for.
pub const MAX_DEADLINE: Duration = Duration::from_secs(600);
/// The most bytes of stdout, and of stderr, an `exec` answer carries.
pub const MAX_OUTPUT: usize = 256 * 1024;

/// A request.
#[derive(Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Op {
    /// Identity, epoch, certificate expiry, app state, uptime.
    Status {
        /// Protocol version.
        v: u32,
    },
    /// The orderly shutdown.
    Stop {
        /// Protocol version.
        v: u32,
    },
    /// Run a command.
    Exec {
        /// Protocol version.
        v: u32,
        /// The user to run as (a name from the guest's `/etc/passwd`, listed in
        /// `exec_users`).
        user: String,
        /// The command and its arguments; `argv[0]` is an absolute path.
        argv: Vec<String>,
        /// Deadline in milliseconds (default 20000, at most 600000).
        #[serde(default)]
        deadline_ms: Option<u64>,
    },
}

impl Op {
    /// The operation's name (what roles are checked against).
    pub fn name(&self) -> &'static str {
        match self {
            Op::Status { .. } => "status",
            Op::Stop { .. } => "stop",
            Op::Exec { .. } => "exec",
        }
    }

    fn version(&self) -> u32 {
        match self {
            Op::Status { v } | Op::Stop { v } | Op::Exec { v, .. } => *v,
        }
    }

    /// Parses and checks one request line (without its newline).
    pub fn parse(line: &[u8]) -> Result<Op, String> {
        let op: Op = serde_json::from_slice(line).map_err(|e| {
            format!(
                "not a request: {} (see docs/AGENT.md)",
                crate::enroll::material::redact(&e.to_string())
            )
        })?;
        if op.version() != VERSION {
            return Err(format!(
                "v: {} is not supported; this agent speaks version {VERSION}",
                op.version()
            ));
        }
        if let Op::Exec {
            argv, deadline_ms, ..
        } = &op
        {
            match argv.first() {
                Some(a) if a.starts_with('/') => {}
                _ => return Err("argv: needs an absolute path as argv[0]".into()),
            }
            if argv.iter().any(|a| a.contains('\0')) {
                return Err("argv: an argument contains a NUL byte".into());
            }
            if deadline_ms.is_some_and(|d| d == 0 || d > MAX_DEADLINE.as_millis() as u64) {
                return Err(format!(
                    "deadline_ms: must be 1 to {}",
                    MAX_DEADLINE.as_millis()
                ));
            }
        }
        Ok(op)
    }
}

/// Gathers one request line from reads of any size.
///
/// The line ends at the first `\n`; with its newline it may be at most `limit` bytes
/// (the agent's limit is [`MAX_REQUEST`]), whatever sizes the reads came in: the same
/// stream gives the same line, or the same refusal, however it is cut. Bytes after the
/// newline are ignored (one request per stream).
#[derive(Debug)]
pub struct LineReader {
    buf: Vec<u8>,
    limit: usize,
}

impl LineReader {
    /// A reader for a line of at most `limit` bytes, newline included.
    pub fn new(limit: usize) -> LineReader {
        LineReader {
            buf: Vec::with_capacity(limit.min(1024)),
            limit,
        }
    }

    /// Takes one read: `Ok(Some(line))` (without its newline) once the line is complete,
    /// `Ok(None)` while more may come, `Err` once the line is longer than the limit.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Option<Vec<u8>>, String> {
        let room = self.limit.saturating_sub(self.buf.len());
        let take = &chunk[..chunk.len().min(room)];
        if let Some(i) = take.iter().position(|&b| b == b'\n') {
            self.buf.extend_from_slice(&take[..i]);
            return Ok(Some(std::mem::take(&mut self.buf)));
        }
        self.buf.extend_from_slice(take);
        if chunk.len() > take.len() || self.buf.len() >= self.limit {
            return Err(format!(
                "the request is longer than {} bytes (newline included)",
                self.limit
            ));
        }
        Ok(None)
    }
}

/// An error answer's code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    /// The request could not be read or parsed.
    MalformedRequest,
    /// The client's role does not allow the operation.
    RoleNotAllowed,
    /// `exec` as a user that is not listed (or does not exist).
    UserNotAllowed,
    /// The command could not be started.
    ExecFailed,
}

/// An answer.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Answer {
    /// Protocol version.
    pub v: u32,
    /// `ok` or `error`.
    pub status: String,
    /// On error: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<Code>,
    /// On error: for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// On success: the operation's result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
}

impl Answer {
    /// A success with `result`.
    pub fn ok(result: serde_json::Value) -> Answer {
        Answer {
            v: VERSION,
            status: "ok".into(),
            code: None,
            message: None,
            result: Some(result),
        }
    }

    /// An error.
    pub fn error(code: Code, message: impl Into<String>) -> Answer {
        Answer {
            v: VERSION,
            status: "error".into(),
            code: Some(code),
            message: Some(message.into()),
            result: None,
        }
    }

    /// The line to send.
    pub fn to_line(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The line the reader gives for `stream` read in pieces of `step` bytes.
    fn framed(stream: &[u8], limit: usize, step: usize) -> Result<Option<Vec<u8>>, String> {
        let mut r = LineReader::new(limit);
        for piece in stream.chunks(step) {
            if let Some(line) = r.push(piece)? {
                return Ok(Some(line));
            }
        }
        Ok(None)
    }

    #[test]
    fn the_line_limit_counts_the_newline_however_the_reads_come() {
        let fits = [vec![b'a'; MAX_REQUEST - 1], b"\nafter".to_vec()].concat();
        let over = [vec![b'a'; MAX_REQUEST], b"\n".to_vec()].concat();
        for step in [1, 7, 4096, MAX_REQUEST, 2 * MAX_REQUEST] {
            assert_eq!(
                framed(&fits, MAX_REQUEST, step).unwrap().unwrap().len(),
                MAX_REQUEST - 1
            );
            let e = framed(&over, MAX_REQUEST, step).unwrap_err();
            assert!(e.contains("longer than 65536 bytes"), "{e}");
            assert_eq!(framed(&fits[..100], MAX_REQUEST, step), Ok(None));
        }
    }

    #[test]
    fn requests_are_strict() {
        assert_eq!(
            Op::parse(br#"{"v":1,"op":"status"}"#).unwrap(),
            Op::Status { v: 1 }
        );
        for (bad, want) in [
            (&br#"{"v":1,"op":"status","x":1}"#[..], "unknown field"),
            (br#"{"v":2,"op":"stop"}"#, "v: 2"),
            (br#"{"v":1,"op":"reboot"}"#, "unknown variant"),
            (
                br#"{"v":1,"op":"exec","user":"app","argv":["id"]}"#,
                "absolute path",
            ),
            (
                br#"{"v":1,"op":"exec","user":"app","argv":[]}"#,
                "absolute path",
            ),
            (
                br#"{"v":1,"op":"exec","user":"app","argv":["/bin/id"],"deadline_ms":0}"#,
                "deadline_ms",
            ),
            (b"not json", "not a request"),
        ] {
            let e = Op::parse(bad).unwrap_err();
            assert!(e.contains(want), "{}: {e}", String::from_utf8_lossy(bad));
        }
    }
}
