//! Shared pieces of the forwarding tests: a seeded random generator, target services
//! (echo, sink-and-source), spec builders and the REQUIRE_ALL convention.

use std::io;
use std::path::Path;
use std::time::Duration;

use guest_init::forward::{DialPolicy, ServiceSpec};
use vm_transport::{Conn, Endpoint};

/// A xorshift64* generator: deterministic from its seed, so a failure is reproducible.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len + 8);
        while v.len() < len {
            v.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        v.truncate(len);
        v
    }

    /// Chunk sizes that cover `len`: mostly large, sometimes tiny, to vary the boundaries.
    pub fn chunks(&mut self, len: usize) -> Vec<usize> {
        let mut out = Vec::new();
        let mut left = len;
        while left > 0 {
            let n = match self.below(4) {
                0 => 1 + self.below(16) as usize,
                1 => 1 + self.below(4096) as usize,
                _ => 1 + self.below(256 * 1024) as usize,
            }
            .min(left);
            out.push(n);
            left -= n;
        }
        out
    }
}

/// Under `REQUIRE_ALL=1` a missing prerequisite fails the test; otherwise the test prints
/// `SKIPPED: <why>` and the caller returns.
pub fn require(ok: bool, what: &str) -> bool {
    if ok {
        return true;
    }
    if std::env::var("REQUIRE_ALL").is_ok_and(|v| v == "1") {
        panic!("required but missing: {what}");
    }
    println!("SKIPPED: {what}");
    false
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// A service spec with default owner, group and mode.
pub fn service(name: &str, listen: &Path, target: Endpoint) -> ServiceSpec {
    ServiceSpec {
        name: name.into(),
        listen: listen.to_path_buf(),
        target,
        owner: None,
        group: None,
        mode: None,
        dial: DialPolicy::default(),
    }
}

/// A dial policy that gives up quickly: for dead-target tests.
pub fn quick_dial() -> DialPolicy {
    DialPolicy {
        attempts: 3,
        backoff_initial_ms: 5,
        backoff_max_ms: 10,
        timeout_ms: 2000,
    }
}

pub fn unix(p: &Path) -> Endpoint {
    Endpoint::Unix(p.to_path_buf())
}

/// A guard against a hung test: a test that waits longer than this has failed.
pub const HANG: Duration = Duration::from_secs(60);

pub async fn guard<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(HANG, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no progress in {HANG:?}"),
    }
}

/// Reads until end of stream.
pub async fn read_all(c: &Conn) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    while let Some(chunk) = c.read_pooled().await? {
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// Whether the connection was closed by the other side: end of stream or a reset.
pub async fn closed(c: &Conn) -> bool {
    let mut buf = [0u8; 64];
    match c.read(&mut buf).await {
        Ok(0) => true,
        Err(e) => matches!(e.raw_os_error(), Some(libc::ECONNRESET) | Some(libc::EPIPE)),
        Ok(_) => false,
    }
}

/// Echoes everything back until end of stream, then half-closes.
pub async fn echo(c: Conn) {
    while let Ok(Some(chunk)) = c.read_pooled().await {
        if c.write_all(&chunk).await.is_err() {
            return;
        }
    }
    let _ = c.shutdown_write();
}

/// Serves `echo` on every connection accepted at `ep`, forever (the task is dropped with
/// the runtime).
pub fn spawn_echo_server(ep: &Endpoint) -> tokio::task::JoinHandle<()> {
    let l = ep.listen().expect("listen for the echo target");
    tokio::spawn(async move {
        loop {
            if let Ok((c, _)) = l.accept().await {
                tokio::spawn(echo(c));
            }
        }
    })
}
