//! `tick PATH` and `size PATH`: a job whose life the host can watch from outside.
//!
//! `tick` appends one line to PATH every 100 ms, forever (it ignores nothing: SIGKILL
//! ends it, SIGTERM too). A test runs it as an agent `exec` job and asks `size` (another
//! job) how long the file is: a file that grew between two `size` calls proves the job
//! runs, one that stopped growing proves it is gone. No `/proc` scan, no shell: what the
//! host sees is the job's own effect.

use std::io::Write;
use std::time::Duration;

use super::say;

/// Appends `tick\n` to `path` every 100 ms. Returns only if the file cannot be written.
pub(super) fn tick(path: &str) -> bool {
    let mut f = match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        Ok(f) => f,
        Err(e) => {
            say!("tick cannot open {path}: {e}");
            return false;
        }
    };
    loop {
        if let Err(e) = f.write_all(b"tick\n") {
            say!("tick cannot write {path}: {e}");
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Prints `size PATH N` (N in bytes; `size PATH missing` if there is no file).
pub(super) fn size(path: &str) -> bool {
    match std::fs::metadata(path) {
        Ok(m) => say!("size {path} {}", m.len()),
        Err(_) => say!("size {path} missing"),
    }
    true
}
