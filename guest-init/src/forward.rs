//! (to be written: the forwarding helper replaces this stub, keeping these signatures)

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::endpoint::Endpoint;
use crate::ids::IdRef;

/// A guest-to-host service: listen at the app's unchanged Unix path, forward to `target`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    /// Name used in log lines (e.g. `dovecot-auth`).
    pub name: String,
    /// The absolute path the app connects to.
    pub listen: PathBuf,
    /// Where each connection goes: `{"vsock": {"cid": 2, "port": N}}` in production.
    pub target: Endpoint,
    /// Owner of the socket file.
    #[serde(default)]
    pub owner: Option<IdRef>,
    /// Group of the socket file.
    #[serde(default)]
    pub group: Option<IdRef>,
    /// Mode of the socket file, as an octal string such as `"0660"`.
    #[serde(default)]
    pub mode: Option<String>,
}

/// A host-to-guest export: listen on `listen` (usually vsock), forward to a guest service.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportSpec {
    /// Name used in log lines.
    pub name: String,
    /// Where the host's connections arrive.
    pub listen: Endpoint,
    /// The guest service (Unix path or TCP address).
    pub target: Endpoint,
}

/// A forwarding error.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// A field is invalid.
    #[error("{field}: {reason}")]
    Invalid {
        /// The configuration field, e.g. `services[0].listen`.
        field: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// A listener could not be set up.
    #[error("{name}: cannot listen at {endpoint}: {source}")]
    Listen {
        /// Service or export name.
        name: String,
        /// The endpoint.
        endpoint: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Checks service and export specs without touching the system.
pub fn validate(_services: &[ServiceSpec], _exports: &[ExportSpec]) -> Result<(), ForwardError> {
    Ok(())
}

/// Running forwarders. Dropping it stops accepting and removes the Unix sockets it created.
#[derive(Debug, Default)]
pub struct Forwarders {}

/// Binds every listener (all are accepting when this returns) and spawns the accept loops
/// on the current tokio runtime.
pub async fn start(
    _services: &[ServiceSpec],
    _exports: &[ExportSpec],
) -> Result<Forwarders, ForwardError> {
    Ok(Forwarders::default())
}
