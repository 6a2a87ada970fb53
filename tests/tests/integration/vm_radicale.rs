//! VM test 9: real Radicale in a real micro-VM signs in through the whole path.
//!
//! Radicale 3.9.0 from PyPI, with its stock `[auth] type = dovecot` configuration, runs
//! on a root disk with Debian's Python 3.11, as uid 1001, under `guest-init` (PID 1).
//! The host reaches it by HTTP through QEMU's user networking and a host port forward,
//! so Radicale sees the gateway 10.0.2.2 as its client, as in production. Its sign-in
//! goes guest-init forwarder → virtio-vsock → vhost-device-vsock → `<uds>_5001` →
//! host-relay → a real Dovecot on the host.
//!
//! Properties checked, each of which fails when its part is broken:
//! - a right password gets 2xx and a wrong one 401 (Dovecot decides: the forwarder,
//!   vsock, the relay and Dovecot are all on the path);
//! - Radicale did see the gateway as its client (its own log on the console), yet
//!   Dovecot's log, which shows every request's `rip`, never shows the gateway, and shows
//!   the app's own client address instead: the relay rewrote it;
//! - the host's stop request ends the VM cleanly: QEMU exits 0 without being killed.
//!
//! Runs on every guest kernel `e2e::util::test_kernels` names (6.1 and 6.12 after setup).
//!
//! Needs QEMU, the guest kernel, vhost-device-vsock, Dovecot and root (for the cached root
//! disk's first build); without them it prints `SKIPPED` (or fails under
//! `REQUIRE_ALL=1`).

use e2e::radicale_vm::{self, Options, Requirements, Scenario, APP_CLIENT_ADDRESS, GATEWAY};
use e2e::util;

#[test]
fn radicale_in_a_vm_signs_in_through_the_relay_and_dovecot_never_sees_the_gateway() {
    let _heavy = crate::support::heavy_lock();
    let req = Requirements::check();
    if !util::require(req.ok(), &req.missing.join(", ")) {
        return;
    }
    let Some(kernels) = util::test_kernels() else {
        return;
    };
    util::on_each_kernel(&kernels, |kernel| {
        let opts = Options {
            kernel: Some(kernel.clone()),
            ..Options::default()
        };
        let mut sc = Scenario::start(&opts, &mut |p| {
            eprintln!(
                "[vm_radicale] {:<13} {:>6}  {}",
                p.name,
                radicale_vm::secs(p.took),
                p.detail
            )
        })
        .unwrap_or_else(|e| panic!("{e}"));
        eprintln!(
            "[vm_radicale] boot-to-ready {:.2} s, boot-to-HTTP {:.2} s",
            sc.boot_to_ready.as_secs_f64(),
            sc.boot_to_http.as_secs_f64()
        );

        let right = sc
            .sign_in(radicale_vm::USER, radicale_vm::PASSWORD)
            .unwrap_or_else(|e| panic!("right password: {e}\nconsole:\n{}", sc.console()));
        assert!(
            (200..300).contains(&right.status),
            "right password got {} (want 2xx)\n{}\nrelay log:\n{}\ndovecot log:\n{}\nconsole:\n{}",
            right.status,
            right.head,
            sc.relay_log(),
            sc.dovecot_log(),
            radicale_vm::tail_lines(&sc.console(), 40)
        );
        let wrong = sc
            .sign_in(radicale_vm::USER, "not-the-password")
            .unwrap_or_else(|e| panic!("wrong password: {e}\nconsole:\n{}", sc.console()));
        assert_eq!(
            wrong.status, 401,
            "wrong password got {} (want 401)\n{}",
            wrong.status, wrong.head
        );

        // Radicale saw the gateway as its client: the rewrite had something to do.
        let console = sc.console();
        assert!(
            console.contains(&format!("received from {GATEWAY}")),
            "Radicale's log does not show the gateway {GATEWAY} as its client:\n{}",
            radicale_vm::tail_lines(&console, 40)
        );
        // Dovecot logged both requests with the app's own address, never the gateway.
        let log = sc.dovecot_log();
        let auth_lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("client in: AUTH"))
            .collect();
        assert!(
            auth_lines.len() >= 2,
            "Dovecot logged {} AUTH requests (want both sign-ins):\n{log}",
            auth_lines.len()
        );
        for l in &auth_lines {
            assert!(
                l.contains(&format!("rip={APP_CLIENT_ADDRESS}")),
                "an AUTH request reached Dovecot without the app's client address: {l}"
            );
        }
        assert!(
            !log.contains(GATEWAY),
            "Dovecot's log shows the gateway address {GATEWAY}:\n{log}"
        );
        assert!(
            !log.contains(radicale_vm::PASSWORD) && !console.contains(radicale_vm::PASSWORD),
            "a password reached a log"
        );

        let stop = sc.stop().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(stop.reply, "ok stopping");
        assert!(
            stop.clean(),
            "the VM did not stop cleanly: exit {:?}, killed {}\n{}",
            stop.exit,
            stop.killed,
            radicale_vm::tail_lines(&sc.console(), 30)
        );
        let console = sc.console();
        assert!(
            !console.contains("Attempted to kill init"),
            "PID 1 died:\n{}",
            radicale_vm::tail_lines(&console, 30)
        );
    });
}

/// The root disk holds what the VM test relies on, read back from the image itself with
/// `debugfs` (no mount): Radicale's stock Dovecot configuration at the unchanged socket
/// path, the guest's Python, and storage owned by the `radicale` user only.
#[test]
fn radicale_root_disk_has_the_stock_dovecot_config_and_a_private_storage_dir() {
    let _heavy = crate::support::heavy_lock();
    use e2e::radicale_rootfs::{self as r, RootfsOptions};
    let req = Requirements::check();
    let have_debugfs =
        util::have_program("debugfs") || std::path::Path::new("/usr/sbin/debugfs").exists();
    if !util::require(req.ok() && have_debugfs, &{
        let mut m = req.missing.clone();
        if !have_debugfs {
            m.push("debugfs (apt-get install e2fsprogs)".into());
        }
        m.join(", ")
    }) {
        return;
    }
    let disk = r::ensure(&RootfsOptions::new(util::cache_dir()), &mut |l| {
        eprintln!("[rootfs] {l}")
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let debugfs = |cmd: &str| -> String {
        let out = std::process::Command::new("debugfs")
            .args(["-R", cmd])
            .arg(&disk.image)
            .output()
            .expect("run debugfs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let config = debugfs(&format!("cat {}", r::RADICALE_CONFIG_PATH));
    assert!(
        config.contains("[auth]\ntype = dovecot\n")
            && config.contains(&format!("dovecot_socket = {}\n", r::DOVECOT_SOCKET)),
        "Radicale's config on the disk is not the stock dovecot one:\n{config}"
    );
    let python = debugfs("stat /usr/bin/python3.11");
    assert!(
        python.contains("Type: regular"),
        "no python3.11 on the disk:\n{python}"
    );
    let radicale = debugfs("stat /usr/lib/python3/dist-packages/radicale/auth/dovecot.py");
    assert!(
        radicale.contains("Type: regular"),
        "Radicale's dovecot backend is not on the disk:\n{radicale}"
    );
    let storage = debugfs("stat /var/lib/radicale/collections");
    assert!(
        storage.contains(&format!("User:  {}", r::RADICALE_UID))
            && storage.contains(&format!("Group:  {}", r::RADICALE_UID))
            && storage.contains("Mode:  0750"),
        "storage is not private to uid {}:\n{storage}",
        r::RADICALE_UID
    );
    let passwd = debugfs("cat /etc/passwd");
    assert!(
        passwd.contains(&format!("radicale:x:{0}:{0}:", r::RADICALE_UID)),
        "no radicale user in /etc/passwd:\n{passwd}"
    );
}
