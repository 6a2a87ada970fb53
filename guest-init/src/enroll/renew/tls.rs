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
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::ResolvesClientCert;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::io::AsyncWriteExt;
use x509_parser::prelude::*;

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
    let (rest, cert) =
        X509Certificate::from_der(der).map_err(|e| format!("not a DER X.509 certificate: {e}"))?;
    if !rest.is_empty() {
        return Err("bytes follow the certificate".into());
    }
    ca.check_issued(&cert)?;
    let now_s = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let v = cert.validity();
    if v.not_before.timestamp() - now_s > CLOCK_SKEW.as_secs() as i64 {
        return Err(format!("not valid yet (notBefore {})", v.not_before));
    }
    if v.not_after.timestamp() <= now_s {
        return Err(format!("expired (notAfter {})", v.not_after));
    }
    if cert
        .basic_constraints()
        .map_err(|e| format!("basicConstraints malformed: {e}"))?
        .is_some_and(|b| b.value.ca)
    {
        return Err("it is a CA certificate".into());
    }
    let eku = cert
        .extended_key_usage()
        .map_err(|e| format!("extendedKeyUsage malformed: {e}"))?
        .ok_or("it has no extendedKeyUsage (serverAuth needed)")?;
    if !eku.value.server_auth {
        return Err("extendedKeyUsage lacks serverAuth".into());
    }
    let mut names = Vec::new();
    let san = cert
        .subject_alternative_name()
        .map_err(|e| format!("subjectAltName malformed: {e}"))?;
    for n in san.iter().flat_map(|s| s.value.general_names.iter()) {
        names.push(match n {
            GeneralName::URI(u) => u.to_string(),
            other => format!("{other}"),
        });
    }
    if names != [SERVICE_URI] {
        return Err(format!("it names {names:?}, not exactly [{SERVICE_URI:?}]"));
    }
    Ok(())
}

#[derive(Debug)]
struct ServiceVerifier(ManagementCa);

impl ServerCertVerifier for ServiceVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        check_service(&self.0, end_entity, SystemTime::now())
            .map(|()| ServerCertVerified::assertion())
            .map_err(|e| rustls::Error::General(format!("the service's certificate: {e}")))
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls12NotOffered,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &crate::agent::crypto::ALGORITHMS,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        crate::agent::crypto::ALGORITHMS.supported_schemes()
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
            .with_custom_certificate_verifier(Arc::new(ServiceVerifier(ca.clone())))
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
