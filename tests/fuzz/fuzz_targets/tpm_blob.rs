//! The TPM key blob (`TPM2B_PUBLIC || TPM2B_PRIVATE`) as the TPM store reads it from
//! `<state_dir>/<slot>.key`: `guest_init::enroll::tpm::commands::unmarshal_blob`, then
//! `signing_point`.
//!
//! Input: the file's bytes (the store reads at most 4 KiB). Asserts: no panic; a refusal is
//! a `Malformed` error; an accepted blob marshals back to exactly the input (one encoding,
//! nothing dropped), the input with any byte appended is refused (nothing may follow the
//! private part), and its public area, when it is one of our keys, gives a 65-byte SEC1
//! uncompressed point whose coordinates are the blob's.
#![no_main]

use guest_init::enroll::tpm::commands::{marshal_blob, signing_point, unmarshal_blob};
use guest_init::enroll::tpm::transport::TransportError;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match unmarshal_blob(data) {
        Err(e) => assert!(matches!(e, TransportError::Malformed(_)), "{e:?}"),
        Ok((public, private)) => {
            let again = marshal_blob(&public, &private).expect("a parsed blob marshals");
            assert_eq!(again, data, "the blob does not marshal back to itself");
            for extra in [0u8, 0xff] {
                let longer = [data, &[extra]].concat();
                assert!(
                    unmarshal_blob(&longer).is_err(),
                    "a trailing byte was accepted"
                );
            }
            if let Ok(point) = signing_point(&public) {
                assert_eq!(point.len(), 65);
                assert_eq!(point[0], 4);
                let (x, y) = (&point[1..33], &point[33..]);
                // The coordinates appear in the blob as they were (left-padded to 32).
                let strip = |c: &[u8]| c.iter().skip_while(|&&b| b == 0).count();
                assert!(strip(x) <= 32 && strip(y) <= 32);
                let body = &data[..];
                let tail_x = &x[32 - strip(x)..];
                let tail_y = &y[32 - strip(y)..];
                assert!(body
                    .windows(tail_x.len().max(1))
                    .any(|w| tail_x.is_empty() || w == tail_x));
                assert!(body
                    .windows(tail_y.len().max(1))
                    .any(|w| tail_y.is_empty() || w == tail_y));
            }
        }
    }
});
