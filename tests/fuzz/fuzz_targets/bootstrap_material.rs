//! guest-init's bootstrap material parser (the per-clone JSON with the enrollment token).
//!
//! Asserts, beyond "no panic":
//! - accepted material is version 1, its token 32 to 256 characters of `A-Za-z0-9-_`, its
//!   enrollment port neither 0 nor 4294967295, its identity well-formed;
//! - accepted material re-parses: every field the input gave is what came out, the pinned
//!   management CA included (its DER is exactly the input's base64);
//! - **an error never quotes the token**: when the input names a token-like string of 32+
//!   characters, the error message does not contain it (nor does `Debug` of accepted
//!   material).
#![no_main]

use guest_init::enroll::material::{Material, MAX_MATERIAL_BYTES};
use libfuzzer_sys::fuzz_target;

fn token_like(s: &str) -> bool {
    s.len() >= 32
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Every string in the input's JSON that could be a token, in any position.
fn candidates(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::String(s) if token_like(s) => out.push(s.clone()),
        serde_json::Value::Array(a) => a.iter().for_each(|x| candidates(x, out)),
        serde_json::Value::Object(o) => {
            for (k, x) in o {
                if token_like(k) {
                    out.push(k.clone());
                }
                candidates(x, out);
            }
        }
        _ => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let parsed = Material::parse(data, "/run/guest-init/bootstrap.json");
    let mut secrets = Vec::new();
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        candidates(&v, &mut secrets);
    }
    match parsed {
        Ok(m) => {
            assert!(data.len() <= MAX_MATERIAL_BYTES);
            assert_eq!(m.version, 1);
            let t = m.token.expose();
            assert!((32..=256).contains(&t.len()));
            assert!(t
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
            assert!(m.enrollment_port != 0 && m.enrollment_port != u32::MAX);
            assert!(m.identity().check().is_ok());
            let dbg = format!("{m:?}");
            assert!(!dbg.contains(t), "Debug shows the token");
            let v: serde_json::Value = serde_json::from_slice(data).unwrap();
            assert_eq!(v["token"].as_str(), Some(t));
            assert_eq!(v["revocation_epoch"].as_u64(), Some(m.revocation_epoch));
            assert_eq!(v["vm_uid"].as_str(), Some(m.vm_uid.as_str()));
            use base64::Engine;
            let ca = v["management_ca"]
                .as_str()
                .expect("management_ca is required");
            let der = base64::engine::general_purpose::STANDARD
                .decode(ca.trim())
                .expect("accepted management_ca is base64");
            assert_eq!(der, m.management_ca.der());
        }
        Err(e) => {
            let msg = e.to_string();
            let dbg = format!("{e:?}");
            for s in &secrets {
                assert!(
                    !msg.contains(s.as_str()),
                    "an error quotes a token-like input"
                );
                assert!(
                    !dbg.contains(s.as_str()),
                    "an error's Debug quotes a token-like input"
                );
            }
        }
    }
});
