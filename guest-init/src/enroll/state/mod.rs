//! The enrollment state machine and its durable records.
//!
//! State directory layout (`state_dir`, `0700`, root):
//!
//! | file | what |
//! |---|---|
//! | `lock` | `flock`ed for the whole run: two enrollments in one guest serialize |
//! | `<slot>.key` | the private key (file store only; PKCS#8 DER, `0600`) |
//! | `<slot>.csr` | the exact CSR DER sent for that key |
//! | `<slot>.crt` | the certificate DER issued for that key |
//! | `<slot>.ca` | the pinned management CA (DER) that certificate was verified against |
//! | `pending.json` | `{identity, slot, token_sha256}`: a CSR is out, no certificate yet (unconfirmed) |
//! | `enrolled.json` | `{identity, slot}`: the certificate in force |
//! | `floor.json` | `{epoch}`: the highest epoch the service confirmed; only rises, never removed |
//!
//! A run, under the lock:
//! 0. **Carry.** An enrolled record's epoch is carried into the floor; then an enrolled
//!    record whose key the store no longer holds (memory store after a restart) is voided.
//!    The floor stays: it is not the enrolled record and is never removed with a key.
//! 1. **Floor.** Material whose epoch is lower than the floor is refused, naming both
//!    epochs. Only a confirmed epoch (a certificate received and verified) is a floor; a
//!    pending record never is, because whoever can push material can make one.
//! 2. **Already done.** If the enrolled identity equals the material's and its certificate
//!    verifies (against the material's CA), republish it and stop. If it fails verification (or is missing), re-send
//!    the *stored* CSR with the *stored* key; never a new key. Any other failure (key store,
//!    publish directory, I/O) fails the run and changes nothing.
//! 3. **Pending.** If a pending CSR exists for the same identity, re-send *its* bytes with
//!    *its* key (across crashes and reboots). If its key is gone (memory store after a
//!    restart) and the token is the same, fail finally: a new CSR for that token would be
//!    denied, and making a new key for the same token is what we never do. A pending CSR
//!    for another identity — any epoch, higher ones included — is unconfirmed: it is
//!    discarded with its key.
//! 4. **New.** Otherwise generate a key in the key store, build the CSR, and persist the
//!    key, then `<slot>.csr`, then `pending.json` (the commit point) — all before the first
//!    byte is sent.
//! 5. **Exchange** (retryable errors retried; a final error leaves the pending state in
//!    place, so a later run re-sends the same CSR and never makes a second key for the
//!    same token). With pushed material ([`Enroller::discard_refused`]) a final refusal
//!    or a bad certificate discards the key and CSR this run made (a resumed pending
//!    record is put back as it was), so the guest can wait for the next push.
//! 6. **Verify** the certificate (issuer = the material's pinned CA, key, validity,
//!    identity, profile), raise `floor.json` (durable before anything depends on it), write
//!    `<slot>.crt` and `<slot>.ca`, then `enrolled.json`
//!    (the commit point), publish `cert.pem`, remove `pending.json`, and only then remove
//!    the previous identity's key, CSR and certificate.
//! 7. **Collect** any slot file no record refers to (left by a crash between steps); if a
//!    record, the store or the directory cannot be read, nothing is removed.
//!
//! A run without material (a reboot with the bootstrap file gone) re-verifies the enrolled
//! certificate against the CA recorded in `<slot>.ca`, which was itself written only after
//! it verified that certificate under the material's pin; a state without it (written by an
//! older guest-init) is refused until material is provisioned again.
//!
//! Every write is atomic and durable ([`super::files`]); a crash at any point leaves a
//! state from which the next run continues without a second CSR for the same token.
//!
//! Threat: replaying an old identity (epoch rollback, also after the memory store lost its
//! key), a rogue pusher raising the floor to deny the VM its identity (only the service's
//! confirmation raises it), a second CSR for one token (the service would deny it and the
//! VM would be stuck), the old key being used for a new identity, a transient error
//! deleting the live key, and concurrent enrollments racing to make two keys.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

use super::client::{self, ExchangeError, RetryPolicy};
use super::identity::Identity;
use super::keystore::{is_slot, KeyStore, MachineKey};
use super::material::{hex, Material};
use super::{files, verify, EnrollError};
use vm_transport::vsock::VMADDR_CID_HOST;
use vm_transport::Endpoint;

mod renewed;
#[cfg(test)]
mod scenarios;
mod store;
use store::{EnrolledRecord, PendingRecord};

const PENDING: &str = "pending.json";
const ENROLLED: &str = "enrolled.json";
const FLOOR: &str = "floor.json";
const MAX_RECORD: usize = 4096;
const MAX_DER: usize = 16 * 1024;

/// The name of the published certificate inside `publish_dir`.
pub const PUBLISHED_CERT: &str = "cert.pem";

/// What a successful run did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A certificate was obtained in this run.
    Enrolled {
        /// The identity URI.
        uri: String,
        /// The key's slot.
        slot: String,
    },
    /// The VM already held a valid certificate for this identity.
    AlreadyEnrolled {
        /// The identity URI.
        uri: String,
        /// The key's slot.
        slot: String,
    },
}

/// A key and the exact CSR bytes to send for it.
struct Prepared {
    slot: String,
    key: Arc<dyn MachineKey>,
    csr: Vec<u8>,
}

/// Everything one run needs besides the material.
pub struct Enroller<'a> {
    /// The state directory.
    pub state_dir: PathBuf,
    /// Where `cert.pem` is published.
    pub publish_dir: PathBuf,
    /// The key store.
    pub store: &'a dyn KeyStore,
    /// Overrides the service endpoint (tests); otherwise vsock CID 2 and the material's port.
    pub service: Option<Endpoint>,
    /// Per-attempt deadline.
    pub timeout: Duration,
    /// Retry policy.
    pub retry: RetryPolicy,
    /// The material was pushed (anyone on the host may push): a final refusal of it, or a
    /// certificate that fails verification, discards its pending CSR and key, so the
    /// guest can wait for another push instead of keeping a rogue document's state.
    pub discard_refused: bool,
}

fn state_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> EnrollError {
    let what = what.into();
    move |source| EnrollError::State { what, source }
}

impl Enroller<'_> {
    /// Runs enrollment for `material` (or, with `None`, checks that a valid enrolled
    /// certificate exists and republishes it).
    pub async fn run(&self, material: Option<Material>) -> Result<Outcome, EnrollError> {
        files::ensure_dir(&self.state_dir, 0o700)
            .map_err(state_err(format!("prepare {}", self.state_dir.display())))?;
        let _lock = self.lock().await?;
        let result = self.run_locked(material).await;
        if result.is_ok() {
            self.collect_garbage();
        }
        result
    }

    async fn lock(&self) -> Result<nix::fcntl::Flock<std::fs::File>, EnrollError> {
        let path = self.state_dir.join("lock");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(state_err(format!("open {}", path.display())))?;
        tokio::task::spawn_blocking(move || {
            nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
                .map_err(|(_, e)| std::io::Error::from(e))
        })
        .await
        .map_err(|e| EnrollError::State {
            what: "wait for the enrollment lock".into(),
            source: std::io::Error::other(e.to_string()),
        })?
        .map_err(state_err("lock the enrollment state"))
    }

    async fn run_locked(&self, material: Option<Material>) -> Result<Outcome, EnrollError> {
        let mut floor = self.floor()?;
        let mut enrolled: Option<EnrolledRecord> = self.read_record(ENROLLED)?;
        let pending: Option<PendingRecord> = self.read_record(PENDING)?;

        // An enrolled record is a confirmed epoch: carry it into the floor first (state
        // written before the floor record existed), so voiding the record below cannot
        // lower it.
        if let Some(e) = &enrolled {
            self.raise_floor(floor, e.identity.epoch)?;
            floor = Some(floor.map_or(e.identity.epoch, |f| f.max(e.identity.epoch)));
        }

        // An enrolled record whose key the store no longer has (memory store after a
        // restart) is void: the VM re-enrolls. The floor stays.
        if let Some(e) = &enrolled {
            if !is_slot(&e.slot) || self.store.open(&e.slot)?.is_none() {
                crate::info!(
                    "enroll: the {} key store no longer holds the enrolled key; re-enrolling",
                    self.store.kind()
                );
                let slot = e.slot.clone();
                files::remove_durable(&self.state_dir, ENROLLED)
                    .map_err(state_err("remove enrolled.json"))?;
                if is_slot(&slot) {
                    self.remove_slot(&slot)?;
                }
                enrolled = None;
            }
        }

        let Some(material) = material else {
            return match &enrolled {
                Some(e) => self.republish(e).await,
                None => Err(EnrollError::NoMaterial),
            };
        };
        let id = material.identity();
        let uri = id.uri();

        // 1. The epoch floor: only epochs the service confirmed. A pending record is not
        //    a floor (anyone who can push material could set it).
        if let Some(f) = floor.filter(|f| id.epoch < *f) {
            return Err(EnrollError::EpochRollback {
                offered: id.epoch,
                floor: f,
            });
        }

        // 2. Already enrolled for this identity. Only a certificate that fails
        //    verification (or is missing) leads back to the service, and then with the
        //    stored key and CSR: never a second CSR for a token. Any other failure (the
        //    key store, the publish directory) is an error of this run.
        let mut reuse: Option<Prepared> = None;
        if let Some(e) = enrolled.as_ref().filter(|e| e.identity == id) {
            let key = self.store.open(&e.slot)?.ok_or(EnrollError::KeyLost)?;
            let check = match self.read_slot_file(&e.slot, "crt")? {
                Some(c) => verify::verify(
                    &c,
                    &material.management_ca,
                    key.public_sec1(),
                    &e.identity,
                    SystemTime::now(),
                )
                .map(|()| c),
                None => Err("the enrolled certificate file is missing".to_owned()),
            };
            match check {
                Ok(cert) => {
                    self.record_ca(&e.slot, &material.management_ca)?;
                    self.publish(&cert)?;
                    if pending.is_some() {
                        files::remove_durable(&self.state_dir, PENDING)
                            .map_err(state_err("remove pending.json"))?;
                    }
                    crate::info!("enroll: already enrolled as {uri}");
                    return Ok(Outcome::AlreadyEnrolled {
                        uri,
                        slot: e.slot.clone(),
                    });
                }
                Err(why) => {
                    let csr = self.read_slot_file(&e.slot, "csr")?.ok_or_else(|| {
                        EnrollError::BadCertificate(format!(
                            "{why}; and the enrolled CSR {}.csr is missing, so it cannot be re-sent",
                            e.slot
                        ))
                    })?;
                    crate::info!(
                        "enroll: the enrolled certificate is unusable ({why}); re-sending the stored CSR of key {}",
                        e.slot
                    );
                    reuse = Some(Prepared {
                        slot: e.slot.clone(),
                        key,
                        csr,
                    });
                }
            }
        }

        // 3./4. The key and the exact CSR bytes to send.
        let token_hash = material.token.sha256_hex();
        // What a refused push undoes: a key and CSR made in this run are discarded; a
        // resumed pending record (its CSR may be committed under another token) is kept
        // as it was.
        let mut made_here = false;
        let mut resumed: Option<PendingRecord> = None;
        let Prepared { slot, key, csr } = match (reuse, pending) {
            (Some(prepared), _) => prepared,
            (None, Some(p)) if p.identity == id => match self.resume(&p)? {
                Some(prepared) => {
                    crate::info!(
                        "enroll: resuming the pending enrollment of {uri} (same key, same CSR)"
                    );
                    resumed = Some(p.clone());
                    if p.token_sha256 != token_hash {
                        self.write_record(
                            PENDING,
                            &PendingRecord {
                                token_sha256: token_hash.clone(),
                                ..p.clone()
                            },
                        )?;
                    }
                    prepared
                }
                None if p.token_sha256 == token_hash => return Err(EnrollError::KeyLost),
                None => {
                    self.discard_pending(&p, enrolled.as_ref())?;
                    made_here = true;
                    self.start(&id, &token_hash)?
                }
            },
            (None, Some(p)) => {
                // Unconfirmed: whatever its epoch, material at or above the confirmed
                // floor replaces it.
                crate::info!(
                    "enroll: new identity {uri} supersedes the unconfirmed pending {}; discarding its key",
                    p.identity.uri()
                );
                self.discard_pending(&p, enrolled.as_ref())?;
                made_here = true;
                self.start(&id, &token_hash)?
            }
            (None, None) => {
                made_here = true;
                self.start(&id, &token_hash)?
            }
        };

        // 5. The exchange.
        let service = self.service.clone().unwrap_or(Endpoint::Vsock {
            cid: VMADDR_CID_HOST,
            port: material.enrollment_port,
        });
        crate::info!(
            "enroll: requesting a certificate for {uri} from {service} (csr sha256 {})",
            hex(&Sha256::digest(&csr))
        );
        let exchanged =
            client::exchange(&service, &material.token, &csr, self.timeout, &self.retry)
                .await
                .map_err(|e| match e {
                    ExchangeError::Final { code, message } => EnrollError::Denied { code, message },
                    ExchangeError::Exhausted { attempts, last } => {
                        EnrollError::Unavailable { attempts, last }
                    }
                })
                .and_then(|cert| {
                    verify::verify(
                        &cert,
                        &material.management_ca,
                        key.public_sec1(),
                        &id,
                        SystemTime::now(),
                    )
                    .map(|()| cert)
                    .map_err(EnrollError::BadCertificate)
                });
        let ca = material.management_ca.clone();
        let enrollment_port = material.enrollment_port;
        drop(material);
        let cert = match exchanged {
            Ok(cert) => cert,
            Err(e) => {
                if self.discard_refused
                    && matches!(
                        e,
                        EnrollError::Denied { .. } | EnrollError::BadCertificate(_)
                    )
                {
                    if made_here {
                        self.abandon(&slot, enrolled.as_ref())?;
                    } else if let Some(p) = resumed {
                        self.write_record(PENDING, &p)?;
                    }
                }
                return Err(e);
            }
        };

        // 6. The service confirmed the epoch: raise the floor before anything depends on
        //    it, then store, publish, retire the old identity.
        self.raise_floor(floor, id.epoch)?;
        files::write_atomic(&self.state_dir, &format!("{slot}.crt"), &cert, 0o600)
            .map_err(state_err(format!("write {slot}.crt")))?;
        self.record_ca(&slot, &ca)?;
        self.write_record(
            ENROLLED,
            &EnrolledRecord {
                identity: id.clone(),
                slot: slot.clone(),
                enrollment_port: Some(enrollment_port),
            },
        )?;
        self.publish(&cert)?;
        files::remove_durable(&self.state_dir, PENDING)
            .map_err(state_err("remove pending.json"))?;
        if let Some(old) = enrolled.filter(|e| e.slot != slot) {
            self.remove_slot(&old.slot)?;
            crate::info!(
                "enroll: removed the key of the previous identity {}",
                old.identity.uri()
            );
        }
        crate::info!(
            "enroll: enrolled {uri} (certificate sha256 {}, key store {}), published at {}",
            hex(&Sha256::digest(&cert)),
            self.store.kind(),
            self.publish_dir.join(PUBLISHED_CERT).display()
        );
        Ok(Outcome::Enrolled { uri, slot })
    }

    /// Forgets refused material: its pending record, and its key unless it is the
    /// enrolled one.
    fn abandon(&self, slot: &str, enrolled: Option<&EnrolledRecord>) -> Result<(), EnrollError> {
        crate::info!("enroll: discarding the refused material's pending CSR and key {slot}");
        files::remove_durable(&self.state_dir, PENDING)
            .map_err(state_err("remove pending.json"))?;
        if enrolled.is_none_or(|e| e.slot != slot) {
            self.remove_slot(slot)?;
        }
        Ok(())
    }

    /// Opens a pending slot's key and CSR; `None` when the key is gone.
    fn resume(&self, p: &PendingRecord) -> Result<Option<Prepared>, EnrollError> {
        if !is_slot(&p.slot) {
            return Ok(None);
        }
        let Some(key) = self.store.open(&p.slot)? else {
            return Ok(None);
        };
        let Some(csr) = self.read_slot_file(&p.slot, "csr")? else {
            return Ok(None);
        };
        Ok(Some(Prepared {
            slot: p.slot.clone(),
            key,
            csr,
        }))
    }

    fn discard_pending(
        &self,
        p: &PendingRecord,
        enrolled: Option<&EnrolledRecord>,
    ) -> Result<(), EnrollError> {
        files::remove_durable(&self.state_dir, PENDING)
            .map_err(state_err("remove pending.json"))?;
        if is_slot(&p.slot) && enrolled.is_none_or(|e| e.slot != p.slot) {
            self.remove_slot(&p.slot)?;
        }
        Ok(())
    }

    /// Step 4: a new key and CSR, persisted before anything is sent.
    fn start(&self, id: &Identity, token_hash: &str) -> Result<Prepared, EnrollError> {
        let (slot, key) = self.store.generate()?;
        let csr =
            super::csr::build(key.as_ref(), id).map_err(|e| EnrollError::Csr(e.to_string()))?;
        files::write_atomic(&self.state_dir, &format!("{slot}.csr"), &csr, 0o600)
            .map_err(state_err(format!("write {slot}.csr")))?;
        self.write_record(
            PENDING,
            &PendingRecord {
                identity: id.clone(),
                slot: slot.clone(),
                token_sha256: token_hash.to_owned(),
            },
        )?;
        crate::info!(
            "enroll: new {} key {slot} and CSR for {} persisted",
            self.store.kind(),
            id.uri()
        );
        Ok(Prepared { slot, key, csr })
    }

    async fn republish(&self, e: &EnrolledRecord) -> Result<Outcome, EnrollError> {
        let cert = self.read_slot_file(&e.slot, "crt")?.ok_or_else(|| {
            EnrollError::BadCertificate("the enrolled certificate file is missing".into())
        })?;
        let key = self.store.open(&e.slot)?.ok_or(EnrollError::KeyLost)?;
        let ca = self.recorded_ca(&e.slot)?;
        verify::verify(
            &cert,
            &ca,
            key.public_sec1(),
            &e.identity,
            SystemTime::now(),
        )
        .map_err(EnrollError::BadCertificate)?;
        self.publish(&cert)?;
        crate::info!("enroll: already enrolled as {}", e.identity.uri());
        Ok(Outcome::AlreadyEnrolled {
            uri: e.identity.uri(),
            slot: e.slot.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::enroll::file_store::FileKeyStore;
    use std::os::unix::fs::PermissionsExt;

    fn enroller<'a>(dir: &std::path::Path, store: &'a dyn KeyStore) -> Enroller<'a> {
        Enroller {
            state_dir: dir.to_path_buf(),
            publish_dir: dir.with_extension("publish"),
            store,
            service: None,
            timeout: Duration::from_secs(1),
            retry: RetryPolicy::default(),
            discard_refused: false,
        }
    }

    fn id() -> Identity {
        Identity {
            workspace_namespace: "ns".into(),
            workspace_name: "ws".into(),
            workspace_uid: "wu".into(),
            vm_uid: "vm".into(),
            epoch: 3,
        }
    }

    #[test]
    fn a_record_that_cannot_be_read_makes_garbage_collection_keep_everything() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("state");
        let store = FileKeyStore::open_dir(&dir).unwrap();
        let e = enroller(&dir, &store);
        let (live, _) = store.generate().unwrap();
        let (leftover, _) = store.generate().unwrap();
        e.write_record(
            ENROLLED,
            &EnrolledRecord {
                identity: id(),
                slot: live.clone(),
                enrollment_port: None,
            },
        )
        .unwrap();

        // A CSR whose key is already gone (a crash between the two removals), and a file
        // that is not a slot's.
        let orphan = "0123456789abcdef.csr";
        std::fs::write(dir.join(orphan), b"csr").unwrap();
        std::fs::write(dir.join("notaslot.csr"), b"mine").unwrap();

        // Readable records: only the leftovers go.
        e.collect_garbage();
        assert!(store.open(&live).unwrap().is_some());
        assert!(store.open(&leftover).unwrap().is_none());
        assert!(!dir.join(orphan).exists(), "an orphaned CSR was kept");
        assert!(
            dir.join("notaslot.csr").exists(),
            "a file that is no slot's was removed"
        );

        // The enrolled record cannot be read (here: its mode was loosened, which the
        // private read refuses): doubt, so nothing is removed, the live key least of all.
        let (leftover, _) = store.generate().unwrap();
        let rec = dir.join(ENROLLED);
        std::fs::set_permissions(&rec, std::fs::Permissions::from_mode(0o644)).unwrap();
        e.collect_garbage();
        assert!(
            store.open(&live).unwrap().is_some(),
            "the live key was deleted on a failed read"
        );
        assert!(store.open(&leftover).unwrap().is_some());
    }

    #[test]
    fn the_floor_only_rises() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("state");
        let store = FileKeyStore::open_dir(&dir).unwrap();
        let e = enroller(&dir, &store);
        assert_eq!(e.floor().unwrap(), None);
        e.raise_floor(None, 5).unwrap();
        assert_eq!(e.floor().unwrap(), Some(5));
        e.raise_floor(Some(5), 4).unwrap();
        assert_eq!(e.floor().unwrap(), Some(5));
        e.raise_floor(Some(5), u64::MAX).unwrap();
        assert_eq!(e.floor().unwrap(), Some(u64::MAX));
    }
}
