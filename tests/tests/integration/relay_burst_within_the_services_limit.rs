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
