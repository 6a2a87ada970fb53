//! ADR 065 acceptance: a guest connecting to a service its app did not declare is refused,
//! and the refusal is logged with app, service, peer and reason.
//!
//! The relay listens on the undeclared platform port (5003, `agent`) only to refuse: the
//! connection is closed at once, nothing is dialled, and a `refused` line names
//! "service not declared by app". A port the platform does not list has no socket at all.

use crate::support::*;

#[test]
fn undeclared_service_is_refused_and_logged() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start(&[("a", dir.path().join("ep-a"))]);
    let uds = dir.path().join("vm.vsock");
    let relay = RelayProc::start(
        dir.path(),
        "relay",
        &serde_json::json!({
            "app": "app-a",
            "vm": {"id": "vm-a"},
            "transport": {"per_vm_socket": {"vsock_uds": uds}},
            "services": [{"name": "dovecot-auth", "port": 5001,
                          "upstream": {"unix": dir.path().join("ep-a")}}],
            "undeclared": [{"name": "agent", "port": 5003}]
        }),
    );
    // The declared service works (so the refusal below is about the port, not the relay).
    assert_eq!(
        exchange(&port_path(&uds, 5001), "ping\n").unwrap(),
        "hello a\n"
    );

    // The undeclared one: closed at once, no byte back, nothing dialled.
    match exchange(&port_path(&uds, 5003), "ping\n") {
        Ok(s) => assert_eq!(s, "", "an undeclared service must answer nothing"),
        Err(e) => assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ),
            "{e}"
        ),
    }
    let line = relay.wait_for_line(&["refused", "service=agent"]);
    assert!(line.contains("app=app-a"), "{line}");
    assert!(line.contains("peer=unix"), "{line}");
    assert!(line.contains("service not declared by app"), "{line}");
    assert_eq!(
        rec.seen().len(),
        1,
        "only the declared connection reached a service"
    );

    // A port the platform does not list at all: nothing there.
    let err = exchange(&port_path(&uds, 5004), "ping\n").unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    assert!(relay.stop().success());
}
