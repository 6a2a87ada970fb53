//! The relay's configuration: one JSON file per app (per VM), validated before anything binds.
//!
//! One process serves one app: every service the app declared is an *instance* (its own
//! listener and accept loop), and every platform service it did not declare is listed too,
//! so the relay can listen there and refuse (see [`crate::admission`]). The file says where
//! the guest's connections arrive (`transport`, a tagged enum carrying exactly what each
//! transport needs), which app they belong to, and where each
//! declared service's connections go (`upstream`, the service's per-app endpoint or its
//! shared socket dialled as the app's user, see [`crate::privileges`]).
//!
//! Parsing is strict: unknown fields are refused (`deny_unknown_fields`), so a typo never
//! silently turns off a check. [`Config::validate`] then checks what serde cannot (a
//! registered CID's range, a path for every service in the unix transport, unique ports, a per-app client address for the `substitute` policy...)
//! and every error names the field and how to fix it. Field reference: `docs/RELAY.md`.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vm_transport::field::FieldError;
use vm_transport::vsock::{FIRST_GUEST_CID, VMADDR_CID_ANY, VMADDR_CID_LOCAL};
use vm_transport::Endpoint;

use crate::dovecot::DEFAULT_ALLOW_FIELDS;

mod types;
pub use types::*;

/// A configuration problem: which field, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The JSON does not match the schema.
    #[error("{field}: {source} (see docs/RELAY.md for every field)")]
    Parse {
        /// The field's path, e.g. `socket.mode` (`.` for the document itself).
        field: String,
        /// serde's message, with line and column.
        #[source]
        source: serde_json::Error,
    },
    /// A field has a value the relay cannot use.
    #[error(transparent)]
    Invalid(#[from] FieldError),
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(FieldError::new(field.into(), reason))
}

/// The whole file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The app's name (log lines).
    pub app: String,
    /// The VM.
    pub vm: VmConfig,
    /// Where guest connections arrive.
    pub transport: Transport,
    /// The guest-facing socket files.
    #[serde(default)]
    pub socket: SocketConfig,
    /// Become this user after binding (option b); absent: stay as started.
    #[serde(default)]
    pub run_as: Option<RunAs>,
    /// Declared services.
    pub services: Vec<ServiceConfig>,
    /// Platform services not declared (refused and logged).
    #[serde(default)]
    pub undeclared: Vec<UndeclaredConfig>,
}

/// One listener the relay will open, derived from the configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenSpec {
    /// Service name.
    pub name: String,
    /// Port (also for per-VM socket names).
    pub port: u32,
    /// Where to listen.
    pub endpoint: Endpoint,
}

impl Config {
    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(&text)
    }

    /// Parses and validates JSON text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            // An empty path is a top-level key that is itself empty (`{"": 1}`; the fuzz
            // target `guest_config` found this in guest-init's parser): name the document,
            // as for `.`.
            let field = match e.path().to_string() {
                f if f.is_empty() => ".".to_string(),
                f => f,
            };
            ConfigError::Parse {
                field,
                source: e.into_inner(),
            }
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks everything serde cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.app.is_empty() || self.app.chars().any(|c| c.is_control() || c == '/') {
            return Err(invalid(
                "app",
                "must be a non-empty name without '/' or control characters",
            ));
        }
        if self.socket.mode.bits() & 0o007 != 0 {
            return Err(invalid(
                "socket.mode",
                "gives access to other users: any local user could speak as this VM; use 0600 or 0660",
            ));
        }
        match &self.transport {
            Transport::PerVmSocket { vsock_uds } if !vsock_uds.is_absolute() => {
                return Err(invalid(
                    "transport.per_vm_socket.vsock_uds",
                    "must be the VMM's absolute hybrid vsock socket path",
                ))
            }
            Transport::PerVmSocket { .. } => {}
            // CID 1 (VMADDR_CID_LOCAL) is accepted too: with it the relay admits only
            // loopback peers of its own kernel, never a VM. It exists so the real AF_VSOCK
            // accept path can be exercised inside a guest over `vsock_loopback` (the VM
            // tests do); 0 (hypervisor), 2 (host) and VMADDR_CID_ANY stay refused.
            Transport::Cid { cid } => {
                if !(*cid == VMADDR_CID_LOCAL || (FIRST_GUEST_CID..VMADDR_CID_ANY).contains(cid)) {
                    return Err(invalid(
                        "transport.cid.cid",
                        "must be the guest CID the platform registered (3 or above; \
                         0, 2 and 4294967295 never name a guest)",
                    ));
                }
            }
            Transport::Unix { listen } => self.check_unix_paths(listen)?,
        }
        if let Some(r) = &self.run_as {
            crate::privileges::check_run_as(r).map_err(|e| invalid(e.field, e.reason))?;
        }
        if self.services.is_empty() {
            return Err(invalid(
                "services",
                "is empty: declare at least one service",
            ));
        }
        let mut names = HashSet::new();
        let mut ports = HashSet::new();
        for (i, s) in self.services.iter().enumerate() {
            let f = format!("services[{i}]");
            if !names.insert(s.name.clone()) {
                return Err(invalid(format!("{f}.name"), "duplicate service name"));
            }
            if !ports.insert(s.port) {
                return Err(invalid(format!("{f}.port"), "port used twice"));
            }
            s.upstream
                .validate()
                .map_err(|r| invalid(format!("{f}.upstream"), r))?;
            match (s.kind, &s.dovecot) {
                (Kind::Stream, Some(_)) => {
                    return Err(invalid(
                        format!("{f}.dovecot"),
                        "only for kind \"dovecot-auth\"; remove it or set the kind",
                    ))
                }
                (Kind::DovecotAuth, d) => self.check_dovecot(&f, &d.clone().unwrap_or_default())?,
                (Kind::Stream, None) => {}
            }
            if !(1..=65_535).contains(&s.max_upstream) {
                return Err(invalid(
                    format!("{f}.max_upstream"),
                    "must be 1 to 65535: connections beyond it wait, so 0 would block every one",
                ));
            }
        }
        for (i, u) in self.undeclared.iter().enumerate() {
            let f = format!("undeclared[{i}]");
            if !names.insert(u.name.clone()) {
                return Err(invalid(format!("{f}.name"), "duplicate service name"));
            }
            if !ports.insert(u.port) {
                return Err(invalid(format!("{f}.port"), "port used twice"));
            }
        }
        // The resulting listen endpoints must be valid socket addresses.
        for l in self.listeners() {
            l.endpoint
                .validate()
                .map_err(|r| invalid(format!("listener for {}", l.name), r))?;
        }
        Ok(())
    }

    /// Unix transport: one absolute path for every service, declared or not, and no path
    /// for a service that does not exist.
    fn check_unix_paths(&self, listen: &BTreeMap<String, PathBuf>) -> Result<(), ConfigError> {
        let names: Vec<&str> = self
            .services
            .iter()
            .map(|s| s.name.as_str())
            .chain(self.undeclared.iter().map(|u| u.name.as_str()))
            .collect();
        for n in &names {
            match listen.get(*n) {
                Some(p) if p.is_absolute() => {}
                Some(_) => {
                    return Err(invalid(
                        format!("transport.unix.listen.{n}"),
                        "must be an absolute path",
                    ))
                }
                None => {
                    return Err(invalid(
                        format!("transport.unix.listen.{n}"),
                        "missing: the unix transport needs a listening path for every service",
                    ))
                }
            }
        }
        if let Some(extra) = listen.keys().find(|k| !names.contains(&k.as_str())) {
            return Err(invalid(
                format!("transport.unix.listen.{extra}"),
                "names no service in services or undeclared; remove it or fix the name",
            ));
        }
        Ok(())
    }

    /// A dovecot-auth service fails closed: every setting that would let a guest's `rip`
    /// or trust fields through is refused, naming the field and the fix. Exceptions are
    /// explicit `unsafe_*` settings, never defaults.
    fn check_dovecot(&self, f: &str, d: &DovecotConfig) -> Result<(), ConfigError> {
        let f = format!("{f}.dovecot");
        if self.vm.gateways.is_empty() && !self.vm.unsafe_no_gateways {
            return Err(invalid(
                "vm.gateways",
                format!(
                    "required by the dovecot-auth service {f}: without the VM's gateway \
                     addresses a guest's rip=<gateway> reaches Dovecot verbatim and every \
                     app behind that NAT shares one attempt budget; list them (QEMU user \
                     networking: \"10.0.2.2\"), or, only for a VM with no NAT at all, set \
                     vm.unsafe_no_gateways to true"
                ),
            ));
        }
        if d.reserved_networks.is_empty() && !d.unsafe_no_reserved_networks {
            return Err(invalid(
                format!("{f}.reserved_networks"),
                "required: the platform's per-app client address pool (e.g. \"100.64.0.0/10\"); \
                 without it a guest can send another app's address as rip and spend that \
                 app's attempt budget (set unsafe_no_reserved_networks to true to accept that)",
            ));
        }
        if d.rip_policy == RipPolicy::Substitute {
            let Some(addr) = d.client_address else {
                return Err(invalid(
                    format!("{f}.client_address"),
                    "the substitute policy needs the app's per-app client address (unique per app), or set rip_policy to \"drop\"",
                ));
            };
            if self.vm.gateways.contains(&addr) {
                return Err(invalid(
                    format!("{f}.client_address"),
                    "equals a gateway address; give the app its own address",
                ));
            }
            if !d.reserved_networks.is_empty()
                && !d.reserved_networks.iter().any(|n| n.contains(&addr))
            {
                return Err(invalid(
                    format!("{f}.client_address"),
                    format!(
                        "{addr} lies outside reserved_networks: the app's own address must come \
                         from the platform's per-app pool, so no other guest can claim it"
                    ),
                ));
            }
        }
        if let Some(fields) = &d.allow_fields {
            for (i, k) in fields.iter().enumerate() {
                if k.is_empty() || k.bytes().any(|b| b == b'\t' || b == b'=' || b < 0x20) {
                    return Err(invalid(
                        format!("{f}.allow_fields[{i}]"),
                        "must be a parameter key without '=', tabs or control characters",
                    ));
                }
                if crate::dovecot::is_trust_field(k) {
                    return Err(invalid(
                        format!("{f}.allow_fields[{i}]"),
                        format!(
                            "{k:?} grants the guest trust Dovecot gives only to its own \
                             services; it can never be allowed"
                        ),
                    ));
                }
                if k == "resp" {
                    return Err(invalid(
                        format!("{f}.allow_fields[{i}]"),
                        "resp is always passed (and kept last); remove it from the list",
                    ));
                }
            }
        }
        Ok(())
    }

    /// The allow-list of a dovecot-auth service.
    pub fn allow_fields(d: &DovecotConfig) -> Vec<String> {
        d.allow_fields
            .clone()
            .unwrap_or_else(|| DEFAULT_ALLOW_FIELDS.iter().map(|s| s.to_string()).collect())
    }

    /// Where the service `name` with `port` listens.
    pub fn endpoint_for(&self, name: &str, port: u32) -> Endpoint {
        match &self.transport {
            Transport::PerVmSocket { vsock_uds } => {
                let mut s = vsock_uds.as_os_str().to_owned();
                s.push(format!("_{port}"));
                Endpoint::Unix(PathBuf::from(s))
            }
            Transport::Cid { .. } => Endpoint::Vsock {
                cid: VMADDR_CID_ANY,
                port,
            },
            Transport::Unix { listen } => {
                Endpoint::Unix(listen.get(name).cloned().unwrap_or_default())
            }
        }
    }

    /// Every listener, declared services first, then undeclared ones.
    pub fn listeners(&self) -> Vec<ListenSpec> {
        let declared = self.services.iter().map(|s| (&s.name, s.port));
        let undeclared = self.undeclared.iter().map(|u| (&u.name, u.port));
        declared
            .chain(undeclared)
            .map(|(name, port)| ListenSpec {
                name: name.clone(),
                port,
                endpoint: self.endpoint_for(name, port),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Value {
        serde_json::json!({
            "app": "radicale",
            "vm": {"id": "vm1", "gateways": ["10.0.2.2"]},
            "transport": {"per_vm_socket": {"vsock_uds": "/run/vm1/vm.vsock"}},
            "services": [{"name": "dovecot-auth", "port": 5001, "kind": "dovecot-auth",
                          "upstream": {"unix": "/run/dovecot/auth-radicale"},
                          "dovecot": {"client_address": "100.64.0.7",
                                      "reserved_networks": ["100.64.0.0/10"]}}],
            "undeclared": [{"name": "agent", "port": 5003}]
        })
    }

    fn err(v: serde_json::Value) -> String {
        Config::parse(&v.to_string()).unwrap_err().to_string()
    }

    #[test]
    fn accepts_the_documented_shape() {
        let c = Config::parse(&base().to_string()).unwrap();
        let l = c.listeners();
        assert_eq!(
            l[0].endpoint,
            Endpoint::Unix("/run/vm1/vm.vsock_5001".into())
        );
        assert_eq!(
            l[1].endpoint,
            Endpoint::Unix("/run/vm1/vm.vsock_5003".into())
        );
        assert_eq!(c.socket.mode.bits(), 0o600);
    }

    /// Regression (the gap the fuzz target `guest_config` found in guest-init's parser, here
    /// too): an empty top-level key gave an error that named no field.
    #[test]
    fn an_empty_key_still_names_where() {
        let mut v = base();
        v[""] = 1.into();
        let e = err(v);
        assert!(e.starts_with(".: unknown field ``"), "{e}");
    }

    #[test]
    fn unknown_fields_are_refused_by_name() {
        let mut v = base();
        v["servces"] = serde_json::json!([]);
        assert!(err(v).contains("servces"));
        let mut v = base();
        v["services"][0]["dovecot"]["rip_polcy"] = "drop".into();
        assert!(err(v).contains("rip_polcy"));
    }

    #[test]
    fn errors_name_the_field() {
        let mut v = base();
        v["services"][0]["dovecot"] = serde_json::json!({"reserved_networks": ["100.64.0.0/10"]});
        assert!(err(v).starts_with("services[0].dovecot.client_address"));
        let mut v = base();
        v["services"][0]["dovecot"]["client_address"] = "10.0.2.2".into();
        assert!(err(v).contains("gateway"));
        let mut v = base();
        v["transport"]["per_vm_socket"]["vsock_uds"] = "vm.vsock".into();
        assert!(err(v).starts_with("transport.per_vm_socket.vsock_uds"));
        let mut v = base();
        v["transport"] = serde_json::json!({"per_vm_socket": {}});
        let e = err(v);
        assert!(e.starts_with("transport.per_vm_socket"), "{e}");
        let mut v = base();
        v["transport"] = serde_json::json!({"cid": {"cid": 2}});
        assert!(err(v).starts_with("transport.cid.cid"));
        let mut v = base();
        v["transport"] = serde_json::json!({"cid": {"cid": 7, "vsock_uds": "/x"}});
        assert!(err(v).contains("vsock_uds"));
        let mut v = base();
        v["mode"] = "cid".into();
        assert!(err(v).contains("mode"));
        let mut v = base();
        v["undeclared"][0]["port"] = 5001.into();
        assert!(err(v).starts_with("undeclared[0].port"));
        let mut v = base();
        v["socket"] = serde_json::json!({"mode": "0666"});
        assert!(err(v).starts_with("socket.mode"));
        let mut v = base();
        v["socket"] = serde_json::json!({"mode": "rw"});
        assert!(err(v).starts_with("socket.mode"));
        let mut v = base();
        v["run_as"] = serde_json::json!({"uid": 0, "gid": 0});
        assert!(err(v).starts_with("run_as.uid"));
        let mut v = base();
        v["run_as"] = serde_json::json!({"uid": 1000, "gid": 0});
        assert!(err(v).starts_with("run_as.gid"));
        let mut v = base();
        v["run_as"] = serde_json::json!({"uid": 1000, "gid": 1000, "groups": [5, 0]});
        assert!(err(v).starts_with("run_as.groups[1]"));
        let mut v = base();
        v["transport"] = serde_json::json!({"unix": {"listen": {"dovecot-auth": "/a"}}});
        assert!(err(v).starts_with("transport.unix.listen.agent"));
        let mut v = base();
        v["transport"] =
            serde_json::json!({"unix": {"listen": {"dovecot-auth": "a", "agent": "/b"}}});
        assert!(err(v).starts_with("transport.unix.listen.dovecot-auth"));
        let mut v = base();
        v["transport"] = serde_json::json!({"unix": {"listen":
            {"dovecot-auth": "/a", "agent": "/b", "typo": "/c"}}});
        assert!(err(v).starts_with("transport.unix.listen.typo"));
        let mut v = base();
        v["services"][0]["listen"] = "/x".into();
        assert!(err(v).contains("listen"));
        let mut v = base();
        v["services"][0]["dovecot"]["allow_fields"] = serde_json::json!(["resp"]);
        assert!(err(v).starts_with("services[0].dovecot.allow_fields[0]"));
        let mut v = base();
        v["services"][0]["kind"] = "stream".into();
        assert!(err(v).starts_with("services[0].dovecot"));
        let mut v = base();
        v["services"] = serde_json::json!([]);
        assert!(err(v).starts_with("services"));
        let mut v = base();
        v["app"] = "a/b".into();
        assert!(err(v).starts_with("app"));
    }

    /// Each setting that would let a guest's rip or trust fields through is refused, and
    /// only the loudly named `unsafe_*` switch turns a refusal into acceptance.
    #[test]
    fn the_dovecot_filter_fails_closed() {
        let mut v = base();
        v["vm"]["gateways"] = serde_json::json!([]);
        let e = err(v.clone());
        assert!(e.starts_with("vm.gateways: required"), "{e}");
        v["vm"]["unsafe_no_gateways"] = true.into();
        Config::parse(&v.to_string()).unwrap();

        let mut v = base();
        v["services"][0]["dovecot"]["reserved_networks"] = serde_json::json!([]);
        let e = err(v.clone());
        assert!(
            e.starts_with("services[0].dovecot.reserved_networks: required"),
            "{e}"
        );
        v["services"][0]["dovecot"]["unsafe_no_reserved_networks"] = true.into();
        Config::parse(&v.to_string()).unwrap();

        let mut v = base();
        v["services"][0]["dovecot"]["client_address"] = "192.0.2.7".into();
        let e = err(v);
        assert!(e.starts_with("services[0].dovecot.client_address"), "{e}");
        assert!(e.contains("outside reserved_networks"), "{e}");

        for trust in [
            "no-penalty",
            "secured",
            "valid-client-cert",
            "cert_username",
            "real_rip",
            "forward_x",
            "debug",
        ] {
            let mut v = base();
            v["services"][0]["dovecot"]["allow_fields"] = serde_json::json!(["service", trust]);
            let e = err(v);
            assert!(
                e.starts_with("services[0].dovecot.allow_fields[1]"),
                "{trust}: {e}"
            );
            assert!(e.contains("can never be allowed"), "{e}");
        }
    }

    #[test]
    fn drop_policy_needs_no_address_and_cid_mode_listens_on_vsock_any() {
        let mut v = base();
        v["services"][0]["dovecot"] =
            serde_json::json!({"rip_policy": "drop", "reserved_networks": ["100.64.0.0/10"]});
        v["transport"] = serde_json::json!({"cid": {"cid": 7}});
        let c = Config::parse(&v.to_string()).unwrap();
        assert_eq!(
            c.listeners()[0].endpoint,
            Endpoint::Vsock {
                cid: u32::MAX,
                port: 5001
            }
        );
    }
}
