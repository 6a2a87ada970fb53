//! The sections of the relay's configuration file, as types.
//!
//! Each type is strict (`deny_unknown_fields`) and carries exactly what its setting needs:
//! the transport is a tagged value, modes are [`SocketMode`], endpoints are
//! [`vm_transport::Endpoint`]. What a type cannot say (a CID's range, a path for every
//! service, an address inside a network) [`super::Config::validate`] checks.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use vm_transport::mode::SocketMode;
use vm_transport::Endpoint;

use crate::dovecot::Cidr;

/// Where the guest's connections arrive, with exactly the fields each transport needs.
///
/// In JSON: `{"per_vm_socket": {"vsock_uds": "/run/vm1/vm.vsock"}}`, `{"cid": {"cid": 7}}`
/// or `{"unix": {"listen": {"dovecot-auth": "/run/relay/auth.sock"}}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Transport {
    /// Hybrid vsock (Cloud Hypervisor, Firecracker, vhost-device-vsock): a Unix socket at
    /// `<vsock_uds>_<port>`. Only the VM's VMM can reach it.
    PerVmSocket {
        /// The VMM's hybrid vsock socket (absolute path).
        vsock_uds: PathBuf,
    },
    /// Kernel vhost-vsock (QEMU): `AF_VSOCK` on `port`, admitting only peer CID `cid`.
    Cid {
        /// The CID the platform registered for this VM.
        cid: u32,
    },
    /// An explicit Unix path per service: native use and tests.
    Unix {
        /// Listening path of every service, declared or not, by name.
        listen: BTreeMap<String, PathBuf>,
    },
}

/// The VM the relay serves.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// The VM's id (log lines only).
    pub id: String,
    /// The VM's gateway addresses: a `rip` equal to one of them is not a client. Required
    /// by a dovecot-auth service.
    #[serde(default)]
    pub gateways: Vec<IpAddr>,
    /// Accept a dovecot-auth service with no gateways (a VM without NAT). Never the
    /// default.
    #[serde(default)]
    pub unsafe_no_gateways: bool,
}

/// The user the whole process becomes after binding (caller identity option (b)).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunAs {
    /// The app's uid.
    pub uid: u32,
    /// The app's primary gid.
    pub gid: u32,
    /// Supplementary groups (exactly these; an empty list clears them).
    #[serde(default)]
    pub groups: Vec<u32>,
}

/// The guest-facing socket files (per-VM-socket and unix modes).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SocketConfig {
    /// Mode of each socket file, octal string; default `"0600"`.
    #[serde(default = "default_socket_mode")]
    pub mode: SocketMode,
    /// Owner uid of each socket file (the VMM's user); default: unchanged (root).
    #[serde(default)]
    pub uid: Option<u32>,
    /// Group of each socket file (with mode `"0660"`); default: unchanged.
    #[serde(default)]
    pub gid: Option<u32>,
}

impl Default for SocketConfig {
    fn default() -> Self {
        SocketConfig {
            mode: default_socket_mode(),
            uid: None,
            gid: None,
        }
    }
}

fn default_socket_mode() -> SocketMode {
    SocketMode::OWNER_ONLY
}

/// What a service's bytes go through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// Bytes unchanged both ways.
    #[default]
    Stream,
    /// Dovecot auth client protocol: guest-to-service lines filtered (see [`crate::dovecot`]).
    DovecotAuth,
}

/// What happens to a `rip` that is not the app's own client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RipPolicy {
    /// Replace it with the app's per-app client address (own attempt budget). Default.
    #[default]
    Substitute,
    /// Remove it (the request lands in Dovecot's shared rip-less budget).
    Drop,
}

/// Options of the `dovecot-auth` filter.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DovecotConfig {
    /// `substitute` (default) or `drop`.
    #[serde(default)]
    pub rip_policy: RipPolicy,
    /// The app's per-app client address (required for `substitute`; unique per app).
    #[serde(default)]
    pub client_address: Option<IpAddr>,
    /// Networks of the platform's per-app client addresses (e.g. `"100.64.0.0/10"`): a
    /// guest's `rip` inside them is another app's identity and is treated like a gateway.
    #[serde(default)]
    pub reserved_networks: Vec<Cidr>,
    /// Parameter keys passed to Dovecot; every other key is removed. Default: see docs.
    /// Trust fields can never be listed.
    #[serde(default)]
    pub allow_fields: Option<Vec<String>>,
    /// Accept an empty `reserved_networks` (a guest may then claim another app's
    /// address). Never the default.
    #[serde(default)]
    pub unsafe_no_reserved_networks: bool,
}

/// A service the app declared.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// Name in log lines, e.g. `dovecot-auth`.
    pub name: String,
    /// The vsock port the platform assigned to this service for this app.
    pub port: u32,
    /// `stream` (default) or `dovecot-auth`.
    #[serde(default)]
    pub kind: Kind,
    /// Where connections go: the per-app endpoint (option a), or the service's socket
    /// dialled as the app's user (option b, with `run_as`).
    pub upstream: Endpoint,
    /// Filter options (kind `dovecot-auth` only).
    #[serde(default)]
    pub dovecot: Option<DovecotConfig>,
    /// At most this many of this VM's connections are open to the upstream at once
    /// (default [`DEFAULT_MAX_UPSTREAM`]); more wait, in arrival order, for one to end.
    #[serde(default = "default_max_upstream")]
    pub max_upstream: u32,
}

/// The default per-VM limit on concurrent upstream connections of one service: a
/// sixteenth of stock Dovecot's `client_limit` of 1,000, which every app on the host
/// shares, so one guest's burst cannot take the service from the others.
pub const DEFAULT_MAX_UPSTREAM: u32 = 64;

fn default_max_upstream() -> u32 {
    DEFAULT_MAX_UPSTREAM
}

/// A platform service the app did not declare: listened on, every connection refused.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UndeclaredConfig {
    /// Name in log lines.
    pub name: String,
    /// Its vsock port.
    pub port: u32,
}
