//! Bootstrap material: who this VM is and the one secret that lets it enroll.
//!
//! The platform stages, per clone, a small JSON object (format version 1):
//!
//! ```json
//! {"version": 1,
//!  "workspace_namespace": "team-a", "workspace_name": "ws1",
//!  "workspace_uid": "0b4c5e2a-...", "vm_uid": "9f0e...",
//!  "revocation_epoch": 18446744073709551615,
//!  "token": "<43..256 characters of A-Z a-z 0-9 - _>",
//!  "expires_at": 1790000000,
//!  "enrollment_port": 5002,
//!  "management_ca": "<standard base64 of the management CA certificate's DER>"}
//! ```
//!
//! `expires_at` is Unix seconds. `management_ca` pins the one CA whose certificates the
//! guest accepts (see [`super::ca`]); it is required, and material without it is refused
//! naming the field: a guest that accepted any issuer would take its identity from
//! whoever answers on the enrollment port. It arrives either as a file (mode 0600, owned by root, on
//! the image or a config disk; see [`read_file`]) or as a one-time push from the host on a
//! port the guest listens on (see [`receive_push`]).
//!
//! Parsing is strict because this is the input that decides the VM's identity: at most
//! [`MAX_MATERIAL_BYTES`], every field required, unknown fields rejected (a misspelt
//! `revocation_epoc` must not silently become epoch 0), the epoch a full-range `u64`, and
//! every string checked against the alphabet the identity URI needs.
//!
//! **The token is secret.** It lives in a [`Token`], whose buffer is wiped on drop and
//! which has no `Display` and a `Debug` that prints `<redacted>`. Parse errors never quote
//! input: `serde_json`'s messages can contain the offending value (`invalid type: string
//! "..."`), so they are rewritten to keep only our own field names (see [`redact`]). The
//! token never enters argv, the environment, the kernel command line or a log line; the
//! file it came from is not deleted (it may be on a read-only config disk), so its
//! protection is its mode and the root-only directory it sits in.
//!
//! Threat: a loose or planted bootstrap file (mode, owner and symlink checks), a token
//! leaking through logs or errors, ambiguous or partial input changing the identity,
//! and material without a usable CA pin (refused, so no issuer is ever trusted by
//! default). The push listener's threats are stated in [`super::push`].

use std::fmt;
use std::io;
use std::path::Path;

use serde::{Deserialize, Deserializer};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use super::identity::Identity;
pub use super::push::receive_push;

/// The largest bootstrap document accepted.
pub const MAX_MATERIAL_BYTES: usize = 4096;

/// The bootstrap format version this build reads.
pub const MATERIAL_VERSION: u32 = 1;

/// Shortest and longest token.
pub const TOKEN_LEN: std::ops::RangeInclusive<usize> = 32..=256;

/// The fields of version 1, the only names an error message may quote.
const FIELDS: &[&str] = &[
    "version",
    "workspace_namespace",
    "workspace_name",
    "workspace_uid",
    "vm_uid",
    "revocation_epoch",
    "token",
    "expires_at",
    "enrollment_port",
    "management_ca",
];

/// The bootstrap token. Wiped on drop; never printed.
pub struct Token(Zeroizing<String>);

impl Token {
    /// The token's characters, for the one place that sends them.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Hex SHA-256 of the token: what the service and the guest's records keep.
    pub fn sha256_hex(&self) -> String {
        hex(&Sha256::digest(self.0.as_bytes()))
    }

    fn check(&self) -> Result<(), String> {
        let t = self.0.as_str();
        if !TOKEN_LEN.contains(&t.len()) {
            return Err(format!(
                "token: must be {} to {} characters long",
                TOKEN_LEN.start(),
                TOKEN_LEN.end()
            ));
        }
        if !t
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(
                "token: only A-Z, a-z, 0-9, '-' and '_' are allowed (base64url or hex)".into(),
            );
        }
        Ok(())
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl<'de> Deserialize<'de> for Token {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // serde_json hands a borrowed &str for strings without escapes (the only ones the
        // token alphabet allows), so no intermediate copy outlives this call.
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Token;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Token, E> {
                let mut s = Zeroizing::new(String::with_capacity(v.len()));
                s.push_str(v);
                Ok(Token(s))
            }
        }
        d.deserialize_str(V)
    }
}

/// Parsed, checked bootstrap material.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Material {
    /// Format version; must be [`MATERIAL_VERSION`].
    pub version: u32,
    /// Workspace namespace.
    pub workspace_namespace: String,
    /// Workspace name.
    pub workspace_name: String,
    /// Workspace UID.
    pub workspace_uid: String,
    /// VM UID.
    pub vm_uid: String,
    /// Revocation epoch (full `u64` range).
    pub revocation_epoch: u64,
    /// The secret token.
    pub token: Token,
    /// When the token expires, Unix seconds.
    pub expires_at: u64,
    /// The enrollment service's vsock port on the host (CID 2).
    pub enrollment_port: u32,
    /// The pinned management CA: the only issuer accepted.
    pub management_ca: super::ca::ManagementCa,
}

/// Bootstrap material that cannot be used. Messages never contain input values.
#[derive(Debug, thiserror::Error)]
pub enum MaterialError {
    /// The file or push could not be read.
    #[error("bootstrap material {origin}: {reason}")]
    Read {
        /// Where it came from.
        origin: String,
        /// Why (no input value).
        reason: String,
    },
    /// Too large.
    #[error("bootstrap material {origin}: larger than {MAX_MATERIAL_BYTES} bytes; provision the documented JSON object only")]
    Oversized {
        /// Where it came from.
        origin: String,
    },
    /// Not the documented JSON.
    #[error("bootstrap material {origin}: {reason}")]
    Invalid {
        /// Where it came from.
        origin: String,
        /// What is wrong, naming the field.
        reason: String,
    },
}

impl Material {
    /// Parses and checks a bootstrap document. `origin` (a path or peer) goes into errors.
    pub fn parse(bytes: &[u8], origin: &str) -> Result<Material, MaterialError> {
        if bytes.len() > MAX_MATERIAL_BYTES {
            return Err(MaterialError::Oversized {
                origin: origin.into(),
            });
        }
        let invalid = |reason: String| MaterialError::Invalid {
            origin: origin.into(),
            reason,
        };
        let m: Material = serde_json::from_slice(bytes).map_err(|e| {
            invalid(format!(
                "{} (line {}, column {}); see docs/ENROLLMENT.md for the format",
                redact(&e.to_string()),
                e.line(),
                e.column()
            ))
        })?;
        if m.version != MATERIAL_VERSION {
            return Err(invalid(format!(
                "version: {} is not supported; this guest-init reads version {MATERIAL_VERSION}",
                m.version
            )));
        }
        m.identity().check().map_err(invalid)?;
        m.token.check().map_err(invalid)?;
        if m.enrollment_port == 0 || m.enrollment_port == u32::MAX {
            return Err(invalid(
                "enrollment_port: must be a vsock port from 1 to 4294967294".into(),
            ));
        }
        Ok(m)
    }

    /// The identity this material asks for.
    pub fn identity(&self) -> Identity {
        Identity {
            workspace_namespace: self.workspace_namespace.clone(),
            workspace_name: self.workspace_name.clone(),
            workspace_uid: self.workspace_uid.clone(),
            vm_uid: self.vm_uid.clone(),
            epoch: self.revocation_epoch,
        }
    }
}

/// Rewrites a `serde_json` message so that only our own field names survive: any other text
/// in backticks or quotes (an input value, an unknown key) becomes `<redacted>`.
///
/// The one piece of input a message quotes is its first quoted text, and that text may
/// itself hold quote characters (a key such as ``a`b``): it runs to the last quote before
/// serde's own `, expected ...` (which lists only our names), or to the message's last
/// quote. Pairing quotes one by one instead let such a key's middle through unredacted
/// (found by the fuzz target `bootstrap_material`).
pub fn redact(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    let Some(i) = msg.find(['`', '"']) else {
        return msg.to_string();
    };
    let q = msg.as_bytes()[i] as char;
    out.push_str(&msg[..i]);
    let tail = msg
        .rfind(", expected")
        .filter(|&e| e > i)
        .unwrap_or(msg.len());
    let mut rest = match msg[..tail].rfind(q).filter(|&j| j > i) {
        Some(j) => {
            let inner = &msg[i + 1..j];
            if FIELDS.contains(&inner) {
                out.push(q);
                out.push_str(inner);
                out.push(q);
            } else {
                out.push_str("<redacted>");
            }
            &msg[j + 1..]
        }
        None => {
            out.push_str("<redacted>");
            return out;
        }
    };
    // The rest is serde's own text: pair its quotes.
    while let Some(i) = rest.find(['`', '"']) {
        let q = rest.as_bytes()[i] as char;
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        match after.find(q) {
            Some(j) => {
                let inner = &after[..j];
                if FIELDS.contains(&inner) {
                    out.push(q);
                    out.push_str(inner);
                    out.push(q);
                } else {
                    out.push_str("<redacted>");
                }
                rest = &after[j + 1..];
            }
            None => {
                out.push_str("<redacted>");
                rest = "";
            }
        }
    }
    out.push_str(rest);
    // Unquoted values (`invalid type: integer 5`) are numbers or literals, never the
    // token, whose alphabet makes it a JSON string.
    out
}

/// Reads bootstrap material from a file: regular, not a symlink, owned by root (the
/// effective uid), mode 0600 or stricter, at most [`MAX_MATERIAL_BYTES`].
/// `Ok(None)` when the file does not exist.
pub fn read_file(path: &Path) -> Result<Option<Material>, MaterialError> {
    let origin = path.display().to_string();
    let bytes = match super::files::read_bounded(path, MAX_MATERIAL_BYTES, true) {
        Ok(Some(b)) => b,
        Ok(None) => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
            return Err(MaterialError::Oversized { origin })
        }
        Err(e) => {
            return Err(MaterialError::Read {
                origin,
                reason: e.to_string(),
            })
        }
    };
    Material::parse(&bytes, &origin).map(Some)
}

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "tok_SECRETSECRETSECRETSECRETSECRET0123";

    fn ca_b64() -> String {
        use base64::Engine;
        let ca = crate::enroll::ca::tests::TestCa::new("management CA");
        base64::engine::general_purpose::STANDARD.encode(ca.pin.der())
    }

    fn doc(extra: &str) -> String {
        doc_with_ca(&format!(r#","management_ca":"{}""#, ca_b64()), extra)
    }

    fn doc_with_ca(ca: &str, extra: &str) -> String {
        format!(
            r#"{{"version":1,"workspace_namespace":"team-a","workspace_name":"ws1",
            "workspace_uid":"u-1","vm_uid":"vm-1","revocation_epoch":18446744073709551615,
            "token":"{TOKEN}","expires_at":1790000000,"enrollment_port":5002{ca}{extra}}}"#
        )
    }

    #[test]
    fn the_management_ca_is_required_and_must_be_a_usable_ca() {
        let e = Material::parse(doc_with_ca("", "").as_bytes(), "test")
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field `management_ca`"), "{e}");
        // A leaf certificate (not a CA) in base64, and text that is not base64.
        use base64::Engine;
        let key = crate::enroll::keystore::P256Key::generate("test").unwrap();
        let mut leaf = rcgen::CertificateParams::default();
        leaf.serial_number = Some(vec![1].into());
        let leaf = leaf
            .self_signed(&crate::enroll::keystore::RcgenSigner(&key))
            .unwrap();
        let leaf = base64::engine::general_purpose::STANDARD.encode(leaf.der());
        for (ca, want) in [
            (
                leaf.as_str(),
                "management_ca: the pinned CA certificate is not a CA",
            ),
            ("%%%", "management_ca: not standard base64"),
            (
                "AAAA",
                "management_ca: the pinned CA certificate is not a DER",
            ),
        ] {
            let d = doc_with_ca(&format!(r#","management_ca":"{ca}""#), "");
            let e = Material::parse(d.as_bytes(), "test")
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
        let m = Material::parse(doc("").as_bytes(), "test").unwrap();
        assert_eq!(m.management_ca.subject(), "CN=management CA");
    }

    #[test]
    fn full_range_epoch_parses() {
        let m = Material::parse(doc("").as_bytes(), "test").unwrap();
        assert_eq!(m.revocation_epoch, u64::MAX);
        assert_eq!(m.token.expose(), TOKEN);
        assert!(!format!("{m:?}").contains(TOKEN));
    }

    #[test]
    fn unknown_fields_are_rejected_by_name() {
        let e = Material::parse(doc(r#","revocation_epoc":3"#).as_bytes(), "test").unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("unknown field") && s.contains("<redacted>"),
            "{s}"
        );
    }

    #[test]
    fn errors_never_quote_the_token() {
        // The token's value in a wrong place or with a wrong type.
        for bad in [
            doc("").replace("\"token\"", &format!("\"{TOKEN}\"")),
            doc("").replace("\"vm-1\"", &format!("\"{TOKEN}\"")),
            doc("").replace("\"u-1\"", &format!("[\"{TOKEN}\"]")),
            doc("").replace("\"team-a\"", &format!("\"{TOKEN}\"")),
            doc("").replace("5002", &format!("\"{TOKEN}\"")),
        ] {
            let e = Material::parse(bad.as_bytes(), "test")
                .unwrap_err()
                .to_string();
            assert!(!e.contains(TOKEN), "{e}");
        }
    }

    /// Regression (fuzz target `bootstrap_material`): a key holding backticks let the text
    /// between them through, token-like characters included.
    #[test]
    fn quotes_inside_quoted_input_do_not_unredact_it() {
        let crash = "{\"ve_____`````__tov".to_string()
            + &"t".repeat(42)
            + "____\":2,\""
            + &"t".repeat(32)
            + "\":90}";
        for bad in [
            crash,
            doc("").replace("\"vm_uid\"", &format!("\"a`{TOKEN}`b\"")),
            doc("").replace("\"vm-1\"", &format!("\"a\\\"{TOKEN}\\\"b\"")),
            doc("").replace("\"vm-1\"", &format!("\"a\\\"{TOKEN}\\\", expected b\"")),
        ] {
            let e = Material::parse(bad.as_bytes(), "test")
                .unwrap_err()
                .to_string();
            assert!(!e.contains("tttt") && !e.contains("SECRET"), "{bad}: {e}");
        }
        assert_eq!(
            redact("unknown field `a`b`, expected one of `version`, `token`"),
            "unknown field <redacted>, expected one of `version`, `token`"
        );
        assert_eq!(redact("missing field `token`"), "missing field `token`");
    }

    #[test]
    fn bad_values_name_their_field() {
        let cases = [
            (doc("").replace("\"vm-1\"", "\"a:b\""), "vm_uid"),
            (doc("").replace("5002", "0"), "enrollment_port"),
            (doc("").replace(TOKEN, "short"), "token"),
            (doc("").replace("\"version\":1", "\"version\":2"), "version"),
            (
                doc("").replace("18446744073709551615", "18446744073709551616"),
                "line",
            ),
            (doc("").replace("18446744073709551615", "-1"), "line"),
        ];
        for (bad, field) in cases {
            let e = Material::parse(bad.as_bytes(), "test")
                .unwrap_err()
                .to_string();
            assert!(e.contains(field), "{field}: {e}");
        }
    }

    #[test]
    fn oversized_is_refused_before_parsing() {
        let big = doc(&format!(r#","pad":"{}""#, "x".repeat(MAX_MATERIAL_BYTES)));
        assert!(matches!(
            Material::parse(big.as_bytes(), "test"),
            Err(MaterialError::Oversized { .. })
        ));
    }
}
