//! The renewal endpoint: mutual TLS 1.3 on the same per-VM socket as enrollment.
//!
//! A connection whose first byte is a TLS handshake record (`0x16`) is a renewal; anything
//! else is the enrollment protocol (its requests start with `{`). The service presents a
//! server certificate from its own CA (one URI, [`SERVICE_URI`], `serverAuth`) and demands
//! a client certificate, checked by rustls' webpki verifier (ring): chained to the CA,
//! within validity, `clientAuth`. Then, in order, each refusal with its own code:
//! 1. the request is `{"v":1,"op":"renew","csr":...}` (`bad_request`);
//! 2. the client certificate names exactly one workload identity URI
//!    (`identity_mismatch`), and its VM is the VM whose socket the connection arrived on
//!    (`identity_mismatch`);
//! 3. that identity is the workspace's *current* identity, by a fresh lookup
//!    (`identity_changed`, final: the VM was reset or its epoch raised; `unavailable`
//!    during an outage);
//! 4. the CSR's signature verifies under its own key (proof of possession, `bad_request`);
//!    its key is the client certificate's key (`csr_mismatch`: renewal never moves an
//!    identity to another key) and its only URI is the same identity (`identity_mismatch`);
//! 5. a certificate for that identity and key is issued with the usual profile and
//!    lifetime. No token and no ledger entry is involved: the ledger binds *tokens*, and
//!    the authority here is the enrolled key.
//!
//! Every renewal is recorded ([`RequestRecord::renewal`]); a failed handshake is recorded
//! with `denied`.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use guest_init::enroll::identity::Identity;
use guest_init::enroll::protocol::{self, ErrorCode, Response};
use guest_init::enroll::renew::tls::{RenewRequest, OP_RENEW, SERVICE_URI};
use rcgen::CertificateSigningRequestParams;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::AsyncWriteExt;
use x509_parser::prelude::*;

use super::{issue_client, lock, Inner, RequestRecord};

/// The TLS record type of a handshake: the first byte of a ClientHello.
const TLS_HANDSHAKE: u8 = 0x16;

/// The first byte of the connection, without consuming it; `None` on EOF, error or 10 s.
async fn peek_first(conn: &vm_transport::Conn) -> Option<u8> {
    for _ in 0..2000 {
        let mut b = [0u8; 1];
        // SAFETY: `recv` writes at most one byte into `b`, a live stack buffer, on a
        // descriptor `conn` owns for the duration of the call.
        let n = unsafe {
            libc::recv(
                conn.as_raw_fd(),
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            1 => return Some(b[0]),
            0 => return None,
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            _ => return None,
        }
    }
    None
}

impl Inner {
    /// A connection on a VM's socket: a renewal (TLS) or an enrollment (JSON).
    pub(super) async fn serve_any(self: Arc<Self>, conn: vm_transport::Conn, vm_uid: &str) {
        if peek_first(&conn).await == Some(TLS_HANDSHAKE) {
            self.serve_renewal(conn, vm_uid).await;
        } else {
            self.serve(conn, vm_uid).await;
        }
    }

    fn renew_tls(&self) -> Arc<rustls::ServerConfig> {
        self.renew_tls
            .get_or_init(|| {
                let (cert, key) = issue_client(
                    &self.issuer,
                    SERVICE_URI,
                    -60,
                    24 * 3600,
                    vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth],
                );
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let mut roots = rustls::RootCertStore::empty();
                roots
                    .add(CertificateDer::from(self.ca_der.clone()))
                    .expect("the service's CA is a valid anchor");
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider.clone(),
                )
                .build()
                .expect("client verifier");
                Arc::new(
                    rustls::ServerConfig::builder_with_provider(provider)
                        .with_protocol_versions(&[&rustls::version::TLS13])
                        .expect("TLS 1.3")
                        .with_client_cert_verifier(verifier)
                        .with_single_cert(
                            vec![CertificateDer::from(cert)],
                            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key)),
                        )
                        .expect("server certificate"),
                )
            })
            .clone()
    }

    async fn serve_renewal(self: Arc<Self>, conn: vm_transport::Conn, vm_uid: &str) {
        let mut record = RequestRecord {
            vm_uid: vm_uid.to_owned(),
            csr: None,
            code: None,
            cert: None,
            renewal: true,
        };
        let acceptor = tokio_rustls::TlsAcceptor::from(self.renew_tls());
        let mut tls =
            match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(conn)).await {
                Ok(Ok(t)) => t,
                _ => {
                    record.code = Some(ErrorCode::Denied);
                    lock(&self.requests).push(record);
                    return;
                }
            };
        let peer = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.to_vec())
            .unwrap_or_default();
        let resp = match tokio::time::timeout(
            Duration::from_secs(10),
            protocol::read_line(&mut tls, protocol::MAX_LINE),
        )
        .await
        {
            Ok(Ok(line)) => self.renew(&line, vm_uid, &peer, &mut record),
            _ => Response::error(ErrorCode::Timeout, "no request line within 10 s"),
        };
        record.code = resp.code;
        lock(&self.requests).push(record);
        let _ = tls.write_all(&resp.to_line()).await;
        let _ = tls.shutdown().await;
    }

    /// The renewal rules (module doc), on an authenticated connection from `peer`.
    fn renew(
        &self,
        line: &[u8],
        vm_uid: &str,
        peer: &[u8],
        record: &mut RequestRecord,
    ) -> Response {
        let Ok(req) = serde_json::from_slice::<RenewRequest>(line) else {
            return Response::error(ErrorCode::BadRequest, "not a renewal request");
        };
        if req.v != protocol::VERSION || req.op != OP_RENEW {
            return Response::error(ErrorCode::BadRequest, "expected v 1, op \"renew\"");
        }
        let Ok(csr_der) = base64::engine::general_purpose::STANDARD.decode(req.csr.as_bytes())
        else {
            return Response::error(ErrorCode::BadRequest, "csr is not base64");
        };
        record.csr = Some(csr_der.clone());
        if let Some(resp) = self.injected_failure() {
            return resp;
        }
        let Ok((_, client)) = X509Certificate::from_der(peer) else {
            return Response::error(ErrorCode::BadRequest, "client certificate unreadable");
        };
        let Some(identity) = only_uri(
            client
                .subject_alternative_name()
                .ok()
                .flatten()
                .map(|s| s.value),
        )
        .and_then(|u| Identity::from_uri(&u)) else {
            return Response::error(
                ErrorCode::IdentityMismatch,
                "the client certificate names no single workload identity",
            );
        };
        if identity.vm_uid != vm_uid {
            return Response::error(
                ErrorCode::IdentityMismatch,
                format!(
                    "the client certificate is VM {}'s, the connection came from VM {vm_uid}",
                    identity.vm_uid
                ),
            );
        }
        if let Err(resp) = self.controller.check(&identity, "renewal") {
            return resp;
        }
        let params = match CertificateSigningRequestParams::from_der(&csr_der.as_slice().into()) {
            Ok(p) => p,
            Err(e) => {
                return Response::error(
                    ErrorCode::BadRequest,
                    format!("CSR rejected (proof of possession): {e}"),
                )
            }
        };
        let Ok((_, csr)) = X509CertificationRequest::from_der(&csr_der) else {
            return Response::error(ErrorCode::BadRequest, "CSR unreadable");
        };
        let info = &csr.certification_request_info;
        if info.subject_pki.raw != client.public_key().raw {
            return Response::error(
                ErrorCode::CsrMismatch,
                "the CSR's key is not the client certificate's key (renewal keeps the key)",
            );
        }
        let csr_uri = csr.requested_extensions().and_then(|mut exts| {
            exts.find_map(|e| match e {
                ParsedExtension::SubjectAlternativeName(s) => only_uri(Some(s)),
                _ => None,
            })
        });
        if csr_uri.as_deref() != Some(identity.uri().as_str()) {
            return Response::error(
                ErrorCode::IdentityMismatch,
                "the CSR's identity is not the client certificate's",
            );
        }
        let lifetime = *lock(&self.cert_lifetime);
        match self.issue(params, &identity, self.now(), lifetime) {
            Ok((cert, _)) => {
                record.cert = Some(cert.clone());
                Response::ok(&cert)
            }
            Err(e) => Response::error(ErrorCode::Unavailable, format!("issue: {e}")),
        }
    }
}

/// The one URI of a subjectAltName with exactly one name.
fn only_uri(san: Option<&SubjectAlternativeName<'_>>) -> Option<String> {
    match san?.general_names.as_slice() {
        [GeneralName::URI(u)] => Some((*u).to_owned()),
        _ => None,
    }
}
