//! A writer for the `newc` cpio format, the one format the Linux kernel unpacks as an
//! initramfs.
//!
//! # Design
//!
//! The archive is built from an in-memory [`Archive`]: a sorted map from path to entry.
//! Nothing is written until [`Archive::write_to`], which makes reproducibility a property of
//! the data structure rather than of the order callers happen to add files in:
//!
//! - entries are emitted in byte order of their paths, so a parent directory always precedes
//!   its children (`"a" < "a/b"`), which the kernel's unpacker needs;
//! - every missing parent directory is added implicitly (mode `0755`);
//! - `mtime` is 0, `uid`/`gid` are 0 and `nlink` is 1 for files (2 for directories), so the
//!   host's clock, user and file system never leak into the bytes;
//! - inode numbers are assigned 1, 2, 3... in emission order, so no two entries share one
//!   (the kernel would otherwise treat them as hard links) and they do not depend on the
//!   host's inodes.
//!
//! The same entries therefore always give the same bytes. The format itself is a 110-byte
//! ASCII header of thirteen 8-digit hex fields, the NUL-terminated name padded to a 4-byte
//! boundary, then the data padded to 4 bytes, and a final `TRAILER!!!` entry.

use std::collections::BTreeMap;
use std::io::{self, Write};

/// File type bits of `st_mode`.
const S_IFREG: u32 = 0o100000;
const S_IFDIR: u32 = 0o040000;
const S_IFLNK: u32 = 0o120000;

/// What an entry is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A directory with the given permission bits.
    Dir {
        /// Permission bits (e.g. `0o755`).
        mode: u32,
    },
    /// A regular file.
    File {
        /// Permission bits (e.g. `0o755` for an executable).
        mode: u32,
        /// The whole content.
        data: Vec<u8>,
    },
    /// A symbolic link to `target`.
    Symlink {
        /// Where the link points.
        target: String,
    },
}

/// An error in the archive's content.
#[derive(Debug, thiserror::Error)]
pub enum CpioError {
    /// The path is empty, absolute after normalisation fails, or has `.`/`..` parts.
    #[error("archive path {path:?} is invalid: {reason}")]
    BadPath {
        /// The path as given.
        path: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Two different entries were given the same path.
    #[error("archive path {path:?} was added twice with different content")]
    Duplicate {
        /// The path.
        path: String,
    },
    /// A path is used both as a directory and as something else.
    #[error("archive path {path:?} is needed as a directory but is a file or link")]
    NotADirectory {
        /// The path.
        path: String,
    },
    /// An entry is too large for the format's 32-bit size field.
    #[error("archive entry {path:?} is {size} bytes; newc cpio holds at most 4 GiB per file")]
    TooLarge {
        /// The path.
        path: String,
        /// Its size.
        size: usize,
    },
}

/// A set of entries, keyed by their path inside the archive (no leading `/`).
#[derive(Clone, Debug, Default)]
pub struct Archive {
    entries: BTreeMap<String, Entry>,
}

impl Archive {
    /// An empty archive.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `entry` at `path` (e.g. `"/etc/guest-init.json"` or `"etc/guest-init.json"`),
    /// creating missing parent directories. Adding the identical entry twice is fine;
    /// adding a different one at the same path is an error.
    pub fn add(&mut self, path: &str, entry: Entry) -> Result<(), CpioError> {
        let norm = normalize(path)?;
        if let Entry::File { data, .. } = &entry {
            if u32::try_from(data.len()).is_err() {
                return Err(CpioError::TooLarge {
                    path: norm,
                    size: data.len(),
                });
            }
        }
        // Parents first.
        let mut idx = 0;
        while let Some(pos) = norm[idx..].find('/') {
            let parent = &norm[..idx + pos];
            match self.entries.get(parent) {
                Some(Entry::Dir { .. }) => {}
                Some(_) => {
                    return Err(CpioError::NotADirectory {
                        path: parent.to_string(),
                    })
                }
                None => {
                    self.entries
                        .insert(parent.to_string(), Entry::Dir { mode: 0o755 });
                }
            }
            idx += pos + 1;
        }
        match self.entries.get(&norm) {
            Some(existing) if *existing == entry => Ok(()),
            // An implicit parent directory may be given explicit permissions later.
            Some(Entry::Dir { .. }) if matches!(entry, Entry::Dir { .. }) => {
                self.entries.insert(norm, entry);
                Ok(())
            }
            Some(_) => Err(CpioError::Duplicate { path: norm }),
            None => {
                self.entries.insert(norm, entry);
                Ok(())
            }
        }
    }

    /// The entries in the order they will be written.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &Entry)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Total size of file contents.
    pub fn content_size(&self) -> u64 {
        self.entries
            .values()
            .map(|e| match e {
                Entry::File { data, .. } => data.len() as u64,
                _ => 0,
            })
            .sum()
    }

    /// Writes the archive in newc format, ending with the trailer.
    pub fn write_to<W: Write>(&self, out: &mut W) -> io::Result<u64> {
        let mut written = 0u64;
        for (ino, (path, entry)) in self.entries.iter().enumerate() {
            let (mode, nlink, data): (u32, u32, &[u8]) = match entry {
                Entry::Dir { mode } => (S_IFDIR | (mode & 0o7777), 2, &[]),
                Entry::File { mode, data } => (S_IFREG | (mode & 0o7777), 1, data),
                Entry::Symlink { target } => (S_IFLNK | 0o777, 1, target.as_bytes()),
            };
            // Inode numbers start at 1; 0 is never used.
            let ino = u32::try_from(ino + 1).unwrap_or(u32::MAX);
            written += write_entry(out, path, ino, mode, nlink, data)?;
        }
        written += write_entry(out, "TRAILER!!!", 0, 0, 1, &[])?;
        Ok(written)
    }

    /// The archive as bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        // Writing to a Vec cannot fail.
        let _ = self.write_to(&mut v);
        v
    }
}

/// Strips a leading `/`, rejects empty, `.` and `..` components.
fn normalize(path: &str) -> Result<String, CpioError> {
    let trimmed = path.trim_start_matches('/').trim_end_matches('/');
    let bad = |reason| CpioError::BadPath {
        path: path.to_string(),
        reason,
    };
    if trimmed.is_empty() {
        return Err(bad("it names the archive root"));
    }
    if trimmed.contains('\0') {
        return Err(bad("it contains a NUL byte"));
    }
    for part in trimmed.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return Err(bad("empty, `.` or `..` components are not allowed"));
        }
    }
    Ok(trimmed.to_string())
}

fn pad4(n: u64) -> usize {
    ((4 - (n % 4)) % 4) as usize
}

fn write_entry<W: Write>(
    out: &mut W,
    name: &str,
    ino: u32,
    mode: u32,
    nlink: u32,
    data: &[u8],
) -> io::Result<u64> {
    let namesize = name.len() + 1;
    let header = format!(
        "070701{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}\
         {devmajor:08x}{devminor:08x}{rdevmajor:08x}{rdevminor:08x}{namesize:08x}{check:08x}",
        uid = 0,
        gid = 0,
        mtime = 0,
        size = data.len(),
        devmajor = 0,
        devminor = 0,
        rdevmajor = 0,
        rdevminor = 0,
        check = 0,
    );
    debug_assert_eq!(header.len(), 110);
    out.write_all(header.as_bytes())?;
    out.write_all(name.as_bytes())?;
    out.write_all(&[0])?;
    let mut n = 110 + namesize as u64;
    let p = pad4(n);
    out.write_all(&[0u8; 3][..p])?;
    n += p as u64;
    out.write_all(data)?;
    n += data.len() as u64;
    let p = pad4(n);
    out.write_all(&[0u8; 3][..p])?;
    n += p as u64;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(data: &[u8]) -> Entry {
        Entry::File {
            mode: 0o644,
            data: data.to_vec(),
        }
    }

    #[test]
    fn order_of_adding_does_not_change_the_bytes() {
        let mut a = Archive::new();
        a.add("/b/x", file(b"1")).unwrap();
        a.add("/a", file(b"22")).unwrap();
        let mut b = Archive::new();
        b.add("a", file(b"22")).unwrap();
        b.add("b/x", file(b"1")).unwrap();
        assert_eq!(a.to_bytes(), b.to_bytes());
    }

    #[test]
    fn parents_are_created_and_precede_children() {
        let mut a = Archive::new();
        a.add("/lib/modules/x.ko", file(b"ko")).unwrap();
        let names: Vec<_> = a.entries().map(|(p, _)| p.to_string()).collect();
        assert_eq!(names, ["lib", "lib/modules", "lib/modules/x.ko"]);
    }

    #[test]
    fn header_fields_are_fixed_and_aligned() {
        let mut a = Archive::new();
        a.add("init", file(b"hello")).unwrap();
        let bytes = a.to_bytes();
        assert_eq!(bytes.len() % 4, 0);
        let h = std::str::from_utf8(&bytes[..110]).unwrap();
        assert_eq!(&h[..6], "070701");
        assert_eq!(&h[6..14], "00000001", "first inode is 1");
        assert_eq!(&h[14..22], "000081a4", "regular file 0644");
        assert_eq!(&h[22..30], "00000000", "uid 0");
        assert_eq!(&h[30..38], "00000000", "gid 0");
        assert_eq!(&h[46..54], "00000000", "mtime 0");
        assert_eq!(&h[54..62], "00000005", "size");
        assert_eq!(&h[94..102], "00000005", "namesize includes the NUL");
        // name "init\0" at 110..115, padded to 116, data at 116.
        assert_eq!(&bytes[110..115], b"init\0");
        assert_eq!(&bytes[116..121], b"hello");
        let tail = String::from_utf8_lossy(&bytes[bytes.len() - 124..]);
        assert!(tail.contains("TRAILER!!!"), "{tail}");
    }

    #[test]
    fn duplicates_and_bad_paths_are_refused() {
        let mut a = Archive::new();
        a.add("x", file(b"1")).unwrap();
        a.add("x", file(b"1")).unwrap();
        assert!(matches!(
            a.add("x", file(b"2")),
            Err(CpioError::Duplicate { .. })
        ));
        assert!(matches!(
            a.add("x/y", file(b"2")),
            Err(CpioError::NotADirectory { .. })
        ));
        assert!(matches!(
            a.add("/", file(b"")),
            Err(CpioError::BadPath { .. })
        ));
        assert!(matches!(
            a.add("a/../b", file(b"")),
            Err(CpioError::BadPath { .. })
        ));
    }

    #[test]
    fn cpio_tool_reads_it_back() {
        if std::process::Command::new("cpio")
            .arg("--version")
            .output()
            .is_err()
        {
            if std::env::var("REQUIRE_ALL").is_ok_and(|v| v == "1") {
                panic!("cpio (GNU cpio) is required for this test and missing");
            }
            eprintln!("SKIPPED: cpio is missing");
            return;
        }
        let mut a = Archive::new();
        a.add("etc/conf", file(b"abc")).unwrap();
        a.add(
            "bin/sh",
            Entry::Symlink {
                target: "/init".into(),
            },
        )
        .unwrap();
        let mut child = std::process::Command::new("cpio")
            .args(["-t", "-v", "--quiet"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(&a.to_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let listing = String::from_utf8_lossy(&out.stdout);
        assert!(listing.contains("etc/conf"), "{listing}");
        assert!(listing.contains("bin/sh -> /init"), "{listing}");
    }
}
