//! One renewal attempt: mutual TLS 1.3 to the enrollment service, one request line, one
//! answer line.
//!
//! **The guest's side of the handshake.** The client certificate is the enrolled
//! certificate in force; the `CertificateVerify` signature comes from the key store
//! ([`MachineSigner`]: a TPM key signs inside the TPM). The TLS stack is the agent's
//! pure-Rust provider ([`crate::agent::crypto`]): TLS 1.3 only, one suite, one group, ECDSA
//! P-256 SHA-256.
//!
//! **The service's certificate** ([`check_service`]) must be issued directly by the pinned
//! management CA (the CA recorded with the enrolled certificate), be within its validity
//! by the guest clock (the enrollment tolerance for a clock behind the CA), not be a CA,
//! have `extendedKeyUsage` `serverAuth`, and name exactly one URI, [`SERVICE_URI`]. A host
//! process answering on the enrollment port without such a certificate gets no request
//! (the handshake fails; the attempt is retryable, as an unreachable service is).
//!
//! **The request** (inside TLS): `{"v":1,"op":"renew","csr":"<base64 DER>"}`, a CSR built
//! afresh for the *same* key and identity, signed by the key. No token: the TLS client
//! certificate is the authority; the CSR proves possession of the key once more and tells
//! the service which key to certify, which it checks equals the client certificate's. The
//! answer is the enrollment protocol's response line, judged by [`parse_answer`].
//!
//! Threat: renewal by anyone but the enrolled machine (only the holder of the enrolled key
//! can complete the handshake), a rogue service learning the CSR or answering refusals (it
//! cannot complete the handshake without the CA's server certificate), and the private key
//! leaving the key store.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use peer_verify::profile::{self, OutsideValidity, Purpose};
use peer_verify::{PeerCheck, PeerVerifier};
use rustls::client::ResolvesClientCert;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::sign::CertifiedKey;
use rustls::SignatureScheme;
use tokio::io::AsyncWriteExt;

use crate::agent::tls::MachineSigner;
use crate::enroll::ca::ManagementCa;
use crate::enroll::client::{parse_answer, AttemptError};
use crate::enroll::keystore::MachineKey;
use crate::enroll::protocol::{self, ErrorCode};
use crate::enroll::verify::CLOCK_SKEW;
use vm_transport::Endpoint;

/// The one URI name of the enrollment service's TLS server certificate.
pub const SERVICE_URI: &str = "urn:hop3:enrollment-service";

/// The renewal operation.
pub const OP_RENEW: &str = "renew";

/// The renewal request (no token: the client certificate authenticates).
#[derive(serde::Serialize, serde::Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    /// Protocol version ([`protocol::VERSION`]).
    pub v: u32,
    /// [`OP_RENEW`].
    pub op: String,
    /// The fresh CSR, standard base64 of its DER.
    pub csr: String,
}

/// Checks the service's server certificate (see the module doc); `Err` says why.
pub fn check_service(ca: &ManagementCa, der: &[u8], now: SystemTime) -> Result<(), String> {
    let cert = profile::parse_one(der)?;
    ca.check_issued(&cert)?;
    let now_s = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let v = cert.validity();
    profile::check_validity(&cert, now_s, CLOCK_SKEW).map_err(|e| match e {
        OutsideValidity::NotYetValid => format!("not valid yet (notBefore {})", v.not_before),
        OutsideValidity::Expired => format!("expired (notAfter {})", v.not_after),
    })?;
    profile::require_end_entity(&cert)?;
    profile::require_purpose(&cert, Purpose::ServerAuth)?;
    let names = profile::san_names(&cert)?;
    if names != [SERVICE_URI] {
        return Err(format!("it names {names:?}, not exactly [{SERVICE_URI:?}]"));
    }
    Ok(())
}

/// [`check_service`] as the server verifier's check, by the guest clock, on every attempt.
#[derive(Debug)]
struct ServiceCheck(ManagementCa);

impl PeerCheck for ServiceCheck {
    fn check(&self, end_entity: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        check_service(&self.0, end_entity, SystemTime::now())
            .map_err(|e| rustls::Error::General(format!("the service's certificate: {e}")))
    }
}

/// The enrolled certificate, presented with the key store's signer.
#[derive(Debug)]
struct Presented(Arc<CertifiedKey>);

impl ResolvesClientCert for Presented {
    fn resolve(&self, _hints: &[&[u8]], schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        schemes
            .contains(&SignatureScheme::ECDSA_NISTP256_SHA256)
            .then(|| self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The client configuration for one attempt.
fn client_config(
    ca: &ManagementCa,
    cert_der: &[u8],
    key: Arc<dyn MachineKey>,
) -> Result<Arc<rustls::ClientConfig>, rustls::Error> {
    let certified = CertifiedKey::new(
        vec![CertificateDer::from(cert_der.to_vec())],
        Arc::new(MachineSigner(key)),
    );
    let mut config =
        rustls::ClientConfig::builder_with_provider(Arc::new(crate::agent::crypto::provider()))
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PeerVerifier::new(
                ServiceCheck(ca.clone()),
                crate::agent::crypto::ALGORITHMS,
            )))
            .with_client_cert_resolver(Arc::new(Presented(Arc::new(certified))));
    config.enable_sni = false;
    // Every attempt is a full handshake: a resumed session would skip the server
    // certificate check and present no client certificate.
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

/// One attempt under `timeout`: the renewed certificate (DER, not yet verified), or why not.
pub async fn attempt(
    service: &Endpoint,
    ca: &ManagementCa,
    cert_der: &[u8],
    key: Arc<dyn MachineKey>,
    csr_der: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, AttemptError> {
    let config = client_config(ca, cert_der, key).map_err(|e| AttemptError::Final {
        code: ErrorCode::BadRequest,
        message: format!("TLS setup: {e}"),
    })?;
    let run = async {
        let retry = AttemptError::Retryable;
        let conn = service
            .connect()
            .await
            .map_err(|e| retry(format!("cannot connect to {service}: {e}")))?;
        let name = ServerName::try_from("enrollment.invalid").expect("a valid DNS name");
        let mut tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, conn)
            .await
            .map_err(|e| retry(format!("TLS handshake with {service} failed: {e}")))?;
        let req = RenewRequest {
            v: protocol::VERSION,
            op: OP_RENEW.into(),
            csr: base64::engine::general_purpose::STANDARD.encode(csr_der),
        };
        let mut line = serde_json::to_vec(&req)
            .map_err(|e| retry(format!("cannot encode the request: {e}")))?;
        line.push(b'\n');
        tls.write_all(&line)
            .await
            .map_err(|e| retry(format!("sending to {service} failed: {e}")))?;
        tls.flush()
            .await
            .map_err(|e| retry(format!("sending to {service} failed: {e}")))?;
        let answer = protocol::read_line(&mut tls, protocol::MAX_LINE)
            .await
            .map_err(|e| retry(format!("reading the answer from {service} failed: {e}")))?;
        parse_answer(&answer, service)
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(r) => r,
        Err(_) => Err(AttemptError::Retryable(format!(
            "no answer from {service} within {} ms",
            timeout.as_millis()
        ))),
    }
}
