//! What the forwarding configuration says, and checking it before anything binds.
//!
//! A [`ServiceSpec`] is a guest-to-host service (the app's unchanged Unix path, forwarded
//! to the host's vsock port); an [`ExportSpec`] is the mirror image (a vsock port the host
//! dials, forwarded to a guest service). [`validate`] checks everything that can be
//! checked without touching the system, and every error names the field and the fix;
//! users and groups are resolved separately ([`check_ids`]) because that needs
//! `/etc/passwd`, which a check run on the build host does not have.

use std::collections::HashSet;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use vm_transport::field::FieldError;
use vm_transport::mode::SocketMode;
use vm_transport::Endpoint;

use super::dial::DialPolicy;
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
    /// Mode of the socket file, as an octal string such as `"0660"` (default `"0666"`).
    #[serde(default)]
    pub mode: Option<SocketMode>,
    /// How the target is dialled while the host side is not up yet.
    #[serde(default)]
    pub dial: DialPolicy,
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
    /// How the guest service is dialled while it is not up yet.
    #[serde(default)]
    pub dial: DialPolicy,
}

/// A forwarding error.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// A field is invalid.
    #[error(transparent)]
    Invalid(#[from] FieldError),
    /// A Unix socket could not be published at its path.
    #[error("{name}: cannot listen: {source}")]
    Publish {
        /// Service or export name.
        name: String,
        /// The cause, naming the path.
        #[source]
        source: vm_transport::publish::PublishError,
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

fn invalid(field: String, reason: impl Into<String>) -> FieldError {
    FieldError::new(field, reason)
}

/// The longest name accepted; names appear in every log line about their listener.
const MAX_NAME: usize = 64;

fn check_name(field: String, name: &str, seen: &mut HashSet<String>) -> Result<(), FieldError> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(invalid(
            field,
            format!("must be 1 to {MAX_NAME} characters long"),
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@')))
    {
        return Err(invalid(
            field,
            format!("{name:?} contains {c:?}; use letters, digits, '-', '_', '.' and '@'"),
        ));
    }
    if !seen.insert(name.to_owned()) {
        return Err(invalid(
            field,
            format!("{name:?} is used twice; every service and export needs its own name"),
        ));
    }
    Ok(())
}

/// Checks a Unix path to listen at: absolute, no `..`, fits a socket address, not a
/// directory name.
fn check_listen_path(field: &str, p: &Path) -> Result<(), FieldError> {
    Endpoint::Unix(p.to_path_buf())
        .validate()
        .map_err(|r| invalid(field.to_owned(), r))?;
    let bytes = p.as_os_str().as_encoded_bytes();
    if bytes.contains(&0) {
        return Err(invalid(field.to_owned(), "the path contains a NUL byte"));
    }
    if p.components().any(|c| c == Component::ParentDir) {
        return Err(invalid(
            field.to_owned(),
            format!("{} contains '..'; write the path without it", p.display()),
        ));
    }
    if p.file_name().is_none() || bytes.ends_with(b"/") {
        return Err(invalid(
            field.to_owned(),
            format!(
                "{} names a directory; give the socket file's path",
                p.display()
            ),
        ));
    }
    Ok(())
}

/// Checks an endpoint this module dials.
fn check_target(field: &str, t: &Endpoint) -> Result<(), FieldError> {
    t.validate().map_err(|r| invalid(field.to_owned(), r))?;
    match t {
        Endpoint::Unix(p) => check_listen_path(field, p),
        Endpoint::Vsock { cid, .. } if *cid == u32::MAX => Err(invalid(
            field.to_owned(),
            "vsock CID 4294967295 (VMADDR_CID_ANY) can only be listened on; the host is CID 2",
        )),
        Endpoint::Tcp(a) if a.port() == 0 || a.ip().is_unspecified() => Err(invalid(
            field.to_owned(),
            format!("tcp:{a} cannot be dialled; give a concrete address and a port other than 0"),
        )),
        _ => Ok(()),
    }
}

/// Checks service and export specs without touching the system.
///
/// Errors name the field (`services[2].listen: ...`) and say how to fix it. Checked: names
/// (non-empty, printable, unique across services and exports), listen paths (absolute, no
/// `..`, at most 107 bytes, unique), targets (dialable, not the forwarder's own listen
/// path), modes (octal syntax) and the dial policy's ranges. Whether users and groups
/// exist depends on the image, not the file: see [`check_ids`].
pub fn validate(services: &[ServiceSpec], exports: &[ExportSpec]) -> Result<(), FieldError> {
    let mut names = HashSet::new();
    let mut listen_paths: HashSet<PathBuf> = HashSet::new();
    let mut listen_other: HashSet<Endpoint> = HashSet::new();
    for (i, s) in services.iter().enumerate() {
        let f = |x: &str| format!("services[{i}].{x}");
        check_name(f("name"), &s.name, &mut names)?;
        check_listen_path(&f("listen"), &s.listen)?;
        // `Path` equality compares components, so `/run//a` and `/run/a` are one path.
        if !listen_paths.insert(s.listen.clone()) {
            return Err(invalid(
                f("listen"),
                format!("{} is already the listen path of another service; each path can have one listener", s.listen.display()),
            ));
        }
        check_target(&f("target"), &s.target)?;
        for (field, id) in [("owner", &s.owner), ("group", &s.group)] {
            if matches!(id, Some(IdRef::Name(n)) if n.is_empty()) {
                return Err(invalid(f(field), "is empty; give a name or a number"));
            }
        }
        s.dial.check(&f("dial"))?;
    }
    for (i, e) in exports.iter().enumerate() {
        let f = |x: &str| format!("exports[{i}].{x}");
        check_name(f("name"), &e.name, &mut names)?;
        match &e.listen {
            Endpoint::Unix(p) => {
                check_listen_path(&f("listen"), p)?;
                if !listen_paths.insert(p.clone()) {
                    return Err(invalid(
                        f("listen"),
                        format!("{} is already another listener's path", p.display()),
                    ));
                }
            }
            Endpoint::Vsock { port, .. } if *port == u32::MAX => {
                return Err(invalid(
                    f("listen"),
                    "vsock port 4294967295 (VMADDR_PORT_ANY) is not a port the host can dial; pick a fixed port",
                ));
            }
            Endpoint::Tcp(a) if a.port() == 0 => {
                return Err(invalid(
                    f("listen"),
                    format!("tcp:{a}: port 0 picks a random port the host cannot know; pick a fixed port"),
                ));
            }
            other => {
                if !listen_other.insert(other.clone()) {
                    return Err(invalid(
                        f("listen"),
                        format!("{other} is already another export's listen address"),
                    ));
                }
            }
        }
        if matches!(e.target, Endpoint::Vsock { .. }) {
            return Err(invalid(
                f("target"),
                "an export forwards to a guest service; use {\"unix\": \"/path\"} or {\"tcp\": \"127.0.0.1:PORT\"}",
            ));
        }
        check_target(&f("target"), &e.target)?;
        e.dial.check(&f("dial"))?;
    }
    // A target that is one of our own listen paths would forward into itself forever.
    let targets = services
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("services[{i}].target"), &s.target))
        .chain(
            exports
                .iter()
                .enumerate()
                .map(|(i, e)| (format!("exports[{i}].target"), &e.target)),
        );
    for (field, t) in targets {
        if let Some(p) = t.unix_path() {
            if listen_paths.contains(p) {
                return Err(invalid(
                    field,
                    format!("{} is a listen path of this configuration; the connection would loop back into guest-init", p.display()),
                ));
            }
        }
    }
    Ok(())
}

/// Resolves every service's `owner` and `group` against this system's user database
/// (the image's `/etc/passwd` and `/etc/group` when run in the VM). [`start`] does the same;
/// this lets a configuration check report an unknown user before anything runs.
pub fn check_ids(services: &[ServiceSpec]) -> Result<(), FieldError> {
    for (i, s) in services.iter().enumerate() {
        resolve_ids(i, s)?;
    }
    Ok(())
}

pub(super) fn resolve_ids(
    i: usize,
    s: &ServiceSpec,
) -> Result<(Option<nix::unistd::Uid>, Option<nix::unistd::Gid>), FieldError> {
    let uid = match &s.owner {
        Some(o) => Some(
            o.resolve_user()
                .map_err(|e| invalid(format!("services[{i}].owner"), e.to_string()))?
                .0,
        ),
        None => None,
    };
    let gid = match &s.group {
        Some(g) => Some(
            g.resolve_group()
                .map_err(|e| invalid(format!("services[{i}].group"), e.to_string()))?,
        ),
        None => None,
    };
    Ok((uid, gid))
}

/// The mode a service socket gets when none is configured. Inside a VM every process is
/// the app's, and the VM is the unit the host admits, so the socket is open to them all;
/// set `owner`, `group` and `mode` to narrow it.
pub const DEFAULT_MODE: SocketMode = SocketMode::ANYONE;

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str, listen: &str, target: Endpoint) -> ServiceSpec {
        ServiceSpec {
            name: name.into(),
            listen: listen.into(),
            target,
            owner: None,
            group: None,
            mode: None,
            dial: DialPolicy::default(),
        }
    }

    fn vsock(port: u32) -> Endpoint {
        Endpoint::Vsock { cid: 2, port }
    }

    fn err(services: &[ServiceSpec], exports: &[ExportSpec]) -> String {
        validate(services, exports).unwrap_err().to_string()
    }

    #[test]
    fn a_good_configuration_passes() {
        let s = [
            svc("dovecot-auth", "/run/dovecot/auth-client", vsock(5001)),
            svc("enroll", "/run/enroll.sock", vsock(5002)),
        ];
        let e = [ExportSpec {
            name: "admin".into(),
            listen: Endpoint::Vsock {
                cid: u32::MAX,
                port: 7000,
            },
            target: Endpoint::Tcp("127.0.0.1:8080".parse().unwrap()),
            dial: DialPolicy::default(),
        }];
        validate(&s, &e).unwrap();
    }

    #[test]
    fn errors_name_the_field() {
        let ok = svc("a", "/run/a.sock", vsock(1));
        let rel = svc("b", "run/b.sock", vsock(2));
        let m = err(&[ok.clone(), rel], &[]);
        assert!(m.starts_with("services[1].listen: "), "{m}");
        assert!(m.contains("relative"), "{m}");

        let long = format!("/run/{}", "x".repeat(120));
        let m = err(&[svc("a", &long, vsock(1))], &[]);
        assert!(
            m.starts_with("services[0].listen: ") && m.contains("107"),
            "{m}"
        );

        let m = err(&[svc("a", "/run/../etc/a", vsock(1))], &[]);
        assert!(
            m.starts_with("services[0].listen: ") && m.contains(".."),
            "{m}"
        );

        let m = err(&[svc("a", "/run/dir/", vsock(1))], &[]);
        assert!(
            m.starts_with("services[0].listen: ") && m.contains("directory"),
            "{m}"
        );

        let m = err(&[ok.clone(), svc("b", "/run//a.sock", vsock(2))], &[]);
        assert!(
            m.starts_with("services[1].listen: ") && m.contains("already"),
            "{m}"
        );

        let m = err(&[ok.clone(), svc("a", "/run/other", vsock(2))], &[]);
        assert!(
            m.starts_with("services[1].name: ") && m.contains("twice"),
            "{m}"
        );

        let m = err(&[svc("bad name", "/run/x", vsock(2))], &[]);
        assert!(m.starts_with("services[0].name: "), "{m}");
        let m = err(&[svc("", "/run/x", vsock(2))], &[]);
        assert!(m.starts_with("services[0].name: "), "{m}");
    }

    #[test]
    fn targets_must_be_dialable_and_not_loop() {
        let m = err(
            &[svc(
                "a",
                "/run/a",
                Endpoint::Vsock {
                    cid: u32::MAX,
                    port: 5,
                },
            )],
            &[],
        );
        assert!(
            m.starts_with("services[0].target: ") && m.contains("CID 2"),
            "{m}"
        );
        let m = err(&[svc("a", "/run/a", vsock(u32::MAX))], &[]);
        assert!(m.starts_with("services[0].target: "), "{m}");
        let m = err(
            &[svc(
                "a",
                "/run/a",
                Endpoint::Tcp("0.0.0.0:80".parse().unwrap()),
            )],
            &[],
        );
        assert!(m.starts_with("services[0].target: "), "{m}");
        let m = err(&[svc("a", "/run/a", Endpoint::Unix("rel".into()))], &[]);
        assert!(
            m.starts_with("services[0].target: ") && m.contains("relative"),
            "{m}"
        );
        let m = err(&[svc("a", "/run/a", Endpoint::Unix("/run/a".into()))], &[]);
        assert!(
            m.starts_with("services[0].target: ") && m.contains("loop"),
            "{m}"
        );
    }

    #[test]
    fn exports_listen_on_fixed_ports_and_forward_into_the_guest() {
        let e = |listen: Endpoint, target: Endpoint| ExportSpec {
            name: "x".into(),
            listen,
            target,
            dial: DialPolicy::default(),
        };
        let any = |port| Endpoint::Vsock {
            cid: u32::MAX,
            port,
        };
        let m = err(&[], &[e(any(7), vsock(8))]);
        assert!(m.starts_with("exports[0].target: "), "{m}");
        let m = err(&[], &[e(any(u32::MAX), Endpoint::Unix("/run/s".into()))]);
        assert!(m.starts_with("exports[0].listen: "), "{m}");
        let m = err(
            &[],
            &[e(
                Endpoint::Tcp("127.0.0.1:0".parse().unwrap()),
                Endpoint::Unix("/run/s".into()),
            )],
        );
        assert!(m.starts_with("exports[0].listen: "), "{m}");
        // Names are unique across services and exports.
        let m = err(
            &[svc("x", "/run/a", vsock(1))],
            &[e(any(7), Endpoint::Unix("/run/s".into()))],
        );
        assert!(m.starts_with("exports[0].name: "), "{m}");
        // A service's listen path is not an export's target.
        let m = err(
            &[svc("a", "/run/a", vsock(1))],
            &[e(any(7), Endpoint::Unix("/run/a".into()))],
        );
        assert!(
            m.starts_with("exports[0].target: ") && m.contains("loop"),
            "{m}"
        );
    }

    #[test]
    fn json_defaults_and_unknown_fields() {
        let s: ServiceSpec = serde_json::from_str(
            r#"{"name":"a","listen":"/run/a","target":{"vsock":{"cid":2,"port":5001}}}"#,
        )
        .unwrap();
        assert_eq!(s.dial, DialPolicy::default());
        let s: ServiceSpec = serde_json::from_str(
            r#"{"name":"a","listen":"/run/a","target":{"unix":"/t"},"dial":{"attempts":3}}"#,
        )
        .unwrap();
        assert_eq!(s.dial.attempts, 3);
        assert_eq!(s.dial.timeout_ms, 5000);
        let e = serde_json::from_str::<ServiceSpec>(
            r#"{"name":"a","listen":"/run/a","target":{"unix":"/t"},"dial":{"tries":3}}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("tries"), "{e}");
    }

    #[test]
    fn unknown_owner_names_the_field() {
        let mut s = svc("a", "/run/a", vsock(1));
        s.owner = Some(IdRef::Name("no-such-user-xyz".into()));
        let m = check_ids(&[s]).unwrap_err().to_string();
        assert!(
            m.starts_with("services[0].owner: ") && m.contains("no-such-user-xyz"),
            "{m}"
        );
    }

    #[test]
    fn a_bad_mode_names_the_field() {
        let e = serde_json::from_str::<ServiceSpec>(
            r#"{"name":"a","listen":"/run/a","target":{"unix":"/t"},"mode":"0999"}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("\"0660\""), "{e}");
        let s: ServiceSpec = serde_json::from_str(
            r#"{"name":"a","listen":"/run/a","target":{"unix":"/t"},"mode":"0640"}"#,
        )
        .unwrap();
        assert_eq!(s.mode.map(|m| m.bits()), Some(0o640));
    }

    #[test]
    fn dial_policy_ranges() {
        let mut s = svc("a", "/run/a", vsock(1));
        s.dial.attempts = 0;
        assert!(err(&[s.clone()], &[]).starts_with("services[0].dial.attempts: "));
        s.dial = DialPolicy {
            backoff_initial_ms: 100,
            backoff_max_ms: 50,
            ..DialPolicy::default()
        };
        assert!(err(&[s.clone()], &[]).starts_with("services[0].dial.backoff_max_ms: "));
        s.dial = DialPolicy {
            timeout_ms: 0,
            ..DialPolicy::default()
        };
        assert!(err(&[s], &[]).starts_with("services[0].dial.timeout_ms: "));
    }
}
