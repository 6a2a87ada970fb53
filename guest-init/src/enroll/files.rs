//! Durable, private file operations for the enrollment state.
//!
//! Everything enrollment keeps on disk (the key in the file store, the exact CSR bytes, the
//! records saying what is pending and what is enrolled) must survive a crash at any
//! instant and must never be readable by the app. The rules, taken from the SPIRE disk key
//! manager and the kubelet's bootstrap, are:
//!
//! - the directory is created `0700`, owned by us; an existing one must be a real
//!   directory (not a symlink) owned by us, and is tightened to `0700`;
//! - a file is written to a fresh temporary name opened
//!   `O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC` with its final mode (so it is never, even for an
//!   instant, more readable than intended and never follows a planted link), written,
//!   `fsync`ed, renamed over the final name, and then the directory is `fsync`ed so the
//!   rename itself is durable;
//! - reads use `O_NOFOLLOW`, check the owner and mode, and are bounded.
//!
//! A reader therefore sees either the old file or the complete new one, never a torn one.
//!
//! Threat: another local user (the app runs as its own uid) reading or swapping the key or
//! the records through loose modes, symlinks or a half-written file.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use zeroize::Zeroizing;

/// Creates `dir` with `mode` if missing (parents `0755`); an existing directory must be a
/// real directory owned by the effective uid, and gets `mode`. Every directory it creates
/// is made durable by `fsync`ing its parent after the `mkdir`, so records written into it
/// later cannot outlive, after a crash, the directory entry that holds them.
pub fn ensure_dir(dir: &Path, mode: u32) -> io::Result<()> {
    if let Some(parent) = dir.parent() {
        if !parent.as_os_str().is_empty() {
            // Outermost missing ancestor first, each made durable in its own parent.
            let missing: Vec<&Path> = parent
                .ancestors()
                .take_while(|a| !a.as_os_str().is_empty() && fs::symlink_metadata(a).is_err())
                .collect();
            for a in missing.into_iter().rev() {
                make_dir(a, 0o755)?;
            }
        }
    }
    make_dir(dir, mode)?;
    let md = fs::symlink_metadata(dir)?;
    if !md.file_type().is_dir() {
        return Err(io::Error::other(format!(
            "{} is not a directory (a symlink or file is in the way); remove it",
            dir.display()
        )));
    }
    let euid = nix::unistd::geteuid().as_raw();
    if md.uid() != euid {
        return Err(io::Error::other(format!(
            "{} is owned by uid {}, not {euid}; it must belong to the enrolling user",
            dir.display(),
            md.uid()
        )));
    }
    if md.mode() & 0o7777 != mode {
        fs::set_permissions(dir, fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// `mkdir` with `mode`; when it created the directory, `fsync`s the parent. An existing
/// entry is left to the caller's checks.
fn make_dir(dir: &Path, mode: u32) -> io::Result<()> {
    match DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => match dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(parent) => sync_dir(parent),
            None => Ok(()),
        },
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
thread_local! {
    /// Directories `sync_dir` was called on in this thread (tests observe the durability
    /// steps this way: a lost `fsync` is invisible without a power cut).
    static SYNCED: std::cell::RefCell<Vec<std::path::PathBuf>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `fsync`s a directory, making renames and removals in it durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(test)]
    SYNCED.with(|s| s.borrow_mut().push(dir.to_path_buf()));
    File::open(dir)?.sync_all()
}

static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// Writes `data` to `dir/name` atomically and durably with `mode` (see the module doc).
pub fn write_atomic(dir: &Path, name: &str, data: &[u8], mode: u32) -> io::Result<()> {
    let tmp = dir.join(format!(
        ".{name}.tmp.{}.{}",
        std::process::id(),
        TEMP_SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        // The umask may have removed bits; never added any. Set exactly `mode`.
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, dir.join(name))?;
        sync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Removes `dir/name` if it exists and makes the removal durable.
pub fn remove_durable(dir: &Path, name: &str) -> io::Result<()> {
    match fs::remove_file(dir.join(name)) {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Reads at most `max` bytes of a regular file without following a symlink. With
/// `private`, the file must belong to the effective uid and have no group or other bits.
/// `Ok(None)` when it does not exist. The buffer is wiped when dropped.
pub fn read_bounded(
    path: &Path,
    max: usize,
    private: bool,
) -> io::Result<Option<Zeroizing<Vec<u8>>>> {
    let f = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(io::Error::other(format!(
                "{} is a symlink; it must be a regular file",
                path.display()
            )))
        }
        Err(e) => return Err(e),
    };
    let md = f.metadata()?;
    if !md.file_type().is_file() {
        return Err(io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    if private {
        let euid = nix::unistd::geteuid().as_raw();
        if md.uid() != euid {
            return Err(io::Error::other(format!(
                "{} is owned by uid {}, not {euid}; provision it owned by root",
                path.display(),
                md.uid()
            )));
        }
        if md.mode() & 0o077 != 0 {
            return Err(io::Error::other(format!(
                "{} has mode {:04o}; it must be 0600 (readable by its owner only)",
                path.display(),
                md.mode() & 0o7777
            )));
        }
    }
    // Capacity fixed up front so the buffer never reallocates (a reallocation would leave
    // an unwiped copy of a secret behind).
    let mut buf = Zeroizing::new(Vec::with_capacity(max + 1));
    f.take(max as u64 + 1).read_to_end(&mut buf)?;
    if buf.len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is larger than {max} bytes", path.display()),
        ));
    }
    Ok(Some(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_sets_exact_mode_and_replaces() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("state");
        ensure_dir(&dir, 0o700).unwrap();
        assert_eq!(fs::metadata(&dir).unwrap().mode() & 0o7777, 0o700);
        write_atomic(&dir, "k", b"one", 0o600).unwrap();
        write_atomic(&dir, "k", b"two", 0o600).unwrap();
        assert_eq!(fs::read(dir.join("k")).unwrap(), b"two");
        assert_eq!(fs::metadata(dir.join("k")).unwrap().mode() & 0o7777, 0o600);
        // No temporary file is left behind.
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
    }

    #[test]
    fn each_created_directory_is_made_durable_in_its_parent() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("a/b/state");
        SYNCED.with(|s| s.borrow_mut().clear());
        ensure_dir(&dir, 0o700).unwrap();
        let synced = SYNCED.with(|s| s.borrow().clone());
        for parent in [
            d.path().to_path_buf(),
            d.path().join("a"),
            d.path().join("a/b"),
        ] {
            assert!(
                synced.contains(&parent),
                "{} was not fsynced after a mkdir in it: {synced:?}",
                parent.display()
            );
        }
        // Nothing created, nothing to sync.
        SYNCED.with(|s| s.borrow_mut().clear());
        ensure_dir(&dir, 0o700).unwrap();
        assert!(SYNCED.with(|s| s.borrow().is_empty()));
    }

    #[test]
    fn loose_directory_is_tightened_and_symlink_refused() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("state");
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        ensure_dir(&dir, 0o700).unwrap();
        assert_eq!(fs::metadata(&dir).unwrap().mode() & 0o7777, 0o700);
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(ensure_dir(&link, 0o700).is_err());
    }

    #[test]
    fn private_read_refuses_loose_modes_symlinks_and_oversize() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        fs::write(&p, b"abc").unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_bounded(&p, 10, true).unwrap_err();
        assert!(e.to_string().contains("0600"), "{e}");
        fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(&**read_bounded(&p, 10, true).unwrap().unwrap(), b"abc");
        assert!(read_bounded(&p, 2, true).is_err());
        let l = d.path().join("l");
        std::os::unix::fs::symlink(&p, &l).unwrap();
        assert!(read_bounded(&l, 10, true).is_err());
        assert!(read_bounded(&d.path().join("none"), 10, true)
            .unwrap()
            .is_none());
    }
}
