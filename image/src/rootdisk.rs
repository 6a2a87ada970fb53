//! Builds an ext4 root disk from a directory, without root privileges, for apps too big for
//! an initramfs (Python and Radicale, for example). `guest-init` switches root into it.
//!
//! # Design
//!
//! `mke2fs -d DIR` (e2fsprogs) populates a new file system from a directory tree in user
//! space: no loop device, no mount, no privileges. The builder runs it on a sparse file of
//! the requested size with everything that would otherwise vary fixed:
//!
//! - the file system UUID and the directory hash seed are derived from a caller-given
//!   label (same label, same UUID), instead of random;
//! - `E2FSPROGS_FAKE_TIME` and `SOURCE_DATE_EPOCH` pin the superblock's times to 0;
//! - `root_owner=0:0` makes `/` owned by root whoever runs the builder.
//!
//! mke2fs 1.47.0 still copies each file's access, change and modification times from the
//! source tree (and the change time cannot be set by a user), so after mke2fs the builder
//! runs `debugfs -w` (also e2fsprogs, also unprivileged, on the image file) to set every
//! inode's four times to 0. The source tree is never modified. With that, the same tree
//! (content, names, modes and owners) gives the same bytes, which the tests check. Owners
//! and modes are copied from the source as they are: the caller decides them.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What to build.
#[derive(Clone, Debug)]
pub struct RootDiskSpec {
    /// The directory whose content becomes `/`.
    pub source: PathBuf,
    /// Size of the disk in MiB.
    pub size_mib: u64,
    /// Volume label, also the seed of the UUID and hash seed.
    pub label: String,
    /// Also set every file's access and modification time *in the source tree* to the
    /// epoch (the image's times are zeroed either way; this makes the tree itself
    /// time-independent, e.g. for hashing or archiving it).
    pub normalize_times: bool,
}

/// A root disk build error.
#[derive(Debug, thiserror::Error)]
pub enum RootDiskError {
    /// The source directory is missing.
    #[error("rootfs source {0} is not a directory")]
    NoSource(PathBuf),
    /// `mke2fs` is missing or failed.
    #[error(
        "mke2fs failed for {out}: {detail} (install e2fsprogs >= 1.43, or give a larger size_mib)"
    )]
    Mke2fs {
        /// The output.
        out: PathBuf,
        /// Its stderr or the spawn error.
        detail: String,
    },
    /// File system I/O.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file name debugfs cannot be given.
    #[error("rootfs source {0}: file names must be UTF-8 without `\"`, `\\` or newlines")]
    BadName(PathBuf),
    /// The label is unusable.
    #[error("rootfs label {0:?} must be 1 to 16 characters of [A-Za-z0-9_-]")]
    BadLabel(String),
}

/// A UUID derived from `seed` (FNV-1a based; only needs to be stable and well spread).
pub fn uuid_from(seed: &str, salt: u8) -> String {
    let mut bytes = [0u8; 16];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ u64::from(salt);
    for (i, b) in bytes.iter_mut().enumerate() {
        for c in seed.bytes().chain([i as u8, salt]) {
            h ^= u64::from(c);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        *b = (h >> 24) as u8;
    }
    // Version 4 / variant bits, so tools accept it as a well-formed UUID.
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

fn set_times_to_epoch(path: &Path) -> Result<(), RootDiskError> {
    let io = |source| RootDiskError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::symlink_metadata(path).map_err(io)?;
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    if meta.is_dir() {
        for e in std::fs::read_dir(path).map_err(io)? {
            set_times_to_epoch(&e.map_err(io)?.path())?;
        }
    }
    let f = std::fs::File::open(path).map_err(io)?;
    let epoch = std::time::SystemTime::UNIX_EPOCH;
    f.set_times(
        std::fs::FileTimes::new()
            .set_accessed(epoch)
            .set_modified(epoch),
    )
    .map_err(io)
}

/// Every path under `root`, relative, with a leading `/`, sorted.
fn list_tree(root: &Path, rel: &str, out: &mut Vec<String>) -> Result<(), RootDiskError> {
    let dir = root.join(rel.trim_start_matches('/'));
    let io = |source| RootDiskError::Io {
        path: dir.clone(),
        source,
    };
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .map_err(io)?
        .collect::<Result<_, _>>()
        .map_err(io)?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        let Some(name) = name.to_str() else {
            return Err(RootDiskError::BadName(e.path()));
        };
        if name.contains(['"', '\n', '\\']) {
            return Err(RootDiskError::BadName(e.path()));
        }
        let path = format!("{}/{name}", rel.trim_end_matches('/'));
        let is_dir = e.file_type().map_err(|source| RootDiskError::Io {
            path: e.path(),
            source,
        })?;
        out.push(path.clone());
        if is_dir.is_dir() {
            list_tree(root, &path, out)?;
        }
    }
    Ok(())
}

/// Sets every inode's times to 0 with `debugfs -w`.
fn zero_times(source: &Path, out: &Path) -> Result<(), RootDiskError> {
    let mut paths = vec!["/".to_string(), "/lost+found".to_string()];
    list_tree(source, "/", &mut paths)?;
    let mut cmds = String::new();
    for p in &paths {
        for field in [
            "atime",
            "mtime",
            "ctime",
            "crtime",
            "atime_extra",
            "mtime_extra",
            "ctime_extra",
            "crtime_extra",
        ] {
            cmds.push_str(&format!("set_inode_field \"{p}\" {field} 0\n"));
        }
    }
    let cmd_file = out.with_extension("debugfs-cmds");
    std::fs::write(&cmd_file, cmds).map_err(|source| RootDiskError::Io {
        path: cmd_file.clone(),
        source,
    })?;
    let result = Command::new("debugfs")
        .arg("-w")
        .arg("-f")
        .arg(&cmd_file)
        .arg(out)
        .env("E2FSPROGS_FAKE_TIME", "1")
        .output();
    let _ = std::fs::remove_file(&cmd_file);
    let output = result.map_err(|e| RootDiskError::Mke2fs {
        out: out.to_path_buf(),
        detail: format!("debugfs: {e}"),
    })?;
    // debugfs reports per-command errors on stderr but exits 0.
    let err = String::from_utf8_lossy(&output.stderr);
    if let Some(line) = err.lines().find(|l| !l.starts_with("debugfs ")) {
        return Err(RootDiskError::Mke2fs {
            out: out.to_path_buf(),
            detail: format!("debugfs: {line}"),
        });
    }
    Ok(())
}

/// Builds the disk image at `out` (overwritten).
pub fn build(spec: &RootDiskSpec, out: &Path) -> Result<(), RootDiskError> {
    if !spec.source.is_dir() {
        return Err(RootDiskError::NoSource(spec.source.clone()));
    }
    if spec.label.is_empty()
        || spec.label.len() > 16
        || !spec
            .label
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
    {
        return Err(RootDiskError::BadLabel(spec.label.clone()));
    }
    if spec.normalize_times {
        set_times_to_epoch(&spec.source)?;
    }
    let io = |source| RootDiskError::Io {
        path: out.to_path_buf(),
        source,
    };
    let _ = std::fs::remove_file(out);
    let f = std::fs::File::create(out).map_err(io)?;
    f.set_len(spec.size_mib << 20).map_err(io)?;
    drop(f);
    let uuid = uuid_from(&spec.label, 1);
    let hash_seed = uuid_from(&spec.label, 2);
    let output = Command::new("mke2fs")
        .args([
            "-q",
            "-F",
            "-t",
            "ext4",
            "-b",
            "4096",
            "-L",
            &spec.label,
            "-U",
            &uuid,
        ])
        .arg("-E")
        .arg(format!("root_owner=0:0,hash_seed={hash_seed}"))
        .arg("-d")
        .arg(&spec.source)
        .arg(out)
        .env("E2FSPROGS_FAKE_TIME", "1")
        .env("SOURCE_DATE_EPOCH", "1")
        .env("MKE2FS_DEVICE_SECTSIZE", "512")
        .output()
        .map_err(|e| RootDiskError::Mke2fs {
            out: out.to_path_buf(),
            detail: e.to_string(),
        })?;
    if !output.status.success() {
        let _ = std::fs::remove_file(out);
        return Err(RootDiskError::Mke2fs {
            out: out.to_path_buf(),
            detail: String::from_utf8_lossy(&output.stderr).trim().to_string(),
        });
    }
    if let Err(e) = zero_times(&spec.source, out) {
        let _ = std::fs::remove_file(out);
        return Err(e);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn have_mke2fs() -> bool {
        let ok = Command::new("mke2fs").arg("-V").output().is_ok();
        if !ok {
            if std::env::var("REQUIRE_ALL").is_ok_and(|v| v == "1") {
                panic!("mke2fs (e2fsprogs) is required for this test and missing");
            }
            eprintln!("SKIPPED: mke2fs (e2fsprogs) is missing");
        }
        ok
    }

    #[test]
    fn uuid_is_stable_and_distinct() {
        assert_eq!(uuid_from("a", 1), uuid_from("a", 1));
        assert_ne!(uuid_from("a", 1), uuid_from("b", 1));
        assert_ne!(uuid_from("a", 1), uuid_from("a", 2));
        assert_eq!(uuid_from("a", 1).len(), 36);
    }

    #[test]
    fn same_tree_gives_same_disk_and_content_is_there() {
        if !have_mke2fs() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(src.join("usr/bin")).unwrap();
        std::fs::write(src.join("usr/bin/app"), b"#!/bin/true\n").unwrap();
        let spec = RootDiskSpec {
            source: src.clone(),
            size_mib: 8,
            label: "test-root".into(),
            normalize_times: false,
        };
        let a = tmp.path().join("a.ext4");
        let b = tmp.path().join("b.ext4");
        build(&spec, &a).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1100));
        build(&spec, &b).unwrap();
        assert!(
            std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
            "two builds of the same tree differ"
        );
        // debugfs (e2fsprogs) reads the file back without mounting.
        let out = Command::new("debugfs")
            .args(["-R", "cat /usr/bin/app"])
            .arg(&a)
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "#!/bin/true\n");
    }

    #[test]
    fn bad_inputs_are_named() {
        let spec = RootDiskSpec {
            source: "/nonexistent-dir".into(),
            size_mib: 8,
            label: "x".into(),
            normalize_times: false,
        };
        let msg = build(&spec, Path::new("/tmp/never.ext4"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("/nonexistent-dir"), "{msg}");
        let tmp = tempfile::tempdir().unwrap();
        let spec = RootDiskSpec {
            source: tmp.path().into(),
            size_mib: 8,
            label: "bad label!".into(),
            normalize_times: false,
        };
        assert!(matches!(
            build(&spec, &tmp.path().join("o")),
            Err(RootDiskError::BadLabel(_))
        ));
    }
}
