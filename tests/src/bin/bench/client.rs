//! The client side of figures 1 to 4: the same workloads, run against any path.
//!
//! Each workload takes only the Unix socket path a client connects to, so the direct
//! socket, the chain and the socat chain are measured by identical code. Clients use
//! blocking standard-library sockets with timeouts: the client must be the cheapest part
//! of the measurement, and a broken path must end as a counted failure, not a hang.
//!
//! - [`rtt`]: 64-byte ping-pong on one connection; one sample per round trip.
//! - [`bulk`]: one connection; a writer thread sends 1 MiB writes while a reader thread
//!   takes the echo back, so both directions carry the full stream at once. The figure is
//!   the bytes that came back per second.
//! - [`setup`]: connect, one 64-byte echo, close, again and again; one sample per
//!   connection.
//! - [`burst`]: N connections opened at once by a few threads, each sending 64 bytes and
//!   checking the echo; all are held open until every one is done, so the relays really
//!   carry N connections at the same moment.

use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::echo::connect;

/// How long any single client operation may take before it counts as a failure.
pub const OP_TIMEOUT: Duration = Duration::from_secs(30);

const PING: [u8; 64] = [0x5a; 64];

fn echo_once(s: &mut (impl Read + Write)) -> io::Result<()> {
    s.write_all(&PING)?;
    let mut back = [0u8; 64];
    s.read_exact(&mut back)?;
    if back != PING {
        return Err(io::Error::other("echo came back altered"));
    }
    Ok(())
}

/// Round-trip times in microseconds of 64-byte ping-pongs for `dur`.
pub fn rtt(path: &Path, dur: Duration) -> io::Result<Vec<f64>> {
    let mut s = connect(path, OP_TIMEOUT)?;
    // Warm the path (first-use allocations, buffer pool) before sampling.
    for _ in 0..50 {
        echo_once(&mut s)?;
    }
    let mut samples = Vec::with_capacity(32 * 1024);
    let end = Instant::now() + dur;
    while Instant::now() < end {
        let t = Instant::now();
        echo_once(&mut s)?;
        samples.push(super::stats::micros(t.elapsed()));
    }
    Ok(samples)
}

/// Bulk throughput in MiB/s of echoed bytes, 1 MiB writes, for `dur`.
pub fn bulk(path: &Path, dur: Duration) -> io::Result<f64> {
    const WRITE: usize = 1 << 20;
    let s = connect(path, OP_TIMEOUT)?;
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

/// Connection setups for `dur`: per-connection times in microseconds, and the rate.
pub fn setup(path: &Path, dur: Duration) -> io::Result<(Vec<f64>, f64)> {
    let one = || -> io::Result<()> {
        let mut s = connect(path, OP_TIMEOUT)?;
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
        samples.push(super::stats::micros(t.elapsed()));
    }
    let rate = samples.len() as f64 / start.elapsed().as_secs_f64();
    Ok((samples, rate))
}

/// What a burst did.
#[derive(Debug, Clone, Copy)]
pub struct Burst {
    /// Connections that were opened and echoed correctly.
    pub ok: usize,
    /// Connections attempted.
    pub total: usize,
    /// From the first connect to the last echo, in milliseconds.
    pub millis: f64,
}

/// Opens `n` connections at once from `threads` threads; each echoes 64 bytes once; all
/// stay open until every thread is done.
pub fn burst(path: &Path, n: usize, threads: usize) -> Burst {
    let threads = threads.clamp(1, n.max(1));
    let barrier = Arc::new(std::sync::Barrier::new(threads + 1));
    let done = Arc::new(std::sync::Barrier::new(threads + 1));
    let mut handles = Vec::new();
    for t in 0..threads {
        let share = n / threads + usize::from(t < n % threads);
        let path = path.to_path_buf();
        let (barrier, done) = (Arc::clone(&barrier), Arc::clone(&done));
        handles.push(std::thread::spawn(move || {
            barrier.wait();
            let mut conns = Vec::with_capacity(share);
            for _ in 0..share {
                if let Ok(mut s) = connect(&path, OP_TIMEOUT) {
                    if s.write_all(&PING).is_ok() {
                        conns.push(s);
                    }
                }
            }
            let mut ok = 0;
            for s in &mut conns {
                let mut back = [0u8; 64];
                if s.read_exact(&mut back).is_ok() && back == PING {
                    ok += 1;
                }
            }
            done.wait();
            // Held open until here: every connection of the burst was live at once.
            drop(conns);
            ok
        }));
    }
    barrier.wait();
    let start = Instant::now();
    done.wait();
    let millis = super::stats::millis(start.elapsed());
    let ok = handles.into_iter().map(|h| h.join().unwrap_or(0)).sum();
    Burst {
        ok,
        total: n,
        millis,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::echo::EchoServer;

    #[test]
    fn workloads_run_against_the_echo_service() {
        let dir = tempfile::tempdir().unwrap();
        let s = EchoServer::start(&dir.path().join("echo")).unwrap();
        let d = Duration::from_millis(30);
        assert!(!rtt(s.path(), d).unwrap().is_empty());
        assert!(bulk(s.path(), d).unwrap() > 0.0);
        let (samples, rate) = setup(s.path(), d).unwrap();
        assert!(!samples.is_empty() && rate > 0.0);
        let b = burst(s.path(), 40, 4);
        assert_eq!((b.ok, b.total), (40, 40));
    }

    #[test]
    fn a_dead_path_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nobody");
        assert!(rtt(&missing, Duration::from_millis(10)).is_err());
        assert_eq!(burst(&missing, 5, 2).ok, 0);
    }
}
