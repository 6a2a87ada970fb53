//! The four paths under test, each ending at the same service.
//!
//! - **direct**: the client connects to the service's own socket. The physical baseline.
//! - **chain**: this project's path. The client connects to the app's socket served by
//!   `guest-init` (run as an ordinary process with one forwarded service); `guest-init`
//!   dials `unix:<uds>_<port>`, which is where `host-relay run`, in per-VM socket mode for
//!   `<uds>`, listens (the hybrid-vsock convention); `host-relay` dials the service. In a
//!   VM the middle hop is vsock through the VMM; here a Unix socket stands in for it, so
//!   the figure is the cost of the two relays themselves.
//! - **naive**: the relay a Rust programmer writes in an afternoon, two hops of
//!   `tokio::io::copy_bidirectional` ([`super::naive`]), in the same places as the chain's.
//! - **socat chain**: what users would otherwise pick, with the same two hops:
//!   `socat UNIX-LISTEN:app,fork,backlog=4096 UNIX-CONNECT:mid` and
//!   `socat UNIX-LISTEN:mid,fork,backlog=4096 UNIX-CONNECT:service`.
//!
//! Every process a path starts is killed when the path is dropped, and its sockets live in
//! the benchmark's temporary directory. The processes inherit the benchmark's raised
//! descriptor limit (see `main`), which a 5,000-connection burst needs: each relayed
//! connection costs a relay two descriptors.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Which path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Client to service over one Unix socket.
    Direct,
    /// Client to guest-init to host-relay to service.
    Chain,
    /// Client to two naive tokio relays to service.
    Naive,
    /// Client to socat to socat to service.
    Socat,
}

impl Kind {
    /// All paths, in report order.
    pub const ALL: [Kind; 4] = [Kind::Direct, Kind::Chain, Kind::Naive, Kind::Socat];

    /// The name used in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Direct => "direct",
            Kind::Chain => "chain",
            Kind::Naive => "naive",
            Kind::Socat => "socat",
        }
    }
}

/// A running path: where clients connect, and the processes that carry it.
#[derive(Debug)]
pub struct Route {
    /// Which path this is.
    pub kind: Kind,
    /// The socket a client connects to.
    pub entry: PathBuf,
    /// The forwarder's pid (guest-init for the chain, the first socat otherwise).
    pub forwarder_pid: Option<u32>,
    /// The host relay's pid (host-relay for the chain, the second socat otherwise).
    pub relay_pid: Option<u32>,
    children: Vec<Child>,
}

impl Route {
    /// Where the client workloads connect.
    pub fn target(&self) -> qemu_harness::load::Target {
        qemu_harness::load::Target::Unix(self.entry.clone())
    }
}

impl Drop for Route {
    fn drop(&mut self) {
        for c in &mut self.children {
            // SIGTERM first so relays remove their sockets; then make sure.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        for c in &mut self.children {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The direct path: the service's own socket.
pub fn direct(service: &Path) -> Route {
    Route {
        kind: Kind::Direct,
        entry: service.to_path_buf(),
        forwarder_pid: None,
        relay_pid: None,
        children: Vec::new(),
    }
}

/// Waits until a socket file exists (a listener is bound), or fails naming it.
pub fn wait_for_socket(path: &Path, child: &mut Child, what: &str) -> io::Result<()> {
    wait_until(path, child, what, Path::exists)
}

/// Waits until a socket accepts connections, or fails naming it. A file that exists may
/// not be listening yet (a connect between `bind` and `listen` is refused), so a path is
/// measured only once a connect succeeds.
pub fn wait_for_listener(path: &Path, child: &mut Child, what: &str) -> io::Result<()> {
    wait_until(path, child, what, |p| {
        std::os::unix::net::UnixStream::connect(p).is_ok()
    })
}

fn wait_until(
    path: &Path,
    child: &mut Child,
    what: &str,
    ready: impl Fn(&Path) -> bool,
) -> io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready(path) {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(io::Error::other(format!(
                "{what} exited ({status}) before {} appeared",
                path.display()
            )));
        }
        if Instant::now() > deadline {
            return Err(io::Error::other(format!(
                "{what} did not create {} within 20 s",
                path.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Starts one process per hop, `listen` → `to`, first the hop nearest the service.
fn hops(
    kind: Kind,
    entry: PathBuf,
    mid: &Path,
    service: &Path,
    what: &str,
    command: impl Fn(&Path, &Path) -> Command,
) -> io::Result<Route> {
    let mut path = Route {
        kind,
        entry: entry.clone(),
        forwarder_pid: None,
        relay_pid: None,
        children: Vec::new(),
    };
    for (listen, to) in [(mid, service), (entry.as_path(), mid)] {
        let mut child = command(listen, to)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| io::Error::other(format!("cannot start {what}: {e}")))?;
        let r = wait_for_listener(listen, &mut child, what);
        let pid = child.id();
        path.children.push(child);
        r?;
        if listen == mid {
            path.relay_pid = Some(pid);
        } else {
            path.forwarder_pid = Some(pid);
        }
    }
    Ok(path)
}

/// The naive chain: two hops of this benchmark run as `bench naive-relay LISTEN TARGET`.
pub fn naive(dir: &Path, service: &Path, tag: &str) -> io::Result<Route> {
    let exe = std::env::current_exe()?;
    let entry = dir.join(format!("naive-{tag}-app.sock"));
    let mid = dir.join(format!("naive-{tag}-mid.sock"));
    hops(
        Kind::Naive,
        entry,
        &mid,
        service,
        "the naive relay",
        |listen, to| {
            let mut c = Command::new(&exe);
            c.arg(super::naive::SUBCOMMAND).arg(listen).arg(to);
            c
        },
    )
}

/// The socat chain: two `UNIX-LISTEN,fork` → `UNIX-CONNECT` hops in front of `service`.
pub fn socat(dir: &Path, service: &Path, tag: &str) -> io::Result<Route> {
    let entry = dir.join(format!("socat-{tag}-app.sock"));
    let mid = dir.join(format!("socat-{tag}-mid.sock"));
    hops(Kind::Socat, entry, &mid, service, "socat", |listen, to| {
        let mut c = Command::new("socat");
        c.arg(format!(
            "UNIX-LISTEN:{},fork,backlog=4096",
            listen.display()
        ))
        .arg(format!("UNIX-CONNECT:{}", to.display()));
        c
    })
}

/// Adds a started child to a path so it is stopped with it.
pub fn adopt(path: &mut Route, child: Child) {
    path.children.push(child);
}

/// A bare path record for a chain whose processes the caller starts and adopts.
pub fn chain_shell(entry: PathBuf) -> Route {
    Route {
        kind: Kind::Chain,
        entry,
        forwarder_pid: None,
        relay_pid: None,
        children: Vec::new(),
    }
}

/// A value from `/proc/<pid>/status` (e.g. `VmHWM`), in KiB.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_status() {
        let hwm = status_kib(std::process::id(), "VmHWM").unwrap();
        assert!(hwm > 0);
        assert_eq!(status_kib(std::process::id(), "NoSuchField"), None);
    }
}
