//! The five TPM 2.0 commands the key store needs, marshalled by `tpm2-protocol`.
//!
//! - `CreatePrimary` under the owner (storage) hierarchy with the TCG's ECC P-256
//!   storage-root-key template ([`srk_template`]). A primary key is derived from the
//!   hierarchy's seed and the template, so the same TPM state gives back the same key
//!   every time: nothing is persisted in the TPM's NV memory (no `EvictControl`), nothing
//!   needs the owner's authorization beyond the empty password every VM's fresh TPM has.
//! - `Create` of the signing key under it ([`signing_template`]): ECC P-256, ECDSA with
//!   SHA-256, `fixedTPM | fixedParent | sensitiveDataOrigin`, so the TPM generates the
//!   private scalar itself and will never export or duplicate it. The TPM returns it only
//!   as a `TPM2B_PRIVATE`: encrypted and integrity-protected with keys derived from the
//!   parent's seed, which never leaves the TPM.
//! - `Load` of that blob under the recreated primary, `Sign` of a SHA-256 digest, and
//!   `FlushContext` of every transient handle afterwards (swtpm's socket and a raw
//!   `/dev/tpm0` have no resource manager to flush for us).
//!
//! Authorization: every object has an empty auth value, and commands that need
//! authorization carry one password session (`TPM_RS_PW`, empty nonce, empty password),
//! which is all an empty auth value asks for. No HMAC or policy session is needed, and the
//! key's protection is that it cannot leave the TPM, not a secret the guest would have to
//! keep on the same disk.

use tpm2_protocol::basic::{TpmBuffer, TpmHandle, TpmUint16};
use tpm2_protocol::data::{
    Tpm2bPrivate, Tpm2bPublic, Tpm2bSensitiveCreate, TpmAlgId, TpmEccCurve, TpmRh, TpmSt,
    TpmaObject, TpmaSession, TpmlPcrSelection, TpmsAuthCommand, TpmsEccParms, TpmsEccPoint,
    TpmsSchemeHash, TpmtEccScheme, TpmtKdfScheme, TpmtPublic, TpmtSigScheme, TpmtSymDef,
    TpmtTkHashcheck, TpmuAsymScheme, TpmuPublicId, TpmuPublicParms, TpmuSigScheme, TpmuSignature,
    TpmuSymKeyBits, TpmuSymMode,
};
use tpm2_protocol::frame::{
    tpm_marshal_command, TpmCreateCommand, TpmCreatePrimaryCommand, TpmCreatePrimaryResponse,
    TpmCreateResponse, TpmFlushContextCommand, TpmFrame, TpmLoadCommand, TpmLoadResponse,
    TpmResponse, TpmSignCommand, TpmSignResponse, TpmUnmarshalBody,
};
use tpm2_protocol::{TpmMarshal, TpmUnmarshal, TpmWriter};

use super::transport::{Tpm, TransportError};

/// A command or response that does not fit what we asked for.
fn proto(what: &str, e: tpm2_protocol::TpmError) -> TransportError {
    TransportError::Malformed(format!("{what}: {e:?}"))
}

/// The owner-hierarchy ECC P-256 storage root key template (TCG "TPM 2.0 Provisioning
/// Guidance", the template `tpm2_createprimary -C o -G ecc` uses): a restricted decryption
/// key with AES-128-CFB for its children, SHA-256 names, no DA lockout, empty unique.
pub fn srk_template() -> TpmtPublic {
    TpmtPublic {
        object_type: TpmAlgId::Ecc,
        name_alg: TpmAlgId::Sha256,
        object_attributes: TpmaObject::FIXED_TPM
            | TpmaObject::FIXED_PARENT
            | TpmaObject::SENSITIVE_DATA_ORIGIN
            | TpmaObject::USER_WITH_AUTH
            | TpmaObject::NO_DA
            | TpmaObject::RESTRICTED
            | TpmaObject::DECRYPT,
        auth_policy: TpmBuffer::default(),
        parameters: TpmuPublicParms::Ecc(TpmsEccParms {
            symmetric: TpmtSymDef {
                algorithm: TpmAlgId::Aes,
                key_bits: TpmuSymKeyBits::Aes(TpmUint16::new(128)),
                mode: TpmuSymMode::Aes(TpmAlgId::Cfb),
            },
            scheme: TpmtEccScheme {
                scheme: TpmAlgId::Null,
                details: TpmuAsymScheme::Null,
            },
            curve_id: TpmEccCurve::NistP256,
            kdf: TpmtKdfScheme::default(),
        }),
        unique: TpmuPublicId::Ecc(TpmsEccPoint::default()),
    }
}

/// The attributes the signing key must have: generated in this TPM, never exportable.
pub fn signing_attributes() -> TpmaObject {
    TpmaObject::FIXED_TPM
        | TpmaObject::FIXED_PARENT
        | TpmaObject::SENSITIVE_DATA_ORIGIN
        | TpmaObject::USER_WITH_AUTH
        | TpmaObject::NO_DA
        | TpmaObject::SIGN_ENCRYPT
}

/// The signing key template: unrestricted ECC P-256 signing, ECDSA with SHA-256.
pub fn signing_template() -> TpmtPublic {
    TpmtPublic {
        object_type: TpmAlgId::Ecc,
        name_alg: TpmAlgId::Sha256,
        object_attributes: signing_attributes(),
        auth_policy: TpmBuffer::default(),
        parameters: TpmuPublicParms::Ecc(TpmsEccParms {
            symmetric: TpmtSymDef {
                algorithm: TpmAlgId::Null,
                key_bits: TpmuSymKeyBits::Null,
                mode: TpmuSymMode::Null,
            },
            scheme: TpmtEccScheme {
                scheme: TpmAlgId::Ecdsa,
                details: TpmuAsymScheme::Hash(TpmsSchemeHash {
                    hash_alg: TpmAlgId::Sha256,
                }),
            },
            curve_id: TpmEccCurve::NistP256,
            kdf: TpmtKdfScheme::default(),
        }),
        unique: TpmuPublicId::Ecc(TpmsEccPoint::default()),
    }
}

/// The password session with an empty password: all an empty auth value asks for.
fn password_session() -> TpmsAuthCommand {
    TpmsAuthCommand {
        session_handle: TpmHandle::new(TpmRh::Pw as u32),
        nonce: TpmBuffer::default(),
        session_attributes: TpmaSession::empty(),
        hmac: TpmBuffer::default(),
    }
}

/// Marshals `command` (with a password session when `auth`), runs it, and unmarshals the
/// response body as `R`.
fn run<C: TpmFrame, R: TpmUnmarshalBody, S: std::io::Read + std::io::Write>(
    tpm: &mut Tpm<S>,
    command: &C,
    auth: bool,
) -> Result<R, TransportError> {
    let mut buf = [0u8; super::transport::MAX_RESPONSE];
    let mut w = TpmWriter::new(&mut buf);
    let (tag, sessions) = if auth {
        (TpmSt::Sessions, vec![password_session()])
    } else {
        (TpmSt::NoSessions, Vec::new())
    };
    tpm_marshal_command(command, tag, &sessions, &mut w)
        .map_err(|e| proto("marshal the command", e))?;
    let response = tpm.transact(w.as_bytes())?;
    TpmResponse::cast(&response)
        .and_then(|r| r.unmarshal::<R>())
        .map_err(|e| proto("unmarshal the response", e))
}

/// Creates (re-derives) the storage root key; returns its transient handle.
pub fn create_primary<S: std::io::Read + std::io::Write>(
    tpm: &mut Tpm<S>,
) -> Result<u32, TransportError> {
    let cmd = TpmCreatePrimaryCommand {
        handles: [TpmHandle::new(TpmRh::Owner as u32)],
        in_sensitive: Tpm2bSensitiveCreate::default(),
        in_public: Tpm2bPublic {
            inner: srk_template(),
        },
        outside_info: TpmBuffer::default(),
        creation_pcr: TpmlPcrSelection::default(),
    };
    let r: TpmCreatePrimaryResponse = run(tpm, &cmd, true)?;
    Ok(r.handles[0].value())
}

/// Creates a signing key under `parent`; returns its wrapped private and its public area.
pub fn create_signing_key<S: std::io::Read + std::io::Write>(
    tpm: &mut Tpm<S>,
    parent: u32,
) -> Result<(Tpm2bPrivate, TpmtPublic), TransportError> {
    let cmd = TpmCreateCommand {
        handles: [TpmHandle::new(parent)],
        in_sensitive: Tpm2bSensitiveCreate::default(),
        in_public: Tpm2bPublic {
            inner: signing_template(),
        },
        outside_info: TpmBuffer::default(),
        creation_pcr: TpmlPcrSelection::default(),
    };
    let r: TpmCreateResponse = run(tpm, &cmd, true)?;
    Ok((r.out_private, r.out_public.inner))
}

/// Loads a wrapped key under `parent`; returns its transient handle.
pub fn load<S: std::io::Read + std::io::Write>(
    tpm: &mut Tpm<S>,
    parent: u32,
    private: &Tpm2bPrivate,
    public: &TpmtPublic,
) -> Result<u32, TransportError> {
    let cmd = TpmLoadCommand {
        handles: [TpmHandle::new(parent)],
        in_private: *private,
        in_public: Tpm2bPublic {
            inner: public.clone(),
        },
    };
    let r: TpmLoadResponse = run(tpm, &cmd, true)?;
    Ok(r.handles[0].value())
}

/// Signs a SHA-256 digest with the loaded key; returns the ECDSA `(r, s)` as the TPM gave them.
pub fn sign<S: std::io::Read + std::io::Write>(
    tpm: &mut Tpm<S>,
    key: u32,
    digest: &[u8; 32],
) -> Result<(Vec<u8>, Vec<u8>), TransportError> {
    let cmd = TpmSignCommand {
        handles: [TpmHandle::new(key)],
        digest: TpmBuffer::try_from(&digest[..]).map_err(|e| proto("digest", e))?,
        in_scheme: TpmtSigScheme {
            scheme: TpmAlgId::Ecdsa,
            details: TpmuSigScheme::Hash(TpmsSchemeHash {
                hash_alg: TpmAlgId::Sha256,
            }),
        },
        // A null ticket: the key is not restricted, so the TPM need not have hashed the
        // message itself.
        validation: TpmtTkHashcheck {
            tag: TpmSt::HashCheck,
            hierarchy: TpmRh::Null,
            digest: TpmBuffer::default(),
        },
    };
    let r: TpmSignResponse = run(tpm, &cmd, true)?;
    match r.signature.signature {
        TpmuSignature::Ecdsa(sig) => Ok((sig.signature_r.to_vec(), sig.signature_s.to_vec())),
        _ => Err(TransportError::Malformed(
            "Sign answered with a non-ECDSA signature".into(),
        )),
    }
}

/// Flushes a transient handle. Errors are the caller's to ignore or report.
pub fn flush<S: std::io::Read + std::io::Write>(
    tpm: &mut Tpm<S>,
    handle: u32,
) -> Result<(), TransportError> {
    let cmd = TpmFlushContextCommand {
        handles: [],
        flush_handle: TpmHandle::new(handle),
    };
    let _: tpm2_protocol::frame::TpmFlushContextResponse = run(tpm, &cmd, false)?;
    Ok(())
}

/// The key blob: `TPM2B_PUBLIC || TPM2B_PRIVATE`, the layout tpm2-tools and the TSS use.
pub fn marshal_blob(
    public: &TpmtPublic,
    private: &Tpm2bPrivate,
) -> Result<Vec<u8>, TransportError> {
    let mut buf = [0u8; 2 * super::transport::MAX_RESPONSE];
    let mut w = TpmWriter::new(&mut buf);
    Tpm2bPublic {
        inner: public.clone(),
    }
    .marshal(&mut w)
    .and_then(|()| private.marshal(&mut w))
    .map_err(|e| proto("marshal the key blob", e))?;
    Ok(w.as_bytes().to_vec())
}

/// Parses a key blob back into its public area and wrapped private; nothing may follow.
pub fn unmarshal_blob(blob: &[u8]) -> Result<(TpmtPublic, Tpm2bPrivate), TransportError> {
    let (public, rest) = Tpm2bPublic::unmarshal(blob).map_err(|e| proto("key blob public", e))?;
    let (private, rest) =
        Tpm2bPrivate::unmarshal(rest).map_err(|e| proto("key blob private", e))?;
    if !rest.is_empty() {
        return Err(TransportError::Malformed(format!(
            "{} bytes after the key blob",
            rest.len()
        )));
    }
    Ok((public.inner, private))
}

/// The SEC1 uncompressed point of an ECC P-256 public area with our signing attributes;
/// `Err` for anything else (a blob that is not one of our keys).
pub fn signing_point(public: &TpmtPublic) -> Result<Vec<u8>, TransportError> {
    let bad = |why: &str| TransportError::Malformed(format!("the key blob's public area {why}"));
    if public.object_type != TpmAlgId::Ecc || public.name_alg != TpmAlgId::Sha256 {
        return Err(bad("is not an ECC key with SHA-256 names"));
    }
    if public.object_attributes != signing_attributes() {
        return Err(bad("does not have the fixedTPM signing-key attributes"));
    }
    match (&public.parameters, &public.unique) {
        (TpmuPublicParms::Ecc(p), TpmuPublicId::Ecc(pt))
            if p.curve_id == TpmEccCurve::NistP256 && pt.x.len() <= 32 && pt.y.len() <= 32 =>
        {
            let mut out = vec![4u8; 65];
            out[1..33].fill(0);
            out[33..].fill(0);
            out[33 - pt.x.len()..33].copy_from_slice(&pt.x);
            out[65 - pt.y.len()..].copy_from_slice(&pt.y);
            Ok(out)
        }
        _ => Err(bad("is not a P-256 point")),
    }
}

/// The DER ECDSA signature for a `(r, s)` the TPM returned (big-endian, leading zeros
/// possibly stripped); `Err` for a component longer than 32 bytes, zero, or not below
/// the curve order: a TPM answer that is not a P-256 signature.
pub fn signature_der(r: &[u8], s: &[u8]) -> Result<Vec<u8>, TransportError> {
    let bad = || TransportError::Malformed("Sign answered with a malformed signature".into());
    if r.len() > 32 || s.len() > 32 {
        return Err(bad());
    }
    let mut rs = [0u8; 64];
    rs[32 - r.len()..32].copy_from_slice(r);
    rs[64 - s.len()..].copy_from_slice(s);
    let sig = p256::ecdsa::Signature::from_slice(&rs).map_err(|_| bad())?;
    Ok(sig.to_der().as_bytes().to_vec())
}
