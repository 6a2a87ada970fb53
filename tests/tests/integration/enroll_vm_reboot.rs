//! VM test 7, part 2: a reboot in the middle of enrollment resumes with the identical CSR,
//! because the guest's enrollment state lives on a virtio-blk disk.
//!
//! # What runs
//!
//! The same path as `enroll_vm.rs` — QEMU (TCG), the Debian guest kernel,
//! vhost-device-vsock, the static musl `guest-init` as PID 1, `host-relay` in
//! per-VM-socket mode on vsock port 5002 in front of the reference enrollment service —
//! with one difference: the guest's root is an ext4 disk on virtio-blk (`/dev/vda`),
//! built with `vm_image::rootdisk` from a directory holding the bootstrap material
//! (root, `0600`) and the app (`guest-probe`). guest-init switches root into it before
//! enrolling, so its state directory (`/var/lib/guest-init/enroll`: key, exact CSR,
//! `pending.json`) is on that disk. The initramfs holds only guest-init, its configuration
//! and the kernel modules.
//!
//! # The scenario
//!
//! 1. **Boot 1.** The service is told to stall after committing (`stall_after_commit`):
//!    it receives the guest's CSR, issues and commits the certificate, and holds back the
//!    answer. Once it has stalled, QEMU is killed with SIGKILL — no orderly shutdown, no
//!    `sync`, no unmount: for the guest this is a power cut mid-enrollment. The guest's
//!    per-attempt timeout is long (120 s), so it cannot give up and retry (and so
//!    succeed) inside boot 1 before the kill.
//! 2. **Between boots**, the disk is inspected on a *copy* (the journal replayed there by
//!    `e2fsck`, the original untouched so the guest's own kernel does the recovery in
//!    boot 2): the key (`0600`), the CSR byte-identical to what the service received, and
//!    `pending.json` are there; no certificate, no `enrolled.json`.
//! 3. **Boot 2**, from the same disk image (a new QEMU, vsock backend and relay: what a
//!    platform restarting a VM does). The guest logs that it resumes the pending
//!    enrollment, the service records a second request whose CSR is byte-identical to
//!    boot 1's and answers it with the certificate committed in boot 1, the app starts
//!    only after that, and after an orderly stop the disk holds that very certificate,
//!    the unchanged key and CSR, and `enrolled.json` in place of `pending.json`.
//!
//! # Why it can fail
//!
//! If guest-init made a new key or CSR after the reboot — state on a tmpfs, not written
//! before the send, or not `fsync`ed (the guest page cache dies with QEMU) — boot 2's CSR
//! would differ, the service would answer `csr_mismatch`, and both the CSR comparison and
//! the ready line fail. If the certificate were not the committed one, the comparison of
//! the disk's `.crt` with the service's ledger fails.
//!
//! # The disk's cache mode
//!
//! The harness attaches disks with `cache=unsafe`: QEMU ignores the guest's flushes, but
//! every write the guest's block layer completed is already in the host's page cache
//! (QEMU completes a write once `pwrite` to the image returns). Killing QEMU therefore
//! loses exactly what the guest had not yet written out — the guest's own page cache —
//! which is what the guest's `fsync` defends against, as with `cache=writeback`. Only a
//! host crash would tell the modes apart, and that is not what this test simulates.
//!
//! Needs QEMU, the guest kernel, vhost-device-vsock, e2fsprogs (`mke2fs`, `debugfs`,
//! `e2fsck`) and root (the disk's files must be owned by root for guest-init to accept
//! the bootstrap file); without them it prints `SKIPPED` (or fails under `REQUIRE_ALL=1`).

use std::time::Instant;

use base64::Engine;
use e2e::util::{musl_bin, on_each_kernel, test_kernels};
use p256::pkcs8::DecodePrivateKey;
use qemu_harness::process::tail;
use qemu_harness::Vm;

const TOKEN: &str = "tok_REBOOT_SECRET_0123456789abcdefghijklmnopqrstuv";

use crate::enroll_disk::{
    boot_resumes, check_requirements, power_cut, read_state, release_the_committed_request,
    service_and_disk, sha, vm_spec, wait_until, BOOT_TIMEOUT,
};

/// The secrets scan: neither the token nor the private key (DER or scalar, hex or
/// base64, or any PEM line of it) in anything the guest or the relay printed.
fn assert_no_secrets(outputs: &[(&str, String)], key_der: &[u8]) {
    let hex = |b: &[u8]| -> String { b.iter().map(|x| format!("{x:02x}")).collect() };
    let b64 = base64::engine::general_purpose::STANDARD;
    let scalar = p256::ecdsa::SigningKey::from_pkcs8_der(key_der)
        .expect("the disk's key is PKCS#8 P-256")
        .to_bytes()
        .to_vec();
    let mut needles = vec![("token".to_string(), TOKEN.to_string())];
    for (what, bytes) in [("key DER", key_der.to_vec()), ("key scalar", scalar)] {
        needles.push((format!("{what} hex"), hex(&bytes)));
        needles.push((format!("{what} HEX"), hex(&bytes).to_uppercase()));
        needles.push((format!("{what} base64"), b64.encode(&bytes)));
        needles.push((
            format!("{what} base64url"),
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&bytes),
        ));
    }
    for line in b64.encode(key_der).as_bytes().chunks(64) {
        needles.push(("key PEM line".into(), String::from_utf8_lossy(line).into()));
    }
    for (source, out) in outputs {
        for (what, n) in &needles {
            // The message names what leaked and where, never the secret itself.
            assert!(!out.contains(n.as_str()), "{what} appears in the {source}");
        }
        assert!(
            !out.contains("PRIVATE KEY"),
            "a PEM private key appears in the {source}"
        );
    }
}

#[test]
fn a_reboot_mid_enrollment_resumes_from_the_virtio_blk_disk_with_the_identical_csr() {
    let _l = crate::support::heavy_lock();
    let Some(tools) = check_requirements() else {
        return;
    };
    let Some(kernels) = test_kernels() else {
        return;
    };
    let guest_init = musl_bin("guest-init");
    let probe = musl_bin("guest-probe");
    on_each_kernel(&kernels, |kernel| {
        let work = tempfile::tempdir().unwrap();
        let (svc, svc_sock, disk) = service_and_disk(&tools, work.path(), &probe, TOKEN);

        // Boot 1: the service commits the CSR and never answers; then the power goes.
        svc.stall_after_commit();
        let boot1_started = Instant::now();
        let mut vm1 = Vm::boot(vm_spec(
            "enroll-reboot-1",
            kernel,
            &guest_init,
            &disk,
            &svc_sock,
            "file",
        ))
        .unwrap_or_else(|e| panic!("boot 1: {e}"));
        wait_until(
            &mut vm1,
            "the service to commit boot 1's CSR and stall",
            BOOT_TIMEOUT,
            || svc.stalled() == 1,
        );
        let boot1_to_stall = boot1_started.elapsed();
        // A power cut: SIGKILL, no stop request.
        power_cut(&mut vm1);
        let console1 = vm1.console();
        let relay1 = vm1.relay_log("enroll");
        assert!(
            console1.contains("switched root to /dev/vda"),
            "boot 1 did not run on the disk:\n{}",
            tail(&console1, 40)
        );
        assert!(
            console1.contains("enroll: new file key ") && console1.contains(" persisted"),
            "boot 1 did not make and persist a key and CSR:\n{}",
            tail(&console1, 40)
        );
        assert!(
            !console1.contains("enroll: enrolled ")
                && !console1.contains(qemu_harness::vm::READY_MARK),
            "boot 1 got its certificate before the kill: the reboot was not mid-enrollment:\n{}",
            tail(&console1, 40)
        );
        drop(vm1);

        // The stalled request completes into the dead connection and is recorded.
        let (committed, csr1) = release_the_committed_request(&svc, TOKEN);

        // The disk after the power cut: key, exact CSR and pending state, no certificate.
        let between = read_state(&tools, &disk, work.path());
        assert_eq!(
            between.dir_mode,
            Some(0o040700),
            "state directory after boot 1: {between:?}"
        );
        let key1 = between.only(".key");
        assert_eq!(
            (key1.mode, key1.uid),
            (0o100600, 0),
            "the key file is not root-only"
        );
        let key1 = key1.bytes.clone();
        assert!(
            between.only(".csr").bytes == csr1,
            "the CSR on the disk (sha256 {}) is not the one the service received (sha256 {})",
            sha(&between.only(".csr").bytes),
            sha(&csr1)
        );
        assert!(
            between.files.contains_key("pending.json")
                && !between.files.contains_key("enrolled.json")
                && between.names_ending(".crt").is_empty(),
            "after boot 1 the disk should hold a pending enrollment and no certificate: {}",
            between.listing()
        );

        // Boot 2 from the same disk: the guest resends the same CSR and gets the certificate.
        let mut vm2 = boot_resumes(
            vm_spec(
                "enroll-reboot-2",
                kernel,
                &guest_init,
                &disk,
                &svc_sock,
                "file",
            ),
            "file",
            &svc,
            &csr1,
            &committed,
        );
        let relay2 = vm2.relay_log("enroll");
        // For a person reading the log (not asserted: timings belong to benchmarks).
        eprintln!(
            "[enroll_vm_reboot] boot 1: QEMU start to the service's stall {:.2} s, then SIGKILL; \
         boot 2: boot-to-ready {:.2} s; CSR sha256 {} sent in both boots; certificate \
         sha256 {}",
            boot1_to_stall.as_secs_f64(),
            vm2.ready().map_or(0.0, |r| r.boot_to_ready.as_secs_f64()),
            sha(&csr1),
            sha(&committed)
        );

        let report = vm2.stop().unwrap_or_else(|e| panic!("stop: {e}"));
        assert!(report.clean(), "{report:?}\n{}", tail(&vm2.console(), 40));
        let console2 = vm2.console();
        for bad in ["Kernel panic", "Attempted to kill init"] {
            assert!(!console2.contains(bad), "{bad}:\n{console2}");
        }
        drop(vm2);

        // The disk now holds the committed certificate for the unchanged key and CSR.
        let after = read_state(&tools, &disk, work.path());
        assert!(
            after.only(".key").bytes == key1,
            "the key changed across the reboot"
        );
        assert!(
            after.only(".csr").bytes == csr1,
            "the CSR changed across the reboot"
        );
        assert!(
            after.only(".crt").bytes == committed,
            "the guest stored another certificate (sha256 {}) than the one committed in boot 1 \
         (sha256 {})",
            sha(&after.only(".crt").bytes),
            sha(&committed)
        );
        assert!(
            after.files.contains_key("enrolled.json") && !after.files.contains_key("pending.json"),
            "after boot 2 the enrollment should be complete: {}",
            after.listing()
        );

        assert_no_secrets(
            &[
                ("boot 1 console", console1),
                ("boot 1 relay log", relay1),
                ("boot 2 console", console2),
                ("boot 2 relay log", relay2),
            ],
            &key1,
        );
    });
}
