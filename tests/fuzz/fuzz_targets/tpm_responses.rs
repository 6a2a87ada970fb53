//! What the TPM answers (`/dev/tpmrm0` in the VM): the transport
//! (`guest_init::enroll::tpm::transport::Tpm::transact`) and the response parsers of the
//! five commands (`guest_init::enroll::tpm::commands`), driven in the order the TPM store
//! uses them: generate (CreatePrimary, Create, FlushContext), then load and sign
//! (CreatePrimary, Load, Sign, FlushContext twice).
//!
//! Input: byte 0 is the size of each `read(2)` the device answers (0: 4096), then the
//! device's responses, one per command, each as a big-endian `u16` length and that many
//! bytes (a device answers a command's reads with that command's response only; once it is
//! read out, reads return 0). Asserts: no panic and no unbounded allocation, whatever the
//! device says; an error answer is `Rc` with a non-zero code; a key the store would accept
//! (`signing_point` is `Ok`) is written as a blob that reads back as the same public area
//! and private; a signature is returned only as a DER `SEQUENCE` of at most 72 bytes.
#![no_main]

use std::io::{self, Read, Write};

use guest_init::enroll::tpm::commands;
use guest_init::enroll::tpm::transport::{Tpm, TransportError};
use libfuzzer_sys::fuzz_target;

/// A device answering from the input.
struct Device<'a> {
    rest: &'a [u8],
    current: &'a [u8],
    step: usize,
}

impl Write for Device<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        // A new command: its response is the next one in the input (or nothing).
        self.current = match self.rest {
            [hi, lo, tail @ ..] => {
                let n = (u16::from_be_bytes([*hi, *lo]) as usize).min(tail.len());
                let (r, t) = tail.split_at(n);
                self.rest = t;
                r
            }
            _ => &[],
        };
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for Device<'_> {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        let n = b.len().min(self.step).min(self.current.len());
        b[..n].copy_from_slice(&self.current[..n]);
        self.current = &self.current[n..];
        Ok(n)
    }
}

fn checked<T>(r: Result<T, TransportError>) -> Option<T> {
    match r {
        Ok(t) => Some(t),
        Err(TransportError::Rc { raw, name }) => {
            assert_ne!(raw, 0);
            assert!(!name.is_empty());
            None
        }
        Err(TransportError::Malformed(m)) => {
            assert!(m.len() < 4096, "{} bytes", m.len());
            None
        }
        Err(TransportError::Io(e)) => panic!("the device never fails I/O: {e}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let [step, rest @ ..] = data else {
        return;
    };
    let step = if *step == 0 { 4096 } else { *step as usize };
    let mut tpm = Tpm::new(Device {
        rest,
        current: &[],
        step,
    });
    // generate
    let Some(primary) = checked(commands::create_primary(&mut tpm)) else {
        return;
    };
    let created = checked(commands::create_signing_key(&mut tpm, primary));
    checked(commands::flush(&mut tpm, primary));
    let Some((private, public)) = created else {
        return;
    };
    let Some(point) = checked(commands::signing_point(&public)) else {
        return;
    };
    assert_eq!((point.len(), point[0]), (65, 4));
    let blob = commands::marshal_blob(&public, &private).expect("an accepted key marshals");
    let (public2, private2) = commands::unmarshal_blob(&blob).expect("a written blob reads back");
    assert_eq!(public2, public);
    assert_eq!(private2, private);
    assert_eq!(commands::signing_point(&public2).unwrap(), point);
    // load and sign
    let Some(primary) = checked(commands::create_primary(&mut tpm)) else {
        return;
    };
    if let Some(key) = checked(commands::load(&mut tpm, primary, &private2, &public2)) {
        if let Some((r, s)) = checked(commands::sign(&mut tpm, key, &[7u8; 32])) {
            if let Some(der) = checked(commands::signature_der(&r, &s)) {
                assert_eq!(der[0], 0x30);
                assert!((8..=72).contains(&der.len()), "{} bytes", der.len());
            }
        }
        checked(commands::flush(&mut tpm, key));
    }
    checked(commands::flush(&mut tpm, primary));
});
