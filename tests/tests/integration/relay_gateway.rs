//! The gateway case: behind the VM's NAT, Radicale's `rip` is the gateway (10.0.2.2) for
//! every request. Two apps, A and B, each with its own forwarder and relay, share one real
//! Dovecot. App A fails to sign in twice (two different wrong passwords, as Radicale would
//! send them: `rip=10.0.2.2`); then app B's Radicale signs in with the right password.
//!
//! - `substitute` (the default): each relay replaces the gateway with its app's own
//!   address, so A's failures spend only A's budget and B gets 207.
//! - `drop`: both relays remove the gateway `rip`, so both apps land in Dovecot's one
//!   rip-less budget; A's failures delay B's sign-in by Dovecot's penalty (8 s after two
//!   failures) beyond Radicale's 5 s socket timeout, and B gets 401.
//!
//! The assertions are the status codes; the durations are printed for the report.

use std::time::Instant;

use crate::support::*;
use e2e::dovecot::{sign_in, Dovecot, DovecotOptions, SignIn};
use e2e::radicale::{propfind, Radicale, RadicaleOptions};
use e2e::util::require;

async fn scenario(policy_a: serde_json::Value, policy_b: serde_json::Value) -> u16 {
    let dovecot = Dovecot::start(&DovecotOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (uds_a, uds_b) = (dir.path().join("a.vsock"), dir.path().join("b.vsock"));
    let relay_a = RelayProc::start(
        dir.path(),
        "a",
        &per_vm_config("app-a", &uds_a, &dovecot.auth_client(), policy_a),
    );
    let relay_b = RelayProc::start(
        dir.path(),
        "b",
        &per_vm_config("app-b", &uds_b, &dovecot.auth_client(), policy_b),
    );
    let (sock_a, sock_b) = (dir.path().join("auth-a"), dir.path().join("auth-b"));
    let _fa = forwarder(&sock_a, &port_path(&uds_a, 5001)).await;
    let _fb = forwarder(&sock_b, &port_path(&uds_b, 5001)).await;
    let radicale_b = Radicale::start(&RadicaleOptions {
        dovecot_socket: sock_b,
        remote_ip_source: Some("X-Remote-Addr".into()),
    })
    .unwrap();

    // App A: two failed sign-ins with different wrong passwords (a repeated one would not
    // raise Dovecot's penalty), each from the gateway, as Radicale in A's VM sends them.
    for (i, pw) in ["wrong-1", "wrong-2"].iter().enumerate() {
        let t = Instant::now();
        let r = sign_in(&sock_a, "alice", pw, &["rip=10.0.2.2"])
            .await
            .unwrap();
        assert!(
            matches!(r, SignIn::Fail(_)),
            "A's wrong password {i} must fail: {r:?}"
        );
        eprintln!(
            "measured: app A failed sign-in {} took {:?}",
            i + 1,
            t.elapsed()
        );
    }
    // App B: Radicale, whose rip is the gateway for every request.
    let addr = radicale_b.addr();
    let t = Instant::now();
    let status = tokio::task::spawn_blocking(move || {
        propfind(addr, "bob", "hunter22", &[("X-Remote-Addr", "10.0.2.2")])
    })
    .await
    .unwrap()
    .unwrap();
    eprintln!(
        "measured: app B's correct sign-in via Radicale: HTTP {status} after {:?}",
        t.elapsed()
    );
    let log = relay_a.log() + &relay_b.log();
    assert!(
        !log.contains("hunter22") && !log.contains("resp="),
        "credentials logged:\n{log}"
    );
    if status != 207 {
        eprintln!("radicale B log:\n{}", radicale_b.log());
    }
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn substitute_gives_each_app_its_own_budget() {
    if !require(Dovecot::available(), "dovecot (apt dovecot-core)")
        || !require(Radicale::available(), "Radicale in .cache/venv")
    {
        return;
    }
    let status = scenario(
        serde_json::json!({"rip_policy": "substitute", "client_address": "100.64.0.1"}),
        serde_json::json!({"rip_policy": "substitute", "client_address": "100.64.0.2"}),
    )
    .await;
    assert_eq!(
        status, 207,
        "A's failures must not delay B under substitute"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_puts_every_app_in_one_budget() {
    if !require(Dovecot::available(), "dovecot (apt dovecot-core)")
        || !require(Radicale::available(), "Radicale in .cache/venv")
    {
        return;
    }
    let status = scenario(
        serde_json::json!({"rip_policy": "drop"}),
        serde_json::json!({"rip_policy": "drop"}),
    )
    .await;
    assert_eq!(
        status, 401,
        "under drop, A's failures put B in the shared penalty (longer than Radicale's 5 s timeout)"
    );
}
