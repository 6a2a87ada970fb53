//! Where the VM's private key lives, behind one trait.
//!
//! A [`KeyStore`] makes, keeps and forgets keys by *slot* (a short name the enrollment
//! state refers to); a [`MachineKey`] can only say its public key and sign. Nothing outside
//! a store ever sees private key bytes, which is what lets the hardware-backed store (a
//! vTPM, where the key is created inside the TPM and cannot be exported) use the same
//! enrollment logic: it implements the same two traits.
//!
//! Three stores exist:
//! - [`super::file_store::FileKeyStore`]: PKCS#8 DER in a root-only `0700` directory, each
//!   file `0600`, written durably (survives reboots; a copied disk carries the key);
//! - [`super::memory_store::MemoryKeyStore`]: the key only in `memfd_secret` memory (or
//!   `mlock`ed, non-dumpable memory), never on disk; lost at every reboot, so the VM
//!   re-enrolls on every boot with fresh bootstrap material.
//! - [`super::tpm::TpmKeyStore`] (feature `tpm`, on by default): the key made by the VM's
//!   TPM 2.0 and kept on disk only wrapped by that TPM (survives reboots with the same TPM
//!   state; a copied disk carries no usable key).
//!
//! Keys are P-256 (ECDSA with SHA-256), generated inside the guest from the OS RNG. The
//! in-memory `p256` signing key wipes itself on drop.
//!
//! Threat: the app (another uid) or a crash dump reading the key; the key leaving the VM.

use std::sync::Arc;

use p256::ecdsa::signature::Signer;
use p256::elliptic_curve::Generate;
use sha2::{Digest, Sha256};

/// A key store failure. Messages name the store and slot, never key bytes.
#[derive(Debug, thiserror::Error)]
pub enum KeyStoreError {
    /// An I/O failure.
    #[error("key store {store}: {what}: {source}")]
    Io {
        /// The store kind.
        store: &'static str,
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A cryptographic failure (RNG, malformed key).
    #[error("key store {store}: {what}")]
    Crypto {
        /// The store kind.
        store: &'static str,
        /// What failed.
        what: String,
    },
}

/// A private key the VM signs with; only its public half is visible.
pub trait MachineKey: Send + Sync {
    /// The public key as a SEC1 uncompressed point (65 bytes for P-256).
    fn public_sec1(&self) -> &[u8];
    /// Signs `msg` with ECDSA P-256 SHA-256; returns the ASN.1 DER signature.
    fn sign_der(&self, msg: &[u8]) -> Result<Vec<u8>, KeyStoreError>;
}

/// Makes, keeps and forgets machine keys.
pub trait KeyStore: Send + Sync {
    /// The store's name in messages and the configuration (`file`, `memory`).
    fn kind(&self) -> &'static str;
    /// Whether keys survive a restart of the process and a reboot.
    fn persistent(&self) -> bool;
    /// Generates a new key, stores it durably (as the store understands it) and returns it
    /// with its slot name.
    fn generate(&self) -> Result<(String, Arc<dyn MachineKey>), KeyStoreError>;
    /// Opens the key in `slot`; `Ok(None)` when the store has no such key.
    fn open(&self, slot: &str) -> Result<Option<Arc<dyn MachineKey>>, KeyStoreError>;
    /// Forgets the key in `slot` (no error if it is already gone).
    fn remove(&self, slot: &str) -> Result<(), KeyStoreError>;
    /// Every slot the store holds.
    fn slots(&self) -> Result<Vec<String>, KeyStoreError>;
}

/// The slot name of a public key: the first 16 hex digits of its SHA-256. Unique per key,
/// so a crash between storing a key and recording it never collides with a later key.
pub fn slot_for(public_sec1: &[u8]) -> String {
    super::material::hex(&Sha256::digest(public_sec1)[..8])
}

/// Whether `s` is a well-formed slot name (so a record cannot point outside the store).
pub fn is_slot(s: &str) -> bool {
    s.len() == 16
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A P-256 key held in process memory by the `p256` crate (wiped on drop).
pub struct P256Key {
    sk: p256::ecdsa::SigningKey,
    public: Vec<u8>,
}

impl P256Key {
    /// A fresh key from the OS RNG.
    pub fn generate(store: &'static str) -> Result<P256Key, KeyStoreError> {
        let sk = p256::ecdsa::SigningKey::try_generate().map_err(|e| KeyStoreError::Crypto {
            store,
            what: format!("the OS random number generator failed: {e}"),
        })?;
        Ok(Self::from_signing_key(sk))
    }

    /// Wraps an existing signing key.
    pub fn from_signing_key(sk: p256::ecdsa::SigningKey) -> P256Key {
        let public = sk.verifying_key().to_sec1_point(false).as_bytes().to_vec();
        P256Key { sk, public }
    }

    /// The signing key, for the stores that serialize it.
    pub(super) fn signing_key(&self) -> &p256::ecdsa::SigningKey {
        &self.sk
    }
}

impl MachineKey for P256Key {
    fn public_sec1(&self) -> &[u8] {
        &self.public
    }

    fn sign_der(&self, msg: &[u8]) -> Result<Vec<u8>, KeyStoreError> {
        let sig: p256::ecdsa::Signature = self.sk.sign(msg);
        Ok(sig.to_der().as_bytes().to_vec())
    }
}

/// Adapts a [`MachineKey`] to rcgen's external-signer traits, so rcgen builds the CSR
/// without ever holding the private key.
pub struct RcgenSigner<'a>(pub &'a dyn MachineKey);

impl rcgen::PublicKeyData for RcgenSigner<'_> {
    fn der_bytes(&self) -> &[u8] {
        self.0.public_sec1()
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}

impl rcgen::SigningKey for RcgenSigner<'_> {
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
        self.0
            .sign_der(msg)
            .map_err(|_| rcgen::Error::RemoteKeyError)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use p256::ecdsa::signature::Verifier;

    #[test]
    fn signatures_verify_under_the_public_key() {
        let k = P256Key::generate("test").unwrap();
        assert_eq!(k.public_sec1().len(), 65);
        assert_eq!(k.public_sec1()[0], 4);
        let der = k.sign_der(b"hello").unwrap();
        let sig = p256::ecdsa::DerSignature::try_from(der.as_slice()).unwrap();
        let vk = p256::ecdsa::VerifyingKey::from_sec1_bytes(k.public_sec1()).unwrap();
        let sig = p256::ecdsa::Signature::try_from(sig).unwrap();
        vk.verify(b"hello", &sig).unwrap();
        assert!(vk.verify(b"other", &sig).is_err());
    }

    #[test]
    fn slots_are_hex_and_distinct() {
        let a = P256Key::generate("test").unwrap();
        let b = P256Key::generate("test").unwrap();
        let (sa, sb) = (slot_for(a.public_sec1()), slot_for(b.public_sec1()));
        assert!(is_slot(&sa) && is_slot(&sb));
        assert_ne!(sa, sb);
        assert!(!is_slot("../../etc/passwd"));
    }
}
