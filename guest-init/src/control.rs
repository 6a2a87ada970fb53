//! The control port: how the host asks a running VM to stop.
//!
//! Protocol (`docs/CONTRACTS.md`): one line per request. `stop\n` answers `ok stopping\n`
//! and starts the orderly shutdown, the same path SIGTERM takes; `ping\n` answers
//! `ok pong\n`; anything else answers `error unknown command\n`. The listener is usually
//! vsock port 1024 (`{"vsock": {"cid": 4294967295, "port": 1024}}`); tests use a Unix path.
//!
//! Threat: who may stop the VM. Stopping is what the host can do anyway by killing the
//! VMM, so the port grants the host nothing new; it must grant nobody else anything.
//! Other VMs cannot reach this VM's vsock, but the guest itself can: once the
//! `vsock_loopback` transport is loaded, a process inside the VM connects to the guest's
//! own port from CID 1 (`VMADDR_CID_LOCAL`), and the app could stop its own VM. The peer
//! CID of a vsock connection is set by the kernel, never by the peer, so [`admit`] takes a
//! vsock peer only from CID 2 (`VMADDR_CID_HOST`): the host (through a hybrid-vsock VMM
//! or vhost-vsock, host-initiated connections arrive from CID 2). Every other peer (CID 1,
//! another guest's CID, a TCP peer, which nothing distinguishes from the app or the
//! network) is answered `ERR not the host`, closed, and logged with its address, before
//! any request is read. A Unix path is reachable only by processes inside the VM: the
//! socket is created mode 0600 owned by root, so the app (which runs as its own user
//! without capabilities) cannot connect to it; tests use it.
//!
//! Robustness: each connection is its own task, with a bounded line (64 bytes) and a read
//! timeout, so a client that sends garbage or nothing affects only itself, and errors end
//! only that connection, never the accept loop. After `ok stopping` the reply is
//! half-closed and the task waits briefly for the host's end of stream before it triggers
//! the shutdown: a guest that writes and powers off at once can lose its last bytes on
//! vsock.

use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;
use tokio::task::JoinHandle;

use crate::{debug, warn};
use vm_transport::mode::SocketMode;
use vm_transport::publish::{self, Access};
use vm_transport::vsock::VMADDR_CID_HOST;
use vm_transport::{Conn, Endpoint, Listener, Peer};

/// The host's vsock CID.
pub const HOST_CID: u32 = VMADDR_CID_HOST;
/// The answer to a peer that is not the host.
const REFUSED: &[u8] = b"ERR not the host\n";

/// Longest request line accepted.
const MAX_LINE: usize = 64;
/// How long a client may take to send its line.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait for the host to close after `ok stopping`. (Long in unit tests, so
/// that the test of the wait cannot lose a race against it on a loaded machine.)
const LINGER: Duration = if cfg!(test) {
    Duration::from_secs(10)
} else {
    Duration::from_millis(500)
};

/// A control listener that could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen at {endpoint}: {source}")]
pub struct ControlError {
    endpoint: String,
    #[source]
    source: std::io::Error,
}

/// Binds the control endpoint and spawns its accept loop on the current runtime. Each
/// `stop` sends one `()` on `stop`.
///
/// A Unix path is published by [`vm_transport::publish`]: mode 0600 set before the socket
/// appears at the path and before it listens, so no process is ever let in by a default
/// mode; a stale socket replaced, a live one (another guest-init's control port) or any
/// other file refused. The file is removed when the accept loop ends.
pub fn start(ep: &Endpoint, stop: UnboundedSender<()>) -> Result<JoinHandle<()>, ControlError> {
    let err = |source| ControlError {
        endpoint: ep.to_string(),
        source,
    };
    let (listener, file) = match ep.unix_path() {
        Some(path) => {
            let access = Access {
                mode: SocketMode::OWNER_ONLY,
                uid: None,
                gid: None,
            };
            let published =
                publish::publish(path, access, true).map_err(|e| err(std::io::Error::other(e)))?;
            let listener = Listener::from_listening_fd(published.fd, ep.clone()).map_err(err)?;
            (listener, Some(published.file))
        }
        None => (ep.listen().map_err(err)?, None),
    };
    debug!("control: listening at {ep}");
    Ok(tokio::spawn(async move {
        // Owned by the loop: the socket file goes when the loop does.
        let _file = file;
        accept_loop(listener, stop).await;
    }))
}

async fn accept_loop(listener: Listener, stop: UnboundedSender<()>) {
    loop {
        match listener.accept().await {
            Ok((conn, peer)) => {
                if !admit(&peer) {
                    warn!("control: refused {peer}: not the host (only vsock CID {HOST_CID} may stop this VM)");
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(LINGER, conn.write_all(REFUSED)).await;
                        let _ = conn.shutdown_write();
                        linger(&conn).await;
                    });
                    continue;
                }
                let stop = stop.clone();
                tokio::spawn(async move {
                    if let Err(e) = serve(conn, &stop).await {
                        debug!("control: connection from {peer}: {e}");
                    }
                });
            }
            Err(e) => {
                // EMFILE and friends: back off a little instead of spinning; never end.
                warn!("control: accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Whether `peer` may use the control port: on vsock only the host (CID 2); Unix peers
/// (the socket is root-only, mode 0600); never TCP.
pub fn admit(peer: &Peer) -> bool {
    match peer {
        Peer::Vsock { cid, .. } => *cid == HOST_CID,
        Peer::Unix => true,
        Peer::Tcp(_) => false,
    }
}

/// What a request line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Command {
    /// `stop`
    Stop,
    /// `ping`
    Ping,
    /// Anything else.
    Unknown,
}

/// Parses one request line (without its newline; a trailing `\r` is tolerated).
pub fn parse(line: &[u8]) -> Command {
    match line.strip_suffix(b"\r").unwrap_or(line) {
        b"stop" => Command::Stop,
        b"ping" => Command::Ping,
        _ => Command::Unknown,
    }
}

async fn read_line(conn: &Conn) -> std::io::Result<Vec<u8>> {
    let mut line = Vec::with_capacity(MAX_LINE);
    let mut buf = [0u8; MAX_LINE];
    loop {
        let n = conn.read(&mut buf[..MAX_LINE - line.len()]).await?;
        if n == 0 {
            return Ok(line);
        }
        line.extend_from_slice(&buf[..n]);
        if let Some(i) = line.iter().position(|b| *b == b'\n') {
            line.truncate(i);
            return Ok(line);
        }
        if line.len() >= MAX_LINE {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "request line longer than 64 bytes",
            ));
        }
    }
}

/// Waits briefly for the peer's end of stream after a half-close, so the last answer is
/// not lost to a reset when the connection closes with unread input.
async fn linger(conn: &Conn) {
    let mut b = [0u8; 16];
    let _ = tokio::time::timeout(LINGER, async {
        while matches!(conn.read(&mut b).await, Ok(n) if n > 0) {}
    })
    .await;
}

async fn serve(conn: Conn, stop: &UnboundedSender<()>) -> std::io::Result<()> {
    let line = match tokio::time::timeout(READ_TIMEOUT, read_line(&conn)).await {
        Ok(r) => r?,
        Err(_) => return Err(std::io::ErrorKind::TimedOut.into()),
    };
    match parse(&line) {
        Command::Ping => conn.write_all(b"ok pong\n").await,
        Command::Unknown => conn.write_all(b"error unknown command\n").await,
        Command::Stop => {
            let reply = conn.write_all(b"ok stopping\n").await;
            if reply.is_ok() {
                let _ = conn.shutdown_write();
                linger(&conn).await;
            }
            // The host asked; stop even if it left before reading the answer.
            let _ = stop.send(());
            reply
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn commands_parse() {
        assert_eq!(parse(b"stop"), Command::Stop);
        assert_eq!(parse(b"stop\r"), Command::Stop);
        assert_eq!(parse(b"ping"), Command::Ping);
        assert_eq!(parse(b"STOP"), Command::Unknown);
        assert_eq!(parse(b""), Command::Unknown);
    }

    async fn try_ask(path: &std::path::Path, req: &[u8]) -> std::io::Result<Vec<u8>> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::UnixStream::connect(path).await?;
        s.write_all(req).await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        Ok(out)
    }

    async fn ask(path: &std::path::Path, req: &[u8]) -> Vec<u8> {
        try_ask(path, req).await.unwrap()
    }

    #[tokio::test]
    async fn answers_and_stops_only_on_stop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/control.sock");
        // A stale socket from an earlier run is replaced.
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let _h = start(&Endpoint::Unix(path.clone()), tx).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);

        assert_eq!(ask(&path, b"ping\n").await, b"ok pong\n");
        assert_eq!(ask(&path, b"reboot\n").await, b"error unknown command\n");
        assert!(rx.try_recv().is_err(), "ping and unknown must not stop");
        // A client that floods garbage without a newline is cut off; the loop goes on.
        // (Closing with unread input makes the client see ECONNRESET, or nothing at all.)
        let flood = try_ask(&path, &[b'x'; 200]).await;
        assert!(flood.as_ref().map_or(true, |o| o.is_empty()), "{flood:?}");
        assert_eq!(ask(&path, b"stop\n").await, b"ok stopping\n");
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap();
    }

    #[test]
    fn only_the_host_cid_is_admitted_on_vsock() {
        let vsock = |cid| Peer::Vsock { cid, port: 49152 };
        assert!(admit(&vsock(2)), "the host");
        // 1: a process inside this VM over vsock_loopback; 3: this or another guest;
        // 0: the hypervisor; u32::MAX: VMADDR_CID_ANY, never a real peer.
        for cid in [0, 1, 3, 4, 1000, u32::MAX] {
            assert!(!admit(&vsock(cid)), "cid {cid} must be refused");
        }
        assert!(admit(&Peer::Unix), "the root-only Unix socket, as today");
        assert!(!admit(&Peer::Tcp("127.0.0.1:5000".parse().unwrap())));
    }

    #[tokio::test]
    async fn a_peer_that_is_not_the_host_cannot_stop_the_vm() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A real listener whose peers are never the host: TCP on loopback, the same
        // accept path a vsock peer from CID 1 takes.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let ep = Endpoint::Tcp(format!("127.0.0.1:{port}").parse().unwrap());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let _h = start(&ep, tx).unwrap();
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        s.write_all(b"stop\n").await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        assert_eq!(out, b"ERR not the host\n");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(rx.try_recv().is_err(), "a refused peer stopped the VM");
    }

    #[tokio::test]
    async fn a_live_socket_or_another_file_at_the_path_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        // Another guest-init's control port, serving: not ours to take over.
        let live = dir.path().join("live.sock");
        let other = std::os::unix::net::UnixListener::bind(&live).unwrap();
        let e = start(&Endpoint::Unix(live.clone()), tx.clone()).unwrap_err();
        assert!(
            e.to_string().contains("another process is listening"),
            "{e}"
        );
        drop(std::os::unix::net::UnixStream::connect(&live).unwrap());
        other.accept().unwrap();
        // A regular file: refused, its content kept.
        let precious = dir.path().join("precious");
        std::fs::write(&precious, b"data").unwrap();
        let e = start(&Endpoint::Unix(precious.clone()), tx).unwrap_err();
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&precious).unwrap(), b"data");
    }

    #[tokio::test]
    async fn a_fresh_path_is_made_owner_only_and_removed_when_the_loop_ends() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("new/dir/control.sock");
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let h = start(&Endpoint::Unix(path.clone()), tx).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(ask(&path, b"ping\n").await, b"ok pong\n");
        h.abort();
        let _ = h.await;
        assert!(!path.exists(), "the control socket outlived its loop");
    }

    #[tokio::test]
    async fn a_request_split_across_reads_is_understood() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let _h = start(&Endpoint::Unix(path.clone()), tx).unwrap();
        let mut s = tokio::net::UnixStream::connect(&path).await.unwrap();
        s.write_all(b"pi").await.unwrap();
        // Let the server read the first piece on its own before the rest arrives.
        tokio::time::sleep(Duration::from_millis(50)).await;
        s.write_all(b"ng\n").await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        assert_eq!(out, b"ok pong\n");
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn the_stop_waits_for_the_host_to_close() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let _h = start(&Endpoint::Unix(path.clone()), tx).unwrap();
        let mut s = tokio::net::UnixStream::connect(&path).await.unwrap();
        s.write_all(b"stop\n").await.unwrap();
        let mut reply = [0u8; 12];
        s.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"ok stopping\n");
        assert_eq!(s.read(&mut [0u8; 1]).await.unwrap(), 0, "no half-close");
        // The host has its answer but has not closed: powering off now could lose the
        // answer on vsock, so the guest waits (given time to show it does not).
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(rx.try_recv().is_err(), "stopped before the host closed");
        drop(s);
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("no stop after the host closed")
            .unwrap();
    }
}
