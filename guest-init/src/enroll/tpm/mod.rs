//! The TPM key store: the VM's signing key lives in its TPM 2.0.
//!
//! The file store keeps a plain PKCS#8 key, so whoever copies the VM's disk has its
//! identity. With `key_store: "tpm"` the P-256 key is generated *inside* the VM's TPM (a
//! vTPM such as swtpm for a micro-VM) and never leaves it in clear: the disk holds only the
//! blob `TPM2_Create` returned, wrapped under a storage key that the TPM derives from its
//! own secret seed. The disk alone is useless; the disk plus that TPM's state is the VM.
//!
//! Key hierarchy (documented for operators in `docs/ENROLLMENT.md`):
//!
//! ```text
//! owner (storage) hierarchy seed            (inside the TPM state, never exported)
//!   └─ storage root key: ECC P-256, TCG SRK template, restricted decrypt, AES-128-CFB
//!        re-created by TPM2_CreatePrimary on every use (deterministic: same seed +
//!        same template = same key); not persisted with EvictControl
//!        └─ signing key: ECC P-256, ECDSA/SHA-256, fixedTPM | fixedParent |
//!             sensitiveDataOrigin, empty auth; on disk as TPM2B_PUBLIC || TPM2B_PRIVATE
//! ```
//!
//! Why re-create rather than persist the primary: a persistent handle needs an NV slot and
//! a choice of handle that another TPM user might already hold, and it outlives our state
//! directory; re-deriving it costs one ECC key derivation per operation and leaves the TPM
//! exactly as the platform provisioned it.
//!
//! Pure Rust: `tpm2-protocol` (pinned, no_std, no dependencies) marshals the commands;
//! [`transport`] writes them to `/dev/tpmrm0` (or any stream: swtpm's socket in tests);
//! [`commands`] builds the five commands and the password session; [`store`] implements
//! the `KeyStore`/`MachineKey` traits. No C library is linked.
//!
//! Fail closed: asking for this store on a VM without `/dev/tpmrm0` is a configuration
//! error naming `key_store` (see [`require_device`]), never a fallback to the file store;
//! a blob this TPM cannot load is an error, never a reason to make a new key.
//!
//! Threat: the VM's disk (copied, snapshotted, backed up) carrying a usable private key.
//! Not defended: someone holding both the disk and the VM's TPM state (the host's swtpm
//! state directory is as sensitive as a key file), and a process in the VM running as
//! root, which can ask the TPM to sign (it cannot extract the key, so its use ends when it
//! loses access).

pub mod commands;
pub mod store;
pub mod transport;

pub use store::{TpmKeyStore, DEVICE};

use std::path::Path;

/// Checks that `device` can be opened before anything is written; the error names the
/// configuration field and the fix.
pub fn require_device(device: &Path) -> Result<(), String> {
    match store::open_device(device) {
        Ok(_) => Ok(()),
        Err(e) => Err(format!(
            "key_store: \"tpm\" needs a TPM 2.0 at {} and this VM has none usable ({e}); give the VM a TPM (QEMU: -tpmdev emulator with swtpm and -device tpm-crb; qemu-harness: --tpm), or choose another key_store explicitly",
            device.display()
        )),
    }
}

#[cfg(test)]
mod tests;
