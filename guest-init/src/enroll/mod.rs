//! (to be written: the enrollment helper replaces this stub, keeping these signatures)

use serde::{Deserialize, Serialize};

/// The `enrollment` section of the configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnrollConfig {}

/// An enrollment error.
#[derive(Debug, thiserror::Error)]
pub enum EnrollError {}

/// Checks the section without touching the system; `Err` names the field and the fix.
pub fn validate(_cfg: &EnrollConfig) -> Result<(), String> {
    Ok(())
}

/// The boot step: called by PID 1 after the forwarders are up and before the app starts.
/// It returns when the VM holds a valid certificate for its current identity, or when
/// enrollment cannot succeed (`Err`, already logged without secrets).
pub async fn boot_step(_cfg: &EnrollConfig) -> Result<(), EnrollError> {
    Ok(())
}

/// `guest-init enroll --config FILE`: enrollment alone, as an ordinary process; returns the
/// process exit code.
pub fn cli_main(_config_path: &std::path::Path) -> i32 {
    0
}
