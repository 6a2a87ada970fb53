//! The pinned management CA: the one issuer whose certificates this VM accepts.
//!
//! Without a pin, whoever answers on the enrollment port (any host process that can bind
//! it, or a confused relay) could hand the VM an identity: a certificate that names our key
//! and our identity URI is easy to make with any CA. So the bootstrap material, which comes
//! through the same trusted path as the token, carries the management CA's certificate
//! (`management_ca`, standard base64 of its DER), and the guest accepts a certificate only
//! if that CA's key signed it.
//!
//! Why the certificate and not just a SHA-256 of its SubjectPublicKeyInfo: checking a
//! signature needs the key itself, and a hash pin would make the service send the CA
//! certificate along, adding a second input to parse and match. The certificate in the
//! material is the key, its name (for the issuer check and for errors), and its hash (for
//! logs), from one source.
//!
//! What is checked:
//! - at parse time, the pinned certificate is one DER X.509 certificate with nothing after
//!   it, a CA (`basicConstraints` `cA: TRUE`), allowed to sign certificates (`keyUsage`
//!   has `keyCertSign` when present), and its key is EC P-256 — the only algorithm this
//!   guest verifies. Anything else is refused there, naming `management_ca`, so a material
//!   that could never verify a certificate is not used to spend a token. The anchor's own
//!   signature and validity period are not checked: a trust anchor is a key and a name
//!   (as in webpki), and it is replaced by provisioning new material.
//! - for an issued certificate ([`ManagementCa::check_issued`]): its issuer name equals
//!   the CA's subject (byte for byte), its signature algorithm is `ecdsa-with-SHA256` in
//!   both places the certificate names it, and the ECDSA P-256 signature over the exact
//!   `tbsCertificate` bytes verifies under the CA's key (the `p256` crate: x509-parser's
//!   own `verify` feature would link ring, and guest-init links no C or assembly crypto).
//!   A refusal names the issuer the certificate claims, so an operator can tell a rogue
//!   service from a rotated CA.
//!
//! Only a certificate issued directly by the pinned CA is accepted (no intermediates): the
//! enrollment service issues from the management CA itself.
//!
//! Threat: a rogue or misconfigured service on the enrollment port giving the VM a
//! certificate from another CA (same name or not), a signature made with another algorithm
//! than the one the CA's key is for, and material pinning something that is not a P-256 CA.

use std::fmt;

use p256::ecdsa::signature::Verifier;
use p256::ecdsa::{Signature, VerifyingKey};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};
use x509_parser::oid_registry::{
    OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_SIG_ECDSA_WITH_SHA256,
};
use x509_parser::prelude::*;

use super::material::hex;

/// The largest pinned CA certificate accepted (DER bytes).
pub const MAX_CA_DER: usize = 2048;

/// The pinned management CA.
#[derive(Clone)]
pub struct ManagementCa {
    der: Vec<u8>,
    subject_raw: Vec<u8>,
    subject: String,
    key: VerifyingKey,
}

impl fmt::Debug for ManagementCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManagementCa")
            .field("subject", &self.subject)
            .field("spki_sha256", &self.spki_sha256_hex())
            .finish()
    }
}

impl ManagementCa {
    /// Parses and checks a CA certificate (DER). `Err` says what is wrong, without quoting
    /// input bytes.
    pub fn from_der(der: &[u8]) -> Result<ManagementCa, String> {
        if der.len() > MAX_CA_DER {
            return Err(format!("larger than {MAX_CA_DER} bytes"));
        }
        let (rest, cert) = X509Certificate::from_der(der)
            .map_err(|e| format!("not a DER X.509 certificate: {e}"))?;
        if !rest.is_empty() {
            return Err(format!("{} bytes follow the certificate", rest.len()));
        }
        let bc = cert
            .basic_constraints()
            .map_err(|e| format!("the basicConstraints extension is malformed: {e}"))?;
        if !bc.is_some_and(|b| b.value.ca) {
            return Err("not a CA certificate (basicConstraints cA is not TRUE)".into());
        }
        let ku = cert
            .key_usage()
            .map_err(|e| format!("the keyUsage extension is malformed: {e}"))?;
        if ku.is_some_and(|k| !k.value.key_cert_sign()) {
            return Err("its keyUsage does not allow signing certificates (keyCertSign)".into());
        }
        let spki = cert.public_key();
        require_p256(spki).map_err(|e| {
            format!("{e}: this guest verifies only ECDSA P-256 with SHA-256, so the CA key must be EC P-256")
        })?;
        let key = VerifyingKey::from_sec1_bytes(&spki.subject_public_key.data)
            .map_err(|_| "its EC P-256 public key is not a valid curve point".to_string())?;
        Ok(ManagementCa {
            der: der.to_vec(),
            subject_raw: cert.subject().as_raw().to_vec(),
            subject: cert.subject().to_string(),
            key,
        })
    }

    /// The CA certificate's DER.
    pub fn der(&self) -> &[u8] {
        &self.der
    }

    /// The CA's subject, DER (for a TLS certificate request's hint).
    pub fn subject_der(&self) -> &[u8] {
        &self.subject_raw
    }

    /// The CA's subject, as text.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Hex SHA-256 of the CA's SubjectPublicKeyInfo (the pin's fingerprint, for logs).
    pub fn spki_sha256_hex(&self) -> String {
        use p256::pkcs8::EncodePublicKey;
        match self.key.to_public_key_der() {
            Ok(d) => hex(&Sha256::digest(d.as_bytes())),
            Err(_) => "unknown".into(),
        }
    }

    /// Checks that `cert` was issued by this CA: issuer name, algorithm, signature.
    pub fn check_issued(&self, cert: &X509Certificate<'_>) -> Result<(), String> {
        let issuer = cert.issuer();
        let refuse = |why: String| {
            format!(
                "not issued by the pinned management CA ({}, key sha256 {}): the certificate names the issuer {}; {why}",
                self.subject,
                self.spki_sha256_hex(),
                issuer
            )
        };
        if issuer.as_raw() != self.subject_raw.as_slice() {
            return Err(refuse("the names differ".into()));
        }
        let outer = &cert.signature_algorithm;
        let inner = &cert.tbs_certificate.signature;
        if outer.algorithm != inner.algorithm || outer.parameters != inner.parameters {
            return Err(refuse(format!(
                "its two signature algorithm fields differ ({} outside, {} inside)",
                outer.algorithm.to_id_string(),
                inner.algorithm.to_id_string()
            )));
        }
        if outer.algorithm != OID_SIG_ECDSA_WITH_SHA256 || outer.parameters.is_some() {
            return Err(refuse(format!(
                "it is signed with algorithm {}; only ecdsa-with-SHA256 (1.2.840.10045.4.3.2, no parameters) is accepted",
                outer.algorithm.to_id_string()
            )));
        }
        let sig = Signature::from_der(&cert.signature_value.data)
            .map_err(|_| refuse("its signature is not a DER ECDSA P-256 signature".into()))?;
        self.key
            .verify(cert.tbs_certificate.as_ref(), &sig)
            .map_err(|_| refuse("its signature does not verify under the pinned CA's key".into()))
    }
}

/// `Ok` when `spki` is an EC key on P-256 (`id-ecPublicKey`, `prime256v1`); otherwise
/// says which algorithm and curve it is.
pub fn require_p256(spki: &SubjectPublicKeyInfo<'_>) -> Result<(), String> {
    let curve = spki
        .algorithm
        .parameters
        .as_ref()
        .and_then(|p| p.as_oid().ok());
    if spki.algorithm.algorithm != OID_KEY_TYPE_EC_PUBLIC_KEY || curve != Some(OID_EC_P256) {
        return Err(format!(
            "the key algorithm is {} (curve {}), not EC P-256",
            spki.algorithm.algorithm.to_id_string(),
            curve.map_or_else(|| "none".into(), |c| c.to_id_string())
        ));
    }
    Ok(())
}

impl Serialize for ManagementCa {
    /// As standard base64 of the DER, the form [`Deserialize`] reads.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use base64::Engine;
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(&self.der))
    }
}

impl<'de> Deserialize<'de> for ManagementCa {
    /// From standard base64 of the DER certificate. Errors name `management_ca` and never
    /// quote the input.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use base64::Engine;
        use serde::de::Error;
        let b64 = String::deserialize(d)?;
        let der = base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .map_err(|_| {
                D::Error::custom(
                    "management_ca: not standard base64; give the CA certificate's DER in base64 (base64 -w0 ca.der)",
                )
            })?;
        ManagementCa::from_der(&der).map_err(|e| {
            D::Error::custom(format!("management_ca: the pinned CA certificate is {e}"))
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::enroll::keystore::{MachineKey, P256Key, RcgenSigner};

    /// A test CA: its key and parameters, and the pin made from its certificate.
    pub(crate) struct TestCa {
        pub(crate) key: P256Key,
        pub(crate) params: rcgen::CertificateParams,
        pub(crate) pin: ManagementCa,
    }

    pub(crate) fn ca_params(cn: &str) -> rcgen::CertificateParams {
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        p.serial_number = Some(vec![0x0c, 0xa0].into());
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        p
    }

    impl TestCa {
        pub(crate) fn new(cn: &str) -> TestCa {
            let key = P256Key::generate("test").unwrap();
            let params = ca_params(cn);
            let der = params
                .self_signed(&RcgenSigner(&key))
                .unwrap()
                .der()
                .to_vec();
            let pin = ManagementCa::from_der(&der).unwrap();
            TestCa { key, params, pin }
        }

        /// Signs `params` for the public key of `subject`.
        pub(crate) fn issue(&self, params: rcgen::CertificateParams, subject: &P256Key) -> Vec<u8> {
            let issuer = rcgen::Issuer::new(self.params.clone(), RcgenSigner(&self.key));
            params
                .signed_by(&RcgenSigner(subject), &issuer)
                .unwrap()
                .der()
                .to_vec()
        }
    }

    fn leaf() -> rcgen::CertificateParams {
        let mut p = rcgen::CertificateParams::default();
        p.serial_number = Some(vec![0x01].into());
        p.is_ca = rcgen::IsCa::ExplicitNoCa;
        p
    }

    fn check(ca: &ManagementCa, der: &[u8]) -> Result<(), String> {
        let (_, cert) = X509Certificate::from_der(der).unwrap();
        ca.check_issued(&cert)
    }

    #[test]
    fn only_the_pinned_ca_key_is_accepted() {
        let ca = TestCa::new("management CA");
        let same_name = TestCa::new("management CA");
        let other_name = TestCa::new("rogue CA");
        let vm = P256Key::generate("test").unwrap();
        check(&ca.pin, &ca.issue(leaf(), &vm)).unwrap();

        let e = check(&ca.pin, &same_name.issue(leaf(), &vm)).unwrap_err();
        assert!(e.contains("does not verify"), "{e}");
        assert!(e.contains("names the issuer CN=management CA"), "{e}");

        let e = check(&ca.pin, &other_name.issue(leaf(), &vm)).unwrap_err();
        assert!(
            e.contains("issuer CN=rogue CA") && e.contains("names differ"),
            "{e}"
        );
    }

    #[test]
    fn a_changed_byte_in_the_signed_part_fails_the_signature() {
        let ca = TestCa::new("management CA");
        let vm = P256Key::generate("test").unwrap();
        let mut p = leaf();
        p.serial_number = Some(vec![0x11, 0x22, 0x33].into());
        let mut der = ca.issue(p, &vm);
        let i = der
            .windows(3)
            .position(|w| w == [0x11, 0x22, 0x33])
            .unwrap();
        der[i + 2] ^= 1;
        let e = check(&ca.pin, &der).unwrap_err();
        assert!(e.contains("does not verify"), "{e}");
    }

    #[test]
    fn other_signature_algorithms_are_refused_by_name() {
        // ecdsa-with-SHA256 as DER, and the same with ecdsa-with-SHA384's last arc.
        const SHA256: [u8; 10] = [0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x02];
        let ca = TestCa::new("management CA");
        let vm = P256Key::generate("test").unwrap();
        let good = ca.issue(leaf(), &vm);
        let at: Vec<usize> = good
            .windows(SHA256.len())
            .enumerate()
            .filter(|(_, w)| *w == SHA256)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(at.len(), 2, "the algorithm appears inside and outside");
        let mut both = good.clone();
        for i in &at {
            both[i + 9] = 0x03;
        }
        let e = check(&ca.pin, &both).unwrap_err();
        assert!(e.contains("algorithm 1.2.840.10045.4.3.3"), "{e}");
        let mut outer = good.clone();
        outer[at[1] + 9] = 0x03;
        let e = check(&ca.pin, &outer).unwrap_err();
        assert!(e.contains("differ"), "{e}");
    }

    #[test]
    fn the_pin_must_be_a_p256_ca_that_may_sign_certificates() {
        let key = P256Key::generate("test").unwrap();
        let mut not_ca = ca_params("x");
        not_ca.is_ca = rcgen::IsCa::ExplicitNoCa;
        let mut no_cert_sign = ca_params("x");
        no_cert_sign.key_usages = vec![rcgen::KeyUsagePurpose::CrlSign];
        for (p, want) in [(not_ca, "not a CA"), (no_cert_sign, "keyCertSign")] {
            let der = p.self_signed(&RcgenSigner(&key)).unwrap().der().to_vec();
            let e = ManagementCa::from_der(&der).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        // A CA certificate whose key is declared P-384 (signed by our P-256 key).
        struct P384<'a>(&'a [u8]);
        impl rcgen::PublicKeyData for P384<'_> {
            fn der_bytes(&self) -> &[u8] {
                self.0
            }
            fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
                &rcgen::PKCS_ECDSA_P384_SHA384
            }
        }
        let issuer = rcgen::Issuer::new(ca_params("x"), RcgenSigner(&key));
        let der = ca_params("x")
            .signed_by(&P384(key.public_sec1()), &issuer)
            .unwrap()
            .der()
            .to_vec();
        let e = ManagementCa::from_der(&der).unwrap_err();
        assert!(e.contains("must be EC P-256"), "{e}");
        let good = ca_params("x").self_signed(&RcgenSigner(&key)).unwrap();
        let e = ManagementCa::from_der(&[good.der().as_ref(), &[0]].concat()).unwrap_err();
        assert!(e.contains("follow"), "{e}");
    }
}
