//! The configuration: one JSON file that says everything PID 1 does.
//!
//! Where it comes from, first match wins:
//! 1. `--config PATH` on guest-init's own command line (tests, ordinary-process mode);
//! 2. `guest_init.config=PATH` on the kernel command line (`/proc/cmdline`; PID 1 only, so
//!    an image can carry several configurations and the VM's launcher picks one);
//! 3. [`DEFAULT_PATH`].
//!
//! Design:
//! - **Strict parsing.** Every struct denies unknown fields and the file carries a
//!   `version`: a misspelt field (`"grace_period"` for `"grace_period_ms"`) is an error, not
//!   a silently ignored setting that changes how the VM behaves.
//! - **Errors name the field.** `serde_json` reports only a line and column, so parsing goes
//!   through `serde_path_to_error`, which tracks the path (`app.restart.max_restarts`), and
//!   a second, semantic pass ([`Config::validate`]) checks what types cannot: absolute paths,
//!   that users and groups resolve, a non-empty command. Each message has the form
//!   `<field path>: <what is wrong>; <how to fix it>`.
//! - **Validation touches nothing.** It reads `/etc/passwd` and `/etc/group` through libc but
//!   never mounts, binds or spawns, so `guest-init check-config FILE` is safe anywhere.
//! - **Secrets stay out.** This file holds no secret itself; enrollment's bootstrap token is
//!   referenced by path inside the `enrollment` section (see `docs/ENROLLMENT.md`), and no
//!   error message quotes a value from that section.
//!
//! Every field is documented, with its default and an example, in `docs/CONFIG.md`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::enroll::EnrollConfig;
use crate::forward::{ExportSpec, ServiceSpec};
use vm_transport::field::FieldError;
use vm_transport::Endpoint;

mod sections;
pub use sections::*;

/// Where the configuration is read from when nothing else names a path.
pub const DEFAULT_PATH: &str = "/etc/guest-init.json";

/// The kernel command-line parameter that names the configuration path.
pub const CMDLINE_KEY: &str = "guest_init.config";

/// The configuration format version this build understands.
pub const VERSION: u32 = 1;

/// The `PATH` the app gets when its `env` does not set one.
pub const DEFAULT_APP_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A configuration that cannot be used. Messages name the field, not the file: callers
/// say which file they read (see [`Config::load_described`]).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read configuration {path}: {source}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The JSON does not parse or does not match the schema.
    #[error("{field}: {message} (line {line}, column {column})")]
    Parse {
        /// The field path, e.g. `app.restart.max_restarts`.
        field: String,
        /// What is wrong.
        message: String,
        /// Line of the error.
        line: usize,
        /// Column of the error.
        column: usize,
    },
    /// A field has a value that parses but cannot be used.
    #[error(transparent)]
    Invalid(#[from] FieldError),
}

impl ConfigError {
    fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid(FieldError::new(field.into(), reason))
    }
}

/// The whole configuration file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Format version; must be [`VERSION`].
    pub version: u32,
    /// Hostname to set (PID 1 only).
    #[serde(default)]
    pub hostname: Option<String>,
    /// The most verbose console level printed.
    #[serde(default)]
    pub log_level: LogLevel,
    /// Kernel modules to load, in order, from `modules_dir/<name>.ko`.
    #[serde(default)]
    pub modules: Vec<String>,
    /// Where the module files are.
    #[serde(default = "default_modules_dir")]
    pub modules_dir: PathBuf,
    /// Optional switch to a root filesystem on a block device.
    #[serde(default)]
    pub root: Option<RootConfig>,
    /// Optional static IPv4 configuration of one interface.
    #[serde(default)]
    pub network: Option<NetworkConfig>,
    /// The app PID 1 runs.
    pub app: AppConfig,
    /// Guest-to-host socket forwarding (`docs/FORWARDING.md`).
    #[serde(default)]
    pub services: Vec<ServiceSpec>,
    /// Host-to-guest forwarding (`docs/FORWARDING.md`).
    #[serde(default)]
    pub exports: Vec<ExportSpec>,
    /// The host's control port (stop, ping).
    #[serde(default)]
    pub control: Option<ControlConfig>,
    /// How the VM ends.
    #[serde(default)]
    pub shutdown: ShutdownConfig,
    /// Enrollment for a key and certificate (`docs/ENROLLMENT.md`).
    #[serde(default)]
    pub enrollment: Option<EnrollConfig>,
    /// The authenticated management channel (`docs/AGENT.md`); needs `enrollment`.
    #[serde(default)]
    pub agent: Option<crate::agent::AgentConfig>,
    /// Test hook: panic deliberately right after the ready line, to exercise the panic path.
    #[serde(default)]
    pub debug_panic_after_ready: bool,
}

fn default_modules_dir() -> PathBuf {
    PathBuf::from("/lib/modules")
}

impl Config {
    /// Reads, parses and validates a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let cfg = Config::parse(&text)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// [`Config::load`], with the file named in the error message (for the console and
    /// `check-config`).
    pub fn load_described(path: &Path) -> Result<Config, String> {
        Config::load(path).map_err(|e| match e {
            ConfigError::Read { .. } => e.to_string(),
            _ => format!("configuration {}: {e}", path.display()),
        })
    }

    /// Parses JSON text. Does not validate.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let inner = e.inner();
            let (line, column) = (inner.line(), inner.column());
            let mut message = inner.to_string();
            // serde_json appends " at line L column C"; we print them once, at the end.
            if let Some(i) = message.rfind(" at line ") {
                message.truncate(i);
            }
            let mut field = e.path().to_string();
            // A missing field is reported at its parent; name the field itself.
            if let Some(name) = message
                .strip_prefix("missing field `")
                .and_then(|r| r.split('`').next())
            {
                field = if field == "." {
                    name.to_owned()
                } else {
                    format!("{field}.{name}")
                };
            }
            // `.` is the document itself; an empty path is a top-level key that is itself
            // empty (`{"": 1}`, found by the fuzz target `guest_config`).
            if field == "." || field.is_empty() {
                field = "(top level)".into();
            }
            ConfigError::Parse {
                field,
                message,
                line,
                column,
            }
        })
    }

    /// Checks everything the types cannot express. Touches nothing but the passwd and group
    /// databases.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.version != VERSION {
            return Err(ConfigError::invalid(
                "version",
                format!(
                    "version {} is not supported; this guest-init reads version {VERSION}",
                    self.version
                ),
            ));
        }
        if let Some(h) = &self.hostname {
            let ok = !h.is_empty()
                && h.len() <= 64
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
            if !ok {
                return Err(ConfigError::invalid(
                    "hostname",
                    format!("{h:?} is not a hostname; use 1 to 64 letters, digits, '-' or '.'"),
                ));
            }
        }
        for (i, m) in self.modules.iter().enumerate() {
            if m.is_empty() || m.contains('/') || m.ends_with(".ko") {
                return Err(ConfigError::invalid(
                    format!("modules[{i}]"),
                    format!("{m:?} is not a module name; write the bare name such as \"virtio_pci\" (the file is modules_dir/<name>.ko)"),
                ));
            }
        }
        absolute("modules_dir", &self.modules_dir)?;
        if let Some(root) = &self.root {
            absolute("root.device", &root.device)?;
            if root.fstype.is_empty() {
                return Err(ConfigError::invalid(
                    "root.fstype",
                    "empty; name a filesystem type such as \"ext4\"",
                ));
            }
        }
        if let Some(net) = &self.network {
            if net.interface.is_empty() || net.interface.len() >= libc::IFNAMSIZ {
                return Err(ConfigError::invalid(
                    "network.interface",
                    format!(
                        "{:?} is not an interface name (1 to 15 bytes)",
                        net.interface
                    ),
                ));
            }
            net.parsed_address()
                .map_err(|r| ConfigError::invalid("network.address", r))?;
        }
        self.validate_app()?;
        crate::forward::validate(&self.services, &self.exports)?;
        // Socket owners and groups must exist in this image, like the app's user.
        crate::forward::check_ids(&self.services)?;
        if let Some(c) = &self.control {
            c.listen
                .validate()
                .map_err(|r| ConfigError::invalid("control.listen", r))?;
            if let Endpoint::Tcp(_) = c.listen {
                // The control port admits only the host (vsock CID 2); on TCP nothing tells
                // the host from the app, so every peer would be refused.
                return Err(ConfigError::invalid(
                    "control.listen",
                    "a TCP control port would refuse every caller (only the host's vsock CID \
                     is admitted); listen on vsock, e.g. {\"vsock\": {\"cid\": 4294967295, \"port\": 1024}}, \
                     or on a Unix path for tests",
                ));
            }
            if let Endpoint::Vsock { port, .. } = c.listen {
                if port == u32::MAX {
                    return Err(ConfigError::invalid(
                        "control.listen",
                        "vsock port 4294967295 cannot be listened on; use a fixed port such as 1024",
                    ));
                }
            }
        }
        if let Some(e) = &self.enrollment {
            crate::enroll::validate(e).map_err(|r| ConfigError::invalid("enrollment", r))?;
        }
        if let Some(a) = &self.agent {
            crate::agent::validate(a).map_err(|r| ConfigError::invalid("agent", r))?;
            if self.enrollment.is_none() {
                return Err(ConfigError::invalid(
                    "agent",
                    "needs the enrollment section: the agent serves with the enrolled certificate and admits operators of the pinned management CA",
                ));
            }
            if self.control.as_ref().is_some_and(|c| !c.with_agent) {
                return Err(ConfigError::invalid(
                    "control",
                    "the unauthenticated control port is off once agent is configured; remove the section, or set control.with_agent: true to keep it (e.g. for the QEMU harness)",
                ));
            }
        }
        Ok(())
    }

    fn validate_app(&self) -> Result<(), ConfigError> {
        let app = &self.app;
        match app.command.first() {
            None => {
                return Err(ConfigError::invalid(
                    "app.command",
                    "empty; give the program and its arguments, e.g. [\"/usr/bin/radicale\"]",
                ))
            }
            Some(p) if p.is_empty() => {
                return Err(ConfigError::invalid(
                    "app.command[0]",
                    "empty program name; give an absolute path or a name found in PATH",
                ))
            }
            _ => {}
        }
        if app.command.iter().any(|a| a.contains('\0')) {
            return Err(ConfigError::invalid(
                "app.command",
                "an argument contains a NUL byte",
            ));
        }
        app.resolve_ids()?;
        for (k, v) in &app.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(ConfigError::invalid(
                    format!("app.env.{k}"),
                    "a variable name must be non-empty without '=' and neither name nor value may contain NUL",
                ));
            }
        }
        absolute("app.workdir", &app.workdir)?;
        let r = &app.restart;
        if r.initial_backoff_ms > r.max_backoff_ms {
            return Err(ConfigError::invalid(
                "app.restart.initial_backoff_ms",
                format!(
                    "{} is above max_backoff_ms {}; lower it or raise max_backoff_ms",
                    r.initial_backoff_ms, r.max_backoff_ms
                ),
            ));
        }
        Ok(())
    }
}

fn absolute(field: &str, p: &Path) -> Result<(), ConfigError> {
    if p.is_absolute() {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            field,
            format!(
                "relative path {:?}; use an absolute path",
                p.display().to_string()
            ),
        ))
    }
}

/// Finds `guest_init.config=PATH` in a kernel command line.
pub fn path_from_cmdline(cmdline: &str) -> Option<PathBuf> {
    cmdline.split_ascii_whitespace().find_map(|tok| {
        tok.strip_prefix(CMDLINE_KEY)
            .and_then(|r| r.strip_prefix('='))
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
    })
}

/// Chooses the configuration path: `--config` first, then (PID 1 only) the kernel command
/// line, then [`DEFAULT_PATH`].
pub fn choose_path(flag: Option<&Path>, read_cmdline: bool) -> PathBuf {
    if let Some(p) = flag {
        return p.to_owned();
    }
    if read_cmdline {
        if let Some(p) = std::fs::read_to_string("/proc/cmdline")
            .ok()
            .as_deref()
            .and_then(path_from_cmdline)
        {
            return p;
        }
    }
    PathBuf::from(DEFAULT_PATH)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (fuzz target `guest_config`): an empty top-level key gave an error that
    /// named no field at all (`: unknown field ``, ...`).
    #[test]
    fn an_empty_key_still_names_where() {
        for text in [r#"{"": 1}"#, r#"{"version": 1, "": 1}"#] {
            let e = Config::parse(text).unwrap_err();
            let ConfigError::Parse { field, .. } = &e else {
                panic!("{e}")
            };
            assert_eq!(field, "(top level)", "{e}");
            assert!(
                e.to_string().starts_with("(top level): unknown field"),
                "{e}"
            );
        }
    }
    use std::net::Ipv4Addr;

    const MINIMAL: &str = r#"{"version": 1, "app": {"command": ["/bin/true"], "user": 0}}"#;

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::parse(MINIMAL).unwrap();
        c.validate().unwrap();
        assert_eq!(c.shutdown.grace_period_ms, 5000);
        assert_eq!(c.shutdown.action, ShutdownAction::Poweroff);
        assert_eq!(c.app.restart.policy, RestartPolicy::Never);
        assert_eq!(c.modules_dir, PathBuf::from("/lib/modules"));
        assert_eq!(c.app.workdir, PathBuf::from("/"));
        assert_eq!(c.log_level, LogLevel::Info);
        // root has a passwd entry, so its group comes from there.
        assert_eq!(c.app.resolve_ids().unwrap().gid, 0);
    }

    #[test]
    fn cmdline_parameter_is_found() {
        assert_eq!(
            path_from_cmdline("console=ttyS0 guest_init.config=/etc/b.json quiet"),
            Some(PathBuf::from("/etc/b.json"))
        );
        assert_eq!(
            path_from_cmdline("console=ttyS0 guest_init.configx=/a"),
            None
        );
        assert_eq!(path_from_cmdline("guest_init.config="), None);
        assert_eq!(
            choose_path(Some(Path::new("/x.json")), true),
            PathBuf::from("/x.json")
        );
    }

    #[test]
    fn network_address_parses() {
        let n = NetworkConfig {
            interface: "eth0".into(),
            address: "10.0.2.15/24".into(),
            gateway: None,
            wait_ms: 0,
        };
        assert_eq!(
            n.parsed_address().unwrap(),
            (Ipv4Addr::new(10, 0, 2, 15), 24)
        );
        for bad in ["10.0.2.15", "10.0.2/24", "10.0.2.15/33", "x/8"] {
            let n = NetworkConfig {
                address: bad.into(),
                ..n.clone()
            };
            assert!(n.parsed_address().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_tcp_control_port_is_refused_because_it_would_admit_nobody() {
        let mut c: Config = serde_json::from_value(serde_json::json!({
            "version": 1,
            "app": {"command": ["/bin/true"], "user": 0, "group": 0},
            "control": {"listen": {"tcp": "127.0.0.1:1024"}}
        }))
        .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.starts_with("control.listen: a TCP control port"), "{e}");
        c.control = serde_json::from_value(
            serde_json::json!({"listen": {"vsock": {"cid": 4294967295u32, "port": 1024}}}),
        )
        .unwrap();
        c.validate().unwrap();
    }
}
