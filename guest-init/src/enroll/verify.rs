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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::enroll::keystore::{MachineKey, P256Key, RcgenSigner};

    fn id(epoch: u64) -> Identity {
        Identity {
            workspace_namespace: "ns".into(),
            workspace_name: "ws".into(),
            workspace_uid: "wu".into(),
            vm_uid: "vm".into(),
            epoch,
        }
    }

    /// A certificate for `key` (self-signed through the external signer: the guest checks
    /// key, validity, identity and CA flag, not the issuer).
    fn cert(key: &P256Key, uris: &[String], from: i64, to: i64, ca: bool) -> Vec<u8> {
        let mut p = rcgen::CertificateParams::default();
        p.serial_number = Some(vec![1, 2, 3].into());
        p.subject_alt_names = uris
            .iter()
            .map(|u| rcgen::SanType::URI(u.clone().try_into().unwrap()))
            .collect();
        let now = SystemTime::now();
        let at = |d: i64| {
            if d >= 0 {
                now + Duration::from_secs(d as u64)
            } else {
                now - Duration::from_secs((-d) as u64)
            }
        };
        p.not_before = at(from).into();
        p.not_after = at(to).into();
        if ca {
            p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        }
        p.self_signed(&RcgenSigner(key)).unwrap().der().to_vec()
    }

    #[test]
    fn a_matching_certificate_passes_and_each_broken_property_fails() {
        let key = P256Key::generate("test").unwrap();
        let other = P256Key::generate("test").unwrap();
        let me = id(7);
        let now = SystemTime::now();
        let good = cert(&key, &[me.uri()], -60, 3600, false);
        verify(&good, key.public_sec1(), &me, now).unwrap();

        let cases: Vec<(Vec<u8>, &[u8], Identity, &str)> = vec![
            (
                good.clone(),
                other.public_sec1(),
                me.clone(),
                "another public key",
            ),
            (good.clone(), key.public_sec1(), id(8), "identity mismatch"),
            (
                cert(&key, &[me.uri()], -7200, -60, false),
                key.public_sec1(),
                me.clone(),
                "expired",
            ),
            (
                cert(&key, &[me.uri()], 3600, 7200, false),
                key.public_sec1(),
                me.clone(),
                "not valid yet",
            ),
            (
                cert(&key, &[me.uri(), id(9).uri()], -60, 3600, false),
                key.public_sec1(),
                me.clone(),
                "identity mismatch",
            ),
            (
                cert(&key, &[], -60, 3600, false),
                key.public_sec1(),
                me.clone(),
                "identity mismatch",
            ),
            (
                cert(&key, &[me.uri()], -60, 3600, true),
                key.public_sec1(),
                me.clone(),
                "CA",
            ),
            (
                [good.clone(), vec![0]].concat(),
                key.public_sec1(),
                me.clone(),
                "follow",
            ),
            (
                good[..good.len() - 5].to_vec(),
                key.public_sec1(),
                me.clone(),
                "not a DER",
            ),
        ];
        for (der, public, ident, want) in cases {
            let e = verify(&der, public, &ident, now).unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    #[test]
    fn pem_wraps_at_64_columns() {
        let pem = to_pem(&[7u8; 100]);
        assert!(pem.starts_with("-----BEGIN CERTIFICATE-----\n"));
        assert!(pem.lines().all(|l| l.len() <= 64));
    }
}
