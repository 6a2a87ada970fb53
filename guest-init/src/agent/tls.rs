//! The agent's TLS: the guest's own certificate and key, and who may connect.
//!
//! **Server side.** The guest presents its enrolled certificate. Its private key never
//! leaves the key store: [`MachineSigner`] is a rustls `SigningKey` whose signatures come
//! from [`MachineKey::sign_der`] (a TPM key signs inside the TPM). Only ECDSA P-256 SHA-256
//! is offered, the one scheme an enrolled key has.
//!
//! **Client side: the operator certificate profile.** A client is admitted only with a
//! certificate that
//! 1. was issued directly by the pinned management CA (the bootstrap material's
//!    `management_ca`; issuer name, `ecdsa-with-SHA256`, signature: [`ManagementCa`]);
//! 2. is within its validity by the guest clock, with the same tolerance for a guest clock
//!    behind the CA as enrollment ([`crate::enroll::verify::CLOCK_SKEW`]); `notAfter` is
//!    strict;
//! 3. is not a CA, and has `extendedKeyUsage` with `clientAuth`;
//! 4. names exactly one role in exactly one URI subject alternative name:
//!    `urn:hop3:operator:<name>:role:<role>`, where `<name>` identifies the person or
//!    service (`A-Z a-z 0-9 - _ . @`, 1-128) and `<role>` is one of [`Role`].
//!
//! Each operation needs a role ([`Role::allows`]): `status` any role, `stop` and `exec`
//! the `operator` role. A certificate without a recognised role is refused at the
//! handshake; a role that does not allow the operation is refused for that request.
//!
//! Every refusal has its own reason ([`Refusal`]), logged with the peer, and sent to the
//! client as the TLS alert that fits (`certificate_required`, `unknown_ca`,
//! `certificate_expired`, `bad_certificate`) or, after the handshake, as a JSON error.
//!
//! Threat: a host process other than the platform's operator tooling driving the VM (any
//! host process can reach CID 2 ports), a certificate from another CA or for another
//! purpose, an expired or not-yet-valid operator credential, a read-only role running
//! commands, and the guest's private key being copied into a TLS library.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use peer_verify::profile::{self, OutsideValidity, Purpose};
use peer_verify::{PeerCheck, PeerVerifier};
use rustls::pki_types::CertificateDer;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::{CertifiedKey, Signer, SigningKey};
use rustls::{CertificateError, SignatureAlgorithm, SignatureScheme};

use crate::enroll::ca::ManagementCa;
use crate::enroll::keystore::MachineKey;
use crate::enroll::verify::CLOCK_SKEW;

/// The URI prefix of an operator certificate's one subject alternative name.
pub const OPERATOR_URI_PREFIX: &str = "urn:hop3:operator:";

/// What an operator certificate allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `status` only.
    Reader,
    /// `status`, `stop` and `exec`.
    Operator,
}

impl Role {
    /// The role's name in the certificate.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Reader => "reader",
            Role::Operator => "operator",
        }
    }

    /// Whether this role may run `op`.
    pub fn allows(self, op: &str) -> bool {
        match self {
            Role::Operator => true,
            Role::Reader => op == "status",
        }
    }
}

/// An admitted operator: the name and role from its certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operator {
    /// Who (the URI's `<name>`).
    pub name: String,
    /// What they may do.
    pub role: Role,
}

/// Why a client certificate was refused. Each has its own message and TLS alert.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    /// Not issued by the pinned management CA.
    #[error("wrong CA: {0}")]
    WrongCa(String),
    /// Past `notAfter`.
    #[error("expired: {0}")]
    Expired(String),
    /// Before `notBefore` (beyond the tolerance).
    #[error("not valid yet: {0}")]
    NotYetValid(String),
    /// Not an operator certificate (CA, no `clientAuth`, malformed).
    #[error("not an operator certificate: {0}")]
    Profile(String),
    /// No role, or a role this guest does not know.
    #[error("no accepted role: {0}")]
    Role(String),
}

impl Refusal {
    /// Logs the refusal (the precise reason stays in the guest's log) and turns it into
    /// the rustls error whose alert tells the client which kind it was: `unknown_ca`,
    /// `certificate_expired`, `unsupported_certificate` or `access_denied`.
    fn into_rustls(self) -> rustls::Error {
        crate::warn!("agent: client certificate refused: {self}");
        rustls::Error::InvalidCertificate(match self {
            Refusal::WrongCa(_) => CertificateError::UnknownIssuer,
            Refusal::Expired(_) => CertificateError::Expired,
            Refusal::NotYetValid(_) => CertificateError::NotValidYet,
            Refusal::Profile(_) => CertificateError::InvalidPurpose,
            Refusal::Role(_) => CertificateError::ApplicationVerificationFailure,
        })
    }
}

/// Checks an operator certificate against the profile at `now` (Unix seconds).
pub fn check_operator(ca: &ManagementCa, der: &[u8], now: i64) -> Result<Operator, Refusal> {
    let cert = profile::parse_one(der).map_err(Refusal::Profile)?;
    ca.check_issued(&cert).map_err(Refusal::WrongCa)?;
    let v = cert.validity();
    profile::check_validity(&cert, now, CLOCK_SKEW).map_err(|e| match e {
        OutsideValidity::NotYetValid => Refusal::NotYetValid(format!(
            "notBefore {} is more than {} s ahead of the guest clock",
            v.not_before,
            CLOCK_SKEW.as_secs()
        )),
        OutsideValidity::Expired => Refusal::Expired(format!("notAfter {}", v.not_after)),
    })?;
    profile::require_end_entity(&cert).map_err(Refusal::Profile)?;
    profile::require_purpose(&cert, Purpose::ClientAuth).map_err(Refusal::Profile)?;
    let uris = profile::uri_names(&cert).map_err(Refusal::Profile)?;
    let [uri] = uris.as_slice() else {
        return Err(Refusal::Role(format!(
            "{} URI names; an operator certificate has exactly one, {OPERATOR_URI_PREFIX}<name>:role:<role>",
            uris.len()
        )));
    };
    parse_operator_uri(uri)
}

/// Parses `urn:hop3:operator:<name>:role:<role>`.
pub fn parse_operator_uri(uri: &str) -> Result<Operator, Refusal> {
    let bad = || {
        Refusal::Role(format!(
            "the URI name is not {OPERATOR_URI_PREFIX}<name>:role:<reader|operator>"
        ))
    };
    let rest = uri.strip_prefix(OPERATOR_URI_PREFIX).ok_or_else(bad)?;
    let (name, role) = rest.split_once(":role:").ok_or_else(bad)?;
    let name_ok = (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b));
    if !name_ok {
        return Err(bad());
    }
    let role = match role {
        "reader" => Role::Reader,
        "operator" => Role::Operator,
        other => {
            return Err(Refusal::Role(format!(
                "role {other:?} is not one this guest accepts (reader, operator)"
            )))
        }
    };
    Ok(Operator {
        name: name.to_owned(),
        role,
    })
}

/// The profile above as the client verifier's check, on every handshake.
#[derive(Debug)]
pub struct OperatorCheck(pub ManagementCa);

impl PeerCheck for OperatorCheck {
    fn check(&self, end_entity: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        // The guest's own clock (rustls passes the same, but say which one decides).
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        check_operator(&self.0, end_entity, now)
            .map(|_| ())
            .map_err(Refusal::into_rustls)
    }
}

/// The client verifier: operators of `ca` (its subject as the certificate request's hint),
/// their `CertificateVerify` checked with our provider's one scheme.
pub fn operator_verifier(ca: ManagementCa) -> PeerVerifier<OperatorCheck> {
    let subject = ca.subject_der().to_vec();
    PeerVerifier::new(OperatorCheck(ca), super::crypto::ALGORITHMS).with_root_hint(&subject)
}

/// The guest's key as a rustls signing key: signatures come from the key store.
#[derive(Debug)]
pub struct MachineSigner(pub Arc<dyn MachineKey>);

impl std::fmt::Debug for dyn MachineKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MachineKey(<in the key store>)")
    }
}

impl SigningKey for MachineSigner {
    fn choose_scheme(&self, offered: &[SignatureScheme]) -> Option<Box<dyn Signer>> {
        offered
            .contains(&SignatureScheme::ECDSA_NISTP256_SHA256)
            .then(|| Box::new(MachineSignerOnce(self.0.clone())) as Box<dyn Signer>)
    }

    fn algorithm(&self) -> SignatureAlgorithm {
        SignatureAlgorithm::ECDSA
    }
}

#[derive(Debug)]
struct MachineSignerOnce(Arc<dyn MachineKey>);

impl Signer for MachineSignerOnce {
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        self.0
            .sign_der(message)
            .map_err(|e| rustls::Error::General(format!("the key store cannot sign: {e}")))
    }

    fn scheme(&self) -> SignatureScheme {
        SignatureScheme::ECDSA_NISTP256_SHA256
    }
}

/// The enrolled certificate in force, swapped as a whole on re-enrollment
/// ([`super::Handle::rotate`]): every handshake reads it afresh.
#[derive(Debug)]
pub struct Enrolled(std::sync::RwLock<Arc<CertifiedKey>>);

impl Enrolled {
    /// The certificate and the key-store signer for it.
    pub fn new(cert_der: Vec<u8>, key: Arc<dyn MachineKey>) -> Enrolled {
        Enrolled(std::sync::RwLock::new(certified(cert_der, key)))
    }

    /// From now on, handshakes present `cert_der` signed by `key`.
    pub fn replace(&self, cert_der: Vec<u8>, key: Arc<dyn MachineKey>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = certified(cert_der, key);
    }
}

fn certified(cert_der: Vec<u8>, key: Arc<dyn MachineKey>) -> Arc<CertifiedKey> {
    Arc::new(CertifiedKey::new(
        vec![CertificateDer::from(cert_der)],
        Arc::new(MachineSigner(key)),
    ))
}

impl ResolvesServerCert for Enrolled {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

/// The server configuration: TLS 1.3 only, our provider, the enrolled certificate (from
/// `enrolled`, read per handshake) signed through the key store, operators of `ca` only.
pub fn server_config(
    enrolled: Arc<Enrolled>,
    ca: ManagementCa,
) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(super::crypto::provider()))
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(Arc::new(operator_verifier(ca)))
        .with_cert_resolver(enrolled);
    let mut config = config;
    // No resumption: every connection is a full handshake, so the operator's certificate
    // is verified (CA, validity, role) each time, and nothing of a revoked identity's
    // sessions survives a rotation.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::enroll::ca::tests::TestCa;
    use crate::enroll::keystore::P256Key;

    fn now() -> i64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
    }

    fn operator_cert(
        ca: &TestCa,
        uris: &[&str],
        edit: impl FnOnce(&mut rcgen::CertificateParams),
    ) -> Vec<u8> {
        let key = P256Key::generate("test").unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.serial_number = Some(vec![7].into());
        p.subject_alt_names = uris
            .iter()
            .map(|u| rcgen::SanType::URI(u.to_string().try_into().unwrap()))
            .collect();
        p.is_ca = rcgen::IsCa::ExplicitNoCa;
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let t = SystemTime::now();
        p.not_before = (t - std::time::Duration::from_secs(60)).into();
        p.not_after = (t + std::time::Duration::from_secs(3600)).into();
        edit(&mut p);
        ca.issue(p, &key)
    }

    #[test]
    fn the_operator_profile_admits_one_role_from_the_pinned_ca() {
        let ca = TestCa::new("management CA");
        let ok = operator_cert(&ca, &["urn:hop3:operator:alice:role:operator"], |_| {});
        assert_eq!(
            check_operator(&ca.pin, &ok, now()).unwrap(),
            Operator {
                name: "alice".into(),
                role: Role::Operator
            }
        );
        let rogue = TestCa::new("management CA");
        let other = operator_cert(&rogue, &["urn:hop3:operator:alice:role:operator"], |_| {});
        assert!(matches!(
            check_operator(&ca.pin, &other, now()),
            Err(Refusal::WrongCa(_))
        ));
        let two = operator_cert(
            &ca,
            &[
                "urn:hop3:operator:alice:role:reader",
                "urn:hop3:operator:alice:role:operator",
            ],
            |_| {},
        );
        assert!(matches!(
            check_operator(&ca.pin, &two, now()),
            Err(Refusal::Role(_))
        ));
        let server_only = operator_cert(&ca, &["urn:hop3:operator:a:role:operator"], |p| {
            p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth]
        });
        assert!(matches!(
            check_operator(&ca.pin, &server_only, now()),
            Err(Refusal::Profile(_))
        ));
        // Expired now; fine an hour ago; 20 minutes before notBefore is too early.
        assert!(matches!(
            check_operator(&ca.pin, &ok, now() + 3601),
            Err(Refusal::Expired(_))
        ));
        assert!(matches!(
            check_operator(&ca.pin, &ok, now() - 60 - 20 * 60),
            Err(Refusal::NotYetValid(_))
        ));
    }

    #[test]
    fn roles_and_names_are_strict() {
        for bad in [
            "urn:hop3:operator:alice",
            "urn:hop3:operator::role:operator",
            "urn:hop3:operator:al ice:role:operator",
            "urn:hop3:operator:alice:role:admin",
            "urn:hop3:workspace:alice:role:operator",
        ] {
            assert!(parse_operator_uri(bad).is_err(), "{bad}");
        }
        let r = parse_operator_uri("urn:hop3:operator:ci-bot@team.a:role:reader").unwrap();
        assert_eq!(r.role, Role::Reader);
        assert!(r.role.allows("status"));
        assert!(!r.role.allows("exec") && !r.role.allows("stop"));
        assert!(Role::Operator.allows("exec") && Role::Operator.allows("stop"));
    }
}
