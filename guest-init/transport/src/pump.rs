//! The pump: moves bytes between two connected sockets, exactly as they arrive.
//!
//! Contract (what the forwarder and the host relay promise the app):
//! - **Byte-exact.** Every chunk one `recv` returns is written whole, in order, before the
//!   next `recv` on that direction. Nothing is split, joined, reordered or rewritten. An app
//!   that reads a greeting with one `recv` (Radicale reads Dovecot's with one
//!   `recv(1024)`) therefore sees what it would see natively, up to what the transport
//!   itself does to segment boundaries.
//! - **Half-close is passed on, never relied on.** End of stream on one side becomes
//!   `shutdown(SHUT_WR)` on the other, and the opposite direction keeps flowing until it
//!   ends too. Transports that turn a half-close into a full close (Firecracker,
//!   vhost-device-vsock) then simply end both directions.
//! - **Drain before close.** An error on one direction ends only that direction; bytes
//!   already in flight the other way are still delivered (a service that replies and then
//!   closes must not lose its reply because our write towards it failed).
//! - **Idle or blocked costs no buffer.** A direction first waits until its destination
//!   can take data, then until its source has some, and only then takes a buffer from a
//!   shared pool, for as long as that one chunk is in flight. Bytes that cannot move yet
//!   wait in the kernel's socket buffers, not in ours. A burst of thousands of mostly idle
//!   connections costs their sockets and task state, not 2 × 64 KiB each (the burst
//!   figures are in `docs/BENCHMARKS.md`). Waiting for the destination first matters in a
//!   burst: a freshly connected socket is reported writable only on the reactor's next
//!   turn, and reading first would hold a buffer per new connection until then.
//!   A buffer is still held across a wait when a destination takes only part of a chunk
//!   (a vsock peer short of credit), one per such stalled direction.
//!
//! The buffers come from [`crate::pool`]. Between two Unix stream sockets, a direction
//! whose read fills a whole buffer (a bulk flow) moves the rest of its chunks with
//! `splice(2)` through pooled pipes instead, under the same contract ([`crate::splice`]).

use std::future::Future;
use std::io;

use crate::conn::Conn;

/// Bytes moved by [`relay`], and how each direction ended.
#[derive(Debug)]
pub struct Totals {
    /// Bytes from `a` to `b`.
    pub a_to_b: u64,
    /// Bytes from `b` to `a`.
    pub b_to_a: u64,
    /// The first error of either direction, if any ended in one.
    pub error: Option<io::Error>,
}

/// Copies one direction until end of stream or an error, then half-closes `to`.
/// Returns the bytes moved, or the error that ended the direction.
pub async fn copy(from: &Conn, to: &Conn) -> io::Result<u64> {
    let result = copy_buffered(from, to).await;
    // Pass the end on; if `to` is already gone there is nobody to tell.
    let _ = to.shutdown_write();
    result
}

/// Copies one direction through pooled buffers (any transport). A read that fills a
/// whole buffer between two Unix stream sockets marks a bulk flow: the rest of the
/// direction goes through [`crate::splice`], whose larger state is allocated then and
/// only then, so the thousands of small connections of a burst do not carry it.
async fn copy_buffered(from: &Conn, to: &Conn) -> io::Result<u64> {
    let mut total = 0u64;
    loop {
        // Destination first, so a chunk is never read before it can be written.
        to.writable().await?;
        let Some(chunk) = from.read_pooled().await? else {
            return Ok(total);
        };
        to.write_all(&chunk).await?;
        total += chunk.len() as u64;
        if chunk.len() == crate::pool::CHUNK && from.splices() && to.splices() {
            drop(chunk);
            return Ok(total + Box::pin(crate::splice::copy(from, to)).await?);
        }
    }
}

/// How one direction of [`relay`] ended without an error.
enum Ended {
    /// End of stream, passed on as a half-close: the other direction may still flow.
    HalfClosed(u64),
    /// End of stream from a source that had closed entirely: nothing can be delivered to
    /// it any more, so the relay ends at once.
    SourceGone(u64),
}

/// One direction of [`relay`]: [`copy`], except that the end of a source that has closed
/// entirely is not passed on as a half-close. The relay closes both sockets at once
/// instead, and the far end sees one close, not a half-close and later a close (two
/// wake-ups where one does, on every hop of a chain).
async fn direction(from: &Conn, to: &Conn) -> io::Result<Ended> {
    match copy_buffered(from, to).await {
        Ok(n) if from.hung_up() => Ok(Ended::SourceGone(n)),
        result => {
            let _ = to.shutdown_write();
            result.map(Ended::HalfClosed)
        }
    }
}

/// The rest of [`relay`] once one direction has ended with `first`: the other direction
/// (towards `peer`) runs on until it ends or `peer` is gone, unless `peer` had already
/// gone. Returns both directions' results, the first one first.
async fn finish(
    first: io::Result<Ended>,
    peer: &Conn,
    other: impl Future<Output = io::Result<Ended>>,
) -> (io::Result<u64>, io::Result<u64>) {
    let gone = || io::Error::new(io::ErrorKind::BrokenPipe, "the peer closed the connection");
    match first {
        Ok(Ended::SourceGone(n)) => (Ok(n), Err(gone())),
        first => {
            // Boxed: only a half-closed connection gets here, and the watch would
            // otherwise enlarge every connection's task (see `crate::pool`'s burst).
            let rest = tokio::select! {
                r = other => r.map(Ended::bytes),
                g = Box::pin(peer.peer_gone()) => Err(g.err().unwrap_or_else(gone)),
            };
            (first.map(Ended::bytes), rest)
        }
    }
}

/// Relays both directions between `a` and `b` until both have ended.
///
/// A direction also ends when its destination's peer has gone entirely (`HUP`) after the
/// opposite direction ended: nothing can be delivered there any more. Without this, an
/// app that closes its socket while the far side keeps quiet would pin the connection
/// forever on transports that do not pass a half-close on (vhost-device-vsock 0.3.0 does
/// not: every closed sign-in stayed open in the relay and the VMM). When the peer had
/// already gone at its end of stream (the usual close of a finished request), the relay
/// ends right there, without passing a half-close on or waiting for the far side.
pub async fn relay(a: &Conn, b: &Conn) -> Totals {
    let ab = direction(a, b);
    let ba = direction(b, a);
    tokio::pin!(ab, ba);
    let (ab, ba) = tokio::select! {
        // `a` sent its end; `ba` writes to `a`.
        r = &mut ab => finish(r, a, &mut ba).await,
        r = &mut ba => {
            let (r, rest) = finish(r, b, &mut ab).await;
            (rest, r)
        }
    };
    let (mut error, mut a_to_b, mut b_to_a) = (None, 0, 0);
    match ab {
        Ok(n) => a_to_b = n,
        Err(e) => error = Some(e),
    }
    match ba {
        Ok(n) => b_to_a = n,
        Err(e) => {
            error.get_or_insert(e);
        }
    }
    Totals {
        a_to_b,
        b_to_a,
        error,
    }
}

impl Ended {
    fn bytes(self) -> u64 {
        match self {
            Ended::HalfClosed(n) | Ended::SourceGone(n) => n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::pair;

    #[tokio::test]
    async fn relays_both_ways_and_passes_half_close() {
        let dir = tempfile::tempdir().unwrap();
        let (client, relay_a) = pair(dir.path(), "a").await;
        let (relay_b, server) = pair(dir.path(), "b").await;
        let task = tokio::spawn(async move { relay(&relay_a, &relay_b).await });
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (w, r) = tokio::join!(
            async {
                client.write_all(&data).await.unwrap();
                client.shutdown_write().unwrap();
            },
            async {
                let mut got = Vec::new();
                loop {
                    match server.read_pooled().await.unwrap() {
                        Some(c) => got.extend_from_slice(&c),
                        None => break got,
                    }
                }
            }
        );
        let () = w;
        assert_eq!(r, data, "bytes must arrive unchanged and in order");
        // The other direction still flows after the half-close.
        server.write_all(b"reply").await.unwrap();
        drop(server);
        let mut buf = [0u8; 16];
        let n = client.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"reply");
        assert_eq!(client.read(&mut buf).await.unwrap(), 0);
        let t = task.await.unwrap();
        assert_eq!(t.a_to_b, data.len() as u64);
        assert_eq!(t.b_to_a, 5);
    }

    /// The app closes its socket after its request; the service keeps its connection open
    /// and says nothing more. Once the request's end has been passed on, the relay must
    /// see that the app is gone and end, not wait for the service forever (a transport
    /// that drops half-closes would otherwise pin every such connection). And since the
    /// app had gone entirely, the end reaches the service as the relay's close, not as a
    /// half-close followed later by a close (a wake-up more on every hop of a chain): the
    /// moment the service reads the end, a reply already fails with `EPIPE`.
    #[tokio::test]
    async fn a_closed_caller_ends_the_relay_though_the_service_stays_silent() {
        use nix::sys::socket::{send, MsgFlags};
        use std::os::fd::AsRawFd;

        let dir = tempfile::tempdir().unwrap();
        let (client, relay_a) = pair(dir.path(), "a").await;
        let (relay_b, server) = pair(dir.path(), "b").await;
        let task = tokio::spawn(async move { relay(&relay_a, &relay_b).await });
        client.write_all(b"request").await.unwrap();
        drop(client);
        let mut got = Vec::new();
        while let Some(c) = server.read_pooled().await.unwrap() {
            got.extend_from_slice(&c);
        }
        assert_eq!(got, b"request");
        // No await between the end and this send: on this single-threaded runtime the
        // relay cannot close its socket in between, so only a relay that had already
        // closed (rather than half-closed) it makes the send fail.
        let reply = send(server.as_raw_fd(), b"late", MsgFlags::MSG_NOSIGNAL);
        assert_eq!(
            reply,
            Err(nix::errno::Errno::EPIPE),
            "the relay passed a half-close on for a caller that had gone entirely"
        );
        // `server` stays open and silent. A hang here is the bug; 30 s only bounds it.
        let totals = tokio::time::timeout(std::time::Duration::from_secs(30), task)
            .await
            .expect("the relay kept a connection whose caller had gone")
            .unwrap();
        assert_eq!(totals.a_to_b, 7);
        drop(server);
    }

    /// The mirror case: the service closes its connection while the app keeps its socket
    /// open and silent. The service's end is passed on, the service is gone, so the relay
    /// ends (a host relay would otherwise hold the service's slot for as long as the app
    /// sits on a dead connection).
    #[tokio::test]
    async fn a_closed_service_ends_the_relay_though_the_caller_stays_silent() {
        let dir = tempfile::tempdir().unwrap();
        let (client, relay_a) = pair(dir.path(), "a").await;
        let (relay_b, server) = pair(dir.path(), "b").await;
        let task = tokio::spawn(async move { relay(&relay_a, &relay_b).await });
        client.write_all(b"q").await.unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(server.read(&mut buf).await.unwrap(), 1);
        drop(server);
        assert_eq!(
            client.read(&mut buf).await.unwrap(),
            0,
            "the service's end passed on"
        );
        // `client` stays open and silent. A hang here is the bug; 30 s only bounds it.
        tokio::time::timeout(std::time::Duration::from_secs(30), task)
            .await
            .expect("the relay kept a connection whose service had gone")
            .unwrap();
        drop(client);
    }

    /// A half-close is not a close: the caller that only shut its sending side still gets
    /// the reply, however late it comes.
    #[tokio::test]
    async fn a_half_closed_caller_still_gets_a_late_reply() {
        let dir = tempfile::tempdir().unwrap();
        let (client, relay_a) = pair(dir.path(), "a").await;
        let (relay_b, server) = pair(dir.path(), "b").await;
        tokio::spawn(async move { relay(&relay_a, &relay_b).await });
        client.write_all(b"q").await.unwrap();
        client.shutdown_write().unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(server.read(&mut buf).await.unwrap(), 1);
        assert_eq!(server.read(&mut buf).await.unwrap(), 0);
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        server.write_all(b"late").await.unwrap();
        drop(server);
        let n = client.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"late");
    }

    #[tokio::test]
    async fn nothing_is_read_while_the_destination_cannot_take_it() {
        use nix::sys::socket::{recv, MsgFlags};
        use std::os::fd::AsRawFd;
        use std::time::Duration;

        let dir = tempfile::tempdir().unwrap();
        let (client, relay_a) = pair(dir.path(), "a").await;
        let (relay_b, server) = pair(dir.path(), "b").await;
        // Fill the way to the server, which is not reading, until a write would block.
        let filler = vec![0u8; 4096];
        let mut filled = 0usize;
        while tokio::time::timeout(Duration::from_millis(50), relay_b.write_all(&filler))
            .await
            .is_ok()
        {
            filled += filler.len();
        }
        assert!(filled > 0);
        let payload: Vec<u8> = (1..=200u8).cycle().take(1000).collect();
        client.write_all(&payload).await.unwrap();
        let source = relay_a.as_raw_fd();
        let task = tokio::spawn(async move {
            copy(&relay_a, &relay_b).await.unwrap();
            (relay_a, relay_b)
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The payload still waits in the kernel, not in one of the pump's buffers.
        let mut peek = [0u8; 2000];
        let queued = recv(
            source,
            &mut peek,
            MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
        );
        assert_eq!(
            queued,
            Ok(payload.len()),
            "the pump read before it could write"
        );
        // Once the server reads, everything arrives, the payload last and unchanged.
        client.shutdown_write().unwrap();
        let mut got = Vec::new();
        while let Some(c) = server.read_pooled().await.unwrap() {
            got.extend_from_slice(&c);
        }
        assert!(got.len() > payload.len());
        assert_eq!(&got[got.len() - payload.len()..], &payload[..]);
        assert!(got[..got.len() - payload.len()].iter().all(|&b| b == 0));
        drop(task.await.unwrap());
    }

    #[tokio::test]
    async fn one_chunk_is_written_whole() {
        // A greeting written in one call arrives in one read on the far side of the relay,
        // and so does a request the other way. Both far ends are record sockets, which
        // would show a split.
        let (client, relay_a) = Conn::seqpacket_pair().unwrap();
        let (relay_b, server) = Conn::seqpacket_pair().unwrap();
        tokio::spawn(async move { relay(&relay_a, &relay_b).await });
        let greeting =
            b"VERSION\t1\t2\nMECH\tPLAIN\tplaintext\nSPID\t1\nCUID\t1\nCOOKIE\t0123\nDONE\n";
        server.write_all(greeting).await.unwrap();
        let mut buf = [0u8; 1024];
        let n = client.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], greeting);
        let request = b"VERSION\t1\t1\nCPID\t9\nAUTH\t1\tPLAIN\tservice=x\tresp=AA==\n";
        client.write_all(request).await.unwrap();
        let n = server.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], request);
    }
}
