//! `write-and-wait PATH SIZE [--ignore-term]`: the careless app of the data-safety tests.
//!
//! It writes SIZE bytes of [`pattern`] to PATH with plain `write` calls and **no**
//! `fsync`, says so, and then waits. The bytes sit in the guest's page cache until someone
//! writes them back: only guest-init's `sync` and read-only remount at shutdown put them on
//! the disk before the power goes, which is what the tests check from the host.
//!
//! On SIGTERM it says `write-and-wait got SIGTERM` and exits 0. With `--ignore-term` it
//! says `write-and-wait got SIGTERM; ignoring it` and keeps waiting, so guest-init must
//! SIGKILL it after the grace period.

use std::io::Write;

use super::{say, wait_term};

/// The content at `len` bytes: `i * 31 + 7 (mod 251)` for byte `i`. 251 is prime, so the
/// sequence does not repeat on page or block boundaries, and a block from elsewhere in the
/// file (or zeros) does not match. The tests compute the same bytes on the host.
pub(super) fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + 7) % 251) as u8).collect()
}

/// Writes the file and waits as described above. Returns whether the write worked (it
/// only returns on SIGTERM without `--ignore-term`, or on a failed write).
pub(super) fn run(path: &str, size: usize, ignore_term: bool) -> bool {
    let data = pattern(size);
    let written = std::fs::File::create(path).and_then(|mut f| {
        for chunk in data.chunks(64 * 1024) {
            f.write_all(chunk)?;
        }
        Ok(())
    });
    if let Err(e) = written {
        say!("write-and-wait cannot write {path}: {e}");
        return false;
    }
    say!("write-and-wait wrote {size} bytes to {path} (no fsync); waiting");
    loop {
        wait_term();
        if !ignore_term {
            say!("write-and-wait got SIGTERM");
            return true;
        }
        say!("write-and-wait got SIGTERM; ignoring it");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_is_fixed_and_does_not_repeat_per_block() {
        let p = pattern(8192);
        assert_eq!(&p[..4], &[7, 38, 69, 100]);
        assert_ne!(p[..4096], p[4096..]);
        assert_eq!(pattern(10), p[..10]);
    }
}
