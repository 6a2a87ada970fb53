//! Binding the guest-facing listeners, before anything else happens.
//!
//! Every listener is bound first, while the process may still be root, and only then does
//! the process drop to the app's user ([`crate::privileges`]) and start its runtime. So the
//! sockets can live in a root-owned run directory and the relay can still dial its
//! upstreams as the app. Binding is plain `socket`/`bind`/`listen` on raw descriptors
//! (no runtime needed yet); [`crate::serve`] registers them with tokio later.
//!
//! Socket files: a per-VM socket `<vm.vsock_uds>_<port>` or an explicit path. A stale
//! *socket* left by a crashed relay is replaced; any other kind of file at the path is an
//! error (it is not ours to remove). Each file gets the configured mode (0600 by default:
//! only the VMM, running as the owner, can connect) and optional owner and group. Every
//! file created is recorded in [`SocketFiles`], which unlinks them when dropped, so a
//! relay that stops (or fails half-way through binding) leaves no socket behind.
//!
//! The backlog is [`guest_init::endpoint::DEFAULT_BACKLOG`] (4096, the kernel's cap here):
//! Firecracker's VMM connects to a per-VM socket with a *blocking* `connect()`, and a full
//! backlog would stall the VM's whole vsock device.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use guest_init::endpoint::{listen_on, Endpoint};

use crate::config::{Config, ListenSpec};

/// A listener could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("service {name}: cannot listen at {endpoint}: {reason}")]
pub struct ListenError {
    /// Service name.
    pub name: String,
    /// Where.
    pub endpoint: String,
    /// What went wrong and what to do.
    pub reason: String,
}

/// Socket files this process created; unlinked on drop.
#[derive(Debug, Default)]
pub struct SocketFiles(Vec<PathBuf>);

impl SocketFiles {
    /// The files, in creation order.
    pub fn paths(&self) -> &[PathBuf] {
        &self.0
    }
}

impl Drop for SocketFiles {
    fn drop(&mut self) {
        for p in &self.0 {
            if let Err(e) = std::fs::remove_file(p) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(path = %p.display(), error = %e, "cannot remove socket file");
                }
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

/// Binds every listener the configuration names.
pub fn bind_all(config: &Config) -> Result<Bound, ListenError> {
    let mode = config.socket_mode().map_err(|e| ListenError {
        name: "socket".into(),
        endpoint: "-".into(),
        reason: e.to_string(),
    })?;
    let mut files = SocketFiles::default();
    let mut listeners = Vec::new();
    let declared = config.services.len();
    for (i, spec) in config.listeners().into_iter().enumerate() {
        let err = |reason: String| ListenError {
            name: spec.name.clone(),
            endpoint: spec.endpoint.to_string(),
            reason,
        };
        let fd = match &spec.endpoint {
            Endpoint::Unix(path) => {
                let fd = bind_unix(path).map_err(err)?;
                files.0.push(path.clone());
                set_file_access(path, mode, config.socket.uid, config.socket.gid)
                    .map_err(|e| err(format!("cannot set mode/owner: {e}")))?;
                fd
            }
            Endpoint::Vsock { cid, port } => bind_vsock(*cid, *port).map_err(err)?,
            Endpoint::Tcp(_) => return Err(err("TCP listeners are not supported".into())),
        };
        listeners.push(BoundListener {
            spec,
            service: (i < declared).then_some(i),
            fd,
        });
    }
    Ok(Bound { listeners, files })
}

fn bind_unix(path: &Path) -> Result<OwnedFd, String> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .map_err(|e| format!("cannot remove the stale socket: {e}"))?,
        Ok(_) => {
            return Err(
                "a file that is not a socket is in the way; remove it or choose another path"
                    .into(),
            )
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("cannot inspect the path: {e}")),
    }
    // Created owner-only; the configured mode is applied right after. (Binding happens
    // before any other thread exists, so the process-wide umask is ours to change.)
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = Endpoint::Unix(path.to_path_buf()).bind();
    nix::sys::stat::umask(old);
    let fd = bound.map_err(|e| {
        format!("bind: {e} (does the directory exist and is it writable by the relay?)")
    })?;
    listen_on(&fd).map_err(|e| format!("listen: {e}"))?;
    Ok(fd)
}

fn bind_vsock(cid: u32, port: u32) -> Result<OwnedFd, String> {
    let fd = Endpoint::Vsock { cid, port }.bind().map_err(|e| {
        format!(
            "bind: {e} (is the vhost_vsock kernel module loaded? vsock ports are host-wide: \
             each app needs its own port in cid mode)"
        )
    })?;
    listen_on(&fd).map_err(|e| format!("listen: {e}"))?;
    Ok(fd)
}

fn set_file_access(path: &Path, mode: u32, uid: Option<u32>, gid: Option<u32>) -> io::Result<()> {
    if uid.is_some() || gid.is_some() {
        std::os::unix::fs::chown(path, uid, gid)?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &Path, mode: &str) -> Config {
        Config::parse(
            &serde_json::json!({
                "app": "a",
                "vm": {"id": "v", "vsock_uds": dir.join("vm.vsock")},
                "mode": "per_vm_socket",
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
        let paths: Vec<PathBuf> = bound.files.paths().to_vec();
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
        assert_eq!(err.name, "agent");
        assert!(err.reason.contains("not a socket"), "{err}");
        // The first listener, created before the failure, was removed again.
        assert!(!dir.path().join("vm.vsock_5001").exists());
        assert!(dir.path().join("vm.vsock_5003").exists());
    }
}
