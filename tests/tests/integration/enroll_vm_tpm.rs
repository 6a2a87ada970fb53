//! Enrollment with the TPM key store in a real micro-VM with a vTPM: the key is made by
//! the guest's TPM (swtpm on `tpm-crb`), the disk holds only a TPM-wrapped blob, a power
//! cut mid-enrollment resumes with the byte-identical CSR on the same TPM, and the same
//! disk on another TPM fails closed.
//!
//! # What runs
//!
//! The path of `enroll_vm_reboot.rs` (QEMU/TCG, the Debian guest kernel, vhost-device-vsock,
//! the static musl `guest-init` as PID 1 switching root into an ext4 disk on virtio-blk,
//! `host-relay` in per-VM-socket mode in front of the reference enrollment service) with
//! `key_store: "tpm"` and a vTPM: one `swtpm socket --tpm2` per boot on a state directory
//! the test keeps, QEMU `-tpmdev emulator` + `-device tpm-crb`. The guest kernel has the
//! TPM drivers built in; guest-init talks to `/dev/tpmrm0` itself (no C library, no tools).
//!
//! # The scenario, per kernel
//!
//! 1. **Boot 1** (TPM state A). The service commits the CSR and stalls; QEMU is SIGKILLed.
//!    The disk (inspected on a copy) holds a `0600` key file that parses as
//!    `TPM2B_PUBLIC || TPM2B_PRIVATE` with the fixedTPM signing attributes, and the CSR the
//!    service received.
//! 2. **Boot 2** (same disk, TPM state A again: a reboot). The guest resumes, resends the
//!    byte-identical CSR, gets the certificate committed in boot 1, starts the app, stops
//!    in order. The certificate's key is the blob's public point.
//! 3. **From outside**: the raw disk image contains no PKCS#8 or SEC1 EC private key
//!    structure and no PEM private key (the scanner is first shown to find one in a real
//!    PKCS#8 key, so it can fail); a swtpm on state A loads the blob from the disk and
//!    signs with it, and the signature verifies under the certificate's key: the blob is
//!    that TPM's key and nobody else's.
//! 4. **Boot 3** (same disk, a fresh TPM state B: the disk copied to another VM). The guest
//!    cannot load the key, says so naming the key and the reason, sends nothing, never
//!    starts the app and powers off; the disk's key, CSR and certificate are unchanged and
//!    no second key was made. Decided (docs/ENROLLMENT.md): fail closed, never re-enroll
//!    with a new key — a legitimate VM never meets another TPM's blob (a reset gives a new
//!    VM a new disk, TPM and identity), and the service would deny a second CSR for the
//!    used token anyway.
//!
//! Before all that, **boot 0** gives the same configuration a VM without a TPM: it powers
//! off with the configuration error naming `key_store` and the fix, sends nothing and
//! writes no state (never a fallback to the file store).
//!
//! Needs what `enroll_vm_reboot.rs` needs plus swtpm (`scripts/setup.sh` installs it).

use std::path::Path;

use e2e::util::{have_program, musl_bin, on_each_kernel, require, test_kernels};
use guest_init::enroll::keystore::KeyStore;
use guest_init::enroll::tpm::commands::{signing_attributes, signing_point, unmarshal_blob};
use guest_init::enroll::tpm::store::{Connector, Stream};
use guest_init::enroll::tpm::TpmKeyStore;
use p256::ecdsa::signature::Verifier;
use qemu_harness::process::tail;
use qemu_harness::swtpm::RawServer;
use qemu_harness::vm::READY_MARK;
use qemu_harness::Vm;

use crate::enroll_disk::{
    boot_resumes, check_requirements, power_cut, read_state, release_the_committed_request,
    service_and_disk, vm_spec, wait_until, BOOT_TIMEOUT,
};

const TOKEN: &str = "tok_TPM_SECRET_0123456789abcdefghijklmnopqrstuvwxyz";

/// DER prefixes of an unencrypted P-256 private key: PKCS#8 (`version 0` then the
/// `id-ecPublicKey` algorithm identifier; a public key's SPKI has no version before it)
/// and SEC1 `ECPrivateKey` (`version 1` then a 32-byte OCTET STRING).
const PKCS8_EC: &[u8] = &[
    0x02, 0x01, 0x00, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01,
];
const SEC1_EC: &[u8] = &[0x30, 0x77, 0x02, 0x01, 0x01, 0x04, 0x20];

/// What in `bytes` looks like a clear private key, by name.
fn private_key_structures(bytes: &[u8]) -> Vec<&'static str> {
    let has = |n: &[u8]| bytes.windows(n.len()).any(|w| w == n);
    let mut found = Vec::new();
    if has(PKCS8_EC) {
        found.push("PKCS#8 EC private key");
    }
    if has(SEC1_EC) {
        found.push("SEC1 ECPrivateKey");
    }
    if has(b"PRIVATE KEY") {
        found.push("PEM private key");
    }
    found
}

/// The certificate's public key as a SEC1 point.
fn cert_point(cert: &[u8]) -> Vec<u8> {
    let (_, c) = x509_parser::parse_x509_certificate(cert).expect("a DER certificate");
    c.public_key().subject_public_key.data.to_vec()
}

fn connector(server: &RawServer) -> Connector {
    let sock = server.socket().to_path_buf();
    std::sync::Arc::new(move || {
        std::os::unix::net::UnixStream::connect(&sock).map(|s| Box::new(s) as Box<dyn Stream>)
    })
}

fn tpm_spec(
    name: &str,
    kernel: &qemu_harness::Kernel,
    guest_init: &Path,
    disk: &Path,
    svc_sock: &Path,
    tpm_state: &Path,
) -> qemu_harness::VmSpec {
    let mut spec = vm_spec(name, kernel, guest_init, disk, svc_sock, "tpm");
    spec.tpm_state = Some(tpm_state.to_path_buf());
    spec
}

#[test]
fn the_tpm_store_keeps_only_a_wrapped_key_resumes_after_a_power_cut_and_fails_closed_on_another_tpm(
) {
    let _l = crate::support::heavy_lock();
    let Some(tools) = check_requirements() else {
        return;
    };
    if !require(
        have_program("swtpm"),
        "swtpm (apt-get install swtpm swtpm-tools)",
    ) {
        return;
    }
    let Some(kernels) = test_kernels() else {
        return;
    };
    let guest_init = musl_bin("guest-init");
    let probe = musl_bin("guest-probe");

    // The scanner can fail: it finds a real PKCS#8 P-256 key and its SEC1 form.
    let sk = <p256::SecretKey as p256::elliptic_curve::Generate>::try_generate().unwrap();
    let pkcs8 = p256::pkcs8::EncodePrivateKey::to_pkcs8_der(&sk).unwrap();
    assert!(private_key_structures(pkcs8.as_bytes()).contains(&"PKCS#8 EC private key"));
    assert!(private_key_structures(&sk.to_sec1_der().unwrap()).contains(&"SEC1 ECPrivateKey"));

    on_each_kernel(&kernels, |kernel| {
        let work = tempfile::tempdir().unwrap();
        let (svc, svc_sock, disk) = service_and_disk(&tools, work.path(), &probe, TOKEN);
        let tpm_a = work.path().join("tpm-a");

        // 0. The same configuration on a VM without a TPM: refused, naming the field and
        //    the fix, before anything is written or sent; never the file store.
        let mut no_tpm = vm_spec("enroll-tpm-0", kernel, &guest_init, &disk, &svc_sock, "tpm");
        no_tpm.tpm_state = None;
        let mut vm0 = Vm::boot(no_tpm).unwrap_or_else(|e| panic!("boot 0: {e}"));
        let exit = vm0.wait_exit(BOOT_TIMEOUT);
        let console0 = vm0.console();
        assert!(
            exit.is_ok()
                && console0.contains("key_store: \"tpm\" needs a TPM 2.0 at /dev/tpmrm0")
                && console0.contains("give the VM a TPM")
                && !console0.contains(READY_MARK),
            "a VM without a TPM was not refused with the field and the fix: {exit:?}\n{}",
            tail(&console0, 40)
        );
        drop(vm0);
        assert!(svc.requests().is_empty(), "boot 0 sent a request");
        let untouched = read_state(&tools, &disk, work.path());
        assert!(
            untouched.dir_mode.is_none(),
            "boot 0 wrote enrollment state: {}",
            untouched.listing()
        );

        // 1. Boot 1 on TPM A: the CSR is committed, then the power goes.
        svc.stall_after_commit();
        let mut vm1 = Vm::boot(tpm_spec(
            "enroll-tpm-1",
            kernel,
            &guest_init,
            &disk,
            &svc_sock,
            &tpm_a,
        ))
        .unwrap_or_else(|e| panic!("boot 1: {e}"));
        wait_until(
            &mut vm1,
            "the service to commit boot 1's CSR and stall",
            BOOT_TIMEOUT,
            || svc.stalled() == 1,
        );
        power_cut(&mut vm1);
        let console1 = vm1.console();
        assert!(
            console1.contains("enroll: new tpm key ") && console1.contains(" persisted"),
            "boot 1 did not make a TPM key and persist its CSR:\n{}",
            tail(&console1, 40)
        );
        drop(vm1);
        let (committed, csr1) = release_the_committed_request(&svc, TOKEN);

        let between = read_state(&tools, &disk, work.path());
        let key = between.only(".key");
        assert_eq!(
            (key.mode, key.uid),
            (0o100600, 0),
            "the key file is not root-only"
        );
        let blob = key.bytes.clone();
        let (public, _private) = unmarshal_blob(&blob)
            .unwrap_or_else(|e| panic!("the key file is not TPM2B_PUBLIC || TPM2B_PRIVATE: {e}"));
        assert_eq!(
            public.object_attributes,
            signing_attributes(),
            "the key is not a fixedTPM/fixedParent/sensitiveDataOrigin signing key"
        );
        assert!(
            between.only(".csr").bytes == csr1,
            "the CSR on disk is not the one the service received"
        );

        // 2. Boot 2 on the same disk and TPM A: the identical CSR, the committed certificate.
        let mut vm2 = boot_resumes(
            tpm_spec(
                "enroll-tpm-2",
                kernel,
                &guest_init,
                &disk,
                &svc_sock,
                &tpm_a,
            ),
            "tpm",
            &svc,
            &csr1,
            &committed,
        );
        let report = vm2.stop().unwrap_or_else(|e| panic!("stop: {e}"));
        assert!(report.clean(), "{report:?}\n{}", tail(&vm2.console(), 40));
        let console2 = vm2.console();
        let relay2 = vm2.relay_log("enroll");
        drop(vm2);

        let after = read_state(&tools, &disk, work.path());
        assert!(after.only(".key").bytes == blob, "the key blob changed");
        assert!(after.only(".crt").bytes == committed);
        assert_eq!(
            cert_point(&committed),
            signing_point(&public).unwrap(),
            "the certificate is not for the TPM key in the blob"
        );

        // 3. From outside: no clear private key anywhere on the disk; the blob works only
        //    with TPM A.
        let image = std::fs::read(&disk).unwrap();
        let found = private_key_structures(&image);
        assert!(
            found.is_empty(),
            "the disk image holds a clear private key: {found:?}"
        );
        let keys = work.path().join("keys-copy");
        std::fs::create_dir(&keys).unwrap();
        let slot = after.names_ending(".key")[0]
            .trim_end_matches(".key")
            .to_string();
        std::io::Write::write_all(
            &mut std::os::unix::fs::OpenOptionsExt::mode(
                std::fs::OpenOptions::new().write(true).create_new(true),
                0o600,
            )
            .open(keys.join(format!("{slot}.key")))
            .unwrap(),
            &blob,
        )
        .unwrap();
        {
            let server = RawServer::start(&tpm_a).expect("swtpm on TPM A's state");
            let store = TpmKeyStore::with_connector(&keys, connector(&server)).unwrap();
            let k = store
                .open(&slot)
                .unwrap_or_else(|e| panic!("TPM A cannot load its own blob: {e}"))
                .expect("the blob");
            let sig = k.sign_der(b"outside").unwrap();
            let vk = p256::ecdsa::VerifyingKey::from_sec1_bytes(&cert_point(&committed)).unwrap();
            let sig = p256::ecdsa::Signature::from_der(&sig).unwrap();
            assert!(
                vk.verify(b"outside", &sig).is_ok(),
                "TPM A's signature does not verify under the certificate's key"
            );
        }

        // 4. Boot 3: the same disk on a fresh TPM B fails closed.
        let tpm_b = work.path().join("tpm-b");
        let mut vm3 = Vm::boot(tpm_spec(
            "enroll-tpm-3",
            kernel,
            &guest_init,
            &disk,
            &svc_sock,
            &tpm_b,
        ))
        .unwrap_or_else(|e| panic!("boot 3: {e}"));
        let exit = vm3.wait_exit(BOOT_TIMEOUT);
        let console3 = vm3.console();
        assert!(
            exit.is_ok(),
            "boot 3 did not power off: {exit:?}\n{}",
            tail(&console3, 40)
        );
        assert!(
            console3.contains("enroll: final failure: key store tpm: key ")
                && console3.contains("cannot be loaded by this VM's TPM")
                && console3.contains(&slot),
            "boot 3 did not fail closed naming the key and the reason:\n{}",
            tail(&console3, 40)
        );
        assert!(
            !console3.contains(READY_MARK),
            "boot 3 started the app without its key:\n{}",
            tail(&console3, 40)
        );
        for bad in ["Kernel panic", "Attempted to kill init"] {
            assert!(!console3.contains(bad), "{bad}:\n{console3}");
        }
        drop(vm3);
        assert_eq!(svc.requests().len(), 2, "boot 3 sent a request");
        let last = read_state(&tools, &disk, work.path());
        assert_eq!(
            last.names_ending(".key"),
            vec![format!("{slot}.key").as_str()],
            "boot 3 made another key"
        );
        assert!(last.only(".key").bytes == blob && last.only(".crt").bytes == committed);

        for (what, out) in [
            ("boot 1 console", &console1),
            ("boot 2 console", &console2),
            ("boot 2 relay log", &relay2),
            ("boot 3 console", &console3),
        ] {
            assert!(!out.contains(TOKEN), "the token appears in the {what}");
        }
    });
}
