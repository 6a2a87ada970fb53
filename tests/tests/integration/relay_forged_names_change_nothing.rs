//! ADR 065 acceptance: a forged app name inside the protocol does not change who the
//! service sees.
//!
//! App A's guest sends sign-in lines that name app B everywhere the protocol allows
//! (`service=`, `session=`, `client_id=`, `local_name=`). The recording service notes,
//! for each connection, which endpoint it arrived on and its `SO_PEERCRED`:
//! - option (a), per-app endpoints: A's connections arrive on A's endpoint, never B's;
//! - option (b), one shared endpoint, relay dropped to the app's uid/gid: A's connections
//!   carry uid/gid 20001 and B's 20002, whatever the lines say.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::support::*;

const FORGED: &str =
    "AUTH\t1\tPLAIN\tservice=app-b\tsession=app-b\tclient_id=app-b\tlocal_name=app-b\tresp=AA==\n";

fn config(app: &str, dir: &Path, upstream: &Path, run_as: Option<u32>) -> serde_json::Value {
    let mut c = serde_json::json!({
        "app": app,
        "vm": {"id": format!("vm-{app}"), "gateways": ["10.0.2.2"]},
        "transport": {"unix": {"listen": {"dovecot-auth": dir.join(format!("{app}.sock"))}}},
        "services": [{"name": "dovecot-auth", "port": 5001, "kind": "dovecot-auth",
                      "upstream": {"unix": upstream},
                      "dovecot": {"rip_policy": "drop",
                                  "reserved_networks": ["100.64.0.0/10"]}}]
    });
    if let Some(id) = run_as {
        c["run_as"] = serde_json::json!({"uid": id, "gid": id, "groups": [id]});
    }
    c
}

#[test]
fn option_a_per_app_endpoint_decides_not_the_protocol() {
    let dir = tempfile::tempdir().unwrap();
    let (ep_a, ep_b) = (dir.path().join("ep-a"), dir.path().join("ep-b"));
    let rec = Recorder::start(&[("a", ep_a.clone()), ("b", ep_b.clone())]);
    let relay = RelayProc::start(dir.path(), "a", &config("app-a", dir.path(), &ep_a, None));
    let reply = exchange(&dir.path().join("app-a.sock"), FORGED).unwrap();
    assert_eq!(reply, "hello a\n");
    let seen = rec.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].endpoint, "a",
        "the endpoint, not service=app-b, decides"
    );
    // The forged fields reach the service as the guest wrote them; they name nobody.
    assert!(seen[0].first_line.contains("service=app-b"), "{seen:?}");
    assert!(relay.stop().success());
}

#[test]
fn option_b_peer_credentials_are_the_apps_whatever_the_lines_say() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let shared = dir.path().join("ep-shared");
    let rec = Recorder::start(&[("shared", shared.clone())]);
    // Each relay's own run directory belongs to its app, so after dropping to the app's
    // uid it can still remove its socket files on shutdown.
    let mut relays = Vec::new();
    for (app, id) in [("app-a", 20001u32), ("app-b", 20002u32)] {
        let run = dir.path().join(app);
        std::fs::create_dir(&run).unwrap();
        std::os::unix::fs::chown(&run, Some(id), Some(id)).unwrap();
        let relay = RelayProc::start(&run, app, &config(app, &run, &shared, Some(id)));
        relay.wait_for_line(&["dropped to the app's credentials", &format!("uid={id}")]);
        relays.push((run, app, relay));
    }
    for (run, app, _) in &relays {
        let reply = exchange(&run.join(format!("{app}.sock")), FORGED).unwrap();
        assert_eq!(reply, "hello shared\n");
    }
    let seen = rec.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let mut creds: Vec<(u32, u32)> = seen.iter().map(|s| (s.uid, s.gid)).collect();
    creds.sort();
    assert_eq!(
        creds,
        vec![(20001, 20001), (20002, 20002)],
        "each relay connects as its own app, never as root or as the app the lines name"
    );
    for (run, app, relay) in relays {
        assert!(relay.stop().success());
        assert!(
            !run.join(format!("{app}.sock")).exists(),
            "socket removed after dropping privileges"
        );
    }
}
