//! The `vm-image` command: build an initramfs or an ext4 root disk from the command line.
//! See `docs/IMAGE.md`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use vm_image::{initramfs, modules, rootdisk};

#[derive(Parser)]
#[command(name = "vm-image", about = "Build a micro-VM's initramfs or root disk")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build an initramfs (cpio newc + gzip).
    Initramfs {
        /// The static musl guest-init binary (becomes /init).
        #[arg(long)]
        init: PathBuf,
        /// guest-init's JSON configuration (becomes /etc/guest-init.json).
        #[arg(long)]
        config: PathBuf,
        /// The guest kernel's module directory (.../lib/modules/<version>).
        #[arg(long)]
        kernel_modules: Option<PathBuf>,
        /// Extra file, `GUEST_PATH=HOST_PATH[:MODE]` (mode in octal, default 0755).
        #[arg(long = "file")]
        files: Vec<String>,
        /// Size limit of the compressed image in bytes.
        #[arg(long, default_value_t = initramfs::DEFAULT_MAX_SIZE)]
        max_size: u64,
        /// Output file.
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Build an ext4 root disk from a directory (no root privileges needed).
    Rootfs {
        /// The directory that becomes `/`.
        #[arg(long)]
        source: PathBuf,
        /// Disk size in MiB.
        #[arg(long)]
        size_mib: u64,
        /// Volume label (also seeds the UUID).
        #[arg(long, default_value = "rootfs")]
        label: String,
        /// Also set every time in the source tree to the epoch.
        #[arg(long)]
        normalize_times: bool,
        /// Output file.
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Print the load order of kernel modules.
    Modules {
        /// The guest kernel's module directory.
        #[arg(long)]
        kernel_modules: PathBuf,
        /// Module names.
        names: Vec<String>,
    },
}

fn parse_file(arg: &str) -> Result<initramfs::ExtraFile> {
    let Some((guest, host)) = arg.split_once('=') else {
        bail!("--file {arg:?}: expected GUEST_PATH=HOST_PATH[:MODE]");
    };
    if !guest.starts_with('/') {
        bail!("--file {arg:?}: the guest path must be absolute");
    }
    let (host, mode) = match host.rsplit_once(':') {
        Some((h, m)) if !m.is_empty() && m.bytes().all(|c| (b'0'..=b'7').contains(&c)) => (
            h,
            u32::from_str_radix(m, 8).with_context(|| format!("--file {arg:?}: mode"))?,
        ),
        _ => (host, 0o755),
    };
    Ok(initramfs::ExtraFile {
        guest_path: guest.to_string(),
        source: initramfs::Source::Host(PathBuf::from(host)),
        mode,
    })
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Initramfs {
            init,
            config,
            kernel_modules,
            files,
            max_size,
            output,
        } => {
            let text = std::fs::read_to_string(&config)
                .with_context(|| format!("reading config {}", config.display()))?;
            let value = serde_json::from_str(&text)
                .with_context(|| format!("config {} is not valid JSON", config.display()))?;
            let mut spec = initramfs::InitramfsSpec::new(init, value);
            spec.kernel_modules = kernel_modules;
            spec.max_size = max_size;
            for f in &files {
                spec.files.push(parse_file(f)?);
            }
            let img = initramfs::build_to(&spec, &output)?;
            for name in &img.builtin {
                eprintln!("note: module {name:?} is built into this kernel; left out of the image");
            }
            println!(
                "{}: {} bytes compressed, {} uncompressed, modules: {}",
                output.display(),
                img.bytes.len(),
                img.uncompressed_size,
                img.modules
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
        Cmd::Rootfs {
            source,
            size_mib,
            label,
            normalize_times,
            output,
        } => {
            rootdisk::build(
                &rootdisk::RootDiskSpec {
                    source,
                    size_mib,
                    label,
                    normalize_times,
                },
                &output,
            )?;
            println!("{}: {} MiB ext4", output.display(), size_mib);
        }
        Cmd::Modules {
            kernel_modules,
            names,
        } => {
            let db = modules::ModuleDb::load(&kernel_modules)?;
            for m in db.resolve(&names)? {
                println!("{}\t{}", m.name, m.rel_path);
            }
            for name in db.builtin_among(&names) {
                eprintln!("note: module {name:?} is built into this kernel");
            }
        }
    }
    Ok(())
}
