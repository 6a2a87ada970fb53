//! The agent: an authenticated management channel into the VM.
//!
//! The control port ([`crate::control`]) trusts whoever reaches it from the host, and can
//! only stop the VM. The agent is the management surface that does more (`status`,
//! `stop`, `exec`), so it authenticates both ends with mutual TLS 1.3:
//! - the guest presents its **enrolled certificate**, signing through the key store (a TPM
//!   key never leaves the TPM) — [`tls`];
//! - the client must present an **operator certificate** issued by the **pinned
//!   management CA** of the bootstrap material, naming a role that allows the operation —
//!   [`tls`];
//! - one JSON request and one JSON answer per stream — [`ops`], with `exec` in [`exec`]
//!   and [`jobs`];
//! - the crypto is our own small RustCrypto provider, no C — [`crypto`].
//!
//! The listener (usually vsock, e.g. port 1025) admits only the host: vsock peer CID 2, as
//! the control port does ([`crate::control::admit`]); a Unix path (tests) is created
//! `0600`. Every refusal is logged with the peer and its own reason: not the host, no
//! client certificate, wrong CA, expired, not an operator certificate, no accepted role
//! (all at the handshake, as the matching TLS alert), role not allowed for the operation,
//! malformed request (after it, as a JSON error). A handshake must finish within
//! [`HANDSHAKE_TIMEOUT`] and the request arrive within [`REQUEST_TIMEOUT`].
//!
//! Threat model (docs/AGENT.md has the whole of it): any host process can connect to the
//! VM's vsock ports, so reaching the port proves nothing; the operator's certificate is
//! what authorizes, and the guest's certificate is what tells the operator it reached the
//! VM it meant (the host side checks it against the current identity).

pub mod crypto;
pub mod exec;
pub mod jobs;
pub mod ops;
pub mod tls;

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc::UnboundedSender;

use crate::enroll::ca::ManagementCa;
use crate::enroll::keystore::MachineKey;
use ops::{Answer, Code, Op};
use vm_transport::{Endpoint, Peer};

/// How long a client may take to finish the handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send its request after the handshake.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The `agent` section of the configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// Where to listen, e.g. `{"vsock": {"cid": 4294967295, "port": 1025}}`.
    pub listen: Endpoint,
    /// Users `exec` may run as, by name (root only if listed). Empty: no `exec`.
    #[serde(default)]
    pub exec_users: Vec<String>,
}

/// Checks the section; `Err` names the field.
pub fn validate(cfg: &AgentConfig) -> Result<(), String> {
    cfg.listen.validate().map_err(|e| format!("listen: {e}"))?;
    if let Endpoint::Tcp(_) = cfg.listen {
        return Err("listen: TCP is not allowed (any peer could reach it); use vsock".into());
    }
    for u in &cfg.exec_users {
        let ok = !u.is_empty()
            && u.len() <= 32
            && u.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !ok {
            return Err(format!("exec_users: {u:?} is not a user name"));
        }
    }
    Ok(())
}

/// The identity the agent serves as: one generation, replaced whole on re-enrollment
/// ([`Handle::rotate`]).
pub struct Served {
    /// The enrolled certificate (DER).
    pub cert_der: Vec<u8>,
    /// The enrolled key, in its key store.
    pub key: Arc<dyn MachineKey>,
    /// The identity URI.
    pub identity: String,
    /// The revocation epoch.
    pub epoch: u64,
    /// The certificate's `notAfter`, Unix seconds.
    pub not_after: i64,
}

impl Served {
    /// The identity enrollment left in force.
    pub fn from_credentials(c: crate::enroll::Credentials) -> Served {
        let not_after = x509_parser::parse_x509_certificate(&c.cert_der)
            .map(|(_, x)| x.validity().not_after.timestamp())
            .unwrap_or(0);
        Served {
            identity: c.identity.uri(),
            epoch: c.identity.epoch,
            not_after,
            cert_der: c.cert_der,
            key: c.key,
        }
    }
}

/// What the agent serves with: the enrolled credentials and the VM's state.
pub struct Context {
    /// The identity in force.
    pub served: Served,
    /// The pinned management CA.
    pub ca: ManagementCa,
    /// When guest-init started.
    pub started: Instant,
    /// Asks the supervisor for the orderly shutdown.
    pub stop: UnboundedSender<()>,
    /// Users `exec` may run as.
    pub exec_users: Vec<String>,
}

/// An agent that could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The listener.
    #[error("agent.listen: cannot listen at {endpoint}: {source}")]
    Listen {
        /// Where.
        endpoint: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The TLS configuration.
    #[error("agent: TLS setup: {0}")]
    Tls(#[from] rustls::Error),
}

/// One generation of the served identity, as connections see it. Each connection holds
/// its generation for as long as it lives, which is how a rotation knows when the old
/// identity's connections are all gone.
struct Generation {
    no: u64,
    identity: String,
    epoch: u64,
    not_after: i64,
}

/// What the accept loop, the connections and [`Handle`] share.
struct Shared {
    enrolled: Arc<tls::Enrolled>,
    current: std::sync::RwLock<Arc<Generation>>,
    /// Held (read) while a connection is admitted; a rotation takes it (write), so no
    /// connection starts while the old identity is being torn down.
    gate: tokio::sync::RwLock<()>,
    /// The newest generation number; connections of older ones close.
    newer: tokio::sync::watch::Sender<u64>,
    started: Instant,
    stop: UnboundedSender<()>,
    exec_users: Vec<String>,
}

impl Shared {
    fn current(&self) -> Arc<Generation> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Controls a running agent.
#[derive(Clone)]
pub struct Handle {
    shared: Arc<Shared>,
}

/// How long a rotation waits for the old identity's connections to end.
pub const ROTATION_TIMEOUT: Duration = Duration::from_secs(10);

impl Handle {
    /// The identity changed (re-enrollment: a higher epoch, a new key and certificate).
    /// In this order: no new connection is admitted; every connection opened under the old
    /// identity is closed, which kills its running job; then handshakes are served only
    /// with the new certificate. Each closed connection and killed job is logged.
    pub async fn rotate(&self, served: Served) {
        let _gate = self.shared.gate.write().await;
        let old = self.shared.current();
        crate::info!(
            "agent: the identity changed ({} -> {}); closing every connection opened under the old one",
            old.identity,
            served.identity
        );
        self.shared.newer.send_replace(old.no + 1);
        let deadline = Instant::now() + ROTATION_TIMEOUT;
        // `current` and `old` hold two references; every other is a live connection.
        while Arc::strong_count(&old) > 2 {
            if Instant::now() >= deadline {
                crate::warn!(
                    "agent: {} connection(s) of the old identity still closing after {ROTATION_TIMEOUT:?}",
                    Arc::strong_count(&old) - 2
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.shared.enrolled.replace(served.cert_der, served.key);
        *self
            .shared
            .current
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Arc::new(Generation {
            no: old.no + 1,
            identity: served.identity.clone(),
            epoch: served.epoch,
            not_after: served.not_after,
        });
        crate::info!("agent: serving as {} from now on", served.identity);
    }
}

impl Handle {
    /// The certificate was renewed (same identity, same key): new handshakes present
    /// `cert_der`; connections already open stay, they are the same identity.
    pub fn renewed(&self, cert_der: Vec<u8>, key: Arc<dyn MachineKey>, not_after: i64) {
        self.shared.enrolled.replace(cert_der, key);
        let mut current = self
            .shared
            .current
            .write()
            .unwrap_or_else(|p| p.into_inner());
        *current = Arc::new(Generation {
            no: current.no,
            identity: current.identity.clone(),
            epoch: current.epoch,
            not_after,
        });
        crate::info!(
            "agent: serving the renewed certificate of {} from now on",
            current.identity
        );
    }
}

/// Binds the listener and spawns the accept loop on the current runtime.
pub fn start(
    cfg: &AgentConfig,
    ctx: Context,
) -> Result<(tokio::task::JoinHandle<()>, Handle), AgentError> {
    let enrolled = Arc::new(tls::Enrolled::new(
        ctx.served.cert_der.clone(),
        ctx.served.key.clone(),
    ));
    let tls = tls::server_config(enrolled.clone(), ctx.ca.clone())?;
    let ep = &cfg.listen;
    let err = |source| AgentError::Listen {
        endpoint: ep.to_string(),
        source,
    };
    if let Some(path) = ep.unix_path() {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(err)?;
        }
        crate::enroll::push::remove_stale_socket(path).map_err(err)?;
    }
    let listener = ep.listen().map_err(err)?;
    if let Some(path) = ep.unix_path() {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    }
    crate::info!(
        "agent: listening at {ep} as {} (operators of {})",
        ctx.served.identity,
        ctx.ca.subject()
    );
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let shared = Arc::new(Shared {
        enrolled,
        current: std::sync::RwLock::new(Arc::new(Generation {
            no: 0,
            identity: ctx.served.identity,
            epoch: ctx.served.epoch,
            not_after: ctx.served.not_after,
        })),
        gate: tokio::sync::RwLock::new(()),
        newer: tokio::sync::watch::channel(0).0,
        started: ctx.started,
        stop: ctx.stop,
        exec_users: ctx.exec_users,
    });
    let handle = Handle {
        shared: shared.clone(),
    };
    let task = tokio::spawn(async move {
        loop {
            let (conn, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    crate::warn!("agent: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if !crate::control::admit(&peer) {
                crate::warn!(
                    "agent: refused {peer}: not the host (only vsock CID 2 may manage this VM)"
                );
                continue;
            }
            let acceptor = acceptor.clone();
            let shared = shared.clone();
            let gate = shared.gate.read().await;
            let generation = shared.current();
            let mut newer = shared.newer.subscribe();
            drop(gate);
            tokio::spawn(async move {
                let no = generation.no;
                let identity = generation.identity.clone();
                tokio::select! {
                    () = serve(acceptor, conn, &peer, &shared, &generation) => {}
                    _ = newer.wait_for(|n| *n > no) => {
                        // Dropping `serve` drops a running job's guard, which kills it.
                        crate::info!(
                            "agent: closed the connection from {peer} opened under {identity} (identity revoked)"
                        );
                    }
                }
                drop(generation);
            });
        }
    });
    Ok((task, handle))
}

async fn serve(
    acceptor: tokio_rustls::TlsAcceptor,
    conn: vm_transport::Conn,
    peer: &Peer,
    ctx: &Shared,
    generation: &Generation,
) {
    let mut tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(conn)).await {
        Err(_) => {
            crate::warn!("agent: refused {peer}: no handshake within {HANDSHAKE_TIMEOUT:?}");
            return;
        }
        Ok(Err(e)) => {
            crate::warn!("agent: refused {peer}: {}", handshake_reason(&e));
            return;
        }
        Ok(Ok(s)) => s,
    };
    let Some(operator) = operator_of(&tls) else {
        // Unreachable after the verifier admitted the certificate; refuse all the same.
        crate::warn!("agent: refused {peer}: the admitted certificate names no role");
        return;
    };
    let answer = match tokio::time::timeout(REQUEST_TIMEOUT, read_line(&mut tls)).await {
        Err(_) => Answer::error(
            Code::MalformedRequest,
            format!("no request within {REQUEST_TIMEOUT:?}"),
        ),
        Ok(Err(e)) => Answer::error(Code::MalformedRequest, e),
        Ok(Ok(line)) => match Op::parse(&line) {
            Err(e) => Answer::error(Code::MalformedRequest, e),
            Ok(op) if !operator.role.allows(op.name()) => Answer::error(
                Code::RoleNotAllowed,
                format!(
                    "role {} does not allow {}",
                    operator.role.as_str(),
                    op.name()
                ),
            ),
            Ok(op) => {
                crate::info!(
                    "agent: {} ({}) from {peer}: {}",
                    operator.name,
                    operator.role.as_str(),
                    op.name()
                );
                dispatch(op, ctx, generation).await
            }
        },
    };
    if let Some(code) = answer.code {
        crate::warn!(
            "agent: refused a request from {} at {peer}: {code:?}: {}",
            operator.name,
            answer.message.as_deref().unwrap_or_default()
        );
    }
    let _ = tls.write_all(&answer.to_line()).await;
    let _ = tls.shutdown().await;
}

/// The operator named by the session's client certificate (already verified).
fn operator_of(tls: &tokio_rustls::server::TlsStream<vm_transport::Conn>) -> Option<tls::Operator> {
    let cert = tls.get_ref().1.peer_certificates()?.first()?;
    let (_, c) = x509_parser::parse_x509_certificate(cert).ok()?;
    let san = c.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        x509_parser::extensions::GeneralName::URI(u) => tls::parse_operator_uri(u).ok(),
        _ => None,
    })
}

/// Why a handshake failed, in the words of the refusal list.
fn handshake_reason(e: &std::io::Error) -> String {
    use rustls::{CertificateError as C, Error as E};
    let inner = e.get_ref().and_then(|i| i.downcast_ref::<E>());
    match inner {
        Some(E::NoCertificatesPresented) => "no client certificate".into(),
        Some(E::InvalidCertificate(C::UnknownIssuer)) => {
            "wrong CA (the client certificate is not from the pinned management CA)".into()
        }
        Some(E::InvalidCertificate(C::Expired)) => "expired client certificate".into(),
        Some(E::InvalidCertificate(C::NotValidYet)) => "client certificate not valid yet".into(),
        Some(E::InvalidCertificate(C::InvalidPurpose)) => "not an operator certificate".into(),
        Some(E::InvalidCertificate(C::ApplicationVerificationFailure)) => {
            "no accepted role in the client certificate".into()
        }
        Some(other) => format!("TLS: {other}"),
        None => format!("handshake: {e}"),
    }
}

/// Reads one request line (at most [`ops::MAX_REQUEST`] bytes, newline included); the
/// newline is dropped.
async fn read_line<R: tokio::io::AsyncRead + Unpin>(r: &mut R) -> Result<Vec<u8>, String> {
    let mut line = ops::LineReader::new(ops::MAX_REQUEST);
    let mut chunk = [0u8; 4096];
    loop {
        let n = r
            .read(&mut chunk)
            .await
            .map_err(|e| format!("reading the request: {e}"))?;
        if n == 0 {
            return Err("the stream ended before a complete request line".into());
        }
        if let Some(l) = line.push(&chunk[..n])? {
            return Ok(l);
        }
    }
}

async fn dispatch(op: Op, ctx: &Shared, generation: &Generation) -> Answer {
    match op {
        Op::Status { .. } => Answer::ok(serde_json::json!({
            "identity": generation.identity,
            "epoch": generation.epoch,
            "not_after": generation.not_after,
            "app": match crate::shutdown::app() {
                Some(pid) => format!("running (pid {pid})"),
                None => "not running".to_string(),
            },
            "uptime_ms": ctx.started.elapsed().as_millis() as u64,
        })),
        Op::Stop { .. } => {
            let _ = ctx.stop.send(());
            Answer::ok(serde_json::json!({"stopping": true}))
        }
        Op::Exec {
            user,
            argv,
            deadline_ms,
            ..
        } => exec::run(&user, &argv, deadline_ms, &ctx.exec_users).await,
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn config(extra: serde_json::Value) -> Result<(), String> {
        let mut v = serde_json::json!({
            "version": 1,
            "app": {"command": ["/bin/true"], "user": 0},
            "agent": {"listen": {"unix": "/run/agent.sock"}, "exec_users": ["nobody"]},
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        Config::parse(&v.to_string())
            .map_err(|e| e.to_string())?
            .validate()
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_agent_needs_enrollment_and_turns_the_control_port_off() {
        let enrollment = serde_json::json!({"bootstrap": {"file": "/b.json"}});
        let e = config(serde_json::json!({})).unwrap_err();
        assert!(
            e.contains("agent") && e.contains("needs the enrollment section"),
            "{e}"
        );
        config(serde_json::json!({"enrollment": enrollment})).unwrap();
        let control = serde_json::json!({"listen": {"unix": "/run/control.sock"}});
        let e =
            config(serde_json::json!({"enrollment": enrollment, "control": control})).unwrap_err();
        assert!(e.contains("control") && e.contains("with_agent"), "{e}");
        let kept = serde_json::json!({"listen": {"unix": "/run/control.sock"}, "with_agent": true});
        config(serde_json::json!({"enrollment": enrollment, "control": kept})).unwrap();
        let e = config(serde_json::json!({
            "enrollment": enrollment,
            "agent": {"listen": {"tcp": "127.0.0.1:9"}},
        }))
        .unwrap_err();
        assert!(e.contains("agent") && e.contains("TCP"), "{e}");
        let e = config(serde_json::json!({
            "enrollment": enrollment,
            "agent": {"listen": {"unix": "/run/a.sock"}, "exec_users": ["a b"]},
        }))
        .unwrap_err();
        assert!(e.contains("exec_users"), "{e}");
    }
}
