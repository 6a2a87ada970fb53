//! The TPM key store: keys made by the VM's TPM, kept on disk only TPM-wrapped.
//!
//! `<state_dir>/<slot>.key` holds `TPM2B_PUBLIC || TPM2B_PRIVATE` as `TPM2_Create` returned
//! them (see [`super::commands`]): the public area in clear, the private scalar encrypted
//! and MACed under the storage root key that the TPM re-derives from its owner seed. The
//! file is written like the file store's (root, `0600`, atomic, durable), but what it
//! protects is different: a copy of the disk carries no usable key, because only the TPM
//! whose state holds that seed can load the blob.
//!
//! Every operation opens the TPM, re-creates the primary key, loads the blob, does its one
//! job (sign) and flushes both handles, so no handle outlives a call and a TPM without a
//! resource manager (swtpm's socket) never fills up.
//!
//! A blob this TPM cannot load (`TPM_RC_INTEGRITY`: made by another TPM, under another
//! owner seed, or altered) is an error, never "no key": enrollment fails closed rather than
//! make a second key for a token, and the message says why. A VM reset gives the VM a new
//! VM UID, a new TPM state *and* a new root disk, so a legitimate VM never meets a foreign
//! blob; a disk booted against another TPM is a copied or mismatched disk.
//!
//! Threat: the raw disk (a copy, a snapshot, a backup) giving away the VM's identity; the
//! app (another uid) reading the key file (it would get only the wrapped blob, and the
//! `0600` mode keeps even that from it).

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tpm2_protocol::data::{Tpm2bPrivate, TpmtPublic};

use super::commands;
use super::transport::{Tpm, TransportError};
use crate::enroll::keystore::{slot_for, KeyStore, KeyStoreError, MachineKey};
use crate::enroll::slot_files::SlotFiles;

const STORE: &str = "tpm";

/// The TPM device inside a VM: the kernel's resource manager, which flushes whatever a
/// process left loaded when it closes the device.
pub const DEVICE: &str = "/dev/tpmrm0";

/// The largest key file read (a P-256 blob is about 250 bytes).
const MAX_KEY_FILE: usize = 4096;

/// A byte stream to a TPM.
pub trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

/// Opens a fresh stream to the TPM for one operation.
pub type Connector = Arc<dyn Fn() -> io::Result<Box<dyn Stream>> + Send + Sync>;

/// Keys in the TPM, wrapped blobs in a private directory.
pub struct TpmKeyStore {
    files: SlotFiles,
    connect: Connector,
}

fn io_err(what: String, source: io::Error) -> KeyStoreError {
    KeyStoreError::Io {
        store: STORE,
        what,
        source,
    }
}

fn tpm_err(what: impl std::fmt::Display, e: TransportError) -> KeyStoreError {
    match e {
        TransportError::Io(source) => io_err(what.to_string(), source),
        e => KeyStoreError::Crypto {
            store: STORE,
            what: format!("{what}: {e}"),
        },
    }
}

/// Opens the TPM character device for reading and writing.
pub fn open_device(device: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(device)
}

impl TpmKeyStore {
    /// A store in `dir` (created `0700`) whose TPM is reached through `connect`.
    pub fn with_connector(dir: &Path, connect: Connector) -> Result<TpmKeyStore, KeyStoreError> {
        Ok(TpmKeyStore {
            files: SlotFiles::open_dir(dir, STORE)?,
            connect,
        })
    }

    /// A store using the TPM character device `device` (normally [`DEVICE`]).
    pub fn with_device(dir: &Path, device: &Path) -> Result<TpmKeyStore, KeyStoreError> {
        let device = device.to_path_buf();
        Self::with_connector(
            dir,
            Arc::new(move || open_device(&device).map(|f| Box::new(f) as Box<dyn Stream>)),
        )
    }

    /// The path of a slot's key blob.
    pub fn key_path(&self, slot: &str) -> PathBuf {
        self.files.path(slot)
    }
}

/// Runs `f` with a fresh connection and the storage root key loaded; flushes the root
/// key afterwards whatever happened.
fn with_primary<T>(
    connect: &Connector,
    f: impl FnOnce(&mut Tpm<Box<dyn Stream>>, u32) -> Result<T, KeyStoreError>,
) -> Result<T, KeyStoreError> {
    let stream = connect().map_err(|e| io_err("open the TPM".into(), e))?;
    let mut tpm = Tpm::new(stream);
    let primary = commands::create_primary(&mut tpm)
        .map_err(|e| tpm_err("create the storage root key", e))?;
    let out = f(&mut tpm, primary);
    let flushed = commands::flush(&mut tpm, primary);
    let out = out?;
    flushed.map_err(|e| tpm_err("flush the storage root key", e))?;
    Ok(out)
}

impl KeyStore for TpmKeyStore {
    fn kind(&self) -> &'static str {
        STORE
    }

    fn persistent(&self) -> bool {
        true
    }

    fn generate(&self) -> Result<(String, Arc<dyn MachineKey>), KeyStoreError> {
        let (public, private) = with_primary(&self.connect, |tpm, primary| {
            commands::create_signing_key(tpm, primary)
                .map(|(private, public)| (public, private))
                .map_err(|e| tpm_err("create the signing key", e))
        })?;
        let point = commands::signing_point(&public).map_err(|e| tpm_err("new key", e))?;
        let slot = slot_for(&point);
        let blob = commands::marshal_blob(&public, &private).map_err(|e| tpm_err(&slot, e))?;
        self.files.write(&slot, &blob)?;
        Ok((
            slot.clone(),
            Arc::new(TpmKey {
                slot,
                point,
                public,
                private,
                connect: self.connect.clone(),
            }),
        ))
    }

    fn open(&self, slot: &str) -> Result<Option<Arc<dyn MachineKey>>, KeyStoreError> {
        let Some(blob) = self.files.read(slot, MAX_KEY_FILE)? else {
            return Ok(None);
        };
        let (public, private) = commands::unmarshal_blob(&blob)
            .map_err(|e| tpm_err(format!("key {slot} is not a TPM key blob"), e))?;
        let point = commands::signing_point(&public)
            .map_err(|e| tpm_err(format!("key {slot} is not one of our TPM keys"), e))?;
        if slot_for(&point) != slot {
            return Err(KeyStoreError::Crypto {
                store: STORE,
                what: format!("key {slot}: the blob holds another key (renamed or swapped)"),
            });
        }
        let key = TpmKey {
            slot: slot.to_owned(),
            point,
            public,
            private,
            connect: self.connect.clone(),
        };
        // Prove now that this TPM can load it, so a foreign blob is reported here, with
        // its reason, before any decision depends on the key.
        key.with_loaded(|_, _| Ok(()))?;
        Ok(Some(Arc::new(key)))
    }

    fn remove(&self, slot: &str) -> Result<(), KeyStoreError> {
        self.files.remove(slot)
    }

    fn slots(&self) -> Result<Vec<String>, KeyStoreError> {
        self.files.slots()
    }
}

/// A key the TPM holds; this process holds only its public part and the wrapped blob.
pub struct TpmKey {
    slot: String,
    point: Vec<u8>,
    public: TpmtPublic,
    private: Tpm2bPrivate,
    connect: Connector,
}

impl TpmKey {
    fn with_loaded<T>(
        &self,
        f: impl FnOnce(&mut Tpm<Box<dyn Stream>>, u32) -> Result<T, KeyStoreError>,
    ) -> Result<T, KeyStoreError> {
        with_primary(&self.connect, |tpm, primary| {
            let handle =
                commands::load(tpm, primary, &self.private, &self.public).map_err(|e| {
                    if e.is_integrity() {
                        KeyStoreError::Crypto {
                            store: STORE,
                            what: format!(
                                "key {} cannot be loaded by this VM's TPM ({e}): it was wrapped by another TPM (or under another owner seed), or altered. This disk's enrollment state belongs to another TPM; it is neither used nor replaced. A VM keeps its key only with its own TPM state: boot this disk with the TPM state it enrolled with, or, for a new VM, provision a fresh state_dir and fresh bootstrap material",
                                self.slot
                            ),
                        }
                    } else {
                        tpm_err(format!("load key {}", self.slot), e)
                    }
                })?;
            let out = f(tpm, handle);
            let flushed = commands::flush(tpm, handle);
            let out = out?;
            flushed.map_err(|e| tpm_err(format!("flush key {}", self.slot), e))?;
            Ok(out)
        })
    }
}

impl MachineKey for TpmKey {
    fn public_sec1(&self) -> &[u8] {
        &self.point
    }

    fn sign_der(&self, msg: &[u8]) -> Result<Vec<u8>, KeyStoreError> {
        let digest: [u8; 32] = Sha256::digest(msg).into();
        let (r, s) = self.with_loaded(|tpm, handle| {
            commands::sign(tpm, handle, &digest)
                .map_err(|e| tpm_err(format!("sign with key {}", self.slot), e))
        })?;
        commands::signature_der(&r, &s).map_err(|e| tpm_err(format!("key {}", self.slot), e))
    }
}
