//! Renewal: a new certificate for the same key, authenticated by the enrolled machine.
//!
//! Seed 002: renewal must authenticate the enrolled machine rather than reuse bootstrap
//! authority. The bootstrap token is single-use and short-lived (it may be gone from the
//! VM); what proves the VM is the VM is its enrolled key, so renewal is mutual TLS 1.3 in
//! which the client certificate is the enrolled certificate and the handshake signature
//! comes from the key store ([`tls`]). No token is read, sent or needed.
//!
//! **When.** PID 1 runs [`run`] after enrollment. It renews at
//! `renew_at_percent_of_lifetime` (default 67, validated 10..=90) of the certificate's
//! notBefore→notAfter, by the guest clock; it re-reads the enrolled state at least every
//! [`RECHECK`] so a re-enrollment (a pushed higher epoch) is picked up.
//!
//! **Where.** The enrollment service, through the same port enrollment used: the
//! configured `service`, else vsock CID 2 and the `enrollment_port` recorded with the
//! certificate (the material may be gone). The service tells TLS from the enrollment
//! protocol's JSON by the first byte.
//!
//! **What is checked here.** The service's server certificate ([`tls::check_service`]);
//! the renewed certificate exactly as enrollment checks one ([`super::verify`]: issued by
//! the CA recorded with the enrolled certificate, our key, our identity, validity,
//! profile), then it is stored durably and published ([`super::state`]), and a running
//! agent serves it on new handshakes.
//!
//! **Failures.** Retryable ones (service unreachable, handshake failure, a retryable code, a
//! certificate that fails verification) are retried with the enrollment `retry` policy's
//! capped exponential backoff and jitter (`initial_ms`, `max_ms`; attempts are bounded by the
//! certificate's `notAfter`, not by `max_attempts`). The current certificate stays in use
//! until it expires. A final refusal (`identity_changed`: the VM was reset or its epoch
//! raised) ends renewal for that certificate: only new bootstrap material can give the VM
//! an identity again. Every attempt and result is logged with the identity, the endpoint
//! and the certificates' SHA-256, never key material.
//!
//! Threat: an identity outliving its revocation through renewal (the service checks the
//! current identity on every renewal), renewal by a holder of (possibly leaked) bootstrap
//! material instead of the machine, and a VM losing its identity to a transient outage.

pub mod tls;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use super::client::AttemptError;
use super::material::hex;
use super::{csr, EnrollConfig, EnrollError};
use vm_transport::vsock::VMADDR_CID_HOST;
use vm_transport::Endpoint;

/// How often the loop re-reads the enrolled state while it waits.
pub const RECHECK: Duration = Duration::from_secs(5);

/// The default `renew_at_percent_of_lifetime`.
pub fn default_percent() -> u8 {
    67
}

/// `renew_at_percent_of_lifetime` must leave time to retry and must not renew constantly.
pub fn validate_percent(p: u8) -> Result<(), String> {
    if !(10..=90).contains(&p) {
        return Err(format!(
            "renew_at_percent_of_lifetime: {p} is outside 10..=90; renewing later leaves no time to retry before the certificate expires, earlier renews constantly (default 67)"
        ));
    }
    Ok(())
}

/// The certificate's notBefore and notAfter, Unix seconds.
pub fn validity(der: &[u8]) -> Option<(i64, i64)> {
    let (_, c) = x509_parser::parse_x509_certificate(der).ok()?;
    Some((
        c.validity().not_before.timestamp(),
        c.validity().not_after.timestamp(),
    ))
}

/// When to renew: `percent` of the way from `not_before` to `not_after`.
pub fn renew_at(not_before: i64, not_after: i64, percent: u8) -> i64 {
    not_before + (not_after - not_before).max(0) * i64::from(percent) / 100
}

fn now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// The enrolled certificate bytes now, if any.
fn current_cert(cfg: &EnrollConfig) -> Option<Vec<u8>> {
    super::credentials(cfg).ok().map(|c| c.cert_der)
}

/// Waits until the enrolled certificate is no longer `cert` (a re-enrollment).
async fn wait_for_change(cfg: &EnrollConfig, cert: &[u8]) {
    loop {
        tokio::time::sleep(RECHECK).await;
        if current_cert(cfg).is_some_and(|c| c != cert) {
            return;
        }
    }
}

/// PID 1's renewal loop; never returns. `agent`, when running, serves each renewed
/// certificate on new handshakes.
pub async fn run(cfg: EnrollConfig, agent: Option<crate::agent::Handle>) {
    loop {
        let creds = match super::credentials(&cfg) {
            Ok(c) => c,
            Err(e) => {
                crate::warn!("renew: no enrolled certificate to renew ({e}); checking again");
                tokio::time::sleep(RECHECK).await;
                continue;
            }
        };
        let uri = creds.identity.uri();
        let Some((nb, na)) = validity(&creds.cert_der) else {
            crate::error!(
                "renew: the enrolled certificate of {uri} cannot be parsed; not renewing it"
            );
            wait_for_change(&cfg, &creds.cert_der).await;
            continue;
        };
        let at = renew_at(nb, na, cfg.renew_at_percent_of_lifetime);
        crate::info!(
            "renew: the certificate of {uri} (sha256 {}) is valid until {na}; renewing at {at} ({}% of its lifetime)",
            hex(&Sha256::digest(&creds.cert_der)),
            cfg.renew_at_percent_of_lifetime
        );
        // Wait for the renewal time, re-reading the state: a re-enrollment starts over.
        let mut changed = false;
        while now_s() < at {
            let left = Duration::from_secs((at - now_s()).max(0) as u64);
            tokio::time::sleep(left.min(RECHECK)).await;
            if current_cert(&cfg).is_some_and(|c| c != creds.cert_der) {
                changed = true;
                break;
            }
        }
        if changed {
            continue;
        }
        renew_one(&cfg, creds, na, agent.as_ref()).await;
    }
}

/// Renews `creds` (valid until `not_after`): retries until renewed, refused, or expired.
async fn renew_one(
    cfg: &EnrollConfig,
    creds: super::Credentials,
    not_after: i64,
    agent: Option<&crate::agent::Handle>,
) {
    let uri = creds.identity.uri();
    let Some(service) = cfg.service.clone().or_else(|| {
        creds.enrollment_port.map(|port| Endpoint::Vsock {
            cid: VMADDR_CID_HOST,
            port,
        })
    }) else {
        crate::error!("renew: no enrollment port is recorded for {uri} (enrolled by an older guest-init) and no service is configured; not renewing");
        wait_for_change(cfg, &creds.cert_der).await;
        return;
    };
    let mut failures = 0u32;
    loop {
        if now_s() >= not_after {
            crate::error!("renew: the certificate of {uri} expired at {not_after} before it could be renewed; the VM needs new bootstrap material to enroll again");
            wait_for_change(cfg, &creds.cert_der).await;
            return;
        }
        crate::info!("renew: attempt {} for {uri} to {service}", failures + 1);
        let result = match csr::build(&*creds.key, &creds.identity) {
            Ok(csr) => {
                let timeout = Duration::from_millis(cfg.timeout_ms);
                tls::attempt(
                    &service,
                    &creds.ca,
                    &creds.cert_der,
                    creds.key.clone(),
                    &csr,
                    timeout,
                )
                .await
            }
            Err(e) => Err(AttemptError::Retryable(format!(
                "cannot build the CSR: {e}"
            ))),
        };
        let why = match result {
            Ok(cert) => match store(cfg, &creds, &cert).await {
                Ok(true) => {
                    let until = validity(&cert).map_or(0, |v| v.1);
                    crate::info!(
                        "renew: renewed {uri}: new certificate sha256 {} valid until {until}, same key",
                        hex(&Sha256::digest(&cert))
                    );
                    if let Some(a) = agent {
                        a.renewed(cert, creds.key.clone(), until);
                    }
                    return;
                }
                Ok(false) => {
                    crate::info!("renew: {uri} was re-enrolled meanwhile; the renewal is dropped");
                    return;
                }
                Err(e) => format!("the renewed certificate was not stored: {e}"),
            },
            Err(AttemptError::Final { code, message }) => {
                crate::error!("renew: refused for {uri} (final, {code}): {message}; the current certificate stays in use until it expires at {not_after}; a new identity needs new bootstrap material");
                wait_for_change(cfg, &creds.cert_der).await;
                return;
            }
            Err(AttemptError::Retryable(why)) => why,
        };
        failures += 1;
        let left = Duration::from_secs((not_after - now_s()).max(1) as u64);
        let d = cfg.retry.delay(failures).min(left);
        crate::warn!(
            "renew: attempt {failures} for {uri} failed (retryable): {why}; the current certificate stays in use (valid until {not_after}); retrying in {} ms",
            d.as_millis()
        );
        tokio::time::sleep(d).await;
    }
}

/// Stores the renewal of `creds` under the enrollment lock.
async fn store(
    cfg: &EnrollConfig,
    creds: &super::Credentials,
    cert: &[u8],
) -> Result<bool, EnrollError> {
    let store = super::OpenStore::open(cfg)?;
    super::enroller(cfg, store.get(), false)
        .store_renewed(&creds.identity, &creds.cert_der, cert)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renews_at_the_configured_fraction_and_refuses_bad_fractions() {
        assert_eq!(renew_at(1000, 1120, 67), 1080);
        assert_eq!(renew_at(0, 100, 90), 90);
        for bad in [0, 9, 91, 100, 255] {
            let e = validate_percent(bad).unwrap_err();
            assert!(e.contains("renew_at_percent_of_lifetime"), "{e}");
        }
        for good in [10, 67, 90] {
            validate_percent(good).unwrap();
        }
    }
}
