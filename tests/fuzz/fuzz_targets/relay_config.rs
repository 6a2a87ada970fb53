//! host-relay's configuration: `Config::parse` (serde, then `validate`).
//!
//! Asserts, beyond "no panic": an accepted configuration serializes and parses back to an
//! accepted one with the same listeners; every listener and every service's instance
//! builds; no dovecot-auth filter policy it yields allows a trust field or `resp` in its
//! list, and a substituted client address is never one of the VM's gateways; every
//! `max_upstream` is 1 to 65,535; a parse error names a field (`.` for the document).
#![no_main]

use host_relay::config::{Config, ConfigError};
use host_relay::dovecot::{is_trust_field, RipRule};
use host_relay::serve::instance;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let c = match Config::parse(text) {
        Ok(c) => c,
        Err(e) => {
            if let ConfigError::Parse { field, .. } = &e {
                assert!(!field.is_empty(), "a parse error names no field: {e}");
            }
            return;
        }
    };
    let listeners = c.listeners();
    assert_eq!(listeners.len(), c.services.len() + c.undeclared.len());
    for (i, s) in c.services.iter().enumerate() {
        assert!((1..=65_535).contains(&s.max_upstream));
        let inst = instance(&c, Some(i), &s.name);
        if let Some(p) = &inst.filter {
            for k in &p.allow {
                assert!(!is_trust_field(k), "trust field {k:?} allowed");
                assert_ne!(k, "resp");
            }
            if let RipRule::Substitute(a) = p.rip {
                assert!(!p.gateways.contains(&a), "client address is a gateway");
            }
        }
    }
    for u in &c.undeclared {
        let inst = instance(&c, None, &u.name);
        assert!(inst.upstream.is_none() && inst.filter.is_none());
    }
    let again = serde_json::to_string(&c).unwrap();
    let c2 = Config::parse(&again)
        .unwrap_or_else(|e| panic!("an accepted config does not round-trip: {e}\n{again}"));
    assert_eq!(c2.listeners(), listeners);
});
