//! Measures key generation + CSR, the guest-side cost of enrolling (the exchange aside).
//!
//! `cargo run --release -p guest-init --example enroll_keygen [N]` prints the median and
//! the 90th percentile over N runs (default 100) of:
//! - `memory`: a P-256 key from the OS RNG into the memory store, and the signed CSR;
//! - `file`: the same with the file store (PKCS#8 written 0600, fsync, rename, fsync dir)
//!   in a temporary directory, plus the CSR;
//! - `tpm`: the key created by a real swtpm (Debian's, started here on a fresh state
//!   directory, reached over its raw-command Unix socket: the same bytes guest-init writes
//!   to `/dev/tpmrm0`), its wrapped blob written like the file store's, and the CSR signed
//!   by the TPM. Each of the two operations re-creates the storage root key, loads what it
//!   needs and flushes it (see `enroll/tpm/`). Host-side: no VM, no TCG.
//!
//! `enroll_keygen N --device /dev/tpmrm0` measures the memory and TPM stores only, the TPM
//! store on that device (keys in a temporary directory under `/run`): run inside a VM
//! with a vTPM (`qemu-harness boot --tpm-state DIR`, the example built for musl as the
//! app, as root) to measure under the VM's accelerator.
//!
//! A benchmark, not a test: it asserts nothing about time.

use std::time::{Duration, Instant};

use guest_init::enroll::file_store::FileKeyStore;
use guest_init::enroll::identity::Identity;
use guest_init::enroll::keystore::KeyStore;
use guest_init::enroll::memory_store::MemoryKeyStore;
use guest_init::enroll::tpm::store::Stream;
use guest_init::enroll::tpm::TpmKeyStore;

fn stats(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    (v[v.len() / 2], v[v.len() * 9 / 10])
}

fn measure(store: &dyn KeyStore, id: &Identity, n: usize) -> Vec<Duration> {
    (0..n)
        .map(|_| {
            let t = Instant::now();
            let (slot, key) = store.generate().expect("generate");
            let csr = guest_init::enroll::csr::build(key.as_ref(), id).expect("csr");
            let d = t.elapsed();
            assert!(!csr.is_empty());
            store.remove(&slot).expect("remove");
            d
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(100);
    let device = args
        .iter()
        .position(|a| a == "--device")
        .and_then(|i| args.get(i + 1));
    let id = Identity {
        workspace_namespace: "team-a".into(),
        workspace_name: "ws1".into(),
        workspace_uid: "0b4c5e2a-1111-2222-3333-444455556666".into(),
        vm_uid: "vm-1".into(),
        epoch: u64::MAX,
    };
    let mem = MemoryKeyStore::new().expect("memory store");
    let (m50, m90) = stats(measure(&mem, &id, n));
    if let Some(device) = device {
        let dir = tempfile::tempdir_in("/run").expect("tempdir in /run");
        let tpm = TpmKeyStore::with_device(&dir.path().join("tpm-keys"), device.as_ref())
            .expect("tpm store");
        let (t50, t90) = stats(measure(&tpm, &id, n));
        println!("key generation + CSR, {n} runs, on {device}:");
        println!("  memory store: median {m50:?}, p90 {m90:?}");
        println!("  tpm store:    median {t50:?}, p90 {t90:?}");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let file = FileKeyStore::open_dir(&dir.path().join("keys")).expect("file store");
    let (f50, f90) = stats(measure(&file, &id, n));
    let tpm_state = dir.path().join("tpm");
    let server = qemu_harness::swtpm::RawServer::start(&tpm_state).expect("start swtpm");
    let sock = server.socket().to_path_buf();
    let tpm = TpmKeyStore::with_connector(
        &dir.path().join("tpm-keys"),
        std::sync::Arc::new(move || {
            std::os::unix::net::UnixStream::connect(&sock).map(|s| Box::new(s) as Box<dyn Stream>)
        }),
    )
    .expect("tpm store");
    let (t50, t90) = stats(measure(&tpm, &id, n));
    println!("key generation + CSR, {n} runs:");
    println!("  memory store: median {m50:?}, p90 {m90:?}");
    println!("  file store:   median {f50:?}, p90 {f90:?} (includes two fsyncs)");
    println!("  tpm store:    median {t50:?}, p90 {t90:?} (swtpm over its socket; two fsyncs)");
}
