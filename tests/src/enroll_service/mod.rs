//! A reference enrollment service: a small CA and ledger with the rules of seed 002.
//!
//! It is a test fixture (never shipped), but its rules are real and the tests depend on
//! them:
//! - **Registration** ([`EnrollService::register`]) stores only the token's SHA-256 and its
//!   binding (workspace namespace/name/UID, VM UID, epoch) with an expiry; a lifetime above
//!   [`MAX_TOKEN_LIFETIME`] (15 minutes) is refused; re-registering the same token with the
//!   same binding and expiry is idempotent, any rebinding or expiry change is refused.
//! - **The caller's VM is learnt out of band**: each registered VM gets its own listening
//!   socket ([`EnrollService::listen_vm`]); host-relay connects to the calling VM's
//!   socket, so which socket a connection arrived on *is* the calling VM. It must equal
//!   the token's VM UID (`identity_mismatch` otherwise).
//! - **Proof of possession**: the CSR's signature must verify under its own public key
//!   (rcgen's `CertificateSigningRequestParams::from_der` checks it), and its only URI SAN
//!   must be the binding's identity URI.
//! - **First CSR wins, atomically**: under the ledger lock, the first valid CSR's SHA-256
//!   and its certificate are committed; an identical CSR gets the identical certificate
//!   bytes; any other CSR gets `csr_mismatch`.
//! - **Expiry** of the token is checked on every request, retries included (`expired`).
//! - **Current identity**: every request, retries included, looks up the workspace's
//!   current VM UID and epoch afresh from a controller stand-in ([`current`]); a token
//!   bound to anything else gets `identity_changed` (final), before anything is issued. An
//!   outage of the lookup fails closed with `unavailable` (retryable, nothing issued).
//! - **A retry needs an unexpired issued certificate**: an identical CSR gets the committed
//!   certificate only while that certificate's `notAfter` is ahead (`expired` otherwise).
//! - **Rechecked after commit**: before answering, the service looks up the current
//!   identity again and rereads its clock (token and certificate expiry), so a reset, an
//!   epoch raise or an expiry while the request was being issued withholds the certificate
//!   (the same codes, the message says it was withheld). The commit stays: a later retry
//!   is judged by the same rules.
//! - **Capacity**: with [`EnrollService::set_capacity`], a ledger holding that many
//!   committed certificates denies a new commit with `capacity_exhausted` (final); it never
//!   evicts a credential to make room. Answering an identical CSR needs no room.
//!
//! - **Renewal** ([`renew`]): on the same per-VM socket, mutual TLS 1.3 with the enrolled
//!   certificate; the current identity is checked on every renewal, and the CSR's key must
//!   be the client certificate's.
//!
//! Test hooks: [`EnrollService::advance_clock`] moves the service's clock forward,
//! [`EnrollService::stall_after_commit`] makes the next request stall after its commit and
//! before its answer (a guest killed "between send and receive", or a reset during
//! issuance), [`EnrollService::fail_next`] answers the next requests with a retryable code,
//! [`EnrollService::set_current`] / [`EnrollService::remove_current`] /
//! [`EnrollService::set_identity_outage`] drive the current-identity source,
//! [`EnrollService::set_cert_lifetime`] shortens issued certificates. Every request is
//! recorded ([`EnrollService::requests`]) with its CSR, never its token.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use guest_init::enroll::identity::Identity;
use guest_init::enroll::protocol::ErrorCode;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use sha2::{Digest, Sha256};
use vm_transport::Endpoint;

pub mod current;
mod renew;
mod rules;

use current::Controller;
pub use current::CurrentIdentity;

/// The longest token lifetime the service registers.
pub const MAX_TOKEN_LIFETIME: Duration = Duration::from_secs(15 * 60);

/// How long issued certificates are valid by default ([`EnrollService::set_cert_lifetime`]).
pub const CERT_LIFETIME: Duration = Duration::from_secs(24 * 3600);

/// A registration or setup failure.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The lifetime is above 15 minutes.
    #[error("token lifetime {0:?} exceeds the 15-minute maximum")]
    LifetimeTooLong(Duration),
    /// The token is registered with another binding or expiry.
    #[error("token already registered with another binding or expiry")]
    Rebind,
    /// The CA could not be created.
    #[error("CA: {0}")]
    Ca(String),
}

/// One token's ledger entry: hash-keyed, binding, expiry, committed result.
struct Entry {
    binding: Identity,
    expires_at: u64,
    committed: Option<Committed>,
}

/// The first CSR's hash and the certificate issued for it.
#[derive(Clone)]
struct Committed {
    csr_hash: [u8; 32],
    cert: Vec<u8>,
    /// The certificate's `notAfter`, Unix seconds.
    not_after: u64,
}

/// What the service saw in one request (no token).
#[derive(Clone, Debug)]
pub struct RequestRecord {
    /// The VM whose socket the connection arrived on.
    pub vm_uid: String,
    /// The CSR DER, if the request was well formed.
    pub csr: Option<Vec<u8>>,
    /// The answer's code (`None` for success).
    pub code: Option<ErrorCode>,
    /// The certificate returned, on success.
    pub cert: Option<Vec<u8>>,
    /// A renewal over mutual TLS (not an enrollment with a token).
    pub renewal: bool,
}

struct Inner {
    issuer: Issuer<'static, KeyPair>,
    ca_der: Vec<u8>,
    ledger: Mutex<HashMap<[u8; 32], Entry>>,
    controller: Controller,
    capacity: Mutex<Option<usize>>,
    cert_lifetime: Mutex<Duration>,
    clock_offset: Mutex<Duration>,
    stall: Mutex<Option<Arc<tokio::sync::Notify>>>,
    stalling: Mutex<Option<Arc<tokio::sync::Notify>>>,
    stalled: Mutex<u32>,
    fail_next: Mutex<(u32, ErrorCode)>,
    requests: Mutex<Vec<RequestRecord>>,
    /// The renewal endpoint's TLS configuration, made on first use ([`renew`]).
    renew_tls: std::sync::OnceLock<Arc<rustls::ServerConfig>>,
}

/// The reference enrollment service. Runs its own tokio runtime.
pub struct EnrollService {
    inner: Arc<Inner>,
    rt: Option<tokio::runtime::Runtime>,
    sockets: Mutex<Vec<PathBuf>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl EnrollService {
    /// A new service with a fresh P-256 CA.
    pub fn start() -> Result<EnrollService, ServiceError> {
        let ca_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| ServiceError::Ca(e.to_string()))?;
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "reference enrollment CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = params
            .self_signed(&ca_key)
            .map_err(|e| ServiceError::Ca(e.to_string()))?;
        let ca_der = ca.der().to_vec();
        let issuer = Issuer::new(params, ca_key);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| ServiceError::Ca(e.to_string()))?;
        Ok(EnrollService {
            inner: Arc::new(Inner {
                issuer,
                ca_der,
                ledger: Mutex::new(HashMap::new()),
                controller: Controller::default(),
                capacity: Mutex::new(None),
                cert_lifetime: Mutex::new(CERT_LIFETIME),
                clock_offset: Mutex::new(Duration::ZERO),
                stall: Mutex::new(None),
                stalling: Mutex::new(None),
                stalled: Mutex::new(0),
                fail_next: Mutex::new((0, ErrorCode::Unavailable)),
                requests: Mutex::new(Vec::new()),
                renew_tls: std::sync::OnceLock::new(),
            }),
            rt: Some(rt),
            sockets: Mutex::new(Vec::new()),
        })
    }

    /// The CA certificate (DER).
    pub fn ca_der(&self) -> &[u8] {
        &self.inner.ca_der
    }

    /// The CA certificate as the bootstrap material's `management_ca` pins it: standard
    /// base64 of its DER.
    pub fn management_ca_b64(&self) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(&self.inner.ca_der)
    }

    /// The bootstrap document the platform stages or pushes for `binding` (the format in
    /// `docs/ENROLLMENT.md`), with the token and the expiry [`EnrollService::register`]
    /// returned, pinning this service's CA.
    pub fn material_json(
        &self,
        token: &str,
        binding: &Identity,
        expires_at: u64,
        enrollment_port: u32,
    ) -> serde_json::Value {
        serde_json::json!({
            "version": 1,
            "workspace_namespace": binding.workspace_namespace,
            "workspace_name": binding.workspace_name,
            "workspace_uid": binding.workspace_uid,
            "vm_uid": binding.vm_uid,
            "revocation_epoch": binding.epoch,
            "token": token,
            "expires_at": expires_at,
            "enrollment_port": enrollment_port,
            "management_ca": self.management_ca_b64(),
        })
    }

    /// An operator client certificate for the agent, issued by this service's CA (the
    /// management CA): one URI name `uri` (e.g. `urn:hop3:operator:alice:role:operator`),
    /// `clientAuth`, valid from `from` to `to` seconds around now. Returns the certificate
    /// and its private key (PKCS#8), both DER.
    pub fn issue_operator(&self, uri: &str, from: i64, to: i64) -> (Vec<u8>, Vec<u8>) {
        self.issue_with_usages(
            uri,
            from,
            to,
            vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth],
        )
    }

    /// As [`EnrollService::issue_operator`], with these extended key usages instead of
    /// `clientAuth` (a certificate for another purpose).
    pub fn issue_with_usages(
        &self,
        uri: &str,
        from: i64,
        to: i64,
        usages: Vec<rcgen::ExtendedKeyUsagePurpose>,
    ) -> (Vec<u8>, Vec<u8>) {
        issue_client(&self.inner.issuer, uri, from, to, usages)
    }

    /// The service's current time (real time plus [`EnrollService::advance_clock`]).
    pub fn now(&self) -> u64 {
        self.inner.now()
    }

    /// Registers a token for `binding`, valid for `lifetime` from the service's now, and
    /// makes `binding` its workspace's current identity (the controller mints tokens for
    /// the identity it holds). Returns the expiry (Unix seconds) to put in the bootstrap
    /// material.
    pub fn register(
        &self,
        token: &str,
        binding: &Identity,
        lifetime: Duration,
    ) -> Result<u64, ServiceError> {
        if lifetime > MAX_TOKEN_LIFETIME {
            return Err(ServiceError::LifetimeTooLong(lifetime));
        }
        let expires_at = self.now() + lifetime.as_secs();
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut ledger = lock(&self.inner.ledger);
        match ledger.get(&hash) {
            Some(e) if e.binding == *binding && e.expires_at == expires_at => {
                self.inner.controller.set(binding);
                Ok(expires_at)
            }
            Some(_) => Err(ServiceError::Rebind),
            None => {
                self.inner.controller.set(binding);
                ledger.insert(
                    hash,
                    Entry {
                        binding: binding.clone(),
                        expires_at,
                        committed: None,
                    },
                );
                Ok(expires_at)
            }
        }
    }

    /// Listens for the VM `vm_uid` on a Unix socket at `path` (the per-VM endpoint the
    /// relay connects to).
    pub fn listen_vm(&self, vm_uid: &str, path: &Path) -> io::Result<()> {
        let rt = self.rt.as_ref().expect("runtime present until drop");
        let _guard = rt.enter();
        let _ = std::fs::remove_file(path);
        let listener = Endpoint::Unix(path.to_path_buf()).listen()?;
        lock(&self.sockets).push(path.to_path_buf());
        let inner = self.inner.clone();
        let vm = vm_uid.to_owned();
        rt.spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    continue;
                };
                let inner = inner.clone();
                let vm = vm.clone();
                tokio::spawn(async move { inner.serve_any(conn, &vm).await });
            }
        });
        Ok(())
    }

    /// The controller changes `identity`'s workspace: its current VM UID and epoch become
    /// `identity`'s (a reset gives a new VM UID, a revocation raises the epoch). Tokens
    /// bound to the previous identity are refused from the next lookup on.
    pub fn set_current(&self, identity: &Identity) {
        self.inner.controller.set(identity);
    }

    /// The controller forgets `identity`'s workspace (deleted): its tokens are refused.
    pub fn remove_current(&self, identity: &Identity) {
        self.inner.controller.remove(identity);
    }

    /// Takes the current-identity source down (`true`) or back up. While it is down every
    /// request fails closed with the retryable `unavailable`.
    pub fn set_identity_outage(&self, down: bool) {
        self.inner.controller.set_outage(down);
    }

    /// How many current-identity lookups the service has made (one before issuing, and
    /// one more after the commit for a request that got a certificate that far).
    pub fn identity_lookups(&self) -> u64 {
        self.inner.controller.lookups()
    }

    /// At most `n` committed certificates in the ledger; a new commit beyond that is
    /// denied with `capacity_exhausted`, never made room for by eviction.
    pub fn set_capacity(&self, n: usize) {
        *lock(&self.inner.capacity) = Some(n);
    }

    /// The validity of certificates issued from now on (default [`CERT_LIFETIME`]).
    pub fn set_cert_lifetime(&self, lifetime: Duration) {
        *lock(&self.inner.cert_lifetime) = lifetime;
    }

    /// Moves the service's clock forward.
    pub fn advance_clock(&self, by: Duration) {
        *lock(&self.inner.clock_offset) += by;
    }

    /// The next committed request stalls after its commit, before its answer, until
    /// [`EnrollService::release_stall`].
    pub fn stall_after_commit(&self) {
        let n = Arc::new(tokio::sync::Notify::new());
        *lock(&self.inner.stall) = Some(n.clone());
        *lock(&self.inner.stalling) = Some(n);
    }

    /// How many requests have stalled after their commit so far.
    pub fn stalled(&self) -> u32 {
        *lock(&self.inner.stalled)
    }

    /// Releases a stalled request (its answer then goes to whatever is left of the
    /// connection).
    pub fn release_stall(&self) {
        lock(&self.inner.stall).take();
        if let Some(n) = lock(&self.inner.stalling).take() {
            n.notify_one();
        }
    }

    /// The next `n` requests are answered with the retryable `code`.
    pub fn fail_next(&self, n: u32, code: ErrorCode) {
        *lock(&self.inner.fail_next) = (n, code);
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.inner.requests).clone()
    }

    /// The certificate committed for `token`, if any.
    pub fn committed_cert(&self, token: &str) -> Option<Vec<u8>> {
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        lock(&self.inner.ledger)
            .get(&hash)
            .and_then(|e| e.committed.as_ref().map(|c| c.cert.clone()))
    }
}

/// Signs a client certificate for a fresh P-256 key with `issuer`.
fn issue_client(
    issuer: &Issuer<'static, KeyPair>,
    uri: &str,
    from: i64,
    to: i64,
    usages: Vec<rcgen::ExtendedKeyUsagePurpose>,
) -> (Vec<u8>, Vec<u8>) {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("generate a key");
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::CommonName, "operator");
    p.subject_alt_names = vec![rcgen::SanType::URI(
        uri.to_owned().try_into().expect("an IA5 URI"),
    )];
    let at = |d: i64| {
        let now = std::time::SystemTime::now();
        if d >= 0 {
            now + Duration::from_secs(d as u64)
        } else {
            now - Duration::from_secs(d.unsigned_abs())
        }
    };
    p.not_before = at(from).into();
    p.not_after = at(to).into();
    p.is_ca = IsCa::ExplicitNoCa;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = usages;
    let cert = p
        .signed_by(&key, issuer)
        .expect("sign the operator certificate");
    (cert.der().to_vec(), key.serialize_der())
}

impl Drop for EnrollService {
    fn drop(&mut self) {
        self.release_stall();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
        for p in lock(&self.sockets).drain(..) {
            let _ = std::fs::remove_file(p);
        }
    }
}
