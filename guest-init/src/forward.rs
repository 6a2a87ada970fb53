//! Forwarding: the app's unchanged Unix socket paths carried to the host, and host
//! connections carried to guest services.
//!
//! # Guest to host ([`ServiceSpec`])
//! The app was written to connect to, say, `/run/dovecot/auth-client`. Inside the VM there
//! is no Dovecot: the service lives on the host. For each declared service PID 1 listens at
//! that exact path and forwards every connection to the service's `target`, which in a VM
//! is `vsock` CID 2 and the port the platform assigned (a Unix path in tests and native
//! use). The app needs no change and cannot tell the difference, because the pump
//! ([`crate::pump`]) writes every chunk it reads whole and unchanged.
//!
//! Setting up a listener, in order:
//! 1. Missing parent directories are created with mode 0755.
//! 2. Whatever is at the path is inspected. Nothing: fine. A socket nobody listens on (left
//!    over from an earlier run): removed. A socket something *is* listening on: refused,
//!    because taking over a live service's path would silently steal its callers. A regular
//!    file, directory or symlink: refused with an error naming it; forwarding never deletes
//!    data.
//! 3. The socket is bound, then its owner, group and mode are set, and only then does it
//!    `listen(2)` (with the large backlog of [`crate::endpoint::DEFAULT_BACKLOG`]). Before
//!    `listen` every connect is refused, so no caller can slip in through a moment of
//!    default permissions.
//!
//! # Host to guest ([`ExportSpec`])
//! The mirror image: listen on a vsock port (a Unix path or TCP address in tests) and
//! forward each connection to a guest service's Unix path or TCP address, so the host can
//! reach, for example, an app's admin socket. The same accept loop and dialler serve both.
//!
//! # Robustness (each point is a failure a peer's users reported; see
//! `/work/shared/notes/peers.md`)
//! - **The accept loop never ends.** Descriptor or memory exhaustion (`EMFILE`, `ENFILE`,
//!   `ENOBUFS`, `ENOMEM`) is logged at most once a second and backed off briefly (the
//!   pending connection stays queued and would otherwise make the loop spin); per-connection
//!   errors such as `ECONNABORTED` are skipped. Apple's vminitd once let one failed accept
//!   end its loop, and every later caller hung. The loop also reserves the descriptor a
//!   connection's dial will need *before* accepting it, so that when descriptors run out,
//!   callers wait in the backlog instead of being accepted and starving each other's dials.
//! - **One task per connection, no limit.** A stalled or failing connection holds only its
//!   own task; worker pools starved in Nitro's vsock-proxy and gvisor-tap-vsock. The only
//!   limits are the kernel's (descriptors, and the VMM's 1023 vsock connections per VM).
//! - **Bounded dial retry.** When the host side is not up yet the dial is retried with an
//!   exponential backoff with jitter ([`DialPolicy`]), bounded in attempts and in total
//!   time, then the caller's connection is closed with one log line naming the service,
//!   the target and the last error. Kata users lived for years with hybrid-vsock dial
//!   stalls that said neither.
//! - **Logs stay small under bursts.** Per-connection events are `debug`; the repeated
//!   failure lines (accept errors, dial failures) are rate limited to one a second per
//!   listener, each stating how many were suppressed, so a burst against a dead host cannot
//!   flood a slow serial console.
//!
//! # Threat model
//! The socket's owner, group and mode narrow which guest processes may call a host
//! service; the VM boundary, not these bits, is what the host relay admits by. What this
//! module defends against is local: a socket left reachable with default permissions
//! while it is being set up (closed by setting them before `listen`), a stale or hostile
//! file at the path being deleted or followed (only sockets are removed; ownership is set
//! with `lchown`, which never follows a symlink), a live service's path being hijacked
//! (refused), and a socket someone else created later at the same path being unlinked on
//! shutdown (only the inode this module bound is removed). Tests in
//! `guest-init/tests/forward*.rs` break each of these if it regresses.

use std::collections::HashSet;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
use serde::{Deserialize, Serialize};
use tokio::task::AbortHandle;

use crate::endpoint::{Conn, Endpoint, Listener};
use crate::ids::IdRef;
use crate::pump;
use crate::{debug, error, info, warn};

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
    pub mode: Option<String>,
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

/// The bounded retry used when a target refuses or is missing.
///
/// Attempt `k` (from 1) that fails with a transient error is followed by a wait drawn
/// uniformly from `[b/2, b]`, where `b = min(backoff_initial_ms * 2^(k-1), backoff_max_ms)`;
/// the whole dial, waits included, is cut off after `timeout_ms`. With the defaults the
/// waits are at most 25, 50, 100, 200, 400, 800, 1000 ms: a target that appears within
/// about 2.5 s is reached, and a dead one is given up on within 5 s.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DialPolicy {
    /// Attempts in total, the first included (1 to 1000; default 8).
    pub attempts: u32,
    /// The first wait between attempts, in milliseconds (1 to 60000; default 25).
    pub backoff_initial_ms: u64,
    /// The longest wait between attempts, in milliseconds (at least `backoff_initial_ms`,
    /// at most 60000; default 1000).
    pub backoff_max_ms: u64,
    /// The bound on the whole dial, waits included, in milliseconds (1 to 600000;
    /// default 5000). A vsock connect to a host port nobody serves takes about 2 s to fail
    /// under hybrid vsock, so this, not `attempts`, is usually what ends a dial to a dead
    /// host.
    pub timeout_ms: u64,
}

impl Default for DialPolicy {
    fn default() -> Self {
        DialPolicy {
            attempts: 8,
            backoff_initial_ms: 25,
            backoff_max_ms: 1000,
            timeout_ms: 5000,
        }
    }
}

impl DialPolicy {
    fn check(&self, field: &str) -> Result<(), ForwardError> {
        let bad = |sub: &str, reason: String| {
            Err(ForwardError::Invalid {
                field: format!("{field}.{sub}"),
                reason,
            })
        };
        if !(1..=1000).contains(&self.attempts) {
            return bad(
                "attempts",
                format!("{} is out of range; use 1 to 1000", self.attempts),
            );
        }
        if !(1..=60_000).contains(&self.backoff_initial_ms) {
            return bad(
                "backoff_initial_ms",
                format!(
                    "{} is out of range; use 1 to 60000",
                    self.backoff_initial_ms
                ),
            );
        }
        if self.backoff_max_ms < self.backoff_initial_ms || self.backoff_max_ms > 60_000 {
            return bad(
                "backoff_max_ms",
                format!(
                    "{} is out of range; use backoff_initial_ms ({}) to 60000",
                    self.backoff_max_ms, self.backoff_initial_ms
                ),
            );
        }
        if !(1..=600_000).contains(&self.timeout_ms) {
            return bad(
                "timeout_ms",
                format!("{} is out of range; use 1 to 600000", self.timeout_ms),
            );
        }
        Ok(())
    }
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

fn invalid(field: String, reason: impl Into<String>) -> ForwardError {
    ForwardError::Invalid {
        field,
        reason: reason.into(),
    }
}

/// The longest name accepted; names appear in every log line about their listener.
const MAX_NAME: usize = 64;

/// The mode a service socket gets when none is configured. Inside a VM every process is
/// the app's, and the VM is the unit the host admits, so the socket is open to them all;
/// set `owner`, `group` and `mode` to narrow it.
pub const DEFAULT_MODE: u32 = 0o666;

/// Parses a mode written as an octal string: three digits, or four with a leading `0`
/// (`"660"`, `"0660"`). Special bits (setuid, setgid, sticky) mean nothing on a socket
/// and are refused.
pub fn parse_mode(s: &str) -> Result<u32, String> {
    let digits = match s.len() {
        3 => s,
        4 if s.starts_with('0') => &s[1..],
        _ => "",
    };
    if digits.is_empty() || !digits.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        return Err(format!(
            "{s:?} is not an octal permission mode; write three octal digits with an optional leading 0, like \"0660\""
        ));
    }
    u32::from_str_radix(digits, 8).map_err(|e| format!("{s:?}: {e}"))
}

fn check_name(field: String, name: &str, seen: &mut HashSet<String>) -> Result<(), ForwardError> {
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
fn check_listen_path(field: &str, p: &Path) -> Result<(), ForwardError> {
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
fn check_target(field: &str, t: &Endpoint) -> Result<(), ForwardError> {
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
pub fn validate(services: &[ServiceSpec], exports: &[ExportSpec]) -> Result<(), ForwardError> {
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
        if let Some(m) = &s.mode {
            parse_mode(m).map_err(|r| invalid(f("mode"), r))?;
        }
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
pub fn check_ids(services: &[ServiceSpec]) -> Result<(), ForwardError> {
    for (i, s) in services.iter().enumerate() {
        resolve_ids(i, s)?;
    }
    Ok(())
}

fn resolve_ids(
    i: usize,
    s: &ServiceSpec,
) -> Result<(Option<nix::unistd::Uid>, Option<nix::unistd::Gid>), ForwardError> {
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

/// Raises this process's soft limit on open descriptors to its hard limit and returns the
/// new soft limit. Every forwarded connection holds two descriptors; the usual soft limit
/// of 1024 would cap a burst at about 500 connections, an artificial limit PID 1 should
/// lift once at start. (Not done by [`start`] itself: the limit is process-wide and the app
/// inherits it, so the caller decides.)
pub fn raise_fd_limit() -> io::Result<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok(hard.max(soft))
}

/// A socket file this module created, identified by its inode so that a file someone
/// else put at the same path later is never removed.
#[derive(Debug)]
struct CreatedSocket {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl CreatedSocket {
    fn remove(&self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if m.dev() == self.dev && m.ino() == self.ino => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    warn!("cannot remove socket {}: {e}", self.path.display());
                }
            }
            Ok(_) => debug!(
                "{} was replaced by another file; leaving it in place",
                self.path.display()
            ),
            Err(_) => {}
        }
    }
}

/// Running forwarders. Dropping it stops accepting and removes the Unix sockets it created.
///
/// Connections already being relayed are not cut: they belong to the app and end when it
/// (or the host) closes them, or with the runtime at power-off.
#[derive(Debug, Default)]
pub struct Forwarders {
    tasks: Vec<AbortHandle>,
    sockets: Vec<CreatedSocket>,
}

impl Forwarders {
    /// Stops every accept loop and removes the socket files this instance created (only
    /// if the file at the path is still the one it bound). Idempotent.
    pub fn close(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        for s in self.sockets.drain(..) {
            s.remove();
        }
    }

    /// Number of accept loops running.
    pub fn listeners(&self) -> usize {
        self.tasks.len()
    }

    /// The Unix socket paths this instance created and will remove.
    pub fn socket_paths(&self) -> impl Iterator<Item = &Path> {
        self.sockets.iter().map(|s| s.path.as_path())
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

/// Binds every listener (all are accepting when this returns) and spawns the accept loops
/// on the current tokio runtime.
///
/// Validation ([`validate`]) runs first; then users and groups are resolved; then each
/// listener is set up as the module documentation describes. If any step fails, the
/// sockets already created are removed again and nothing is left running.
pub async fn start(
    services: &[ServiceSpec],
    exports: &[ExportSpec],
) -> Result<Forwarders, ForwardError> {
    validate(services, exports)?;
    let mut fwd = Forwarders::default();
    let mut ready: Vec<(Listener, Route)> = Vec::new();
    for (i, s) in services.iter().enumerate() {
        let (uid, gid) = resolve_ids(i, s)?;
        let mode = match &s.mode {
            Some(m) => parse_mode(m).map_err(|r| invalid(format!("services[{i}].mode"), r))?,
            None => DEFAULT_MODE,
        };
        let listen_err = |source| ForwardError::Listen {
            name: s.name.clone(),
            endpoint: format!("unix:{}", s.listen.display()),
            source,
        };
        let (listener, created) = listen_unix(&s.listen, mode, uid, gid).map_err(listen_err)?;
        fwd.sockets.push(created);
        ready.push((listener, Route::new(format!("service {}", s.name), s)));
    }
    for e in exports {
        let listen_err = |source| ForwardError::Listen {
            name: e.name.clone(),
            endpoint: e.listen.to_string(),
            source,
        };
        let listener = match &e.listen {
            Endpoint::Unix(p) => {
                let (l, created) = listen_unix(p, DEFAULT_MODE, None, None).map_err(listen_err)?;
                fwd.sockets.push(created);
                l
            }
            other => other.listen().map_err(listen_err)?,
        };
        ready.push((
            listener,
            Route {
                label: format!("export {}", e.name),
                target: e.target.clone(),
                dial: e.dial.clone(),
                dial_log: RateLimit::default(),
                accept_log: RateLimit::default(),
            },
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

impl Route {
    fn new(label: String, s: &ServiceSpec) -> Self {
        Route {
            label,
            target: s.target.clone(),
            dial: s.dial.clone(),
            dial_log: RateLimit::default(),
            accept_log: RateLimit::default(),
        }
    }
}

/// Prepares the path and binds a listening Unix socket there with the given permissions.
fn listen_unix(
    path: &Path,
    mode: u32,
    uid: Option<nix::unistd::Uid>,
    gid: Option<nix::unistd::Gid>,
) -> io::Result<(Listener, CreatedSocket)> {
    if let Some(parent) = path.parent() {
        create_parents(parent)?;
    }
    remove_stale(path)?;
    let fd = Endpoint::Unix(path.to_path_buf()).bind()?;
    let meta = std::fs::symlink_metadata(path)?;
    let created = CreatedSocket {
        path: path.to_path_buf(),
        dev: meta.dev(),
        ino: meta.ino(),
    };
    // From here on a failure removes the file we bound (`created` is dropped unused, so
    // remove it explicitly).
    let finish = move || -> io::Result<Listener> {
        if uid.is_some() || gid.is_some() {
            std::os::unix::fs::lchown(path, uid.map(|u| u.as_raw()), gid.map(|g| g.as_raw()))
                .map_err(|e| io::Error::new(e.kind(), format!("cannot set owner/group: {e}")))?;
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| io::Error::new(e.kind(), format!("cannot set mode {mode:o}: {e}")))?;
        crate::endpoint::listen_on(&fd)?;
        Listener::from_listening_fd(fd, Endpoint::Unix(path.to_path_buf()))
    };
    match finish() {
        Ok(l) => Ok((l, created)),
        Err(e) => {
            created.remove();
            Err(e)
        }
    }
}

/// Creates `dir` and its missing ancestors with mode 0755 exactly (whatever the umask), so
/// the app, which does not run as root, can reach the socket. Existing directories are left
/// as they are.
fn create_parents(dir: &Path) -> io::Result<()> {
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|d| std::fs::symlink_metadata(d).is_err())
        .collect();
    for d in missing.into_iter().rev() {
        let made = std::fs::DirBuilder::new().mode(0o755).create(d);
        match made {
            Ok(()) => std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)),
            // Someone else made it meanwhile: theirs to keep as it is.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(e),
        }
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot create parent directory {}: {e}", d.display()),
            )
        })?;
    }
    Ok(())
}

/// Removes a socket nobody listens on; refuses anything else that is in the way.
fn remove_stale(path: &Path) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let ft = meta.file_type();
    let refuse = |what: &str| {
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "{} is {what}, not a socket; refusing to delete it (remove it yourself or choose another listen path)",
                path.display()
            ),
        ))
    };
    if ft.is_file() {
        return refuse("a regular file");
    }
    if ft.is_dir() {
        return refuse("a directory");
    }
    if ft.is_symlink() {
        return refuse("a symbolic link");
    }
    if !ft.is_socket() {
        return refuse("a special file");
    }
    if socket_is_live(path) {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "another process is listening at {}; stop it or choose another listen path",
                path.display()
            ),
        ));
    }
    std::fs::remove_file(path)?;
    debug!("removed stale socket {}", path.display());
    Ok(())
}

/// Whether something accepts connections at a socket path. A non-blocking connect never
/// waits: a full backlog (`EAGAIN`) also means somebody is listening.
fn socket_is_live(path: &Path) -> bool {
    let Ok(fd) = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    ) else {
        return false;
    };
    let Ok(addr) = UnixAddr::new(path) else {
        return false;
    };
    matches!(
        socket::connect(fd.as_raw_fd(), &addr),
        Ok(()) | Err(Errno::EAGAIN) | Err(Errno::EINPROGRESS)
    )
}

/// How an accept error is handled.
#[derive(Debug, PartialEq, Eq)]
enum AcceptFailure {
    /// The connection died or was refused before we took it; take the next one.
    Skip,
    /// Out of descriptors or memory: the connection stays queued, so wait a little.
    Exhausted,
    /// Anything else: log and wait a little rather than spin.
    Other,
}

fn classify_accept(e: &io::Error) -> AcceptFailure {
    match e.raw_os_error() {
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
            AcceptFailure::Exhausted
        }
        // accept(2): "Linux accept() passes already-pending network errors on the new
        // socket as an error code from accept()"; treat them like EAGAIN.
        Some(
            libc::ECONNABORTED
            | libc::EINTR
            | libc::EAGAIN
            | libc::EPROTO
            | libc::EPERM
            | libc::ENETDOWN
            | libc::ENOPROTOOPT
            | libc::EHOSTDOWN
            | libc::ENONET
            | libc::EHOSTUNREACH
            | libc::EOPNOTSUPP
            | libc::ENETUNREACH
            | libc::ECONNRESET,
        ) => AcceptFailure::Skip,
        _ => AcceptFailure::Other,
    }
}

const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// Accepts forever; each connection becomes its own task.
///
/// Before each accept the loop reserves the descriptor the connection's dial will need
/// (an unconnected socket, closed just before dialling). Without it, a process out of
/// descriptors accepts callers it cannot dial for: each accepted caller holds the last free
/// descriptor while its dial fails, and they starve one another until every dial gives up.
/// With it, callers the process cannot serve yet wait in the backlog.
async fn accept_loop(listener: Listener, route: Arc<Route>) {
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let next = match reserve_descriptor() {
            Ok(reserve) => listener
                .accept()
                .await
                .map(|(conn, peer)| (conn, peer, reserve)),
            Err(e) => Err(e),
        };
        match next {
            Ok((conn, peer, reserve)) => {
                backoff = ACCEPT_BACKOFF_MIN;
                debug!("{}: accepted a connection from {peer}", route.label);
                tokio::spawn(serve(conn, reserve, Arc::clone(&route)));
            }
            Err(e) => match classify_accept(&e) {
                AcceptFailure::Skip => {
                    debug!("{}: accept: {e}; skipped", route.label);
                    tokio::task::yield_now().await;
                }
                failure => {
                    if let Some(suppressed) = route.accept_log.allow() {
                        let what = if failure == AcceptFailure::Exhausted {
                            "out of resources"
                        } else {
                            "unexpected error"
                        };
                        warn!(
                            "{}: accept failed ({what}): {e}; retrying in {} ms{}",
                            route.label,
                            backoff.as_millis(),
                            suppressed_note(suppressed)
                        );
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                }
            },
        }
    }
}

/// Holds one descriptor slot for a connection's dial (see [`accept_loop`]).
fn reserve_descriptor() -> io::Result<OwnedFd> {
    Ok(socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

/// Serves one accepted connection: dial, then relay until both directions end.
async fn serve(caller: Conn, reserve: OwnedFd, route: Arc<Route>) {
    // Free the reserved slot for the dial's socket.
    drop(reserve);
    match dial(&route.target, &route.dial).await {
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

fn suppressed_note(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" ({n} similar lines suppressed)")
    }
}

/// Why a dial gave up.
#[derive(Debug)]
struct DialFailure {
    attempts: u32,
    elapsed: Duration,
    error: io::Error,
}

/// Whether a dial error may go away by itself (the target is starting, or the system is
/// briefly short of resources), as opposed to a configuration or permission problem.
fn retryable(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::ECONNREFUSED
                | libc::ENOENT
                | libc::ETIMEDOUT
                | libc::ECONNRESET
                | libc::ECONNABORTED
                | libc::EAGAIN
                | libc::EINTR
                | libc::EADDRNOTAVAIL
                | libc::ENETUNREACH
                | libc::EHOSTUNREACH
                | libc::ENODEV
                | libc::ENETDOWN
                | libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
        )
    ) || e.kind() == io::ErrorKind::TimedOut
}

/// Dials `target` under `policy`: see [`DialPolicy`].
async fn dial(target: &Endpoint, policy: &DialPolicy) -> Result<Conn, DialFailure> {
    let start = Instant::now();
    let deadline = start + Duration::from_millis(policy.timeout_ms);
    let mut backoff = Duration::from_millis(policy.backoff_initial_ms);
    let max = Duration::from_millis(policy.backoff_max_ms);
    let attempts = policy.attempts.max(1);
    let mut attempt = 0;
    loop {
        attempt += 1;
        let remaining = deadline.saturating_duration_since(Instant::now());
        let error = match tokio::time::timeout(remaining, target.connect()).await {
            Ok(Ok(conn)) => {
                if attempt > 1 {
                    debug!("reached {target} at attempt {attempt}");
                }
                return Ok(conn);
            }
            Ok(Err(e)) => e,
            Err(_elapsed) => io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no answer within the dial timeout of {} ms",
                    policy.timeout_ms
                ),
            ),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if !retryable(&error) || attempt >= attempts || left.is_zero() {
            return Err(DialFailure {
                attempts: attempt,
                elapsed: start.elapsed(),
                error,
            });
        }
        tokio::time::sleep(jitter(backoff).min(left)).await;
        backoff = (backoff * 2).min(max);
    }
}

/// A wait drawn uniformly from `[b/2, b]`, so that many connections refused at once do
/// not retry in lock step.
fn jitter(b: Duration) -> Duration {
    let half = b / 2;
    let span = (b - half).as_micros() as u64;
    let r = std::hash::RandomState::new().build_hasher().finish();
    half + Duration::from_micros(if span == 0 { 0 } else { r % (span + 1) })
}

/// Lets one line through per interval and counts the ones held back.
#[derive(Debug, Default)]
struct RateLimit {
    state: Mutex<(Option<Instant>, u64)>,
}

const LOG_INTERVAL: Duration = Duration::from_secs(1);

impl RateLimit {
    /// `Some(n)`: log now, `n` lines were suppressed since the last one. `None`: suppress.
    fn allow(&self) -> Option<u64> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        match st.0 {
            Some(last) if now.duration_since(last) < LOG_INTERVAL => {
                st.1 += 1;
                None
            }
            _ => {
                let n = st.1;
                *st = (Some(now), 0);
                Some(n)
            }
        }
    }
}

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
    fn modes_are_octal_permission_bits() {
        assert_eq!(parse_mode("0660").unwrap(), 0o660);
        assert_eq!(parse_mode("600").unwrap(), 0o600);
        for bad in [
            "rw-rw----",
            "0x1b6",
            "660 ",
            "4755",
            "0668",
            "66",
            "",
            "00660",
        ] {
            let e = parse_mode(bad).unwrap_err();
            assert!(e.contains("\"0660\""), "{bad}: {e}");
        }
        let mut s = svc("a", "/run/a", vsock(1));
        s.mode = Some("0999".into());
        let m = err(&[s], &[]);
        assert!(m.starts_with("services[0].mode: "), "{m}");
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
    fn accept_errors_are_classified() {
        let e = |n| io::Error::from_raw_os_error(n);
        assert_eq!(classify_accept(&e(libc::EMFILE)), AcceptFailure::Exhausted);
        assert_eq!(classify_accept(&e(libc::ENFILE)), AcceptFailure::Exhausted);
        assert_eq!(classify_accept(&e(libc::ENOBUFS)), AcceptFailure::Exhausted);
        assert_eq!(classify_accept(&e(libc::ECONNABORTED)), AcceptFailure::Skip);
        assert_eq!(classify_accept(&e(libc::EBADF)), AcceptFailure::Other);
    }

    #[test]
    fn only_transient_dial_errors_are_retried() {
        let e = |n| io::Error::from_raw_os_error(n);
        for n in [
            libc::ECONNREFUSED,
            libc::ENOENT,
            libc::ETIMEDOUT,
            libc::ECONNRESET,
        ] {
            assert!(retryable(&e(n)), "{n}");
        }
        for n in [
            libc::EACCES,
            libc::EINVAL,
            libc::EAFNOSUPPORT,
            libc::ENOTDIR,
        ] {
            assert!(!retryable(&e(n)), "{n}");
        }
    }

    #[test]
    fn jitter_stays_in_range() {
        for ms in [1u64, 2, 25, 1000] {
            let b = Duration::from_millis(ms);
            for _ in 0..100 {
                let j = jitter(b);
                assert!(j >= b / 2 && j <= b, "{j:?} for {b:?}");
            }
        }
    }

    #[test]
    fn rate_limit_lets_one_line_through_and_counts_the_rest() {
        let r = RateLimit::default();
        assert_eq!(r.allow(), Some(0));
        assert_eq!(r.allow(), None);
        assert_eq!(r.allow(), None);
        r.state.lock().unwrap().0 = Some(Instant::now() - LOG_INTERVAL);
        assert_eq!(r.allow(), Some(2));
    }

    #[tokio::test]
    async fn dial_gives_up_after_the_configured_attempts() {
        let dir = tempfile::tempdir().unwrap();
        let policy = DialPolicy {
            attempts: 3,
            backoff_initial_ms: 1,
            backoff_max_ms: 2,
            timeout_ms: 60_000,
        };
        let f = dial(&Endpoint::Unix(dir.path().join("none")), &policy)
            .await
            .unwrap_err();
        assert_eq!(f.attempts, 3);
        assert_eq!(f.error.raw_os_error(), Some(libc::ENOENT));
        // A permanent error (a path through a regular file) is not retried.
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let f = dial(&Endpoint::Unix(file.join("sock")), &policy)
            .await
            .unwrap_err();
        assert_eq!(f.error.raw_os_error(), Some(libc::ENOTDIR));
        assert_eq!(f.attempts, 1, "{}", f.error);
    }
}
