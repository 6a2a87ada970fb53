//! Dialling a target with a bounded retry, and keeping the log small while doing it.
//!
//! When the host side is not up yet (the relay starting after the VM, a service
//! restarting), the dial is retried with an exponential backoff with jitter
//! ([`DialPolicy`]), bounded in attempts and in total time. Then the caller's connection
//! is closed with one log line naming the service, the target and the last error. Kata
//! users lived for years with hybrid-vsock dial stalls that said neither. Only errors that
//! may go away by themselves are retried ([`retryable`]); a permission or configuration
//! problem fails at once.
//!
//! Failure lines are rate limited ([`RateLimit`]) to one a second per listener, each
//! stating how many were suppressed, so a burst against a dead host cannot flood a slow
//! serial console.

use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vm_transport::{Conn, Endpoint};

use crate::debug;
use vm_transport::field::FieldError;

/// The bounded retry used when a target refuses or is missing.
///
/// Attempt `k` (from 1) that fails with a transient error is followed by a wait drawn
/// uniformly from `[b/2, b]`, where `b = min(backoff_initial_ms * 2^(k-1), backoff_max_ms)`;
/// the whole dial, waits included, is cut off after `timeout_ms`. With the defaults the
/// waits are at most 25, 50, 100, 200, 400, 800, 1000 ms: a target that appears within
/// about 2.5 s is reached, and a dead one is given up on within 5 s.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DialPolicy {
    /// Attempts in total, the first included (1 to 1000; default 8).
    pub attempts: u32,
    /// The first wait between attempts, in milliseconds (1 to 60000; default 25).
    pub backoff_initial_ms: u64,
    /// The longest wait between attempts, in milliseconds (at least `backoff_initial_ms`,
    /// at most 60000; default 1000).
    pub backoff_max_ms: u64,
    /// The bound on the whole dial, waits included, in milliseconds (1 to 600000;
    /// default 5000). A vsock connect to a host port nobody serves takes about 2 s to fail
    /// under hybrid vsock, so this, not `attempts`, is usually what ends a dial to a dead
    /// host.
    pub timeout_ms: u64,
}

impl Default for DialPolicy {
    fn default() -> Self {
        DialPolicy {
            attempts: 8,
            backoff_initial_ms: 25,
            backoff_max_ms: 1000,
            timeout_ms: 5000,
        }
    }
}

impl DialPolicy {
    pub(crate) fn check(&self, field: &str) -> Result<(), FieldError> {
        let bad =
            |sub: &str, reason: String| Err(FieldError::new(format!("{field}.{sub}"), reason));
        if !(1..=1000).contains(&self.attempts) {
            return bad(
                "attempts",
                format!("{} is out of range; use 1 to 1000", self.attempts),
            );
        }
        if !(1..=60_000).contains(&self.backoff_initial_ms) {
            return bad(
                "backoff_initial_ms",
                format!(
                    "{} is out of range; use 1 to 60000",
                    self.backoff_initial_ms
                ),
            );
        }
        if self.backoff_max_ms < self.backoff_initial_ms || self.backoff_max_ms > 60_000 {
            return bad(
                "backoff_max_ms",
                format!(
                    "{} is out of range; use backoff_initial_ms ({}) to 60000",
                    self.backoff_max_ms, self.backoff_initial_ms
                ),
            );
        }
        if !(1..=600_000).contains(&self.timeout_ms) {
            return bad(
                "timeout_ms",
                format!("{} is out of range; use 1 to 600000", self.timeout_ms),
            );
        }
        Ok(())
    }
}

pub(crate) fn suppressed_note(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" ({n} similar lines suppressed)")
    }
}

/// Why a dial gave up.
#[derive(Debug)]
pub(crate) struct DialFailure {
    pub(crate) attempts: u32,
    pub(crate) elapsed: Duration,
    pub(crate) error: io::Error,
}

/// Whether a dial error may go away by itself (the target is starting, or the system is
/// briefly short of resources), as opposed to a configuration or permission problem.
pub(crate) fn retryable(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::ECONNREFUSED
                | libc::ENOENT
                | libc::ETIMEDOUT
                | libc::ECONNRESET
                | libc::ECONNABORTED
                | libc::EAGAIN
                | libc::EINTR
                | libc::EADDRNOTAVAIL
                | libc::ENETUNREACH
                | libc::EHOSTUNREACH
                | libc::ENODEV
                | libc::ENETDOWN
                | libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
        )
    ) || e.kind() == io::ErrorKind::TimedOut
}

/// Dials `target` under `policy`: see [`DialPolicy`]. The first attempt uses `reserved`
/// when given (a socket of the target's family, [`Endpoint::connect_with`]).
pub(crate) async fn dial(
    target: &Endpoint,
    policy: &DialPolicy,
    mut reserved: Option<OwnedFd>,
) -> Result<Conn, DialFailure> {
    let start = Instant::now();
    let deadline = start + Duration::from_millis(policy.timeout_ms);
    let mut backoff = Duration::from_millis(policy.backoff_initial_ms);
    let max = Duration::from_millis(policy.backoff_max_ms);
    let attempts = policy.attempts.max(1);
    let mut attempt = 0;
    loop {
        attempt += 1;
        let remaining = deadline.saturating_duration_since(Instant::now());
        let error =
            match tokio::time::timeout(remaining, target.connect_with(reserved.take())).await {
                Ok(Ok(conn)) => {
                    debug!("reached {target} at attempt {attempt}");
                    return Ok(conn);
                }
                Ok(Err(e)) => e,
                Err(_elapsed) => io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "no answer within the dial timeout of {} ms",
                        policy.timeout_ms
                    ),
                ),
            };
        let left = deadline.saturating_duration_since(Instant::now());
        if !retryable(&error) || attempt >= attempts || left.is_zero() {
            return Err(DialFailure {
                attempts: attempt,
                elapsed: start.elapsed(),
                error,
            });
        }
        tokio::time::sleep(jitter(backoff).min(left)).await;
        backoff = (backoff * 2).min(max);
    }
}

/// A wait drawn uniformly from `[b/2, b]`, so that many connections refused at once do
/// not retry in lock step.
pub(crate) fn jitter(b: Duration) -> Duration {
    let half = b / 2;
    let span = (b - half).as_micros() as u64;
    let r = std::hash::RandomState::new().build_hasher().finish();
    half + Duration::from_micros(if span == 0 { 0 } else { r % (span + 1) })
}

/// Lets one line through per interval and counts the ones held back.
#[derive(Debug, Default)]
pub(crate) struct RateLimit {
    state: Mutex<(Option<Instant>, u64)>,
}

const LOG_INTERVAL: Duration = Duration::from_secs(1);

impl RateLimit {
    /// `Some(n)`: log now, `n` lines were suppressed since the last one. `None`: suppress.
    pub(crate) fn allow(&self) -> Option<u64> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        match st.0 {
            Some(last) if now.duration_since(last) < LOG_INTERVAL => {
                st.1 += 1;
                None
            }
            _ => {
                let n = st.1;
                *st = (Some(now), 0);
                Some(n)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_transient_dial_errors_are_retried() {
        let e = |n| io::Error::from_raw_os_error(n);
        for n in [
            libc::ECONNREFUSED,
            libc::ENOENT,
            libc::ETIMEDOUT,
            libc::ECONNRESET,
        ] {
            assert!(retryable(&e(n)), "{n}");
        }
        for n in [
            libc::EACCES,
            libc::EINVAL,
            libc::EAFNOSUPPORT,
            libc::ENOTDIR,
        ] {
            assert!(!retryable(&e(n)), "{n}");
        }
    }

    #[test]
    fn jitter_stays_in_range() {
        for ms in [1u64, 2, 25, 1000] {
            let b = Duration::from_millis(ms);
            for _ in 0..100 {
                let j = jitter(b);
                assert!(j >= b / 2 && j <= b, "{j:?} for {b:?}");
            }
        }
    }

    #[test]
    fn jitter_spreads_over_the_whole_range() {
        // The smallest span: both ends, b/2 and b, must come up (each with probability
        // 1/2 per draw; missing one in 200 draws has probability 2^-199).
        let b = Duration::from_micros(2);
        let seen: std::collections::BTreeSet<Duration> = (0..200).map(|_| jitter(b)).collect();
        assert_eq!(
            seen.into_iter().collect::<Vec<_>>(),
            [Duration::from_micros(1), b]
        );
        // A wide span: connections refused at once do not retry in lock step.
        let b = Duration::from_secs(1);
        let seen: std::collections::BTreeSet<Duration> = (0..20).map(|_| jitter(b)).collect();
        assert!(seen.len() > 1, "every wait was {seen:?}");
    }

    #[test]
    fn each_policy_field_is_checked_at_its_bounds() {
        let with = |f: fn(&mut DialPolicy)| {
            let mut p = DialPolicy::default();
            f(&mut p);
            p.check("services[0].dial").map_err(|e| e.to_string())
        };
        // The extremes of every range are accepted.
        for ok in [
            with(|p| p.attempts = 1),
            with(|p| p.attempts = 1000),
            with(|p| {
                p.backoff_initial_ms = 1;
                p.backoff_max_ms = 1;
            }),
            with(|p| {
                p.backoff_initial_ms = 60_000;
                p.backoff_max_ms = 60_000;
            }),
            with(|p| p.timeout_ms = 1),
            with(|p| p.timeout_ms = 600_000),
        ] {
            assert_eq!(ok, Ok(()));
        }
        // One past each end is refused, naming the field.
        type Edit = fn(&mut DialPolicy);
        let refused: [(Edit, &str); 8] = [
            (|p| p.attempts = 0, "attempts"),
            (|p| p.attempts = 1001, "attempts"),
            (|p| p.backoff_initial_ms = 0, "backoff_initial_ms"),
            (
                |p| {
                    p.backoff_initial_ms = 60_001;
                    p.backoff_max_ms = 60_001;
                },
                "backoff_initial_ms",
            ),
            (
                |p| p.backoff_max_ms = p.backoff_initial_ms - 1,
                "backoff_max_ms",
            ),
            (|p| p.backoff_max_ms = 60_001, "backoff_max_ms"),
            (|p| p.timeout_ms = 0, "timeout_ms"),
            (|p| p.timeout_ms = 600_001, "timeout_ms"),
        ];
        for (f, field) in refused {
            let e = with(f).unwrap_err();
            assert!(
                e.starts_with(&format!("services[0].dial.{field}")),
                "{field}: {e}"
            );
        }
    }

    #[test]
    fn suppressed_lines_are_counted_in_the_next_line() {
        assert_eq!(suppressed_note(0), "");
        assert_eq!(suppressed_note(3), " (3 similar lines suppressed)");
    }

    #[tokio::test]
    async fn the_backoff_grows_so_a_dead_target_costs_few_attempts() {
        // 1000 attempts allowed within 1 s: with waits doubling from 1 ms, even the
        // shortest draws (half of each) before the 12th attempt add up to
        // 0.5 + 1 + 2 + ... + 512 = 1023.5 ms, so the time bound ends the dial at the
        // 12th attempt at the latest (one attempt may fall on the deadline itself). A
        // backoff that does not grow would make hundreds. A slow machine makes fewer.
        let dir = tempfile::tempdir().unwrap();
        let policy = DialPolicy {
            attempts: 1000,
            backoff_initial_ms: 1,
            backoff_max_ms: 60_000,
            timeout_ms: 1000,
        };
        let f = dial(&Endpoint::Unix(dir.path().join("none")), &policy, None)
            .await
            .unwrap_err();
        assert!(f.attempts <= 12, "{} attempts", f.attempts);
        assert!(f.attempts >= 2, "the dead target was not retried");
    }

    #[test]
    fn rate_limit_lets_one_line_through_and_counts_the_rest() {
        let r = RateLimit::default();
        assert_eq!(r.allow(), Some(0));
        assert_eq!(r.allow(), None);
        assert_eq!(r.allow(), None);
        r.state.lock().unwrap().0 = Some(Instant::now() - LOG_INTERVAL);
        assert_eq!(r.allow(), Some(2));
    }

    #[tokio::test]
    async fn dial_gives_up_after_the_configured_attempts() {
        let dir = tempfile::tempdir().unwrap();
        let policy = DialPolicy {
            attempts: 3,
            backoff_initial_ms: 1,
            backoff_max_ms: 2,
            timeout_ms: 60_000,
        };
        let f = dial(&Endpoint::Unix(dir.path().join("none")), &policy, None)
            .await
            .unwrap_err();
        assert_eq!(f.attempts, 3);
        assert_eq!(f.error.raw_os_error(), Some(libc::ENOENT));
        // A permanent error (a path through a regular file) is not retried.
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let f = dial(&Endpoint::Unix(file.join("sock")), &policy, None)
            .await
            .unwrap_err();
        assert_eq!(f.error.raw_os_error(), Some(libc::ENOTDIR));
        assert_eq!(f.attempts, 1, "{}", f.error);
    }
}
