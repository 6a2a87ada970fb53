//! Storing a renewed certificate: same identity, same key, same slot; only `<slot>.crt`
//! and the published `cert.pem` change.
//!
//! Under the enrollment lock (a pushed re-enrollment and a renewal never interleave), the
//! renewal is stored only if the state still holds the certificate it renewed: the
//! enrolled record names the same identity and `<slot>.crt` is the very certificate the
//! renewal presented. Otherwise (a re-enrollment replaced it meanwhile) the result is
//! dropped, never written over a newer identity. The certificate is verified exactly as
//! enrollment verifies one ([`verify::verify`]: the CA recorded for the slot, the slot's
//! key, the enrolled identity, validity, profile) before the atomic, durable replacement of
//! `<slot>.crt` (the commit point); then `cert.pem` is republished. A crash before the
//! rename keeps the old certificate (still valid: renewal starts well before it expires);
//! after it, the next boot's run republishes the new one.
//!
//! Threat: a renewed certificate for another key, identity or CA being stored or served,
//! and a late renewal overwriting the certificate of a newer identity.

use super::*;

impl Enroller<'_> {
    /// Stores `new_cert` as the renewal of `old_cert` for `identity`. `Ok(false)`: the
    /// state no longer holds `old_cert` (superseded), nothing written.
    pub async fn store_renewed(
        &self,
        identity: &Identity,
        old_cert: &[u8],
        new_cert: &[u8],
    ) -> Result<bool, EnrollError> {
        let _lock = self.lock().await?;
        let Some(e): Option<EnrolledRecord> = self.read_record(ENROLLED)? else {
            return Ok(false);
        };
        if e.identity != *identity
            || !is_slot(&e.slot)
            || self.read_slot_file(&e.slot, "crt")?.as_deref() != Some(old_cert)
        {
            return Ok(false);
        }
        let key = self.store.open(&e.slot)?.ok_or(EnrollError::KeyLost)?;
        let ca = self.recorded_ca(&e.slot)?;
        verify::verify(
            new_cert,
            &ca,
            key.public_sec1(),
            identity,
            SystemTime::now(),
        )
        .map_err(EnrollError::BadCertificate)?;
        files::write_atomic(&self.state_dir, &format!("{}.crt", e.slot), new_cert, 0o600)
            .map_err(state_err(format!("write {}.crt", e.slot)))?;
        self.publish(new_cert)?;
        Ok(true)
    }
}
