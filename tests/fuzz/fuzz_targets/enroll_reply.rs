//! guest-init's reading of the enrollment service's answer line (protocol v1).
//!
//! Input: the answer line (without its newline; `protocol::read_line` caps it at
//! `MAX_LINE`). Asserts, beyond "no panic":
//! - a certificate comes back only from a well-formed version-1 `"status":"ok"` answer,
//!   and it is exactly the base64-decoded `certificate`;
//! - a final error only from a version-1 `"status":"error"` answer whose code is not
//!   retryable (`unavailable`, `timeout`, `busy`), with that code (`unknown` if absent or
//!   new) and a message that is a prefix of the service's, at most 300 bytes;
//! - everything else (not JSON, another version, a missing certificate) is retryable.
#![no_main]

use base64::Engine;
use guest_init::enroll::client::{parse_answer, AttemptError};
use guest_init::enroll::protocol::{ErrorCode, Response, Status, MAX_LINE};
use libfuzzer_sys::fuzz_target;
use vm_transport::Endpoint;

fuzz_target!(|data: &[u8]| {
    if data.len() >= MAX_LINE {
        return;
    }
    let service = Endpoint::Unix("/run/enroll.sock".into());
    let got = parse_answer(data, &service);
    let resp: Option<Response> = serde_json::from_slice(data).ok();
    match got {
        Ok(cert) => {
            let r = resp.expect("a certificate from an answer that is not protocol JSON");
            assert_eq!(r.v, 1);
            assert_eq!(r.status, Status::Ok);
            let b64 = r.certificate.expect("a certificate from an ok without one");
            let want = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .unwrap();
            assert_eq!(cert, want);
        }
        Err(AttemptError::Final { code, message }) => {
            let r = resp.expect("a final error from an answer that is not protocol JSON");
            assert_eq!(r.v, 1);
            assert_eq!(r.status, Status::Error);
            assert!(!code.retryable());
            assert_eq!(code, r.code.unwrap_or(ErrorCode::Unknown));
            assert!(message.len() <= 300);
            assert!(r.message.unwrap_or_default().starts_with(&message));
        }
        Err(AttemptError::Retryable(why)) => {
            assert!(why.len() < 4096, "an unbounded retry message");
            if let Some(r) = resp {
                let retryable_code =
                    r.status == Status::Error && r.code.unwrap_or(ErrorCode::Unknown).retryable();
                assert!(
                    r.v != 1 || retryable_code || (r.status == Status::Ok),
                    "a well-formed final answer was treated as retryable"
                );
            }
        }
    }
});
