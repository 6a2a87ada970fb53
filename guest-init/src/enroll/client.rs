//! The enrollment exchange: send the persisted CSR with the token, get a certificate.
//!
//! One attempt ([`attempt`]) dials the service, writes the request line, reads one response
//! line, all under one deadline. Its failures are sorted into two kinds:
//! - **retryable**: the connection could not be made or broke, the deadline passed, the
//!   response was not a well-formed version-1 line, or the service answered a retryable
//!   code (`unavailable`, `timeout`, `busy`);
//! - **final**: the service answered a final code (`expired`, `csr_mismatch`, ...).
//!
//! [`exchange`] retries only the first kind, with capped exponential backoff and jitter
//! (from the clock's nanoseconds; the point is only to de-synchronize clones booted
//! together), up to `max_attempts`. Every attempt sends the *same* bytes: the caller passes
//! the persisted CSR, never a freshly signed one.
//!
//! The request line holds the token. It is built in a buffer sized up front (so it never
//! reallocates and leaves a copy behind) that is wiped on drop. Log lines carry the
//! endpoint, attempt number, the CSR's SHA-256 and error codes; never the token or the
//! request.

use std::time::Duration;

use base64::Engine;
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use super::material::{hex, Token};
use super::protocol::{self, ErrorCode, Request, Response, Status};
use vm_transport::Endpoint;

/// Backoff and attempt limits.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// First delay, in milliseconds.
    #[serde(default = "default_initial_ms")]
    pub initial_ms: u64,
    /// Largest delay, in milliseconds.
    #[serde(default = "default_max_ms")]
    pub max_ms: u64,
    /// Attempts in all (the first one included).
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
}

fn default_initial_ms() -> u64 {
    200
}
fn default_max_ms() -> u64 {
    5_000
}
fn default_max_attempts() -> u32 {
    20
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            initial_ms: default_initial_ms(),
            max_ms: default_max_ms(),
            max_attempts: default_max_attempts(),
        }
    }
}

impl RetryPolicy {
    /// The delay before attempt `n + 1` after `n` failures (n >= 1), jittered ±25 %.
    pub fn delay(&self, failures: u32) -> Duration {
        let exp = self
            .initial_ms
            .saturating_mul(1u64 << failures.saturating_sub(1).min(20))
            .min(self.max_ms);
        let nanos = crate::log::monotonic().subsec_nanos() as u64;
        let jitter = exp / 4;
        let ms = if jitter == 0 {
            exp
        } else {
            exp - jitter + nanos % (2 * jitter + 1)
        };
        Duration::from_millis(ms)
    }
}

/// How one attempt failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptError {
    /// Try again later. The string says what happened (no secrets).
    Retryable(String),
    /// Do not try again with this token and CSR.
    Final {
        /// The service's code.
        code: ErrorCode,
        /// The service's explanation, bounded.
        message: String,
    },
}

/// The service's answer after all attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExchangeError {
    /// A final error.
    Final {
        /// The service's code.
        code: ErrorCode,
        /// The service's explanation.
        message: String,
    },
    /// Every attempt failed with a retryable error; the last one is given.
    Exhausted {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        last: String,
    },
}

/// One attempt under `timeout`. Returns the DER certificate.
pub async fn attempt(
    service: &Endpoint,
    token: &Token,
    csr_der: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, AttemptError> {
    match tokio::time::timeout(timeout, attempt_inner(service, token, csr_der)).await {
        Ok(r) => r,
        Err(_) => Err(AttemptError::Retryable(format!(
            "no answer from {service} within {} ms",
            timeout.as_millis()
        ))),
    }
}

async fn attempt_inner(
    service: &Endpoint,
    token: &Token,
    csr_der: &[u8],
) -> Result<Vec<u8>, AttemptError> {
    let retry = |what: String| AttemptError::Retryable(what);
    let csr_b64 = base64::engine::general_purpose::STANDARD.encode(csr_der);
    let req = Request {
        v: protocol::VERSION,
        op: protocol::OP_ENROLL.into(),
        token: token.expose().into(),
        csr: csr_b64.into(),
    };
    let mut line = Zeroizing::new(Vec::with_capacity(protocol::MAX_LINE));
    serde_json::to_writer(&mut *line, &req)
        .map_err(|e| retry(format!("cannot encode the request: {e}")))?;
    drop(req);
    line.push(b'\n');
    if line.len() > protocol::MAX_LINE {
        return Err(AttemptError::Final {
            code: ErrorCode::BadRequest,
            message: format!("the request is larger than {} bytes", protocol::MAX_LINE),
        });
    }
    let mut conn = service
        .connect()
        .await
        .map_err(|e| retry(format!("cannot connect to {service}: {e}")))?;
    conn.write_all(&line)
        .await
        .map_err(|e| retry(format!("sending to {service} failed: {e}")))?;
    drop(line);
    let answer = protocol::read_line(&mut conn, protocol::MAX_LINE)
        .await
        .map_err(|e| retry(format!("reading the answer from {service} failed: {e}")))?;
    parse_answer(&answer, service)
}

/// Judges the service's answer line (without its `\n`): the DER certificate, or why not.
/// Pure; the fuzz target `enroll_reply` drives it.
pub fn parse_answer(answer: &[u8], service: &Endpoint) -> Result<Vec<u8>, AttemptError> {
    let retry = |what: String| AttemptError::Retryable(what);
    let resp: Response = serde_json::from_slice(answer).map_err(|e| {
        retry(format!(
            "the answer from {service} is not protocol JSON: {e}"
        ))
    })?;
    if resp.v != protocol::VERSION {
        return Err(retry(format!(
            "the answer from {service} has version {}, expected {}",
            resp.v,
            protocol::VERSION
        )));
    }
    match resp.status {
        Status::Ok => {
            let b64 = resp
                .certificate
                .ok_or_else(|| retry("an ok answer without a certificate".into()))?;
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|_| retry("the certificate is not base64".into()))
        }
        Status::Error => {
            let code = resp.code.unwrap_or(ErrorCode::Unknown);
            let mut message = resp.message.unwrap_or_default();
            message.truncate(
                (0..=message.len().min(300))
                    .rev()
                    .find(|&i| message.is_char_boundary(i))
                    .unwrap_or(0),
            );
            if code.retryable() {
                Err(retry(format!("{service} answered {code}: {message}")))
            } else {
                Err(AttemptError::Final { code, message })
            }
        }
    }
}

/// Attempts until a certificate, a final error, or `policy.max_attempts` retryable failures.
pub async fn exchange(
    service: &Endpoint,
    token: &Token,
    csr_der: &[u8],
    timeout: Duration,
    policy: &RetryPolicy,
) -> Result<Vec<u8>, ExchangeError> {
    let csr_hash = hex(&Sha256::digest(csr_der));
    let mut failures = 0u32;
    loop {
        crate::debug!(
            "enroll: attempt {} to {service}, csr sha256 {csr_hash}",
            failures + 1
        );
        match attempt(service, token, csr_der, timeout).await {
            Ok(cert) => return Ok(cert),
            Err(AttemptError::Final { code, message }) => {
                return Err(ExchangeError::Final { code, message })
            }
            Err(AttemptError::Retryable(why)) => {
                failures += 1;
                if failures >= policy.max_attempts.max(1) {
                    return Err(ExchangeError::Exhausted {
                        attempts: failures,
                        last: why,
                    });
                }
                let d = policy.delay(failures);
                crate::warn!(
                    "enroll: attempt {failures} failed (retryable): {why}; retrying in {} ms",
                    d.as_millis()
                );
                tokio::time::sleep(d).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let p = RetryPolicy {
            initial_ms: 100,
            max_ms: 1000,
            max_attempts: 5,
        };
        let d1 = p.delay(1).as_millis();
        let d3 = p.delay(3).as_millis();
        let d9 = p.delay(9).as_millis();
        assert!((75..=125).contains(&d1), "{d1}");
        assert!((300..=500).contains(&d3), "{d3}");
        assert!((750..=1250).contains(&d9), "{d9}");
    }
}
