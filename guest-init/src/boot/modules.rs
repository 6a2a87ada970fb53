//! Kernel modules loaded with `finit_module(2)` from the image's own files, in the
//! configured order. A file that is missing is an error naming it, unless the kernel has
//! the module built in; one failed module does not stop the others.

use std::ffi::CString;
use std::fs;
use std::io;
use std::path::Path;
use std::time::Instant;

use super::BootError;
use crate::{debug, info};

/// How one module load ended.
#[derive(Debug, PartialEq, Eq)]
pub enum ModuleOutcome {
    /// `finit_module` loaded it.
    Loaded,
    /// It was loaded already (`EEXIST`).
    AlreadyLoaded,
    /// No file, but the kernel has it built in.
    BuiltIn,
}

/// Loads one module from `dir/<name>.ko`; `sys_module` is normally `/sys/module`.
pub fn load_module(name: &str, dir: &Path, sys_module: &Path) -> Result<ModuleOutcome, BootError> {
    let path = dir.join(format!("{name}.ko"));
    let file = match fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // Built-in modules appear in /sys/module (with dashes or underscores).
            let alt = name.replace('-', "_");
            if sys_module.join(name).exists() || sys_module.join(&alt).exists() {
                return Ok(ModuleOutcome::BuiltIn);
            }
            return Err(BootError::Module {
                name: name.into(),
                path,
                source: e,
            });
        }
        Err(e) => {
            return Err(BootError::Module {
                name: name.into(),
                path,
                source: e,
            })
        }
    };
    let params = CString::default();
    match nix::kmod::finit_module(&file, &params, nix::kmod::ModuleInitFlags::empty()) {
        Ok(()) => Ok(ModuleOutcome::Loaded),
        Err(nix::errno::Errno::EEXIST) => Ok(ModuleOutcome::AlreadyLoaded),
        Err(e) => Err(BootError::Module {
            name: name.into(),
            path,
            source: e.into(),
        }),
    }
}

/// Loads the modules in order. Each failure is logged; the first is returned after all
/// were tried (a later module may still load, and the app may not need the failed one).
pub fn load_modules(names: &[String], dir: &Path) -> Result<(), BootError> {
    let start = Instant::now();
    let mut first_err = None;
    let mut loaded = 0;
    for name in names {
        match load_module(name, dir, Path::new("/sys/module")) {
            Ok(ModuleOutcome::Loaded) => loaded += 1,
            Ok(other) => debug!("module {name}: {other:?}"),
            Err(e) => {
                crate::error!("{e}");
                first_err.get_or_insert(e);
            }
        }
    }
    if !names.is_empty() {
        info!(
            "modules: {loaded} of {} loaded in {} ms",
            names.len(),
            start.elapsed().as_millis()
        );
    }
    first_err.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_module_file_is_fine_only_when_built_in() {
        let modules = tempfile::tempdir().unwrap();
        let sys = tempfile::tempdir().unwrap();
        std::fs::create_dir(sys.path().join("tpm_crb")).unwrap();
        assert_eq!(
            load_module("tpm_crb", modules.path(), sys.path()).unwrap(),
            ModuleOutcome::BuiltIn
        );
        let e = load_module("virtio_nope", modules.path(), sys.path()).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("virtio_nope") && msg.contains("virtio_nope.ko"),
            "{msg}"
        );
    }

    #[test]
    fn a_file_that_is_not_a_module_is_an_error_naming_it() {
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED: finit_module needs root");
            return;
        }
        let modules = tempfile::tempdir().unwrap();
        std::fs::write(modules.path().join("junk.ko"), b"not an ELF file").unwrap();
        let e = load_module("junk", modules.path(), Path::new("/nonexistent")).unwrap_err();
        assert!(e.to_string().contains("module junk"), "{e}");
    }
}
