//! Forwarding: the app's unchanged Unix socket paths carried to the host, and host
//! connections carried to guest services.
//!
//! # Guest to host ([`ServiceSpec`])
//! The app was written to connect to, say, `/run/dovecot/auth-client`. Inside the VM there
//! is no Dovecot: the service lives on the host. For each declared service PID 1 listens at
//! that exact path and forwards every connection to the service's `target`, which in a VM
//! is `vsock` CID 2 and the port the platform assigned (a Unix path in tests and native
//! use). The app needs no change and cannot tell the difference, because the pump
//! ([`vm_transport::pump`]) writes every chunk it reads whole and unchanged.
//!
//! Each listener is published by [`vm_transport::publish`]: missing parent directories
//! made 0755; a stale socket replaced, a live one or any other file refused; owner, group
//! and mode set before the socket appears at the path and before it listens (with the
//! 4096 backlog of [`vm_transport::listener`]); no symlink followed at any step.
//!
//! # Host to guest ([`ExportSpec`])
//! The mirror image: listen on a vsock port (a Unix path or TCP address in tests) and
//! forward each connection to a guest service's Unix path or TCP address, so the host can
//! reach, for example, an app's admin socket. The same accept loop and dialler serve both.
//!
//! # Robustness (each point is a failure a peer's users reported; see `docs/DESIGN.md`)
//! - **The accept loop never ends** ([`vm_transport::accept`]): exhaustion is backed off
//!   and logged at most once a second, per-connection errors skipped. The loop reserves
//!   the descriptor a connection's dial will need *before* accepting it, so that when
//!   descriptors run out, callers wait in the backlog instead of starving each other.
//! - **One task per connection, no limit.** A stalled or failing connection holds only its
//!   own task; worker pools starved in Nitro's vsock-proxy and gvisor-tap-vsock. The only
//!   limits are the kernel's (descriptors, and the VMM's 1023 vsock connections per VM).
//! - **Bounded dial retry** with rate-limited failure lines ([`dial`]).
//!
//! # Threat model
//! The socket's owner, group and mode narrow which guest processes may call a host
//! service; the VM boundary, not these bits, is what the host relay admits by. What this
//! module defends against is local, and [`vm_transport::publish`] does the defending: a
//! socket reachable with default permissions while it is set up, a hostile file or
//! symlink at the path being deleted or followed (in ordinary-process mode an app that
//! owns the parent directory could otherwise turn our `chmod` onto any file), a live
//! service's path hijacked, and someone else's later socket unlinked at shutdown. On
//! shutdown the files are removed *before* the accept loops stop, so the path stays
//! provably ours until it is gone.

mod dial;
mod spec;

pub use dial::DialPolicy;
pub use spec::{check_ids, validate, ExportSpec, ForwardError, ServiceSpec, DEFAULT_MODE};

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;

use tokio::task::AbortHandle;
use vm_transport::accept::{self, Accepted, Failure};
use vm_transport::publish::{self, Access, SocketFile};
use vm_transport::{pump, Conn, Endpoint, Listener};

use crate::{debug, error, info, warn};
use dial::{dial, suppressed_note, RateLimit};

/// Running forwarders. Dropping it removes the Unix sockets it created, then stops
/// accepting.
///
/// Connections already being relayed are not cut: they belong to the app and end when it
/// (or the host) closes them, or with the runtime at power-off.
#[derive(Debug, Default)]
pub struct Forwarders {
    tasks: Vec<AbortHandle>,
    sockets: Vec<SocketFile>,
}

impl Forwarders {
    /// Removes the socket files this instance created (only where the path still names
    /// the inode it published), then stops every accept loop. Removing first, while still
    /// listening, means no other publisher can have taken the path over meanwhile: it
    /// would have found a live socket and refused. Idempotent.
    pub fn close(&mut self) {
        for mut s in self.sockets.drain(..) {
            if let Err(e) = s.remove() {
                warn!("cannot remove socket {}: {e}", s.path().display());
            }
        }
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }

    /// Number of accept loops running.
    pub fn listeners(&self) -> usize {
        self.tasks.len()
    }

    /// The Unix socket paths this instance created and will remove.
    pub fn socket_paths(&self) -> impl Iterator<Item = &Path> {
        self.sockets.iter().map(|s| s.path())
    }
}

impl Drop for Forwarders {
    fn drop(&mut self) {
        self.close();
    }
}

/// What one accept loop needs to serve a connection.
#[derive(Debug)]
struct Route {
    /// `service NAME` or `export NAME`, for log lines.
    label: String,
    target: Endpoint,
    dial: DialPolicy,
    /// Rate limit for "gave up dialling" lines.
    dial_log: RateLimit,
    /// Rate limit for accept error lines.
    accept_log: RateLimit,
}

impl Route {
    fn new(label: String, target: &Endpoint, dial: &DialPolicy) -> Self {
        Route {
            label,
            target: target.clone(),
            dial: dial.clone(),
            dial_log: RateLimit::default(),
            accept_log: RateLimit::default(),
        }
    }
}

/// Binds every listener (all are accepting when this returns) and spawns the accept loops
/// on the current tokio runtime.
///
/// Validation ([`validate`]) runs first; then users and groups are resolved; then each
/// listener is published as the module documentation describes. If any step fails, the
/// sockets already created are removed again and nothing is left running.
pub async fn start(
    services: &[ServiceSpec],
    exports: &[ExportSpec],
) -> Result<Forwarders, ForwardError> {
    validate(services, exports)?;
    let mut fwd = Forwarders::default();
    let mut ready: Vec<(Listener, Route)> = Vec::new();
    for (i, s) in services.iter().enumerate() {
        let (uid, gid) = spec::resolve_ids(i, s)?;
        let access = Access {
            mode: s.mode.unwrap_or(DEFAULT_MODE),
            uid: uid.map(|u| u.as_raw()),
            gid: gid.map(|g| g.as_raw()),
        };
        let endpoint = Endpoint::Unix(s.listen.clone());
        let listener = publish_unix(&s.name, &endpoint, access, &mut fwd)?;
        ready.push((
            listener,
            Route::new(format!("service {}", s.name), &s.target, &s.dial),
        ));
    }
    for e in exports {
        let listener = match &e.listen {
            Endpoint::Unix(_) => {
                let access = Access {
                    mode: DEFAULT_MODE,
                    uid: None,
                    gid: None,
                };
                publish_unix(&e.name, &e.listen, access, &mut fwd)?
            }
            other => {
                vm_transport::listener::listen(other).map_err(|source| ForwardError::Listen {
                    name: e.name.clone(),
                    endpoint: e.listen.to_string(),
                    source,
                })?
            }
        };
        ready.push((
            listener,
            Route::new(format!("export {}", e.name), &e.target, &e.dial),
        ));
    }
    for (listener, route) in ready {
        info!(
            "{}: listening at {} -> {}",
            route.label,
            listener.endpoint(),
            route.target
        );
        fwd.tasks
            .push(tokio::spawn(accept_loop(listener, Arc::new(route))).abort_handle());
    }
    Ok(fwd)
}

fn publish_unix(
    name: &str,
    endpoint: &Endpoint,
    access: Access,
    fwd: &mut Forwarders,
) -> Result<Listener, ForwardError> {
    let Endpoint::Unix(path) = endpoint else {
        unreachable!("publish_unix is called with Unix endpoints only");
    };
    let published =
        publish::publish(path, access, true).map_err(|source| ForwardError::Publish {
            name: name.to_string(),
            source,
        })?;
    fwd.sockets.push(published.file);
    Listener::from_listening_fd(published.fd, endpoint.clone()).map_err(|source| {
        ForwardError::Listen {
            name: name.to_string(),
            endpoint: endpoint.to_string(),
            source,
        }
    })
}

/// Accepts forever (see [`vm_transport::accept`]); each connection becomes its own task.
async fn accept_loop(listener: Listener, route: Arc<Route>) {
    let opts = accept::Options {
        reserve: Some(route.target.family()),
    };
    let on_accept = |a: Accepted| {
        debug!("{}: accepted a connection from {}", route.label, a.peer);
        tokio::spawn(serve(a.conn, a.reserve, Arc::clone(&route)));
    };
    let on_error = |e: &std::io::Error, class: Failure, pause: std::time::Duration| {
        if class == Failure::Skip {
            debug!("{}: accept: {e}; skipped", route.label);
            return;
        }
        if let Some(suppressed) = route.accept_log.allow() {
            let what = if class == Failure::Exhausted {
                "out of resources"
            } else {
                "unexpected error"
            };
            warn!(
                "{}: accept failed ({what}): {e}; retrying in {} ms{}",
                route.label,
                pause.as_millis(),
                suppressed_note(suppressed)
            );
        }
    };
    accept::run(&listener, opts, on_accept, on_error).await;
}

/// Serves one accepted connection: dial, then relay until both directions end.
async fn serve(caller: Conn, reserve: Option<OwnedFd>, route: Arc<Route>) {
    // The reserve is the socket the dial's first attempt uses.
    match dial(&route.target, &route.dial, reserve).await {
        Ok(upstream) => {
            let t = pump::relay(&caller, &upstream).await;
            debug!(
                "{}: connection ended: {} bytes to {}, {} bytes back{}",
                route.label,
                t.a_to_b,
                route.target,
                t.b_to_a,
                t.error.map(|e| format!(", error: {e}")).unwrap_or_default()
            );
        }
        Err(f) => {
            if let Some(suppressed) = route.dial_log.allow() {
                error!(
                    "{}: cannot reach {}: gave up after {} attempt{} in {} ms: {}; closed the caller's connection{}",
                    route.label,
                    route.target,
                    f.attempts,
                    if f.attempts == 1 { "" } else { "s" },
                    f.elapsed.as_millis(),
                    f.error,
                    suppressed_note(suppressed)
                );
            }
            // Dropping `caller` closes it: the app sees end of stream or a reset.
        }
    }
}
