//! Checks on the certificate the service returns, before anything is stored.
//!
//! The guest accepts a certificate only if:
//! 1. it is one well-formed DER X.509 certificate with nothing after it;
//! 2. its subject public key is exactly our key (SEC1 point equality): a certificate for
//!    another key, even a valid one, would be useless and could hide a mix-up of CSRs;
//! 3. it is within its validity window now (`notBefore` may be up to
//!    [`CLOCK_SKEW`] in the future, for a guest clock slightly behind the service's);
//! 4. its URI subject alternative names are exactly one, equal to our identity URI
//!    (workspace, VM UID, epoch); no other URI identity may ride along;
//! 5. it is not a CA certificate.
//!
//! The chain to the platform's CA is not checked here: the guest holds no trust anchor in
//! the bootstrap format, and the parties that rely on the certificate (mTLS peers) check
//! the chain and, per seed 000, re-check the identity's currency on every handshake.
//!
//! Threat: storing and publishing a certificate that does not belong to this key, this
//! identity or this time (a confused or malicious relay/service answer).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use x509_parser::prelude::*;

use super::identity::Identity;

/// How far in the future `notBefore` may be.
pub const CLOCK_SKEW: Duration = Duration::from_secs(300);

/// Verifies `der` for `public_sec1` and `id` at `now`; `Err` says which check failed.
pub fn verify(
    der: &[u8],
    public_sec1: &[u8],
    id: &Identity,
    now: SystemTime,
) -> Result<(), String> {
    let (rest, cert) =
        X509Certificate::from_der(der).map_err(|e| format!("not a DER X.509 certificate: {e}"))?;
    if !rest.is_empty() {
        return Err(format!("{} bytes follow the certificate", rest.len()));
    }
    if &*cert.public_key().subject_public_key.data != public_sec1 {
        return Err("the certificate is for another public key, not ours".into());
    }
    let now_s = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let v = cert.validity();
    if v.not_before.timestamp() > now_s + CLOCK_SKEW.as_secs() as i64 {
        return Err(format!(
            "not valid yet (notBefore {}); check the guest clock",
            v.not_before
        ));
    }
    if v.not_after.timestamp() <= now_s {
        return Err(format!("expired (notAfter {})", v.not_after));
    }
    let mut uris = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            if let GeneralName::URI(u) = n {
                uris.push(u.to_string());
            }
        }
    }
    let want = id.uri();
    if uris != [want.clone()] {
        return Err(format!(
            "identity mismatch: the certificate names {uris:?}, expected exactly [{want:?}]"
        ));
    }
    if cert.is_ca() {
        return Err("it is a CA certificate".into());
    }
    Ok(())
}

/// The PEM form of a DER certificate.
pub fn to_pem(der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut s = String::from("-----BEGIN CERTIFICATE-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        s.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        s.push('\n');
    }
    s.push_str("-----END CERTIFICATE-----\n");
    s
}
