//! The accept loop: one table of accept errors, one backoff, and a loop that never ends.
//!
//! A peer's lesson: one failed `accept` ended an accept loop, and every later caller hung.
//! So [`run`] only returns when its caller drops it. Each error is classified once, here:
//! - **Skip**: the connection died or was refused before we took it (`ECONNABORTED`,
//!   `EPROTO`, the network errors `accept(2)` passes on from the new socket...). Take the
//!   next one at once.
//! - **Exhausted**: out of descriptors or memory (`EMFILE`, `ENFILE`, `ENOBUFS`,
//!   `ENOMEM`). The connection stays queued, so retrying at once would spin: pause, from
//!   [`BACKOFF_MIN`] doubling to [`BACKOFF_MAX`], until an accept succeeds.
//! - **Other**: anything unexpected. Pause the same way rather than spin.
//!
//! **Reserving a descriptor.** A forwarder must dial for every caller it accepts. Out of
//! descriptors, it would accept callers it cannot dial for: each holds the last free
//! descriptor while its dial fails, and they starve one another. With
//! [`Options::reserve`], the loop first opens a spare descriptor and hands it over with
//! the connection, to be closed just before dialling; when none can be opened, callers
//! wait in the backlog instead.
//!
//! **Draining.** When the listener is readable, queued connections are taken one after
//! another until the queue is empty (or [`BATCH`] were taken, then the loop yields once so
//! their tasks run) before the loop waits again, so a burst costs one wake-up, not one
//! reactor turn per caller, and an empty queue costs one `EAGAIN`, after which the
//! readiness is cleared and the loop waits for the kernel's next report. Each connection
//! goes straight to the caller's handler, which spawns its task.
//!
//! Logging is the caller's: guest-init writes console lines, host-relay uses `tracing`.
//! The error callback is told the class and the pause, and rate-limits as it likes.

use std::io;
use std::os::fd::OwnedFd;
use std::time::Duration;

use nix::sys::socket::{self, AddressFamily, SockFlag, SockType};

use crate::conn::Conn;
use crate::listener::{Listener, Peer};

/// The first pause after an exhausted or unexpected accept error.
pub const BACKOFF_MIN: Duration = Duration::from_millis(5);
/// The longest pause.
pub const BACKOFF_MAX: Duration = Duration::from_millis(500);
/// How many queued connections are taken before the loop yields to other tasks.
pub const BATCH: usize = 64;

/// How an accept error is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The connection died or was refused before we took it; take the next one.
    Skip,
    /// Out of descriptors or memory: the connection stays queued, so wait a little.
    Exhausted,
    /// Anything else: wait a little rather than spin.
    Other,
}

/// Classifies an accept error.
pub fn classify(e: &io::Error) -> Failure {
    match e.raw_os_error() {
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => Failure::Exhausted,
        // accept(2): "Linux accept() passes already-pending network errors on the new
        // socket as an error code from accept()"; treat them like EAGAIN.
        Some(
            libc::ECONNABORTED
            | libc::EINTR
            | libc::EAGAIN
            | libc::EPROTO
            | libc::EPERM
            | libc::ENETDOWN
            | libc::ENOPROTOOPT
            | libc::EHOSTDOWN
            | libc::ENONET
            | libc::EHOSTUNREACH
            | libc::EOPNOTSUPP
            | libc::ENETUNREACH
            | libc::ECONNRESET,
        ) => Failure::Skip,
        _ => Failure::Other,
    }
}

/// The pause after a failure of class `f`, given the previous pause.
pub fn backoff(f: Failure, previous: Duration) -> Duration {
    match f {
        Failure::Skip => Duration::ZERO,
        Failure::Exhausted | Failure::Other => (previous * 2).clamp(BACKOFF_MIN, BACKOFF_MAX),
    }
}

/// One accepted connection.
#[derive(Debug)]
pub struct Accepted {
    /// The connection.
    pub conn: Conn,
    /// Who is calling, as the kernel reports it.
    pub peer: Peer,
    /// With [`Options::reserve`]: a spare descriptor to close just before dialling.
    pub reserve: Option<OwnedFd>,
}

/// How the loop runs.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Reserve a descriptor for each connection's dial before accepting it.
    pub reserve: bool,
}

/// Accepts until dropped: each connection goes to `on_accept`, each error to `on_error`
/// with its class and the pause that follows.
pub async fn run(
    listener: &Listener,
    opts: Options,
    mut on_accept: impl FnMut(Accepted),
    mut on_error: impl FnMut(&io::Error, Failure, Duration),
) {
    let mut pause = Duration::ZERO;
    // A reserve opened for a caller that was not there (the queue had emptied) is kept for
    // the next one, so each connection costs one `socket` and one `close` for it, not more.
    let mut reserve: Option<OwnedFd> = None;
    loop {
        if let Err(e) = top_up(opts, &mut reserve) {
            pause = fail(&e, pause, &mut on_error).await;
            continue;
        }
        let mut guard = match listener.readiness().readable().await {
            Ok(g) => g,
            Err(e) => {
                pause = fail(&e, pause, &mut on_error).await;
                continue;
            }
        };
        // Drain what is queued without waiting for another wake-up.
        let mut taken = 0;
        let mut failed = None;
        while taken < BATCH {
            if let Err(e) = top_up(opts, &mut reserve) {
                failed = Some(e);
                break;
            }
            match listener.try_accept() {
                Ok(Some((conn, peer))) => {
                    pause = Duration::ZERO;
                    taken += 1;
                    on_accept(Accepted {
                        conn,
                        peer,
                        reserve: reserve.take(),
                    });
                }
                Ok(None) => {
                    // The queue is empty: wait for the kernel's next report. (A connection
                    // that arrived since is a newer event, which this does not clear.)
                    guard.clear_ready();
                    break;
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        drop(guard);
        if let Some(e) = failed {
            pause = fail(&e, pause, &mut on_error).await;
        } else if taken >= BATCH {
            // Let the connections just taken (and everything else) run.
            tokio::task::yield_now().await;
        }
    }
}

/// Opens the reserve descriptor when the options ask for one and none is held.
fn top_up(opts: Options, reserve: &mut Option<OwnedFd>) -> io::Result<()> {
    if opts.reserve && reserve.is_none() {
        *reserve = Some(reserve_descriptor()?);
    }
    Ok(())
}

async fn fail(
    e: &io::Error,
    previous: Duration,
    on_error: &mut impl FnMut(&io::Error, Failure, Duration),
) -> Duration {
    let class = classify(e);
    let pause = backoff(class, previous);
    on_error(e, class, pause);
    if !pause.is_zero() {
        tokio::time::sleep(pause).await;
    }
    pause
}

/// Holds one descriptor slot for a connection's dial.
fn reserve_descriptor() -> io::Result<OwnedFd> {
    Ok(socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_table_for_every_listener() {
        let e = |n| io::Error::from_raw_os_error(n);
        assert_eq!(classify(&e(libc::EMFILE)), Failure::Exhausted);
        assert_eq!(classify(&e(libc::ENOBUFS)), Failure::Exhausted);
        assert_eq!(classify(&e(libc::ECONNABORTED)), Failure::Skip);
        assert_eq!(classify(&e(libc::EPROTO)), Failure::Skip);
        assert_eq!(classify(&e(libc::EBADF)), Failure::Other);
        assert_eq!(backoff(Failure::Skip, BACKOFF_MAX), Duration::ZERO);
        assert_eq!(backoff(Failure::Exhausted, Duration::ZERO), BACKOFF_MIN);
        assert_eq!(backoff(Failure::Other, BACKOFF_MIN), BACKOFF_MIN * 2);
        assert_eq!(
            backoff(Failure::Exhausted, Duration::from_secs(9)),
            BACKOFF_MAX
        );
    }
}
