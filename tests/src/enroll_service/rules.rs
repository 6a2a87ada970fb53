//! The service's decisions for one request, in order: parse, token, expiry, current
//! identity, calling VM, CSR identity, then under the ledger lock the committed
//! certificate (unexpired) for an identical CSR, `csr_mismatch` for another, capacity, or
//! issue and commit; then, after the commit and before the answer, the current identity
//! and the clock again.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use guest_init::enroll::identity::Identity;
use guest_init::enroll::protocol::{self, ErrorCode, Request, Response};
use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyUsagePurpose, SanType,
};
use sha2::{Digest, Sha256};

use super::{lock, Committed, Inner, RequestRecord};

/// What a successful ledger decision hands to the answer: the certificate and what the
/// after-commit recheck needs.
struct Decision {
    cert: Vec<u8>,
    binding: Identity,
    token_expires_at: u64,
    cert_not_after: u64,
    stall: Option<Arc<tokio::sync::Notify>>,
}

impl Inner {
    pub(super) fn now(&self) -> u64 {
        (SystemTime::now() + *lock(&self.clock_offset))
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    }

    /// The [`super::EnrollService::fail_next`] hook: the next injected answer, if any.
    pub(super) fn injected_failure(&self) -> Option<Response> {
        let mut fail = lock(&self.fail_next);
        (fail.0 > 0).then(|| {
            fail.0 -= 1;
            Response::error(fail.1, "test hook: try again")
        })
    }

    pub(super) async fn serve(self: Arc<Self>, mut conn: vm_transport::Conn, vm_uid: &str) {
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
            renewal: false,
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
        if let Some(resp) = self.injected_failure() {
            return resp;
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
        let d = match self.commit(&token_hash, csr_hash, csr, vm_uid, self.now()) {
            Ok(d) => d,
            Err(resp) => return resp,
        };
        if let Some(n) = &d.stall {
            *lock(&self.stalled) += 1;
            n.notified().await;
        }
        if let Err(resp) = self.recheck(&d) {
            return resp;
        }
        record.cert = Some(d.cert.clone());
        Response::ok(&d.cert)
    }

    /// After the commit, before the answer: a fresh current-identity lookup and the clock
    /// read again. Any failure withholds the certificate (the commit stays).
    fn recheck(&self, d: &Decision) -> Result<(), Response> {
        const WHEN: &str = "certificate withheld after commit";
        self.controller.check(&d.binding, WHEN)?;
        let now = self.now();
        if now >= d.token_expires_at {
            return Err(Response::error(
                ErrorCode::Expired,
                format!("{WHEN}: the bootstrap token expired during issuance"),
            ));
        }
        if now >= d.cert_not_after {
            return Err(Response::error(
                ErrorCode::Expired,
                format!("{WHEN}: the issued certificate expired during issuance"),
            ));
        }
        Ok(())
    }

    /// The ledger decision, atomic under the ledger lock: checks expiry, the current
    /// identity, the calling VM and the CSR's identity, then returns the committed
    /// certificate (if unexpired) for an identical CSR, denies another CSR, denies when the
    /// ledger is full, or issues and commits the first one. Also hands out the stall hook
    /// to the request that commits.
    fn commit(
        &self,
        token_hash: &[u8; 32],
        csr_hash: [u8; 32],
        csr: CertificateSigningRequestParams,
        vm_uid: &str,
        now: u64,
    ) -> Result<Decision, Response> {
        let mut ledger = lock(&self.ledger);
        let committed_count = ledger.values().filter(|e| e.committed.is_some()).count();
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
        self.controller
            .check(&entry.binding, "refused before issuing")?;
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
        let decision = |c: &Committed, stall| Decision {
            cert: c.cert.clone(),
            binding: entry.binding.clone(),
            token_expires_at: entry.expires_at,
            cert_not_after: c.not_after,
            stall,
        };
        match &entry.committed {
            Some(c) if c.csr_hash == csr_hash => {
                if now >= c.not_after {
                    return Err(Response::error(
                        ErrorCode::Expired,
                        "the certificate issued for this CSR has expired; new material is needed",
                    ));
                }
                Ok(decision(c, None))
            }
            Some(_) => Err(Response::error(
                ErrorCode::CsrMismatch,
                "another CSR is already enrolled for this token",
            )),
            None => {
                if let Some(cap) = *lock(&self.capacity) {
                    if committed_count >= cap {
                        return Err(Response::error(
                            ErrorCode::CapacityExhausted,
                            format!(
                                "the ledger holds {committed_count} of {cap} certificates; \
                                 nothing is evicted to make room"
                            ),
                        ));
                    }
                }
                let lifetime = *lock(&self.cert_lifetime);
                match self.issue(csr, &entry.binding, now, lifetime) {
                    Ok((cert, not_after)) => {
                        let c = Committed {
                            csr_hash,
                            cert,
                            not_after,
                        };
                        let d = decision(&c, lock(&self.stall).take());
                        entry.committed = Some(c);
                        Ok(d)
                    }
                    Err(e) => Err(Response::error(
                        ErrorCode::Unavailable,
                        format!("issue: {e}"),
                    )),
                }
            }
        }
    }

    /// Signs the certificate; returns it and its `notAfter` (Unix seconds).
    pub(super) fn issue(
        &self,
        csr: CertificateSigningRequestParams,
        binding: &Identity,
        now: u64,
        lifetime: Duration,
    ) -> Result<(Vec<u8>, u64), rcgen::Error> {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, format!("vm {}", binding.vm_uid));
        params.subject_alt_names = vec![SanType::URI(binding.uri().try_into()?)];
        let start = now.saturating_sub(60);
        let not_after = start + lifetime.as_secs();
        params.not_before = (UNIX_EPOCH + Duration::from_secs(start)).into();
        params.not_after = (UNIX_EPOCH + Duration::from_secs(not_after)).into();
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
        Ok((csr.signed_by(&self.issuer)?.der().to_vec(), not_after))
    }
}
