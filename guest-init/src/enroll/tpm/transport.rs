//! The TPM command transport: one command written whole, one response read whole.
//!
//! The kernel's TPM character devices (`/dev/tpm0`, and `/dev/tpmrm0` behind the in-kernel
//! resource manager) take a command in a single `write(2)` and hand back the response to
//! the following `read(2)` calls. swtpm's `--server type=unixio` socket takes the same raw
//! command bytes on a stream. [`Tpm`] speaks to any `Read + Write` stream, so the same code
//! runs against `/dev/tpmrm0` in the VM and against swtpm's socket in host-side tests.
//!
//! The response is read by its header: ten bytes (tag, size, response code), then exactly
//! `size - 10` more. A size below ten or above [`MAX_RESPONSE`] is a malformed response,
//! not something to allocate for. A response code other than success is returned as
//! [`TransportError::Rc`] with its raw value, so callers can tell "this blob belongs to
//! another TPM" (`TPM_RC_INTEGRITY`) from other failures.
//!
//! Threat: a misbehaving or hostile TPM device answering with a bogus length (bounded),
//! or a short read/write silently truncating a command (each is an error).

use std::io::{self, Read, Write};

/// The largest response accepted (TPM 2.0's `MAX_RESPONSE_SIZE` is 4096 on every TPM
/// the kernel drivers support; swtpm uses 4096).
pub const MAX_RESPONSE: usize = 4096;

const HEADER: usize = 10;

/// A transport failure or a TPM error response.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// Reading or writing the device failed.
    #[error("TPM I/O: {0}")]
    Io(#[from] io::Error),
    /// The response was malformed.
    #[error("malformed TPM response: {0}")]
    Malformed(String),
    /// The TPM answered with an error code.
    #[error("TPM error {name} (0x{raw:03x})")]
    Rc {
        /// The raw response code.
        raw: u32,
        /// Its name, as the protocol crate spells it.
        name: String,
    },
}

impl TransportError {
    /// Whether this is `TPM_RC_INTEGRITY` (format 1, error 0x1F): a wrapped private blob
    /// whose integrity check failed under the parent, i.e. a blob made by another TPM (or
    /// under another storage key) or altered on disk.
    pub fn is_integrity(&self) -> bool {
        matches!(self, TransportError::Rc { raw, .. } if raw & 0x80 != 0 && raw & 0x3f == 0x1f)
    }
}

/// A TPM reached through a byte stream.
pub struct Tpm<S> {
    stream: S,
}

impl<S: Read + Write> Tpm<S> {
    /// Wraps an open stream (the device file, or a socket to swtpm).
    pub fn new(stream: S) -> Tpm<S> {
        Tpm { stream }
    }

    /// Sends one command and returns the whole response (header included) when its
    /// response code is success.
    pub fn transact(&mut self, command: &[u8]) -> Result<Vec<u8>, TransportError> {
        // One write: the kernel driver takes a command in a single write(2) and refuses
        // (or truncates) anything else.
        let n = self.stream.write(command)?;
        if n != command.len() {
            return Err(TransportError::Io(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("short write to the TPM ({n} of {} bytes)", command.len()),
            )));
        }
        self.stream.flush()?;
        let mut buf = vec![0u8; MAX_RESPONSE];
        let mut have = 0;
        let mut want = HEADER;
        while have < want {
            let n = self.stream.read(&mut buf[have..])?;
            if n == 0 {
                return Err(TransportError::Malformed(format!(
                    "the TPM closed after {have} of {want} response bytes"
                )));
            }
            have += n;
            if want == HEADER && have >= HEADER {
                want = u32::from_be_bytes([buf[2], buf[3], buf[4], buf[5]]) as usize;
                if !(HEADER..=MAX_RESPONSE).contains(&want) {
                    return Err(TransportError::Malformed(format!(
                        "response size {want} outside {HEADER}..={MAX_RESPONSE}"
                    )));
                }
            }
        }
        if have != want {
            return Err(TransportError::Malformed(format!(
                "{} bytes after the {want}-byte response",
                have - want
            )));
        }
        buf.truncate(want);
        let raw = u32::from_be_bytes([buf[6], buf[7], buf[8], buf[9]]);
        if raw != 0 {
            let name = tpm2_protocol::data::TpmRc::try_from(raw)
                .map(|rc| rc.to_string())
                .unwrap_or_else(|_| "unknown".into());
            return Err(TransportError::Rc { raw, name });
        }
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scripted peer: what it will answer, and what it was sent.
    struct Script {
        answer: io::Cursor<Vec<u8>>,
        sent: Vec<u8>,
    }

    impl Read for Script {
        fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
            // One byte at a time: the reader must reassemble.
            let n = b.len().min(1);
            self.answer.read(&mut b[..n])
        }
    }
    impl Write for Script {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.sent.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn tpm(answer: &[u8]) -> Tpm<Script> {
        Tpm::new(Script {
            answer: io::Cursor::new(answer.to_vec()),
            sent: Vec::new(),
        })
    }

    #[test]
    fn responses_are_reassembled_by_their_size() {
        let ok = [0x80, 0x01, 0, 0, 0, 12, 0, 0, 0, 0, 0xaa, 0xbb, 0xff];
        let mut t = tpm(&ok);
        assert_eq!(t.transact(b"cmd").unwrap(), ok[..12].to_vec());
        assert_eq!(t.stream.sent, b"cmd");
    }

    #[test]
    fn bad_sizes_and_short_responses_are_errors() {
        let huge = [0x80, 0x01, 0, 1, 0, 1, 0, 0, 0, 0];
        assert!(matches!(
            tpm(&huge).transact(b"x"),
            Err(TransportError::Malformed(_))
        ));
        let tiny = [0x80, 0x01, 0, 0, 0, 9, 0, 0, 0, 0];
        assert!(matches!(
            tpm(&tiny).transact(b"x"),
            Err(TransportError::Malformed(_))
        ));
        let short = [0x80, 0x01, 0, 0, 0, 20, 0, 0, 0, 0];
        assert!(matches!(
            tpm(&short).transact(b"x"),
            Err(TransportError::Malformed(_))
        ));
    }

    #[test]
    fn error_codes_are_named_and_integrity_is_recognised() {
        // TPM_RC_INTEGRITY on parameter 1: 0x19f.
        let e = tpm(&[0x80, 0x01, 0, 0, 0, 10, 0, 0, 0x01, 0x9f])
            .transact(b"x")
            .unwrap_err();
        assert!(e.is_integrity(), "{e}");
        // TPM_RC_FAILURE (0x101) is not.
        let e = tpm(&[0x80, 0x01, 0, 0, 0, 10, 0, 0, 0x01, 0x01])
            .transact(b"x")
            .unwrap_err();
        assert!(!e.is_integrity(), "{e}");
    }
}
