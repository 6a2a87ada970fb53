//! guest-init's control-port request line (`stop`, `ping`, anything else).
//!
//! Asserts: only the exact bytes `stop` (or `stop\r`) stop the VM, only `ping` (or
//! `ping\r`) pings; everything else, however close, is `Unknown`; no panic.
#![no_main]

use guest_init::control::{parse, Command};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let got = parse(data);
    let want = match data {
        b"stop" | b"stop\r" => Command::Stop,
        b"ping" | b"ping\r" => Command::Ping,
        _ => Command::Unknown,
    };
    assert_eq!(got, want, "{data:?}");
    // As the server reads it: the line is what precedes the first newline.
    let line = data.split(|&b| b == b'\n').next().unwrap_or_default();
    if parse(line) == Command::Stop {
        assert!(line == b"stop" || line == b"stop\r");
    }
});
