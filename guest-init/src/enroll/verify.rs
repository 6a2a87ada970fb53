//! Checks on the certificate the service returns, before anything is stored.
//!
//! The guest accepts a certificate only if it fits the workload profile the enrollment
//! service issues:
//! 1. it is one well-formed DER X.509 certificate with nothing after it;
//! 2. it was issued by the pinned management CA of the bootstrap material: issuer name,
//!    `ecdsa-with-SHA256`, and the signature verified under the CA's key (see
//!    [`super::ca`]); a certificate from any other CA is refused naming its issuer;
//! 3. no extension appears twice (a second `basicConstraints` saying `cA: TRUE` must not
//!    hide behind a first one that a parser happens to read);
//! 4. its key is EC on P-256 (`id-ecPublicKey`, `prime256v1`), and its subject public key
//!    is exactly our key (SEC1 point equality): a certificate for another key, even a
//!    valid one, would be useless and could hide a mix-up of CSRs;
//! 5. it is within its validity window by the guest clock, with [`CLOCK_SKEW`] of
//!    tolerance on `notBefore` (see below);
//! 6. its subject alternative names are exactly one, a URI equal to our identity URI
//!    (workspace, VM UID, epoch): no other identity (URI, DNS name, address, mail) may
//!    ride along;
//! 7. it is not a CA certificate;
//! 8. `keyUsage` is present, has `digitalSignature`, and has neither `keyCertSign` nor
//!    `cRLSign` (a workload key signs handshakes, never certificates or CRLs);
//! 9. `extendedKeyUsage` is present and has `clientAuth` (the VM authenticates to
//!    platform services with it); `serverAuth` may accompany it (a VM may also serve
//!    mTLS); any other purpose, `anyExtendedKeyUsage` included, is refused.
//!
//! **The guest clock.** A micro-VM has no time sync; its clock comes from the RTC the VMM
//! gives it and may be off at boot. The CA's clock is the authority on validity. The guest
//! still checks the window, because a stored certificate is re-checked at every boot
//! (an expired one is fetched again with the stored CSR), but it tolerates a guest clock
//! up to [`CLOCK_SKEW`] (15 minutes) *behind* the CA: `notBefore` may be that far ahead of
//! the guest's now. A guest clock *ahead* of the CA needs no tolerance as long as it is
//! within the certificate's lifetime (the reference service issues for 24 hours and
//! backdates `notBefore` by 60 s). `notAfter` is strict: a certificate that is expired by
//! the guest clock is refused, never stretched. A guest clock more than 15 minutes behind
//! fails enrollment with an error that says so and names both times; the fix is the VM's
//! clock (the RTC the VMM sets), not a larger tolerance. The tolerance is bounded because
//! the check is what keeps a long-expired certificate (for a key still on disk) from
//! being taken as current by a VM whose clock was set back.
//!
//! Relying parties check the chain and the identity's currency themselves on every
//! handshake (seed 000); these checks keep the VM from storing and publishing anything
//! they would refuse.
//!
//! Threat: storing and publishing a certificate that does not belong to this key, this
//! identity, this time or this platform's CA (a confused or malicious relay/service
//! answer, or a second CA answering on the enrollment port).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use x509_parser::prelude::*;

use super::ca::ManagementCa;
use super::identity::Identity;

/// How far ahead of the guest clock `notBefore` may be (a guest clock behind the CA's).
pub const CLOCK_SKEW: Duration = Duration::from_secs(15 * 60);

/// Verifies `der` for `public_sec1` and `id`, issued by `ca`, at `now`; `Err` says which
/// check failed.
pub fn verify(
    der: &[u8],
    ca: &ManagementCa,
    public_sec1: &[u8],
    id: &Identity,
    now: SystemTime,
) -> Result<(), String> {
    let (rest, cert) =
        X509Certificate::from_der(der).map_err(|e| format!("not a DER X.509 certificate: {e}"))?;
    if !rest.is_empty() {
        return Err(format!("{} bytes follow the certificate", rest.len()));
    }
    ca.check_issued(&cert)?;
    let mut seen = Vec::new();
    for ext in cert.extensions() {
        if seen.contains(&&ext.oid) {
            return Err(format!(
                "the extension {} appears more than once",
                ext.oid.to_id_string()
            ));
        }
        seen.push(&ext.oid);
    }
    let spki = cert.public_key();
    super::ca::require_p256(spki)?;
    if &*spki.subject_public_key.data != public_sec1 {
        return Err("the certificate is for another public key, not ours".into());
    }
    let now_s = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let v = cert.validity();
    let guest_now =
        ASN1Time::from_timestamp(now_s).map_or_else(|_| now_s.to_string(), |t| t.to_string());
    let ahead = v.not_before.timestamp() - now_s;
    if ahead > CLOCK_SKEW.as_secs() as i64 {
        return Err(format!(
            "not valid yet by the guest clock: notBefore {} is {ahead} s ahead of the guest's now ({guest_now}), more than the {} s tolerated; the guest clock is behind the CA's, set the VM's clock (RTC)",
            v.not_before,
            CLOCK_SKEW.as_secs()
        ));
    }
    if ahead > 0 {
        crate::warn!(
            "enroll: the certificate's notBefore is {ahead} s ahead of the guest clock (tolerated up to {} s): the guest clock is behind the CA's",
            CLOCK_SKEW.as_secs()
        );
    }
    if v.not_after.timestamp() <= now_s {
        return Err(format!(
            "expired by the guest clock (notAfter {}, guest now {guest_now})",
            v.not_after
        ));
    }
    let mut names = Vec::new();
    let san = cert
        .subject_alternative_name()
        .map_err(|e| format!("the subjectAltName extension is malformed: {e}"))?;
    for n in san.iter().flat_map(|s| s.value.general_names.iter()) {
        names.push(match n {
            GeneralName::URI(u) => u.to_string(),
            other => format!("{other}"),
        });
    }
    let want = id.uri();
    if names != [want.clone()] {
        return Err(format!(
            "identity mismatch: the certificate names {names:?}, expected exactly [{want:?}] and no other name"
        ));
    }
    let ca = cert
        .basic_constraints()
        .map_err(|e| format!("the basicConstraints extension is malformed: {e}"))?;
    if ca.is_some_and(|b| b.value.ca) {
        return Err("it is a CA certificate".into());
    }
    let ku = cert
        .key_usage()
        .map_err(|e| format!("the keyUsage extension is malformed: {e}"))?
        .ok_or("it has no keyUsage extension; the profile needs digitalSignature")?;
    if !ku.value.digital_signature() {
        return Err(format!("keyUsage ({}) lacks digitalSignature", ku.value));
    }
    if ku.value.key_cert_sign() || ku.value.crl_sign() {
        return Err(format!(
            "keyUsage ({}) allows signing certificates or CRLs",
            ku.value
        ));
    }
    let eku = cert
        .extended_key_usage()
        .map_err(|e| format!("the extendedKeyUsage extension is malformed: {e}"))?
        .ok_or("it has no extendedKeyUsage extension; the profile needs clientAuth")?
        .value;
    if !eku.client_auth {
        return Err("extendedKeyUsage lacks clientAuth".into());
    }
    if eku.any
        || eku.code_signing
        || eku.email_protection
        || eku.time_stamping
        || eku.ocsp_signing
        || !eku.other.is_empty()
    {
        return Err(
            "extendedKeyUsage has a purpose outside the profile (only clientAuth and serverAuth are allowed)"
                .into(),
        );
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
    use crate::enroll::ca::tests::TestCa;
    use crate::enroll::keystore::{MachineKey, P256Key, RcgenSigner};

    /// The management CA of these tests.
    fn ca() -> &'static TestCa {
        static CA: std::sync::OnceLock<TestCa> = std::sync::OnceLock::new();
        CA.get_or_init(|| TestCa::new("management CA"))
    }

    fn pin() -> &'static ManagementCa {
        &ca().pin
    }

    fn id(epoch: u64) -> Identity {
        Identity {
            workspace_namespace: "ns".into(),
            workspace_name: "ws".into(),
            workspace_uid: "wu".into(),
            vm_uid: "vm".into(),
            epoch,
        }
    }

    /// The parameters of a profile-conforming certificate for `uris`, valid from `from` to
    /// `to` seconds around now.
    fn params(uris: &[String], from: i64, to: i64) -> rcgen::CertificateParams {
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
        p.is_ca = rcgen::IsCa::ExplicitNoCa;
        p.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        p
    }

    /// A certificate for `key`, issued by the test management CA.
    fn cert(key: &P256Key, uris: &[String], from: i64, to: i64, is_ca: bool) -> Vec<u8> {
        let mut p = params(uris, from, to);
        if is_ca {
            p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        }
        ca().issue(p, key)
    }

    /// A profile-conforming certificate for `key` and identity `me`, changed by `edit`.
    fn cert_with(
        key: &P256Key,
        me: &Identity,
        edit: impl FnOnce(&mut rcgen::CertificateParams),
    ) -> Vec<u8> {
        let mut p = params(&[me.uri()], -60, 3600);
        edit(&mut p);
        ca().issue(p, key)
    }

    fn refused(der: &[u8], key: &P256Key, me: &Identity) -> String {
        verify(der, pin(), key.public_sec1(), me, SystemTime::now()).unwrap_err()
    }

    #[test]
    fn a_certificate_from_another_ca_is_refused_naming_its_issuer() {
        let key = P256Key::generate("test").unwrap();
        let me = id(1);
        let rogue = TestCa::new("rogue CA");
        let der = rogue.issue(params(&[me.uri()], -60, 3600), &key);
        let e = refused(&der, &key, &me);
        assert!(
            e.contains("not issued by the pinned management CA") && e.contains("CN=rogue CA"),
            "{e}"
        );
        // A self-signed certificate for our own key and identity: the check that was
        // missing before the pin.
        let own = params(&[me.uri()], -60, 3600)
            .self_signed(&RcgenSigner(&key))
            .unwrap();
        let e = refused(own.der(), &key, &me);
        assert!(e.contains("not issued by the pinned management CA"), "{e}");
    }

    #[test]
    fn the_guest_clock_may_be_up_to_fifteen_minutes_behind_never_past_not_after() {
        let key = P256Key::generate("test").unwrap();
        let me = id(1);
        let der = cert(&key, &[me.uri()], -60, 3600, false);
        let now = SystemTime::now();
        let check = |at: SystemTime| verify(&der, pin(), key.public_sec1(), &me, at);
        // notBefore is 60 s before the CA's now. The guest clock 10 and 15 minutes behind
        // that: accepted.
        check(now - Duration::from_secs(60 + 600)).unwrap();
        check(now - Duration::from_secs(60 + 15 * 60)).unwrap();
        // A few seconds more (whole seconds in the certificate; the margin covers the
        // test crossing a second): refused, saying it is the clock.
        let e = check(now - Duration::from_secs(60 + 15 * 60 + 5)).unwrap_err();
        assert!(e.contains("guest clock is behind"), "{e}");
        // Ahead by 10 minutes: accepted; past notAfter by a second: refused.
        check(now + Duration::from_secs(600)).unwrap();
        let e = check(now + Duration::from_secs(3601)).unwrap_err();
        assert!(e.contains("expired by the guest clock"), "{e}");
    }

    #[test]
    fn a_duplicate_extension_is_refused() {
        // A second basicConstraints with cA TRUE (SEQUENCE { BOOLEAN TRUE }) after the
        // first one saying "not a CA".
        let key = P256Key::generate("test").unwrap();
        let me = id(1);
        let der = cert_with(&key, &me, |p| {
            p.custom_extensions
                .push(rcgen::CustomExtension::from_oid_content(
                    &[2, 5, 29, 19],
                    vec![0x30, 0x03, 0x01, 0x01, 0xff],
                ));
        });
        let e = refused(&der, &key, &me);
        assert!(e.contains("2.5.29.19 appears more than once"), "{e}");
    }

    #[test]
    fn key_usage_must_be_digital_signature_and_never_certificate_signing() {
        let key = P256Key::generate("test").unwrap();
        let me = id(1);
        for (usages, want) in [
            (vec![], "no keyUsage"),
            (
                vec![rcgen::KeyUsagePurpose::KeyEncipherment],
                "lacks digitalSignature",
            ),
            (
                vec![
                    rcgen::KeyUsagePurpose::DigitalSignature,
                    rcgen::KeyUsagePurpose::KeyCertSign,
                ],
                "certificates or CRLs",
            ),
            (
                vec![
                    rcgen::KeyUsagePurpose::DigitalSignature,
                    rcgen::KeyUsagePurpose::CrlSign,
                ],
                "certificates or CRLs",
            ),
        ] {
            let der = cert_with(&key, &me, |p| p.key_usages = usages.clone());
            let e = refused(&der, &key, &me);
            assert!(e.contains(want), "{usages:?}: {e}");
        }
    }

    #[test]
    fn extended_key_usage_must_be_client_auth_with_at_most_server_auth() {
        use rcgen::ExtendedKeyUsagePurpose as P;
        let key = P256Key::generate("test").unwrap();
        let me = id(1);
        let ok = cert_with(&key, &me, |p| {
            p.extended_key_usages = vec![P::ClientAuth, P::ServerAuth]
        });
        verify(&ok, pin(), key.public_sec1(), &me, SystemTime::now()).unwrap();
        for (ekus, want) in [
            (vec![], "no extendedKeyUsage"),
            (vec![P::ServerAuth], "lacks clientAuth"),
            (vec![P::ClientAuth, P::CodeSigning], "outside the profile"),
            (vec![P::ClientAuth, P::Any], "outside the profile"),
            (
                vec![P::ClientAuth, P::EmailProtection],
                "outside the profile",
            ),
            (vec![P::ClientAuth, P::TimeStamping], "outside the profile"),
            (vec![P::ClientAuth, P::OcspSigning], "outside the profile"),
            (
                vec![P::ClientAuth, P::Other(vec![1, 3, 6, 1, 4, 1, 99999, 1])],
                "outside the profile",
            ),
        ] {
            let der = cert_with(&key, &me, |p| p.extended_key_usages = ekus.clone());
            let e = refused(&der, &key, &me);
            assert!(e.contains(want), "{ekus:?}: {e}");
        }
    }

    /// Our public key bytes, declared under another algorithm.
    struct Declared<'a>(&'a [u8], &'static rcgen::SignatureAlgorithm);
    impl rcgen::PublicKeyData for Declared<'_> {
        fn der_bytes(&self) -> &[u8] {
            self.0
        }
        fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
            self.1
        }
    }

    #[test]
    fn the_key_must_be_ec_p256() {
        let key = P256Key::generate("test").unwrap();
        let me = id(1);
        let issuer = rcgen::Issuer::new(ca().params.clone(), RcgenSigner(&ca().key));
        for (alg, want) in [
            (&rcgen::PKCS_ECDSA_P384_SHA384, "curve 1.3.132.0.34"),
            (&rcgen::PKCS_ED25519, "key algorithm is 1.3.101.112"),
        ] {
            let der = params(&[me.uri()], -60, 3600)
                .signed_by(&Declared(key.public_sec1(), alg), &issuer)
                .unwrap()
                .der()
                .to_vec();
            let e = refused(&der, &key, &me);
            assert!(e.contains(want) && e.contains("not EC P-256"), "{e}");
        }
        // The control: the same construction with P-256 passes.
        let der = params(&[me.uri()], -60, 3600)
            .signed_by(
                &Declared(key.public_sec1(), &rcgen::PKCS_ECDSA_P256_SHA256),
                &issuer,
            )
            .unwrap()
            .der()
            .to_vec();
        verify(&der, pin(), key.public_sec1(), &me, SystemTime::now()).unwrap();
    }

    #[test]
    fn the_identity_uri_must_be_the_only_subject_alternative_name() {
        let key = P256Key::generate("test").unwrap();
        let me = id(1);
        for extra in [
            rcgen::SanType::DnsName("vm.example".try_into().unwrap()),
            rcgen::SanType::IpAddress([10, 0, 0, 1].into()),
            rcgen::SanType::Rfc822Name("vm@example.org".try_into().unwrap()),
        ] {
            let der = cert_with(&key, &me, |p| p.subject_alt_names.push(extra.clone()));
            let e = refused(&der, &key, &me);
            assert!(e.contains("no other name"), "{extra:?}: {e}");
        }
    }

    #[test]
    fn a_matching_certificate_passes_and_each_broken_property_fails() {
        let key = P256Key::generate("test").unwrap();
        let other = P256Key::generate("test").unwrap();
        let me = id(7);
        let now = SystemTime::now();
        let good = cert(&key, &[me.uri()], -60, 3600, false);
        verify(&good, pin(), key.public_sec1(), &me, now).unwrap();

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
            let e = verify(&der, pin(), public, &ident, now).unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    #[test]
    fn the_validity_window_holds_to_the_second() {
        let key = P256Key::generate("test").unwrap();
        let me = id(1);
        let der = cert(&key, &[me.uri()], 3600, 7200, false);
        let (_, c) = X509Certificate::from_der(&der).unwrap();
        let not_before = c.validity().not_before.timestamp() as u64;
        let not_after = c.validity().not_after.timestamp() as u64;
        let at = |s: u64| {
            let now = UNIX_EPOCH + Duration::from_secs(s);
            verify(&der, pin(), key.public_sec1(), &me, now)
        };
        let skew = CLOCK_SKEW.as_secs();
        // A guest clock exactly the tolerance behind notBefore is accepted; one second
        // more is not.
        at(not_before - skew).unwrap();
        let e = at(not_before - skew - 1).unwrap_err();
        assert!(e.contains("not valid yet"), "{e}");
        // Valid through the second before notAfter; at notAfter it has expired.
        at(not_after - 1).unwrap();
        let e = at(not_after).unwrap_err();
        assert!(e.contains("expired"), "{e}");
    }

    #[test]
    fn pem_wraps_at_64_columns() {
        let pem = to_pem(&[7u8; 100]);
        assert!(pem.starts_with("-----BEGIN CERTIFICATE-----\n"));
        assert!(pem.lines().all(|l| l.len() <= 64));
    }
}
