//! Binding the guest-facing listeners, before anything else happens.
//!
//! Every listener is bound first, while the process may still be root, and only then does
//! the process drop to the app's user ([`crate::privileges`]) and start its runtime. So the
//! sockets can live in a root-owned run directory and the relay can still dial its
//! upstreams as the app. Nothing here needs a runtime; [`crate::serve`] registers the
//! descriptors with tokio later.
//!
//! Socket files (a per-VM socket `<vm.vsock_uds>_<port>`, or an explicit path) are
//! published by [`vm_transport::publish`], which is where the threats are handled: the
//! directory is writable by the VMM's user (and, with `run_as`, the app's), so no call
//! that follows a symlink ever names the path, and the configured owner and mode (0600 by
//! default: only the VMM, running as the owner, can connect) are set before the socket
//! appears and listens. A stale socket left by a crashed relay is replaced; a socket a
//! *live* relay listens on is refused (a second relay started with the same configuration
//! must not steal the first one's VM); anything else at the path is refused, not deleted.
//! Every file is recorded in [`SocketFiles`], which removes it at the end only while the
//! path still names the inode this process published.
//!
//! The backlog is 4096 ([`vm_transport::listener`]): Firecracker's VMM connects to a
//! per-VM socket with a *blocking* `connect()`, and a full backlog would stall the VM's
//! whole vsock device.

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use vm_transport::publish::{self, Access, SocketFile};
use vm_transport::Endpoint;

use crate::config::{Config, ListenSpec};

/// Why a listener could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// A Unix socket could not be published.
    #[error("service {name}: cannot listen: {source}")]
    Publish {
        /// Service name.
        name: String,
        /// The cause, naming the path and the fix.
        #[source]
        source: publish::PublishError,
    },
    /// A vsock listener could not be bound.
    #[error("service {name}: cannot listen at {endpoint}: {source} (is the vhost_vsock kernel module loaded? vsock ports are host-wide: each app needs its own port in cid mode)")]
    Vsock {
        /// Service name.
        name: String,
        /// Where.
        endpoint: Endpoint,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A transport the relay does not listen on.
    #[error(
        "service {name}: cannot listen at {endpoint}: the relay listens on Unix and vsock only"
    )]
    Unsupported {
        /// Service name.
        name: String,
        /// Where.
        endpoint: Endpoint,
    },
}

impl ListenError {
    /// The service the error is about.
    pub fn service(&self) -> &str {
        match self {
            ListenError::Publish { name, .. }
            | ListenError::Vsock { name, .. }
            | ListenError::Unsupported { name, .. } => name,
        }
    }
}

/// Socket files this process published; each is removed on drop if still ours.
#[derive(Debug, Default)]
pub struct SocketFiles(Vec<SocketFile>);

impl SocketFiles {
    /// The files' paths, in creation order.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.0.iter().map(|f| f.path().to_path_buf()).collect()
    }

    /// Removes every file that is still ours. Call it while the listeners still listen.
    pub fn remove_all(&mut self) {
        for f in &mut self.0 {
            if let Err(e) = f.remove() {
                tracing::warn!(path = %f.path().display(), error = %e, "cannot remove socket file");
            }
        }
    }
}

/// One bound, listening socket not yet registered with a runtime.
#[derive(Debug)]
pub struct BoundListener {
    /// What it serves.
    pub spec: ListenSpec,
    /// Index into `config.services`, or `None` for an undeclared service.
    pub service: Option<usize>,
    /// The listening descriptor.
    pub fd: OwnedFd,
}

/// Every listener of a configuration, bound.
#[derive(Debug)]
pub struct Bound {
    /// The listeners, declared services first.
    pub listeners: Vec<BoundListener>,
    /// Files to remove at the end.
    pub files: SocketFiles,
}

/// Binds every listener the configuration names. On an error, the files already
/// published are removed again.
pub fn bind_all(config: &Config) -> Result<Bound, ListenError> {
    let access = Access {
        mode: config.socket.mode,
        uid: config.socket.uid,
        gid: config.socket.gid,
    };
    let mut files = SocketFiles::default();
    let mut listeners = Vec::new();
    let declared = config.services.len();
    for (i, spec) in config.listeners().into_iter().enumerate() {
        let fd = match &spec.endpoint {
            Endpoint::Unix(path) => {
                let p = publish::publish(path, access, false).map_err(|source| {
                    ListenError::Publish {
                        name: spec.name.clone(),
                        source,
                    }
                })?;
                files.0.push(p.file);
                p.fd
            }
            Endpoint::Vsock { .. } => {
                bind_vsock(&spec.endpoint).map_err(|source| ListenError::Vsock {
                    name: spec.name.clone(),
                    endpoint: spec.endpoint.clone(),
                    source,
                })?
            }
            Endpoint::Tcp(_) => {
                return Err(ListenError::Unsupported {
                    name: spec.name.clone(),
                    endpoint: spec.endpoint.clone(),
                })
            }
        };
        listeners.push(BoundListener {
            spec,
            service: (i < declared).then_some(i),
            fd,
        });
    }
    Ok(Bound { listeners, files })
}

fn bind_vsock(endpoint: &Endpoint) -> std::io::Result<OwnedFd> {
    let fd = endpoint.bind()?;
    vm_transport::listener::listen_on(&fd)?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    use std::path::Path;

    fn config(dir: &Path, mode: &str) -> Config {
        Config::parse(
            &serde_json::json!({
                "app": "a",
                "vm": {"id": "v"},
                "transport": {"per_vm_socket": {"vsock_uds": dir.join("vm.vsock")}},
                "socket": {"mode": mode},
                "services": [{"name": "s", "port": 5001, "upstream": {"unix": "/nonexistent"}}],
                "undeclared": [{"name": "agent", "port": 5003}]
            })
            .to_string(),
        )
        .unwrap()
    }

    #[test]
    fn binds_every_listener_with_its_mode_and_removes_them_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let bound = bind_all(&config(dir.path(), "0660")).unwrap();
        let paths: Vec<PathBuf> = bound.files.paths();
        assert_eq!(
            paths,
            vec![
                dir.path().join("vm.vsock_5001"),
                dir.path().join("vm.vsock_5003")
            ]
        );
        assert_eq!(bound.listeners[0].service, Some(0));
        assert_eq!(bound.listeners[1].service, None);
        for p in &paths {
            let m = std::fs::metadata(p).unwrap();
            assert!(m.file_type().is_socket());
            assert_eq!(m.permissions().mode() & 0o777, 0o660);
            // Listening already: a connect succeeds before any runtime exists.
            std::os::unix::net::UnixStream::connect(p).unwrap();
        }
        drop(bound);
        assert!(paths.iter().all(|p| !p.exists()));
    }

    #[test]
    fn replaces_a_stale_socket_but_not_other_files() {
        let dir = tempfile::tempdir().unwrap();
        drop(std::os::unix::net::UnixListener::bind(dir.path().join("vm.vsock_5001")).unwrap());
        let bound = bind_all(&config(dir.path(), "0600")).unwrap();
        drop(bound);
        std::fs::write(dir.path().join("vm.vsock_5003"), b"not a socket").unwrap();
        let err = bind_all(&config(dir.path(), "0600")).unwrap_err();
        assert_eq!(err.service(), "agent");
        assert!(err.to_string().contains("not a socket"), "{err}");
        // The first listener, created before the failure, was removed again.
        assert!(!dir.path().join("vm.vsock_5001").exists());
        assert!(dir.path().join("vm.vsock_5003").exists());
    }

    /// Non-blocking connects, as Python with a timeout, Go, Node and asyncio make them,
    /// against a relay socket nobody accepts on yet: the kernel must queue far more than
    /// 128 (nix's `Backlog` once capped the backlog there silently).
    #[test]
    fn the_kernel_queues_thousands_on_a_per_vm_socket() {
        use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
        use std::os::fd::AsRawFd;
        vm_transport::fdlimit::raise_fd_limit().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let bound = bind_all(&config(dir.path(), "0600")).unwrap();
        let path = dir.path().join("vm.vsock_5001");
        // What the kernel reports for the listeners: `ss` shows the backlog as Send-Q, and
        // the socket inode, which is what identifies ours (the bound name is the
        // publisher's private directory, see vm_transport::publish).
        use std::os::unix::fs::MetadataExt;
        let ss = std::process::Command::new("ss")
            .args(["-xlnH"])
            .output()
            .unwrap();
        let ss = String::from_utf8_lossy(&ss.stdout);
        for l in &bound.listeners {
            let fd = l.fd.as_raw_fd();
            let ino = std::fs::metadata(format!("/proc/self/fd/{fd}"))
                .unwrap()
                .ino()
                .to_string();
            let line = ss
                .lines()
                .find(|l| l.split_whitespace().nth(5) == Some(ino.as_str()))
                .unwrap_or_else(|| panic!("ss does not list socket inode {ino}:\n{ss}"));
            let send_q: u32 = line.split_whitespace().nth(3).unwrap().parse().unwrap();
            assert!(send_q > 1000, "ss reports a backlog of {send_q}: {line}");
        }
        let addr = UnixAddr::new(&path).unwrap();
        let mut held = Vec::new();
        for n in 0..2000 {
            let fd = socket(
                AddressFamily::Unix,
                SockType::Stream,
                SockFlag::SOCK_NONBLOCK,
                None,
            )
            .unwrap();
            if let Err(e) = connect(fd.as_raw_fd(), &addr) {
                panic!(
                    "non-blocking connect {} refused ({e}): the backlog is too small",
                    n + 1
                );
            }
            held.push(fd);
        }
        drop(bound);
    }

    #[test]
    fn a_second_relay_refuses_a_live_socket_and_leaves_it_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let first = bind_all(&config(dir.path(), "0600")).unwrap();
        let err = bind_all(&config(dir.path(), "0600")).unwrap_err();
        assert_eq!(err.service(), "s");
        assert!(
            err.to_string().contains("another process is listening"),
            "{err}"
        );
        // The failed second relay removed nothing: the first is still reachable.
        for p in first.files.paths() {
            std::os::unix::net::UnixStream::connect(&p)
                .unwrap_or_else(|e| panic!("{} lost: {e}", p.display()));
        }
        drop(first);
    }

    #[test]
    fn at_exit_only_the_relays_own_inode_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let bound = bind_all(&config(dir.path(), "0600")).unwrap();
        // The file is replaced (say, by an operator's new relay after ours went stale).
        let p = dir.path().join("vm.vsock_5001");
        std::fs::remove_file(&p).unwrap();
        let theirs = std::os::unix::net::UnixListener::bind(&p).unwrap();
        drop(bound);
        assert!(p.exists(), "a file this relay did not create was removed");
        std::os::unix::net::UnixStream::connect(&p).unwrap();
        drop(theirs);
    }
}
