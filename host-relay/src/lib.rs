//! `host-relay`: the host side of a micro-VM's platform services (ADR 065 sections 1-2).
//!
//! A guest reaches a platform service (the Dovecot sign-in socket, the enrollment
//! service...) over vsock. On the host, this relay
//! - **admits** a connection only from the VM it serves ([`admission`]): the per-VM hybrid
//!   vsock socket, or the registered peer CID under kernel vhost-vsock;
//! - **tells the service who calls**, out of band: by dialling the service's per-app
//!   endpoint (option a, [`config::ServiceConfig::upstream`]) or by dialling as the app's
//!   Unix user so `SO_PEERCRED` shows the app as natively (option b, [`privileges`]);
//! - **passes bytes unchanged** ([`vm_transport::pump`]), except the sign-in protocol's
//!   guest-to-service lines, where it removes what only the VM's plumbing adds and what
//!   would grant trust ([`dovecot`]);
//! - **refuses undeclared services** visibly, and takes bursts ([`serve`]).
//!
//! One process serves one app, all its services as tasks of one runtime ([`serve`]
//! explains why). The host-initiated direction (`CONNECT <port>`) is
//! `vm_transport::hybrid`; the socket plumbing is shared with guest-init through `vm-transport`.
//! Configuration: [`config`] and `docs/RELAY.md`. [`agent_client`] is the operator's
//! client for a guest's authenticated agent (`docs/AGENT.md`).

pub mod admission;
pub mod agent_client;
pub mod config;
pub mod dovecot;
pub mod listen;
pub mod privileges;
pub mod serve;
