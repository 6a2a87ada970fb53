//! The certificate signing request: the identity, signed by the machine key.
//!
//! The CSR is built by rcgen from the parameters below and signed through rcgen's
//! external-signer traits ([`super::keystore::RcgenSigner`]): rcgen serializes the
//! `CertificationRequestInfo`, hands the bytes to the key store's key to sign, and never
//! holds the private key itself.
//!
//! Contents:
//! - subject: `CN=vm <vm-uid>` (informational);
//! - one URI subject alternative name: the identity URI of [`super::identity`], which is
//!   what the service compares with the token's binding;
//! - the P-256 public key and an ECDSA-SHA256 signature (proof of possession).
//!
//! The exact DER is persisted before the first send and re-sent unchanged on every retry:
//! the service commits the first CSR's hash and denies any other. Rebuilding is not a
//! substitute: `p256` signs deterministically (RFC 6979), but ECDSA signers in general —
//! a vTPM store, another library — randomize, and any change in encoding (a new rcgen
//! version after an upgrade) would change the bytes too.

use super::identity::Identity;
use super::keystore::{MachineKey, RcgenSigner};

/// Builds the DER CSR for `id`, signed by `key`.
pub fn build(key: &dyn MachineKey, id: &Identity) -> Result<Vec<u8>, rcgen::Error> {
    let mut params = rcgen::CertificateParams::default();
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(rcgen::DnType::CommonName, format!("vm {}", id.vm_uid));
    params.distinguished_name = dn;
    params.subject_alt_names = vec![rcgen::SanType::URI(id.uri().try_into()?)];
    let csr = params.serialize_request(&RcgenSigner(key))?;
    Ok(csr.der().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::enroll::keystore::P256Key;
    use x509_parser::prelude::*;

    #[test]
    fn csr_carries_the_identity_uri_and_our_key() {
        let key = P256Key::generate("test").unwrap();
        let id = Identity {
            workspace_namespace: "ns".into(),
            workspace_name: "ws".into(),
            workspace_uid: "wu".into(),
            vm_uid: "vm".into(),
            epoch: u64::MAX,
        };
        let der = build(&key, &id).unwrap();
        let (rest, csr) = X509CertificationRequest::from_der(&der).unwrap();
        assert!(rest.is_empty());
        let info = &csr.certification_request_info;
        assert_eq!(
            &*info.subject_pki.subject_public_key.data,
            key.public_sec1()
        );
        let mut uris = Vec::new();
        for ext in csr.requested_extensions().into_iter().flatten() {
            if let ParsedExtension::SubjectAlternativeName(san) = ext {
                for n in &san.general_names {
                    if let GeneralName::URI(u) = n {
                        uris.push(u.to_string());
                    }
                }
            }
        }
        assert_eq!(uris, vec![id.uri()]);
    }
}
