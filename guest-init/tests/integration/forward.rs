//! Forwarding through real sockets, with the library API (`forward::start` in a tokio
//! runtime): what the app sees is what it would see natively, whatever the target does.
//!
//! Unix sockets stand in for vsock here (in a VM the target is `vsock` CID 2); the
//! forwarder code path after `connect` is the same descriptor type and pump.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::forward::*;
use guest_init::forward::{self, DialPolicy, ExportSpec};
use vm_transport::{Conn, Endpoint};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_data_both_directions_at_once_arrives_byte_exact() {
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("app.sock");
    let host = unix(&dir.path().join("host.sock"));

    // The target: takes the client's seed (first 8 bytes), then at the same time sends its
    // own random stream (derived from the seed) and records everything the client sends.
    let received: Arc<Mutex<Vec<Received>>> = Arc::default();
    let l = host.listen().unwrap();
    let rec = Arc::clone(&received);
    tokio::spawn(async move {
        loop {
            let Ok((c, _)) = l.accept().await else {
                continue;
            };
            let rec = Arc::clone(&rec);
            tokio::spawn(async move {
                let mut got = Vec::new();
                while got.len() < 8 {
                    match c.read_pooled().await.unwrap() {
                        Some(chunk) => got.extend_from_slice(&chunk),
                        None => panic!("stream ended inside the seed"),
                    }
                }
                let seed = u64::from_le_bytes(got[..8].try_into().unwrap());
                let rest = got.split_off(8);
                let (_, tail) = tokio::join!(
                    async {
                        let mut rng = Rng::new(seed ^ 0x5eed);
                        let reply = reply_for(seed);
                        let mut off = 0;
                        for n in rng.chunks(reply.len()) {
                            c.write_all(&reply[off..off + n]).await.unwrap();
                            off += n;
                        }
                        c.shutdown_write().unwrap();
                    },
                    read_all(&c)
                );
                let mut all = rest;
                all.extend_from_slice(&tail.unwrap());
                rec.lock().unwrap().push((seed, all));
            });
        }
    });

    let fwd = forward::start(&[service("data", &app_path, host.clone())], &[])
        .await
        .unwrap();
    let app = unix(&app_path);

    let mut clients = Vec::new();
    for i in 0..12u64 {
        let app = app.clone();
        clients.push(tokio::spawn(async move {
            let seed = 0x1234_5678_9abc_def0 ^ (i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut rng = Rng::new(seed);
            let len = rng.below(1_500_000) as usize;
            let data = rng.bytes(len);
            let c = app.connect().await.unwrap();
            let (_, back) = tokio::join!(
                async {
                    c.write_all(&seed.to_le_bytes()).await.unwrap();
                    let mut off = 0;
                    for n in rng.chunks(data.len()) {
                        c.write_all(&data[off..off + n]).await.unwrap();
                        off += n;
                    }
                    c.shutdown_write().unwrap();
                },
                read_all(&c)
            );
            let back = back.unwrap();
            let want = reply_for(seed);
            assert_eq!(back.len(), want.len(), "client {i}: reply length");
            assert!(
                back == want,
                "client {i}: reply differs from what the target sent"
            );
            (seed, data)
        }));
    }
    let mut sent = Vec::new();
    for c in clients {
        sent.push(guard("client", c).await.unwrap());
    }
    // The target records a connection after both of its directions have ended.
    guard("target records", async {
        while received.lock().unwrap().len() < sent.len() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let got = received.lock().unwrap();
    for (seed, data) in &sent {
        let (_, at_target) = got.iter().find(|(s, _)| s == seed).expect("seed seen");
        assert_eq!(
            at_target.len(),
            data.len(),
            "seed {seed:x}: length at target"
        );
        assert!(
            at_target == data,
            "seed {seed:x}: bytes differ at the target"
        );
    }
    drop(fwd);
}

/// What the target got on one connection: the client's seed and the bytes after it.
type Received = (u64, Vec<u8>);

fn reply_for(seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed.rotate_left(17) ^ 0xfeed);
    let len = rng.below(1_500_000) as usize;
    rng.bytes(len)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_greeting_written_once_is_read_once() {
    // Radicale reads Dovecot's greeting with a single recv(1024): the forwarder must not
    // split it. Over AF_UNIX stream sockets a reader coalesces whatever has arrived, so
    // this end-to-end check cannot see a split by itself; the pump's own test
    // (`vm_transport::pump::tests::one_chunk_is_written_whole`) uses record sockets,
    // which do, and fails on a planted split.
    const GREETING: &[u8] = b"VERSION\t1\t2\nMECH\tPLAIN\tplaintext\nMECH\tLOGIN\tplaintext\nSPID\t4242\nCUID\t7\nCOOKIE\t0123456789abcdef0123456789abcdef\nDONE\n";
    const REQUEST: &[u8] =
        b"VERSION\t1\t1\nCPID\t99\nAUTH\t1\tPLAIN\tservice=radicale\tresp=AGFsaWNlAHNlY3JldA==\n";
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("auth-client");
    let host = unix(&dir.path().join("host.sock"));
    let l = host.listen().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (c, _) = l.accept().await.unwrap();
        c.write_all(GREETING).await.unwrap();
        let mut buf = [0u8; 1024];
        let n = c.read(&mut buf).await.unwrap();
        tx.send(buf[..n].to_vec()).unwrap();
        // Keep the connection open until the test is done with it.
        let _ = c.read(&mut buf).await;
    });
    let _fwd = forward::start(&[service("dovecot-auth", &app_path, host)], &[])
        .await
        .unwrap();
    let c = unix(&app_path).connect().await.unwrap();
    let mut buf = [0u8; 1024];
    let n = guard("greeting", c.read(&mut buf)).await.unwrap();
    assert_eq!(&buf[..n], GREETING, "the greeting must arrive in one read");
    c.write_all(REQUEST).await.unwrap();
    let at_target = guard("request", rx).await.unwrap();
    assert_eq!(at_target, REQUEST, "the request must arrive in one read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_connections_all_succeed() {
    vm_transport::fdlimit::raise_fd_limit().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("app.sock");
    let host = unix(&dir.path().join("host.sock"));
    spawn_echo_server(&host);
    let _fwd = forward::start(&[service("burst", &app_path, host)], &[])
        .await
        .unwrap();
    const N: usize = 1000;
    // Every client holds its connection open until all have had their answer, so all
    // 1,000 are relayed at the same time.
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let app = unix(&app_path);
    let mut tasks = Vec::new();
    for i in 0..N {
        let (app, barrier) = (app.clone(), Arc::clone(&barrier));
        tasks.push(tokio::spawn(async move {
            let c = app
                .connect()
                .await
                .map_err(|e| format!("{i}: connect: {e}"))?;
            let msg = format!("connection {i:04} says hello");
            c.write_all(msg.as_bytes())
                .await
                .map_err(|e| format!("{i}: write: {e}"))?;
            let mut got = Vec::new();
            let mut buf = [0u8; 64];
            while got.len() < msg.len() {
                let n = c
                    .read(&mut buf)
                    .await
                    .map_err(|e| format!("{i}: read: {e}"))?;
                if n == 0 {
                    return Err(format!("{i}: closed early"));
                }
                got.extend_from_slice(&buf[..n]);
            }
            if got != msg.as_bytes() {
                return Err(format!("{i}: wrong echo"));
            }
            barrier.wait().await;
            Ok::<(), String>(())
        }));
    }
    let mut failures = Vec::new();
    for t in tasks {
        if let Err(e) = guard("burst client", t).await.unwrap() {
            failures.push(e);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {N} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_target_closes_the_connection_and_the_next_one_works_once_it_is_up() {
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("app.sock");
    let host_path = dir.path().join("host.sock");
    let mut spec = service("late-host", &app_path, unix(&host_path));
    spec.dial = quick_dial();
    let _fwd = forward::start(&[spec], &[]).await.unwrap();
    let app = unix(&app_path);

    // Nobody serves the target: the forwarder accepts, retries, then closes.
    let c = app.connect().await.unwrap();
    c.write_all(b"anyone there?").await.unwrap();
    assert!(
        guard("dead target", closed(&c)).await,
        "expected the connection to be closed"
    );

    // The accept loop goes on: once the host side is up, the next connection goes through.
    spawn_echo_server(&unix(&host_path));
    let c = app.connect().await.unwrap();
    c.write_all(b"now?").await.unwrap();
    c.shutdown_write().unwrap();
    assert_eq!(guard("echo", read_all(&c)).await.unwrap(), b"now?");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_comes_up_late_is_reached_by_the_retry() {
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("app.sock");
    let host_path = dir.path().join("host.sock");
    // Default policy: waits of 25, 50, 100, 200... ms cover a target 300 ms late.
    let _fwd = forward::start(&[service("slow-host", &app_path, unix(&host_path))], &[])
        .await
        .unwrap();
    // The target comes up 300 ms after the app has connected (and the forwarder has made
    // its first, failed, dial).
    let c = unix(&app_path).connect().await.unwrap();
    let host = unix(&host_path);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        spawn_echo_server(&host);
    });
    c.write_all(b"early bird").await.unwrap();
    c.shutdown_write().unwrap();
    assert_eq!(
        guard("late echo", read_all(&c)).await.unwrap(),
        b"early bird"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_connection_does_not_block_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("app.sock");
    let host = unix(&dir.path().join("host.sock"));
    // The target never reads its first connection; it echoes all the others.
    let l = host.listen().unwrap();
    let (held_tx, held_rx) = tokio::sync::oneshot::channel::<Conn>();
    tokio::spawn(async move {
        let (first, _) = l.accept().await.unwrap();
        held_tx.send(first).unwrap();
        loop {
            if let Ok((c, _)) = l.accept().await {
                tokio::spawn(echo(c));
            }
        }
    });
    let _fwd = forward::start(&[service("stall", &app_path, host)], &[])
        .await
        .unwrap();
    let app = unix(&app_path);

    let stalled = app.connect().await.unwrap();
    let held = guard("first connection reaches the target", held_rx)
        .await
        .unwrap();
    // 64 MiB cannot fit in the socket buffers and one pooled chunk: this writer blocks.
    let writer = tokio::spawn(async move {
        let chunk = vec![0xa5u8; 64 * 1024];
        for _ in 0..1024 {
            stalled.write_all(&chunk).await?;
        }
        Ok::<_, std::io::Error>(stalled)
    });
    // Let the stalled direction fill up, then check that others still flow.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for i in 0..20 {
        let c = app.connect().await.unwrap();
        let msg = format!("independent {i}");
        c.write_all(msg.as_bytes()).await.unwrap();
        c.shutdown_write().unwrap();
        assert_eq!(
            guard("echo beside a stalled connection", read_all(&c))
                .await
                .unwrap(),
            msg.as_bytes()
        );
    }
    assert!(
        !writer.is_finished(),
        "the stalled writer should still be blocked"
    );
    writer.abort();
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_reaches_the_target_and_the_reply_still_flows_back() {
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("app.sock");
    let host = unix(&dir.path().join("host.sock"));
    let l = host.listen().unwrap();
    let target = tokio::spawn(async move {
        let (c, _) = l.accept().await.unwrap();
        // Only end of stream from the app ends this read.
        let request = read_all(&c).await.unwrap();
        c.write_all(b"reply after your EOF").await.unwrap();
        c.shutdown_write().unwrap();
        request
    });
    let _fwd = forward::start(&[service("halfclose", &app_path, host)], &[])
        .await
        .unwrap();
    let c = unix(&app_path).connect().await.unwrap();
    c.write_all(b"the whole request").await.unwrap();
    c.shutdown_write().unwrap();
    let reply = guard("reply", read_all(&c)).await.unwrap();
    assert_eq!(reply, b"reply after your EOF");
    assert_eq!(guard("target", target).await.unwrap(), b"the whole request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_forward_host_connections_to_guest_unix_and_tcp_services() {
    let dir = tempfile::tempdir().unwrap();
    // Guest services: one on TCP loopback, one on a Unix path.
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let tcp_addr = tcp.local_addr().unwrap();
    drop(tcp);
    let tcp_target = Endpoint::Tcp(tcp_addr);
    spawn_echo_server(&tcp_target);
    let unix_target = unix(&dir.path().join("guest-svc.sock"));
    spawn_echo_server(&unix_target);
    // The host side arrives on Unix paths here; in a VM these are vsock ports.
    let exports = [
        ExportSpec {
            name: "to-tcp".into(),
            listen: unix(&dir.path().join("in-tcp")),
            target: tcp_target,
            dial: DialPolicy::default(),
        },
        ExportSpec {
            name: "to-unix".into(),
            listen: unix(&dir.path().join("in-unix")),
            target: unix_target,
            dial: DialPolicy::default(),
        },
    ];
    let fwd = forward::start(&[], &exports).await.unwrap();
    assert_eq!(fwd.listeners(), 2);
    for e in &exports {
        let c = e.listen.connect().await.unwrap();
        let msg = format!("host calls {}", e.name);
        c.write_all(msg.as_bytes()).await.unwrap();
        c.shutdown_write().unwrap();
        assert_eq!(
            guard("export echo", read_all(&c)).await.unwrap(),
            msg.as_bytes()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_forwarders_stops_every_listener() {
    // An export listening on TCP: no socket file, so only stopping the accept loop (and
    // with it the listening socket) can end it.
    let dir = tempfile::tempdir().unwrap();
    let target = unix(&dir.path().join("guest-svc.sock"));
    spawn_echo_server(&target);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let listen = Endpoint::Tcp(port);
    let exports = [ExportSpec {
        name: "admin".into(),
        listen: listen.clone(),
        target,
        dial: DialPolicy::default(),
    }];
    let fwd = forward::start(&[], &exports).await.unwrap();
    drop(listen.connect().await.unwrap());
    drop(fwd);
    // The aborted loop drops its listener on its next turn of the runtime.
    let mut refused = false;
    for _ in 0..100 {
        if std::net::TcpStream::connect(port).is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        refused,
        "{port} still accepts connections after the forwarders were dropped"
    );
}
