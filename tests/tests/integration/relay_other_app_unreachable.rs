//! ADR 065 acceptance: a guest cannot reach another app's service endpoint.
//!
//! Two apps, A (uid 20001) and B (uid 20002), each with a relay in per-VM-socket mode.
//! Each relay's guest-facing sockets belong to its VM's VMM user (mode 0600), and each
//! relay dials only its own app's per-app endpoint. So:
//! - VM A's VMM (a process running as uid 20001, here `socat`) reaches A's endpoint
//!   through A's socket, and is refused by the file system at B's socket;
//! - nothing A's guest sends, on any of A's ports, ever arrives at B's endpoint.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::support::*;
use e2e::util::{have_program, require};

fn config(app: &str, uds: &Path, vmm_uid: u32, upstream: &Path) -> serde_json::Value {
    serde_json::json!({
        "app": app,
        "vm": {"id": format!("vm-{app}")},
        "transport": {"per_vm_socket": {"vsock_uds": uds}},
        "socket": {"mode": "0600", "uid": vmm_uid},
        "services": [{"name": "svc", "port": 5001, "upstream": {"unix": upstream}}],
        "undeclared": [{"name": "agent", "port": 5003}]
    })
}

/// Connects to `path` as `uid` (the VMM's user), sends a line, returns (success, output).
fn connect_as(uid: u32, path: &Path) -> (bool, String) {
    let out = Command::new("socat")
        .args(["-t", "5", "-", &format!("UNIX-CONNECT:{}", path.display())])
        .uid(uid)
        .gid(uid)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(b"ping\n")?;
            c.wait_with_output()
        })
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[test]
fn a_guest_cannot_reach_another_apps_endpoint() {
    if !require(have_program("socat"), "socat (apt socat)") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let (ep_a, ep_b) = (dir.path().join("ep-a"), dir.path().join("ep-b"));
    let rec = Recorder::start(&[("a", ep_a.clone()), ("b", ep_b.clone())]);
    let (uds_a, uds_b) = (dir.path().join("a.vsock"), dir.path().join("b.vsock"));
    let relay_a = RelayProc::start(dir.path(), "a", &config("app-a", &uds_a, 20001, &ep_a));
    let relay_b = RelayProc::start(dir.path(), "b", &config("app-b", &uds_b, 20002, &ep_b));

    // VM A's VMM reaches A's service through A's socket...
    let (ok, out) = connect_as(20001, &port_path(&uds_a, 5001));
    assert!(ok && out.contains("hello a"), "A's own socket: {out}");
    // ...and cannot open B's socket at all.
    for port in [5001, 5003] {
        let (ok, out) = connect_as(20001, &port_path(&uds_b, port));
        assert!(!ok, "VM A's VMM must not open B's socket: {out}");
        assert!(out.contains("Permission denied"), "{out}");
    }
    // Whatever A's guest sends on any of A's ports, it lands at A's endpoint or nowhere.
    for port in [5001, 5003] {
        let _ = exchange(&port_path(&uds_a, port), "AUTH\t1\tPLAIN\tservice=app-b\n");
    }
    let seen = rec.seen();
    assert!(!seen.is_empty());
    assert!(
        seen.iter().all(|s| s.endpoint == "a"),
        "B's endpoint was reached: {seen:?}"
    );
    assert!(relay_a.stop().success());
    assert!(relay_b.stop().success());
}
