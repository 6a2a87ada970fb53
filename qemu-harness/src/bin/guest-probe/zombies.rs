//! `zombies N`: makes N orphans that die at once, so PID 1 has zombies to reap, then
//! watches `/proc` until none is left (or 30 s pass). Kept apart from `guest-probe.rs` to
//! keep each file short.

use std::time::{Duration, Instant};

use super::say;

fn count_zombie_orphans() -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return usize::MAX;
    };
    dir.filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|stat| {
            // "pid (comm) S ppid ...": fields after the last ')'.
            let rest = stat.rsplit(')').next().unwrap_or("");
            let mut f = rest.split_whitespace();
            f.next() == Some("Z") && f.next() == Some("1")
        })
        .count()
}

pub(super) fn zombies(n: usize) -> bool {
    // A child forks N grandchildren that exit at once, then exits itself: the grandchildren
    // are re-parented to PID 1 and stay zombies until it reaps them.
    // SAFETY: fork in a process whose other threads do nothing (none were started yet); the
    // child calls only async-signal-safe functions (fork, _exit) before exiting.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        for _ in 0..n {
            // SAFETY: as above.
            unsafe {
                if libc::fork() == 0 {
                    libc::_exit(0);
                }
            }
        }
        // Give the grandchildren time to exit so they are zombies when orphaned.
        // SAFETY: usleep and _exit are async-signal-safe.
        unsafe {
            libc::usleep(200_000);
            libc::_exit(0);
        }
    }
    if pid < 0 {
        say!("zombies fork failed");
        return false;
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    say!("zombies made {n} orphans");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = count_zombie_orphans();
        if left == 0 {
            say!("zombies left 0 (all reaped by PID 1)");
            return true;
        }
        if Instant::now() > deadline {
            say!("zombies left {left} after 30 s");
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
