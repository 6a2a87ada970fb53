//! The sign-in chain as a VM runs it, on one host: real Radicale 3.9 (stock
//! `[auth] type = dovecot`) → guest-init's forwarder (the app's unchanged socket path) →
//! host-relay in per-VM-socket mode (Unix sockets `<uds>_<port>` standing in for the VMM's
//! hybrid vsock) → real Dovecot 2.3. The right password gives 207, a wrong one 401.
//!
//! Radicale reads Dovecot's greeting and each reply with one `recv`, so this also checks
//! that nothing on the way splits them. The relay's log must show the admitted connection
//! and must never contain a credential.

use crate::support::*;
use e2e::dovecot::{AuthListener, Dovecot, DovecotOptions};
use e2e::radicale::{propfind, Radicale, RadicaleOptions};
use e2e::util::require;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn radicale_signs_in_through_forwarder_relay_and_dovecot() {
    if !require(Dovecot::available(), "dovecot (apt dovecot-core)")
        || !require(Radicale::available(), "Radicale in .cache/venv")
    {
        return;
    }
    // Option (a): the app's own per-app auth listener in the real Dovecot.
    let dovecot = Dovecot::start(&DovecotOptions {
        listeners: vec![AuthListener::open("auth_app_radicale")],
        ..DovecotOptions::default()
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let relay = RelayProc::start(
        dir.path(),
        "relay",
        &per_vm_config(
            "radicale",
            &uds,
            &dovecot.socket("auth_app_radicale"),
            serde_json::json!({"client_address": "100.64.0.7"}),
        ),
    );
    let app_socket = dir.path().join("auth-client");
    let _fwd = forwarder(&app_socket, &port_path(&uds, 5001)).await;
    let radicale = Radicale::start(&RadicaleOptions {
        dovecot_socket: app_socket,
        remote_ip_source: None,
    })
    .unwrap();

    let addr = radicale.addr();
    let ok = tokio::task::spawn_blocking(move || propfind(addr, "alice", "secret123", &[]))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ok, 207, "right password; radicale log:\n{}", radicale.log());
    let bad = tokio::task::spawn_blocking(move || propfind(addr, "alice", "wrong-password", &[]))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        bad,
        401,
        "wrong password; radicale log:\n{}",
        radicale.log()
    );

    relay.wait_for_line(&["admitted", "app=radicale", "service=dovecot-auth"]);
    let log = relay.log();
    for secret in ["secret123", "wrong-password", "resp=", "AGFsaWNl"] {
        assert!(!log.contains(secret), "relay log leaks {secret:?}:\n{log}");
    }
    assert!(relay.stop().success(), "relay exits 0 on SIGTERM");
    assert!(
        !port_path(&uds, 5001).exists(),
        "socket removed on shutdown"
    );
    assert!(
        !port_path(&uds, 5003).exists(),
        "socket removed on shutdown"
    );
}
