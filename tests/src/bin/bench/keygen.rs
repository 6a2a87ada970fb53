//! Figure 8: a fresh P-256 key and a certificate signing request, as enrollment makes
//! them on first boot.
//!
//! Measured through `guest-init`'s own enrollment library, so the figure is the code a VM
//! runs: [`P256Key::generate`] (the `p256` crate, OS randomness) and [`csr::build`] (rcgen
//! serializes the request, the key store's key signs it through rcgen's external-signer
//! trait). The identity is a fixed, made-up one. The key never leaves this function and is
//! never printed.

use std::time::Instant;

use guest_init::enroll::csr;
use guest_init::enroll::identity::Identity;
use guest_init::enroll::keystore::P256Key;

/// Times `n` key generations plus CSRs; returns milliseconds per sample.
pub fn keygen_csr(n: usize) -> Result<Vec<f64>, String> {
    let id = Identity {
        workspace_namespace: "bench".into(),
        workspace_name: "bench".into(),
        workspace_uid: "00000000-0000-4000-8000-000000000000".into(),
        vm_uid: "00000000-0000-4000-8000-000000000001".into(),
        epoch: 1,
    };
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let key = P256Key::generate("bench").map_err(|e| e.to_string())?;
        let der = csr::build(&key, &id).map_err(|e| format!("CSR: {e}"))?;
        samples.push(super::stats::millis(t.elapsed()));
        if der.is_empty() {
            return Err("the CSR came out empty".into());
        }
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
