//! Resolves kernel module names to the files to load, in dependency order, from a guest
//! kernel's `modules.dep`.
//!
//! # Design
//!
//! `guest-init` loads modules with `finit_module` in exactly the order its configuration
//! lists them, and does no dependency resolution of its own (PID 1 stays small and the
//! guest needs no `modules.dep`). So the image builder expands the configured names here,
//! on the host, into the full load order.
//!
//! `modules.dep` (written by `depmod`) has one line per module:
//! `kernel/path/a.ko: kernel/path/b.ko kernel/path/c.ko`, listing the *transitive*
//! dependencies, the ones to load first at the end (this is how `modprobe` reads it). We
//! resolve by depth-first search over those lines, visiting a module's dependencies from
//! the last to the first and emitting each module after its dependencies, once. The result
//! is deterministic and independent of the order of lines in the file.
//!
//! A module's file may be plain (`.ko`) or compressed (`.ko.xz`, `.ko.zst`, `.ko.gz`),
//! as distributions ship them; [`crate::decompress`] unpacks it when the image is built.
//! Any other ending is an error naming the file and the formats accepted.
//!
//! Module names are compared with `-` and `_` treated as the same, as the kernel does.
//! A name that `modules.builtin` lists is built into the kernel: it needs no file and is
//! dropped from the load order. A name found in neither is an error naming the module and
//! the kernel directory, so a typo fails the image build rather than the boot.
//!
//! `modules.dep` does not always tell the whole story: the vsock transport does not depend
//! on `virtio_pci`, yet without it there is no PCI device for the transport to bind to. Such
//! drivers must be listed explicitly in the configuration (the defaults in
//! [`crate::VSOCK_MODULES`] do).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use crate::decompress::{Format, ACCEPTED};

/// One module to load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Module {
    /// Canonical name (underscores), e.g. `virtio_pci`.
    pub name: String,
    /// The file, relative to the kernel's module directory.
    pub rel_path: String,
}

/// An error resolving modules.
#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    /// `modules.dep` cannot be read.
    #[error("cannot read {path}: {source} (run `depmod -b DIR VERSION` on the kernel's modules)")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A configured module exists neither as a file nor built in.
    #[error(
        "modules: kernel module {name:?} is not in {dir}/modules.dep nor built in; \
         check the name (see `modinfo -b` / `ls {dir}/kernel`) or the kernel version"
    )]
    Missing {
        /// The module name as configured.
        name: String,
        /// The kernel module directory searched.
        dir: String,
    },
    /// A line of `modules.dep` is malformed.
    #[error("{path}:{line}: malformed modules.dep line (expected `file.ko: deps...`)")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
    },
    /// A module file in a compression format the builder cannot unpack.
    #[error(
        "kernel module {name:?} is {rel_path}, a format the image builder cannot unpack \
         (it takes {accepted}); recompress the kernel's modules with xz or zstd, or \
         decompress them, and rerun depmod"
    )]
    UnknownFormat {
        /// The module.
        name: String,
        /// Its file.
        rel_path: String,
        /// The endings accepted.
        accepted: &'static str,
    },
}

/// Canonical module name: `-` becomes `_`.
pub fn canonical(name: &str) -> String {
    name.trim().replace('-', "_")
}

fn name_of(rel_path: &str) -> String {
    let file = rel_path.rsplit('/').next().unwrap_or(rel_path);
    let stem = file.split(".ko").next().unwrap_or(file);
    canonical(stem)
}

/// The parsed dependency database of one kernel.
#[derive(Clone, Debug)]
pub struct ModuleDb {
    dir: PathBuf,
    /// name → (file, its dependency names in file order)
    deps: BTreeMap<String, (String, Vec<String>)>,
    builtin: HashSet<String>,
}

impl ModuleDb {
    /// Reads `<dir>/modules.dep` and (if present) `<dir>/modules.builtin`, where `dir` is
    /// `.../lib/modules/<version>`.
    pub fn load(dir: &Path) -> Result<Self, ModuleError> {
        let dep_path = dir.join("modules.dep");
        let text = std::fs::read_to_string(&dep_path).map_err(|source| ModuleError::Read {
            path: dep_path.clone(),
            source,
        })?;
        let builtin = std::fs::read_to_string(dir.join("modules.builtin")).unwrap_or_default();
        Self::parse(dir, &dep_path, &text, &builtin)
    }

    /// Parses the two files' contents (for tests and callers with their own I/O).
    pub fn parse(
        dir: &Path,
        dep_path: &Path,
        dep_text: &str,
        builtin_text: &str,
    ) -> Result<Self, ModuleError> {
        let mut deps = BTreeMap::new();
        for (i, line) in dep_text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let Some((file, rest)) = line.split_once(':') else {
                return Err(ModuleError::Malformed {
                    path: dep_path.to_path_buf(),
                    line: i + 1,
                });
            };
            let file = file.trim().to_string();
            let list = rest.split_whitespace().map(name_of).collect();
            deps.insert(name_of(&file), (file, list));
        }
        let builtin = builtin_text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(name_of)
            .collect();
        Ok(Self {
            dir: dir.to_path_buf(),
            deps,
            builtin,
        })
    }

    /// The directory the database came from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether `name` is built into the kernel.
    pub fn is_builtin(&self, name: &str) -> bool {
        self.builtin.contains(&canonical(name))
    }

    /// The names among `names` that are built into the kernel and have no module file, in
    /// canonical form, each once: [`Self::resolve`] drops them from the load order, and
    /// the builder reports them as a note (a configuration written for a kernel that has
    /// them as modules is valid for one that builds them in, such as `virtio_pci` in 6.12).
    pub fn builtin_among<S: AsRef<str>>(&self, names: &[S]) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for n in names {
            let n = canonical(n.as_ref());
            if !self.deps.contains_key(&n) && self.builtin.contains(&n) && !out.contains(&n) {
                out.push(n);
            }
        }
        out
    }

    /// Expands `names` into the full load order: each module after its dependencies, each
    /// once, built-in modules left out. The configured order is kept where dependencies
    /// allow it.
    pub fn resolve<S: AsRef<str>>(&self, names: &[S]) -> Result<Vec<Module>, ModuleError> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for n in names {
            self.visit(n.as_ref(), &mut seen, &mut out)?;
        }
        Ok(out)
    }

    fn visit(
        &self,
        name: &str,
        seen: &mut HashSet<String>,
        out: &mut Vec<Module>,
    ) -> Result<(), ModuleError> {
        let name = canonical(name);
        if seen.contains(&name) {
            return Ok(());
        }
        seen.insert(name.clone());
        let Some((file, deps)) = self.deps.get(&name) else {
            if self.builtin.contains(&name) {
                return Ok(());
            }
            return Err(ModuleError::Missing {
                name,
                dir: self.dir.display().to_string(),
            });
        };
        if Format::of(file).is_none() {
            return Err(ModuleError::UnknownFormat {
                name,
                rel_path: file.clone(),
                accepted: ACCEPTED,
            });
        }
        // Dependencies to load first are at the end of the list.
        for d in deps.iter().rev() {
            self.visit(d, seen, out)?;
        }
        out.push(Module {
            name,
            rel_path: file.clone(),
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/drivers/virtio/virtio_pci_modern_dev.ko:
kernel/drivers/virtio/virtio_pci_legacy_dev.ko:
kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio_pci_legacy_dev.ko kernel/drivers/virtio/virtio_pci_modern_dev.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_ring.ko:
kernel/net/vmw_vsock/vsock.ko:
kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko: kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko kernel/net/vmw_vsock/vsock.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko: kernel/net/vmw_vsock/vsock.ko
kernel/fs/zz/comp.ko.xz: kernel/fs/zz/zdep.ko.zst
kernel/fs/zz/zdep.ko.zst:
kernel/fs/zz/old.ko.bz2:
";

    fn db() -> ModuleDb {
        ModuleDb::parse(
            Path::new("/k"),
            Path::new("/k/modules.dep"),
            DEP,
            "kernel/fs/ext4/ext4.ko\n",
        )
        .unwrap()
    }

    fn names(m: &[Module]) -> Vec<&str> {
        m.iter().map(|m| m.name.as_str()).collect()
    }

    #[test]
    fn dependencies_come_first_each_once() {
        let m = db()
            .resolve(&["virtio_pci", "vmw_vsock_virtio_transport"])
            .unwrap();
        assert_eq!(
            names(&m),
            [
                "virtio_ring",
                "virtio",
                "virtio_pci_modern_dev",
                "virtio_pci_legacy_dev",
                "virtio_pci",
                "vsock",
                "vmw_vsock_virtio_transport_common",
                "vmw_vsock_virtio_transport",
            ]
        );
        assert_eq!(m[4].rel_path, "kernel/drivers/virtio/virtio_pci.ko");
    }

    #[test]
    fn every_module_follows_all_its_dependencies() {
        let d = db();
        let m = d
            .resolve(&["vmw-vsock-virtio-transport", "virtio_pci"])
            .unwrap();
        for (i, module) in m.iter().enumerate() {
            for dep in &d.deps[&module.name].1 {
                let j = m.iter().position(|x| &x.name == dep).unwrap();
                assert!(j < i, "{dep} must load before {}", module.name);
            }
        }
    }

    #[test]
    fn builtin_is_dropped_and_missing_is_named() {
        let d = db();
        assert!(d.resolve(&["ext4"]).unwrap().is_empty());
        let err = d.resolve(&["virtio_pci", "no_such_mod"]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("\"no_such_mod\"") && msg.contains("/k"),
            "{msg}"
        );
    }

    #[test]
    fn compressed_modules_resolve_and_unknown_formats_are_refused_clearly() {
        let m = db().resolve(&["comp"]).unwrap();
        assert_eq!(names(&m), ["zdep", "comp"]);
        assert_eq!(m[1].rel_path, "kernel/fs/zz/comp.ko.xz");
        assert_eq!(m[0].rel_path, "kernel/fs/zz/zdep.ko.zst");
        let err = db().resolve(&["old"]).unwrap_err();
        assert!(matches!(err, ModuleError::UnknownFormat { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("old.ko.bz2") && msg.contains(".ko.zst"),
            "{msg}"
        );
    }

    #[test]
    fn builtins_among_the_configured_names_are_listed_once() {
        let d = db();
        assert_eq!(
            d.builtin_among(&["virtio_pci", "ext4", "vsock", "ext4"]),
            ["ext4"]
        );
    }

    #[test]
    fn malformed_line_is_reported_with_its_number() {
        let err = ModuleDb::parse(
            Path::new("/k"),
            Path::new("/k/modules.dep"),
            "a.ko:\nbad\n",
            "",
        )
        .unwrap_err();
        assert!(err.to_string().contains("modules.dep:2"), "{err}");
    }
}
