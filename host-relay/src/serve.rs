//! Serving: one accept loop per listener, one task per connection, until shutdown.
//!
//! **Shape.** One process serves one app (one VM). Each declared service is an *instance*:
//! a listener, its admission [`Gate`], its upstream and, for `dovecot-auth`, its filter
//! [`Policy`]. Each undeclared platform service is an instance that refuses everyone. All
//! instances share one tokio runtime. Tearing the app down is stopping one process; a
//! crash takes down one app's relay, never another's.
//!
//! **Accept loops never die** (a peer's lesson: one failed accept ended a loop and every
//! later caller hung). The loop is guest-init's ([`vm_transport::accept`]: one table of
//! which errors are skipped and which back off); every error is logged here. Each
//! admitted connection runs in its own task, so one stuck connection (a service that
//! never answers, a guest that never reads) blocks nothing else. The listener backlog is
//! 4096.
//!
//! **One guest cannot starve the others.** A shared service has a limit of its own
//! (stock Dovecot: 1,000 auth clients for everyone). Each service instance admits at most
//! `max_upstream` (default 64) of this VM's connections to the upstream at once; beyond
//! that a connection is accepted and waits, in arrival order, for a slot. So a burst is
//! never refused (ADR 065 §2) and never holds more than its share of the service.
//!
//! **What is logged.** One line per connection decision, with app, service, peer and
//! reason (`admitted`, or `refused` with e.g. "service not declared by app", or the
//! foreign CID and port). Closing a dovecot-auth connection for a bad line logs the kind
//! of problem only, never line contents: `resp=` and `CONT` lines carry credentials.
//!
//! **Shutdown.** When the shutdown future completes, every socket file this process
//! created is removed (while still listening, so nobody can have taken the path over),
//! then the loops stop accepting and the listeners close, and [`serve`] returns; the binary then exits 0. Connections still open end with the process.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Semaphore};
use vm_transport::accept::{self, Accepted, Failure};
use vm_transport::{pump, Conn, Endpoint, Listener, Peer};

use crate::admission::{decide, Decision, Gate, Transport};
use crate::config;
use crate::config::{Config, Kind, RipPolicy};
use crate::dovecot::{FilterError, GuestFilter, Policy, RipRule};
use crate::listen::Bound;

/// How long dialling an upstream may take before the guest's connection is closed.
pub const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection may wait for an upstream slot (see
/// [`crate::config::ServiceConfig::max_upstream`]) before it is closed: long past any
/// client's own timeout, so the relay never gives up on a caller that is still waiting.
pub const UPSTREAM_QUEUE_TIMEOUT: Duration = Duration::from_secs(120);

/// One listener's job.
#[derive(Debug)]
pub struct Instance {
    /// The app.
    pub app: String,
    /// The service name.
    pub service: String,
    /// Admission rules.
    pub gate: Gate,
    /// Where admitted connections go (`None` for undeclared services).
    pub upstream: Option<Endpoint>,
    /// The dovecot-auth filter, if any.
    pub filter: Option<Policy>,
    /// Admits at most `max_upstream` concurrent upstream connections; the rest wait.
    pub upstream_slots: Arc<Semaphore>,
}

/// Builds the instance for a listener: `service` indexes `config.services`, `None` is an
/// undeclared service.
pub fn instance(config: &Config, service: Option<usize>, name: &str) -> Instance {
    let transport = match &config.transport {
        config::Transport::PerVmSocket { .. } => Transport::PerVmSocket,
        config::Transport::Cid { cid } => Transport::Cid { registered: *cid },
        config::Transport::Unix { .. } => Transport::Unix,
    };
    let svc = service.and_then(|i| config.services.get(i));
    let filter = svc.filter(|s| s.kind == Kind::DovecotAuth).map(|s| {
        let d = s.dovecot.clone().unwrap_or_default();
        Policy {
            gateways: config.vm.gateways.clone(),
            reserved: d.reserved_networks.clone(),
            rip: match (d.rip_policy, d.client_address) {
                (RipPolicy::Substitute, Some(a)) => RipRule::Substitute(a),
                _ => RipRule::Drop,
            },
            allow: Config::allow_fields(&d),
        }
    });
    Instance {
        app: config.app.clone(),
        service: name.to_string(),
        gate: Gate {
            transport,
            declared: svc.is_some(),
        },
        upstream: svc.map(|s| s.upstream.clone()),
        filter,
        upstream_slots: Arc::new(Semaphore::new(svc.map_or(1, |s| s.max_upstream as usize))),
    }
}

/// Serves every bound listener until `shutdown` completes, then removes the socket files.
/// Must run inside a tokio runtime.
pub async fn serve(
    config: &Config,
    bound: Bound,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut loops = Vec::new();
    let count = bound.listeners.len();
    for b in bound.listeners {
        let inst = Arc::new(instance(config, b.service, &b.spec.name));
        let listener = Listener::from_listening_fd(b.fd, b.spec.endpoint.clone())?;
        loops.push(tokio::spawn(accept_loop(listener, inst, stop_rx.clone())));
    }
    tracing::info!(app = %config.app, vm = %config.vm.id, listeners = count, "ready");
    shutdown.await;
    // Files first, while still listening: until they are gone no other relay can have
    // taken the paths over (it would have found them live and refused).
    let mut files = bound.files;
    files.remove_all();
    let _ = stop_tx.send(true);
    for l in loops {
        let _ = l.await;
    }
    tracing::info!(app = %config.app, "stopped: listeners closed, socket files removed");
    Ok(())
}

async fn accept_loop(listener: Listener, inst: Arc<Instance>, mut stop: watch::Receiver<bool>) {
    let on_accept = |a: Accepted| match decide(&inst.gate, &a.peer) {
        Decision::Admit => {
            tracing::info!(app = %inst.app, service = %inst.service, peer = %a.peer,
                reason = "declared by app, peer is the app's VM", "admitted");
            tokio::spawn(serve_conn(inst.clone(), a.conn, a.peer));
        }
        Decision::Refuse(reason) => {
            tracing::warn!(app = %inst.app, service = %inst.service, peer = %a.peer,
                reason = %reason, "refused");
        }
    };
    let on_error = |e: &io::Error, _class: Failure, pause: Duration| {
        tracing::error!(app = %inst.app, service = %inst.service, error = %e,
            pause_ms = pause.as_millis() as u64, "accept failed; listener stays up");
    };
    tokio::select! {
        _ = stop.changed() => {}
        () = accept::run(&listener, accept::Options::default(), on_accept, on_error) => {}
    }
}

async fn serve_conn(inst: Arc<Instance>, guest: Conn, peer: Peer) {
    let Some(upstream) = &inst.upstream else {
        return;
    };
    // Beyond the service's limit the connection waits here, accepted and queued in arrival
    // order (tokio's semaphore is fair), until one of this VM's connections ends: a burst
    // is never refused, and never takes more than its share of the service.
    let _slot = match inst.upstream_slots.clone().try_acquire_owned() {
        Ok(p) => p,
        Err(_) => {
            tracing::debug!(app = %inst.app, service = %inst.service, peer = %peer,
                "upstream limit reached; waiting for a slot");
            let wait = inst.upstream_slots.clone().acquire_owned();
            match tokio::time::timeout(UPSTREAM_QUEUE_TIMEOUT, wait).await {
                Ok(Ok(p)) => p,
                _ => {
                    tracing::warn!(app = %inst.app, service = %inst.service, peer = %peer,
                        wait_s = UPSTREAM_QUEUE_TIMEOUT.as_secs(),
                        "no upstream slot freed in time; closing");
                    return;
                }
            }
        }
    };
    let service = match tokio::time::timeout(UPSTREAM_CONNECT_TIMEOUT, upstream.connect()).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            tracing::warn!(app = %inst.app, service = %inst.service, peer = %peer,
                upstream = %upstream, error = %e, "upstream unreachable; closing");
            return;
        }
        Err(_) => {
            tracing::warn!(app = %inst.app, service = %inst.service, peer = %peer,
                upstream = %upstream, "upstream connect timed out; closing");
            return;
        }
    };
    match &inst.filter {
        None => {
            pump::relay(&guest, &service).await;
        }
        Some(policy) => {
            if let Err(e) = dovecot_session(&guest, &service, policy).await {
                tracing::warn!(app = %inst.app, service = %inst.service, peer = %peer,
                    reason = %e, "closed: guest sent a line the filter refuses");
            }
        }
    }
}

/// Relays one dovecot-auth connection: service-to-guest bytes unchanged (through
/// [`pump::copy`]), guest-to-service lines through the filter. A filter error ends both
/// directions at once (the connections close when the caller drops them).
pub async fn dovecot_session(
    guest: &Conn,
    service: &Conn,
    policy: &Policy,
) -> Result<(), FilterError> {
    let down = pump::copy(service, guest);
    let up = async {
        let mut filter = GuestFilter::new(policy);
        // Ends at end of stream (an unfinished line is never sent) or a read error.
        while let Ok(Some(chunk)) = guest.read_pooled().await {
            // Lines completed before a bad one are passed on; nothing of the bad one is.
            let mut out = Vec::new();
            let fed = filter.feed(&chunk, &mut out);
            drop(chunk);
            if !out.is_empty() && service.write_all(&out).await.is_err() {
                break;
            }
            fed?;
        }
        // A guest that has closed entirely can be sent nothing more: end both directions
        // now instead of half-closing and waiting for the service (as `pump::relay` does).
        if guest.hung_up() {
            return Ok(true);
        }
        let _ = service.shutdown_write();
        Ok(false)
    };
    tokio::pin!(up, down);
    let (mut up_done, mut down_done) = (false, false);
    while !(up_done && down_done) {
        tokio::select! {
            r = &mut up, if !up_done => {
                if r? {
                    break;
                }
                up_done = true;
            }
            _ = &mut down, if !down_done => down_done = true,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instances_follow_the_config() {
        let c = Config::parse(
            &serde_json::json!({
                "app": "a",
                "vm": {"id": "v", "gateways": ["10.0.2.2"]},
                "transport": {"cid": {"cid": 9}},
                "services": [{"name": "auth", "port": 5001, "kind": "dovecot-auth",
                              "upstream": {"unix": "/run/auth-a"},
                              "dovecot": {"client_address": "100.64.0.3",
                                          "reserved_networks": ["100.64.0.0/10"]}}],
                "undeclared": [{"name": "agent", "port": 5003}]
            })
            .to_string(),
        )
        .unwrap();
        let i = instance(&c, Some(0), "auth");
        assert_eq!(i.gate.transport, Transport::Cid { registered: 9 });
        assert!(i.gate.declared);
        assert_eq!(i.upstream, Some(Endpoint::Unix("/run/auth-a".into())));
        let f = i.filter.unwrap();
        assert_eq!(f.rip, RipRule::Substitute("100.64.0.3".parse().unwrap()));
        assert_eq!(
            f.gateways,
            vec!["10.0.2.2".parse::<std::net::IpAddr>().unwrap()]
        );
        let u = instance(&c, None, "agent");
        assert!(!u.gate.declared);
        assert!(u.upstream.is_none() && u.filter.is_none());
    }
}
