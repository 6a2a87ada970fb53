//! The enrollment state machine with the TPM store, against the reference service and a
//! real swtpm (its raw-command socket; no VM): what the file store guarantees holds with
//! the TPM store too. An identity change (a raised epoch) makes a new TPM key and CSR and
//! removes the old key's blob; two runs at once share one state directory, serialize on
//! its lock and send one CSR; a run with an enrolled identity sends nothing.
//!
//! The guest-init *library* runs here (`state::Enroller` with a `TpmKeyStore` connected to
//! swtpm), since the binary only knows `/dev/tpmrm0`; the VM test `enroll_vm_tpm` runs the
//! binary with a vTPM.

use std::os::unix::net::UnixStream;
use std::sync::Arc;

use e2e::util::{have_program, require};
use guest_init::enroll::keystore::KeyStore;
use guest_init::enroll::state::{Enroller, Outcome};
use guest_init::enroll::tpm::store::Stream;
use guest_init::enroll::tpm::TpmKeyStore;
use guest_init::enroll::{material, RetryPolicy};
use qemu_harness::swtpm::RawServer;
use vm_transport::Endpoint;

use super::*;

/// Writes root-only material for `id` with a newly registered token and reads it back
/// the way guest-init does.
fn material_for(
    svc: &EnrollService,
    dir: &Path,
    id: &Identity,
) -> guest_init::enroll::material::Material {
    let token = new_token("TPM");
    let expires = svc.register(&token, id, Duration::from_secs(600)).unwrap();
    let doc = svc.material_json(&token, id, expires, 5002);
    let path = dir.join(format!("bootstrap-{}.json", id.epoch));
    write_bootstrap(&path, doc.to_string().as_bytes());
    material::read_file(&path).unwrap().expect("material")
}

fn slot_of(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Enrolled { slot, .. } | Outcome::AlreadyEnrolled { slot, .. } => slot.clone(),
    }
}

#[test]
fn the_tpm_store_keeps_the_state_machines_rules() {
    if !require(have_program("swtpm"), "swtpm (apt-get install swtpm)") {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let svc = EnrollService::start().unwrap();
    let svc_sock = work.path().join("svc.sock");
    svc.listen_vm(VM, &svc_sock).unwrap();
    let server = RawServer::start(&work.path().join("tpm")).unwrap();
    let sock = server.socket().to_path_buf();
    let state = work.path().join("state");
    let store = TpmKeyStore::with_connector(
        &state,
        Arc::new(move || UnixStream::connect(&sock).map(|s| Box::new(s) as Box<dyn Stream>)),
    )
    .unwrap();
    let enroller = || Enroller {
        state_dir: state.clone(),
        publish_dir: work.path().join("identity"),
        store: &store,
        service: Some(Endpoint::Unix(svc_sock.clone())),
        timeout: Duration::from_secs(10),
        retry: RetryPolicy::default(),
        discard_refused: false,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    // Epoch 5: a TPM key, a certificate for it.
    let m5 = material_for(&svc, work.path(), &identity(VM, 5));
    let first = rt.block_on(enroller().run(Some(m5))).unwrap();
    let old = slot_of(&first);
    assert!(matches!(first, Outcome::Enrolled { .. }), "{first:?}");
    assert_eq!(store.slots().unwrap(), vec![old.clone()]);
    let cert5 = std::fs::read(state.join(format!("{old}.crt"))).unwrap();
    let key5 = store.open(&old).unwrap().unwrap();
    assert_eq!(cert_key(&cert5), key5.public_sec1());

    // Epoch 6, two runs at once with the same material: they serialize on the lock, one
    // CSR goes out, the second run finds the identity enrolled.
    let id6 = identity(VM, 6);
    let (a, b) = (
        material_for(&svc, work.path(), &id6),
        material::read_file(&work.path().join("bootstrap-6.json"))
            .unwrap()
            .unwrap(),
    );
    let csrs_before = distinct_csrs(&svc).len();
    let (ra, rb) = rt.block_on(async {
        let (ea, eb) = (enroller(), enroller());
        tokio::join!(ea.run(Some(a)), eb.run(Some(b)))
    });
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(
        distinct_csrs(&svc).len(),
        csrs_before + 1,
        "two runs at once sent more than one CSR"
    );
    assert_eq!(slot_of(&ra), slot_of(&rb), "{ra:?} / {rb:?}");
    assert!(
        matches!(
            (&ra, &rb),
            (Outcome::Enrolled { .. }, Outcome::AlreadyEnrolled { .. })
                | (Outcome::AlreadyEnrolled { .. }, Outcome::Enrolled { .. })
        ),
        "{ra:?} / {rb:?}"
    );

    // The new identity has a new TPM key; the old key's blob, CSR and certificate are gone.
    let new = slot_of(&ra);
    assert_ne!(new, old, "the raised epoch reused the old key");
    assert_eq!(store.slots().unwrap(), vec![new.clone()]);
    assert!(store.open(&old).unwrap().is_none());
    for ext in ["key", "csr", "crt"] {
        assert!(
            !state.join(format!("{old}.{ext}")).exists(),
            "{old}.{ext} outlived its identity"
        );
    }
    let cert6 = std::fs::read(state.join(format!("{new}.crt"))).unwrap();
    let key6 = store.open(&new).unwrap().unwrap();
    assert_eq!(cert_key(&cert6), key6.public_sec1());
    assert_eq!(
        cert_uris(&cert6),
        vec![id6.uri()],
        "the certificate names another identity"
    );
}
