//! guest-init's configuration: `Config::parse`, then `Config::validate` (which reads only
//! the passwd and group databases, nothing else).
//!
//! Asserts, beyond "no panic": a parse error names a field and a position; an accepted
//! configuration has version 1, an absolute `modules_dir` and `app.workdir`, a non-empty
//! `app.command`, and serializes and parses back to one that is accepted again.
#![no_main]

use guest_init::config::{Config, ConfigError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let c = match Config::parse(text) {
        Ok(c) => c,
        Err(ConfigError::Parse { field, .. }) => {
            assert!(!field.is_empty());
            return;
        }
        Err(e) => panic!("parse returned a non-parse error: {e}"),
    };
    if c.validate().is_err() {
        return;
    }
    assert_eq!(c.version, 1);
    assert!(c.modules_dir.is_absolute());
    assert!(c.app.workdir.is_absolute());
    assert!(!c.app.command.is_empty() && !c.app.command[0].is_empty());
    let again = serde_json::to_string(&c).unwrap();
    let c2 = Config::parse(&again)
        .unwrap_or_else(|e| panic!("an accepted config does not round-trip: {e}\n{again}"));
    c2.validate()
        .unwrap_or_else(|e| panic!("a round-tripped config is refused: {e}\n{again}"));
});
