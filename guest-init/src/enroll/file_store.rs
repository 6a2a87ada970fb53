//! The file key store: PKCS#8 DER in a root-only directory.
//!
//! Each key is `<dir>/<slot>.key`. The directory is `0700` and owned by root; the file is
//! created `O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC` with mode `0600` under a temporary name,
//! written, `fsync`ed, renamed into place and the directory `fsync`ed (see
//! [`super::files`]), so a crash leaves either no key or a complete one, and the app,
//! which runs as another uid, can read neither the directory nor the file. Opening checks
//! the file is still owned by us and `0600`; a loosened file is refused rather than used.
//!
//! The DER is produced and parsed in buffers that wipe themselves on drop (`p256`'s
//! `SecretDocument`, our `Zeroizing` read buffer).
//!
//! Threat: another uid in the VM reading the key; a partially written key after a crash;
//! a symlink planted at the key's path. Not defended: someone with the raw disk (use the
//! TPM store, or the memory store).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use p256::pkcs8::{DecodePrivateKey, EncodePrivateKey};

use super::keystore::{slot_for, KeyStore, KeyStoreError, MachineKey, P256Key};
use super::slot_files::SlotFiles;

const STORE: &str = "file";

/// The largest key file read (a P-256 PKCS#8 document is about 138 bytes).
const MAX_KEY_FILE: usize = 4096;

/// Keys as files in a private directory.
pub struct FileKeyStore {
    files: SlotFiles,
}

impl FileKeyStore {
    /// A store in `dir`, created `0700` (or tightened to it) now.
    pub fn open_dir(dir: &Path) -> Result<FileKeyStore, KeyStoreError> {
        Ok(FileKeyStore {
            files: SlotFiles::open_dir(dir, STORE)?,
        })
    }

    /// The path of a slot's key file.
    pub fn key_path(&self, slot: &str) -> PathBuf {
        self.files.path(slot)
    }
}

impl KeyStore for FileKeyStore {
    fn kind(&self) -> &'static str {
        STORE
    }

    fn persistent(&self) -> bool {
        true
    }

    fn generate(&self) -> Result<(String, Arc<dyn MachineKey>), KeyStoreError> {
        let key = P256Key::generate(STORE)?;
        let slot = slot_for(key.public_sec1());
        let der = key
            .signing_key()
            .to_pkcs8_der()
            .map_err(|e| KeyStoreError::Crypto {
                store: STORE,
                what: format!("encode PKCS#8: {e}"),
            })?;
        self.files.write(&slot, der.as_bytes())?;
        Ok((slot, Arc::new(key)))
    }

    fn open(&self, slot: &str) -> Result<Option<Arc<dyn MachineKey>>, KeyStoreError> {
        let Some(der) = self.files.read(slot, MAX_KEY_FILE)? else {
            return Ok(None);
        };
        let sk =
            p256::ecdsa::SigningKey::from_pkcs8_der(&der).map_err(|_| KeyStoreError::Crypto {
                store: STORE,
                what: format!("key {slot} is not a P-256 PKCS#8 key"),
            })?;
        Ok(Some(Arc::new(P256Key::from_signing_key(sk))))
    }

    fn remove(&self, slot: &str) -> Result<(), KeyStoreError> {
        self.files.remove(slot)
    }

    fn slots(&self) -> Result<Vec<String>, KeyStoreError> {
        self.files.slots()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn keys_round_trip_with_private_modes() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("keys");
        let store = FileKeyStore::open_dir(&dir).unwrap();
        let (slot, key) = store.generate().unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o7777, 0o700);
        let md = std::fs::metadata(store.key_path(&slot)).unwrap();
        assert_eq!(md.mode() & 0o7777, 0o600);
        let again = store.open(&slot).unwrap().unwrap();
        assert_eq!(again.public_sec1(), key.public_sec1());
        assert_eq!(store.slots().unwrap(), vec![slot.clone()]);
        store.remove(&slot).unwrap();
        assert!(store.open(&slot).unwrap().is_none());
        assert!(store.slots().unwrap().is_empty());
    }

    #[test]
    fn a_loosened_key_file_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let store = FileKeyStore::open_dir(d.path()).unwrap();
        let (slot, _) = store.generate().unwrap();
        std::fs::set_permissions(
            store.key_path(&slot),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let e = store.open(&slot).err().unwrap().to_string();
        assert!(e.contains("0600"), "{e}");
    }
}
