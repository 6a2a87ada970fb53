//! The state machine's promises, each checked from outside: what the service received,
//! what the key store and the state directory hold, what was published.
//!
//! The service here is a minimal in-process one speaking protocol version 1 on a Unix
//! socket: it records every CSR it receives and either issues a profile-conforming
//! certificate for the CSR's key and identity (signed by its own P-256 CA key) or answers
//! a chosen error. The reference service in `tests/` (seed 002's rules, through the real
//! relay and binary) is the end-to-end check; this one exists so that the state machine's
//! own tests run in the library's test binary, which mutation testing rebuilds for every
//! planted change (`docs/MUTANTS.md`).

use std::os::unix::fs::PermissionsExt;
use std::sync::Mutex;

use base64::Engine;
use tokio::io::AsyncWriteExt;
use x509_parser::prelude::*;

use super::*;
use crate::enroll::ca::tests::TestCa;
use crate::enroll::file_store::FileKeyStore;
use crate::enroll::keystore::{P256Key, RcgenSigner};
use crate::enroll::memory_store::MemoryKeyStore;
use crate::enroll::protocol::{self, ErrorCode, Request, Response};

/// What the service answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    /// A certificate for the CSR's key and identity.
    Issue,
    /// A certificate for the CSR's identity but another key.
    WrongKey,
    /// A certificate for the CSR's key and identity, 6 KiB long (an extra extension).
    IssueLarge,
    /// This final error.
    Deny(ErrorCode),
}

struct Service {
    _dir: tempfile::TempDir,
    endpoint: Endpoint,
    csrs: Arc<Mutex<Vec<Vec<u8>>>>,
    answer: Arc<Mutex<Answer>>,
}

impl Service {
    fn start(ca: Arc<TestCa>) -> Service {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("svc.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let csrs = Arc::new(Mutex::new(Vec::new()));
        let answer = Arc::new(Mutex::new(Answer::Issue));
        let (c, a) = (Arc::clone(&csrs), Arc::clone(&answer));
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let line = protocol::read_line(&mut s, protocol::MAX_LINE)
                    .await
                    .unwrap();
                let req: Request<'_> = serde_json::from_slice(&line).unwrap();
                let csr = base64::engine::general_purpose::STANDARD
                    .decode(req.csr.as_bytes())
                    .unwrap();
                c.lock().unwrap().push(csr.clone());
                let answer = *a.lock().unwrap();
                let resp = match answer {
                    Answer::Deny(code) => Response::error(code, "no"),
                    Answer::Issue | Answer::WrongKey | Answer::IssueLarge => {
                        let other;
                        let (uri, mut key) = csr_contents(&csr);
                        if answer == Answer::WrongKey {
                            other = P256Key::generate("test").unwrap();
                            key = other.public_sec1().to_vec();
                        }
                        let padding = if answer == Answer::IssueLarge {
                            6 * 1024
                        } else {
                            0
                        };
                        Response::ok(&issue(&ca, &uri, key, padding))
                    }
                };
                s.write_all(&resp.to_line()).await.unwrap();
            }
        });
        Service {
            _dir: dir,
            endpoint: Endpoint::Unix(path),
            csrs,
            answer,
        }
    }

    fn answer(&self, a: Answer) {
        *self.answer.lock().unwrap() = a;
    }

    fn csrs(&self) -> Vec<Vec<u8>> {
        self.csrs.lock().unwrap().clone()
    }
}

/// The identity URI and the SEC1 public key a CSR carries.
fn csr_contents(der: &[u8]) -> (String, Vec<u8>) {
    let (_, csr) = X509CertificationRequest::from_der(der).unwrap();
    let info = &csr.certification_request_info;
    let key = info.subject_pki.subject_public_key.data.to_vec();
    let mut uri = None;
    for ext in csr.requested_extensions().into_iter().flatten() {
        if let ParsedExtension::SubjectAlternativeName(san) = ext {
            for n in &san.general_names {
                if let GeneralName::URI(u) = n {
                    uri = Some((*u).to_owned());
                }
            }
        }
    }
    (uri.unwrap(), key)
}

/// The public key of a certificate to issue.
struct Spki(Vec<u8>);

impl rcgen::PublicKeyData for Spki {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }
    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}

/// A workload certificate for `key` and `uri`, issued by `ca`; with `padding`, a private
/// non-critical extension of that many bytes makes it larger.
fn issue(ca: &TestCa, uri: &str, key: Vec<u8>, padding: u16) -> Vec<u8> {
    let mut p = rcgen::CertificateParams::default();
    p.serial_number = Some(vec![7].into());
    p.subject_alt_names = vec![rcgen::SanType::URI(uri.to_owned().try_into().unwrap())];
    let now = SystemTime::now();
    p.not_before = (now - Duration::from_secs(60)).into();
    p.not_after = (now + Duration::from_secs(3600)).into();
    p.is_ca = rcgen::IsCa::ExplicitNoCa;
    p.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    if padding > 0 {
        // An OCTET STRING of `padding` bytes under a private-enterprise OID.
        let [hi, lo] = padding.to_be_bytes();
        let mut content = vec![0x04, 0x82, hi, lo];
        content.resize(4 + usize::from(padding), 0x5a);
        p.custom_extensions
            .push(rcgen::CustomExtension::from_oid_content(
                &[1, 3, 6, 1, 4, 1, 99999, 1],
                content,
            ));
    }
    let issuer = rcgen::Issuer::new(ca.params.clone(), RcgenSigner(&ca.key));
    p.signed_by(&Spki(key), &issuer).unwrap().der().to_vec()
}

/// The management CA every test's service issues from and every material pins.
fn test_ca() -> Arc<TestCa> {
    static CA: std::sync::OnceLock<Arc<TestCa>> = std::sync::OnceLock::new();
    Arc::clone(CA.get_or_init(|| Arc::new(TestCa::new("management CA"))))
}

fn material(epoch: u64) -> Material {
    material_with_token(epoch, &format!("tok_{epoch}_abcdefghijklmnopqrstuvwxyz"))
}

fn material_with_token(epoch: u64, token: &str) -> Material {
    let ca = base64::engine::general_purpose::STANDARD.encode(test_ca().pin.der());
    let doc = serde_json::json!({
        "version": 1,
        "workspace_namespace": "ns",
        "workspace_name": "ws",
        "workspace_uid": "wu",
        "vm_uid": "vm",
        "revocation_epoch": epoch,
        "token": token,
        "expires_at": 4_000_000_000u64,
        "enrollment_port": 5002,
        "management_ca": ca,
    });
    Material::parse(doc.to_string().as_bytes(), "test").unwrap()
}

struct Env {
    _dir: tempfile::TempDir,
    state: PathBuf,
    publish: PathBuf,
    svc: Service,
}

impl Env {
    fn new() -> Env {
        let dir = tempfile::tempdir().unwrap();
        Env {
            state: dir.path().join("state"),
            publish: dir.path().join("publish"),
            _dir: dir,
            svc: Service::start(test_ca()),
        }
    }

    fn enroller<'a>(&self, store: &'a dyn KeyStore, discard_refused: bool) -> Enroller<'a> {
        Enroller {
            state_dir: self.state.clone(),
            publish_dir: self.publish.clone(),
            store,
            service: Some(self.svc.endpoint.clone()),
            timeout: Duration::from_secs(10),
            retry: RetryPolicy {
                initial_ms: 1,
                max_ms: 1,
                max_attempts: 1,
            },
            discard_refused,
        }
    }

    async fn run(&self, store: &dyn KeyStore, epoch: Option<u64>) -> Result<Outcome, EnrollError> {
        self.enroller(store, false).run(epoch.map(material)).await
    }

    async fn run_token(&self, store: &dyn KeyStore, token: &str) -> Result<Outcome, EnrollError> {
        let m = material_with_token(2, token);
        self.enroller(store, false).run(Some(m)).await
    }

    /// The floor as the file on disk says.
    fn floor(&self) -> Option<u64> {
        let bytes = std::fs::read(self.state.join(FLOOR)).ok()?;
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        v["epoch"].as_u64()
    }

    fn exists(&self, name: &str) -> bool {
        self.state.join(name).exists()
    }
}

fn slot(o: &Outcome) -> &str {
    match o {
        Outcome::Enrolled { slot, .. } | Outcome::AlreadyEnrolled { slot, .. } => slot,
    }
}

#[tokio::test]
async fn the_floor_survives_a_restart_of_the_memory_store() {
    let env = Env::new();
    let before = MemoryKeyStore::new().unwrap();
    let first = env.run(&before, Some(5)).await.unwrap();
    assert!(matches!(first, Outcome::Enrolled { .. }), "{first:?}");
    assert_eq!(env.floor(), Some(5));
    drop(before);

    // A restart: the memory store has lost the key.
    let after = MemoryKeyStore::new().unwrap();
    let e = env.run(&after, Some(4)).await.unwrap_err();
    assert!(
        matches!(
            e,
            EnrollError::EpochRollback {
                offered: 4,
                floor: 5
            }
        ),
        "{e}"
    );
    let msg = e.to_string();
    assert!(msg.contains("epoch 4") && msg.contains("epoch 5"), "{msg}");
    assert_eq!(
        env.svc.csrs().len(),
        1,
        "material below the floor reached the service"
    );
    assert_eq!(env.floor(), Some(5));

    // The same epoch again is not a rollback: the VM re-enrolls with a new key.
    let again = env.run(&after, Some(5)).await.unwrap();
    assert!(matches!(again, Outcome::Enrolled { .. }), "{again:?}");
    assert_ne!(slot(&again), slot(&first));
    assert_eq!(env.svc.csrs().len(), 2);
    assert_eq!(after.slots().unwrap(), vec![slot(&again).to_owned()]);
}

#[tokio::test]
async fn a_second_run_sends_nothing_and_a_raised_epoch_retires_the_old_key() {
    let env = Env::new();
    let store = FileKeyStore::open_dir(&env.state).unwrap();
    let first = env.run(&store, Some(3)).await.unwrap();
    let s1 = slot(&first).to_owned();
    assert!(!env.exists(PENDING), "pending.json outlived the enrollment");
    let cert = std::fs::metadata(env.publish.join(PUBLISHED_CERT)).unwrap();
    assert_eq!(cert.permissions().mode() & 0o777, 0o644);
    let pem = std::fs::read_to_string(env.publish.join(PUBLISHED_CERT)).unwrap();
    assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"), "{pem}");
    for f in [ENROLLED, FLOOR, &format!("{s1}.crt"), &format!("{s1}.csr")] {
        let m = std::fs::metadata(env.state.join(f)).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o600, "{f}");
    }

    // Same material, and no material: nothing is sent, the same key stays.
    std::fs::remove_file(env.publish.join(PUBLISHED_CERT)).unwrap();
    for epoch in [Some(3), None] {
        let again = env.run(&store, epoch).await.unwrap();
        assert!(
            matches!(again, Outcome::AlreadyEnrolled { .. }),
            "{again:?}"
        );
        assert_eq!(slot(&again), s1);
        assert_eq!(
            std::fs::read_to_string(env.publish.join(PUBLISHED_CERT)).unwrap(),
            pem
        );
    }
    assert_eq!(env.svc.csrs().len(), 1);

    // A raised epoch: a new key; the old key, CSR and certificate are gone.
    let raised = env.run(&store, Some(4)).await.unwrap();
    let s2 = slot(&raised).to_owned();
    assert!(matches!(raised, Outcome::Enrolled { .. }), "{raised:?}");
    assert_ne!(s2, s1);
    assert_eq!(store.slots().unwrap(), vec![s2.clone()]);
    for ext in ["csr", "crt"] {
        assert!(!env.exists(&format!("{s1}.{ext}")), "{s1}.{ext} kept");
        assert!(env.exists(&format!("{s2}.{ext}")), "{s2}.{ext} missing");
    }
    assert_eq!(env.floor(), Some(4));
    let e = env.run(&store, Some(3)).await.unwrap_err();
    assert!(
        matches!(
            e,
            EnrollError::EpochRollback {
                offered: 3,
                floor: 4
            }
        ),
        "{e}"
    );
}

#[tokio::test]
async fn a_kept_refusal_resends_the_same_csr_and_a_refused_push_is_forgotten() {
    let env = Env::new();
    let store = FileKeyStore::open_dir(&env.state).unwrap();
    env.svc.answer(Answer::Deny(ErrorCode::Expired));
    for _ in 0..2 {
        let e = env.run(&store, Some(2)).await.unwrap_err();
        assert!(
            matches!(
                e,
                EnrollError::Denied {
                    code: ErrorCode::Expired,
                    ..
                }
            ),
            "{e}"
        );
        assert!(env.exists(PENDING));
    }
    let csrs = env.svc.csrs();
    assert_eq!(csrs.len(), 2);
    assert_eq!(csrs[0], csrs[1], "a retry sent a different CSR");
    assert_eq!(
        store.slots().unwrap().len(),
        1,
        "a second key for one token"
    );

    // Pushed material for a new identity: it supersedes the unconfirmed pending record
    // (whose key goes), and its refusal discards the CSR and key this run made.
    let e = env
        .enroller(&store, true)
        .run(Some(material(3)))
        .await
        .unwrap_err();
    assert!(matches!(e, EnrollError::Denied { .. }), "{e}");
    assert_eq!(env.svc.csrs().len(), 3);
    assert!(
        !env.exists(PENDING),
        "the refused push's pending record was kept"
    );
    assert!(
        store.slots().unwrap().is_empty(),
        "the refused push's key was kept"
    );
    assert_eq!(env.floor(), None, "a refusal raised the floor");
}

#[tokio::test]
async fn an_unconfirmed_epoch_is_no_floor() {
    let env = Env::new();
    let store = FileKeyStore::open_dir(&env.state).unwrap();
    env.svc.answer(Answer::Deny(ErrorCode::Denied));
    env.run(&store, Some(9)).await.unwrap_err();
    assert_eq!(env.floor(), None);
    // Lower material supersedes the unconfirmed pending one, whose key goes.
    let pending_slot = store.slots().unwrap();
    env.svc.answer(Answer::Issue);
    let o = env.run(&store, Some(2)).await.unwrap();
    assert!(matches!(o, Outcome::Enrolled { .. }), "{o:?}");
    assert_eq!(env.floor(), Some(2));
    assert_eq!(store.slots().unwrap(), vec![slot(&o).to_owned()]);
    assert_ne!(store.slots().unwrap(), pending_slot);
}

#[tokio::test]
async fn a_certificate_for_another_key_is_not_stored_published_or_a_floor() {
    let env = Env::new();
    let store = FileKeyStore::open_dir(&env.state).unwrap();
    env.svc.answer(Answer::WrongKey);
    let e = env.run(&store, Some(6)).await.unwrap_err();
    assert!(matches!(e, EnrollError::BadCertificate(_)), "{e}");
    assert!(e.to_string().contains("another public key"), "{e}");
    assert_eq!(env.floor(), None);
    assert!(!env.exists(ENROLLED));
    assert!(!env.publish.join(PUBLISHED_CERT).exists());
    // Nothing enrolled and no material: there is nothing to republish.
    let e = env.run(&store, None).await.unwrap_err();
    assert!(matches!(e, EnrollError::NoMaterial), "{e}");
}

#[tokio::test]
async fn a_new_token_for_the_pending_identity_is_remembered() {
    let env = Env::new();
    let (a, b, c) = (
        "tok_a_abcdefghijklmnopqrstuvwxyz",
        "tok_b_abcdefghijklmnopqrstuvwxyz",
        "tok_c_abcdefghijklmnopqrstuvwxyz",
    );
    let mem = MemoryKeyStore::new().unwrap();
    env.svc.answer(Answer::Deny(ErrorCode::Unavailable));
    env.run_token(&mem, a).await.unwrap_err();
    // New material for the same identity: the same key and CSR, under the new token.
    env.run_token(&mem, b).await.unwrap_err();
    let csrs = env.svc.csrs();
    assert_eq!(csrs[0], csrs[1]);
    // After a restart the key is gone. The CSR was last sent under token b: a new CSR
    // for b would be denied, so that is final; token c is a fresh start.
    drop(mem);
    let mem = MemoryKeyStore::new().unwrap();
    let e = env.run_token(&mem, b).await.unwrap_err();
    assert!(matches!(e, EnrollError::KeyLost), "{e}");
    assert_eq!(env.svc.csrs().len(), 2, "a second CSR was sent for token b");
    env.run_token(&mem, c).await.unwrap_err();
    let csrs = env.svc.csrs();
    assert_eq!(csrs.len(), 3);
    assert_ne!(csrs[2], csrs[0], "token c must come with a new key");
}

#[tokio::test]
async fn refusals_never_cost_the_enrolled_key() {
    let env = Env::new();
    let store = FileKeyStore::open_dir(&env.state).unwrap();
    let enrolled = env.run(&store, Some(3)).await.unwrap();
    let s1 = slot(&enrolled).to_owned();
    // A crash between writing enrolled.json and removing pending.json leaves a pending
    // record naming the enrolled key.
    let m = material(3);
    let pending = PendingRecord {
        identity: m.identity(),
        slot: s1.clone(),
        token_sha256: m.token.sha256_hex(),
    };
    env.enroller(&store, false)
        .write_record(PENDING, &pending)
        .unwrap();

    env.svc.answer(Answer::Deny(ErrorCode::Denied));
    // Material for epoch 9 supersedes that record (keeping the enrolled key), then is
    // refused; its pending record and key stay, for a later run.
    env.run(&store, Some(9)).await.unwrap_err();
    assert!(store.open(&s1).unwrap().is_some(), "the enrolled key went");
    let slots = store.slots().unwrap();
    assert_eq!(slots.len(), 2);
    // Epoch 10 supersedes epoch 9's pending record, whose key goes at once (the run
    // fails, so no garbage collection does it).
    env.run(&store, Some(10)).await.unwrap_err();
    let now = store.slots().unwrap();
    assert_eq!(now.len(), 2, "{now:?}");
    assert!(now.contains(&s1));
    // A pushed, refused epoch 11: its own key goes, the enrolled one stays.
    env.enroller(&store, true)
        .run(Some(material(11)))
        .await
        .unwrap_err();
    assert_eq!(store.slots().unwrap(), vec![s1.clone()]);
    assert!(!env.exists(PENDING));
    assert_eq!(env.floor(), Some(3));
    // And the enrolled certificate is still served.
    let o = env.run(&store, None).await.unwrap();
    assert_eq!(
        o,
        Outcome::AlreadyEnrolled {
            uri: m.identity().uri(),
            slot: s1
        }
    );
}

#[tokio::test]
async fn the_lock_is_never_taken_through_a_symlink() {
    let env = Env::new();
    let store = FileKeyStore::open_dir(&env.state).unwrap();
    let elsewhere = env.state.with_extension("elsewhere");
    std::os::unix::fs::symlink(&elsewhere, env.state.join("lock")).unwrap();
    let e = env.run(&store, Some(1)).await.unwrap_err();
    assert!(matches!(e, EnrollError::State { .. }), "{e}");
    assert!(e.to_string().contains("lock"), "{e}");
    assert!(!elsewhere.exists(), "the symlink was followed");
    assert!(env.svc.csrs().is_empty());
}

#[tokio::test]
async fn a_large_certificate_is_stored_and_read_back() {
    let env = Env::new();
    let store = FileKeyStore::open_dir(&env.state).unwrap();
    env.svc.answer(Answer::IssueLarge);
    let first = env.run(&store, Some(1)).await.unwrap();
    let crt = std::fs::metadata(env.state.join(format!("{}.crt", slot(&first)))).unwrap();
    assert!(crt.len() > 6 * 1024, "{} bytes", crt.len());
    let again = env.run(&store, Some(1)).await.unwrap();
    assert!(
        matches!(again, Outcome::AlreadyEnrolled { .. }),
        "{again:?}"
    );
    assert_eq!(env.svc.csrs().len(), 1);
}

#[tokio::test]
async fn a_damaged_certificate_is_fetched_again_with_the_same_key_which_stays() {
    let env = Env::new();
    let store = FileKeyStore::open_dir(&env.state).unwrap();
    let first = env.run(&store, Some(3)).await.unwrap();
    let s1 = slot(&first).to_owned();
    std::fs::write(env.state.join(format!("{s1}.crt")), b"damaged").unwrap();
    let again = env.run(&store, Some(3)).await.unwrap();
    assert_eq!(
        again,
        Outcome::Enrolled {
            uri: material(3).identity().uri(),
            slot: s1.clone()
        }
    );
    let csrs = env.svc.csrs();
    assert_eq!(csrs.len(), 2);
    assert_eq!(csrs[0], csrs[1], "not the stored CSR");
    assert_eq!(
        store.slots().unwrap(),
        vec![s1.clone()],
        "the enrolled key went"
    );
    let third = env.run(&store, None).await.unwrap();
    assert!(
        matches!(third, Outcome::AlreadyEnrolled { .. }),
        "{third:?}"
    );
}
