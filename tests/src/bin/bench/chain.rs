//! The chain: this project's forwarding path, run from its real binaries.
//!
//! ```text
//! client ──unix──▶ guest-init ──unix:<uds>_<port>──▶ host-relay ──unix──▶ service
//!          (app's socket)       (stands in for vsock)   (per-VM socket mode)
//! ```
//!
//! `guest-init` runs as an ordinary process (not PID 1) with one forwarded service whose
//! target is `unix:<uds>_<port>`; `host-relay run` serves the same app in per-VM socket mode
//! for `<uds>`, so it listens exactly where a hybrid-vsock VMM (Cloud Hypervisor,
//! Firecracker, vhost-device-vsock) would connect for a guest dialling host port `<port>`.
//! The only thing missing compared with a VM is the VMM's own vsock copy, which is not
//! this project's code and would dominate under TCG anyway.
//!
//! `guest-init` is the static musl binary a VM boots (its allocator and size are what
//! ship); `host-relay` is the host build. Both are built once per run with
//! `cargo build --release` so a stale binary is never measured. The app `guest-init`
//! supervises is `sleep`, running as the test identity uid/gid 20001.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use super::paths::{self, Route};

/// The vsock port the benchmark's services use.
pub const PORT_BASE: u32 = 6001;

/// The release binaries the chain runs, built once per benchmark run.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// Static musl `guest-init`.
    pub guest_init: PathBuf,
    /// Host `host-relay`.
    pub host_relay: PathBuf,
    /// Static musl `guest-probe`, the app inside the VM path's guest.
    pub guest_probe: PathBuf,
}

/// Builds (once) and returns the chain's binaries, or why they are not available.
pub fn binaries() -> Result<Binaries, String> {
    static BUILT: OnceLock<Result<Binaries, String>> = OnceLock::new();
    BUILT.get_or_init(build).clone()
}

fn build() -> Result<Binaries, String> {
    let root = e2e::util::workspace_root();
    let target = target_dir();
    let run = |args: &[&str]| -> Result<(), String> {
        eprintln!("bench: cargo {}", args.join(" "));
        let out = Command::new(env!("CARGO"))
            .args(args)
            .arg("--target-dir")
            .arg(&target)
            .current_dir(&root)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| format!("cannot run cargo: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            let err = String::from_utf8_lossy(&out.stderr);
            let first: Vec<&str> = err
                .lines()
                .filter(|l| l.starts_with("error"))
                .take(3)
                .collect();
            Err(format!(
                "cargo {} failed: {}",
                args.join(" "),
                first.join(" / ")
            ))
        }
    };
    // A static musl binary: `$<NAME>_MUSL` when set (as the demo sets it), else built here.
    let musl = |var: &str, package: &str, bin: &str| -> Result<PathBuf, String> {
        if let Some(p) = std::env::var_os(var) {
            return Ok(PathBuf::from(p));
        }
        run(&[
            "build",
            "--quiet",
            "--release",
            "--target",
            "x86_64-unknown-linux-musl",
            "-p",
            package,
            "--bin",
            bin,
        ])?;
        Ok(target.join("x86_64-unknown-linux-musl/release").join(bin))
    };
    let guest_init = musl("GUEST_INIT_MUSL", "guest-init", "guest-init")?;
    let guest_probe = musl("GUEST_PROBE_MUSL", "qemu-harness", "guest-probe")?;
    // `$HOST_RELAY_BIN` when set (to compare two builds of the relay), else built here.
    let host_relay = match std::env::var_os("HOST_RELAY_BIN") {
        Some(p) => PathBuf::from(p),
        None => {
            run(&[
                "build",
                "--quiet",
                "--release",
                "-p",
                "host-relay",
                "--bin",
                "host-relay",
            ])?;
            target.join("release/host-relay")
        }
    };
    Ok(Binaries {
        guest_init,
        host_relay,
        guest_probe,
    })
}

/// The target directory the benchmark itself was built in (`<target>/<profile>/bench`), so
/// the binaries it builds share that build cache whatever `CARGO_TARGET_DIR` says now.
fn target_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.to_path_buf()))
        .filter(|t| t.join("release").is_dir() || t.join("debug").is_dir())
        .unwrap_or_else(e2e::util::target_dir)
}

/// The `guest-init` configuration: `sleep` as the app, and one forwarded service per
/// `(listen, target)` pair.
pub fn guest_config(services: &[(String, PathBuf, PathBuf)]) -> serde_json::Value {
    let services: Vec<_> = services
        .iter()
        .map(|(name, listen, target)| {
            serde_json::json!({
                "name": name,
                "listen": listen,
                "target": { "unix": target },
                "mode": "0666",
            })
        })
        .collect();
    serde_json::json!({
        "version": 1,
        "app": {
            "command": ["/bin/sleep", "1000000"],
            "user": 20001,
            "group": 20001,
        },
        "services": services,
    })
}

/// `host-relay`'s configuration for app `bench-<tag>`: per-VM socket mode on `uds`, one
/// service on vsock port `port` to the Unix socket `service`; the `auth` tag makes it a
/// Dovecot sign-in service with the filter, any other an echo service.
pub fn relay_config(tag: &str, uds: &Path, port: u32, service: &Path) -> serde_json::Value {
    let dovecot = tag == "auth";
    let mut svc = serde_json::json!({
        "name": tag,
        "port": port,
        "upstream": { "unix": service },
    });
    if !dovecot {
        // The burst holds every connection open at once; the relay's per-VM fairness
        // limit (default 64 upstream connections, see docs/RELAY.md) would queue all but
        // 64 of them until the others end, which they never do. The benchmark measures
        // the relay, not that policy, so the echo chain allows as many as the burst.
        svc["max_upstream"] = 65_535.into();
    }
    if dovecot {
        svc["kind"] = "dovecot-auth".into();
        svc["dovecot"] = serde_json::json!({
            "client_address": "100.64.0.7",
            "reserved_networks": ["100.64.0.0/10"]
        });
    }
    serde_json::json!({
        "app": format!("bench-{tag}"),
        "vm": {"id": format!("bench-{tag}"), "gateways": ["10.0.2.2"]},
        "transport": {"per_vm_socket": {"vsock_uds": uds}},
        "services": [svc],
    })
}

/// Starts `host-relay` and `guest-init` in front of `service`; clients connect to the
/// returned route's entry. `tag` keeps the sockets of several chains apart.
pub fn start(dir: &Path, tag: &str, service: &Path) -> io::Result<Route> {
    let bins = binaries().map_err(io::Error::other)?;
    let port = PORT_BASE;
    let uds = dir.join(format!("{tag}-vm.vsock"));
    let relay_conf = relay_config(tag, &uds, port, service);
    let relay_path = dir.join(format!("{tag}-relay.json"));
    std::fs::write(&relay_path, relay_conf.to_string())?;
    let hybrid = PathBuf::from(format!("{}_{port}", uds.display()));
    let entry = dir.join(format!("{tag}-app.sock"));
    let guest_path = dir.join(format!("{tag}-guest.json"));
    std::fs::write(
        &guest_path,
        guest_config(&[(tag.to_string(), entry.clone(), hybrid.clone())]).to_string(),
    )?;

    let mut route = paths::chain_shell(entry.clone());
    let relay_log = dir.join(format!("{tag}-relay.log"));
    let mut relay = Command::new(&bins.host_relay)
        .arg("run")
        .arg("--config")
        .arg(&relay_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&relay_log)?)
        .spawn()
        .map_err(|e| io::Error::other(format!("cannot start host-relay: {e}")))?;
    let r = paths::wait_for_listener(&hybrid, &mut relay, "host-relay")
        .map_err(|e| with_log(e, &relay_log));
    route.relay_pid = Some(relay.id());
    paths::adopt(&mut route, relay);
    r?;
    let guest_log = dir.join(format!("{tag}-guest.log"));
    let mut guest = Command::new(&bins.guest_init)
        .arg("--config")
        .arg(&guest_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&guest_log)?)
        .spawn()
        .map_err(|e| io::Error::other(format!("cannot start guest-init: {e}")))?;
    let r = paths::wait_for_listener(&entry, &mut guest, "guest-init")
        .map_err(|e| with_log(e, &guest_log));
    route.forwarder_pid = Some(guest.id());
    paths::adopt(&mut route, guest);
    r?;
    Ok(route)
}

/// Adds the last lines of a process's log to an error.
fn with_log(e: io::Error, log: &Path) -> io::Error {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let tail: Vec<&str> = text.lines().rev().take(4).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    io::Error::other(format!("{e}; its log ends: {}", tail.join(" / ")))
}
