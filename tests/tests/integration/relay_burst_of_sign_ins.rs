//! ADR 065 acceptance: a burst of 1,000 concurrent sign-ins through the chain succeeds,
//! as natively: 1,000 clients at once on the app's socket (guest-init's forwarder) →
//! host-relay (per-VM socket, dovecot-auth filter) → real Dovecot. Every one must get
//! `OK`. The elapsed time is printed for the report, not asserted.

use std::time::Instant;

use crate::support::*;
use e2e::dovecot::{sign_in, Dovecot, DovecotOptions, SignIn};
use e2e::util::require;

const BURST: usize = 1000;

// The guard only orders this test against the other heavy ones; the runtime is this
// test's own, so holding it across awaits blocks nothing else.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_1000_concurrent_sign_ins_all_succeed() {
    let _heavy = crate::support::heavy_lock();
    if !require(Dovecot::available(), "dovecot (apt dovecot-core)") {
        return;
    }
    raise_fd_limit();
    let dovecot = Dovecot::start(&DovecotOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let relay = RelayProc::start(
        dir.path(),
        "relay",
        &per_vm_config(
            "radicale",
            &uds,
            &dovecot.auth_client(),
            serde_json::json!({"client_address": "100.64.0.7"}),
        ),
    );
    let app_socket = dir.path().join("auth-client");
    let _fwd = forwarder(&app_socket, &port_path(&uds, 5001)).await;

    let start = Instant::now();
    let tasks: Vec<_> = (0..BURST)
        .map(|_| {
            let s = app_socket.clone();
            tokio::spawn(async move { sign_in(&s, "alice", "secret123", &["rip=10.0.2.2"]).await })
        })
        .collect();
    let mut failures = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(SignIn::Ok) => {}
            other => failures.push(format!("{other:?}")),
        }
    }
    let elapsed = start.elapsed();
    eprintln!(
        "measured: burst of {BURST} concurrent sign-ins: {} ok in {elapsed:?}",
        BURST - failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {BURST} failed, first: {:?}\nrelay log tail:\n{}\ndovecot log:\n{}",
        failures.len(),
        failures.first(),
        relay
            .log()
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .join("\n"),
        dovecot.log()
    );
    assert!(!relay.log().contains("refused"));
}
