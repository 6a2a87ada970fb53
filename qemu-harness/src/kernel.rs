//! Finds the guest kernel and its modules in the cache.
//!
//! `scripts/setup.sh` fetches Debian's cloud kernel once (`apt-get download`, `dpkg -x`,
//! `depmod`) into `<cache>/kernel/<version>/` and points `<cache>/kernel/current` at it.
//! The harness only reads that layout (fixed in `docs/CONTRACTS.md`); it never downloads,
//! so a missing kernel is a clear error that names the setup script.

use std::path::{Path, PathBuf};

use crate::HarnessError;

/// A guest kernel: the compressed image and its depmod'ed module directory.
#[derive(Clone, Debug)]
pub struct Kernel {
    /// Kernel release, e.g. `6.1.0-57-cloud-amd64`.
    pub version: String,
    /// The bzImage.
    pub vmlinuz: PathBuf,
    /// `.../lib/modules/<version>` (holds `modules.dep`).
    pub modules_dir: PathBuf,
}

/// The cache directory: `$MICROVM_CACHE`, else `<workspace>/.cache`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("MICROVM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .unwrap_or(Path::new("."))
                .join(".cache")
        })
}

impl Kernel {
    /// The kernel `<cache>/kernel/current` points at.
    pub fn from_cache(cache: &Path) -> Result<Self, HarnessError> {
        let current = cache.join("kernel/current");
        let dir = std::fs::canonicalize(&current).map_err(|_| HarnessError::Missing {
            what: format!("guest kernel ({} does not exist)", current.display()),
        })?;
        let version = dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        Self::from_dir(&dir, &version)
    }

    /// The kernel in `dir` (`vmlinuz` and `modules/lib/modules/<version>`).
    pub fn from_dir(dir: &Path, version: &str) -> Result<Self, HarnessError> {
        let k = Self {
            version: version.to_string(),
            vmlinuz: dir.join("vmlinuz"),
            modules_dir: dir.join("modules/lib/modules").join(version),
        };
        if !k.vmlinuz.is_file() {
            return Err(HarnessError::Missing {
                what: format!("guest kernel image {}", k.vmlinuz.display()),
            });
        }
        if !k.modules_dir.join("modules.dep").is_file() {
            return Err(HarnessError::Missing {
                what: format!("{}/modules.dep", k.modules_dir.display()),
            });
        }
        Ok(k)
    }
}
