//! The `qemu-harness` command: boot a micro-VM and keep it running until interrupted, stop
//! one from another shell, or show the cached kernel. See `docs/HARNESS.md`.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use qemu_harness::{kernel, Image, RelaySpec, Vm, VmSpec};
use vm_image::initramfs::{ExtraFile, InitramfsSpec, Source};

#[derive(Parser)]
#[command(
    name = "qemu-harness",
    about = "Run a micro-VM under QEMU the way a platform would"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Boot a VM, wait for guest-init's ready line, run until Ctrl-C (then stop it in
    /// order) or until the guest powers off.
    Boot(Box<BootArgs>),
    /// Ask a running VM's guest-init to stop (`stop` on its control port).
    Stop {
        /// The VM's hybrid vsock socket (`<run-dir>/vm.vsock`).
        #[arg(long)]
        uds: PathBuf,
        /// guest-init's control port.
        #[arg(long, default_value_t = 1024)]
        port: u32,
    },
    /// Print the cached guest kernels and the default one.
    Kernel,
}

#[derive(clap::Args)]
struct BootArgs {
    /// Name in messages.
    #[arg(long, default_value = "vm")]
    name: String,
    /// A prebuilt initramfs.
    #[arg(long, conflicts_with_all = ["init", "config"])]
    initrd: Option<PathBuf>,
    /// guest-init (static musl) to build an initramfs around.
    #[arg(long, requires = "config")]
    init: Option<PathBuf>,
    /// guest-init's JSON configuration.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Extra initramfs file, `GUEST_PATH=HOST_PATH` (mode 0755).
    #[arg(long = "file")]
    files: Vec<String>,
    /// A raw disk image for virtio-blk (`/dev/vda`, ...).
    #[arg(long = "disk")]
    disks: Vec<PathBuf>,
    /// A relay: `NAME=CONFIG.json[:WAIT_PORT,...]`; waits for `<vsock uds>_<port>`.
    #[arg(long = "relay")]
    relays: Vec<String>,
    /// The host-relay binary (for --relay).
    #[arg(long)]
    relay_bin: Option<PathBuf>,
    /// Guest kernel by version or prefix (`6.12`); default `$MICROVM_KERNEL`, else the
    /// cache's `current`.
    #[arg(long)]
    kernel: Option<String>,
    /// Run directory (default: a fresh /tmp/qh-...). Relay configs can refer to
    /// `<run-dir>/vm.vsock`.
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256)]
    memory: u32,
    /// vCPUs.
    #[arg(long, default_value_t = 1)]
    cpus: u32,
    /// Extra kernel command line.
    #[arg(long, default_value = "")]
    append: String,
    /// Seconds to wait for the ready line.
    #[arg(long, default_value_t = 180)]
    ready_timeout: u64,
    /// Keep the run directory afterwards.
    #[arg(long)]
    keep: bool,
    /// Give the guest a vTPM 2.0 (swtpm on `tpm-crb`) whose state lives in this directory;
    /// boot again with the same directory for the same TPM.
    #[arg(long)]
    tpm_state: Option<PathBuf>,
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: `on_signal` is an `extern "C"` function that only stores to an atomic,
        // which is async-signal-safe; signal(2) has no other preconditions.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Kernel => {
            let cache = kernel::cache_dir();
            let k = kernel::Kernel::from_cache(&cache)?;
            println!("version  {}", k.version);
            println!("vmlinuz  {}", k.vmlinuz.display());
            println!("modules  {}", k.modules_dir.display());
            println!("installed {}", kernel::installed(&cache).join(" "));
        }
        Cmd::Stop { uds, port } => {
            let mut s = qemu_harness::hybrid::connect(&uds, port, Duration::from_secs(30))
                .with_context(|| {
                    format!("connecting to guest port {port} via {}", uds.display())
                })?;
            s.write_all(b"stop\n")?;
            let mut reply = String::new();
            s.read_to_string(&mut reply)?;
            println!("{}", reply.trim_end());
        }
        Cmd::Boot(args) => {
            let BootArgs {
                name,
                initrd,
                init,
                config,
                files,
                disks,
                relays,
                relay_bin,
                kernel: kernel_version,
                run_dir,
                memory,
                cpus,
                append,
                ready_timeout,
                keep,
                tpm_state,
            } = *args;
            let image = match (initrd, init, config) {
                (Some(p), _, _) => Image::File(p),
                (None, Some(init), Some(config)) => {
                    let text = std::fs::read_to_string(&config)
                        .with_context(|| format!("reading {}", config.display()))?;
                    let value = serde_json::from_str(&text)
                        .with_context(|| format!("{} is not valid JSON", config.display()))?;
                    let mut spec = InitramfsSpec::new(init, value);
                    for f in &files {
                        let Some((g, h)) = f.split_once('=') else {
                            bail!("--file {f:?}: expected GUEST_PATH=HOST_PATH");
                        };
                        spec.files.push(ExtraFile {
                            guest_path: g.into(),
                            source: Source::Host(h.into()),
                            mode: 0o755,
                        });
                    }
                    Image::Initramfs(Box::new(spec))
                }
                _ => bail!("give --initrd FILE, or --init GUEST_INIT --config CONFIG.json"),
            };
            let mut spec = VmSpec::new(&name, image);
            if let Some(v) = kernel_version {
                spec.kernel = Some(kernel::Kernel::by_version(&kernel::cache_dir(), &v)?);
            }
            if let Some(d) = run_dir {
                spec.run_dir = d;
            }
            spec.memory_mib = memory;
            spec.cpus = cpus;
            spec.cmdline_extra = append;
            spec.ready_timeout = Duration::from_secs(ready_timeout);
            spec.keep_run_dir = keep;
            spec.tpm_state = tpm_state;
            spec.relay_bin = relay_bin;
            spec.disks = disks.into_iter().map(|d| (d, false)).collect();
            for r in &relays {
                let Some((rname, rest)) = r.split_once('=') else {
                    bail!("--relay {r:?}: expected NAME=CONFIG.json[:PORT,...]");
                };
                let (cfg, ports) = rest.split_once(':').unwrap_or((rest, ""));
                let text =
                    std::fs::read_to_string(cfg).with_context(|| format!("reading {cfg}"))?;
                let config = serde_json::from_str(&text).with_context(|| format!("{cfg}: JSON"))?;
                let mut wait_for = Vec::new();
                for p in ports.split(',').filter(|p| !p.is_empty()) {
                    wait_for.push(
                        spec.port_socket(p.parse().with_context(|| format!("--relay port {p:?}"))?),
                    );
                }
                spec.relays.push(RelaySpec {
                    name: rname.into(),
                    config,
                    wait_for,
                });
            }
            install_signal_handlers();
            let mut vm = Vm::start(spec)?;
            println!(
                "ready; vsock socket {} (Ctrl-C stops the VM in order)",
                vm.spec().vsock_uds().display()
            );
            while !INTERRUPTED.load(Ordering::SeqCst) && vm.is_running() {
                std::thread::sleep(Duration::from_millis(100));
            }
            if vm.is_running() {
                let report = vm.stop()?;
                if !report.clean() {
                    bail!("stop was not clean: {report:?}");
                }
            } else {
                println!("the guest powered off by itself");
            }
        }
    }
    Ok(())
}
