//! Bad bootstrap material through the real `guest-init enroll`: each case exits with the
//! configuration/material code (2), says what is wrong (naming the field or the limit),
//! never prints the token, and writes nothing (no state directory, no published
//! certificate). No enrollment service is needed: nothing may get that far.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::Command;

const TOKEN: &str = "tok_BADINPUT_SECRET_abcdefghijklmnopqrstuvwxyz";

fn good() -> serde_json::Value {
    serde_json::json!({
        "version": 1,
        "workspace_namespace": "team-a",
        "workspace_name": "ws1",
        "workspace_uid": "u-1",
        "vm_uid": "vm-1",
        "revocation_epoch": 0,
        "token": TOKEN,
        "expires_at": 4000000000u64,
        "enrollment_port": 5002,
        "management_ca": crate::support::management_ca_b64(),
    })
}

fn run(material: &[u8], mode: u32) -> (i32, String, tempfile::TempDir) {
    run_with(material, mode, |_| {})
}

/// As [`run`], with `edit` applied to the enrollment section first.
fn run_with(
    material: &[u8],
    mode: u32,
    edit: impl FnOnce(&mut serde_json::Value),
) -> (i32, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let boot = dir.path().join("bootstrap.json");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&boot)
        .unwrap();
    f.write_all(material).unwrap();
    drop(f);
    std::fs::set_permissions(&boot, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    let cfg = dir.path().join("guest.json");
    let mut section = serde_json::json!({
        "bootstrap": {"file": boot},
        "state_dir": dir.path().join("state"),
        "publish_dir": dir.path().join("identity"),
        "service": {"unix": dir.path().join("nobody-listens.sock")},
        "retry": {"initial_ms": 1, "max_ms": 2, "max_attempts": 1},
    });
    edit(&mut section);
    std::fs::write(
        &cfg,
        serde_json::json!({"log_level": "debug", "enrollment": section}).to_string(),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_guest-init"))
        .args(["enroll", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text, dir)
}

fn assert_refused(material: &[u8], mode: u32, expect: &[&str]) {
    let (code, out, dir) = run(material, mode);
    assert_eq!(code, 2, "{out}");
    for e in expect {
        assert!(out.contains(e), "expected {e:?} in: {out}");
    }
    assert!(!out.contains(TOKEN), "the token leaked: {out}");
    assert!(
        !Path::new(&dir.path().join("state")).exists(),
        "state written"
    );
    assert!(
        !Path::new(&dir.path().join("identity")).exists(),
        "publish dir written"
    );
}

#[test]
fn malformed_json_is_refused_and_nothing_is_written() {
    let s = good().to_string();
    assert_refused(
        &s.as_bytes()[..s.len() - 10],
        0o600,
        &["bootstrap material", "line 1"],
    );
    assert_refused(b"not json at all", 0o600, &["bootstrap material"]);
}

#[test]
fn oversized_material_is_refused_and_nothing_is_written() {
    let mut v = good();
    v["workspace_name"] = "a".repeat(5000).into();
    assert_refused(v.to_string().as_bytes(), 0o600, &["larger than 4096 bytes"]);
}

#[test]
fn unknown_fields_are_refused_and_nothing_is_written() {
    let mut v = good();
    v["revocation_epoc"] = 3.into();
    assert_refused(v.to_string().as_bytes(), 0o600, &["unknown field"]);
}

#[test]
fn bad_values_name_the_field_and_never_echo_the_token() {
    let mut v = good();
    v["vm_uid"] = TOKEN.replace('_', ":").into();
    assert_refused(v.to_string().as_bytes(), 0o600, &["vm_uid"]);
    let mut v = good();
    v["revocation_epoch"] = serde_json::Value::String(TOKEN.into());
    assert_refused(v.to_string().as_bytes(), 0o600, &["invalid type"]);
    let mut v = good();
    v["revocation_epoch"] = (-1).into();
    assert_refused(v.to_string().as_bytes(), 0o600, &["bootstrap material"]);
}

#[test]
fn material_without_a_usable_management_ca_is_refused_naming_the_field() {
    let mut v = good();
    v.as_object_mut().unwrap().remove("management_ca");
    assert_refused(
        v.to_string().as_bytes(),
        0o600,
        &["missing field `management_ca`"],
    );
    let mut v = good();
    v["management_ca"] = "bm90IGEgY2VydGlmaWNhdGU=".into();
    assert_refused(
        v.to_string().as_bytes(),
        0o600,
        &["management_ca: the pinned CA certificate is not a DER X.509 certificate"],
    );
}

#[test]
fn a_readable_bootstrap_file_is_refused() {
    assert_refused(good().to_string().as_bytes(), 0o644, &["must be 0600"]);
}

#[test]
fn good_material_gets_past_validation() {
    // The control for the cases above: the same document, well formed, reaches the
    // exchange (and fails there as unavailable, exit 4, with the state written).
    let (code, out, dir) = run(good().to_string().as_bytes(), 0o600);
    assert_eq!(code, 4, "{out}");
    assert!(dir.path().join("state/pending.json").exists());
    assert!(!out.contains(TOKEN));
}

#[test]
fn the_tpm_store_without_a_tpm_is_a_configuration_error() {
    // A host (or VM) without /dev/tpmrm0 asked for the TPM store: a configuration error
    // naming the field and the fix, before anything is written; never the file store.
    if std::path::Path::new("/dev/tpmrm0").exists() {
        // This machine has a TPM: the refusal cannot be provoked here. The VM test
        // `enroll_vm_tpm` covers the store with a TPM; this path needs a machine without.
        assert!(
            std::env::var("REQUIRE_ALL").as_deref() != Ok("1"),
            "this host has /dev/tpmrm0: run this test where there is none"
        );
        eprintln!("SKIPPED: this host has /dev/tpmrm0");
        return;
    }
    let (code, out, dir) = run_with(good().to_string().as_bytes(), 0o600, |s| {
        s["key_store"] = "tpm".into();
    });
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("key_store: \"tpm\" needs a TPM 2.0 at /dev/tpmrm0")
            && out.contains("give the VM a TPM"),
        "the message must name the field, the device and the fix: {out}"
    );
    assert!(!out.contains(TOKEN), "the token leaked: {out}");
    assert!(!dir.path().join("state").exists(), "state written");
    assert!(!dir.path().join("identity").exists(), "publish dir written");
}

#[test]
fn the_memory_store_is_refused_for_the_enroll_subcommand() {
    // `guest-init enroll` is its own process: a memory-store key would die with it, leaving
    // a published certificate for a key that no longer exists. Refused before anything is
    // read or written, naming the field and the fix.
    let (code, out, dir) = run_with(good().to_string().as_bytes(), 0o600, |s| {
        s["key_store"] = "memory".into();
    });
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("key_store") && out.contains("memory") && out.contains("\"file\""),
        "the message must name the field and the fix: {out}"
    );
    assert!(!out.contains(TOKEN), "the token leaked: {out}");
    assert!(!dir.path().join("state").exists(), "state written");
    assert!(!dir.path().join("identity").exists(), "publish dir written");
}
