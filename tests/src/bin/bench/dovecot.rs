//! Figure 5: real sign-ins against a real Dovecot, the way Radicale makes them.
//!
//! Dovecot 2.3 is the tests' own fixture ([`e2e::dovecot::Dovecot`]), listening on its
//! `auth-client` socket with the fixture's user `alice`.
//! One sign-in is what Radicale 3.9's dovecot backend does per HTTP request: connect,
//! read the greeting up to `DONE`, send `VERSION` and `CPID`, send one
//! `AUTH ... PLAIN service=radicale rip=127.0.0.1 resp=<base64>` line, read the `OK`
//! line, close. The password is a benchmark-only constant for a throwaway user, never a
//! real secret, and it is not printed.
//!
//! Only correct passwords are sent: a failure would add Dovecot's 2 s failure delay and
//! measure that instead of the path.

use std::io::{self, Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;

use super::echo::connect;

fn read_until(s: &mut impl Read, buf: &mut Vec<u8>, end: &[u8]) -> io::Result<()> {
    let mut chunk = [0u8; 1024];
    while !buf.windows(end.len()).any(|w| w == end) {
        match s.read(&mut chunk)? {
            0 => return Err(io::Error::other("auth server closed the connection early")),
            n => buf.extend_from_slice(&chunk[..n]),
        }
    }
    Ok(())
}

/// One Radicale-style sign-in through `socket`; `Ok` only when Dovecot said `OK`.
pub fn sign_in(socket: &Path) -> io::Result<()> {
    let mut s = connect(socket, Duration::from_secs(10))?;
    let mut greeting = Vec::new();
    read_until(&mut s, &mut greeting, b"DONE\n")?;
    s.write_all(format!("VERSION\t1\t1\nCPID\t{}\n", std::process::id()).as_bytes())?;
    let resp = base64::engine::general_purpose::STANDARD.encode(b"\0alice\0secret123");
    s.write_all(
        format!("AUTH\t1\tPLAIN\tservice=radicale\trip=127.0.0.1\tresp={resp}\n").as_bytes(),
    )?;
    let mut reply = Vec::new();
    read_until(&mut s, &mut reply, b"\n")?;
    if reply.starts_with(b"OK\t1\t") {
        Ok(())
    } else {
        let line = String::from_utf8_lossy(&reply);
        let first = line.split('\t').next().unwrap_or("");
        Err(io::Error::other(format!(
            "sign-in refused: Dovecot answered {first:?}"
        )))
    }
}

/// `n` sign-ins; milliseconds per sign-in.
pub fn sign_ins(socket: &Path, n: usize) -> io::Result<Vec<f64>> {
    sign_in(socket)?;
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        sign_in(socket)?;
        samples.push(super::stats::millis(t.elapsed()));
    }
    Ok(samples)
}
