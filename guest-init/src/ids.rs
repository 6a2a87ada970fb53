//! Users and groups named in the configuration.
//!
//! A configuration names an account either by name (`"radicale"`, looked up in the image's
//! `/etc/passwd` and `/etc/group` through libc, which reads the files directly under musl)
//! or by number (`"1001"` or `1001`), which needs no entry at all: a micro-VM image often
//! has no passwd file, and numeric ids are what the platform allocates per app.

use nix::unistd::{Gid, Group, Uid, User};
use serde::{Deserialize, Serialize};

/// A user or group as written in the configuration: a name or a number.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum IdRef {
    /// A numeric id.
    Id(u32),
    /// A name, or a number written as a string.
    Name(String),
}

impl std::fmt::Display for IdRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IdRef::Id(n) => write!(f, "{n}"),
            IdRef::Name(s) => f.write_str(s),
        }
    }
}

/// A name that does not resolve.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdError {
    /// No such user.
    #[error("unknown user {0:?}: no entry in /etc/passwd; use a numeric uid or add the user to the image")]
    UnknownUser(String),
    /// No such group.
    #[error("unknown group {0:?}: no entry in /etc/group; use a numeric gid or add the group to the image")]
    UnknownGroup(String),
}

impl IdRef {
    fn number(&self) -> Option<u32> {
        match self {
            IdRef::Id(n) => Some(*n),
            IdRef::Name(s) => s.parse().ok(),
        }
    }

    /// Resolves a user reference to its uid and, when it has a passwd entry, its primary gid.
    pub fn resolve_user(&self) -> Result<(Uid, Option<Gid>), IdError> {
        if let Some(n) = self.number() {
            let gid = User::from_uid(Uid::from_raw(n))
                .ok()
                .flatten()
                .map(|u| u.gid);
            return Ok((Uid::from_raw(n), gid));
        }
        let name = self.to_string();
        match User::from_name(&name) {
            Ok(Some(u)) => Ok((u.uid, Some(u.gid))),
            _ => Err(IdError::UnknownUser(name)),
        }
    }

    /// Resolves a group reference to its gid.
    pub fn resolve_group(&self) -> Result<Gid, IdError> {
        if let Some(n) = self.number() {
            return Ok(Gid::from_raw(n));
        }
        let name = self.to_string();
        match Group::from_name(&name) {
            Ok(Some(g)) => Ok(g.gid),
            _ => Err(IdError::UnknownGroup(name)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_need_no_entry() {
        let (uid, _) = IdRef::Id(20001).resolve_user().unwrap();
        assert_eq!(uid.as_raw(), 20001);
        let (uid, _) = IdRef::Name("20002".into()).resolve_user().unwrap();
        assert_eq!(uid.as_raw(), 20002);
        assert_eq!(IdRef::Name("0".into()).resolve_group().unwrap().as_raw(), 0);
    }

    #[test]
    fn names_resolve_and_unknown_names_say_so() {
        assert_eq!(
            IdRef::Name("root".into())
                .resolve_user()
                .unwrap()
                .0
                .as_raw(),
            0
        );
        let e = IdRef::Name("no-such-user-xyz".into())
            .resolve_user()
            .unwrap_err();
        assert!(e.to_string().contains("no-such-user-xyz"));
    }

    #[test]
    fn json_accepts_both_forms() {
        let v: Vec<IdRef> = serde_json::from_str(r#"[1001, "radicale"]"#).unwrap();
        assert_eq!(v, vec![IdRef::Id(1001), IdRef::Name("radicale".into())]);
    }
}
