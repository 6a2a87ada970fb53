//! A socket file's permission bits, parsed one way on both sides.
//!
//! Written in configuration as an octal string: three digits, or four with a leading `0`
//! (`"660"`, `"0660"`). Special bits (setuid, setgid, sticky) mean nothing on a socket and
//! are refused, as is anything else, with a message that shows the accepted form: a typo
//! must never turn into a mode nobody meant.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Permission bits of a socket file (`0o000..=0o777`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SocketMode(u32);

impl SocketMode {
    /// Owner only.
    pub const OWNER_ONLY: SocketMode = SocketMode(0o600);
    /// Everyone may connect.
    pub const ANYONE: SocketMode = SocketMode(0o666);

    /// The mode from its bits; `None` above `0o777`.
    pub const fn new(bits: u32) -> Option<SocketMode> {
        if bits <= 0o777 {
            Some(SocketMode(bits))
        } else {
            None
        }
    }

    /// The permission bits.
    pub const fn bits(self) -> u32 {
        self.0
    }
}

/// A mode string that is not three octal digits with an optional leading `0`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an octal permission mode; write three octal digits with an optional leading 0, like \"0660\"")]
pub struct ParseModeError(String);

impl FromStr for SocketMode {
    type Err = ParseModeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let digits = match s.len() {
            3 => s,
            4 if s.starts_with('0') => &s[1..],
            _ => "",
        };
        if digits.is_empty() || !digits.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
            return Err(ParseModeError(s.to_owned()));
        }
        u32::from_str_radix(digits, 8)
            .ok()
            .and_then(SocketMode::new)
            .ok_or_else(|| ParseModeError(s.to_owned()))
    }
}

impl fmt::Display for SocketMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04o}", self.0)
    }
}

impl Serialize for SocketMode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SocketMode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_three_or_four_octal_digits_only() {
        assert_eq!("0660".parse::<SocketMode>().unwrap().bits(), 0o660);
        assert_eq!("600".parse::<SocketMode>().unwrap().bits(), 0o600);
        for bad in [
            "",
            "66",
            "0o660",
            "4755",
            "1777",
            "0888",
            "rw-rw----",
            "06600",
            " 660",
        ] {
            let e = bad.parse::<SocketMode>().unwrap_err();
            assert!(e.to_string().contains("\"0660\""), "{bad}: {e}");
        }
    }

    #[test]
    fn json_round_trip_and_errors() {
        let m: SocketMode = serde_json::from_str("\"0640\"").unwrap();
        assert_eq!(m.bits(), 0o640);
        assert_eq!(serde_json::to_string(&m).unwrap(), "\"0640\"");
        assert!(serde_json::from_str::<SocketMode>("416").is_err());
        assert!(serde_json::from_str::<SocketMode>("\"7777\"").is_err());
    }
}
