//! The relay as a process: configuration checking, bursts, accept failures, stuck
//! connections and shutdown.
//!
//! - `check-config` names the bad field and exits non-zero;
//! - one stuck connection (a caller that never sends) does not block the next caller;
//! - running out of descriptors (`EMFILE`, forced with `prlimit`) is logged, and the
//!   accept loop serves again once descriptors are free: the relay never dies;
//! - SIGTERM: exit 0 and every socket file removed.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;

use crate::support::*;
use e2e::util::{have_program, host_bin, require};

fn stream_config(dir: &Path, uds: &Path) -> serde_json::Value {
    serde_json::json!({
        "app": "app-a",
        "vm": {"id": "vm-a"},
        "transport": {"per_vm_socket": {"vsock_uds": uds}},
        "services": [{"name": "svc", "port": 5001, "upstream": {"unix": dir.join("ep-a")}}],
        "undeclared": [{"name": "agent", "port": 5003}]
    })
}

#[test]
fn check_config_names_the_field_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let good = dir.path().join("good.json");
    std::fs::write(&good, stream_config(dir.path(), &uds).to_string()).unwrap();
    let out = Command::new(host_bin("host-relay"))
        .args(["check-config"])
        .arg(&good)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut bad = stream_config(dir.path(), &uds);
    bad["undeclared"][0]["port"] = 5001.into();
    let path = dir.path().join("bad.json");
    std::fs::write(&path, bad.to_string()).unwrap();
    let out = Command::new(host_bin("host-relay"))
        .args(["check-config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("undeclared[0].port"), "{err}");

    let mut typo = stream_config(dir.path(), &uds);
    typo["vm"]["gatways"] = serde_json::json!([]);
    std::fs::write(&path, typo.to_string()).unwrap();
    let out = Command::new(host_bin("host-relay"))
        .args(["check-config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("gatways"));
}

#[test]
fn a_stuck_connection_does_not_block_the_next_and_sigterm_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let _rec = Recorder::start(&[("a", dir.path().join("ep-a"))]);
    let uds = dir.path().join("vm.vsock");
    // A stale socket from a crashed relay is replaced.
    drop(std::os::unix::net::UnixListener::bind(port_path(&uds, 5001)).unwrap());
    let relay = RelayProc::start(dir.path(), "relay", &stream_config(dir.path(), &uds));
    let mode = std::fs::metadata(port_path(&uds, 5001)).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
        0o600
    );
    // Connected, admitted, and silent: the service waits for a line that never comes.
    let stuck: Vec<UnixStream> = (0..20)
        .map(|_| UnixStream::connect(port_path(&uds, 5001)).unwrap())
        .collect();
    assert_eq!(
        exchange(&port_path(&uds, 5001), "ping\n").unwrap(),
        "hello a\n"
    );
    drop(stuck);
    assert!(relay.stop().success(), "exit 0 on SIGTERM");
    for port in [5001, 5003] {
        assert!(!port_path(&uds, port).exists(), "socket {port} left behind");
    }
}

#[test]
fn accept_survives_running_out_of_descriptors() {
    if !require(have_program("prlimit"), "prlimit (util-linux)") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let _rec = Recorder::start(&[("a", dir.path().join("ep-a"))]);
    let uds = dir.path().join("vm.vsock");
    let config = dir.path().join("relay.json");
    std::fs::write(&config, stream_config(dir.path(), &uds).to_string()).unwrap();
    // 40 descriptors: the runtime and listeners take some; each relayed connection two.
    let mut child = Command::new("prlimit")
        .arg("--nofile=40:40")
        .arg(host_bin("host-relay"))
        .args(["run", "--config"])
        .arg(&config)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let lines = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let sink = lines.clone();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let mut s = sink.lock().unwrap();
            s.push_str(&l);
            s.push('\n');
        }
    });
    let wait_for = |needle: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !lines.lock().unwrap().contains(needle) {
            assert!(
                std::time::Instant::now() < deadline,
                "no {needle:?} in:\n{}",
                lines.lock().unwrap()
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    };
    wait_for(" ready ");
    // Hold many connections open: the relay runs out of descriptors while accepting.
    let held: Vec<UnixStream> = (0..60)
        .filter_map(|_| UnixStream::connect(port_path(&uds, 5001)).ok())
        .collect();
    wait_for("accept failed");
    assert!(
        lines.lock().unwrap().contains("Too many open files"),
        "{}",
        lines.lock().unwrap()
    );
    drop(held);
    // Descriptors are free again: the same listener serves new callers.
    let mut served = false;
    for _ in 0..200 {
        if let Ok(r) = exchange(&port_path(&uds, 5001), "ping\n") {
            if r == "hello a\n" {
                served = true;
                break;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        served,
        "the relay must serve again:\n{}",
        lines.lock().unwrap()
    );
    assert!(
        child.try_wait().unwrap().is_none(),
        "the relay must not die"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(child.wait().unwrap().success());
}

#[test]
fn connect_cli_speaks_hybrid_connect_and_keeps_the_guests_bytes() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.vsock");
    let l = std::os::unix::net::UnixListener::bind(&uds).unwrap();
    let vmm = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while s.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
            line.push(b[0]);
        }
        // The OK line and the guest's first bytes in one segment.
        s.write_all(b"OK 1024\nok pong\n").unwrap();
        let mut rest = String::new();
        s.read_to_string(&mut rest).unwrap();
        (String::from_utf8(line).unwrap(), rest)
    });
    let mut child = Command::new(host_bin("host-relay"))
        .args(["connect", "--uds"])
        .arg(&uds)
        .args(["--port", "1024", "--timeout-ms", "5000"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"ping\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok pong\n");
    let (line, rest) = vmm.join().unwrap();
    assert_eq!(line, "CONNECT 1024");
    assert_eq!(rest, "ping\n");
}
