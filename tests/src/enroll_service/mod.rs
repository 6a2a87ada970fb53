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
//! - **Expiry** is checked on every request, retries included (`expired`).
//!
//! Test hooks: [`EnrollService::advance_clock`] moves the service's clock forward,
//! [`EnrollService::stall_after_commit`] makes the next request stall after its commit and
//! before its answer (a guest killed "between send and receive"),
//! [`EnrollService::fail_next`] answers the next requests with a retryable code. Every
//! request is recorded ([`EnrollService::requests`]) with its CSR, never its token.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use guest_init::enroll::identity::Identity;
use guest_init::enroll::protocol::{self, ErrorCode, Request, Response};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use sha2::{Digest, Sha256};
use vm_transport::Endpoint;

/// The longest token lifetime the service registers.
pub const MAX_TOKEN_LIFETIME: Duration = Duration::from_secs(15 * 60);

/// How long issued certificates are valid.
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
    committed: Option<([u8; 32], Vec<u8>)>,
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
}

struct Inner {
    issuer: Issuer<'static, KeyPair>,
    ca_der: Vec<u8>,
    ledger: Mutex<HashMap<[u8; 32], Entry>>,
    clock_offset: Mutex<Duration>,
    stall: Mutex<Option<Arc<tokio::sync::Notify>>>,
    stalling: Mutex<Option<Arc<tokio::sync::Notify>>>,
    stalled: Mutex<u32>,
    fail_next: Mutex<(u32, ErrorCode)>,
    requests: Mutex<Vec<RequestRecord>>,
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
                clock_offset: Mutex::new(Duration::ZERO),
                stall: Mutex::new(None),
                stalling: Mutex::new(None),
                stalled: Mutex::new(0),
                fail_next: Mutex::new((0, ErrorCode::Unavailable)),
                requests: Mutex::new(Vec::new()),
            }),
            rt: Some(rt),
            sockets: Mutex::new(Vec::new()),
        })
    }

    /// The CA certificate (DER).
    pub fn ca_der(&self) -> &[u8] {
        &self.inner.ca_der
    }

    /// The service's current time (real time plus [`EnrollService::advance_clock`]).
    pub fn now(&self) -> u64 {
        self.inner.now()
    }

    /// Registers a token for `binding`, valid for `lifetime` from the service's now.
    /// Returns the expiry (Unix seconds) to put in the bootstrap material.
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
            Some(e) if e.binding == *binding && e.expires_at == expires_at => Ok(expires_at),
            Some(_) => Err(ServiceError::Rebind),
            None => {
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
                tokio::spawn(async move { inner.serve(conn, &vm).await });
            }
        });
        Ok(())
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
            .and_then(|e| e.committed.as_ref().map(|c| c.1.clone()))
    }
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

impl Inner {
    fn now(&self) -> u64 {
        (SystemTime::now() + *lock(&self.clock_offset))
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    }

    async fn serve(self: Arc<Self>, mut conn: vm_transport::Conn, vm_uid: &str) {
        let line = tokio::time::timeout(
            Duration::from_secs(10),
            protocol::read_line(&mut conn, protocol::MAX_LINE),
        )
        .await;
        let mut record = RequestRecord {
            vm_uid: vm_uid.to_owned(),
            csr: None,
            code: None,
            cert: None,
        };
        let resp = match line {
            Err(_) => Response::error(ErrorCode::Timeout, "no request line within 10 s"),
            Ok(Err(e)) => Response::error(ErrorCode::BadRequest, format!("request line: {e}")),
            Ok(Ok(line)) => self.handle(&line, vm_uid, &mut record).await,
        };
        record.code = resp.code;
        lock(&self.requests).push(record);
        let _ = conn.write_all(&resp.to_line()).await;
        let _ = conn.shutdown_write();
    }

    async fn handle(&self, line: &[u8], vm_uid: &str, record: &mut RequestRecord) -> Response {
        let req: Request<'_> = match serde_json::from_slice(line) {
            Ok(r) => r,
            // serde's message may quote a value (the token): never echo it.
            Err(e) => {
                return Response::error(
                    ErrorCode::BadRequest,
                    format!("request is not protocol JSON (column {})", e.column()),
                )
            }
        };
        if req.v != protocol::VERSION {
            return Response::error(
                ErrorCode::UnsupportedVersion,
                format!("version {} unsupported; use {}", req.v, protocol::VERSION),
            );
        }
        if req.op != protocol::OP_ENROLL {
            return Response::error(ErrorCode::BadRequest, "op must be \"enroll\"");
        }
        let Ok(csr_der) = base64::engine::general_purpose::STANDARD.decode(req.csr.as_bytes())
        else {
            return Response::error(ErrorCode::BadRequest, "csr is not base64");
        };
        record.csr = Some(csr_der.clone());
        {
            let mut fail = lock(&self.fail_next);
            if fail.0 > 0 {
                fail.0 -= 1;
                return Response::error(fail.1, "test hook: try again");
            }
        }
        let token_hash: [u8; 32] = Sha256::digest(req.token.as_bytes()).into();
        drop(req);
        let csr_hash: [u8; 32] = Sha256::digest(&csr_der).into();
        // Proof of possession: the CSR's signature under its own key.
        let csr = match CertificateSigningRequestParams::from_der(&csr_der.as_slice().into()) {
            Ok(c) => c,
            Err(e) => {
                return Response::error(
                    ErrorCode::BadRequest,
                    format!("CSR rejected (proof of possession): {e}"),
                )
            }
        };
        let now = self.now();
        match self.commit(&token_hash, csr_hash, csr, vm_uid, now) {
            Ok((cert, stall)) => {
                if let Some(n) = stall {
                    *lock(&self.stalled) += 1;
                    n.notified().await;
                }
                record.cert = Some(cert.clone());
                Response::ok(&cert)
            }
            Err(resp) => resp,
        }
    }

    /// The ledger decision, atomic under the ledger lock: checks expiry, the calling VM and
    /// the CSR's identity, then returns the committed certificate for an identical CSR,
    /// denies another CSR, or issues and commits the first one. Also hands out the stall
    /// hook to the request that commits.
    #[allow(clippy::type_complexity)]
    fn commit(
        &self,
        token_hash: &[u8; 32],
        csr_hash: [u8; 32],
        csr: CertificateSigningRequestParams,
        vm_uid: &str,
        now: u64,
    ) -> Result<(Vec<u8>, Option<Arc<tokio::sync::Notify>>), Response> {
        let mut ledger = lock(&self.ledger);
        let Some(entry) = ledger.get_mut(token_hash) else {
            return Err(Response::error(
                ErrorCode::Denied,
                "unknown bootstrap token",
            ));
        };
        if now >= entry.expires_at {
            return Err(Response::error(
                ErrorCode::Expired,
                "bootstrap token expired",
            ));
        }
        if entry.binding.vm_uid != vm_uid {
            return Err(Response::error(
                ErrorCode::IdentityMismatch,
                "the calling VM is not the token's VM",
            ));
        }
        let uris: Vec<String> = csr
            .params
            .subject_alt_names
            .iter()
            .filter_map(|s| match s {
                SanType::URI(u) => Some(u.as_str().to_owned()),
                _ => None,
            })
            .collect();
        if uris != [entry.binding.uri()] {
            return Err(Response::error(
                ErrorCode::IdentityMismatch,
                "the CSR's identity URI does not match the token's binding",
            ));
        }
        match &entry.committed {
            Some((h, cert)) if *h == csr_hash => Ok((cert.clone(), None)),
            Some(_) => Err(Response::error(
                ErrorCode::CsrMismatch,
                "another CSR is already enrolled for this token",
            )),
            None => match self.issue(csr, &entry.binding, now) {
                Ok(cert) => {
                    entry.committed = Some((csr_hash, cert.clone()));
                    Ok((cert, lock(&self.stall).take()))
                }
                Err(e) => Err(Response::error(
                    ErrorCode::Unavailable,
                    format!("issue: {e}"),
                )),
            },
        }
    }

    fn issue(
        &self,
        csr: CertificateSigningRequestParams,
        binding: &Identity,
        now: u64,
    ) -> Result<Vec<u8>, rcgen::Error> {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, format!("vm {}", binding.vm_uid));
        params.subject_alt_names = vec![SanType::URI(binding.uri().try_into()?)];
        let start = UNIX_EPOCH + Duration::from_secs(now.saturating_sub(60));
        params.not_before = start.into();
        params.not_after = (start + CERT_LIFETIME).into();
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let mut serial = [0u8; 16];
        serial.copy_from_slice(&Sha256::digest(format!("{now}{}", binding.uri()))[..16]);
        serial[0] &= 0x7f;
        params.serial_number = Some(serial.to_vec().into());
        let csr = CertificateSigningRequestParams {
            params,
            public_key: csr.public_key,
        };
        Ok(csr.signed_by(&self.issuer)?.der().to_vec())
    }
}
