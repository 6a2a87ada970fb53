//! The VM path under QEMU/TCG, reported separately from figures 1-8 and informative only.
//!
//! TCG translates every guest instruction, so these numbers say how the whole real path
//! behaves here, not what it costs on KVM; they have no targets. Each boot is a fresh
//! micro-VM from `qemu_harness`: the real Debian kernel, virtio-vsock through the real
//! `vhost-device-vsock`, the static musl `guest-init` as PID 1 and, as its app,
//! `guest-probe signin-timed`, which signs in the way Radicale does (one `recv` for the
//! greeting) at the unchanged path `/var/run/dovecot/auth-client`:
//!
//! ```text
//! guest-probe ─unix─▶ guest-init ─AF_VSOCK─▶ vhost-device-vsock ─<uds>_5001─▶ host-relay ─▶ Dovecot
//! ```
//!
//! Per boot, three numbers: boot to ready (QEMU's start to guest-init's `ready in` line
//! seen on the host, through the harness), guest-init's own start-to-ready, and the
//! in-guest sign-in p50/p99, timed by the probe inside the guest (the host's clock cannot
//! see where a round trip starts). The table quotes medians over the boots; a boot whose
//! sign-ins did not all succeed is a note, never a silent gap.

use std::path::Path;
use std::time::Duration;

use e2e::radicale_vm::{
    relay_config, CONTROL_PORT, DOVECOT_AUTH_PORT, PASSWORD, USER, VSOCK_CID_ANY,
};
use qemu_harness::{Image, RelaySpec, Vm, VmSpec};
use serde_json::json;
use vm_image::initramfs::{ExtraFile, InitramfsSpec, Source};

use super::chain::{binaries, Binaries};
use super::report::Row;
use super::stats::{median, millis};
use super::Settings;

/// Where Radicale expects Dovecot, unchanged.
const AUTH_PATH: &str = "/var/run/dovecot/auth-client";
pub const PROBE: &str = "/bin/guest-probe";
pub const APP_UID: u32 = 20001;
/// How long the in-guest sign-ins of one boot may take under TCG.
const SIGN_IN_TIMEOUT: Duration = Duration::from_secs(600);

/// What one boot measured.
#[derive(Debug)]
struct Boot {
    boot_to_ready_ms: f64,
    guest_ready_ms: f64,
    p50_ms: f64,
    p99_ms: f64,
    ok: usize,
}

/// Reads one number of a boot.
type Field = fn(&Boot) -> f64;

fn rows(boots: &[Boot], sign_ins: usize) -> Vec<Row> {
    let col = |f: Field| -> [Option<f64>; 4] {
        let v: Vec<f64> = boots.iter().map(f).collect();
        [None, median(&v), None, None]
    };
    let timed: [(&str, Field); 4] = [
        ("boot to ready (QEMU start to ready line)", |b| {
            b.boot_to_ready_ms
        }),
        ("guest-init start to ready, in guest", |b| b.guest_ready_ms),
        ("in-guest sign-in p50 through vsock", |b| b.p50_ms),
        ("in-guest sign-in p99 through vsock", |b| b.p99_ms),
    ];
    let mut rows: Vec<Row> = timed
        .into_iter()
        .map(|(metric, f)| Row::new("VM", metric, "ms", col(f)).ratios("informative (TCG)".into()))
        .collect();
    rows.push(Row::new(
        "VM",
        format!("sign-ins succeeded of {sign_ins} (worst boot)"),
        "count",
        [
            None,
            boots.iter().map(|b| b.ok as f64).reduce(f64::min),
            None,
            None,
        ],
    ));
    rows
}

/// What a VM path needs from this machine (QEMU, the guest kernel, vhost-device-vsock,
/// the binaries, and the `extra` programs, each `(name, how to install it)`): the
/// binaries, or every missing part in one message.
pub fn preflight(extra: &[(bool, &str)]) -> Result<Binaries, String> {
    let mut missing = Vec::new();
    let cache = e2e::util::cache_dir();
    if !e2e::util::have_program("qemu-system-x86_64") {
        missing.push("qemu-system-x86_64 (apt-get install qemu-system-x86)".to_string());
    }
    for (file, what) in [
        ("kernel/current/vmlinuz", "the guest kernel"),
        ("tools/bin/vhost-device-vsock", "vhost-device-vsock"),
    ] {
        if !cache.join(file).is_file() {
            missing.push(format!(
                "{what} ({}; run scripts/setup.sh)",
                cache.join(file).display()
            ));
        }
    }
    for (present, what) in extra {
        if !present {
            missing.push(what.to_string());
        }
    }
    let bins = binaries();
    if let Err(e) = &bins {
        missing.push(e.clone());
    }
    match bins {
        Ok(b) if missing.is_empty() => Ok(b),
        _ => Err(missing.join("; ")),
    }
}

/// The VM rows: `s.vm_boots` boots, each with `s.vm_sign_ins` in-guest sign-ins.
pub fn figures(s: &Settings, notes: &mut Vec<String>) -> Vec<Row> {
    let bins = match preflight(&[(
        e2e::dovecot::Dovecot::available(),
        "Dovecot (apt-get install dovecot-core)",
    )]) {
        Ok(b) => b,
        Err(e) => {
            notes.push(format!("VM path not measured: {e}"));
            return rows(&[], s.vm_sign_ins);
        }
    };
    let dovecot = match e2e::dovecot::Dovecot::start(&e2e::dovecot::DovecotOptions::default()) {
        Ok(d) => d,
        Err(e) => {
            notes.push(format!("VM path not measured: Dovecot did not start: {e}"));
            return rows(&[], s.vm_sign_ins);
        }
    };
    let mut boots = Vec::new();
    for i in 0..s.vm_boots {
        eprintln!("bench: VM path, boot {} of {}", i + 1, s.vm_boots);
        match boot(&bins, &dovecot.auth_client(), s.vm_sign_ins) {
            Ok(b) => {
                if b.ok < s.vm_sign_ins {
                    notes.push(format!(
                        "VM boot {}: {} of {} in-guest sign-ins failed",
                        i + 1,
                        s.vm_sign_ins - b.ok,
                        s.vm_sign_ins
                    ));
                }
                boots.push(b);
            }
            Err(e) => notes.push(format!("VM boot {} failed: {e}", i + 1)),
        }
    }
    rows(&boots, s.vm_sign_ins)
}

/// guest-init's configuration: the vsock modules, the sign-in service at its unchanged
/// path, and the probe as the app.
fn guest_config(sign_ins: usize) -> serde_json::Value {
    let command = json!([
        PROBE,
        "signin-timed",
        sign_ins.to_string(),
        "--socket",
        AUTH_PATH,
        "--try",
        format!("{USER}:{PASSWORD}"),
        "--then-sleep"
    ]);
    probe_guest_config(command, "dovecot-auth", AUTH_PATH, DOVECOT_AUTH_PORT)
}

/// A bench guest's configuration: the vsock modules, `command` as the app (uid/gid
/// 20001, in `/tmp`), one service `name` published at `listen` for the app and forwarded
/// to host port `port`, and the control port for an orderly stop.
pub fn probe_guest_config(
    command: serde_json::Value,
    name: &str,
    listen: &str,
    port: u32,
) -> serde_json::Value {
    json!({
        "version": 1,
        "hostname": "bench-vm",
        "modules": vm_image::VSOCK_MODULES,
        "app": { "command": command, "user": APP_UID, "group": APP_UID, "workdir": "/tmp" },
        "services": [{
            "name": name,
            "listen": listen,
            "target": { "vsock": { "cid": 2, "port": port } },
            "owner": APP_UID,
            "group": APP_UID,
            "mode": "0660"
        }],
        "control": { "listen": { "vsock": { "cid": VSOCK_CID_ANY, "port": CONTROL_PORT } } },
        "shutdown": { "grace_period_ms": 5000 }
    })
}

fn boot(bins: &Binaries, auth_client: &Path, sign_ins: usize) -> Result<Boot, String> {
    let mut image = InitramfsSpec::new(&bins.guest_init, guest_config(sign_ins));
    image.files.push(ExtraFile {
        guest_path: PROBE.into(),
        source: Source::Host(bins.guest_probe.clone()),
        mode: 0o755,
    });
    let mut spec = VmSpec::new("bench", Image::Initramfs(Box::new(image)));
    spec.relay_bin = Some(bins.host_relay.clone());
    spec.progress = false;
    spec.relays = vec![RelaySpec {
        name: "auth".into(),
        config: relay_config(&spec.name, &spec.vsock_uds(), auth_client),
        wait_for: vec![spec.port_socket(DOVECOT_AUTH_PORT)],
    }];
    let mut vm = Vm::start(spec).map_err(|e| e.to_string())?;
    let ready = vm.ready().cloned().ok_or("no ready line")?;
    // The probe prints `signin-timed done: ...` after its result line: waiting for that
    // one means the result line is complete on the console (QEMU writes the serial
    // console as it comes, so a line matched while it is being written can be cut short).
    vm.wait_for_console("guest-probe: signin-timed done", SIGN_IN_TIMEOUT)
        .map_err(|e| e.to_string())?;
    let line = vm
        .console()
        .lines()
        .find(|l| l.contains("guest-probe: signin-timed ok="))
        .map(str::to_string)
        .ok_or("the probe printed no signin-timed result line")?;
    let stop = vm.stop().map_err(|e| e.to_string())?;
    if !stop.clean() {
        return Err(format!("the VM did not stop cleanly: {stop:?}"));
    }
    let (ok, p50, p99) =
        parse_signin_timed(&line).ok_or_else(|| format!("unreadable probe line {line:?}"))?;
    Ok(Boot {
        boot_to_ready_ms: millis(ready.boot_to_ready),
        guest_ready_ms: ready.guest_ms as f64,
        p50_ms: p50 / 1000.0,
        p99_ms: p99 / 1000.0,
        ok,
    })
}

/// `... signin-timed ok=K fail=F err=E p50_us=X p99_us=Y ...` → (K, X, Y).
fn parse_signin_timed(line: &str) -> Option<(usize, f64, f64)> {
    let field = |key: &str| -> Option<&str> {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
    };
    Some((
        field("ok")?.parse().ok()?,
        field("p50_us")?.parse().ok()?,
        field("p99_us")?.parse().ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_probe_line() {
        let line = "guest-probe: signin-timed ok=50 fail=0 err=0 p50_us=41234 p99_us=90001";
        assert_eq!(parse_signin_timed(line), Some((50, 41234.0, 90001.0)));
        assert_eq!(parse_signin_timed("guest-probe: signin-timed ok=x"), None);
    }

    #[test]
    fn no_boots_give_empty_rows_not_numbers() {
        let r = rows(&[], 10);
        assert_eq!(r.len(), 5);
        assert!(r.iter().all(|r| r.chain.is_none() && r.figure == "VM"));
    }
}
