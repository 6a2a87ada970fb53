//! `guest-init check-config FILE`: every bad configuration is refused with exit status 1 and
//! a message that names the field (and, for JSON errors, the line), and nothing runs.

use std::process::Command;

use crate::support::*;

/// Runs check-config on `text`; returns (exit code, stdout + stderr).
fn check(text: &str) -> (i32, String) {
    let dir = scratch();
    let p = dir.path().join("c.json");
    std::fs::write(&p, text).unwrap();
    let out = Command::new(bin())
        .arg("check-config")
        .arg(&p)
        .output()
        .unwrap();
    let msg = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), msg)
}

fn assert_refused(text: &str, expected: &[&str]) {
    let (code, msg) = check(text);
    assert_eq!(code, 1, "must be refused: {text}\n{msg}");
    for e in expected {
        assert!(msg.contains(e), "message lacks {e:?}: {msg}");
    }
    assert!(msg.contains("c.json"), "message must name the file: {msg}");
}

const APP: &str = r#""app": {"command": ["/bin/true"], "user": 0}"#;

#[test]
fn a_good_configuration_passes() {
    let (code, msg) = check(&format!(r#"{{"version": 1, {APP}}}"#));
    assert_eq!(code, 0, "{msg}");
    assert!(msg.contains("ok"));
}

#[test]
fn missing_fields_are_named() {
    assert_refused(
        r#"{"version": 1, "app": {"user": 0}}"#,
        &["app.command: missing field `command`", "line 1"],
    );
    assert_refused(r#"{"version": 1}"#, &["app: missing field `app`"]);
    assert_refused(&format!("{{{APP}}}"), &["version: missing field `version`"]);
    assert_refused(
        &format!(r#"{{"version": 1, {APP}, "services": [{{"name": "a", "listen": "/run/a"}}]}}"#),
        &["services[0].target: missing field `target`"],
    );
}

#[test]
fn wrong_types_are_named_with_the_line() {
    assert_refused(
        &format!("{{\"version\": 1,\n {APP},\n \"shutdown\": {{\"grace_period_ms\": \"soon\"}}}}"),
        &[
            "shutdown.grace_period_ms: invalid type: string \"soon\"",
            "line 3",
        ],
    );
    assert_refused(
        r#"{"version": 1, "app": {"command": "/bin/true", "user": 0}}"#,
        &["app.command: invalid type: string", "expected a sequence"],
    );
    assert_refused(
        &format!(r#"{{"version": 1, {APP}, "shutdown": {{"action": "halt"}}}}"#),
        &[
            "shutdown.action: unknown variant `halt`",
            "`poweroff` or `reboot`",
        ],
    );
}

#[test]
fn unknown_fields_are_named() {
    assert_refused(
        &format!(r#"{{"version": 1, {APP}, "shutdown": {{"grace": 1}}}}"#),
        &["shutdown.grace: unknown field `grace`", "grace_period_ms"],
    );
    assert_refused(
        &format!(r#"{{"version": 1, {APP}, "hostnmae": "x"}}"#),
        &["unknown field `hostnmae`"],
    );
}

#[test]
fn unknown_users_and_groups_are_named() {
    assert_refused(
        r#"{"version": 1, "app": {"command": ["/bin/true"], "user": "nope"}}"#,
        &["app.user: unknown user \"nope\"", "numeric uid"],
    );
    assert_refused(
        r#"{"version": 1, "app": {"command": ["/bin/true"], "user": 0, "group": "nogroup-xyz"}}"#,
        &["app.group: unknown group \"nogroup-xyz\""],
    );
    assert_refused(
        r#"{"version": 1, "app": {"command": ["/bin/true"], "user": 0, "supplementary_groups": [0, "nogroup-xyz"]}}"#,
        &["app.supplementary_groups[1]: unknown group"],
    );
    assert_refused(
        &format!(
            r#"{{"version": 1, {APP}, "services": [{{"name": "a", "listen": "/run/a.sock", "target": {{"unix": "/run/b"}}, "owner": "nope"}}]}}"#
        ),
        &["services[0].owner: unknown user \"nope\""],
    );
    // A numeric user without a passwd entry needs an explicit group.
    assert_refused(
        r#"{"version": 1, "app": {"command": ["/bin/true"], "user": 20001}}"#,
        &["app.group: missing", "set app.group"],
    );
}

#[test]
fn relative_paths_are_refused() {
    let svc = r#"{"name": "a", "listen": "/run/a.sock", "target": {"unix": "/run/b"}}"#;
    assert_refused(
        &format!(
            r#"{{"version": 1, {APP}, "services": [{svc}, {{"name": "b", "listen": "x", "target": {{"unix": "/run/b"}}}}]}}"#
        ),
        &["services[1].listen:", "relative; use an absolute path"],
    );
    // The endpoint spelling where a plain path is expected gets the corrected value.
    assert_refused(
        &format!(
            r#"{{"version": 1, {APP}, "services": [{{"name": "a", "listen": "unix:/run/a.sock", "target": {{"unix": "/run/b"}}}}]}}"#
        ),
        &[
            "services[0].listen:",
            "takes a plain path; write /run/a.sock",
        ],
    );
    assert_refused(
        &format!(r#"{{"version": 1, {APP}, "control": {{"listen": {{"unix": "ctl.sock"}}}}}}"#),
        &["control.listen:", "relative"],
    );
    assert_refused(
        r#"{"version": 1, "app": {"command": ["/bin/true"], "user": 0, "workdir": "srv"}}"#,
        &["app.workdir: relative path \"srv\""],
    );
    assert_refused(
        &format!(r#"{{"version": 1, {APP}, "root": {{"device": "vda"}}}}"#),
        &["root.device: relative path"],
    );
}

#[test]
fn other_semantic_errors_are_named() {
    assert_refused(
        &format!(r#"{{"version": 2, {APP}}}"#),
        &["version: version 2 is not supported"],
    );
    assert_refused(
        r#"{"version": 1, "app": {"command": [], "user": 0}}"#,
        &["app.command: empty"],
    );
    assert_refused(
        &format!(r#"{{"version": 1, {APP}, "modules": ["vsock", "virtio_pci.ko"]}}"#),
        &["modules[1]"],
    );
    assert_refused(
        &format!(
            r#"{{"version": 1, {APP}, "network": {{"interface": "eth0", "address": "10.0.2.15"}}}}"#
        ),
        &["network.address", "prefix length"],
    );
    assert_refused(
        &format!(r#"{{"version": 1, {APP}, "hostname": "bad name"}}"#),
        &["hostname:"],
    );
}

#[test]
fn a_missing_file_is_named() {
    let out = Command::new(bin())
        .args(["check-config", "/nonexistent/guest-init.json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let msg = String::from_utf8_lossy(&out.stderr);
    assert!(msg.contains("/nonexistent/guest-init.json"), "{msg}");
}

#[test]
fn bad_usage_is_explained() {
    let out = Command::new(bin()).arg("--frobnicate").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage: guest-init"));
}
