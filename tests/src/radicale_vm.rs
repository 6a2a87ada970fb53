//! Real Radicale in a real micro-VM, signing in through the whole path: the scenario shared
//! by VM test 9 (`tests/tests/integration/vm_radicale.rs`) and the demo (`src/bin/demo.rs`).
//!
//! # The path of one sign-in
//!
//! ```text
//!  host: HTTP client ── 127.0.0.1:PORT ──▶ QEMU user networking (hostfwd)
//!  guest: ──▶ 10.0.2.15:5232 Radicale 3.9.0 (uid 1001; sees the client as 10.0.2.2)
//!         Radicale ── /var/run/dovecot/auth-client ──▶ guest-init (PID 1) forwarder
//!         ── AF_VSOCK CID 2 port 5001 ──▶ virtio-vsock
//!  host: ──▶ vhost-device-vsock ── <vm.vsock>_5001 ──▶ host-relay (per-VM socket mode,
//!         dovecot-auth filter) ──▶ Dovecot 2.3 auth-client (passwd-file)
//! ```
//!
//! Everything on that path is the real program: Debian's cloud kernel under QEMU (TCG
//! here), `vhost-device-vsock`, the static `guest-init` and `host-relay`, Radicale from
//! PyPI with its stock `[auth] type = dovecot` configuration on a root disk
//! ([`crate::radicale_rootfs`]), and Dovecot from Debian ([`crate::dovecot`]).
//!
//! # What it shows (the threat it is about)
//!
//! Behind QEMU's NAT every HTTP client of Radicale appears as the gateway 10.0.2.2, and
//! Radicale 3.9 passes that as `rip=` in its `AUTH` line. Dovecot keys its failed-attempt
//! penalty on `rip`, so unfiltered, every app behind a gateway would share one budget and
//! one app's wrong passwords would delay (and, through Radicale's 5 s timeout, fail)
//! everyone's sign-ins. The relay is configured with the VM's gateway and the app's own
//! client address ([`APP_CLIENT_ADDRESS`]); the scenario checks that Radicale really saw
//! the gateway (its log, on the guest console) and that Dovecot never did (its log, with
//! `auth_verbose` and `auth_debug`, shows each request's `rip`).
//!
//! # Design
//!
//! [`Scenario::start`] brings the parts up in dependency order and records how long each
//! phase took ([`Phase`]): root disk (cached by its inputs), Dovecot, initramfs, then the
//! VM through [`qemu_harness`] (kernel, vsock backend, relays, boot, ready), then waits
//! until Radicale answers HTTP. [`Scenario::sign_in`] is one `PROPFIND` with Basic
//! credentials ([`http`]). [`Scenario::stop`] asks guest-init to stop over its vsock
//! control port and reports QEMU's exit. Dropping a scenario kills whatever is still
//! running, so a failing test leaves no process or socket behind.

pub mod http;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// QEMU user networking's gateway: the client address Radicale sees for every request.
pub const GATEWAY: &str = "10.0.2.2";
/// The guest's address under QEMU user networking.
pub const GUEST_ADDRESS: &str = "10.0.2.15/24";
/// The app's own client address: what the relay puts in `rip` instead of the gateway.
pub const APP_CLIENT_ADDRESS: &str = "100.64.0.11";
/// The vsock port of the sign-in service (docs/CONTRACTS.md).
pub const DOVECOT_AUTH_PORT: u32 = 5001;
/// The vsock port of guest-init's control listener (docs/CONTRACTS.md).
pub const CONTROL_PORT: u32 = 1024;
/// `VMADDR_CID_ANY`, to listen on vsock.
pub const VSOCK_CID_ANY: u32 = u32::MAX;
/// The user the scenario signs in as, and the right password. (Test credentials of a
/// throwaway Dovecot, not secrets.)
pub const USER: &str = "alice";
/// The right password for [`USER`].
pub const PASSWORD: &str = "secret123";

/// Kernel modules the guest loads: vsock over virtio-pci, the root disk and the network.
/// The image builder expands dependencies and drops those built into the kernel (the
/// cloud kernel has ext4, jbd2, mbcache and crc16 built in).
pub fn guest_modules() -> Vec<String> {
    let mut m: Vec<String> = vm_image::VSOCK_MODULES
        .iter()
        .map(|s| s.to_string())
        .collect();
    for extra in ["virtio_blk", "ext4", "virtio_net"] {
        m.push(extra.to_string());
    }
    m
}

/// guest-init's configuration for the Radicale VM.
pub fn guest_config() -> Value {
    use crate::radicale_rootfs as r;
    json!({
        "version": 1,
        "hostname": "radicale-vm",
        "log_level": "info",
        "modules": guest_modules(),
        "root": { "device": "/dev/vda", "fstype": "ext4", "wait_ms": 10000 },
        "network": {
            "interface": "eth0",
            "address": GUEST_ADDRESS,
            "gateway": GATEWAY
        },
        "app": {
            "command": [r::GUEST_PYTHON, "-m", "radicale", "--config", r::RADICALE_CONFIG_PATH],
            "user": r::RADICALE_UID,
            "group": r::RADICALE_UID,
            "env": {
                "HOME": "/var/lib/radicale",
                "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONUNBUFFERED": "1"
            },
            "workdir": "/var/lib/radicale"
        },
        "services": [{
            "name": "dovecot-auth",
            "listen": r::DOVECOT_SOCKET,
            "target": { "vsock": { "cid": 2, "port": DOVECOT_AUTH_PORT } },
            "owner": r::RADICALE_UID,
            "group": r::RADICALE_UID,
            "mode": "0660"
        }],
        "control": { "listen": { "vsock": { "cid": VSOCK_CID_ANY, "port": CONTROL_PORT } } },
        "shutdown": { "grace_period_ms": 5000 }
    })
}

/// host-relay's configuration for the VM: per-VM socket mode on `vsock_uds`, the sign-in
/// service filtered and sent to Dovecot's `auth_client` socket.
pub fn relay_config(vm_id: &str, vsock_uds: &Path, auth_client: &Path) -> Value {
    json!({
        "app": "radicale",
        "vm": {
            "id": vm_id,
            "gateways": [GATEWAY]
        },
        "transport": { "per_vm_socket": { "vsock_uds": vsock_uds } },
        "socket": { "mode": "0600" },
        "services": [{
            "name": "dovecot-auth",
            "port": DOVECOT_AUTH_PORT,
            "kind": "dovecot-auth",
            "upstream": { "unix": auth_client },
            "dovecot": {
                "rip_policy": "substitute",
                "client_address": APP_CLIENT_ADDRESS,
                "reserved_networks": ["100.64.0.0/10"]
            }
        }]
    })
}

/// One timed step, for the transcript and the report.
#[derive(Clone, Debug)]
pub struct Phase {
    /// Short name (`kernel`, `image`, `vsock backend`, `relays`, `boot`, `ready`...).
    pub name: String,
    /// What happened, in one line.
    pub detail: String,
    /// How long it took.
    pub took: Duration,
}

/// A scenario failure: which step, and what went wrong.
#[derive(Debug, thiserror::Error)]
#[error("{step}: {detail}")]
pub struct ScenarioError {
    /// The step that failed.
    pub step: String,
    /// What went wrong, with the console's or a log's last lines where they help.
    pub detail: String,
}

impl ScenarioError {
    fn new(step: &str, detail: impl std::fmt::Display) -> Self {
        ScenarioError {
            step: step.to_string(),
            detail: detail.to_string(),
        }
    }
}

/// Everything the scenario needs from the machine; see [`Requirements::check`].
#[derive(Clone, Debug)]
pub struct Requirements {
    /// The cache dir (kernel, tools, root disks).
    pub cache: PathBuf,
    /// What is missing, one phrase each.
    pub missing: Vec<String>,
}

impl Requirements {
    /// Looks for QEMU, the guest kernel, vhost-device-vsock, Dovecot, and either a root
    /// disk build's prerequisites (root, apt, pip) or nothing more.
    pub fn check() -> Self {
        let cache = crate::util::cache_dir();
        let mut missing = Vec::new();
        if !crate::util::have_program("qemu-system-x86_64") {
            missing.push("qemu-system-x86_64 (apt-get install qemu-system-x86)".into());
        }
        if let Err(e) = qemu_harness::Kernel::from_cache(&cache) {
            missing.push(format!("the guest kernel ({e})"));
        }
        if !cache.join("tools/bin/vhost-device-vsock").exists() {
            missing.push(format!(
                "vhost-device-vsock {}",
                cache.join("tools/bin/vhost-device-vsock").display()
            ));
        }
        if !crate::util::have_program("dovecot") && !Path::new("/usr/sbin/dovecot").exists() {
            missing.push("dovecot (apt-get install dovecot-core)".into());
        }
        if !crate::util::have_program("mke2fs") && !Path::new("/usr/sbin/mke2fs").exists() {
            missing.push("mke2fs (apt-get install e2fsprogs)".into());
        }
        if !nix::unistd::geteuid().is_root() {
            missing.push(
                "root (the Radicale root disk build uses chroot; the VM test runs as root in CI)"
                    .into(),
            );
        }
        Requirements { cache, missing }
    }

    /// Whether everything is there.
    pub fn ok(&self) -> bool {
        self.missing.is_empty()
    }
}

/// Seconds with one decimal, for transcripts.
pub fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// A loopback TCP port that was free a moment ago (for QEMU's `hostfwd`).
pub fn free_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// The HTTP address of Radicale through the port forward.
pub fn http_addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Elapsed time since `t`, and `t` reset to now.
fn lap(t: &mut Instant) -> Duration {
    let d = t.elapsed();
    *t = Instant::now();
    d
}

/// How to run the scenario.
#[derive(Clone, Debug)]
pub struct Options {
    /// The host port forwarded to Radicale; default: a free one.
    pub http_port: Option<u16>,
    /// Guest RAM in MiB (Python and Radicale want more than the harness's default).
    pub memory_mib: u32,
    /// Print the harness's phase lines to stderr.
    pub progress: bool,
    /// How long Radicale may take to answer HTTP after guest-init's ready line.
    pub http_timeout: Duration,
    /// The guest kernel; default: the harness's (`$MICROVM_KERNEL`, else `current`).
    pub kernel: Option<qemu_harness::Kernel>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            http_port: None,
            memory_mib: 512,
            progress: true,
            http_timeout: Duration::from_secs(180),
            kernel: None,
        }
    }
}

/// A Radicale VM with its Dovecot and relay, up and answering HTTP.
///
/// Fields drop in declaration order: the VM (QEMU, relay, vsock backend) first, then
/// Dovecot, then the work directory.
pub struct Scenario {
    vm: qemu_harness::Vm,
    dovecot: crate::dovecot::Dovecot,
    work: tempfile::TempDir,
    /// Radicale's address through the port forward.
    pub http: SocketAddr,
    /// Each phase, in order.
    pub phases: Vec<Phase>,
    /// The root disk used (its cache entry).
    pub rootfs: crate::radicale_rootfs::RadicaleRootfs,
    /// From QEMU's start to guest-init's ready line.
    pub boot_to_ready: Duration,
    /// From QEMU's start to Radicale's first HTTP answer.
    pub boot_to_http: Duration,
}

impl std::fmt::Debug for Scenario {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scenario")
            .field("http", &self.http)
            .field("run_dir", &self.vm.run_dir())
            .field("work", &self.work.path())
            .finish()
    }
}

impl Scenario {
    /// Builds (or finds) the root disk, starts Dovecot, boots the VM with its relay, and
    /// waits until Radicale answers HTTP. `on_phase` sees each phase as it ends.
    pub fn start(opts: &Options, on_phase: &mut dyn FnMut(&Phase)) -> Result<Self, ScenarioError> {
        let mut phases = Vec::new();
        let mut record = |name: &str, detail: String, took: Duration| {
            let p = Phase {
                name: name.to_string(),
                detail,
                took,
            };
            on_phase(&p);
            phases.push(p);
        };
        let cache = crate::util::cache_dir();
        let mut t = Instant::now();

        // Root disk: cached by its inputs; the VM writes to a private sparse copy.
        let rootfs = crate::radicale_rootfs::ensure(
            &crate::radicale_rootfs::RootfsOptions::new(&cache),
            &mut |line| eprintln!("[rootfs] {line}"),
        )
        .map_err(|e| ScenarioError::new("root disk", e))?;
        let work = tempfile::Builder::new()
            .prefix("radicale-vm-")
            .tempdir()
            .map_err(|e| ScenarioError::new("work directory", e))?;
        let disk = work.path().join("root.ext4");
        copy_sparse(&rootfs.image, &disk).map_err(|e| ScenarioError::new("root disk copy", e))?;
        record(
            "root disk",
            format!(
                "{} {} ({} MiB image, {} MiB of files; Python 3.11 + Radicale {})",
                if rootfs.from_cache { "cached" } else { "built" },
                rootfs.image.display(),
                rootfs.image_bytes >> 20,
                rootfs.content_bytes >> 20,
                crate::radicale_rootfs::RADICALE_VERSION
            ),
            lap(&mut t),
        );

        // Dovecot on the host, logging each request's rip.
        let dovecot = crate::dovecot::Dovecot::start(&crate::dovecot::DovecotOptions {
            users: vec![(USER.into(), PASSWORD.into())],
            log_requests: true,
            ..Default::default()
        })
        .map_err(|e| ScenarioError::new("dovecot", e))?;
        let dovecot_version =
            crate::dovecot::Dovecot::version().map_err(|e| ScenarioError::new("dovecot", e))?;
        record(
            "dovecot",
            format!(
                "Dovecot {} auth-client at {}",
                dovecot_version,
                dovecot.auth_client().display()
            ),
            lap(&mut t),
        );

        // The VM: guest-init + modules in the initramfs, the root disk, user networking
        // with Radicale's port forwarded, one relay for the sign-in service.
        let port = match opts.http_port {
            Some(p) => p,
            None => free_port().map_err(|e| ScenarioError::new("http port", e))?,
        };
        let guest_init = crate::util::musl_bin("guest-init");
        let relay_bin = crate::util::musl_bin("host-relay");
        let mut ispec = vm_image::initramfs::InitramfsSpec::new(&guest_init, guest_config());
        ispec.max_size = vm_image::initramfs::DEFAULT_MAX_SIZE;
        let mut spec =
            qemu_harness::VmSpec::new("radicale", qemu_harness::Image::Initramfs(Box::new(ispec)));
        spec.kernel = opts.kernel.clone();
        spec.memory_mib = opts.memory_mib;
        spec.progress = opts.progress;
        spec.disks = vec![(disk, false)];
        spec.net = Some(qemu_harness::UserNet {
            forwards: vec![(
                format!("127.0.0.1:{port}"),
                crate::radicale_rootfs::RADICALE_PORT,
            )],
        });
        spec.control_port = CONTROL_PORT;
        spec.relay_bin = Some(relay_bin);
        let relay = relay_config(&spec.name, &spec.vsock_uds(), &dovecot.auth_client());
        spec.relays = vec![qemu_harness::RelaySpec {
            name: "dovecot-auth".into(),
            config: relay,
            wait_for: vec![spec.port_socket(DOVECOT_AUTH_PORT)],
        }];
        let vm = qemu_harness::Vm::start(spec).map_err(|e| ScenarioError::new("vm", e))?;
        let ready = vm
            .ready()
            .cloned()
            .ok_or_else(|| ScenarioError::new("vm", "no ready line"))?;
        for (name, took) in vm.phases() {
            let detail = harness_phase_detail(name, &vm, &ready, port, &dovecot.auth_client());
            record(name, detail, *took);
        }
        t = Instant::now();

        // Radicale: guest-init's ready line means it started it; Python needs a while
        // more under TCG before it listens.
        let http = http_addr(port);
        let waited = http::wait_ready(http, Instant::now() + opts.http_timeout).map_err(|e| {
            ScenarioError::new(
                "radicale",
                format!(
                    "no HTTP answer at {http} within {:?} ({e}); console:\n{}",
                    opts.http_timeout,
                    tail_lines(&vm.console(), 30)
                ),
            )
        })?;
        let boot_to_http = ready.boot_to_ready + waited;
        record(
            "radicale",
            format!(
                "HTTP answers at {http} (python3 -m radicale as uid {})",
                crate::radicale_rootfs::RADICALE_UID
            ),
            lap(&mut t),
        );
        Ok(Scenario {
            vm,
            dovecot,
            work,
            http,
            phases,
            rootfs,
            boot_to_ready: ready.boot_to_ready,
            boot_to_http,
        })
    }

    /// One sign-in: `PROPFIND /<user>/` with Basic credentials.
    pub fn sign_in(&self, user: &str, password: &str) -> std::io::Result<http::Reply> {
        http::sign_in(self.http, user, password, Duration::from_secs(30))
    }

    /// The guest console so far (guest-init's lines and Radicale's log).
    pub fn console(&self) -> String {
        self.vm.console()
    }

    /// Dovecot's log so far.
    pub fn dovecot_log(&self) -> String {
        self.dovecot.log()
    }

    /// The relay's log so far.
    pub fn relay_log(&self) -> String {
        self.vm.relay_log("dovecot-auth")
    }

    /// The VM (for the run directory, the accelerator, the image size...).
    pub fn vm(&self) -> &qemu_harness::Vm {
        &self.vm
    }

    /// Asks guest-init to stop (control port) and waits for QEMU to exit.
    pub fn stop(&mut self) -> Result<qemu_harness::StopReport, ScenarioError> {
        self.vm.stop().map_err(|e| ScenarioError::new("stop", e))
    }
}

/// One line on what a harness phase did, for the transcript.
fn harness_phase_detail(
    name: &str,
    vm: &qemu_harness::Vm,
    ready: &qemu_harness::Ready,
    port: u16,
    auth_client: &Path,
) -> String {
    let spec = vm.spec();
    match name {
        "kernel" => format!(
            "Debian cloud kernel {}",
            spec.kernel
                .clone()
                .or_else(|| qemu_harness::Kernel::from_cache(&crate::util::cache_dir()).ok())
                .map(|k| k.version)
                .unwrap_or_default()
        ),
        "image" => format!(
            "initramfs {} KiB: static guest-init as /init, its config, {} configured module names \
             expanded from modules.dep (built-ins dropped)",
            vm.image_size() >> 10,
            guest_modules().len()
        ),
        "accel" => format!(
            "{} (KVM is used only where it boots this kernel)",
            vm.accel().name()
        ),
        "vsock backend" => format!(
            "vhost-device-vsock, guest CID {}, hybrid sockets {}_<port>",
            spec.guest_cid,
            spec.vsock_uds().display()
        ),
        "relays" => format!(
            "host-relay listens at {} -> Dovecot {} (rip {GATEWAY} -> {APP_CLIENT_ADDRESS})",
            spec.port_socket(DOVECOT_AUTH_PORT).display(),
            auth_client.display()
        ),
        "boot" => format!(
            "QEMU q35 ({}), {} MiB, root disk on virtio-blk, user net 127.0.0.1:{port} -> \
             guest :{}",
            vm.accel().name(),
            spec.memory_mib,
            crate::radicale_rootfs::RADICALE_PORT
        ),
        "ready" => format!(
            "{} (boot-to-ready {:.2} s)",
            ready
                .line
                .split("guest-init: ")
                .nth(1)
                .unwrap_or(&ready.line),
            ready.boot_to_ready.as_secs_f64()
        ),
        _ => String::new(),
    }
}

/// The last `n` lines of `text`.
pub fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Copies a sparse image, keeping it sparse (`cp --sparse=always`).
fn copy_sparse(from: &Path, to: &Path) -> std::io::Result<()> {
    let status = std::process::Command::new("cp")
        .arg("--sparse=always")
        .arg(from)
        .arg(to)
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "cp {} {}: {status}",
            from.display(),
            to.display()
        )))
    }
}
