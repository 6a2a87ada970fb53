//! guest-init as PID 1 of a fresh PID + mount namespace (`unshare --fork --pid --mount
//! --mount-proc --uts --net`): reaping, the shutdown order and grace period, the app's exit
//! status, the host's stop request, and that a panic or a malformed configuration ends in
//! the orderly power-off. In a PID namespace `reboot(RB_POWER_OFF)` ends the namespace's
//! init as if killed by SIGINT; `unshare` re-raises it, so the test sees SIGINT where a VM
//! would power off. A crash of PID 1 would show up as another status (or SIGKILL).

use crate::support::*;
use nix::sys::signal::Signal;
use serde_json::json;

fn config(app: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    let mut c = json!({"version": 1, "hostname": "pid1-test", "app": app});
    if let serde_json::Value::Object(m) = extra {
        c.as_object_mut().unwrap().extend(m);
    }
    c
}

#[test]
fn a_thousand_orphaned_zombies_are_reaped() {
    if !require_namespaces() {
        return;
    }
    let dir = scratch();
    let d = dir.path().display();
    // Each `(true &)` makes `true` an orphan: its subshell exits at once, so `true` is
    // re-parented to PID 1 and becomes a zombie that only PID 1 can reap. The app then
    // counts zombies in the namespace until none is left (or it gives up) and reports.
    let script = write_script(
        dir.path(),
        "app.sh",
        &format!(
            r#"i=0
while [ $i -lt 1000 ]; do (true &); i=$((i+1)); done
n=0
while [ $n -lt 600 ]; do
  z=$(grep -s '^State:[[:space:]]*Z' /proc/[0-9]*/status | wc -l)
  [ "$z" -eq 0 ] && break
  n=$((n+1)); sleep 0.1
done
echo "$z" > {d}/zombies
exit 0"#
        ),
    );
    let cfg = write_config(
        dir.path(),
        &config(
            json!({"command": [script], "user": 0}),
            json!({"log_level": "debug"}),
        ),
    );
    let (st, console) = Running::pid1(&cfg).wait();
    assert_eq!(
        read(&dir.path().join("zombies")),
        "0",
        "zombies left; console tail:\n{}",
        tail(&console)
    );
    let reaped = console.matches("guest-init: reaped pid=").count();
    assert!(reaped >= 1000, "only {reaped} orphans reaped");
    assert!(
        console.contains("app exited status=0"),
        "{}",
        tail(&console)
    );
    assert!(console.contains("shutdown: app ended"));
    assert_powered_off(st, &console);
}

fn tail(console: &str) -> String {
    let lines: Vec<&str> = console.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

#[test]
fn sigterm_reaches_everyone_then_sigkill_after_the_grace_period() {
    if !require_namespaces() {
        return;
    }
    let dir = scratch();
    let d = dir.path().display();
    // - a child in the app's process group that exits on SIGTERM;
    // - a daemon in its own session (out of the app's group: only kill(-1) reaches it);
    // - a stubborn child that ignores SIGTERM, notes it, and 1 s later notes it is still
    //   alive (the grace period is 5 s, so it must be), then only SIGKILL ends it;
    // - the app itself exits 0 on SIGTERM, 0.3 s after noting it: exactly once, since a
    //   second SIGTERM would run its trap again.
    let script = write_script(
        dir.path(),
        "app.sh",
        &format!(
            r#"sh -c 'trap "echo term > {d}/child.term; exit 0" TERM; while :; do sleep 0.05; done' &
setsid sh -c 'trap "echo term > {d}/daemon.term; exit 0" TERM; while :; do sleep 0.05; done' &
sh -c 'echo $$ > {d}/stubborn.pid; trap "echo term > {d}/stubborn.term; sleep 1; echo alive > {d}/stubborn.alive" TERM; while :; do sleep 0.05; done' &
trap 'echo term >> {d}/app.term; sleep 0.3; exit 0' TERM
sleep 0.3
echo started > {d}/started
while :; do sleep 0.05; done"#
        ),
    );
    let cfg = write_config(
        dir.path(),
        &config(
            json!({"command": [script], "user": 0}),
            json!({"log_level": "debug", "shutdown": {"grace_period_ms": 5000}}),
        ),
    );
    let vm = Running::pid1(&cfg);
    vm.wait_for_line("ready in ");
    wait_for_file(&dir.path().join("started"));
    wait_for_file(&dir.path().join("stubborn.pid"));
    vm.signal(Signal::SIGTERM);
    let (st, console) = vm.wait();
    let p = |f: &str| dir.path().join(f);
    for f in ["app.term", "child.term", "daemon.term", "stubborn.term"] {
        assert_eq!(
            read(&p(f)),
            "term",
            "{f}: SIGTERM did not arrive; console:\n{}",
            tail(&console)
        );
    }
    assert_eq!(
        read(&p("stubborn.alive")),
        "alive",
        "the stubborn child was killed before the grace period ended"
    );
    let stubborn = read(&p("stubborn.pid"));
    let killed = format!("reaped pid={stubborn} signal=SIGKILL");
    assert!(
        console.contains(&killed),
        "no {killed:?}:\n{}",
        tail(&console)
    );
    // In order: TERM (shutdown line), app's end, grace over, SIGKILL, power-off.
    let pos = |needle: &str| {
        console
            .find(needle)
            .unwrap_or_else(|| panic!("no {needle:?} on the console:\n{}", tail(&console)))
    };
    assert!(pos("shutdown: signal SIGTERM") < pos("app exited status=0"));
    assert!(pos("app exited status=0") < pos("grace period of 5000 ms over"));
    assert!(pos("grace period of 5000 ms over") < pos(&killed));
    assert_powered_off(st, &console);
}

#[test]
fn the_apps_exit_status_is_reported() {
    if !require_namespaces() {
        return;
    }
    let dir = scratch();
    let cfg = write_config(
        dir.path(),
        &config(
            json!({"command": ["/bin/sh", "-c", "exit 7"], "user": 0}),
            json!({}),
        ),
    );
    let (st, console) = Running::pid1(&cfg).wait();
    assert!(
        console.contains("guest-init: app exited status=7"),
        "{console}"
    );
    assert!(
        console.contains("guest-init: shutdown: app ended"),
        "{console}"
    );
    assert_powered_off(st, &console);

    let cfg = write_config(
        dir.path(),
        &config(
            json!({"command": ["/bin/sh", "-c", "kill -KILL $$"], "user": 0}),
            json!({}),
        ),
    );
    let (st, console) = Running::pid1(&cfg).wait();
    assert!(
        console.contains("guest-init: app killed signal=SIGKILL"),
        "{console}"
    );
    assert_powered_off(st, &console);
}

#[test]
fn a_panic_ends_in_the_orderly_poweroff() {
    if !require_namespaces() {
        return;
    }
    let dir = scratch();
    let d = dir.path().display();
    let script = write_script(
        dir.path(),
        "app.sh",
        &format!("trap 'echo term > {d}/app.term; exit 0' TERM\nwhile :; do sleep 0.05; done"),
    );
    let cfg = write_config(
        dir.path(),
        &config(
            json!({"command": [script], "user": 0}),
            json!({"debug_panic_after_ready": true}),
        ),
    );
    let (st, console) = Running::pid1(&cfg).wait();
    assert!(
        console.contains("guest-init: error: panic: debug_panic_after_ready is set"),
        "{console}"
    );
    assert!(console.contains("guest-init: shutdown: panic"), "{console}");
    // Orderly: the app was asked to stop with SIGTERM, not killed with its VM. (The panic
    // comes right after the spawn, so the shell may not have set its trap yet: then SIGTERM
    // kills it, which the console reports.)
    assert!(
        read(&dir.path().join("app.term")) == "term"
            || console.contains("guest-init: app killed signal=SIGTERM"),
        "the app did not get SIGTERM: {console}"
    );
    assert_powered_off(st, &console);
}

#[test]
fn a_malformed_configuration_ends_in_the_orderly_poweroff() {
    if !require_namespaces() {
        return;
    }
    let dir = scratch();
    let cfg = dir.path().join("guest-init.json");
    std::fs::write(
        &cfg,
        "{\"version\": 1,\n \"app\": {\"command\": [\"/bin/true\"], \"user\": 0,}\n",
    )
    .unwrap();
    let (st, console) = Running::pid1(&cfg).wait();
    assert!(console.contains("guest-init: error: fatal: "), "{console}");
    assert!(
        console.contains("line 2"),
        "the message must say where: {console}"
    );
    assert!(
        console.contains("guest-init: shutdown: fatal error"),
        "{console}"
    );
    assert_powered_off(st, &console);

    // A configuration that parses but names an unknown user is fatal the same way.
    let cfg = write_config(
        dir.path(),
        &config(
            json!({"command": ["/bin/true"], "user": "no-such-user-xyz"}),
            json!({}),
        ),
    );
    let (st, console) = Running::pid1(&cfg).wait();
    assert!(
        console.contains("error: fatal: configuration ")
            && console.contains("guest-init.json: app.user: unknown user \"no-such-user-xyz\""),
        "{console}"
    );
    assert_powered_off(st, &console);
}

#[test]
fn the_hosts_stop_request_takes_the_shutdown_path() {
    if !require_namespaces() {
        return;
    }
    use std::io::{Read, Write};
    let dir = scratch();
    let d = dir.path().display();
    let sock = dir.path().join("control.sock");
    let script = write_script(
        dir.path(),
        "app.sh",
        &format!("trap 'echo term > {d}/app.term; exit 0' TERM\nwhile :; do sleep 0.05; done"),
    );
    let cfg = write_config(
        dir.path(),
        &config(
            json!({"command": [script], "user": 0}),
            json!({"control": {"listen": {"unix": sock}}}),
        ),
    );
    let vm = Running::pid1(&cfg);
    vm.wait_for_line("ready in ");
    let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    c.write_all(b"ping\n").unwrap();
    let mut buf = [0u8; 64];
    let n = c.read(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"ok pong\n");
    let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    c.write_all(b"stop\n").unwrap();
    let mut reply = Vec::new();
    c.read_to_end(&mut reply).unwrap();
    assert_eq!(reply, b"ok stopping\n");
    drop(c);
    let (st, console) = vm.wait();
    assert!(
        console.contains("guest-init: shutdown: host request"),
        "{console}"
    );
    assert_eq!(read(&dir.path().join("app.term")), "term");
    assert_powered_off(st, &console);
}

#[test]
fn hostname_loopback_and_static_network_are_set_up() {
    if !require_namespaces() {
        return;
    }
    let dir = scratch();
    let d = dir.path().display();
    // In the fresh network namespace only `lo` exists, so it stands in for eth0: the test
    // checks the address, the default route and the link state the ioctls set.
    let script = write_script(
        dir.path(),
        "app.sh",
        &format!(
            "hostname > {d}/hostname\ncat /proc/net/route > {d}/route\ncat /proc/net/fib_trie > {d}/fib\ncat /proc/net/dev > {d}/dev\ngrep -c ' /tmp ' /proc/self/mountinfo > {d}/tmp-mounted"
        ),
    );
    let cfg = write_config(
        dir.path(),
        &config(
            json!({"command": [script], "user": 0}),
            json!({"network": {"interface": "lo", "address": "10.0.2.15/24", "gateway": "10.0.2.2"}}),
        ),
    );
    let (st, console) = Running::pid1(&cfg).wait();
    assert!(
        console.contains("network: lo 10.0.2.15/24 via 10.0.2.2"),
        "{console}"
    );
    assert_eq!(read(&dir.path().join("hostname")), "pid1-test");
    let route = read(&dir.path().join("route"));
    // Destination 0.0.0.0, gateway 10.0.2.2 (little-endian hex), flags UP|GATEWAY.
    assert!(
        route.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[1] == "00000000" && f[2] == "0202000A" && f[3] == "0003"
        }),
        "no default route via 10.0.2.2:\n{route}"
    );
    assert!(read(&dir.path().join("fib")).contains("10.0.2.15"));
    assert_eq!(
        read(&dir.path().join("tmp-mounted")),
        "1",
        "/tmp was not mounted"
    );
    assert_powered_off(st, &console);
}

#[test]
fn as_pid1_stray_arguments_never_end_init() {
    if !require_namespaces() {
        return;
    }
    // `--help` would print and return from main in an ordinary process; as PID 1 that
    // would panic the kernel. Here it is ignored, the default configuration is missing on
    // this host, and that fatal error ends in the orderly power-off.
    if !require(
        !std::path::Path::new(guest_init::config::DEFAULT_PATH).exists(),
        "this test needs a host without /etc/guest-init.json",
    ) {
        return;
    }
    let (st, console) = Running::pid1_args(&["--help"]).wait();
    assert!(console.contains("ignoring arguments"), "{console}");
    assert!(
        console.contains("error: fatal: cannot read configuration /etc/guest-init.json"),
        "{console}"
    );
    assert_powered_off(st, &console);
}
