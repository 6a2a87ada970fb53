//! Host-to-guest connections over a hybrid vsock Unix socket (`CONNECT <port>\n`).
//!
//! The protocol and its traps are `vm-transport`'s to handle (`vm_transport::hybrid`: byte-wise
//! reply, bounded retries, never closing before `OK` or EOF). This module only runs that
//! async client on a private single-threaded runtime and turns its connection into the
//! blocking `UnixStream` that tests and the command line want.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Connects to guest `port` through the VM's vsock socket `uds`, retrying for up to
/// `timeout` while the guest is not ready. The returned stream is blocking.
pub fn connect(uds: &Path, port: u32, timeout: Duration) -> std::io::Result<UnixStream> {
    let opts = vm_transport::hybrid::ConnectOptions {
        timeout,
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let conn = rt.block_on(vm_transport::hybrid::connect(uds, port, &opts))?;
    let fd: OwnedFd = conn.into_owned_fd();
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}
