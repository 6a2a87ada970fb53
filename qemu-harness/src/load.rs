//! The benchmark's client workloads, shared by the host bench and the in-guest probe.
//!
//! The same four workloads measure every path of the benchmark, on the host (direct, the
//! chain, the naive relay, socat; `tests/src/bin/bench`) and inside a VM under TCG
//! (guest-init's forwarder, socat as the forwarder, an app dialling vsock itself;
//! `guest-probe load`). Keeping one implementation here means a figure means the same on
//! both sides, and a fix to one is a fix to both. Clients use blocking sockets with
//! timeouts: the client must be the cheapest part of the measurement, and a broken path
//! must end as a counted failure, not a hang.
//!
//! - [`rtt`]: 64-byte ping-pong on one connection; one sample per round trip.
//! - [`bulk`]: one connection; a writer thread sends 1 MiB writes while a reader thread
//!   takes the echo back, so both directions carry the full stream at once. The figure is
//!   the bytes that came back per second.
//! - [`bulk_exchange`]: the in-guest bulk figure: chunks written and read back in turn
//!   (why: its doc).
//! - [`setup`]: connect, one 64-byte echo, close, again and again; one sample per
//!   connection.
//! - [`burst`]: N connections opened at once by a few threads, each sending 64 bytes and
//!   checking the echo; all are held open until every one is done, so the relays really
//!   carry N connections at the same moment.
//!
//! A [`Target`] is where a client connects: a Unix socket path or a vsock address. Both
//! connect with `SO_SNDTIMEO`/`SO_RCVTIMEO` set before `connect(2)`, so a full backlog
//! (where a blocking Unix connect waits) also ends at the timeout.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// How long any single client operation may take before it counts as a failure.
pub const OP_TIMEOUT: Duration = Duration::from_secs(30);

const PING: [u8; 64] = [0x5a; 64];

/// Where a client connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A Unix stream socket.
    Unix(PathBuf),
    /// An `AF_VSOCK` stream address.
    Vsock {
        /// The peer's CID (2: the host).
        cid: u32,
        /// The port.
        port: u32,
    },
}

impl Target {
    /// Parses `vsock:CID:PORT`, or a path (`unix:PATH` or an absolute `PATH`).
    pub fn parse(s: &str) -> Option<Target> {
        if let Some(rest) = s.strip_prefix("vsock:") {
            let (cid, port) = rest.split_once(':')?;
            return Some(Target::Vsock {
                cid: cid.parse().ok()?,
                port: port.parse().ok()?,
            });
        }
        let path = s.strip_prefix("unix:").unwrap_or(s);
        path.starts_with('/').then(|| Target::Unix(path.into()))
    }

    /// Connects; the connect, and later reads and writes, give up after `timeout`.
    pub fn connect(&self, timeout: Duration) -> io::Result<UnixStream> {
        match self {
            Target::Unix(path) => connect_unix(path, timeout),
            Target::Vsock { cid, port } => connect_vsock(*cid, *port, timeout),
        }
    }
}

/// The form [`Target::parse`] reads back.
impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Unix(path) => write!(f, "{}", path.display()),
            Target::Vsock { cid, port } => write!(f, "vsock:{cid}:{port}"),
        }
    }
}

fn socket(family: libc::c_int, timeout: Duration) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the result is checked before use.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as _,
        tv_usec: timeout.subsec_micros() as _,
    };
    for opt in [libc::SO_SNDTIMEO, libc::SO_RCVTIMEO] {
        // SAFETY: `tv` is a valid timeval and the length passed is its size.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                std::ptr::addr_of!(tv).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(fd)
}

/// `connect(2)` on `fd` to the address `addr` of type `T`.
fn connect_to<T>(fd: OwnedFd, addr: &T) -> io::Result<UnixStream> {
    // SAFETY: `addr` points to a complete sockaddr of the socket's family, and the length
    // passed is its size.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            std::ptr::from_ref(addr).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // A connected stream socket of any family works with UnixStream's read(2)/write(2).
    Ok(UnixStream::from(fd))
}

fn connect_unix(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt as _;
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid starting value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket path {} is too long", path.display()),
        ));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    connect_to(socket(libc::AF_UNIX, timeout)?, &addr)
}

fn connect_vsock(cid: u32, port: u32, timeout: Duration) -> io::Result<UnixStream> {
    // SAFETY: sockaddr_vm is plain old data; all-zero is a valid starting value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    connect_to(socket(libc::AF_VSOCK, timeout)?, &addr)
}

/// Microseconds in a duration, as a float.
pub fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The `p`-th percentile (0..=100) of `samples` by nearest rank (no interpolation rule
/// to argue about; always a value that was measured); `None` when empty.
pub fn percentile(samples: &[f64], p: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

fn echo_once(s: &mut (impl Read + Write)) -> io::Result<()> {
    s.write_all(&PING)?;
    let mut back = [0u8; 64];
    s.read_exact(&mut back)?;
    if back != PING {
        return Err(io::Error::other("echo came back altered"));
    }
    Ok(())
}

/// Round trips [`rtt`] makes before it starts sampling.
pub const RTT_WARMUP: usize = 50;

/// Round-trip times in microseconds of 64-byte ping-pongs for `dur`.
pub fn rtt(to: &Target, dur: Duration) -> io::Result<Vec<f64>> {
    let mut s = to.connect(OP_TIMEOUT)?;
    // Warm the path (first-use allocations, buffer pool) before sampling.
    for _ in 0..RTT_WARMUP {
        echo_once(&mut s)?;
    }
    let mut samples = Vec::with_capacity(32 * 1024);
    let end = Instant::now() + dur;
    while Instant::now() < end {
        let t = Instant::now();
        echo_once(&mut s)?;
        samples.push(micros(t.elapsed()));
    }
    Ok(samples)
}

/// Bulk throughput in MiB/s of echoed bytes, 1 MiB writes, for `dur`.
pub fn bulk(to: &Target, dur: Duration) -> io::Result<f64> {
    const WRITE: usize = 1 << 20;
    let s = to.connect(OP_TIMEOUT)?;
    let mut writer = s.try_clone()?;
    let mut reader = s;
    let received = Arc::new(AtomicU64::new(0));
    let got = Arc::clone(&received);
    let reading = std::thread::spawn(move || -> io::Result<()> {
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            match reader.read(&mut buf)? {
                0 => return Ok(()),
                n => {
                    got.fetch_add(n as u64, Ordering::Relaxed);
                }
            }
        }
    });
    let data = vec![0xa5u8; WRITE];
    // Warm up for a tenth of the time, then measure what comes back.
    let start = Instant::now();
    let warm = start + dur / 10;
    let end = warm + dur;
    // The window opens after the warm-up and closes when the last byte written is back:
    // at least one write follows the opening, so a loaded machine that blocks a whole
    // window in one write still measures that write, never 0 bytes.
    let mut base = None;
    while base.is_none() || Instant::now() < end {
        writer.write_all(&data)?;
        if base.is_none() && Instant::now() >= warm {
            base = Some((Instant::now(), received.load(Ordering::Relaxed)));
        }
    }
    let (t0, b0) = base.unwrap_or((start, 0));
    writer.shutdown(std::net::Shutdown::Write)?;
    reading
        .join()
        .map_err(|_| io::Error::other("bulk reader panicked"))??;
    let bytes = received.load(Ordering::Relaxed) - b0;
    let secs = t0.elapsed().as_secs_f64();
    Ok(bytes as f64 / (1024.0 * 1024.0) / secs)
}

/// Bulk throughput in MiB/s of echoed bytes, one direction at a time: `chunk` bytes
/// written, then the same bytes read back, again and again, for `dur`.
///
/// The in-guest figure: vhost-device-vsock 0.3.0 flushes the guest-to-host bytes it had
/// to buffer only on an epoll event that is `EPOLLOUT` alone, so a connection that
/// carries data both ways at once (what [`bulk`] does) stalls for good as soon as the
/// host side both has bytes for the guest and can take more (seen on every path, socat's
/// included). Exchanging chunks lets the host side fall quiet between them, and
/// `chunk` must fit in the path's buffers (256 KiB does: a Unix socket buffer and vsock's
/// 256 KiB credit on the way back alone hold more).
pub fn bulk_exchange(to: &Target, dur: Duration, chunk: usize) -> io::Result<f64> {
    let mut s = to.connect(OP_TIMEOUT)?;
    let data = vec![0xa5u8; chunk];
    let mut back = vec![0u8; chunk];
    let mut one = || -> io::Result<()> {
        s.write_all(&data)?;
        s.read_exact(&mut back)?;
        if back != data {
            return Err(io::Error::other("bulk echo came back altered"));
        }
        Ok(())
    };
    // Warm up for a tenth of the time (at least one exchange), then measure.
    let start = Instant::now();
    while start.elapsed() < dur / 10 {
        one()?;
    }
    let (t0, mut bytes) = (Instant::now(), 0u64);
    while bytes == 0 || t0.elapsed() < dur {
        one()?;
        bytes += chunk as u64;
    }
    Ok(bytes as f64 / (1024.0 * 1024.0) / t0.elapsed().as_secs_f64())
}

/// Connection setups for `dur`: per-connection times in microseconds, and the rate.
pub fn setup(to: &Target, dur: Duration) -> io::Result<(Vec<f64>, f64)> {
    let one = || -> io::Result<()> {
        let mut s = to.connect(OP_TIMEOUT)?;
        echo_once(&mut s)
    };
    for _ in 0..20 {
        one()?;
    }
    let mut samples = Vec::new();
    let start = Instant::now();
    let end = start + dur;
    while Instant::now() < end {
        let t = Instant::now();
        one()?;
        samples.push(micros(t.elapsed()));
    }
    let rate = samples.len() as f64 / start.elapsed().as_secs_f64();
    Ok((samples, rate))
}

/// What a burst did.
#[derive(Debug, Clone)]
pub struct Burst {
    /// Connections that were opened and echoed correctly.
    pub ok: usize,
    /// Connections attempted.
    pub total: usize,
    /// From the first connect to the last echo, in milliseconds.
    pub millis: f64,
    /// The first error seen, if any (a failed connection is counted, and this says why).
    pub first_error: Option<String>,
}

/// Opens `n` connections at once from `threads` threads; each echoes 64 bytes once; all
/// stay open until every thread is done.
pub fn burst(to: &Target, n: usize, threads: usize) -> Burst {
    let threads = threads.clamp(1, n.max(1));
    let barrier = Arc::new(Barrier::new(threads + 1));
    let done = Arc::new(Barrier::new(threads + 1));
    let mut handles = Vec::new();
    for t in 0..threads {
        let share = n / threads + usize::from(t < n % threads);
        let to = to.clone();
        let (barrier, done) = (Arc::clone(&barrier), Arc::clone(&done));
        handles.push(std::thread::spawn(move || {
            barrier.wait();
            let mut conns = Vec::with_capacity(share);
            let mut first_error = None;
            for _ in 0..share {
                let opened = to
                    .connect(OP_TIMEOUT)
                    .and_then(|mut s| s.write_all(&PING).map(|()| s));
                match opened {
                    Ok(s) => conns.push(s),
                    Err(e) => {
                        first_error.get_or_insert(format!("connect or send: {e}"));
                    }
                }
            }
            // One deadline for all of this thread's echoes: a path that stops answering
            // costs the burst OP_TIMEOUT, not OP_TIMEOUT per connection.
            let deadline = Instant::now() + OP_TIMEOUT;
            let mut ok = 0;
            for s in &mut conns {
                let left = deadline.saturating_duration_since(Instant::now());
                let _ = s.set_read_timeout(Some(left.max(Duration::from_millis(1))));
                let mut back = [0u8; 64];
                match s.read_exact(&mut back) {
                    Ok(()) if back == PING => ok += 1,
                    Ok(()) => {
                        first_error.get_or_insert("echo came back altered".into());
                    }
                    Err(e) => {
                        first_error.get_or_insert(format!("echo: {e}"));
                    }
                }
            }
            done.wait();
            // Held open until here: every connection of the burst was live at once.
            drop(conns);
            (ok, first_error)
        }));
    }
    barrier.wait();
    let start = Instant::now();
    done.wait();
    let millis = start.elapsed().as_secs_f64() * 1e3;
    let (mut ok, mut first_error) = (0, None);
    for h in handles {
        let (k, e) = h
            .join()
            .unwrap_or((0, Some("a burst thread panicked".into())));
        ok += k;
        if first_error.is_none() {
            first_error = e;
        }
    }
    Burst {
        ok,
        total: n,
        millis,
        first_error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn echo_server(path: &Path) {
        let l = UnixListener::bind(path).unwrap();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { continue };
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 65536];
                    while let Ok(n @ 1..) = c.read(&mut buf) {
                        if c.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
    }

    #[test]
    fn workloads_run_against_an_echo_service() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("echo");
        echo_server(&path);
        let to = Target::Unix(path);
        let d = Duration::from_millis(30);
        assert!(!rtt(&to, d).unwrap().is_empty());
        assert!(bulk(&to, d).unwrap() > 0.0);
        assert!(bulk_exchange(&to, d, 256 * 1024).unwrap() > 0.0);
        let (samples, rate) = setup(&to, d).unwrap();
        assert!(!samples.is_empty() && rate > 0.0);
        let b = burst(&to, 40, 4);
        assert_eq!((b.ok, b.total, b.first_error), (40, 40, None));
    }

    #[test]
    fn a_dead_path_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let to = Target::Unix(dir.path().join("nobody"));
        assert!(rtt(&to, Duration::from_millis(10)).is_err());
        let b = burst(&to, 5, 2);
        assert_eq!(b.ok, 0);
        assert!(b.first_error.is_some_and(|e| e.contains("connect")));
    }

    #[test]
    fn targets_parse() {
        assert_eq!(
            Target::parse("vsock:2:6001"),
            Some(Target::Vsock { cid: 2, port: 6001 })
        );
        assert_eq!(
            Target::parse("unix:/run/a.sock"),
            Some(Target::Unix("/run/a.sock".into()))
        );
        assert_eq!(
            Target::parse("/run/a.sock"),
            Some(Target::Unix("/run/a.sock".into()))
        );
        assert_eq!(Target::parse("vsock:2"), None);
        assert_eq!(Target::parse("relative.sock"), None);
        for t in ["vsock:2:6001", "/run/a.sock"] {
            assert_eq!(Target::parse(t).unwrap().to_string(), t);
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).rev().collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
