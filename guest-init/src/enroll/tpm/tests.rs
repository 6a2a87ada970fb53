//! Host-side tests of the TPM transport, session and store against a real swtpm, reached
//! over its raw-command Unix socket (`swtpm socket --server type=unixio`): no VM needed.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use p256::ecdsa::signature::Verifier;
use qemu_harness::swtpm::RawServer;

use super::store::{Connector, Stream, TpmKeyStore};
use crate::enroll::keystore::KeyStore;

/// A swtpm on `state` (the same directory again is the same TPM), or `None` when swtpm
/// is missing and `REQUIRE_ALL` is not set.
fn swtpm(state: &Path) -> Option<RawServer> {
    if Command::new("swtpm").arg("--version").output().is_err() {
        assert!(
            std::env::var("REQUIRE_ALL").as_deref() != Ok("1"),
            "swtpm is missing (scripts/setup.sh installs it)"
        );
        eprintln!("SKIPPED: swtpm is not installed");
        return None;
    }
    Some(RawServer::start(state).expect("start swtpm"))
}

/// A temporary directory holding a fresh TPM's state in `tpm/` (key files go in `keys/`),
/// and that TPM, or `None` as [`swtpm`].
fn fresh_tpm() -> Option<(tempfile::TempDir, RawServer)> {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("tpm")).unwrap();
    let tpm = swtpm(&d.path().join("tpm"))?;
    Some((d, tpm))
}

/// A connector for the store: a fresh connection to the server per operation.
fn connector(server: &RawServer) -> Connector {
    let sock = server.socket().to_path_buf();
    Arc::new(move || UnixStream::connect(&sock).map(|s| Box::new(s) as Box<dyn Stream>))
}

fn verify(public_sec1: &[u8], msg: &[u8], der: &[u8]) -> bool {
    let vk = p256::ecdsa::VerifyingKey::from_sec1_bytes(public_sec1).unwrap();
    let sig = p256::ecdsa::Signature::from_der(der).unwrap();
    vk.verify(msg, &sig).is_ok()
}

#[test]
fn keys_are_made_by_the_tpm_and_survive_a_tpm_restart() {
    let Some((d, tpm)) = fresh_tpm() else {
        return;
    };
    let dir = d.path().join("keys");
    let store = TpmKeyStore::with_connector(&dir, connector(&tpm)).unwrap();
    let (slot, key) = store.generate().unwrap();
    let der = key.sign_der(b"hello").unwrap();
    assert!(verify(key.public_sec1(), b"hello", &der));
    assert!(!verify(key.public_sec1(), b"other", &der));
    // Two signatures differ (ECDSA nonces come from the TPM) and both verify.
    let again = key.sign_der(b"hello").unwrap();
    assert_ne!(der, again);
    assert!(verify(key.public_sec1(), b"hello", &again));

    // The blob on disk is public + wrapped private, not PKCS#8.
    let blob = std::fs::read(store.key_path(&slot)).unwrap();
    let (public, _) = super::commands::unmarshal_blob(&blob).unwrap();
    assert_eq!(
        super::commands::signing_point(&public).unwrap(),
        key.public_sec1()
    );
    assert!(p256::SecretKey::from_sec1_der(&blob).is_err());
    assert!(<p256::SecretKey as p256::pkcs8::DecodePrivateKey>::from_pkcs8_der(&blob).is_err());

    // The same TPM state after a restart (a reboot) loads and signs with it.
    drop(tpm);
    let tpm = swtpm(&d.path().join("tpm")).unwrap();
    let store = TpmKeyStore::with_connector(&dir, connector(&tpm)).unwrap();
    let reopened = store.open(&slot).unwrap().unwrap();
    assert_eq!(reopened.public_sec1(), key.public_sec1());
    let der = reopened.sign_der(b"after reboot").unwrap();
    assert!(verify(key.public_sec1(), b"after reboot", &der));
    assert_eq!(store.slots().unwrap(), vec![slot.clone()]);

    // Handles are flushed: many operations do not fill swtpm's three transient slots.
    for _ in 0..8 {
        reopened.sign_der(b"x").unwrap();
    }
    store.remove(&slot).unwrap();
    assert!(store.open(&slot).unwrap().is_none());
}

#[test]
fn another_tpm_cannot_load_the_blob_and_says_so() {
    let d = tempfile::tempdir().unwrap();
    let (a, b, dir) = (
        d.path().join("a"),
        d.path().join("b"),
        d.path().join("keys"),
    );
    std::fs::create_dir(&a).unwrap();
    std::fs::create_dir(&b).unwrap();
    let Some(tpm_a) = swtpm(&a) else {
        return;
    };
    let (slot, _) = TpmKeyStore::with_connector(&dir, connector(&tpm_a))
        .unwrap()
        .generate()
        .unwrap();
    drop(tpm_a);
    let tpm_b = swtpm(&b).unwrap();
    let store = TpmKeyStore::with_connector(&dir, connector(&tpm_b)).unwrap();
    let e = store.open(&slot).expect_err("a foreign blob must not load");
    let msg = e.to_string();
    assert!(msg.contains("another TPM"), "{msg}");
    assert!(msg.contains(&slot), "{msg}");
    // Nothing was removed: the blob is the evidence, and the state is not ours to drop.
    assert!(store.key_path(&slot).exists());
}

#[test]
fn a_swapped_or_damaged_blob_is_refused() {
    let Some((d, tpm)) = fresh_tpm() else {
        return;
    };
    let dir = d.path().join("keys");
    let store = TpmKeyStore::with_connector(&dir, connector(&tpm)).unwrap();
    let (a, _) = store.generate().unwrap();
    let (b, _) = store.generate().unwrap();
    // b's blob under a's name: the public key does not match the slot.
    std::fs::copy(store.key_path(&b), store.key_path(&a)).unwrap();
    let e = store.open(&a).err().unwrap().to_string();
    assert!(e.contains("another key"), "{e}");
    // A flipped bit in the wrapped private: the TPM's integrity check refuses it.
    let mut blob = std::fs::read(store.key_path(&b)).unwrap();
    let last = blob.len() - 1;
    blob[last] ^= 1;
    std::fs::write(store.key_path(&b), &blob).unwrap();
    let e = store.open(&b).err().unwrap().to_string();
    assert!(e.contains("cannot be loaded"), "{e}");
}

#[test]
fn a_missing_device_is_a_configuration_error_naming_the_field() {
    let e = super::require_device(Path::new("/nonexistent/tpmrm0")).unwrap_err();
    assert!(e.starts_with("key_store:"), "{e}");
    assert!(e.contains("/nonexistent/tpmrm0"), "{e}");
}

/// A stream to swtpm that records each response, one per command.
struct Recorder {
    inner: UnixStream,
    answers: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl Write for Recorder {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.answers.lock().unwrap().push(Vec::new());
        self.inner.write(b)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Read for Recorder {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(b)?;
        if let Some(last) = self.answers.lock().unwrap().last_mut() {
            last.extend_from_slice(&b[..n]);
        }
        Ok(n)
    }
}

/// A TPM that answers every command with the next recorded response, whatever it was.
struct Replay {
    answers: Arc<Mutex<VecDeque<Vec<u8>>>>,
    current: io::Cursor<Vec<u8>>,
}

impl Write for Replay {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let next = self.answers.lock().unwrap().pop_front().unwrap_or_default();
        self.current = io::Cursor::new(next);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for Replay {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        self.current.read(b)
    }
}

/// Recorded swtpm answers to the store's generate and sign, replayed by a fake device,
/// give the same key and the same signature: the transport and the response parsers
/// read real answers alone, with no state of their own. The recording is also the seed
/// of the `tpm_responses` fuzz target (its input format: a read size, then each response
/// as a big-endian `u16` length and its bytes), and the key file that of `tpm_blob`; set
/// `TPM_FUZZ_SEEDS` to a directory to write both there.
#[test]
fn recorded_tpm_answers_replay_to_the_same_key_and_signature() {
    let Some((d, tpm)) = fresh_tpm() else {
        return;
    };
    let dir = d.path().join("keys");
    let answers = Arc::new(Mutex::new(Vec::new()));
    let (sock, rec) = (tpm.socket().to_path_buf(), answers.clone());
    let recording: Connector = Arc::new(move || {
        UnixStream::connect(&sock).map(|inner| {
            Box::new(Recorder {
                inner,
                answers: rec.clone(),
            }) as Box<dyn Stream>
        })
    });
    let store = TpmKeyStore::with_connector(&dir.join("a"), recording).unwrap();
    let (slot, key) = store.generate().unwrap();
    let der = key.sign_der(b"hello").unwrap();
    let answers = answers.lock().unwrap().clone();
    // generate: CreatePrimary, Create, FlushContext; sign: CreatePrimary, Load, Sign,
    // FlushContext twice.
    assert_eq!(answers.len(), 8);

    let queue = Arc::new(Mutex::new(VecDeque::from(answers.clone())));
    let replay: Connector = Arc::new(move || {
        Ok(Box::new(Replay {
            answers: queue.clone(),
            current: io::Cursor::new(Vec::new()),
        }) as Box<dyn Stream>)
    });
    let replayed = TpmKeyStore::with_connector(&dir.join("b"), replay).unwrap();
    let (slot_b, key_b) = replayed.generate().unwrap();
    assert_eq!((&slot_b, key_b.public_sec1()), (&slot, key.public_sec1()));
    assert_eq!(key_b.sign_der(b"hello").unwrap(), der);

    if let Some(out) = std::env::var_os("TPM_FUZZ_SEEDS") {
        let out = Path::new(&out);
        let mut seed = vec![0u8];
        for a in &answers {
            seed.extend_from_slice(&(a.len() as u16).to_be_bytes());
            seed.extend_from_slice(a);
        }
        std::fs::write(out.join("seed-swtpm-generate-sign"), seed).unwrap();
        std::fs::copy(store.key_path(&slot), out.join("seed-swtpm-key")).unwrap();
    }
}
