//! guest-init as an ordinary process: a subreaper supervisor that exits with the app's
//! status. Also the app's sandbox (user, groups, capabilities, no_new_privs, environment,
//! working directory), restarts, and signal forwarding.

use crate::support::*;
use nix::sys::signal::Signal;
use serde_json::json;

#[test]
fn exits_with_the_apps_status() {
    let dir = scratch();
    let cfg = write_config(
        dir.path(),
        &json!({"version": 1, "app": {"command": ["/bin/sh", "-c", "exit 42"], "user": 0}}),
    );
    let (st, console) = Running::ordinary(&cfg).wait();
    assert_eq!(st.code(), Some(42), "{console}");
    assert!(console.contains("app exited status=42"));

    let cfg = write_config(
        dir.path(),
        &json!({"version": 1, "app": {"command": ["/bin/sh", "-c", "kill -USR2 $$"], "user": 0}}),
    );
    let (st, console) = Running::ordinary(&cfg).wait();
    assert_eq!(st.code(), Some(128 + libc::SIGUSR2), "{console}");
    assert!(console.contains("app killed signal=SIGUSR2"));
}

#[test]
fn sigterm_to_guest_init_terminates_the_app() {
    let dir = scratch();
    let d = dir.path().display();
    let script = write_script(
        dir.path(),
        "app.sh",
        &format!("trap 'echo term >> {d}/app.term; sleep 0.3; exit 5' TERM\necho up > {d}/up\nwhile :; do sleep 0.05; done"),
    );
    let cfg = write_config(
        dir.path(),
        &json!({"version": 1, "app": {"command": [script], "user": 0}}),
    );
    let run = Running::ordinary(&cfg);
    wait_for_file(&dir.path().join("up"));
    run.signal(Signal::SIGTERM);
    let (st, console) = run.wait();
    assert_eq!(read(&dir.path().join("app.term")), "term", "{console}");
    assert_eq!(
        st.code(),
        Some(5),
        "guest-init must exit with the app's status: {console}"
    );
    assert!(console.contains("shutdown: signal SIGTERM"));
}

#[test]
fn orphans_come_to_the_subreaper_and_are_reaped() {
    let dir = scratch();
    let d = dir.path().display();
    // The orphan outlives its parent shell and then records who its parent became.
    let script = write_script(
        dir.path(),
        "app.sh",
        &format!(
            "(sh -c 'sleep 0.5; cut -d\" \" -f4 /proc/$$/stat > {d}/ppid' &)\nwhile [ ! -s {d}/ppid ]; do sleep 0.05; done\nsleep 0.2"
        ),
    );
    let cfg = write_config(
        dir.path(),
        &json!({"version": 1, "log_level": "debug", "app": {"command": [script], "user": 0}}),
    );
    let run = Running::ordinary(&cfg);
    let me = run.guest_init_pid();
    let (st, console) = run.wait();
    assert_eq!(st.code(), Some(0), "{console}");
    assert_eq!(
        read(&dir.path().join("ppid")),
        me.to_string(),
        "the orphan was not re-parented to guest-init"
    );
    assert!(
        console.contains("reaped pid="),
        "the orphan was not reaped: {console}"
    );
}

/// Threat: the app must not keep any of PID 1's privileges. Each property is read back
/// from the kernel's view of the running app (`/proc/self/status`).
#[test]
fn the_app_runs_as_its_user_without_capabilities() {
    if !require(
        nix::unistd::geteuid().is_root(),
        "changing users needs root",
    ) {
        return;
    }
    let dir = scratch();
    let d = dir.path().display();
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    nix::unistd::chown(&work, Some(nix::unistd::Uid::from_raw(20001)), None).unwrap();
    let script = write_script(
        dir.path(),
        "app.sh",
        &format!("cat /proc/self/status > {d}/status.tmp; env > {d}/env.tmp; pwd > {d}/pwd.tmp; cut -d' ' -f5 /proc/$$/stat > {d}/pgid.tmp; echo $$ > {d}/pid.tmp"),
    );
    // The app writes into the scratch dir (mode 0777) as uid 20001.
    let cfg = write_config(
        dir.path(),
        &json!({"version": 1, "app": {
            "command": [script], "user": 20001, "group": 20001,
            "supplementary_groups": [20005, "20006"],
            "env": {"GREETING": "hello"}, "workdir": work
        }}),
    );
    let (st, console) = Running::ordinary(&cfg).wait();
    assert_eq!(st.code(), Some(0), "{console}");
    let status = read(&dir.path().join("status.tmp"));
    let field = |name: &str| -> String {
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap_or_else(|| panic!("no {name} in\n{status}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(field("Uid"), "20001 20001 20001 20001");
    assert_eq!(field("Gid"), "20001 20001 20001 20001");
    assert_eq!(field("Groups"), "20005 20006");
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(field(set), "0000000000000000", "{set} not empty");
    }
    assert_eq!(field("NoNewPrivs"), "1");
    let env = read(&dir.path().join("env.tmp"));
    assert!(env.lines().any(|l| l == "GREETING=hello"), "{env}");
    assert!(
        env.lines().any(|l| l.starts_with("PATH=/usr/local/sbin:")),
        "{env}"
    );
    assert!(
        !env.lines()
            .any(|l| l.starts_with("CARGO") || l.starts_with("HOME=")),
        "guest-init's own environment leaked into the app:\n{env}"
    );
    assert_eq!(
        read(&dir.path().join("pwd.tmp")),
        work.display().to_string()
    );
    // Its own session: its process group id is its pid.
    let pid = read(&dir.path().join("pid.tmp"));
    let pgid = read(&dir.path().join("pgid.tmp"));
    assert_eq!(
        pgid, pid,
        "the app is not the leader of its own process group"
    );
}

#[test]
fn the_app_is_restarted_on_failure_with_a_limit() {
    let dir = scratch();
    let d = dir.path().display();
    // Fails twice, then succeeds: three runs, and guest-init ends with status 0.
    let script = write_script(
        dir.path(),
        "app.sh",
        &format!("echo run >> {d}/runs\n[ $(wc -l < {d}/runs) -ge 3 ] && exit 0\nexit 9"),
    );
    let restart = json!({"policy": "on-failure", "max_restarts": 5, "initial_backoff_ms": 10, "max_backoff_ms": 40});
    let cfg = write_config(
        dir.path(),
        &json!({"version": 1, "app": {"command": [script], "user": 0, "restart": restart}}),
    );
    let (st, console) = Running::ordinary(&cfg).wait();
    assert_eq!(st.code(), Some(0), "{console}");
    assert_eq!(read(&dir.path().join("runs")).lines().count(), 3);
    assert_eq!(
        console.matches("app failed (status=9); restart").count(),
        2,
        "{console}"
    );

    // Always failing: 1 run + max_restarts restarts, then the failure is final.
    std::fs::remove_file(dir.path().join("runs")).unwrap();
    let script = write_script(
        dir.path(),
        "fail.sh",
        &format!("echo run >> {d}/runs\nexit 9"),
    );
    let restart = json!({"policy": "on-failure", "max_restarts": 2, "initial_backoff_ms": 10, "max_backoff_ms": 40});
    let cfg = write_config(
        dir.path(),
        &json!({"version": 1, "app": {"command": [script], "user": 0, "restart": restart}}),
    );
    let (st, console) = Running::ordinary(&cfg).wait();
    assert_eq!(st.code(), Some(9), "{console}");
    assert_eq!(read(&dir.path().join("runs")).lines().count(), 3);
    assert!(console.contains("app exited status=9"));
}

#[test]
fn hup_usr1_usr2_are_forwarded_to_the_app() {
    let dir = scratch();
    let d = dir.path().display();
    let script = write_script(
        dir.path(),
        "app.sh",
        &format!(
            "trap 'echo hup >> {d}/got' HUP\ntrap 'echo usr1 >> {d}/got' USR1\ntrap 'echo usr2 >> {d}/got; exit 0' USR2\necho up > {d}/up\nwhile :; do sleep 0.05; done"
        ),
    );
    let cfg = write_config(
        dir.path(),
        &json!({"version": 1, "app": {"command": [script], "user": 0}}),
    );
    let run = Running::ordinary(&cfg);
    wait_for_file(&dir.path().join("up"));
    let got = dir.path().join("got");
    run.signal(Signal::SIGHUP);
    while !read(&got).contains("hup") {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    run.signal(Signal::SIGUSR1);
    while !read(&got).contains("usr1") {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    run.signal(Signal::SIGUSR2);
    let (st, console) = run.wait();
    assert_eq!(read(&got), "hup\nusr1\nusr2", "{console}");
    assert_eq!(
        st.code(),
        Some(0),
        "guest-init must survive the forwarded signals: {console}"
    );
}

#[test]
fn an_app_that_cannot_start_is_a_fatal_error_naming_it() {
    let dir = scratch();
    let cfg = write_config(
        dir.path(),
        &json!({"version": 1, "app": {"command": ["/nonexistent/app", "--flag"], "user": 0}}),
    );
    let (st, console) = Running::ordinary(&cfg).wait();
    assert_eq!(st.code(), Some(1), "{console}");
    assert!(
        console.contains("error: fatal: app: cannot start \"/nonexistent/app\""),
        "{console}"
    );
    assert!(console.contains("shutdown: fatal error"), "{console}");
    assert!(!console.contains("ready in"), "{console}");
}

/// During the grace period the app may still need its forwarded sockets (to finish a
/// request, to flush a last message): the forwarders stay up until the shutdown is over.
#[test]
fn forwarded_sockets_keep_working_during_the_grace_period() {
    let have_socat = std::process::Command::new("socat")
        .arg("-V")
        .stdout(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !require(
        have_socat,
        "socat is not installed (the app's socket client)",
    ) {
        return;
    }
    let dir = scratch();
    let d = dir.path().display();
    let target = dir.path().join("target.sock");
    let listener = std::os::unix::net::UnixListener::bind(&target).unwrap();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for mut c in listener.incoming().map_while(Result::ok) {
            let mut buf = [0u8; 64];
            let n = c.read(&mut buf).unwrap_or(0);
            let _ = c.write_all(b"reply to ");
            let _ = c.write_all(&buf[..n]);
        }
    });
    let script = write_script(
        dir.path(),
        "app.sh",
        &format!(
            "trap 'echo last-words | socat -t 5 - UNIX-CONNECT:{d}/app.sock > {d}/answer; exit 0' TERM\necho up > {d}/up\nwhile :; do sleep 0.05; done"
        ),
    );
    let cfg = write_config(
        dir.path(),
        &json!({"version": 1,
            "app": {"command": [script], "user": 0},
            "services": [{"name": "svc", "listen": dir.path().join("app.sock"), "target": {"unix": target}}]}),
    );
    let run = Running::ordinary(&cfg);
    wait_for_file(&dir.path().join("up"));
    run.signal(Signal::SIGTERM);
    let (st, console) = run.wait();
    assert_eq!(st.code(), Some(0), "{console}");
    assert_eq!(
        read(&dir.path().join("answer")),
        "reply to last-words",
        "{console}"
    );
}

#[test]
fn forwarding_gets_the_hard_fd_limit_and_the_app_keeps_the_original() {
    if !require(
        std::path::Path::new("/usr/bin/prlimit").exists(),
        "prlimit (util-linux)",
    ) {
        return;
    }
    let dir = scratch();
    let d = dir.path().display();
    // The app records its own limits, and its parent's (guest-init's) soft limit.
    let script = write_script(
        dir.path(),
        "app.sh",
        &format!(
            "ulimit -Sn > {d}/app.soft\nulimit -Hn > {d}/app.hard\n\
             awk '/^Max open files/ {{print $4}}' /proc/$PPID/limits > {d}/init.soft"
        ),
    );
    let cfg = write_config(
        dir.path(),
        &json!({"version": 1, "app": {"command": [script], "user": 0}}),
    );
    let (st, console) = Running::ordinary_with_nofile(&cfg, 256, 4096).wait();
    assert_eq!(st.code(), Some(0), "{console}");
    assert_eq!(
        read(&dir.path().join("init.soft")),
        "4096",
        "guest-init must lift its soft limit to the hard one for forwarding bursts: {console}"
    );
    assert_eq!(
        read(&dir.path().join("app.soft")),
        "256",
        "the app must get the limit guest-init started with"
    );
    assert_eq!(read(&dir.path().join("app.hard")), "4096");
}
