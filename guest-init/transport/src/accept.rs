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
//! [`Options::reserve`], the loop first opens the socket the connection's dial will use
//! and hands it over with the connection; when none can be opened, callers wait in the
//! backlog instead. (The reserve is the dial's own socket rather than a spare closed
//! just before dialling: the same guarantee for two system calls fewer per connection.)
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

use nix::sys::socket::AddressFamily;

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
    /// With [`Options::reserve`]: the socket to dial with (non-blocking, close-on-exec,
    /// of the family the options named), opened before the connection was taken.
    pub reserve: Option<OwnedFd>,
}

/// How the loop runs.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Before accepting each connection, open the socket its dial will use: a stream
    /// socket of this family (the dial target's).
    pub reserve: Option<AddressFamily>,
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
    if let (Some(family), None) = (opts.reserve, &reserve) {
        *reserve = Some(crate::endpoint::new_socket(family)?);
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

    #[tokio::test]
    async fn every_queued_connection_is_handed_over_with_a_reserve() {
        let dir = tempfile::tempdir().unwrap();
        let ep = crate::Endpoint::Unix(dir.path().join("s"));
        let listener = ep.listen().unwrap();
        // More than one batch, all queued before the loop runs.
        let n = BATCH * 2 + 1;
        let clients: Vec<_> = (0..n)
            .map(|_| std::os::unix::net::UnixStream::connect(dir.path().join("s")).unwrap())
            .collect();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let opts = Options {
            reserve: Some(AddressFamily::Unix),
        };
        let on_accept = move |a: Accepted| {
            let _ = tx.send(a.reserve.is_some());
        };
        let on_error = |e: &io::Error, _: Failure, _: Duration| panic!("accept failed: {e}");
        let loop_ = tokio::spawn(async move { run(&listener, opts, on_accept, on_error).await });
        for i in 0..n {
            let reserved = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .unwrap_or_else(|_| panic!("connection {i} of {n} never handed over"))
                .unwrap();
            assert!(
                reserved,
                "connection {i} came without a reserved descriptor"
            );
        }
        loop_.abort();
        drop(clients);
    }

    /// A burst is drained a batch at a time: each wake-up takes up to [`BATCH`] queued
    /// connections, then the loop lets other work run. An observer polled between the
    /// loop's turns sees the count grow by whole batches.
    #[test]
    fn a_burst_is_taken_in_batches_between_which_other_tasks_run() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("s");
            let listener = crate::Endpoint::Unix(path.clone()).listen().unwrap();
            let n = BATCH * 3;
            let clients: Vec<_> = (0..n)
                .map(|_| std::os::unix::net::UnixStream::connect(&path).unwrap())
                .collect();
            let count = std::rc::Rc::new(std::cell::Cell::new(0));
            let c = std::rc::Rc::clone(&count);
            let on_accept = move |_: Accepted| c.set(c.get() + 1);
            let on_error = |e: &io::Error, _: Failure, _: Duration| panic!("accept failed: {e}");
            let accepting = run(&listener, Options::default(), on_accept, on_error);
            let observing = async {
                let mut seen = Vec::new();
                while count.get() < n {
                    if seen.last() != Some(&count.get()) {
                        seen.push(count.get());
                    }
                    tokio::task::yield_now().await;
                }
                seen
            };
            // Polled in this order on every wake-up: the observer, then one turn of the loop.
            let seen = tokio::select! {
                biased;
                seen = observing => seen,
                () = accepting => unreachable!("the accept loop ended"),
            };
            assert_eq!(seen, [0, BATCH, 2 * BATCH], "counts seen between turns");
            drop(clients);
        });
    }

    /// The name of the test below, which re-runs this test binary as its child.
    const EXHAUSTION_TEST: &str = "accept::tests::out_of_descriptors_the_loop_waits_doubling";

    /// Out of descriptors, the loop neither spins nor gives up: each failure is reported
    /// with a pause that doubles from [`BACKOFF_MIN`] to [`BACKOFF_MAX`], and the loop
    /// sleeps it. Runs in a child process (its own descriptor limit) on a paused clock, so
    /// the pauses pass in virtual time.
    #[test]
    fn out_of_descriptors_the_loop_waits_doubling() {
        if std::env::var_os("VM_TRANSPORT_EXHAUSTION_CHILD").is_some() {
            return exhaustion_child();
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                EXHAUSTION_TEST,
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("VM_TRANSPORT_EXHAUSTION_CHILD", "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        assert!(
            stdout.contains("1 passed"),
            "the child ran nothing: {stdout}"
        );
    }

    fn exhaustion_child() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let listener = crate::Endpoint::Unix(dir.path().join("s"))
                .listen()
                .unwrap();
            // Use up every descriptor the limit allows: the reserve cannot be opened.
            let (_, hard) =
                nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, 64, hard)
                .unwrap();
            let mut hold = Vec::new();
            while let Ok(fd) = nix::unistd::dup(std::io::stderr()) {
                hold.push(fd);
            }
            let mut seen = Vec::new();
            let on_error = |e: &io::Error, class: Failure, pause: Duration| {
                assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
                seen.push((class, pause));
            };
            let opts = Options {
                reserve: Some(AddressFamily::Unix),
            };
            let virtual_time = Duration::from_secs(3);
            let _ =
                tokio::time::timeout(virtual_time, run(&listener, opts, |_| {}, on_error)).await;
            let pauses: Vec<u128> = seen.iter().map(|(_, p)| p.as_millis()).collect();
            assert!(
                seen.iter().all(|(c, _)| *c == Failure::Exhausted),
                "{seen:?}"
            );
            // 5 + 10 + ... + 320 + 500 + 500 + ... ms fill the 3 s of virtual time.
            assert_eq!(
                pauses,
                [5, 10, 20, 40, 80, 160, 320, 500, 500, 500, 500, 500]
            );
        });
    }
}
