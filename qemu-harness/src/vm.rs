//! One micro-VM, run the way a platform runs it: guest kernel, image, vsock backend, the
//! host relays for the app's declared services, QEMU, readiness, connections in, and an
//! orderly stop.
//!
//! # Design
//!
//! [`VmSpec`] says what to run; [`Vm::boot`] starts it phase by phase and returns as soon
//! as QEMU runs; [`Vm::wait_ready`] waits for guest-init's `ready in` console line;
//! [`Vm::start`] does both. Each phase is printed with its duration
//! (`[qemu-harness] vm1: relays ... 0.02 s`), so a person sees where the time goes.
//!
//! The order matters. vhost-device-vsock comes first: QEMU connects to its vhost-user
//! socket at start and fails without it. The relays come before QEMU too: a guest that
//! connects to a service whose `<uds>_<port>` socket does not exist yet waits about 2 s and
//! fails (a hybrid vsock connect to a missing listener times out rather than being
//! refused), so the relays must be listening before the guest can run.
//!
//! **Supervision.** The harness owns every process it starts ([`crate::process::Child`]).
//! While waiting, it watches QEMU and the vsock backend: if either dies, the wait ends
//! at once with an error that quotes the console's and the process's last lines, instead
//! of running into a timeout. (vhost-device-vsock 0.3.0 can die on a host client that
//! closes too early; the harness's own connections never do, see `vm_transport::hybrid`.)
//!
//! **Stop.** The ways to end a running VM (guest-init's control port, the ACPI power
//! button and Ctrl-Alt-Del through QMP) and the waits for QEMU's exit live in
//! [`crate::stop`]; QEMU always gets a QMP socket ([`VmSpec::qmp_socket`]) for them.
//!
//! **vTPM.** With [`VmSpec::tpm_state`], one `swtpm socket --tpm2` runs per VM on that
//! state directory, started after the vsock backend and before QEMU (which connects to
//! its control socket at start), supervised like the backend while QEMU runs; it ends
//! with QEMU. The guest sees a TPM 2.0 on `tpm-crb` (`/dev/tpm0`, `/dev/tpmrm0`).
//!
//! **Cleanup.** Dropping a [`Vm`] ends QEMU, the relays, the backend and swtpm (in that order)
//! and removes the run directory with its sockets — except when the thread is panicking
//! (a failing test): then the directory, with the console and every process's log, is
//! kept and its path printed.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use vm_image::initramfs::{self, InitramfsSpec};

use crate::kernel::{cache_dir, Kernel};
use crate::process::{tail, wait_for_path, Child};
use crate::qemu::{resolve_accel, Accel, QemuArgs, UserNet};
use crate::HarnessError;

/// The guest-init console text that marks readiness.
pub const READY_MARK: &str = "guest-init: ready in ";

/// How many console lines an error quotes.
const TAIL_LINES: usize = 40;

/// What the VM boots from.
#[derive(Clone, Debug)]
pub enum Image {
    /// A ready-made initramfs file.
    File(PathBuf),
    /// Build this initramfs first (its `kernel_modules` defaults to the VM's kernel's).
    Initramfs(Box<InitramfsSpec>),
}

/// A `host-relay run` instance to start before the VM.
#[derive(Clone, Debug)]
pub struct RelaySpec {
    /// A name for messages and the log file (`relay-<name>.log` in the run directory).
    pub name: String,
    /// The relay's JSON configuration (`docs/RELAY.md`), written to a file.
    pub config: serde_json::Value,
    /// Paths that exist once the relay listens (usually `<vsock uds>_<port>`).
    pub wait_for: Vec<PathBuf>,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct VmSpec {
    /// Name in messages.
    pub name: String,
    /// Directory for sockets, logs and the built image. Default: a fresh `/tmp/qh-...`.
    pub run_dir: PathBuf,
    /// The guest kernel; default: [`Kernel::from_cache`] (`$MICROVM_KERNEL`, else
    /// `<cache>/kernel/current`). Pick one with [`Kernel::by_version`].
    pub kernel: Option<Kernel>,
    /// The image.
    pub image: Image,
    /// Extra raw disks (virtio-blk, `/dev/vda`...) and whether each is read-only.
    pub disks: Vec<(PathBuf, bool)>,
    /// Guest RAM in MiB.
    pub memory_mib: u32,
    /// vCPUs.
    pub cpus: u32,
    /// Appended to `console=ttyS0 panic=-1 quiet`.
    pub cmdline_extra: String,
    /// The guest's CID.
    pub guest_cid: u32,
    /// guest-init's control port.
    pub control_port: u32,
    /// Relays to start before the VM.
    pub relays: Vec<RelaySpec>,
    /// The host-relay binary (required when `relays` is not empty).
    pub relay_bin: Option<PathBuf>,
    /// vhost-device-vsock; default `<cache>/tools/bin/vhost-device-vsock`.
    pub vhost_bin: Option<PathBuf>,
    /// A vTPM 2.0 for the guest: swtpm's state directory. The caller owns it: boot again
    /// with the same directory and the guest sees the same TPM (a reboot); a fresh
    /// directory is a new TPM (a new VM). `None`: no TPM.
    pub tpm_state: Option<PathBuf>,
    /// swtpm (Debian's `swtpm` package); default `swtpm` on `PATH`.
    pub swtpm_bin: PathBuf,
    /// QEMU.
    pub qemu_bin: PathBuf,
    /// KVM, TCG or detect.
    pub accel: Accel,
    /// User networking with port forwards.
    pub net: Option<UserNet>,
    /// How long to wait for the ready line.
    pub ready_timeout: Duration,
    /// How long a stop may take before QEMU is killed.
    pub stop_timeout: Duration,
    /// Keep the run directory even on success.
    pub keep_run_dir: bool,
    /// Print phases to stderr.
    pub progress: bool,
}

static RUN_COUNTER: AtomicU32 = AtomicU32::new(0);

impl VmSpec {
    /// A spec with the defaults: 256 MiB, 1 vCPU, CID 3, control port 1024, TCG or KVM as
    /// detected, 180 s to get ready, 60 s to stop.
    pub fn new(name: &str, image: Image) -> Self {
        let n = RUN_COUNTER.fetch_add(1, Ordering::Relaxed);
        let run_dir = std::env::temp_dir().join(format!("qh-{name}-{}-{n}", std::process::id()));
        Self {
            name: name.to_string(),
            run_dir,
            kernel: None,
            image,
            disks: Vec::new(),
            memory_mib: 256,
            cpus: 1,
            cmdline_extra: String::new(),
            guest_cid: 3,
            control_port: 1024,
            relays: Vec::new(),
            relay_bin: None,
            vhost_bin: None,
            tpm_state: None,
            swtpm_bin: PathBuf::from("swtpm"),
            qemu_bin: PathBuf::from("qemu-system-x86_64"),
            accel: Accel::Auto,
            net: None,
            ready_timeout: Duration::from_secs(180),
            stop_timeout: Duration::from_secs(60),
            keep_run_dir: false,
            progress: true,
        }
    }

    /// The VM's hybrid vsock socket (host-initiated connections: `CONNECT <port>`).
    pub fn vsock_uds(&self) -> PathBuf {
        self.run_dir.join("vm.vsock")
    }

    /// QEMU's QMP socket (`-qmp unix:...`), through which the harness presses buttons.
    pub fn qmp_socket(&self) -> PathBuf {
        self.run_dir.join("qmp.sock")
    }

    /// Where a guest connection to host port `port` arrives: `<vsock uds>_<port>`.
    pub fn port_socket(&self, port: u32) -> PathBuf {
        self.run_dir.join(format!("vm.vsock_{port}"))
    }
}

/// guest-init's ready line, parsed.
#[derive(Clone, Debug)]
pub struct Ready {
    /// The guest's own start-to-ready time (`ready in <ms> ms`).
    pub guest_ms: u64,
    /// From QEMU's start to the line appearing on the host.
    pub boot_to_ready: Duration,
    /// The whole line.
    pub line: String,
}

/// A running VM. Dropping it ends every process it started.
#[derive(Debug)]
pub struct Vm {
    pub(crate) spec: VmSpec,
    kernel: Kernel,
    accel: Accel,
    image_path: PathBuf,
    image_size: u64,
    console: PathBuf,
    phases: Vec<(String, Duration)>,
    pub(crate) qemu: Option<Child>,
    relays: Vec<Child>,
    vhost: Option<Child>,
    swtpm: Option<Child>,
    qemu_started: Instant,
    ready: Option<Ready>,
}

impl Vm {
    /// Boots and waits for the ready line.
    pub fn start(spec: VmSpec) -> Result<Self, HarnessError> {
        let mut vm = Self::boot(spec)?;
        vm.wait_ready()?;
        Ok(vm)
    }

    pub(crate) fn phase(&mut self, name: &str, detail: &str, t: Instant) {
        let d = t.elapsed();
        if self.spec.progress {
            eprintln!(
                "[qemu-harness] {}: {name:<13} {:>7.2} s  {detail}",
                self.spec.name,
                d.as_secs_f64()
            );
        }
        self.phases.push((name.to_string(), d));
    }

    /// Starts everything up to a running QEMU; does not wait for the guest.
    pub fn boot(spec: VmSpec) -> Result<Self, HarnessError> {
        let cache = cache_dir();
        let t = Instant::now();
        let kernel = match &spec.kernel {
            Some(k) => k.clone(),
            None => Kernel::from_cache(&cache)?,
        };
        if spec.run_dir.exists() {
            std::fs::remove_dir_all(&spec.run_dir)
                .map_err(|e| HarnessError::io(&spec.run_dir, e))?;
        }
        std::fs::create_dir_all(&spec.run_dir).map_err(|e| HarnessError::io(&spec.run_dir, e))?;
        let console = spec.run_dir.join("console.log");
        let mut vm = Vm {
            kernel,
            accel: Accel::Tcg,
            image_path: PathBuf::new(),
            image_size: 0,
            console,
            phases: Vec::new(),
            qemu: None,
            relays: Vec::new(),
            vhost: None,
            swtpm: None,
            qemu_started: Instant::now(),
            ready: None,
            spec,
        };
        let detail = format!("{} ({})", vm.kernel.version, vm.kernel.vmlinuz.display());
        vm.phase("kernel", &detail, t);
        match vm.start_processes(&cache) {
            Ok(()) => Ok(vm),
            Err(e) => {
                // Keep the logs that explain the failure; Drop still ends every process.
                vm.spec.keep_run_dir = true;
                Err(e)
            }
        }
    }

    /// Image, accelerator, vsock backend, relays and QEMU, in that order.
    fn start_processes(&mut self, cache: &Path) -> Result<(), HarnessError> {
        let vm = self;

        // Image.
        let t = Instant::now();
        let (path, detail) = match &vm.spec.image {
            Image::File(p) => (p.clone(), "prebuilt".to_string()),
            Image::Initramfs(s) => {
                let mut s = (**s).clone();
                if s.kernel_modules.is_none() {
                    s.kernel_modules = Some(vm.kernel.modules_dir.clone());
                }
                let out = vm.spec.run_dir.join("initrd.cpio.gz");
                let img = initramfs::build_to(&s, &out)?;
                let mods = img.modules.len();
                // Configured modules this kernel has built in: a note, not an error.
                let note = match img.builtin.as_slice() {
                    [] => String::new(),
                    b => format!("; built into this kernel, left out: {}", b.join(" ")),
                };
                (out, format!("built, {mods} modules{note}"))
            }
        };
        vm.image_size = std::fs::metadata(&path)
            .map_err(|e| HarnessError::io(&path, e))?
            .len();
        vm.image_path = path;
        let detail = format!("{} bytes, {detail}", vm.image_size);
        vm.phase("image", &detail, t);

        // Accelerator (probing only on first use per kernel and cache).
        let t = Instant::now();
        vm.accel = resolve_accel(
            vm.spec.accel,
            &vm.spec.qemu_bin,
            &vm.kernel.vmlinuz,
            cache,
            &vm.spec.run_dir,
        );
        let detail = vm.accel.name().to_string();
        vm.phase("accel", &detail, t);

        // vsock backend.
        let t = Instant::now();
        let bin = vm
            .spec
            .vhost_bin
            .clone()
            .unwrap_or_else(|| cache.join("tools/bin/vhost-device-vsock"));
        if !bin.is_file() {
            return Err(HarnessError::Missing {
                what: format!("vhost-device-vsock ({})", bin.display()),
            });
        }
        let vhost_sock = vm.spec.run_dir.join("vhost.sock");
        let mut cmd = Command::new(&bin);
        cmd.arg("--vm").arg(format!(
            "guest-cid={},socket={},uds-path={}",
            vm.spec.guest_cid,
            vhost_sock.display(),
            vm.spec.vsock_uds().display()
        ));
        let log = vm.spec.run_dir.join("vhost-device-vsock.log");
        let mut child =
            Child::spawn("vhost-device-vsock", cmd, &log).map_err(|e| HarnessError::Spawn {
                what: bin.display().to_string(),
                source: e,
            })?;
        wait_for_path(&vhost_sock, Duration::from_secs(20), &mut child)?;
        vm.vhost = Some(child);
        let detail = format!(
            "cid {}, {}",
            vm.spec.guest_cid,
            vm.spec.vsock_uds().display()
        );
        vm.phase("vsock backend", &detail, t);

        // vTPM.
        let tpm_socket = match vm.spec.tpm_state.clone() {
            Some(state) => Some(vm.start_swtpm(&state)?),
            None => None,
        };

        // Relays.
        let t = Instant::now();
        let relays = vm.spec.relays.clone();
        if !relays.is_empty() {
            let bin = vm
                .spec
                .relay_bin
                .clone()
                .ok_or_else(|| HarnessError::Missing {
                    what: "host-relay binary (VmSpec::relay_bin)".into(),
                })?;
            for r in &relays {
                let cfg = vm.spec.run_dir.join(format!("relay-{}.json", r.name));
                let text = serde_json::to_vec_pretty(&r.config).unwrap_or_default();
                std::fs::write(&cfg, text).map_err(|e| HarnessError::io(&cfg, e))?;
                let mut cmd = Command::new(&bin);
                cmd.arg("run").arg("--config").arg(&cfg);
                let log = vm.spec.run_dir.join(format!("relay-{}.log", r.name));
                let mut child =
                    Child::spawn(&format!("relay {}", r.name), cmd, &log).map_err(|e| {
                        HarnessError::Spawn {
                            what: bin.display().to_string(),
                            source: e,
                        }
                    })?;
                for p in &r.wait_for {
                    wait_for_path(p, Duration::from_secs(20), &mut child)?;
                }
                vm.relays.push(child);
            }
        }
        let detail = format!("{} started", relays.len());
        vm.phase("relays", &detail, t);

        // QEMU.
        let t = Instant::now();
        let mut cmdline = String::from("console=ttyS0 panic=-1 quiet");
        if !vm.spec.cmdline_extra.is_empty() {
            cmdline.push(' ');
            cmdline.push_str(&vm.spec.cmdline_extra);
        }
        let args = QemuArgs {
            binary: vm.spec.qemu_bin.clone(),
            accel: vm.accel,
            memory_mib: vm.spec.memory_mib,
            cpus: vm.spec.cpus,
            kernel: vm.kernel.vmlinuz.clone(),
            initrd: vm.image_path.clone(),
            cmdline,
            vhost_socket: vhost_sock,
            console: vm.console.clone(),
            disks: vm.spec.disks.clone(),
            net: vm.spec.net.clone(),
            qmp: Some(vm.spec.qmp_socket()),
            tpm: tpm_socket,
        };
        let log = vm.spec.run_dir.join("qemu.log");
        let child =
            Child::spawn("qemu", args.command(), &log).map_err(|e| HarnessError::Spawn {
                what: vm.spec.qemu_bin.display().to_string(),
                source: e,
            })?;
        vm.qemu_started = Instant::now();
        let detail = format!("pid {}, {}", child.pid(), vm.accel.name());
        vm.qemu = Some(child);
        vm.phase("boot", &detail, t);
        Ok(())
    }

    /// Starts one `swtpm socket --tpm2` on `state` with its control socket in the run
    /// directory (QEMU's `-tpmdev emulator` connects there); returns that socket. swtpm
    /// ends with QEMU (`--terminate`: when QEMU closes the control channel).
    fn start_swtpm(&mut self, state: &Path) -> Result<PathBuf, HarnessError> {
        let t = Instant::now();
        std::fs::create_dir_all(state).map_err(|e| HarnessError::io(state, e))?;
        let ctrl = self.spec.run_dir.join("swtpm.sock");
        let cmd = crate::swtpm::vm_command(&self.spec.swtpm_bin, state, &ctrl);
        let mut child =
            Child::spawn("swtpm", cmd, &self.spec.run_dir.join("swtpm.log")).map_err(|e| {
                HarnessError::Spawn {
                    what: format!(
                        "{} (Debian package swtpm; scripts/setup.sh installs it)",
                        self.spec.swtpm_bin.display()
                    ),
                    source: e,
                }
            })?;
        wait_for_path(&ctrl, Duration::from_secs(20), &mut child)?;
        self.swtpm = Some(child);
        let detail = format!("swtpm, state {}", state.display());
        self.phase("vtpm", &detail, t);
        Ok(ctrl)
    }

    /// The console so far.
    pub fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }

    /// The console file.
    pub fn console_path(&self) -> &Path {
        &self.console
    }

    /// The run directory.
    pub fn run_dir(&self) -> &Path {
        &self.spec.run_dir
    }

    /// The spec it runs.
    pub fn spec(&self) -> &VmSpec {
        &self.spec
    }

    /// The chosen accelerator.
    pub fn accel(&self) -> Accel {
        self.accel
    }

    /// The image's size in bytes.
    pub fn image_size(&self) -> u64 {
        self.image_size
    }

    /// Each phase and how long it took.
    pub fn phases(&self) -> &[(String, Duration)] {
        &self.phases
    }

    /// The ready line, once seen.
    pub fn ready(&self) -> Option<&Ready> {
        self.ready.as_ref()
    }

    /// A relay's log (by its [`RelaySpec::name`]).
    pub fn relay_log(&self, name: &str) -> String {
        let want = format!("relay {name}");
        self.relays
            .iter()
            .find(|c| c.name() == want)
            .map(|c| c.log())
            .unwrap_or_default()
    }

    pub(crate) fn console_tail(&self) -> String {
        tail(&self.console(), TAIL_LINES)
    }

    /// Errors when QEMU or the vsock backend has died.
    fn check_alive(&mut self, allow_qemu_exit: bool) -> Result<(), HarnessError> {
        if let Some(v) = self.vhost.as_mut() {
            if let Some(s) = v.try_status() {
                return Err(HarnessError::ProcessDied {
                    name: "vhost-device-vsock".into(),
                    status: s.to_string(),
                    log_tail: format!(
                        "{}\n--- console ---\n{}",
                        tail(&v.log(), 10),
                        self.console_tail()
                    ),
                });
            }
        }
        // swtpm ends with QEMU by design; while QEMU runs, its death is an error.
        if let Some(t) = self.swtpm.as_mut() {
            let qemu_running = self.qemu.as_mut().is_some_and(|q| q.try_status().is_none());
            if qemu_running && !allow_qemu_exit {
                if let Some(s) = t.try_status() {
                    return Err(HarnessError::ProcessDied {
                        name: "swtpm".into(),
                        status: s.to_string(),
                        log_tail: format!(
                            "{}\n--- console ---\n{}",
                            tail(&t.log(), 10),
                            self.console_tail()
                        ),
                    });
                }
            }
        }
        if !allow_qemu_exit {
            if let Some(q) = self.qemu.as_mut() {
                if let Some(s) = q.try_status() {
                    let log = tail(&q.log(), 10);
                    return Err(HarnessError::ProcessDied {
                        name: "qemu".into(),
                        status: s.to_string(),
                        log_tail: format!("{log}\n--- console ---\n{}", self.console_tail()),
                    });
                }
            }
        }
        Ok(())
    }

    /// Waits until the console shows `text`, or fails with the console's last lines.
    pub fn wait_for_console(
        &mut self,
        text: &str,
        timeout: Duration,
    ) -> Result<String, HarnessError> {
        let deadline = Instant::now() + timeout;
        loop {
            let console = self.console();
            if let Some(line) = console.lines().find(|l| l.contains(text)) {
                return Ok(line.to_string());
            }
            self.check_alive(false)?;
            if Instant::now() >= deadline {
                return Err(HarnessError::Timeout {
                    what: format!("console line containing {text:?}"),
                    after: timeout,
                    tail: self.console_tail(),
                });
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Waits for guest-init's `ready in` line (up to the spec's ready timeout).
    pub fn wait_ready(&mut self) -> Result<Ready, HarnessError> {
        let t = Instant::now();
        let line = self.wait_for_console(READY_MARK, self.spec.ready_timeout)?;
        let guest_ms = line
            .split(READY_MARK)
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let ready = Ready {
            guest_ms,
            boot_to_ready: self.qemu_started.elapsed(),
            line: line.clone(),
        };
        let detail = format!(
            "boot-to-ready {:.2} s (guest-init {} ms)",
            ready.boot_to_ready.as_secs_f64(),
            guest_ms
        );
        self.phase("ready", &detail, t);
        self.ready = Some(ready.clone());
        Ok(ready)
    }

    /// Opens a connection to guest `port` (hybrid `CONNECT`), retrying for up to `timeout`
    /// while the guest is not ready. The stream is blocking.
    pub fn connect(&mut self, port: u32, timeout: Duration) -> Result<UnixStream, HarnessError> {
        self.check_alive(false)?;
        crate::hybrid::connect(&self.spec.vsock_uds(), port, timeout).map_err(|e| {
            HarnessError::Connect {
                port,
                source: e,
                tail: self.console_tail(),
            }
        })
    }

    /// The processes this VM runs on the host, by name (QEMU, each relay, the backend).
    pub fn pids(&self) -> Vec<(String, u32)> {
        let mut v = Vec::new();
        if let Some(q) = &self.qemu {
            v.push((q.name().to_string(), q.pid()));
        }
        for r in &self.relays {
            v.push((r.name().to_string(), r.pid()));
        }
        if let Some(b) = &self.vhost {
            v.push((b.name().to_string(), b.pid()));
        }
        if let Some(t) = &self.swtpm {
            v.push((t.name().to_string(), t.pid()));
        }
        v
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if let Some(mut q) = self.qemu.take() {
            if q.try_status().is_none() {
                q.kill();
                if self.spec.progress {
                    eprintln!("[qemu-harness] {}: QEMU killed at cleanup", self.spec.name);
                }
            }
        }
        for mut r in self.relays.drain(..) {
            r.terminate(Duration::from_secs(5));
        }
        if let Some(mut v) = self.vhost.take() {
            v.terminate(Duration::from_secs(2));
        }
        if let Some(mut t) = self.swtpm.take() {
            t.terminate(Duration::from_secs(2));
        }
        if std::thread::panicking() || self.spec.keep_run_dir {
            eprintln!(
                "[qemu-harness] {}: run directory kept: {} (console.log, qemu.log, relay-*.log)",
                self.spec.name,
                self.spec.run_dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.spec.run_dir);
        }
    }
}
