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
//! | `pending.json` | `{identity, slot, token_sha256}`: a CSR is out, no certificate yet |
//! | `enrolled.json` | `{identity, slot}`: the certificate in force |
//!
//! A run, under the lock:
//! 1. **Floor.** Material whose epoch is lower than the enrolled one, or than a pending
//!    one, is refused: epochs only go up.
//! 2. **Already done.** If the enrolled identity equals the material's and its certificate
//!    is still valid, republish it and stop.
//! 3. **Pending.** If a pending CSR exists for the same identity, re-send *its* bytes with
//!    *its* key (across crashes and reboots). If its key is gone (memory store after a
//!    restart) and the token is the same, fail finally: a new CSR for that token would be
//!    denied, and making a new key for the same token is what we never do. A pending CSR
//!    for another identity is discarded with its key.
//! 4. **New.** Otherwise generate a key in the key store, build the CSR, and persist the
//!    key, then `<slot>.csr`, then `pending.json` (the commit point) — all before the first
//!    byte is sent.
//! 5. **Exchange** (retryable errors retried; a final error leaves the pending state in
//!    place, so a later run re-sends the same CSR and never makes a second key for the
//!    same token).
//! 6. **Verify** the certificate (key, validity, identity), write `<slot>.crt`, then
//!    `enrolled.json` (the commit point), publish `cert.pem`, remove `pending.json`, and
//!    only then remove the previous identity's key, CSR and certificate.
//! 7. **Collect** any slot file no record refers to (left by a crash between steps).
//!
//! Every write is atomic and durable ([`super::files`]); a crash at any point leaves a
//! state from which the next run continues without a second CSR for the same token.
//!
//! Threat: replaying an old identity (epoch rollback), a second CSR for one token (the
//! service would deny it and the VM would be stuck), the old key being used for a new
//! identity, and concurrent enrollments racing to make two keys.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::client::{self, ExchangeError, RetryPolicy};
use super::identity::Identity;
use super::keystore::{is_slot, KeyStore, MachineKey};
use super::material::{hex, Material};
use super::{files, verify, EnrollError};
use vm_transport::vsock::VMADDR_CID_HOST;
use vm_transport::Endpoint;

const PENDING: &str = "pending.json";
const ENROLLED: &str = "enrolled.json";
const MAX_RECORD: usize = 4096;
const MAX_DER: usize = 16 * 1024;

/// The name of the published certificate inside `publish_dir`.
pub const PUBLISHED_CERT: &str = "cert.pem";

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PendingRecord {
    identity: Identity,
    slot: String,
    token_sha256: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct EnrolledRecord {
    identity: Identity,
    slot: String,
}

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

    fn read_record<T: for<'de> Deserialize<'de>>(
        &self,
        name: &str,
    ) -> Result<Option<T>, EnrollError> {
        let path = self.state_dir.join(name);
        let Some(bytes) = files::read_bounded(&path, MAX_RECORD, true)
            .map_err(state_err(format!("read {}", path.display())))?
        else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| EnrollError::State {
                what: format!(
                    "{} is damaged; remove the state directory to re-enroll",
                    path.display()
                ),
                source: std::io::Error::other(e.to_string()),
            })
    }

    fn write_record<T: Serialize>(&self, name: &str, rec: &T) -> Result<(), EnrollError> {
        let bytes = serde_json::to_vec(rec).unwrap_or_default();
        files::write_atomic(&self.state_dir, name, &bytes, 0o600)
            .map_err(state_err(format!("write {name}")))
    }

    fn read_slot_file(&self, slot: &str, ext: &str) -> Result<Option<Vec<u8>>, EnrollError> {
        let path = self.state_dir.join(format!("{slot}.{ext}"));
        Ok(files::read_bounded(&path, MAX_DER, true)
            .map_err(state_err(format!("read {}", path.display())))?
            .map(|b| b.to_vec()))
    }

    fn remove_slot(&self, slot: &str) -> Result<(), EnrollError> {
        self.store.remove(slot)?;
        for ext in ["csr", "crt"] {
            files::remove_durable(&self.state_dir, &format!("{slot}.{ext}"))
                .map_err(state_err(format!("remove {slot}.{ext}")))?;
        }
        Ok(())
    }

    async fn run_locked(&self, material: Option<Material>) -> Result<Outcome, EnrollError> {
        let mut enrolled: Option<EnrolledRecord> = self.read_record(ENROLLED)?;
        let pending: Option<PendingRecord> = self.read_record(PENDING)?;

        // An enrolled record whose key the store no longer has (memory store after a
        // restart) is void: the VM re-enrolls.
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

        // 1. The epoch floor.
        if let Some(e) = &enrolled {
            if id.epoch < e.identity.epoch {
                return Err(EnrollError::EpochRollback {
                    offered: id.epoch,
                    floor: e.identity.epoch,
                    what: "enrolled",
                });
            }
        }
        if let Some(p) = &pending {
            if id.epoch < p.identity.epoch {
                return Err(EnrollError::EpochRollback {
                    offered: id.epoch,
                    floor: p.identity.epoch,
                    what: "pending",
                });
            }
        }

        // 2. Already enrolled for this identity with a valid certificate.
        if let Some(e) = enrolled.as_ref().filter(|e| e.identity == id) {
            match self.republish(e).await {
                Ok(o) => {
                    if pending.is_some() {
                        files::remove_durable(&self.state_dir, PENDING)
                            .map_err(state_err("remove pending.json"))?;
                    }
                    return Ok(o);
                }
                Err(err) => crate::info!(
                    "enroll: the enrolled certificate is unusable ({err}); enrolling again"
                ),
            }
        }

        // 3./4. The key and the exact CSR bytes to send.
        let token_hash = material.token.sha256_hex();
        let Prepared { slot, key, csr } = match pending {
            Some(p) if p.identity == id => match self.resume(&p)? {
                Some(prepared) => {
                    crate::info!(
                        "enroll: resuming the pending enrollment of {uri} (same key, same CSR)"
                    );
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
                    self.start(&id, &token_hash)?
                }
            },
            Some(p) => {
                crate::info!(
                    "enroll: new identity {uri} supersedes the pending {}; discarding its key",
                    p.identity.uri()
                );
                self.discard_pending(&p, enrolled.as_ref())?;
                self.start(&id, &token_hash)?
            }
            None => self.start(&id, &token_hash)?,
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
        let cert = client::exchange(&service, &material.token, &csr, self.timeout, &self.retry)
            .await
            .map_err(|e| match e {
                ExchangeError::Final { code, message } => EnrollError::Denied { code, message },
                ExchangeError::Exhausted { attempts, last } => {
                    EnrollError::Unavailable { attempts, last }
                }
            })?;
        drop(material);

        // 6. Verify, store, publish, retire the old identity.
        verify::verify(&cert, key.public_sec1(), &id, SystemTime::now())
            .map_err(EnrollError::BadCertificate)?;
        files::write_atomic(&self.state_dir, &format!("{slot}.crt"), &cert, 0o600)
            .map_err(state_err(format!("write {slot}.crt")))?;
        self.write_record(
            ENROLLED,
            &EnrolledRecord {
                identity: id.clone(),
                slot: slot.clone(),
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
        verify::verify(&cert, key.public_sec1(), &e.identity, SystemTime::now())
            .map_err(EnrollError::BadCertificate)?;
        self.publish(&cert)?;
        crate::info!("enroll: already enrolled as {}", e.identity.uri());
        Ok(Outcome::AlreadyEnrolled {
            uri: e.identity.uri(),
            slot: e.slot.clone(),
        })
    }

    /// Writes `cert.pem` (0644) into the publish directory (0755): the certificate is
    /// public, and local consumers such as the app read it there.
    fn publish(&self, cert_der: &[u8]) -> Result<(), EnrollError> {
        files::ensure_dir(&self.publish_dir, 0o755)
            .map_err(state_err(format!("prepare {}", self.publish_dir.display())))?;
        files::write_atomic(
            &self.publish_dir,
            PUBLISHED_CERT,
            verify::to_pem(cert_der).as_bytes(),
            0o644,
        )
        .map_err(state_err(format!("publish {PUBLISHED_CERT}")))
    }

    /// Step 7: removes key, CSR and certificate files no record refers to.
    fn collect_garbage(&self) {
        let keep: Vec<String> = [
            self.read_record::<EnrolledRecord>(ENROLLED)
                .ok()
                .flatten()
                .map(|r| r.slot),
            self.read_record::<PendingRecord>(PENDING)
                .ok()
                .flatten()
                .map(|r| r.slot),
        ]
        .into_iter()
        .flatten()
        .collect();
        let mut slots = self.store.slots().unwrap_or_default();
        if let Ok(rd) = std::fs::read_dir(&self.state_dir) {
            for e in rd.flatten() {
                let name = e.file_name();
                let name = name.to_string_lossy();
                if let Some((slot, _)) = name.split_once('.') {
                    if is_slot(slot) && (name.ends_with(".csr") || name.ends_with(".crt")) {
                        slots.push(slot.to_owned());
                    }
                }
            }
        }
        for slot in slots {
            if !keep.contains(&slot) {
                crate::debug!("enroll: removing leftover slot {slot}");
                let _ = self.remove_slot(&slot);
            }
        }
    }
}

/// The path of the published certificate for a publish directory.
pub fn published_cert(publish_dir: &Path) -> PathBuf {
    publish_dir.join(PUBLISHED_CERT)
}
