//! host-relay's Dovecot auth-protocol filter, guest to service.
//!
//! Input: byte 0 picks the policy (substitute an IPv4 or IPv6 app address, or drop),
//! byte 1 the read size the stream is cut into; the rest is the guest's byte stream.
//! Asserts, beyond "no panic":
//! - feeding the stream in pieces gives exactly what feeding it at once gives;
//! - one output line per complete input line; lines other than `AUTH` pass byte for byte;
//! - in an `AUTH` line the positional fields are unchanged, every parameter is `resp` or
//!   on the allow-list and never a trust field (`no-penalty`, `real_*`, ...), every kept
//!   parameter is one of the guest's own, byte for byte, and every `rip` is a client's
//!   (never a gateway, never another app's reserved address, always a plain IP) or the
//!   app's own; under `substitute` there is always a `rip`;
//! - no raw NUL or CR is ever emitted, and a line grows only by the `rip` rewrites.
#![no_main]

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::LazyLock;

use host_relay::dovecot::{
    is_trust_field, Cidr, GuestFilter, Policy, RipRule, DEFAULT_ALLOW_FIELDS,
};
use libfuzzer_sys::fuzz_target;

static POLICIES: LazyLock<[Policy; 3]> = LazyLock::new(|| {
    let mk = |rip| Policy {
        gateways: vec!["10.0.2.2".parse().unwrap(), "fd00::2".parse().unwrap()],
        reserved: vec![
            "100.64.0.0/10".parse().unwrap(),
            "fd00:64::/48".parse().unwrap(),
        ],
        rip,
        allow: DEFAULT_ALLOW_FIELDS.iter().map(|s| s.to_string()).collect(),
    };
    [
        mk(RipRule::Substitute("100.64.0.7".parse().unwrap())),
        mk(RipRule::Substitute("fd00:64::7".parse().unwrap())),
        mk(RipRule::Drop),
    ]
});

fn feed(policy: &Policy, data: &[u8], step: usize) -> (Result<(), String>, Vec<u8>) {
    let mut f = GuestFilter::new(policy);
    let mut out = Vec::new();
    for chunk in data.chunks(step.max(1)) {
        if let Err(e) = f.feed(chunk, &mut out) {
            return (Err(e.to_string()), out);
        }
    }
    (Ok(()), out)
}

fn key(field: &[u8]) -> &[u8] {
    field.split(|&b| b == b'=').next().unwrap_or_default()
}

fn is_client(p: &Policy, v: &[u8]) -> bool {
    let Some(ip) = std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse::<IpAddr>().ok())
        .map(|ip| ip.to_canonical())
    else {
        return false;
    };
    if p.rip == RipRule::Substitute(ip) {
        return true;
    }
    !p.gateways.iter().any(|g| g.to_canonical() == ip)
        && !p.reserved.iter().any(|n: &Cidr| n.contains(&ip))
}

fn check_line(p: &Policy, input: &[u8], output: &[u8]) {
    assert!(
        !output.contains(&0) && !output.contains(&b'\r'),
        "raw NUL/CR emitted"
    );
    let in_fields: Vec<&[u8]> = input.split(|&b| b == b'\t').collect();
    if in_fields[0] != b"AUTH" || input.len() == 4 {
        assert_eq!(input, output, "a non-AUTH line was changed");
        return;
    }
    let out_fields: Vec<&[u8]> = output.split(|&b| b == b'\t').collect();
    let npos = in_fields.len().min(3);
    assert_eq!(
        in_fields[..npos],
        out_fields[..npos],
        "positional fields changed"
    );
    let in_params = &in_fields[npos..];
    // A set, not a scan: a 4 KiB line can hold thousands of fields.
    let own: HashSet<&[u8]> = in_params.iter().copied().collect();
    let addr = match p.rip {
        RipRule::Substitute(a) => Some(a.to_string()),
        RipRule::Drop => None,
    };
    let mut have_rip = false;
    for f in &out_fields[npos..] {
        let k = key(f);
        let ks = String::from_utf8_lossy(k);
        assert!(!is_trust_field(&ks), "trust field {ks:?} passed");
        assert!(
            k == b"resp" || p.allow.iter().any(|a| a.as_bytes() == k),
            "key {ks:?} not on the allow-list passed"
        );
        let rewritten = addr.as_ref().is_some_and(|a| {
            f.len() == k.len() + 1 + a.len() && f.ends_with(a.as_bytes()) && f[k.len()] == b'='
        });
        assert!(
            own.contains(f) || ((k == b"rip" || k == b"real_rip") && rewritten),
            "a parameter that is not the guest's own: {:?}",
            String::from_utf8_lossy(f)
        );
        if k == b"rip" {
            have_rip = true;
            assert!(
                is_client(p, &f[4..]),
                "rip {:?} is a gateway, another app's or not an address",
                String::from_utf8_lossy(f)
            );
        }
    }
    if let Some(a) = &addr {
        assert!(have_rip, "substitute: AUTH line without rip");
        let rips = in_params
            .iter()
            .filter(|f| matches!(key(f), b"rip" | b"real_rip"))
            .count();
        assert!(
            output.len() <= input.len() + (rips + 1) * (5 + a.len()),
            "line grew by more than its rip rewrites"
        );
    } else {
        assert!(output.len() <= input.len(), "drop: line grew");
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let p = &POLICIES[data[0] as usize % 3];
    let step = data[1] as usize % 32 + 1;
    let stream = &data[2..];
    let whole = feed(p, stream, usize::MAX);
    let pieces = feed(p, stream, step);
    assert_eq!(
        whole, pieces,
        "the result depends on how the stream was cut"
    );
    let (Ok(()), out) = whole else { return };
    let mut in_lines: Vec<&[u8]> = stream.split(|&b| b == b'\n').collect();
    in_lines.pop(); // the unfinished tail stays pending, never forwarded
    assert_eq!(out.last().map_or(true, |&b| b == b'\n'), true);
    let mut out_lines: Vec<&[u8]> = out.split(|&b| b == b'\n').collect();
    out_lines.pop();
    assert_eq!(in_lines.len(), out_lines.len(), "lines added or lost");
    for (i, o) in in_lines.iter().zip(&out_lines) {
        check_line(p, i, o);
    }
});
