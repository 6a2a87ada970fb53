//! The X.509 checks the platform's certificate profiles have in common.
//!
//! Each profile (operator, enrollment service, guest workload) is written out in its own
//! module with its threat; these are the steps two or more of them take, so that a step
//! reads, and fails, the same way everywhere:
//!
//! - [`parse_one`]: exactly one DER certificate, nothing after it (trailing bytes could
//!   hide a second certificate that another parser reads instead);
//! - [`check_validity`]: `notBefore <= now + skew` and `now < notAfter`. `skew` is a
//!   tolerance for a clock *behind* the CA (a guest's clock comes from the RTC and may be
//!   off at boot); `notAfter` is always strict: an expired certificate is never
//!   stretched;
//! - [`require_end_entity`]: not a CA (`basicConstraints` `cA` absent or false);
//! - [`require_purpose`]: `extendedKeyUsage` present and holding the purpose the peer
//!   plays (`clientAuth` for an operator, `serverAuth` for a service);
//! - [`uri_names`] and [`san_names`]: the subject alternative names a profile compares
//!   with the identity it expects.
//!
//! A malformed extension is an error naming it, never read as absent: an unreadable
//! `basicConstraints` must not pass as "not a CA".
//!
//! Threat: a CA certificate, a certificate for another purpose, an expired or not-yet-valid
//! one, or one carrying extra names being admitted because one profile's copy of a check
//! drifted from the others.

use std::time::Duration;

use x509_parser::prelude::*;

/// Parses `der` as exactly one X.509 certificate.
pub fn parse_one(der: &[u8]) -> Result<X509Certificate<'_>, String> {
    let (rest, cert) =
        X509Certificate::from_der(der).map_err(|e| format!("not a DER X.509 certificate: {e}"))?;
    if !rest.is_empty() {
        return Err("bytes follow the certificate".into());
    }
    Ok(cert)
}

/// Why a certificate is outside its validity window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutsideValidity {
    /// `notBefore` is more than the tolerance ahead of now.
    NotYetValid,
    /// `notAfter` is now or past.
    Expired,
}

/// Checks the validity window at `now` (Unix seconds), with `skew` of tolerance for a
/// clock behind the CA on `notBefore` only.
pub fn check_validity(
    cert: &X509Certificate<'_>,
    now: i64,
    skew: Duration,
) -> Result<(), OutsideValidity> {
    let v = cert.validity();
    if v.not_before.timestamp() > now.saturating_add(skew.as_secs() as i64) {
        return Err(OutsideValidity::NotYetValid);
    }
    if v.not_after.timestamp() <= now {
        return Err(OutsideValidity::Expired);
    }
    Ok(())
}

/// Refuses a CA certificate (or one whose `basicConstraints` cannot be read).
pub fn require_end_entity(cert: &X509Certificate<'_>) -> Result<(), String> {
    let bc = cert
        .basic_constraints()
        .map_err(|e| format!("basicConstraints is malformed: {e}"))?;
    if bc.is_some_and(|b| b.value.ca) {
        return Err("it is a CA certificate".into());
    }
    Ok(())
}

/// The role a peer's certificate must allow (`extendedKeyUsage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// `id-kp-clientAuth`: the peer is a TLS client.
    ClientAuth,
    /// `id-kp-serverAuth`: the peer is a TLS server.
    ServerAuth,
}

impl Purpose {
    fn name(self) -> &'static str {
        match self {
            Purpose::ClientAuth => "clientAuth",
            Purpose::ServerAuth => "serverAuth",
        }
    }
}

/// Requires `extendedKeyUsage` with `purpose` (other purposes may accompany it).
pub fn require_purpose(cert: &X509Certificate<'_>, purpose: Purpose) -> Result<(), String> {
    let eku = cert
        .extended_key_usage()
        .map_err(|e| format!("extendedKeyUsage is malformed: {e}"))?
        .ok_or_else(|| format!("it has no extendedKeyUsage ({} needed)", purpose.name()))?;
    let has = match purpose {
        Purpose::ClientAuth => eku.value.client_auth,
        Purpose::ServerAuth => eku.value.server_auth,
    };
    if !has {
        return Err(format!("extendedKeyUsage lacks {}", purpose.name()));
    }
    Ok(())
}

/// The URI subject alternative names, in order (other kinds of name are skipped).
pub fn uri_names<'a>(cert: &'a X509Certificate<'_>) -> Result<Vec<&'a str>, String> {
    Ok(general_names(cert)?
        .into_iter()
        .filter_map(|n| match n {
            GeneralName::URI(u) => Some(*u),
            _ => None,
        })
        .collect())
}

/// Every subject alternative name, in order: a URI as itself, any other name as
/// x509-parser prints it (`DNSName(...)`, `IPAddress(...)`, ...).
pub fn san_names(cert: &X509Certificate<'_>) -> Result<Vec<String>, String> {
    Ok(general_names(cert)?
        .into_iter()
        .map(|n| match n {
            GeneralName::URI(u) => u.to_string(),
            other => format!("{other}"),
        })
        .collect())
}

fn general_names<'a>(cert: &'a X509Certificate<'_>) -> Result<Vec<&'a GeneralName<'a>>, String> {
    let san = cert
        .subject_alternative_name()
        .map_err(|e| format!("subjectAltName is malformed: {e}"))?;
    Ok(san
        .iter()
        .flat_map(|s| s.value.general_names.iter())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    fn cert(edit: impl FnOnce(&mut rcgen::CertificateParams)) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.is_ca = rcgen::IsCa::ExplicitNoCa;
        edit(&mut p);
        p.self_signed(&key).unwrap().der().to_vec()
    }

    fn at(secs: u64) -> std::time::SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn parse_one_takes_exactly_one_certificate() {
        let der = cert(|_| {});
        assert!(parse_one(&der).is_ok());
        let mut more = der.clone();
        more.push(0);
        assert_eq!(
            parse_one(&more).err().unwrap(),
            "bytes follow the certificate"
        );
        let e = parse_one(b"junk").err().unwrap();
        assert!(e.starts_with("not a DER X.509 certificate"), "{e}");
    }

    #[test]
    fn the_validity_window_holds_to_the_second() {
        let (nb, na) = (1_000_000_i64, 2_000_000_i64);
        let der = cert(|p| {
            p.not_before = at(nb as u64).into();
            p.not_after = at(na as u64).into();
        });
        let c = parse_one(&der).unwrap();
        let zero = Duration::ZERO;
        let skew = Duration::from_secs(60);
        assert_eq!(check_validity(&c, nb, zero), Ok(()));
        assert_eq!(
            check_validity(&c, nb - 1, zero),
            Err(OutsideValidity::NotYetValid)
        );
        assert_eq!(check_validity(&c, nb - 60, skew), Ok(()));
        assert_eq!(
            check_validity(&c, nb - 61, skew),
            Err(OutsideValidity::NotYetValid)
        );
        assert_eq!(check_validity(&c, na - 1, zero), Ok(()));
        assert_eq!(check_validity(&c, na, zero), Err(OutsideValidity::Expired));
        // The tolerance never stretches notAfter.
        assert_eq!(
            check_validity(&c, na, Duration::from_secs(3600)),
            Err(OutsideValidity::Expired)
        );
    }

    #[test]
    fn a_ca_certificate_is_not_an_end_entity() {
        for is_ca in [rcgen::IsCa::ExplicitNoCa, rcgen::IsCa::NoCa] {
            let der = cert(|p| p.is_ca = is_ca);
            assert_eq!(require_end_entity(&parse_one(&der).unwrap()), Ok(()));
        }
        let der = cert(|p| p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained));
        assert_eq!(
            require_end_entity(&parse_one(&der).unwrap()),
            Err("it is a CA certificate".into())
        );
    }

    #[test]
    fn the_purpose_must_be_in_extended_key_usage() {
        use rcgen::ExtendedKeyUsagePurpose as P;
        let none = cert(|_| {});
        assert_eq!(
            require_purpose(&parse_one(&none).unwrap(), Purpose::ClientAuth),
            Err("it has no extendedKeyUsage (clientAuth needed)".into())
        );
        let server = cert(|p| p.extended_key_usages = vec![P::ServerAuth]);
        let server = parse_one(&server).unwrap();
        assert_eq!(
            require_purpose(&server, Purpose::ClientAuth),
            Err("extendedKeyUsage lacks clientAuth".into())
        );
        assert_eq!(require_purpose(&server, Purpose::ServerAuth), Ok(()));
        let client = cert(|p| p.extended_key_usages = vec![P::ClientAuth]);
        let client = parse_one(&client).unwrap();
        assert_eq!(require_purpose(&client, Purpose::ClientAuth), Ok(()));
        assert_eq!(
            require_purpose(&client, Purpose::ServerAuth),
            Err("extendedKeyUsage lacks serverAuth".into())
        );
    }

    #[test]
    fn names_keep_their_order_and_kind() {
        let der = cert(|p| {
            p.subject_alt_names = vec![
                rcgen::SanType::URI("urn:a".try_into().unwrap()),
                rcgen::SanType::DnsName("b.example".try_into().unwrap()),
                rcgen::SanType::URI("urn:c".try_into().unwrap()),
            ]
        });
        let c = parse_one(&der).unwrap();
        assert_eq!(uri_names(&c).unwrap(), ["urn:a", "urn:c"]);
        let all = san_names(&c).unwrap();
        assert_eq!(all.len(), 3, "{all:?}");
        assert_eq!((all[0].as_str(), all[2].as_str()), ("urn:a", "urn:c"));
        assert!(
            all[1].contains("b.example") && all[1] != "b.example",
            "{all:?}"
        );
        let none = cert(|_| {});
        let none = parse_one(&none).unwrap();
        assert!(uri_names(&none).unwrap().is_empty());
        assert!(san_names(&none).unwrap().is_empty());
    }
}
