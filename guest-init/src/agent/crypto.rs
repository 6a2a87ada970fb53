//! The agent's rustls crypto provider: the smallest set that speaks TLS 1.3 with the
//! platform, on pure-Rust RustCrypto crates.
//!
//! Why our own provider: guest-init is a static musl binary that links no C or assembly
//! crypto, so rustls' stock providers are out (aws-lc-rs is C; ring is C and assembly).
//! `rustls-rustcrypto` exists, but it is an alpha on the previous RustCrypto generation
//! (p256 0.13, sha2 0.10), so it would link a second copy of P-256 and SHA-2 next to the
//! ones enrollment uses, plus RSA and Ed25519 code nobody here needs. This module is the
//! subset the agent's profile needs, on the crates guest-init already has:
//!
//! - one cipher suite, `TLS13_CHACHA20_POLY1305_SHA256` (`chacha20poly1305`; constant-time
//!   in software, unlike table-based AES without AES-NI);
//! - one key-exchange group, `secp256r1` (`p256`'s ECDH, ephemeral per handshake);
//! - one signature scheme, ECDSA P-256 with SHA-256 (`p256`), to verify the peer's
//!   `CertificateVerify`; the guest's own signatures go through its key store
//!   (see [`super::tls`]);
//! - HKDF from rustls' `HkdfUsingHmac` over `hmac` + `sha2`;
//! - randomness from the kernel (`getrandom`).
//!
//! Nothing else is offered, so a peer that wants anything else fails the handshake: no
//! TLS 1.2, no RSA, no other curve. The key provider loads no private keys (keys live in
//! the key store).
//!
//! Threat: a weak or downgradable handshake (only TLS 1.3 and one suite exist), key-share
//! points off the curve (p256 rejects them: `PeerMisbehaved::InvalidKeyShare`), and a
//! second, unreviewed copy of the crypto the rest of guest-init relies on.

use std::sync::Arc;

use chacha20poly1305::aead::{AeadInOut, KeyInit};
use chacha20poly1305::ChaCha20Poly1305;
use hmac::Mac;
use p256::ecdsa::signature::hazmat::PrehashVerifier;
use rustls::crypto::cipher::{
    self, AeadKey, InboundOpaqueMessage, InboundPlainMessage, Iv, MessageDecrypter,
    MessageEncrypter, OutboundOpaqueMessage, OutboundPlainMessage, PrefixedPayload,
    Tls13AeadAlgorithm, UnsupportedOperationError,
};
use rustls::crypto::{
    hash, hmac as rhmac, tls13::HkdfUsingHmac, ActiveKeyExchange, CipherSuiteCommon,
    CryptoProvider, GetRandomFailed, KeyProvider, SecureRandom, SharedSecret, SupportedKxGroup,
    WebPkiSupportedAlgorithms,
};
use rustls::pki_types::SignatureVerificationAlgorithm;
use rustls::pki_types::{alg_id, AlgorithmIdentifier, InvalidSignature, PrivateKeyDer};
use rustls::{
    CipherSuite, ConnectionTrafficSecrets, ContentType, NamedGroup, ProtocolVersion,
    SignatureScheme, SupportedCipherSuite, Tls13CipherSuite,
};
use sha2::{Digest, Sha256};

/// The provider: one suite, one group, one signature scheme.
pub fn provider() -> CryptoProvider {
    CryptoProvider {
        cipher_suites: vec![TLS13_CHACHA20_POLY1305_SHA256],
        kx_groups: vec![&Secp256r1],
        signature_verification_algorithms: ALGORITHMS,
        secure_random: &Kernel,
        key_provider: &Kernel,
    }
}

/// The signature schemes the provider verifies.
pub static ALGORITHMS: WebPkiSupportedAlgorithms = WebPkiSupportedAlgorithms {
    all: &[ECDSA_P256_SHA256],
    mapping: &[(SignatureScheme::ECDSA_NISTP256_SHA256, &[ECDSA_P256_SHA256])],
};

/// `TLS13_CHACHA20_POLY1305_SHA256`.
pub static TLS13_CHACHA20_POLY1305_SHA256: SupportedCipherSuite =
    SupportedCipherSuite::Tls13(&Tls13CipherSuite {
        common: CipherSuiteCommon {
            suite: CipherSuite::TLS13_CHACHA20_POLY1305_SHA256,
            hash_provider: &Sha256Hash,
            // RFC 8446 §5.5: ChaCha20-Poly1305 has no practical limit.
            confidentiality_limit: u64::MAX,
        },
        hkdf_provider: &HkdfUsingHmac(&HmacSha256),
        aead_alg: &ChaChaPoly,
        quic: None,
    });

#[derive(Debug)]
struct Kernel;

impl SecureRandom for Kernel {
    fn fill(&self, buf: &mut [u8]) -> Result<(), GetRandomFailed> {
        getrandom::fill(buf).map_err(|_| GetRandomFailed)
    }
}

impl KeyProvider for Kernel {
    fn load_private_key(
        &self,
        _key: PrivateKeyDer<'static>,
    ) -> Result<Arc<dyn rustls::sign::SigningKey>, rustls::Error> {
        Err(rustls::Error::General(
            "the agent loads no private keys; its key lives in the key store".into(),
        ))
    }
}

// --- hashing ---------------------------------------------------------------------------

struct Sha256Hash;

impl hash::Hash for Sha256Hash {
    fn start(&self) -> Box<dyn hash::Context> {
        Box::new(Sha256Ctx(Sha256::new()))
    }
    fn hash(&self, data: &[u8]) -> hash::Output {
        hash::Output::new(&Sha256::digest(data)[..])
    }
    fn output_len(&self) -> usize {
        32
    }
    fn algorithm(&self) -> hash::HashAlgorithm {
        hash::HashAlgorithm::SHA256
    }
}

struct Sha256Ctx(Sha256);

impl hash::Context for Sha256Ctx {
    fn fork_finish(&self) -> hash::Output {
        hash::Output::new(&self.0.clone().finalize()[..])
    }
    fn fork(&self) -> Box<dyn hash::Context> {
        Box::new(Sha256Ctx(self.0.clone()))
    }
    fn finish(self: Box<Self>) -> hash::Output {
        hash::Output::new(&self.0.finalize()[..])
    }
    fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }
}

struct HmacSha256;

impl rhmac::Hmac for HmacSha256 {
    fn with_key(&self, key: &[u8]) -> Box<dyn rhmac::Key> {
        // HMAC takes keys of any length.
        Box::new(HmacKey(
            hmac::Hmac::<Sha256>::new_from_slice(key).unwrap_or_else(|_| unreachable!()),
        ))
    }
    fn hash_output_len(&self) -> usize {
        32
    }
}

struct HmacKey(hmac::Hmac<Sha256>);

impl rhmac::Key for HmacKey {
    fn sign_concat(&self, first: &[u8], middle: &[&[u8]], last: &[u8]) -> rhmac::Tag {
        let mut m = self.0.clone();
        m.update(first);
        for x in middle {
            m.update(x);
        }
        m.update(last);
        rhmac::Tag::new(&m.finalize().into_bytes()[..])
    }
    fn tag_len(&self) -> usize {
        32
    }
}

// --- key exchange ----------------------------------------------------------------------

#[derive(Debug)]
struct Secp256r1;

impl SupportedKxGroup for Secp256r1 {
    fn name(&self) -> NamedGroup {
        NamedGroup::secp256r1
    }
    fn start(&self) -> Result<Box<dyn ActiveKeyExchange>, rustls::Error> {
        use p256::elliptic_curve::sec1::ToSec1Point;
        use p256::elliptic_curve::Generate;
        let secret = p256::ecdh::EphemeralSecret::try_generate()
            .map_err(|_| rustls::Error::FailedToGetRandomBytes)?;
        // TLS 1.3 key shares are uncompressed points (RFC 8446 §4.2.8.2).
        let public = secret.public_key().to_sec1_point(false).as_bytes().to_vec();
        Ok(Box::new(Secp256r1Exchange { secret, public }))
    }
}

struct Secp256r1Exchange {
    secret: p256::ecdh::EphemeralSecret,
    public: Vec<u8>,
}

impl ActiveKeyExchange for Secp256r1Exchange {
    fn complete(self: Box<Self>, peer: &[u8]) -> Result<SharedSecret, rustls::Error> {
        let theirs = p256::PublicKey::from_sec1_bytes(peer)
            .map_err(|_| rustls::Error::from(rustls::PeerMisbehaved::InvalidKeyShare))?;
        let shared = self.secret.diffie_hellman(&theirs);
        Ok(SharedSecret::from(&shared.raw_secret_bytes()[..]))
    }
    fn pub_key(&self) -> &[u8] {
        &self.public
    }
    fn group(&self) -> NamedGroup {
        NamedGroup::secp256r1
    }
}

// --- signature verification ------------------------------------------------------------

/// ECDSA P-256 with SHA-256, for certificates and `CertificateVerify`.
pub static ECDSA_P256_SHA256: &dyn SignatureVerificationAlgorithm = &EcdsaP256Sha256;

#[derive(Debug)]
struct EcdsaP256Sha256;

impl SignatureVerificationAlgorithm for EcdsaP256Sha256 {
    fn public_key_alg_id(&self) -> AlgorithmIdentifier {
        alg_id::ECDSA_P256
    }
    fn signature_alg_id(&self) -> AlgorithmIdentifier {
        alg_id::ECDSA_SHA256
    }
    fn verify_signature(
        &self,
        public_key: &[u8],
        message: &[u8],
        signature: &[u8],
    ) -> Result<(), InvalidSignature> {
        let sig = p256::ecdsa::DerSignature::from_bytes(signature).map_err(|_| InvalidSignature)?;
        let key =
            p256::ecdsa::VerifyingKey::from_sec1_bytes(public_key).map_err(|_| InvalidSignature)?;
        key.verify_prehash(&Sha256::digest(message), &sig)
            .map_err(|_| InvalidSignature)
    }
}

// --- AEAD ------------------------------------------------------------------------------

struct ChaChaPoly;

const TAG_LEN: usize = 16;

impl Tls13AeadAlgorithm for ChaChaPoly {
    fn encrypter(&self, key: AeadKey, iv: Iv) -> Box<dyn MessageEncrypter> {
        Box::new(ChaChaCipher(cipher_for(&key), iv))
    }
    fn decrypter(&self, key: AeadKey, iv: Iv) -> Box<dyn MessageDecrypter> {
        Box::new(ChaChaCipher(cipher_for(&key), iv))
    }
    fn key_len(&self) -> usize {
        32
    }
    fn extract_keys(
        &self,
        key: AeadKey,
        iv: Iv,
    ) -> Result<ConnectionTrafficSecrets, UnsupportedOperationError> {
        Ok(ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv })
    }
}

fn cipher_for(key: &AeadKey) -> ChaCha20Poly1305 {
    // rustls derives exactly `key_len()` (32) bytes.
    ChaCha20Poly1305::new_from_slice(key.as_ref()).unwrap_or_else(|_| unreachable!())
}

struct ChaChaCipher(ChaCha20Poly1305, Iv);

impl ChaChaCipher {
    fn nonce(&self, seq: u64) -> chacha20poly1305::Nonce {
        cipher::Nonce::new(&self.1, seq).0.into()
    }
}

impl MessageEncrypter for ChaChaCipher {
    fn encrypt(
        &mut self,
        m: OutboundPlainMessage<'_>,
        seq: u64,
    ) -> Result<OutboundOpaqueMessage, rustls::Error> {
        let total = self.encrypted_payload_len(m.payload.len());
        let mut payload = PrefixedPayload::with_capacity(total);
        payload.extend_from_chunks(&m.payload);
        payload.extend_from_slice(&m.typ.to_array());
        let aad = cipher::make_tls13_aad(total);
        let body_len = payload.as_ref().len();
        let tag = self
            .0
            .encrypt_inout_detached(
                &self.nonce(seq),
                &aad,
                (&mut payload.as_mut()[..body_len]).into(),
            )
            .map_err(|_| rustls::Error::EncryptError)?;
        payload.extend_from_slice(&tag);
        Ok(OutboundOpaqueMessage::new(
            ContentType::ApplicationData,
            ProtocolVersion::TLSv1_2,
            payload,
        ))
    }
    fn encrypted_payload_len(&self, payload_len: usize) -> usize {
        payload_len + 1 + TAG_LEN
    }
}

impl MessageDecrypter for ChaChaCipher {
    fn decrypt<'a>(
        &mut self,
        mut m: InboundOpaqueMessage<'a>,
        seq: u64,
    ) -> Result<InboundPlainMessage<'a>, rustls::Error> {
        let payload = &mut m.payload;
        let len = payload.len();
        if len < TAG_LEN {
            return Err(rustls::Error::DecryptError);
        }
        let aad = cipher::make_tls13_aad(len);
        let nonce = self.nonce(seq);
        let (body, tag) = payload.split_at_mut(len - TAG_LEN);
        let tag =
            chacha20poly1305::Tag::try_from(&*tag).map_err(|_| rustls::Error::DecryptError)?;
        self.0
            .decrypt_inout_detached(&nonce, &aad, body.into(), &tag)
            .map_err(|_| rustls::Error::DecryptError)?;
        payload.truncate(len - TAG_LEN);
        m.into_tls13_unpadded_message()
    }
}
