//! Tests of [`Conn`]: readiness shortcuts, what the kernel is asked to watch, and
//! the system calls a message costs.

use super::*;
use crate::endpoint::Endpoint;
use std::future::Future;

/// Polls a future once: its output if it completed without waiting for anything (in
/// particular, without a turn of the reactor), else `None`.
fn first_poll<F: Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    let mut cx = Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

/// A new connection's first bytes move in the same turn of the event loop that made
/// it: the dial completes in the call, the first write needs no writability report and
/// the first read no readability report. (Waiting for either costs a reactor turn per
/// connection; the benchmark's connection setup figure showed it.)
#[tokio::test]
async fn a_new_connection_moves_bytes_without_a_reactor_turn() {
    let dir = tempfile::tempdir().unwrap();
    let ep = Endpoint::Unix(dir.path().join("s"));
    let l = ep.listen().unwrap();
    let client = first_poll(ep.connect())
        .expect("a Unix connect completes in the call")
        .unwrap();
    first_poll(client.writable())
        .expect("nothing written yet: writable at once")
        .unwrap();
    first_poll(client.write_all(b"first"))
        .expect("the first write waited for the reactor")
        .unwrap();
    let (server, _) = l.try_accept().unwrap().expect("the connection is queued");
    let chunk = first_poll(server.read_pooled())
        .expect("the first read waited for the reactor")
        .unwrap()
        .unwrap();
    assert_eq!(&chunk[..], b"first");
    // Writes are tried before any readiness report, the later ones too.
    first_poll(server.write_all(b"x"))
        .expect("a write waited for the reactor")
        .unwrap();
    let mut buf = [0u8; 8];
    assert_eq!(client.read(&mut buf).await.unwrap(), 1);
}

thread_local! {
    /// `recv` calls made on this thread (tests run on a current-thread runtime).
    pub(super) static RECVS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A read that returns less than its buffer's room emptied the receive queue, so
/// the next read waits for the kernel's report without trying a `recv` that could
/// only fail with `EAGAIN`: one `recv` per message, not two.
#[tokio::test]
async fn a_short_read_costs_one_recv() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = crate::testing::pair(dir.path(), "s").await;
    let mut cx = Context::from_waker(std::task::Waker::noop());
    // The first read tries before any readiness report ([`Conn::read_pooled`]), so
    // the report of the bytes it took can still come after it: not counted.
    a.write_all(b"zero").await.unwrap();
    assert_eq!(&b.read_pooled().await.unwrap().unwrap()[..], b"zero");
    for msg in [&b"one"[..], b"two", b"three"] {
        a.write_all(msg).await.unwrap();
        // Let the reactor report the bytes, then count the reads that take them.
        tokio::task::yield_now().await;
        let before = RECVS.with(|n| n.get());
        let chunk = b.read_pooled().await.unwrap().unwrap();
        assert_eq!(&chunk[..], msg);
        let mut next = std::pin::pin!(b.read_pooled());
        assert!(
            next.as_mut().poll(&mut cx).is_pending(),
            "nothing more was sent"
        );
        assert_eq!(
            RECVS.with(|n| n.get()) - before,
            1,
            "a short read was followed by a recv that found nothing"
        );
    }
}

/// The `events` masks of every registration of `fd`'s socket (the descriptor or any
/// duplicate of it) in this process's epoll instances, as the kernel lists them in
/// `/proc/self/fdinfo` (`tfd: .. events: <hex> .. ino:<hex>`, matched by inode, since
/// descriptor numbers are reused by the tests running beside this one).
fn epoll_masks(fd: RawFd) -> Vec<u32> {
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap();
    let inode: u64 = link
        .to_str()
        .and_then(|l| l.strip_prefix("socket:["))
        .and_then(|l| l.strip_suffix(']'))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a socket: {link:?}"));
    // A registration is listed once per descriptor of its epoll instance (mio keeps
    // a duplicate of it), with the same line each time.
    let mut seen = std::collections::HashSet::new();
    let mut masks = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fdinfo").unwrap().flatten() {
        let Ok(info) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        for line in info.lines().filter(|l| l.starts_with("tfd:")) {
            if !seen.insert(line.to_string()) {
                continue;
            }
            let field = |name: &str| {
                let at = line.find(name).unwrap() + name.len();
                let v = line[at..].split_whitespace().next().unwrap();
                u64::from_str_radix(v, 16).unwrap()
            };
            if field("ino:") == inode {
                masks.push(field("events:") as u32);
            }
        }
    }
    masks
}

/// Seen from the kernel's side: a connection is registered for readability only, so
/// the peer reading what was sent wakes nobody. Only once a write finds the socket
/// full is a duplicate of it registered for writability, and the write then goes
/// through when the peer makes room.
#[tokio::test]
async fn only_reads_are_watched_until_a_write_finds_the_socket_full() {
    const EPOLLIN: u32 = libc::EPOLLIN as u32;
    const EPOLLOUT: u32 = libc::EPOLLOUT as u32;
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = crate::testing::pair(dir.path(), "s").await;
    a.write_all(b"x").await.unwrap();
    let masks = epoll_masks(a.as_raw_fd());
    assert_eq!(masks.len(), 1, "one registration: {masks:x?}");
    assert_ne!(masks[0] & EPOLLIN, 0, "not watched for reading: {masks:x?}");
    assert_eq!(
        masks[0] & EPOLLOUT,
        0,
        "watched for writing: every read by the peer would wake this process"
    );
    // Fill the socket until a write cannot go through.
    let filler = vec![7u8; 64 * 1024];
    let mut sent = 0usize;
    while let Ok(r) =
        tokio::time::timeout(std::time::Duration::from_millis(100), a.write_all(&filler)).await
    {
        r.unwrap();
        sent += filler.len();
    }
    let masks = epoll_masks(a.as_raw_fd());
    assert!(
        masks.iter().any(|m| m & EPOLLOUT != 0),
        "a full socket is not watched for room: {masks:x?}"
    );
    // The peer makes room: a blocked write goes through.
    let (w, got) = tokio::join!(a.write_all(b"last"), async {
        let mut got = 0usize;
        while got < 1 + sent + 4 {
            got += b.read_pooled().await.unwrap().unwrap().len();
        }
        got
    });
    w.unwrap();
    assert!(got >= 1 + sent + 4);
}

/// A dialled connection's first read waits for a readiness report: the service has
/// only just accepted, so a `recv` tried at once could only find nothing.
#[tokio::test]
async fn a_dialled_connection_waits_for_its_first_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let ep = Endpoint::Unix(dir.path().join("s"));
    let l = ep.listen().unwrap();
    let client = ep.connect().await.unwrap();
    let before = RECVS.with(|n| n.get());
    let mut read = std::pin::pin!(client.read_pooled());
    let mut cx = Context::from_waker(std::task::Waker::noop());
    assert!(read.as_mut().poll(&mut cx).is_pending());
    assert_eq!(
        RECVS.with(|n| n.get()),
        before,
        "a dialled connection tried a recv before any report"
    );
    let (server, _) = l.try_accept().unwrap().expect("the connection is queued");
    server.write_all(b"greeting").await.unwrap();
    assert_eq!(&read.await.unwrap().unwrap()[..], b"greeting");
}

/// The shortcut is for the first read only, and an empty socket still waits.
#[tokio::test]
async fn a_first_read_with_nothing_queued_waits() {
    let (a, b) = Conn::seqpacket_pair().unwrap();
    let read = a.read_pooled();
    let mut read = std::pin::pin!(read);
    let mut cx = Context::from_waker(std::task::Waker::noop());
    assert!(read.as_mut().poll(&mut cx).is_pending());
    b.write_all(b"late").await.unwrap();
    let chunk = read.await.unwrap().unwrap();
    assert_eq!(&chunk[..], b"late");
}

#[test]
fn only_vsock_sends_are_capped() {
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    assert_eq!(send_limit(&OwnedFd::from(a)), usize::MAX);
    match socket::socket(
        socket::AddressFamily::Vsock,
        socket::SockType::Stream,
        socket::SockFlag::empty(),
        None,
    ) {
        Ok(fd) => assert_eq!(send_limit(&fd), VSOCK_MAX_SEND),
        // The VM tests cover vsock where the host has no AF_VSOCK.
        Err(e) => eprintln!("no AF_VSOCK on this host ({e}); vsock half not run"),
    }
}

/// Every byte of a `Conn` and of the relay's state counts once per connection, thousands
/// of times in a burst (`docs/BENCHMARKS.md`, figure 4): the write watch is boxed and the
/// send limit kept in 32 bits so that neither grew past what they were before sockets
/// were registered for readability only (48 and 976 bytes then, 56 and 952 now).
#[tokio::test]
async fn a_connection_and_its_relay_stay_small() {
    let (a, b) = Conn::seqpacket_pair().unwrap();
    assert!(
        std::mem::size_of::<Conn>() <= 56,
        "Conn is {} bytes",
        std::mem::size_of::<Conn>()
    );
    let relay = crate::pump::relay(&a, &b);
    assert!(
        std::mem::size_of_val(&relay) <= 976,
        "the relay's future is {} bytes",
        std::mem::size_of_val(&relay)
    );
}
