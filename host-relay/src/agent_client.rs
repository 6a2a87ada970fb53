//! The host's client for a guest's agent (`host-relay agent ...`), with its peer-authorizer.
//!
//! The agent (guest-init, `docs/AGENT.md`) speaks mutual TLS 1.3: this client presents the
//! operator's certificate and key, sends one JSON request, and reads one JSON answer. It
//! reaches the guest through the VMM's hybrid vsock socket (`CONNECT <port>`), by CID under
//! kernel vhost-vsock, or on a Unix path (tests).
//!
//! **The peer-authorizer** ([`GuestAuthorizer`]) runs on every handshake, before any request
//! is sent, and refuses the guest unless
//! 1. its certificate is issued by the management CA (issuer name and signature, checked
//!    with ring through x509-parser) and is within its validity by the host clock;
//! 2. its only URI names exactly the *current* identity: workspace, VM UID and epoch read
//!    afresh, on this handshake, from the current-identity file the controller writes
//!    (JSON: `workspace_namespace`, `workspace_name`, `workspace_uid`, `vm_uid`, `epoch`).
//!    A file that cannot be read or parsed fails closed: no handshake, no request;
//! 3. it signed the handshake with that certificate's key (rustls, ring).
//!
//! Session resumption is off: a resumed TLS 1.3 session skips certificate verification,
//! which would let a guest whose epoch was raised since the first handshake through.
//!
//! Seed 000's rule is what this enforces: a certificate signature is not authorization to
//! an old generation. A guest still holding a certificate for a revoked epoch, or a reset
//! VM's predecessor, is refused by the operator's side even though the CA signed it.
//!
//! Threat: an operator command reaching a stale VM (old epoch, old VM UID), a rogue
//! endpoint impersonating the guest (another CA, or no proof of the key), and a broken or
//! missing current-identity source silently allowing everything.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use peer_verify::profile;
use peer_verify::{PeerCheck, PeerVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::SignatureScheme;
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use x509_parser::prelude::*;

/// The URI prefix of a workload identity.
pub const WORKLOAD_URI_PREFIX: &str = "urn:hop3:workspace:";

/// The current identity, as the controller writes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CurrentIdentity {
    /// Workspace namespace.
    pub workspace_namespace: String,
    /// Workspace name.
    pub workspace_name: String,
    /// Workspace UID.
    pub workspace_uid: String,
    /// VM UID.
    pub vm_uid: String,
    /// Revocation epoch.
    pub epoch: u64,
}

impl CurrentIdentity {
    /// Reads and checks the file; every failure names the file and fails closed.
    pub fn read(path: &Path) -> Result<CurrentIdentity, String> {
        let bytes = std::fs::read(path).map_err(|e| {
            format!(
                "current identity {}: cannot read: {e}; refusing the guest",
                path.display()
            )
        })?;
        let id: CurrentIdentity = serde_json::from_slice(&bytes).map_err(|e| {
            format!(
                "current identity {}: not the documented JSON ({e}); refusing the guest",
                path.display()
            )
        })?;
        for (field, v) in [
            ("workspace_namespace", &id.workspace_namespace),
            ("workspace_name", &id.workspace_name),
            ("workspace_uid", &id.workspace_uid),
            ("vm_uid", &id.vm_uid),
        ] {
            if v.is_empty()
                || !v
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
            {
                return Err(format!(
                    "current identity {}: {field} is empty or has characters outside A-Z a-z 0-9 - .; refusing the guest",
                    path.display()
                ));
            }
        }
        Ok(id)
    }

    /// The workload URI this identity has.
    pub fn uri(&self) -> String {
        format!(
            "{WORKLOAD_URI_PREFIX}{}/{}/{}:vm:{}:epoch:{}",
            self.workspace_namespace,
            self.workspace_name,
            self.workspace_uid,
            self.vm_uid,
            self.epoch
        )
    }
}

/// The peer-authorizer: management CA, validity, current identity, on every handshake.
#[derive(Debug)]
pub struct GuestAuthorizer {
    ca_der: Vec<u8>,
    current: PathBuf,
}

impl GuestAuthorizer {
    /// An authorizer for guests of the CA `ca_der` whose current identity is in `current`.
    pub fn new(ca_der: Vec<u8>, current: PathBuf) -> GuestAuthorizer {
        GuestAuthorizer { ca_der, current }
    }

    /// Checks a guest certificate now; `Err` says why it is refused.
    pub fn check(&self, der: &[u8]) -> Result<(), String> {
        let (_, ca) = X509Certificate::from_der(&self.ca_der)
            .map_err(|e| format!("the management CA certificate is unreadable: {e}"))?;
        let cert = profile::parse_one(der).map_err(|e| format!("the guest's certificate: {e}"))?;
        if cert.issuer().as_raw() != ca.subject().as_raw()
            || cert.verify_signature(Some(ca.public_key())).is_err()
        {
            return Err(format!(
                "the guest's certificate (issuer {}) is not from the management CA {}",
                cert.issuer(),
                ca.subject()
            ));
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        if profile::check_validity(&cert, now, Duration::ZERO).is_err() {
            let v = cert.validity();
            return Err(format!(
                "the guest's certificate is not valid now ({} to {})",
                v.not_before, v.not_after
            ));
        }
        let current = CurrentIdentity::read(&self.current)?;
        let want = current.uri();
        let uris =
            profile::uri_names(&cert).map_err(|e| format!("the guest's certificate: {e}"))?;
        if uris != [want.as_str()] {
            return Err(format!(
                "the guest's certificate names {uris:?}, but the current identity is {want} (an old epoch or another VM UID is not authorized)"
            ));
        }
        Ok(())
    }
}

impl PeerCheck for GuestAuthorizer {
    fn check(&self, end_entity: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        GuestAuthorizer::check(self, end_entity).map_err(rustls::Error::General)
    }
}

/// Where the guest's agent is.
#[derive(Clone, Debug)]
pub enum Target {
    /// The VMM's hybrid vsock socket and the agent's port.
    Hybrid(PathBuf, u32),
    /// Any endpoint `vm-transport` dials (vsock CID and port; a Unix path in tests).
    Endpoint(vm_transport::Endpoint),
}

/// A client call that did not produce an answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The inputs (certificates, key) are unusable.
    #[error("{0}")]
    Setup(String),
    /// The connection could not be made.
    #[error("cannot reach the agent: {0}")]
    Connect(std::io::Error),
    /// The handshake failed: the guest was refused, or it refused us.
    #[error("handshake refused: {0}")]
    Refused(std::io::Error),
    /// The exchange after the handshake failed.
    #[error("exchange: {0}")]
    Exchange(String),
}

/// The operator's credentials and what to trust.
pub struct Client {
    config: Arc<rustls::ClientConfig>,
}

impl Client {
    /// From PEM files: the operator's certificate and key, the management CA, and the
    /// current-identity file (read on every handshake).
    pub fn from_files(
        cert: &Path,
        key: &Path,
        ca: &Path,
        current: &Path,
    ) -> Result<Client, CallError> {
        use rustls::pki_types::pem::PemObject;
        let setup = |what: &str, p: &Path, e: &dyn std::fmt::Display| {
            CallError::Setup(format!("{what} {}: {e}", p.display()))
        };
        let chain = vec![CertificateDer::from_pem_file(cert)
            .map_err(|e| setup("operator certificate", cert, &e))?];
        let key = PrivateKeyDer::from_pem_file(key).map_err(|e| setup("operator key", key, &e))?;
        let ca_der = CertificateDer::from_pem_file(ca)
            .map_err(|e| setup("management CA", ca, &e))?
            .to_vec();
        Client::new(chain, key, ca_der, current.to_path_buf())
    }

    /// From DER.
    pub fn new(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        ca_der: Vec<u8>,
        current: PathBuf,
    ) -> Result<Client, CallError> {
        let provider = rustls::crypto::ring::default_provider();
        // The one scheme an enrolled guest key has: the only one offered and verified.
        let algorithms = peer_verify::only_scheme(
            provider.signature_verification_algorithms,
            SignatureScheme::ECDSA_NISTP256_SHA256,
        )
        .ok_or_else(|| CallError::Setup("ring lacks ECDSA P-256 SHA-256".into()))?;
        let verifier = PeerVerifier::new(GuestAuthorizer::new(ca_der, current), algorithms);
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| CallError::Setup(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(chain, key)
            .map_err(|e| CallError::Setup(format!("operator certificate and key: {e}")))?;
        let mut config = config;
        // No resumption: a resumed session skips the certificate checks, and the
        // peer-authorizer must judge the guest against the current identity on every
        // handshake (found by the VM test: a resumed session reached a revoked epoch).
        config.resumption = rustls::client::Resumption::disabled();
        Ok(Client {
            config: Arc::new(config),
        })
    }

    /// Sends one request line and returns the answer line.
    pub async fn call(&self, target: &Target, request: &str) -> Result<String, CallError> {
        let conn = match target {
            Target::Hybrid(uds, port) => {
                vm_transport::hybrid::connect(uds, *port, &Default::default()).await
            }
            Target::Endpoint(ep) => ep.connect().await,
        }
        .map_err(CallError::Connect)?;
        let connector = tokio_rustls::TlsConnector::from(self.config.clone());
        let name = ServerName::try_from("guest").unwrap_or_else(|_| unreachable!());
        let mut tls = tokio::time::timeout(Duration::from_secs(30), connector.connect(name, conn))
            .await
            .map_err(|_| CallError::Refused(std::io::Error::other("no handshake within 30 s")))?
            .map_err(CallError::Refused)?;
        tls.write_all(format!("{request}\n").as_bytes())
            .await
            .map_err(|e| CallError::Exchange(e.to_string()))?;
        let mut answer = String::new();
        tls.read_to_string(&mut answer)
            .await
            .map_err(|e| CallError::Exchange(e.to_string()))?;
        Ok(answer.trim_end().to_owned())
    }
}
