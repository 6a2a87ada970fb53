//! Finds the guest kernels and their modules in the cache, by version.
//!
//! `scripts/setup.sh` fetches Debian's cloud kernels once (`apt-get download`, `dpkg -x`,
//! `depmod`) into `<cache>/kernel/<version>/`, one directory per kernel (today 6.1, Debian
//! 12's own, and 6.12, the line Debian 13 ships), and points `<cache>/kernel/current` at
//! 6.1. The harness only reads that layout (fixed in `docs/CONTRACTS.md`); it never
//! downloads, so a missing kernel is a clear error that names the setup script.
//!
//! A kernel is chosen by version: the full release (`6.12.117+deb12-cloud-amd64`) or a
//! prefix of it that ends at a `.`, `-` or `+` (`6.12`, `6.1`, `6.1.0-57`), which must
//! match exactly one installed kernel, so `6.1` never picks 6.12. With no version given,
//! [`Kernel::from_cache`] takes `$MICROVM_KERNEL` if set, else `current`. [`installed`]
//! lists every kernel in the cache, which is what the VM test matrix runs on.

use std::path::{Path, PathBuf};

use crate::HarnessError;

/// The environment variable that picks the default kernel by version.
pub const KERNEL_ENV: &str = "MICROVM_KERNEL";

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

/// The versions of every kernel installed under `<cache>/kernel/` (real directories with a
/// `vmlinuz`; the `current` link is not counted twice), sorted by version number.
pub fn installed(cache: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(cache.join("kernel")) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| e.path().join("vmlinuz").is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    out.sort_by_key(|v| version_key(v));
    out
}

/// Numeric sort key: `6.12.117+deb12` after `6.1.0-57`.
fn version_key(v: &str) -> Vec<u64> {
    v.split(|c: char| !c.is_ascii_digit())
        .filter(|p| !p.is_empty())
        .map(|p| p.parse().unwrap_or(u64::MAX))
        .collect()
}

/// Whether `wanted` names `version`: equal, or a prefix ending at a separator.
fn matches(version: &str, wanted: &str) -> bool {
    version == wanted
        || (version.starts_with(wanted)
            && version[wanted.len()..].starts_with(['.', '-', '+'])
            && !wanted.is_empty())
}

impl Kernel {
    /// The default kernel: the version in `$MICROVM_KERNEL` if set (see
    /// [`Kernel::by_version`]), else the one `<cache>/kernel/current` points at.
    pub fn from_cache(cache: &Path) -> Result<Self, HarnessError> {
        if let Some(v) = std::env::var(KERNEL_ENV)
            .ok()
            .filter(|v| !v.trim().is_empty())
        {
            return Self::by_version(cache, v.trim());
        }
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

    /// The installed kernel `wanted` names: its full version or a prefix ending at `.`,
    /// `-` or `+` (`6.12`), matching exactly one kernel under `<cache>/kernel/`.
    pub fn by_version(cache: &Path, wanted: &str) -> Result<Self, HarnessError> {
        let all = installed(cache);
        let found: Vec<&String> = all.iter().filter(|v| matches(v, wanted)).collect();
        match found.as_slice() {
            [one] => Self::from_dir(&cache.join("kernel").join(one), one),
            [] => Err(HarnessError::Missing {
                what: format!(
                    "guest kernel {wanted:?} (installed under {}: {}; \
                     scripts/setup.sh fetches 6.1 and 6.12, docs/IMAGE.md says how to add one)",
                    cache.join("kernel").display(),
                    if all.is_empty() {
                        "none".to_string()
                    } else {
                        all.join(", ")
                    }
                ),
            }),
            many => Err(HarnessError::Missing {
                what: format!(
                    "one guest kernel named {wanted:?}, but it matches {}; give more of the \
                     version",
                    many.iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_cache(versions: &[&str]) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        for v in versions {
            let d = t.path().join("kernel").join(v);
            std::fs::create_dir_all(d.join("modules/lib/modules").join(v)).unwrap();
            std::fs::write(d.join("vmlinuz"), b"k").unwrap();
            std::fs::write(
                d.join("modules/lib/modules").join(v).join("modules.dep"),
                b"",
            )
            .unwrap();
        }
        std::os::unix::fs::symlink(versions[0], t.path().join("kernel/current")).unwrap();
        t
    }

    #[test]
    fn versions_are_listed_in_order_and_picked_by_prefix() {
        let t = fake_cache(&["6.12.117+deb12-cloud-amd64", "6.1.0-57-cloud-amd64"]);
        let c = t.path();
        assert_eq!(
            installed(c),
            ["6.1.0-57-cloud-amd64", "6.12.117+deb12-cloud-amd64"]
        );
        assert_eq!(
            Kernel::by_version(c, "6.1").unwrap().version,
            "6.1.0-57-cloud-amd64"
        );
        let k = Kernel::by_version(c, "6.12").unwrap();
        assert_eq!(k.version, "6.12.117+deb12-cloud-amd64");
        assert!(k
            .modules_dir
            .ends_with("lib/modules/6.12.117+deb12-cloud-amd64"));
        assert_eq!(
            Kernel::by_version(c, "6.12.117+deb12-cloud-amd64")
                .unwrap()
                .version,
            "6.12.117+deb12-cloud-amd64"
        );
    }

    #[test]
    fn unknown_and_ambiguous_versions_are_named() {
        let t = fake_cache(&["6.1.0-57-cloud-amd64", "6.1.0-58-cloud-amd64"]);
        let msg = Kernel::by_version(t.path(), "6.6").unwrap_err().to_string();
        assert!(
            msg.contains("\"6.6\"") && msg.contains("6.1.0-57-cloud-amd64"),
            "{msg}"
        );
        let msg = Kernel::by_version(t.path(), "6.1").unwrap_err().to_string();
        assert!(msg.contains("matches") && msg.contains("6.1.0-58"), "{msg}");
        assert!(Kernel::by_version(t.path(), "").is_err());
        assert!(Kernel::by_version(t.path(), "6.1.0-5").is_err());
    }
}
