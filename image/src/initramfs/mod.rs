//! Builds a VM's initramfs: `guest-init` as `/init`, its configuration, the kernel modules
//! it loads, and the app's files — as a reproducible gzip-compressed newc cpio archive.
//!
//! # Design
//!
//! The builder gathers everything into a [`crate::cpio::Archive`] first and checks it
//! before writing a byte:
//!
//! - `/init` must be a static x86-64 ELF ([`crate::elf::check_static`]); a dynamic one would
//!   only fail at boot with a kernel panic.
//! - The configuration's `modules` list is expanded with [`crate::modules::ModuleDb`] into
//!   the full load order, and each module file is copied to `/lib/modules/<name>.ko`
//!   (the layout in `docs/CONTRACTS.md`), decompressed first if the kernel ships it as
//!   `.ko.xz`, `.ko.zst` or `.ko.gz` ([`crate::decompress`]), so guest-init's plain
//!   `finit_module` loads it on any kernel. A missing module is an error naming it; a
//!   configured module that this kernel has built in is dropped and reported in
//!   [`Initramfs::builtin`] (the same configuration serves kernels that build a driver in,
//!   like 6.12's `virtio_pci`, and kernels that have it as a module, like 6.1's).
//! - A configuration that loads modules also gets [`crate::POWER_BUTTON_MODULES`] (`button`
//!   and `evdev`), appended after its own, whenever the kernel has them: without them a
//!   VMM's ACPI power button (QEMU's `system_powerdown`, `virsh shutdown`) reaches no one
//!   and the VM is killed after the VMM's timeout. A kernel without them (or with them
//!   built in) simply gets none; a configuration without modules is left as it is.
//! - The compressed size is checked against the limit, with an error that gives both sizes
//!   and the fix (a root disk for big apps).
//!
//! Reproducibility: the archive is sorted with fixed metadata (see `cpio`), the JSON is
//! serialised by serde_json from the parsed value (stable key order, as `serde_json::Map`
//! is a `BTreeMap`), and the gzip header carries mtime 0 and no file name. The same inputs
//! therefore give the same bytes, which `tests` in this module check.

use std::io::Write;
use std::path::{Path, PathBuf};

use flate2::{Compression, GzBuilder};
use serde_json::Value;

use crate::cpio::{Archive, CpioError, Entry};
use crate::decompress::{self, DecompressError};
use crate::elf::{self, ElfError};
use crate::modules::{Module, ModuleDb, ModuleError};

/// Where guest-init reads its configuration.
pub const CONFIG_PATH: &str = "/etc/guest-init.json";
/// Where module files go.
pub const MODULE_DIR: &str = "/lib/modules";

/// Where an extra file's bytes come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A file on the host, read at build time.
    Host(PathBuf),
    /// Bytes given directly.
    Bytes(Vec<u8>),
}

/// A file to add to the image besides `/init`, the configuration and the modules.
#[derive(Clone, Debug)]
pub struct ExtraFile {
    /// Absolute path inside the guest, e.g. `/app/guest-probe`.
    pub guest_path: String,
    /// Its content.
    pub source: Source,
    /// Permission bits.
    pub mode: u32,
}

/// What to put into an initramfs.
#[derive(Clone, Debug)]
pub struct InitramfsSpec {
    /// The static musl `guest-init` binary.
    pub init: PathBuf,
    /// guest-init's configuration (its `modules` list is expanded).
    pub config: Value,
    /// The guest kernel's module directory (`.../lib/modules/<version>`); needed when the
    /// configuration lists modules.
    pub kernel_modules: Option<PathBuf>,
    /// Extra files.
    pub files: Vec<ExtraFile>,
    /// Limit on the compressed size in bytes.
    pub max_size: u64,
}

/// Default size limit: 64 MiB compressed. Bigger apps belong on a root disk.
pub const DEFAULT_MAX_SIZE: u64 = 64 << 20;

impl InitramfsSpec {
    /// A spec with `init` and `config`, no extra files and the default limit.
    pub fn new(init: impl Into<PathBuf>, config: Value) -> Self {
        Self {
            init: init.into(),
            config,
            kernel_modules: None,
            files: Vec::new(),
            max_size: DEFAULT_MAX_SIZE,
        }
    }
}

/// The result of a build.
#[derive(Clone, Debug)]
pub struct Initramfs {
    /// The gzip-compressed archive.
    pub bytes: Vec<u8>,
    /// Size of the uncompressed archive.
    pub uncompressed_size: u64,
    /// The modules in load order, as written into the configuration.
    pub modules: Vec<Module>,
    /// Configured modules left out because this kernel has them built in (a note for the
    /// caller to show, not an error).
    pub builtin: Vec<String>,
    /// The configuration as written into the image.
    pub config: Value,
}

/// An image build error. Each names the input at fault and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// An input file cannot be read.
    #[error("cannot read {what} {path}: {source}")]
    Read {
        /// What the file is for (`init`, `extra file /app/x`...).
        what: String,
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `/init` is not a static x86-64 executable.
    #[error("init {path}: {source}")]
    BadInit {
        /// The binary.
        path: PathBuf,
        /// Why.
        #[source]
        source: ElfError,
    },
    /// The configuration's `modules` field is not a list of names.
    #[error("config.modules: {0}")]
    BadModulesField(String),
    /// Modules are listed but no kernel module directory was given.
    #[error(
        "config.modules lists {0} module(s) but no kernel module directory was given \
         (pass the kernel's lib/modules/<version> directory)"
    )]
    NoKernelModules(usize),
    /// A module could not be resolved.
    #[error(transparent)]
    Module(#[from] ModuleError),
    /// A module file could not be decompressed.
    #[error(transparent)]
    Decompress(#[from] DecompressError),
    /// The archive's structure is wrong (duplicate or bad paths).
    #[error(transparent)]
    Archive(#[from] CpioError),
    /// The image is too large.
    #[error(
        "initramfs is {size} bytes compressed, over the limit of {limit} bytes; \
         move big files to a root disk (`vm-image rootfs`) or raise the limit"
    )]
    TooLarge {
        /// Compressed size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// Writing the output failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The output path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>, ImageError> {
    std::fs::read(path).map_err(|source| ImageError::Read {
        what: what.to_string(),
        path: path.to_path_buf(),
        source,
    })
}

/// Builds the initramfs in memory.
pub fn build(spec: &InitramfsSpec) -> Result<Initramfs, ImageError> {
    let mut archive = Archive::new();

    let init = read("init", &spec.init)?;
    elf::check_static(&init).map_err(|source| ImageError::BadInit {
        path: spec.init.clone(),
        source,
    })?;
    archive.add(
        "/init",
        Entry::File {
            mode: 0o755,
            data: init,
        },
    )?;

    let mut config = spec.config.clone();
    let (modules, builtin) = expand_modules(&mut config, spec.kernel_modules.as_deref())?;
    if let Some(dir) = &spec.kernel_modules {
        for m in &modules {
            let file = dir.join(&m.rel_path);
            let data = read(&format!("module {}", m.name), &file)?;
            let data = decompress::module_bytes(&file.display().to_string(), data)?;
            archive.add(
                &format!("{MODULE_DIR}/{}.ko", m.name),
                Entry::File { mode: 0o644, data },
            )?;
        }
    }
    let mut json = serde_json::to_vec_pretty(&config)
        .map_err(|e| ImageError::BadModulesField(e.to_string()))?;
    json.push(b'\n');
    archive.add(
        CONFIG_PATH,
        Entry::File {
            mode: 0o644,
            data: json,
        },
    )?;

    for f in &spec.files {
        let data = match &f.source {
            Source::Host(p) => read(&format!("extra file {}", f.guest_path), p)?,
            Source::Bytes(b) => b.clone(),
        };
        archive.add(&f.guest_path, Entry::File { mode: f.mode, data })?;
    }
    // Mount points guest-init expects to exist on an initramfs root.
    for d in ["/proc", "/sys", "/dev", "/run", "/tmp"] {
        archive.add(d, Entry::Dir { mode: 0o755 })?;
    }

    let raw = archive.to_bytes();
    let mut gz = GzBuilder::new()
        .mtime(0)
        .operating_system(3)
        .write(Vec::new(), Compression::fast());
    gz.write_all(&raw)
        .and_then(|_| gz.try_finish())
        .map_err(|source| ImageError::Write {
            path: PathBuf::from("<memory>"),
            source,
        })?;
    let bytes = gz.finish().map_err(|source| ImageError::Write {
        path: PathBuf::from("<memory>"),
        source,
    })?;
    if bytes.len() as u64 > spec.max_size {
        return Err(ImageError::TooLarge {
            size: bytes.len() as u64,
            limit: spec.max_size,
        });
    }
    Ok(Initramfs {
        bytes,
        uncompressed_size: raw.len() as u64,
        modules,
        builtin,
        config,
    })
}

/// Builds the initramfs and writes it to `out` (atomically: a temporary file renamed).
pub fn build_to(spec: &InitramfsSpec, out: &Path) -> Result<Initramfs, ImageError> {
    let img = build(spec)?;
    let tmp = out.with_extension("tmp");
    std::fs::write(&tmp, &img.bytes)
        .and_then(|_| std::fs::rename(&tmp, out))
        .map_err(|source| ImageError::Write {
            path: out.to_path_buf(),
            source,
        })?;
    Ok(img)
}

/// Replaces `config.modules` (names) with the full load order; returns it and the
/// configured names dropped as built in.
fn expand_modules(
    config: &mut Value,
    kernel_modules: Option<&Path>,
) -> Result<(Vec<Module>, Vec<String>), ImageError> {
    let Some(obj) = config.as_object_mut() else {
        return Err(ImageError::BadModulesField(
            "the configuration must be a JSON object".into(),
        ));
    };
    let Some(list) = obj.get("modules") else {
        return Ok((Vec::new(), Vec::new()));
    };
    let Some(arr) = list.as_array() else {
        return Err(ImageError::BadModulesField(
            "must be a list of kernel module names, e.g. [\"virtio_pci\"]".into(),
        ));
    };
    let mut names = Vec::with_capacity(arr.len());
    for (i, v) in arr.iter().enumerate() {
        match v.as_str() {
            Some(s) if !s.trim().is_empty() => names.push(s.to_string()),
            _ => {
                return Err(ImageError::BadModulesField(format!(
                    "entry {i} must be a non-empty module name string, found {v}"
                )))
            }
        }
    }
    if names.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let Some(dir) = kernel_modules else {
        return Err(ImageError::NoKernelModules(names.len()));
    };
    let db = ModuleDb::load(dir)?;
    for extra in crate::POWER_BUTTON_MODULES {
        // Only what this kernel has as a loadable module; never an error.
        if db.resolve(&[extra]).is_ok_and(|m| !m.is_empty()) {
            names.push(extra.to_string());
        }
    }
    let modules = db.resolve(&names)?;
    let builtin = db.builtin_among(&names);
    obj.insert(
        "modules".into(),
        Value::Array(
            modules
                .iter()
                .map(|m| Value::String(m.name.clone()))
                .collect(),
        ),
    );
    Ok((modules, builtin))
}

#[cfg(test)]
mod tests;
