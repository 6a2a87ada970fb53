//! The sign-in protocol filter: Dovecot's auth client protocol, guest to service.
//!
//! **Threats.** Dovecot's auth-client socket trusts whoever can open it: a client may set
//! `rip` (the address the attempt budget is keyed on), `real_*`, `secured`,
//! `valid-client-cert`, `cert_username`, `no-penalty` (turns the budget off),
//! `forward_fields` and `debug`. Natively only the declared services can open the socket;
//! through the relay, an untrusted guest could
//! 1. set the trust fields and gain what they grant (no penalty, "secured", a certificate
//!    user name) — defended by an **allow-list** of parameter keys: every other key is
//!    removed, so a field Dovecot learns tomorrow is not passed until someone allows it;
//! 2. pass on its gateway's address as `rip`. Behind the VM's NAT every request's `rip` is
//!    the gateway (10.0.2.2 under QEMU user networking), the same for every guest, so one
//!    app's failed sign-ins would spend every app's budget. Removing `rip` is no cure:
//!    Dovecot keys every rip-less request under one empty key. So by default
//!    (`substitute`) a gateway `rip` becomes the app's own per-app client address; with
//!    `drop` it is removed. A request without any `rip` gets the app's address added under
//!    `substitute`, so a rip-less app still has its own budget;
//! 3. claim another app's per-app address as `rip`, to spend that app's budget — a `rip`
//!    inside the configured `reserved_networks` (the platform's per-app address pool) is
//!    treated like a gateway address. So is a `rip` that does not parse as a plain IP
//!    address: what Dovecot would make of it cannot be known here, so it is never passed;
//! 4. make the filter and Dovecot disagree on where a line or field ends (raw NUL or CR
//!    bytes, broken `\001` escapes, lines over Dovecot's 16,384-byte limit). Such a line
//!    closes the connection; nothing of it reaches the service.
//!
//! Everything else is passed **byte for byte**: fields kept are the guest's own bytes,
//! in the guest's order, `resp=` stays last (an added `rip` goes just before it), and
//! lines other than `AUTH` are not touched. Service-to-guest bytes do not pass through
//! here at all: the connection code copies them with [`vm_transport::pump::copy`], so a
//! greeting or reply that arrived in one piece is written in one piece (Radicale reads
//! each with one `recv`).
//!
//! The filter works on whole lines and emits each as soon as its `\n` is in hand, so the
//! output of a chunk never waits for the next one. It never logs line contents: `resp=`
//! and `CONT` carry credentials; errors name only the kind of problem.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Longest line Dovecot accepts, `\n` included; longer lines close the connection.
pub const MAX_LINE: usize = 16384;

/// Parameter keys that grant the caller trust Dovecot gives only its own services; the
/// configuration can never allow them (`real_*` and `forward_*` are matched as prefixes).
pub const TRUST_FIELDS: &[&str] = &[
    "no-penalty",
    "secured",
    "valid-client-cert",
    "cert_username",
    "forward_fields",
    "debug",
];

/// Whether `key` is a trust field (see [`TRUST_FIELDS`]).
pub fn is_trust_field(key: &str) -> bool {
    TRUST_FIELDS.contains(&key) || key.starts_with("real_") || key.starts_with("forward_")
}

/// Parameter keys passed to Dovecot by default. Not in it, so removed: `no-penalty`,
/// `secured`, `valid-client-cert`, `cert_username`, `real_*`, `forward_fields`, `debug`
/// and anything unknown. `resp` is always passed.
pub const DEFAULT_ALLOW_FIELDS: &[&str] = &[
    "service",
    "lip",
    "rip",
    "lport",
    "rport",
    "local_name",
    "session",
    "client_id",
    "final-resp-ok",
];

/// An IP network, written `"100.64.0.0/10"` or `"fd00:64::/48"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Whether `ip` is inside the network.
    pub fn contains(&self, ip: &IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                prefix_eq(&net.octets(), &ip.octets(), self.prefix)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                prefix_eq(&net.octets(), &ip.octets(), self.prefix)
            }
            _ => false,
        }
    }
}

fn prefix_eq(a: &[u8], b: &[u8], bits: u8) -> bool {
    let bits = usize::from(bits);
    let whole = bits / 8;
    if a[..whole] != b[..whole] {
        return false;
    }
    let rest = bits % 8;
    if rest == 0 {
        return true;
    }
    let mask = 0xffu8 << (8 - rest);
    a[whole] & mask == b[whole] & mask
}

impl FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not a network; write ADDRESS/PREFIX, e.g. 100.64.0.0/10");
        let (a, p) = s.split_once('/').ok_or_else(bad)?;
        let addr: IpAddr = a.parse().map_err(|_| bad())?;
        let prefix: u8 = p.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(bad());
        }
        Ok(Cidr { addr, prefix })
    }
}

impl TryFrom<String> for Cidr {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<Cidr> for String {
    fn from(c: Cidr) -> String {
        c.to_string()
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// What becomes of a `rip` that is not a client of the app's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RipRule {
    /// Replace it with (or, when absent, add) the app's per-app client address.
    Substitute(IpAddr),
    /// Remove it.
    Drop,
}

/// The filter's rules for one service instance.
#[derive(Clone, Debug)]
pub struct Policy {
    /// The VM's gateway addresses.
    pub gateways: Vec<IpAddr>,
    /// The platform's per-app address pool(s).
    pub reserved: Vec<Cidr>,
    /// Substitute or drop.
    pub rip: RipRule,
    /// Parameter keys passed on (`resp` always is).
    pub allow: Vec<String>,
}

/// Why a connection is closed. Never carries line contents.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    /// A line longer than Dovecot's limit.
    #[error("line longer than {MAX_LINE} bytes")]
    LineTooLong,
    /// Bytes Dovecot's line syntax does not allow.
    #[error("malformed line: {0}")]
    Malformed(&'static str),
}

impl Policy {
    fn allowed(&self, key: &[u8]) -> bool {
        self.allow.iter().any(|k| k.as_bytes() == key)
    }

    /// Whether a guest's `rip` value names a client that may keep its own budget.
    fn is_client(&self, value: &[u8]) -> bool {
        let Some(ip) = std::str::from_utf8(value)
            .ok()
            .and_then(|s| s.parse::<IpAddr>().ok())
            .map(|ip| ip.to_canonical())
        else {
            return false;
        };
        if self.rip == RipRule::Substitute(ip) {
            return true;
        }
        !self.gateways.iter().any(|g| g.to_canonical() == ip)
            && !self.reserved.iter().any(|n| n.contains(&ip))
    }
}

/// Checks the line syntax: no raw NUL or CR, every `\001` starts a valid escape.
fn check_syntax(line: &[u8]) -> Result<(), FilterError> {
    if line.contains(&0) {
        return Err(FilterError::Malformed("raw NUL byte"));
    }
    if line.contains(&b'\r') {
        return Err(FilterError::Malformed("raw CR byte"));
    }
    // An escaped character is never 0x01 itself, so checking every 0x01 needs no skipping.
    let valid_escape = |i: usize| matches!(line.get(i + 1), Some(b'0' | b'1' | b't' | b'r' | b'n'));
    if (0..line.len()).any(|i| line[i] == 1 && !valid_escape(i)) {
        return Err(FilterError::Malformed("invalid \\001 escape"));
    }
    Ok(())
}

/// One parameter of a rewritten `AUTH` line.
enum Part<'a> {
    /// The guest's bytes, unchanged.
    Field(&'a [u8]),
    /// `key=<the app's address>` in place of the guest's value.
    Rip(&'a [u8], IpAddr),
}

/// Filters one complete line (without its `\n`) and appends the result, `\n` included.
pub fn filter_line(policy: &Policy, line: &[u8], out: &mut Vec<u8>) -> Result<(), FilterError> {
    if line.len() >= MAX_LINE {
        return Err(FilterError::LineTooLong);
    }
    check_syntax(line)?;
    let mut fields = line.split(|&b| b == b'\t');
    if fields.next() != Some(b"AUTH".as_slice()) || line.len() == 4 {
        out.extend_from_slice(line);
        out.push(b'\n');
        return Ok(());
    }
    // AUTH <id> <mech> are positional; parameters follow.
    out.extend_from_slice(b"AUTH");
    for positional in fields.by_ref().take(2) {
        out.push(b'\t');
        out.extend_from_slice(positional);
    }
    // Kept parameters, in the guest's order.
    let mut kept: Vec<Part<'_>> = Vec::new();
    let mut have_rip = false;
    let mut first_resp = None;
    for field in fields {
        let key = field.split(|&b| b == b'=').next().unwrap_or_default();
        if key == b"resp" {
            first_resp.get_or_insert(kept.len());
            kept.push(Part::Field(field));
            continue;
        }
        if !policy.allowed(key) {
            continue;
        }
        if key == b"rip" || key == b"real_rip" {
            let value = field.get(key.len() + 1..).unwrap_or_default();
            if !policy.is_client(value) {
                if let RipRule::Substitute(addr) = policy.rip {
                    have_rip |= key == b"rip";
                    kept.push(Part::Rip(key, addr));
                }
                continue;
            }
            have_rip |= key == b"rip";
        }
        kept.push(Part::Field(field));
    }
    if let (false, RipRule::Substitute(addr)) = (have_rip, policy.rip) {
        // resp= must stay last: an added rip goes just before it.
        kept.insert(first_resp.unwrap_or(kept.len()), Part::Rip(b"rip", addr));
    }
    for part in kept {
        out.push(b'\t');
        match part {
            Part::Field(f) => out.extend_from_slice(f),
            Part::Rip(key, addr) => {
                out.extend_from_slice(key);
                out.push(b'=');
                out.extend_from_slice(addr.to_string().as_bytes());
            }
        }
    }
    out.push(b'\n');
    Ok(())
}

/// The guest-to-service direction of one connection: collects lines across reads.
#[derive(Debug)]
pub struct GuestFilter<'p> {
    policy: &'p Policy,
    pending: Vec<u8>,
}

impl<'p> GuestFilter<'p> {
    /// A filter for one connection.
    pub fn new(policy: &'p Policy) -> Self {
        GuestFilter {
            policy,
            pending: Vec::new(),
        }
    }

    /// Bytes of an unfinished line held back (never forwarded until its `\n` arrives).
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Takes one chunk read from the guest and appends to `out` every line it completes,
    /// filtered. On error the connection must be closed: `out` then holds the lines
    /// completed before the bad one (safe to send), and nothing of the bad line.
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<(), FilterError> {
        let mut rest = input;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            let (part, tail) = (&rest[..pos], &rest[pos + 1..]);
            if self.pending.is_empty() {
                filter_line(self.policy, part, out)?;
            } else {
                if self.pending.len() + part.len() >= MAX_LINE {
                    return Err(FilterError::LineTooLong);
                }
                self.pending.extend_from_slice(part);
                let line = std::mem::take(&mut self.pending);
                filter_line(self.policy, &line, out)?;
            }
            rest = tail;
        }
        if self.pending.len() + rest.len() >= MAX_LINE {
            return Err(FilterError::LineTooLong);
        }
        self.pending.extend_from_slice(rest);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(rule: RipRule) -> Policy {
        Policy {
            gateways: vec!["10.0.2.2".parse().unwrap()],
            reserved: vec!["100.64.0.0/10".parse().unwrap()],
            rip: rule,
            allow: DEFAULT_ALLOW_FIELDS.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn sub() -> Policy {
        policy(RipRule::Substitute("100.64.0.7".parse().unwrap()))
    }

    fn run(p: &Policy, input: &[u8]) -> Result<Vec<u8>, FilterError> {
        let mut out = Vec::new();
        GuestFilter::new(p).feed(input, &mut out)?;
        Ok(out)
    }

    #[test]
    fn radicale_bytes_get_the_app_address_instead_of_the_gateway() {
        let input = b"VERSION\t1\t1\nCPID\t13323\nAUTH\t1\tPLAIN\tservice=radicale\trip=10.0.2.2\tresp=AGFsaWNlAHNlY3JldDEyMw==\n";
        let out = run(&sub(), input).unwrap();
        assert_eq!(
            out,
            b"VERSION\t1\t1\nCPID\t13323\nAUTH\t1\tPLAIN\tservice=radicale\trip=100.64.0.7\tresp=AGFsaWNlAHNlY3JldDEyMw==\n"
        );
        let out = run(&policy(RipRule::Drop), input).unwrap();
        assert_eq!(
            out,
            b"VERSION\t1\t1\nCPID\t13323\nAUTH\t1\tPLAIN\tservice=radicale\tresp=AGFsaWNlAHNlY3JldDEyMw==\n"
        );
    }

    #[test]
    fn trust_fields_are_removed_and_resp_stays_last() {
        let input = b"AUTH\t7\tPLAIN\tservice=imap\tno-penalty\tsecured=tls\tvalid-client-cert\tcert_username=x\treal_rip=1.1.1.1\treal_lport=1\tforward_fields=a\tdebug\tsession=s\tfoo=bar\trip=192.0.2.1\tresp=AA==\n";
        let out = run(&sub(), input).unwrap();
        assert_eq!(
            out,
            b"AUTH\t7\tPLAIN\tservice=imap\tsession=s\trip=192.0.2.1\tresp=AA==\n"
        );
    }

    #[test]
    fn a_missing_rip_is_added_under_substitute_only() {
        let input = b"AUTH\t1\tPLAIN\tservice=x\tresp=AA==\n";
        assert_eq!(
            run(&sub(), input).unwrap(),
            b"AUTH\t1\tPLAIN\tservice=x\trip=100.64.0.7\tresp=AA==\n"
        );
        assert_eq!(run(&policy(RipRule::Drop), input).unwrap(), input);
        let no_resp = b"AUTH\t1\tPLAIN\tservice=x\n";
        assert_eq!(
            run(&sub(), no_resp).unwrap(),
            b"AUTH\t1\tPLAIN\tservice=x\trip=100.64.0.7\n"
        );
    }

    #[test]
    fn another_apps_address_and_unparsable_rips_are_not_clients() {
        for rip in [
            "100.64.0.9",
            "::ffff:10.0.2.2",
            "010.0.2.2",
            "10.0.2.2 ",
            "",
            "x",
        ] {
            let input = format!("AUTH\t1\tPLAIN\tservice=x\trip={rip}\n");
            assert_eq!(
                run(&sub(), input.as_bytes()).unwrap(),
                b"AUTH\t1\tPLAIN\tservice=x\trip=100.64.0.7\n",
                "{rip:?}"
            );
            assert_eq!(
                run(&policy(RipRule::Drop), input.as_bytes()).unwrap(),
                b"AUTH\t1\tPLAIN\tservice=x\n",
                "{rip:?}"
            );
        }
        // The app's own address and real clients are kept as sent.
        // (The app's own address inside the reserved pool is its own, in any spelling.)
        for rip in [
            "100.64.0.7",
            "::ffff:100.64.0.7",
            "192.0.2.1",
            "2001:db8::1",
            "100.128.0.1",
        ] {
            let input = format!("AUTH\t1\tPLAIN\tservice=x\trip={rip}\n");
            assert_eq!(run(&sub(), input.as_bytes()).unwrap(), input.as_bytes());
        }
    }

    #[test]
    fn real_rip_follows_the_rip_rule_when_allowed() {
        let mut p = sub();
        p.allow.push("real_rip".into());
        let input = b"AUTH\t1\tPLAIN\tservice=x\trip=192.0.2.1\treal_rip=10.0.2.2\n";
        assert_eq!(
            run(&p, input).unwrap(),
            b"AUTH\t1\tPLAIN\tservice=x\trip=192.0.2.1\treal_rip=100.64.0.7\n"
        );
    }

    #[test]
    fn escaped_keys_do_not_match_allowed_ones() {
        let input = b"AUTH\t1\tPLAIN\tservice=x\tsessio\x01tn=1\trip=192.0.2.1\n";
        assert_eq!(
            run(&sub(), input).unwrap(),
            b"AUTH\t1\tPLAIN\tservice=x\trip=192.0.2.1\n"
        );
        let ok = b"AUTH\t1\tPLAIN\tservice=x\x01ty\x01n\x010\x011\x01r\trip=192.0.2.1\n";
        assert_eq!(run(&sub(), ok).unwrap(), ok);
    }

    #[test]
    fn other_commands_pass_unchanged() {
        let input = b"CONT\t1\tc2VjcmV0\nCANCEL\t1\nAUTH\nauth\t1\tPLAIN\tno-penalty\nXYZ\n\n";
        assert_eq!(run(&sub(), input).unwrap(), input);
    }

    #[test]
    fn malformed_lines_close_the_connection() {
        for bad in [
            &b"AUTH\t1\tPLAIN\tservice=x\x01\n"[..],
            b"AUTH\t1\tPLAIN\tservice=x\x01z\n",
            b"AUTH\t1\tPLAIN\tservice=x\x01\x01t\n",
            b"\x01\n",
            b"CONT\t1\0\n",
            b"AUTH\t1\tPLAIN\tservice=x\r\n",
        ] {
            assert!(
                matches!(run(&sub(), bad), Err(FilterError::Malformed(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn line_limit_is_dovecots() {
        let mut ok = vec![b'a'; MAX_LINE - 1];
        ok.push(b'\n');
        assert_eq!(run(&sub(), &ok).unwrap(), ok);
        let mut long = vec![b'a'; MAX_LINE];
        long.push(b'\n');
        assert_eq!(run(&sub(), &long), Err(FilterError::LineTooLong));
        // Without its newline yet, a line that can no longer fit is refused at once.
        assert_eq!(
            run(&sub(), &long[..MAX_LINE]),
            Err(FilterError::LineTooLong)
        );
        assert!(run(&sub(), &long[..MAX_LINE - 1]).unwrap().is_empty());
        // Across reads.
        let p = sub();
        let mut f = GuestFilter::new(&p);
        let mut out = Vec::new();
        f.feed(&ok[..100], &mut out).unwrap();
        assert_eq!(f.pending(), 100);
        f.feed(&ok[100..], &mut out).unwrap();
        assert_eq!(out, ok);
        assert_eq!(f.pending(), 0);
        let mut f = GuestFilter::new(&p);
        f.feed(&long[..100], &mut out).unwrap();
        assert_eq!(
            f.feed(&long[100..], &mut out),
            Err(FilterError::LineTooLong)
        );
    }

    #[test]
    fn complete_lines_are_emitted_at_once_and_partial_ones_held() {
        let p = sub();
        let mut f = GuestFilter::new(&p);
        let mut out = Vec::new();
        f.feed(b"VERSION\t1\t1\nCPI", &mut out).unwrap();
        assert_eq!(out, b"VERSION\t1\t1\n");
        out.clear();
        f.feed(b"D\t1\n", &mut out).unwrap();
        assert_eq!(out, b"CPID\t1\n");
    }

    #[test]
    fn cidr_parsing_and_matching() {
        let n: Cidr = "100.64.0.0/10".parse().unwrap();
        assert!(n.contains(&"100.127.255.255".parse().unwrap()));
        assert!(!n.contains(&"100.128.0.0".parse().unwrap()));
        assert!(n.contains(&"::ffff:100.64.0.1".parse().unwrap()));
        assert!(!n.contains(&"::1".parse().unwrap()));
        let v6: Cidr = "fd00:64::/48".parse().unwrap();
        assert!(v6.contains(&"fd00:64:0:1::5".parse().unwrap()));
        assert!(!v6.contains(&"fd00:65::1".parse().unwrap()));
        assert!(!v6.contains(&"100.64.0.1".parse().unwrap()));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(&"1.2.3.4".parse().unwrap()));
        let host: Cidr = "10.0.0.1/32".parse().unwrap();
        assert!(host.contains(&"10.0.0.1".parse().unwrap()));
        assert!(!host.contains(&"10.0.0.0".parse().unwrap()));
        for bad in ["10.0.0.0", "10.0.0.0/33", "x/8", "::/129", "10.0.0.0/x"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
        assert_eq!(n.to_string(), "100.64.0.0/10");
        assert_eq!(String::from(n), "100.64.0.0/10");
        let j: Cidr = serde_json::from_str("\"100.64.0.0/10\"").unwrap();
        assert_eq!(j, n);
    }
}
