//! The enrollment state on disk: its records, the key slots, publishing, and garbage.
//!
//! Three small JSON records, each written atomically (`files::write_atomic`: `O_EXCL |
//! O_NOFOLLOW` temp file, fsync, rename, directory fsync) and read with a size bound:
//! - `pending.json`: the identity, key slot and token hash of an enrollment in flight. It
//!   is what makes a retry resend the byte-identical CSR, and it is **never** a floor: a
//!   pushed document nobody has confirmed must not be able to raise one.
//! - `floor.json`: the highest epoch the service confirmed. Only ever raised, durable
//!   before the certificate that confirmed it is stored, never removed with a key.
//! - `enrolled.json`: the identity and slot of the certificate in use.
//!
//! Garbage collection fails closed: if a record, the key store or the directory cannot be
//! read, nothing is removed, because "cannot tell" must never turn into "delete the key".

use serde::{Deserialize, Serialize};

use super::*;
use crate::enroll::ca::ManagementCa;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PendingRecord {
    pub(super) identity: Identity,
    pub(super) slot: String,
    pub(super) token_sha256: String,
}

/// The highest revocation epoch the service has confirmed (a certificate received and
/// verified). Only ever raised; never removed with a key.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FloorRecord {
    pub(super) epoch: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EnrolledRecord {
    pub(super) identity: Identity,
    pub(super) slot: String,
    /// The material's enrollment port, for renewal after the material is gone (absent in
    /// records of older guest-inits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) enrollment_port: Option<u32>,
}

impl Enroller<'_> {
    pub(super) fn read_record<T: for<'de> Deserialize<'de>>(
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

    pub(super) fn write_record<T: Serialize>(
        &self,
        name: &str,
        rec: &T,
    ) -> Result<(), EnrollError> {
        let bytes = serde_json::to_vec(rec).unwrap_or_default();
        files::write_atomic(&self.state_dir, name, &bytes, 0o600)
            .map_err(state_err(format!("write {name}")))
    }

    pub(super) fn read_slot_file(
        &self,
        slot: &str,
        ext: &str,
    ) -> Result<Option<Vec<u8>>, EnrollError> {
        let path = self.state_dir.join(format!("{slot}.{ext}"));
        Ok(files::read_bounded(&path, MAX_DER, true)
            .map_err(state_err(format!("read {}", path.display())))?
            .map(|b| b.to_vec()))
    }

    pub(super) fn remove_slot(&self, slot: &str) -> Result<(), EnrollError> {
        self.store.remove(slot)?;
        for ext in ["csr", "crt", "ca"] {
            files::remove_durable(&self.state_dir, &format!("{slot}.{ext}"))
                .map_err(state_err(format!("remove {slot}.{ext}")))?;
        }
        Ok(())
    }

    /// Records `ca` as the CA `slot`'s certificate was verified against (`<slot>.ca`),
    /// unless it is recorded already.
    pub(super) fn record_ca(&self, slot: &str, ca: &ManagementCa) -> Result<(), EnrollError> {
        if self.read_slot_file(slot, "ca")?.as_deref() == Some(ca.der()) {
            return Ok(());
        }
        files::write_atomic(&self.state_dir, &format!("{slot}.ca"), ca.der(), 0o600)
            .map_err(state_err(format!("write {slot}.ca")))
    }

    /// The CA recorded for `slot`, for a run without material.
    pub(super) fn recorded_ca(&self, slot: &str) -> Result<ManagementCa, EnrollError> {
        let der = self.read_slot_file(slot, "ca")?.ok_or_else(|| {
            EnrollError::BadCertificate(format!(
                "no management CA is recorded for the enrolled certificate ({slot}.ca is missing: state from an older guest-init); provision bootstrap material with management_ca"
            ))
        })?;
        ManagementCa::from_der(&der).map_err(|e| {
            EnrollError::BadCertificate(format!("the recorded management CA {slot}.ca is {e}"))
        })
    }

    /// The credentials in force: the enrolled identity, its key, certificate and the CA
    /// it was verified against. For the agent, after a successful run.
    pub fn credentials(&self) -> Result<super::super::Credentials, EnrollError> {
        let e: EnrolledRecord = self.read_record(ENROLLED)?.ok_or(EnrollError::NoMaterial)?;
        let key = self.store.open(&e.slot)?.ok_or(EnrollError::KeyLost)?;
        let cert_der = self.read_slot_file(&e.slot, "crt")?.ok_or_else(|| {
            EnrollError::BadCertificate("the enrolled certificate file is missing".into())
        })?;
        let ca = self.recorded_ca(&e.slot)?;
        Ok(super::super::Credentials {
            identity: e.identity,
            key,
            cert_der,
            ca,
            enrollment_port: e.enrollment_port,
        })
    }

    /// The confirmed epoch floor (`floor.json`), `None` before the first certificate.
    pub(super) fn floor(&self) -> Result<Option<u64>, EnrollError> {
        Ok(self.read_record::<FloorRecord>(FLOOR)?.map(|f| f.epoch))
    }

    /// Raises the floor to `epoch` (never lowers it); durable before it returns.
    pub(super) fn raise_floor(&self, current: Option<u64>, epoch: u64) -> Result<(), EnrollError> {
        if current.is_some_and(|f| f >= epoch) {
            return Ok(());
        }
        self.write_record(FLOOR, &FloorRecord { epoch })
    }

    /// Writes `cert.pem` (0644) into the publish directory (0755): the certificate is
    /// public, and local consumers such as the app read it there.
    pub(super) fn publish(&self, cert_der: &[u8]) -> Result<(), EnrollError> {
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

    /// Step 7: removes key, CSR and certificate files no record refers to. On any doubt
    /// (a record or the store that cannot be read) it removes nothing: a transient error
    /// must never delete the live key.
    pub(super) fn collect_garbage(&self) {
        let records = (|| -> Result<Vec<String>, EnrollError> {
            Ok([
                self.read_record::<EnrolledRecord>(ENROLLED)?
                    .map(|r| r.slot),
                self.read_record::<PendingRecord>(PENDING)?.map(|r| r.slot),
            ]
            .into_iter()
            .flatten()
            .collect())
        })();
        let keep = match records {
            Ok(k) => k,
            Err(e) => {
                crate::warn!("enroll: leftover slots not collected: {e}");
                return;
            }
        };
        let mut slots = match self.store.slots() {
            Ok(s) => s,
            Err(e) => {
                crate::warn!("enroll: leftover slots not collected: {e}");
                return;
            }
        };
        match std::fs::read_dir(&self.state_dir) {
            Ok(rd) => {
                for e in rd {
                    let Ok(e) = e else {
                        crate::warn!(
                            "enroll: leftover slots not collected: cannot list {}",
                            self.state_dir.display()
                        );
                        return;
                    };
                    let name = e.file_name();
                    let name = name.to_string_lossy();
                    if let Some((slot, _)) = name.split_once('.') {
                        if is_slot(slot)
                            && [".csr", ".crt", ".ca"].iter().any(|x| name.ends_with(x))
                        {
                            slots.push(slot.to_owned());
                        }
                    }
                }
            }
            Err(e) => {
                crate::warn!(
                    "enroll: leftover slots not collected: cannot list {}: {e}",
                    self.state_dir.display()
                );
                return;
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
