//! The sections of the configuration below the top level: console, root disk, network,
//! the app and its restarts, the control port, shutdown. Each is strict
//! (`deny_unknown_fields`) with its defaults here; [`super::Config::validate`] checks what
//! types cannot, and [`AppConfig::resolve_ids`] turns the app's user and groups into ids.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::ConfigError;
use crate::ids::IdRef;
use vm_transport::Endpoint;

/// Console verbosity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// Errors only.
    Error,
    /// Errors and warnings.
    Warn,
    /// One line per normal event.
    #[default]
    Info,
    /// Everything, including each reaped orphan.
    Debug,
}

impl From<LogLevel> for crate::log::Level {
    fn from(l: LogLevel) -> Self {
        match l {
            LogLevel::Error => crate::log::Level::Error,
            LogLevel::Warn => crate::log::Level::Warn,
            LogLevel::Info => crate::log::Level::Info,
            LogLevel::Debug => crate::log::Level::Debug,
        }
    }
}

/// The `root` section: switch to a root filesystem on a block device.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RootConfig {
    /// The block device, e.g. `/dev/vda`.
    pub device: PathBuf,
    /// Filesystem type.
    #[serde(default = "default_fstype")]
    pub fstype: String,
    /// Filesystem-specific mount options (`data` argument of mount(2)), e.g. `"discard"`.
    #[serde(default)]
    pub options: String,
    /// Mount read-only.
    #[serde(default)]
    pub read_only: bool,
    /// How long to wait for the device node to appear.
    #[serde(default = "default_root_wait_ms")]
    pub wait_ms: u64,
}

fn default_fstype() -> String {
    "ext4".into()
}

fn default_root_wait_ms() -> u64 {
    5000
}

/// The `network` section: one interface with a static IPv4 address.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkConfig {
    /// Interface name, e.g. `eth0`.
    pub interface: String,
    /// Address with prefix length, e.g. `10.0.2.15/24`.
    pub address: String,
    /// Default gateway, e.g. `10.0.2.2`.
    #[serde(default)]
    pub gateway: Option<Ipv4Addr>,
    /// How long to wait for the interface to appear (its driver may have just loaded).
    #[serde(default = "default_net_wait_ms")]
    pub wait_ms: u64,
}

fn default_net_wait_ms() -> u64 {
    3000
}

impl NetworkConfig {
    /// The address and prefix length.
    pub fn parsed_address(&self) -> Result<(Ipv4Addr, u8), String> {
        let (a, p) = self.address.split_once('/').ok_or_else(|| {
            format!(
                "{:?} has no prefix length; write it as A.B.C.D/N, e.g. 10.0.2.15/24",
                self.address
            )
        })?;
        let addr: Ipv4Addr = a
            .parse()
            .map_err(|_| format!("{a:?} is not an IPv4 address; write A.B.C.D/N"))?;
        let prefix: u8 = p
            .parse()
            .ok()
            .filter(|n| *n <= 32)
            .ok_or_else(|| format!("prefix length {p:?} is not a number from 0 to 32"))?;
        Ok((addr, prefix))
    }
}

/// The `app` section.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppConfig {
    /// Program and arguments. The program is an absolute path or found in the app's `PATH`.
    pub command: Vec<String>,
    /// The Unix user the app runs as (name or number). Required: root must be asked for.
    pub user: IdRef,
    /// The primary group; defaults to the user's group from `/etc/passwd`.
    #[serde(default)]
    pub group: Option<IdRef>,
    /// Supplementary groups.
    #[serde(default)]
    pub supplementary_groups: Vec<IdRef>,
    /// The whole environment (it starts empty); `PATH` defaults to [`DEFAULT_APP_PATH`].
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory.
    #[serde(default = "default_workdir")]
    pub workdir: PathBuf,
    /// What happens when the app exits.
    #[serde(default)]
    pub restart: RestartConfig,
}

fn default_workdir() -> PathBuf {
    PathBuf::from("/")
}

/// Restart policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestartPolicy {
    /// The first exit is the end: shut down.
    #[default]
    Never,
    /// Restart after a non-zero exit or a signal, with backoff, up to `max_restarts` times.
    OnFailure,
}

/// The `app.restart` section.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestartConfig {
    /// The policy.
    #[serde(default)]
    pub policy: RestartPolicy,
    /// Restarts allowed before the failure is final.
    #[serde(default = "default_max_restarts")]
    pub max_restarts: u32,
    /// Delay before the first restart; it doubles on each further restart.
    #[serde(default = "default_initial_backoff_ms")]
    pub initial_backoff_ms: u64,
    /// Upper bound of the delay.
    #[serde(default = "default_max_backoff_ms")]
    pub max_backoff_ms: u64,
}

impl Default for RestartConfig {
    fn default() -> Self {
        RestartConfig {
            policy: RestartPolicy::default(),
            max_restarts: default_max_restarts(),
            initial_backoff_ms: default_initial_backoff_ms(),
            max_backoff_ms: default_max_backoff_ms(),
        }
    }
}

fn default_max_restarts() -> u32 {
    5
}
fn default_initial_backoff_ms() -> u64 {
    200
}
fn default_max_backoff_ms() -> u64 {
    10_000
}

/// The `control` section.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlConfig {
    /// Where the host's control connections arrive.
    pub listen: Endpoint,
    /// Keep this unauthenticated port although the authenticated `agent` is configured
    /// (the QEMU harness stops VMs through it). Without it, a configuration with both is
    /// refused: the control port is off once the agent is on.
    #[serde(default)]
    pub with_agent: bool,
}

/// What the kernel is asked to do at the end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShutdownAction {
    /// `reboot(RB_POWER_OFF)`: QEMU and Cloud Hypervisor end the VM.
    #[default]
    Poweroff,
    /// `reboot(RB_AUTOBOOT)`: Firecracker on x86 (with `reboot=k`) ends the VM only so.
    Reboot,
}

/// The `shutdown` section.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownConfig {
    /// Time between SIGTERM and SIGKILL.
    #[serde(default = "default_grace_ms")]
    pub grace_period_ms: u64,
    /// Power off or reboot.
    #[serde(default)]
    pub action: ShutdownAction,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig {
            grace_period_ms: default_grace_ms(),
            action: ShutdownAction::default(),
        }
    }
}

fn default_grace_ms() -> u64 {
    5000
}

/// The app's credentials, resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary group ids.
    pub groups: Vec<u32>,
}

impl AppConfig {
    /// Resolves user, group and supplementary groups; errors name the field.
    pub fn resolve_ids(&self) -> Result<Credentials, ConfigError> {
        let (uid, passwd_gid) = self
            .user
            .resolve_user()
            .map_err(|e| ConfigError::invalid("app.user", e.to_string()))?;
        let gid = match &self.group {
            Some(g) => g
                .resolve_group()
                .map_err(|e| ConfigError::invalid("app.group", e.to_string()))?,
            None => passwd_gid.ok_or_else(|| {
                ConfigError::invalid(
                    "app.group",
                    format!(
                        "missing, and user {} has no /etc/passwd entry to take a primary group from; set app.group",
                        self.user
                    ),
                )
            })?,
        };
        let mut groups = Vec::with_capacity(self.supplementary_groups.len());
        for (i, g) in self.supplementary_groups.iter().enumerate() {
            groups.push(
                g.resolve_group()
                    .map_err(|e| {
                        ConfigError::invalid(
                            format!("app.supplementary_groups[{i}]"),
                            e.to_string(),
                        )
                    })?
                    .as_raw(),
            );
        }
        Ok(Credentials {
            uid: uid.as_raw(),
            gid: gid.as_raw(),
            groups,
        })
    }
}
