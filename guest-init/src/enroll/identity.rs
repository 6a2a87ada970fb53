//! The identity a certificate binds: workspace, VM incarnation and revocation epoch.
//!
//! Seed 000 fences every credential on three things: the workspace (its namespace, name and
//! UID), the VM UID (one provisioned root incarnation; a reset or re-creation changes it)
//! and the revocation epoch (an unsigned counter that only goes up). The CSR and the
//! certificate carry all of them in one URI subject alternative name:
//!
//! ```text
//! urn:hop3:workspace:<namespace>/<name>/<workspace-uid>:vm:<vm-uid>:epoch:<n>
//! ```
//!
//! `<n>` is the epoch in decimal, the full `u64` range (`18446744073709551615` included).
//! The URI is unambiguous because every component is checked against an alphabet that
//! contains neither `/` nor `:` (Kubernetes DNS names for the namespace and name, letters,
//! digits and `-` for the UIDs), so two different identities never print to the same URI
//! and [`Identity::from_uri`] is the exact inverse of [`Identity::uri`].
//!
//! Threat: a certificate for one workspace, VM or epoch being accepted for another. The
//! enrollment service compares the CSR's URI with the token's binding and the guest compares
//! the certificate's URI with its bootstrap material, both byte for byte on this form.

use serde::{Deserialize, Serialize};

/// The URI prefix of every identity.
pub const URI_PREFIX: &str = "urn:hop3:workspace:";

/// The longest namespace or name (a Kubernetes DNS subdomain).
pub const MAX_NAME_LEN: usize = 253;

/// The longest UID.
pub const MAX_UID_LEN: usize = 64;

/// What a certificate for this VM asserts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// The workspace's Kubernetes namespace.
    pub workspace_namespace: String,
    /// The workspace's name.
    pub workspace_name: String,
    /// The workspace's UID.
    pub workspace_uid: String,
    /// The VM UID (the provisioned root incarnation).
    pub vm_uid: String,
    /// The revocation epoch.
    pub epoch: u64,
}

impl Identity {
    /// The identity URI (see the module documentation).
    pub fn uri(&self) -> String {
        format!(
            "{URI_PREFIX}{}/{}/{}:vm:{}:epoch:{}",
            self.workspace_namespace,
            self.workspace_name,
            self.workspace_uid,
            self.vm_uid,
            self.epoch
        )
    }

    /// Parses an identity URI; `None` unless it is exactly the form [`Identity::uri`] prints.
    pub fn from_uri(uri: &str) -> Option<Identity> {
        let rest = uri.strip_prefix(URI_PREFIX)?;
        let (ws, rest) = rest.split_once(":vm:")?;
        let (vm_uid, epoch) = rest.split_once(":epoch:")?;
        let mut parts = ws.split('/');
        let id = Identity {
            workspace_namespace: parts.next()?.to_owned(),
            workspace_name: parts.next()?.to_owned(),
            workspace_uid: parts.next()?.to_owned(),
            vm_uid: vm_uid.to_owned(),
            epoch: parse_decimal(epoch)?,
        };
        if parts.next().is_some() || id.check().is_err() || id.uri() != uri {
            return None;
        }
        Some(id)
    }

    /// Checks every component's alphabet and length; `Err` names the field.
    pub fn check(&self) -> Result<(), String> {
        check_name("workspace_namespace", &self.workspace_namespace)?;
        check_name("workspace_name", &self.workspace_name)?;
        check_uid("workspace_uid", &self.workspace_uid)?;
        check_uid("vm_uid", &self.vm_uid)?;
        Ok(())
    }

    /// Whether `other` is the same workspace (the epoch and VM may differ).
    pub fn same_workspace(&self, other: &Identity) -> bool {
        self.workspace_namespace == other.workspace_namespace
            && self.workspace_name == other.workspace_name
            && self.workspace_uid == other.workspace_uid
    }
}

/// A canonical decimal `u64`: digits only, no sign, no leading zero.
fn parse_decimal(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0'))
    {
        return None;
    }
    s.parse().ok()
}

fn check_name(field: &str, v: &str) -> Result<(), String> {
    if v.is_empty() || v.len() > MAX_NAME_LEN {
        return Err(format!(
            "{field}: must be 1 to {MAX_NAME_LEN} characters (a Kubernetes DNS name)"
        ));
    }
    let ok = v
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    if !ok || !v.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(format!(
            "{field}: only lowercase letters, digits, '-' and '.' are allowed, starting with a letter or digit"
        ));
    }
    Ok(())
}

fn check_uid(field: &str, v: &str) -> Result<(), String> {
    if v.is_empty() || v.len() > MAX_UID_LEN {
        return Err(format!("{field}: must be 1 to {MAX_UID_LEN} characters"));
    }
    if !v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        return Err(format!(
            "{field}: only letters, digits and '-' are allowed (a Kubernetes UID)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(epoch: u64) -> Identity {
        Identity {
            workspace_namespace: "team-a".into(),
            workspace_name: "ws.one".into(),
            workspace_uid: "0b4c5e2a-1111-2222-3333-444455556666".into(),
            vm_uid: "9f0e-77".into(),
            epoch,
        }
    }

    #[test]
    fn uri_round_trips_over_the_full_epoch_range() {
        for e in [0, 1, 41, u64::MAX - 1, u64::MAX] {
            let i = id(e);
            assert_eq!(Identity::from_uri(&i.uri()), Some(i.clone()));
        }
        assert_eq!(
            id(u64::MAX).uri(),
            "urn:hop3:workspace:team-a/ws.one/0b4c5e2a-1111-2222-3333-444455556666:vm:9f0e-77:epoch:18446744073709551615"
        );
    }

    #[test]
    fn non_canonical_uris_are_rejected() {
        let base = id(7).uri();
        for bad in [
            base.replace(":epoch:7", ":epoch:07"),
            base.replace(":epoch:7", ":epoch:+7"),
            base.replace(":epoch:7", ":epoch:18446744073709551616"),
            base.replace("team-a/", "team-a/x/"),
            base.replace("urn:hop3", "urn:other"),
            format!("{base}:extra"),
        ] {
            assert_eq!(Identity::from_uri(&bad), None, "{bad}");
        }
    }

    #[test]
    fn separators_are_not_allowed_in_components() {
        let mut i = id(1);
        i.vm_uid = "a:epoch:9".into();
        assert!(i.check().unwrap_err().starts_with("vm_uid"));
        let mut i = id(1);
        i.workspace_name = "a/b".into();
        assert!(i.check().unwrap_err().starts_with("workspace_name"));
    }
}
