//! Figure 8: a fresh P-256 key and a certificate signing request, as enrollment makes
//! them on first boot.
//!
//! Measured with `rcgen` (its `ring` backend generates the P-256 key and signs the CSR)
//! directly, because `guest_init::enroll` did not expose a key-and-CSR function when this
//! benchmark was written. The work is the same: one key generation, one DER encoding, one
//! ECDSA signature. The key never leaves this function and is never printed.

use std::time::Instant;

/// Times `n` key generations plus CSRs; returns milliseconds per sample.
pub fn keygen_csr(n: usize) -> Result<Vec<f64>, rcgen::Error> {
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut params = rcgen::CertificateParams::new(vec![format!("vm-{i}.bench.invalid")])?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("vm-{i}"));
        let csr = params.serialize_request(&key)?;
        let der_len = csr.der().len();
        samples.push(super::stats::millis(t.elapsed()));
        debug_assert!(der_len > 0);
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    #[test]
    fn makes_csrs() {
        assert_eq!(super::keygen_csr(2).unwrap().len(), 2);
    }
}
