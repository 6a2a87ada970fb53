//! The agent's two limits that a client can push against, checked from outside with a
//! real client (docs/AGENT.md): the 256 KiB cap on each of an `exec`'s output streams, and
//! the 10 s handshake limit.
//!
//! - Output: the answer carries exactly the cap and says `truncated`; a job writing far
//!   more (16 MiB to each stream) still runs to its end (the agent drains what it drops,
//!   so no full pipe stalls it), and the guest-init process's peak resident memory, read
//!   from its `/proc/<pid>/status` (`VmHWM`), does not grow with what the job wrote.
//! - Handshake: connections that send nothing, or stop partway through the ClientHello,
//!   are closed by the guest and logged as such, while other clients are served
//!   meanwhile; a handshake whose client is slow but finishes inside the limit succeeds.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use e2e::util::wait_in_log;

use super::*;

/// The cap, as docs/AGENT.md states it.
const CAP: usize = 256 * 1024;

fn exec(g: &Guest, operator: &Credential, script: &str) -> serde_json::Value {
    let request = serde_json::json!({
        "v": 1, "op": "exec", "user": "nobody",
        "argv": ["/bin/sh", "-c", script], "deadline_ms": 60000,
    });
    let answer = g.call(Some(operator), &request.to_string()).unwrap();
    ok(&answer).clone()
}

/// A field of `/proc/<pid>/status`, in KiB.
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in {status}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A job writing `n` bytes of `c` to stdout, then `m` bytes of `d` to stderr.
fn writes(n: usize, c: char, m: usize, d: char) -> String {
    format!("head -c {n} /dev/zero | tr '\\0' {c}; head -c {m} /dev/zero | tr '\\0' {d} >&2")
}

#[test]
fn exec_output_is_capped_at_256_kib_per_stream_and_a_flood_neither_stalls_nor_grows_pid_1() {
    let g = Guest::start();
    let operator = g
        .svc
        .issue_operator("urn:hop3:operator:alice:role:operator", -60, 3600);
    let pid = g.child.as_ref().unwrap().id();

    // Exactly the cap on each stream: all of it, not truncated.
    let r = exec(&g, &operator, &writes(CAP, 'o', CAP, 'e'));
    assert_eq!(b64(&r["stdout"]), "o".repeat(CAP));
    assert_eq!(b64(&r["stderr"]), "e".repeat(CAP));
    assert_eq!(r["truncated"], false, "exactly the cap is not truncated");
    // One byte more, on one stream: the cap, and truncated.
    let r = exec(&g, &operator, &writes(CAP + 1, 'o', 10, 'e'));
    assert_eq!(b64(&r["stdout"]), "o".repeat(CAP));
    assert_eq!(b64(&r["stderr"]), "e".repeat(10));
    assert_eq!(r["truncated"], true);

    // A flood: 16 MiB to stdout, then 16 MiB to stderr. The peak memory before it already
    // includes a full answer (the two calls above).
    let before = status_kib(pid, "VmHWM");
    let flood = 16 << 20;
    let r = exec(&g, &operator, &writes(flood, 'o', flood, 'e'));
    assert_eq!(r["timed_out"], false, "the job stalled on a full pipe: {r}");
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(b64(&r["stdout"]), "o".repeat(CAP));
    assert_eq!(b64(&r["stderr"]), "e".repeat(CAP));
    assert_eq!(r["truncated"], true);
    let (after, rss) = (status_kib(pid, "VmHWM"), status_kib(pid, "VmRSS"));
    eprintln!("guest-init VmHWM {before} KiB before the flood, {after} KiB after; VmRSS {rss} KiB");
    // The job wrote 32 MiB; keeping even a quarter of it would show here.
    assert!(
        after < before + 8 * 1024,
        "guest-init's peak memory grew from {before} KiB to {after} KiB with a 32 MiB flood"
    );
}

/// The first flight of a real client's handshake (its ClientHello record).
fn client_hello(g: &Guest, operator: &Credential) -> Vec<u8> {
    let mut conn = operator::connection(Some(operator), ServerCert::pinned(g.published()));
    let mut hello = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut hello).unwrap();
    }
    hello
}

/// A status call whose client is slow at both of its flights: the ClientHello in eight
/// pieces 400 ms apart, then 3 s before its Certificate/Finished (about 6 s in all, inside
/// the 10 s limit).
fn slow_status(g: &Guest, operator: &Credential) -> Result<serde_json::Value, String> {
    let mut conn = operator::connection(Some(operator), ServerCert::pinned(g.published()));
    let mut sock = UnixStream::connect(g.sock()).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut hello = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut hello).unwrap();
    }
    for piece in hello.chunks(hello.len().div_ceil(8)) {
        sock.write_all(piece).map_err(|e| e.to_string())?;
        std::thread::sleep(Duration::from_millis(400));
    }
    while !conn.wants_write() {
        if conn.read_tls(&mut sock).map_err(|e| e.to_string())? == 0 {
            return Err("the guest closed during the handshake".into());
        }
        conn.process_new_packets().map_err(|e| e.to_string())?;
    }
    std::thread::sleep(Duration::from_secs(3));
    let mut tls = rustls::StreamOwned::new(conn, sock);
    tls.write_all(b"{\"v\":1,\"op\":\"status\"}\n")
        .and_then(|()| tls.flush())
        .map_err(|e| e.to_string())?;
    let mut answer = String::new();
    tls.read_to_string(&mut answer).map_err(|e| e.to_string())?;
    serde_json::from_str(&answer).map_err(|e| format!("not JSON ({e}): {answer}"))
}

/// Waits for the guest to close `s`: end of stream (or a reset), nothing sent.
fn closed_by_the_guest(mut s: UnixStream) {
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut b = [0u8; 64];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        Ok(n) => panic!("the guest sent {n} bytes to a client without a ClientHello"),
        Err(e) => panic!("the guest kept an unfinished handshake open for 60 s: {e}"),
    }
}

#[test]
fn unfinished_handshakes_are_closed_at_10_s_while_others_and_a_slow_one_are_served() {
    let g = Guest::start();
    let reader = g
        .svc
        .issue_operator("urn:hop3:operator:alice:role:reader", -60, 3600);
    let hello = client_hello(&g, &reader);

    let mut stalled: Vec<UnixStream> = (0..3)
        .map(|_| UnixStream::connect(g.sock()).unwrap())
        .collect();
    let mut partial = UnixStream::connect(g.sock()).unwrap();
    partial.write_all(&hello[..hello.len() / 2]).unwrap();
    stalled.push(partial);

    std::thread::scope(|scope| {
        let slow = scope.spawn(|| slow_status(&g, &reader));
        // Others are served while the stalled connections wait.
        for _ in 0..3 {
            let answer = g.call(Some(&reader), r#"{"v":1,"op":"status"}"#).unwrap();
            assert_eq!(ok(&answer)["identity"], g.id.uri());
        }
        let answer = slow
            .join()
            .unwrap()
            .expect("a slow handshake inside the limit");
        assert_eq!(ok(&answer)["identity"], g.id.uri());
    });

    for s in stalled {
        closed_by_the_guest(s);
    }
    let limit = "agent: refused unix: no handshake within 10s";
    // The guest closes, then logs: wait for the fourth line.
    let log = wait_in_log(
        &g.dir.path().join("guest.log"),
        limit,
        4,
        Duration::from_secs(30),
    );
    assert_eq!(log.matches(limit).count(), 4, "{log}");
    // The four status calls were served before the first stalled client was dropped.
    let served: Vec<usize> = log
        .match_indices("agent: alice (reader) from unix: status")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(served.len(), 4, "{log}");
    assert!(
        served[3] < log.find(limit).unwrap(),
        "the other clients waited for the stalled ones:\n{log}"
    );
}
