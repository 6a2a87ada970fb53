//! The agent's request: the framing (`guest_init::agent::ops::LineReader`) and the parser
//! (`guest_init::agent::ops::Op::parse`), as `agent::serve` runs them on a client's stream.
//!
//! Input: byte 0 picks the read size (0: the whole stream in one read, else 1..=255 bytes
//! per read), byte 1 the line limit (0: the agent's `MAX_REQUEST`, else 1..=255 bytes, so
//! short inputs reach the limit); the rest is what the client sends after the handshake.
//! Asserts: the framing does not depend on how the stream is cut (the same line or the
//! same refusal as one read); a line is the stream's bytes before its first `\n`, and it
//! is given exactly when line plus newline fit the limit, refused exactly when they do not,
//! pending only when neither is known yet. A parsed request is version 1, an `exec` has an
//! absolute `argv[0]`, no NUL in any argument and a deadline of 1..=600,000 ms or none; it
//! serializes and parses back to the same request. A refusal says what was wrong: it is
//! "not a request" or names the field (`v`, `argv`, `deadline_ms`), and is bounded.
#![no_main]

use guest_init::agent::ops::{LineReader, Op, MAX_DEADLINE, MAX_REQUEST, VERSION};
use libfuzzer_sys::fuzz_target;

fn frame(stream: &[u8], limit: usize, step: usize) -> Result<Option<Vec<u8>>, String> {
    let mut r = LineReader::new(limit);
    for piece in stream.chunks(step.max(1)) {
        if let Some(line) = r.push(piece)? {
            return Ok(Some(line));
        }
    }
    Ok(None)
}

fn check_request(line: &[u8]) {
    match Op::parse(line) {
        Ok(op) => {
            let v = match &op {
                Op::Status { v } | Op::Stop { v } => *v,
                Op::Exec {
                    v,
                    user: _,
                    argv,
                    deadline_ms,
                } => {
                    assert!(argv.first().is_some_and(|a| a.starts_with('/')));
                    assert!(argv.iter().all(|a| !a.contains('\0')));
                    assert!(deadline_ms
                        .is_none_or(|d| (1..=MAX_DEADLINE.as_millis() as u64).contains(&d)));
                    *v
                }
            };
            assert_eq!(v, VERSION);
            assert!(["status", "stop", "exec"].contains(&op.name()));
            let again = serde_json::to_vec(&op).expect("a request serializes");
            assert_eq!(
                Op::parse(&again).as_ref(),
                Ok(&op),
                "{op:?} did not parse back"
            );
        }
        Err(e) => {
            assert!(
                e.starts_with("not a request: ")
                    || e.starts_with("v: ")
                    || e.starts_with("argv: ")
                    || e.starts_with("deadline_ms: "),
                "{e}"
            );
            assert!(
                e.len() <= 512 + line.len().min(512),
                "{} bytes: {e}",
                e.len()
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let [step, limit, stream @ ..] = data else {
        return;
    };
    let limit = match *limit {
        0 => MAX_REQUEST,
        l => l as usize,
    };
    let whole = frame(stream, limit, stream.len());
    if *step != 0 {
        assert_eq!(frame(stream, limit, *step as usize), whole, "cut at {step}");
    }
    let newline = stream.iter().position(|&b| b == b'\n');
    match (&whole, newline) {
        (Ok(Some(line)), Some(i)) => {
            assert_eq!(&line[..], &stream[..i]);
            assert!(i < limit);
        }
        (Err(e), Some(i)) => {
            assert!(i >= limit, "{e}");
            assert!(e.contains(&format!("longer than {limit} bytes")), "{e}");
        }
        (Err(_), None) => assert!(stream.len() >= limit),
        (Ok(None), None) => assert!(stream.len() < limit),
        (got, n) => panic!("{got:?} for a stream whose newline is at {n:?}"),
    }
    if let Ok(Some(line)) = whole {
        check_request(&line);
    }
});
