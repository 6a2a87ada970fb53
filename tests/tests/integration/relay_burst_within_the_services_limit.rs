//! One guest cannot starve every other app of a shared service. Dovecot's stock
//! `client_limit` (1,000 connections per auth process) is shared by every app on the
//! host; host-relay holds at most `max_upstream` of one VM's connections to it at once and
//! queues the rest, so a 2,000-sign-in burst from app A all succeeds (nothing refused)
//! while app B's sign-in still gets through during that burst.
//!
//! What is checked from outside: every sign-in's answer from Dovecot; B's answer arriving
//! while A's burst is still running (an ordering, not a time); and, sampled from the
//! service's side (`/proc/<Dovecot auth pid>/fd`), that Dovecot never holds more than
//! the limit's worth of connections at once. Without the limit it holds up to its stock
//! 1,000.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::support::*;
use e2e::dovecot::{sign_in, Dovecot, DovecotOptions, SignIn};
use e2e::util::require;

const BURST: usize = 2000;
const LIMIT: u32 = 32;

// The guard only orders this test against the other heavy ones; the runtime is this
// test's own, so holding it across awaits blocks nothing else.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_at_stock_client_limit_queues_and_another_app_still_signs_in() {
    let _heavy = crate::support::heavy_lock();
    if !require(Dovecot::available(), "dovecot (apt dovecot-core)") {
        return;
    }
    raise_fd_limit();
    let dovecot = Dovecot::start(&DovecotOptions {
        stock_limits: true,
        ..DovecotOptions::default()
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let relay = |app: &str, addr: &str| {
        let uds = dir.path().join(format!("{app}.vsock"));
        let mut config = per_vm_config(
            app,
            &uds,
            &dovecot.auth_client(),
            serde_json::json!({"client_address": addr}),
        );
        config["services"][0]["max_upstream"] = LIMIT.into();
        (RelayProc::start(dir.path(), app, &config), uds)
    };
    let (relay_a, uds_a) = relay("app-a", "100.64.0.1");
    let (relay_b, uds_b) = relay("app-b", "100.64.0.2");
    let sock_a = dir.path().join("a-auth-client");
    let sock_b = dir.path().join("b-auth-client");
    let _fwd_a = forwarder(&sock_a, &port_path(&uds_a, 5001)).await;
    let _fwd_b = forwarder(&sock_b, &port_path(&uds_b, 5001)).await;

    // Warm Dovecot's auth process up, then watch its descriptors from outside while the
    // burst runs: every auth-client connection it holds is one descriptor there.
    assert!(matches!(
        sign_in(&sock_b, "bob", "hunter22", &[]).await,
        Ok(SignIn::Ok)
    ));
    let auth = dovecot.auth_pid().expect("dovecot's auth process");
    let fds = move || std::fs::read_dir(format!("/proc/{auth}/fd")).map(|d| d.count());
    let idle_fds = fds().unwrap();
    let running = Arc::new(AtomicBool::new(true));
    let peak = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (running, peak) = (running.clone(), peak.clone());
        std::thread::spawn(move || {
            while running.load(Ordering::Relaxed) {
                if let Ok(n) = fds() {
                    peak.fetch_max(n, Ordering::Relaxed);
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        })
    };

    let burst: Vec<_> = (0..BURST)
        .map(|_| {
            let s = sock_a.clone();
            tokio::spawn(async move { sign_in(&s, "alice", "secret123", &[]).await })
        })
        .collect();
    // B signs in while A's burst is in flight.
    let b = sign_in(&sock_b, "bob", "hunter22", &[]).await;
    let burst_done_before_b = burst.iter().all(|t| t.is_finished());
    let mut failures = Vec::new();
    for t in burst {
        match t.await.unwrap() {
            Ok(SignIn::Ok) => {}
            other => failures.push(format!("{other:?}")),
        }
    }
    running.store(false, Ordering::Relaxed);
    sampler.join().unwrap();

    assert!(matches!(b, Ok(SignIn::Ok)), "app B's sign-in: {b:?}");
    assert!(
        !burst_done_before_b,
        "app B was answered only after app A's whole burst: the limit did not hold"
    );
    assert!(
        failures.is_empty(),
        "{} of {BURST} of app A's sign-ins failed, first: {:?}\ndovecot log:\n{}",
        failures.len(),
        failures.first(),
        dovecot.log()
    );
    // Relay A's connections at once, plus B's one and some slack for Dovecot's own.
    let peak = peak.load(Ordering::Relaxed);
    eprintln!("measured: dovecot auth descriptors idle {idle_fds}, peak {peak} (limit {LIMIT})");
    assert!(
        peak <= idle_fds + LIMIT as usize + 4,
        "Dovecot held {} connections at once: more than relay A's limit of {LIMIT}",
        peak - idle_fds
    );
    assert!(!relay_a.log().contains("refused"));
    drop(relay_b);
}

/// The documented default (`max_upstream` left out: 64) seen from the service's side: of
/// 150 connections a guest opens at once to a service that accepts and never answers,
/// the service sees exactly 64 until one of them ends; then the next queued one arrives.
/// Nothing is refused.
#[test]
fn the_default_limit_is_64_as_the_service_sees_it() {
    const OPEN: usize = 150;
    const DEFAULT: usize = 64;
    let _heavy = crate::support::heavy_lock();
    raise_fd_limit();
    let dir = tempfile::tempdir().unwrap();
    let upstream_path = dir.path().join("service.sock");
    let upstream = std::os::unix::net::UnixListener::bind(&upstream_path).unwrap();
    let uds = dir.path().join("app.vsock");
    let config = serde_json::json!({
        "app": "app",
        "vm": {"id": "vm-app", "gateways": ["10.0.2.2"]},
        "transport": {"per_vm_socket": {"vsock_uds": uds}},
        "services": [{"name": "plain", "port": 5002, "upstream": {"unix": upstream_path}}],
    });
    let relay = RelayProc::start(dir.path(), "relay", &config);

    // The service: accepts, keeps every connection open, counts them all.
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let arrived = Arc::new(AtomicUsize::new(0));
    {
        let (held, arrived) = (held.clone(), arrived.clone());
        std::thread::spawn(move || {
            for c in upstream.incoming() {
                held.lock().unwrap().push(c.unwrap());
                arrived.fetch_add(1, Ordering::SeqCst);
            }
        });
    }
    let count = || arrived.load(Ordering::SeqCst);
    let wait_for = |n: usize| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while count() < n {
            assert!(
                std::time::Instant::now() < deadline,
                "the service saw {} connections, expected {n}\nrelay log:\n{}",
                count(),
                relay.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };

    // The guest: opens OPEN connections at once on the service's port, each sending a byte.
    let guests: Vec<_> = (0..OPEN)
        .map(|_| {
            let mut s = std::os::unix::net::UnixStream::connect(port_path(&uds, 5002)).unwrap();
            std::io::Write::write_all(&mut s, b"x").unwrap();
            s
        })
        .collect();
    wait_for(DEFAULT);
    // Give the relay every chance to exceed the limit before looking again.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(
        count(),
        DEFAULT,
        "with max_upstream left out the service must see 64 of this VM's connections at once"
    );
    // One ends; the next queued connection takes its place, not refused.
    held.lock().unwrap().remove(0);
    wait_for(DEFAULT + 1);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(
        count(),
        DEFAULT + 1,
        "one ended, exactly one more may arrive"
    );
    assert_eq!(held.lock().unwrap().len(), DEFAULT);
    // All end: every queued connection reaches the service.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while count() < OPEN && std::time::Instant::now() < deadline {
        held.lock().unwrap().clear();
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(count(), OPEN, "every queued connection reaches the service");
    assert!(!relay.log().contains("refused"), "{}", relay.log());
    drop(guests);
}
