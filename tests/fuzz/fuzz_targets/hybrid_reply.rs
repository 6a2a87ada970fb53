//! vm-transport's hybrid-vsock `CONNECT` reply parser (`OK <port>\n` from the VMM).
//!
//! Input: the bytes the VMM sends; as the client does, the reply is what precedes the
//! first `\n` (bytes after it belong to the guest and are never judged). Asserts: `Ok`
//! exactly when the line starts with `OK ` and is at most `MAX_REPLY` bytes; any other
//! short reply is a final refusal (`PermissionDenied`, never retried), an over-long one
//! `InvalidData`; the error names the port; no panic.
#![no_main]

use std::io::ErrorKind;

use libfuzzer_sys::fuzz_target;
use vm_transport::hybrid::{parse_reply, MAX_REPLY};

fuzz_target!(|data: &[u8]| {
    let line = data.split(|&b| b == b'\n').next().unwrap_or_default();
    let port = 5000 + line.len() as u32;
    match parse_reply(line, port) {
        Ok(()) => assert!(line.starts_with(b"OK ") && line.len() <= MAX_REPLY),
        Err(e) => {
            if line.len() > MAX_REPLY {
                assert_eq!(e.kind(), ErrorKind::InvalidData);
            } else {
                assert!(!line.starts_with(b"OK "));
                assert_eq!(e.kind(), ErrorKind::PermissionDenied);
            }
            assert!(e.to_string().contains(&format!("CONNECT {port}")));
        }
    }
});
