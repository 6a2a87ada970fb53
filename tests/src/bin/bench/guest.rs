//! Figures 6 and 7: what `guest-init` itself costs a VM.
//!
//! - **6, size and idle memory.** The size of the static musl binary a VM boots, and its
//!   resident memory (`VmRSS`) once it is forwarding 4 services and nothing is connected:
//!   run as an ordinary process, the four app sockets bound, 300 ms of quiet, then read
//!   `/proc/<pid>/status`.
//! - **7, start to ready.** `guest-init` as PID 1 of a fresh PID namespace with 4 services.
//!   It runs under `unshare --pid --fork --mount --propagation private --mount-proc --uts
//!   --ipc --net --kill-child`: the mount namespace is private because a PID 1 mounts what
//!   is missing (`/tmp`, `/run`...) and must never do that to the host's view, and its
//!   sockets live under `/var/tmp` because its own `/tmp` mount would hide a directory in
//!   the host's `/tmp`. Two numbers per start: the `ready in <ms> ms` that guest-init
//!   prints (measured inside, from its own start), and the time from just before the
//!   `unshare` exec to the moment that line is read here (which adds unshare's own exec
//!   and fork). The figure is the median of the repetitions.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::chain::{binaries, guest_config};
use super::paths;
use super::report::Row;
use super::stats::{median, millis};
use super::Settings;

const SERVICES: usize = 4;

fn services(dir: &Path, tag: &str) -> Vec<(String, PathBuf, PathBuf)> {
    (0..SERVICES)
        .map(|i| {
            (
                format!("svc{i}"),
                dir.join(format!("{tag}-svc{i}.sock")),
                // Nothing listens there: an idle forwarder never dials.
                dir.join(format!("{tag}-host.vsock_{}", 7001 + i)),
            )
        })
        .collect()
}

/// Figures 6 and 7.
pub fn figures(dir: &Path, s: &Settings, notes: &mut Vec<String>) -> Vec<Row> {
    let bins = match binaries() {
        Ok(b) => Some(b),
        Err(e) => {
            notes.push(format!("figures 6-7 not measured: {e}"));
            None
        }
    };
    let size = bins
        .as_ref()
        .and_then(|b| std::fs::metadata(&b.guest_init).ok())
        .map(|m| m.len() as f64 / 1e6);
    let rss = bins
        .as_ref()
        .and_then(|b| match idle_rss(&b.guest_init, dir) {
            Ok(v) => Some(v),
            Err(e) => {
                notes.push(format!("figure 6 idle RSS not measured: {e}"));
                None
            }
        });
    let (inside, outside) = match bins
        .as_ref()
        .map(|b| start_to_ready(&b.guest_init, s.starts))
    {
        Some(Ok(v)) => v,
        Some(Err(e)) => {
            notes.push(format!("figure 7 not measured: {e}"));
            (None, None)
        }
        None => (None, None),
    };
    vec![
        Row::new(
            "6",
            "guest-init musl binary size",
            "MB",
            [None, size, None, None],
        )
        .target("<= 3 MB", size.map(|v| v <= 3.0)),
        Row::new(
            "6",
            format!("guest-init idle RSS, {SERVICES} services"),
            "MiB",
            [None, rss, None, None],
        )
        .target("<= 4 MiB", rss.map(|v| v <= 4.0)),
        Row::new(
            "7",
            format!("start to ready as PID 1 (own line), median of {}", s.starts),
            "ms",
            [None, inside, None, None],
        )
        .target("<= 20 ms", inside.map(|v| v <= 20.0)),
        Row::new(
            "7",
            "start to ready, exec to line seen outside",
            "ms",
            [None, outside, None, None],
        ),
    ]
}

fn idle_rss(guest_init: &Path, dir: &Path) -> Result<f64, String> {
    let svcs = services(dir, "idle");
    let conf = dir.join("idle-guest.json");
    std::fs::write(&conf, guest_config(&svcs).to_string()).map_err(|e| e.to_string())?;
    let mut child = Command::new(guest_init)
        .arg("--config")
        .arg(&conf)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start guest-init: {e}"))?;
    let pid = child.id();
    let mut result = Ok(());
    for (_, listen, _) in &svcs {
        result =
            paths::wait_for_socket(listen, &mut child, "guest-init").map_err(|e| e.to_string());
        if result.is_err() {
            break;
        }
    }
    if result.is_ok() {
        std::thread::sleep(Duration::from_millis(300));
    }
    let rss = paths::status_kib(pid, "VmRSS");
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline && !matches!(child.try_wait(), Ok(Some(_))) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    result?;
    rss.map(|k| k as f64 / 1024.0)
        .ok_or_else(|| "VmRSS not readable".to_string())
}

/// Parses `ready in <ms> ms` out of a console line.
pub fn parse_ready(line: &str) -> Option<f64> {
    let rest = line.split("guest-init: ready in ").nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

fn start_to_ready(guest_init: &Path, n: usize) -> Result<(Option<f64>, Option<f64>), String> {
    if !e2e::util::have_program("unshare") {
        return Err("unshare (util-linux) is not installed".into());
    }
    let dir = tempfile::Builder::new()
        .prefix("bench-pid1-")
        .tempdir_in("/var/tmp")
        .map_err(|e| format!("cannot create a directory in /var/tmp: {e}"))?;
    let (mut inside, mut outside) = (Vec::new(), Vec::new());
    for i in 0..n {
        let tag = format!("s{i}");
        let conf = dir.path().join(format!("{tag}.json"));
        let svcs = services(dir.path(), &tag);
        std::fs::write(&conf, guest_config(&svcs).to_string()).map_err(|e| e.to_string())?;
        let t = Instant::now();
        let mut child = Command::new("unshare")
            .args([
                "--pid",
                "--fork",
                "--kill-child",
                "--mount",
                "--propagation",
                "private",
                "--mount-proc",
                "--uts",
                "--ipc",
                "--net",
            ])
            .arg(guest_init)
            .arg("--config")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start unshare: {e}"))?;
        let mut lines = Vec::new();
        let mut found = None;
        if let Some(err) = child.stderr.take() {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                if let Some(ms) = parse_ready(&line) {
                    found = Some((ms, millis(t.elapsed())));
                    break;
                }
                lines.push(line);
                if lines.len() > 200 {
                    break;
                }
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        match found {
            Some((own, seen)) => {
                inside.push(own);
                outside.push(seen);
            }
            None => {
                let tail: Vec<_> = lines.iter().rev().take(5).rev().cloned().collect();
                return Err(format!(
                    "guest-init as PID 1 printed no ready line; last lines: {}",
                    tail.join(" / ")
                ));
            }
        }
    }
    Ok((median(&inside), median(&outside)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_the_ready_line() {
        let l = "[    0.012345] guest-init: ready in 7.5 ms (services=4 exports=0 app_pid=9)";
        assert_eq!(super::parse_ready(l), Some(7.5));
        assert_eq!(
            super::parse_ready("[ 1.0] guest-init: ready in 12 ms (x)"),
            Some(12.0)
        );
        assert_eq!(super::parse_ready("guest-init: app exited status=0"), None);
    }
}
