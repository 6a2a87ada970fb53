//! Forwarding through the real `guest-init` binary, run as an ordinary process (a
//! subreaper supervisor) with Unix-socket targets standing in for vsock: the
//! configuration's `services` reach the forwarder, the ready line comes after the
//! listeners are up, bytes arrive exactly, bursts are served, dead and late targets are
//! handled, and the socket is removed when guest-init ends.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::forward::*;
use serde_json::json;

/// guest-init with its console (stderr) captured; killed if still running when dropped.
struct GuestInit {
    child: Child,
    console: Arc<Mutex<Vec<String>>>,
}

impl GuestInit {
    fn start(config: &Path) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_guest-init"))
            .arg("--config")
            .arg(config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn guest-init");
        let console = Arc::new(Mutex::new(Vec::new()));
        let lines = Arc::clone(&console);
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(stderr).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(l);
            }
        });
        GuestInit { child, console }
    }

    fn console(&self) -> String {
        self.console.lock().unwrap().join("\n")
    }

    async fn wait_line(&mut self, what: &str, want: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + HANG;
        loop {
            if let Some(l) = self.console.lock().unwrap().iter().find(|l| want(l)) {
                return l.clone();
            }
            let ended = self.child.try_wait().unwrap();
            if ended.is_some() || Instant::now() >= deadline {
                // Let the reader take the last lines.
                tokio::time::sleep(Duration::from_millis(100)).await;
                panic!(
                    "no console line {what} (guest-init ended: {ended:?}); console:\n{}",
                    self.console()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for GuestInit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_forwards_bytes_bursts_dead_and_late_targets() {
    if !require(is_root(), "root, to run the app as uid 20001") {
        return;
    }
    vm_transport::fdlimit::raise_fd_limit().unwrap();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = dir.path();
    let (data_app, data_host) = (d.join("run/data.sock"), d.join("host-data.sock"));
    let (dead_app, dead_host) = (d.join("run/dead.sock"), d.join("host-dead.sock"));
    let (late_app, late_host) = (d.join("run/late.sock"), d.join("host-late.sock"));
    spawn_echo_server(&unix(&data_host));
    let config = json!({
        "version": 1,
        "app": {"command": ["/bin/sleep", "600"], "user": "20001", "group": "20001"},
        "services": [
            {"name": "data", "listen": data_app, "target": {"unix": data_host}},
            {"name": "dead", "listen": dead_app, "target": {"unix": dead_host},
             "dial": {"attempts": 3, "backoff_initial_ms": 5, "backoff_max_ms": 10}},
            {"name": "late", "listen": late_app, "target": {"unix": late_host}}
        ]
    });
    let cfg_path = d.join("guest-init.json");
    std::fs::write(&cfg_path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    let mut gi = GuestInit::start(&cfg_path);
    let ready = gi
        .wait_line("saying ready", |l| l.contains("guest-init: ready in "))
        .await;
    assert!(ready.contains("services=3"), "{ready}");
    // The ready line is truthful: the listeners were up before it.
    for (p, name) in [
        (&data_app, "data"),
        (&dead_app, "dead"),
        (&late_app, "late"),
    ] {
        assert!(p.exists(), "{} missing after ready", p.display());
        let console = gi.console();
        let up = console
            .find(&format!(
                "service {name}: listening at unix:{}",
                p.display()
            ))
            .unwrap_or_else(|| panic!("no listener line for {name}:\n{console}"));
        assert!(up < console.find("ready in ").unwrap(), "{console}");
    }

    // Byte-exactness: random data of random sizes, both directions at once, 8 connections.
    let mut tasks = Vec::new();
    for i in 0..8u64 {
        let app = unix(&data_app);
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(0xb1a5 + i);
            let len = rng.below(1 << 20) as usize;
            let data = rng.bytes(len);
            let c = app.connect().await.unwrap();
            let (_, back) = tokio::join!(
                async {
                    let mut off = 0;
                    for n in rng.chunks(data.len()) {
                        c.write_all(&data[off..off + n]).await.unwrap();
                        off += n;
                    }
                    c.shutdown_write().unwrap();
                },
                read_all(&c)
            );
            let back = back.unwrap();
            assert_eq!(back.len(), data.len(), "connection {i}: length");
            assert!(back == data, "connection {i}: bytes differ");
        }));
    }
    for t in tasks {
        guard("byte-exact client", t).await.unwrap();
    }

    // A burst of 1,000 connections open at the same time.
    const N: usize = 1000;
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let mut tasks = Vec::new();
    for i in 0..N {
        let (app, barrier) = (unix(&data_app), Arc::clone(&barrier));
        tasks.push(tokio::spawn(async move {
            let c = app.connect().await.map_err(|e| format!("{i}: {e}"))?;
            let msg = format!("burst {i:04}");
            c.write_all(msg.as_bytes())
                .await
                .map_err(|e| format!("{i}: {e}"))?;
            let mut buf = [0u8; 32];
            let mut got = Vec::new();
            while got.len() < msg.len() {
                match c.read(&mut buf).await {
                    Ok(0) => return Err(format!("{i}: closed early")),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) => return Err(format!("{i}: {e}")),
                }
            }
            barrier.wait().await;
            (got == msg.as_bytes())
                .then_some(())
                .ok_or(format!("{i}: wrong echo"))
        }));
    }
    let mut failed = Vec::new();
    for t in tasks {
        if let Err(e) = guard("burst", t).await.unwrap() {
            failed.push(e);
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {N} failed, e.g. {:?}",
        failed.len(),
        failed.first()
    );

    // A dead target: the caller is closed, one line names the service and the target.
    let c = unix(&dead_app).connect().await.unwrap();
    c.write_all(b"x").await.unwrap();
    assert!(guard("dead target", closed(&c)).await);
    let line = gi
        .wait_line("about the dead target", |l| {
            l.contains("service dead: cannot reach")
        })
        .await;
    assert!(
        line.contains(&format!("unix:{}", dead_host.display())),
        "{line}"
    );
    // ...and once the target is up, the same listener serves.
    spawn_echo_server(&unix(&dead_host));
    let c = unix(&dead_app).connect().await.unwrap();
    c.write_all(b"up now").await.unwrap();
    c.shutdown_write().unwrap();
    assert_eq!(guard("revived", read_all(&c)).await.unwrap(), b"up now");

    // A late target: up 300 ms after the app connected; the retry reaches it.
    let c = unix(&late_app).connect().await.unwrap();
    let host = unix(&late_host);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        spawn_echo_server(&host);
    });
    c.write_all(b"patience").await.unwrap();
    c.shutdown_write().unwrap();
    assert_eq!(guard("late", read_all(&c)).await.unwrap(), b"patience");

    // guest-init ends on SIGTERM and removes the sockets it created.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(gi.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let deadline = Instant::now() + HANG;
    while gi.child.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "guest-init did not end:\n{}",
            gi.console()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for p in [&data_app, &dead_app, &late_app] {
        assert!(
            !p.exists(),
            "{} left behind; console:\n{}",
            p.display(),
            gi.console()
        );
    }
}
