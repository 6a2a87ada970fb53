//! One file per key slot: what the file and TPM key stores keep on disk alike.
//!
//! Both stores keep each key as `<dir>/<slot>.key` in a root-only `0700` directory, written
//! atomically and durably with mode `0600` and read back bounded, without following a
//! symlink, only if it is still ours and `0600` (see [`super::files`]). They differ only in
//! what the bytes are (PKCS#8 DER for the file store, a TPM-wrapped blob for the TPM
//! store). A name that is not a slot ([`is_slot`]: the hex form [`super::keystore::slot_for`]
//! makes) is never turned into a path: opening it finds no key, removing it removes
//! nothing.
//!
//! Threat: another uid in the VM reading or swapping a key file, a half-written key after a
//! crash, a symlink planted at a key's path, and a slot name from a record walking out of
//! the directory (`../`).

use std::io;
use std::path::{Path, PathBuf};

use zeroize::Zeroizing;

use super::files;
use super::keystore::{is_slot, KeyStoreError};

/// The key files of one store, in its private directory.
pub(super) struct SlotFiles {
    dir: PathBuf,
    store: &'static str,
}

impl SlotFiles {
    /// The key files of `store` in `dir`, created `0700` (or tightened to it) now.
    pub(super) fn open_dir(dir: &Path, store: &'static str) -> Result<SlotFiles, KeyStoreError> {
        let files = SlotFiles {
            dir: dir.to_path_buf(),
            store,
        };
        files::ensure_dir(dir, 0o700)
            .map_err(|e| files.io_err(format!("prepare {}", dir.display()), e))?;
        Ok(files)
    }

    /// An I/O error of this store.
    pub(super) fn io_err(&self, what: String, source: io::Error) -> KeyStoreError {
        KeyStoreError::Io {
            store: self.store,
            what,
            source,
        }
    }

    /// The path of a slot's key file.
    pub(super) fn path(&self, slot: &str) -> PathBuf {
        self.dir.join(format!("{slot}.key"))
    }

    /// Writes a slot's key file: atomic, durable, `0600`.
    pub(super) fn write(&self, slot: &str, data: &[u8]) -> Result<(), KeyStoreError> {
        files::write_atomic(&self.dir, &format!("{slot}.key"), data, 0o600)
            .map_err(|e| self.io_err(format!("write key {slot}"), e))
    }

    /// Reads at most `max` bytes of a slot's key file; `None` when `slot` is not a slot
    /// name or has no file.
    pub(super) fn read(
        &self,
        slot: &str,
        max: usize,
    ) -> Result<Option<Zeroizing<Vec<u8>>>, KeyStoreError> {
        if !is_slot(slot) {
            return Ok(None);
        }
        files::read_bounded(&self.path(slot), max, true)
            .map_err(|e| self.io_err(format!("read key {slot}"), e))
    }

    /// Removes a slot's key file durably; nothing when `slot` is not a slot name.
    pub(super) fn remove(&self, slot: &str) -> Result<(), KeyStoreError> {
        if !is_slot(slot) {
            return Ok(());
        }
        files::remove_durable(&self.dir, &format!("{slot}.key"))
            .map_err(|e| self.io_err(format!("remove key {slot}"), e))
    }

    /// The slots that have a key file.
    pub(super) fn slots(&self) -> Result<Vec<String>, KeyStoreError> {
        let list_err = |source| self.io_err("list keys".into(), source);
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(list_err)? {
            let name = entry.map_err(list_err)?.file_name();
            if let Some(slot) = name.to_str().and_then(|n| n.strip_suffix(".key")) {
                if is_slot(slot) {
                    out.push(slot.to_owned());
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};

    const SLOT: &str = "0123456789abcdef";

    /// A private file `name` in `dir`, as a key file would be.
    fn plant(dir: &Path, name: &str) {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dir.join(name))
            .unwrap();
    }

    #[test]
    fn a_slot_is_written_private_read_listed_and_removed() {
        let d = tempfile::tempdir().unwrap();
        let files = SlotFiles::open_dir(&d.path().join("keys"), "test").unwrap();
        files.write(SLOT, b"key bytes").unwrap();
        let path = files.path(SLOT);
        assert_eq!(path, d.path().join("keys").join(format!("{SLOT}.key")));
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o7777, 0o600);
        assert_eq!(
            files.read(SLOT, 64).unwrap().unwrap().as_slice(),
            b"key bytes"
        );
        assert_eq!(files.slots().unwrap(), [SLOT]);
        files.remove(SLOT).unwrap();
        assert!(files.read(SLOT, 64).unwrap().is_none());
        assert!(files.slots().unwrap().is_empty());
    }

    #[test]
    fn a_name_that_is_not_a_slot_never_becomes_a_path() {
        let d = tempfile::tempdir().unwrap();
        let files = SlotFiles::open_dir(&d.path().join("keys"), "test").unwrap();
        // A private key-like file one level up, and files in the directory whose names
        // are not slots.
        plant(d.path(), "outside.key");
        plant(&d.path().join("keys"), "not-a-slot.key");
        plant(&d.path().join("keys"), "0123456789ABCDEF.key");
        plant(&d.path().join("keys"), &format!("{SLOT}.tmp"));
        assert!(files.read("../outside", 64).unwrap().is_none());
        files.remove("../outside").unwrap();
        assert!(d.path().join("outside.key").exists());
        assert!(files.read("not-a-slot", 64).unwrap().is_none());
        assert!(files.slots().unwrap().is_empty());
    }
}
