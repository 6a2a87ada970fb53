//! Enrollment: the VM's own key and a certificate for its current identity.
//!
//! The platform's enrollment service (seed 002) gives a certificate to whoever presents an
//! unexpired single-purpose bootstrap token together with a CSR, commits the *first* CSR for
//! that token, gives the identical certificate to an identical retry, and denies any other
//! CSR. It fences on the VM UID and the revocation epoch (seed 000). This module is the
//! guest side that service needs:
//!
//! - [`material`]: the bootstrap material (identity, secret token, expiry, port, pinned
//!   management CA), strict and bounded, from a root-only file or a one-time host push;
//! - [`push`]: the one-time bootstrap push from the host;
//! - [`ca`]: the pinned management CA and the signature check of issued certificates;
//! - [`identity`]: the identity and its URI form in the CSR and certificate;
//! - [`keystore`] with [`file_store`], [`memory_store`] and `tpm` (the VM's TPM 2.0): where
//!   the P-256 key lives (the file and TPM stores keep one file per key slot the same
//!   way, `slot_files`);
//! - [`csr`]: the CSR, signed through rcgen's external-signer traits;
//! - [`protocol`] and [`client`]: the versioned one-line JSON exchange and its retries;
//! - [`verify`]: checks on the returned certificate (issuer, key, validity, identity,
//!   profile);
//! - [`state`]: the durable state machine tying them together (persist before send,
//!   identical retries, epoch floor, identity changes, the lock);
//! - [`files`]: atomic, durable, private file writes.
//!
//! Entry points: [`boot_step`] (PID 1, after the forwarders are up, before the app starts)
//! and [`cli_main`] (`guest-init enroll --config FILE`). Both read the `enrollment` section
//! ([`EnrollConfig`]). The protocol, identity binding and stores are described for
//! operators in `docs/ENROLLMENT.md`.
//!
//! Trust: a pushed document may come from any host process, so with a push source the
//! service endpoint must be configured (the document does not choose it), a refused
//! document is discarded and the guest waits for another push, and only an epoch the
//! service confirmed becomes the floor. `guest-init enroll` refuses the memory store (its
//! key would die with the process).
//!
//! Secrets: the token lives only in [`material::Token`] (wiped on drop, never printed) and
//! the wiped request buffer; private keys only inside a key store. No error or log line in
//! this module formats either; errors carry paths, field names, codes and hashes.

pub mod ca;
pub mod client;
pub mod csr;
pub mod file_store;
pub mod files;
pub mod identity;
pub mod keystore;
pub mod material;
pub mod memory_store;
pub mod protocol;
pub mod push;
pub mod renew;
mod slot_files;
pub mod state;
#[cfg(feature = "tpm")]
pub mod tpm;
pub mod verify;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use client::RetryPolicy;
use keystore::KeyStore;
pub use protocol::ErrorCode;
pub use state::Outcome;

use vm_transport::Endpoint;

/// Where the bootstrap material comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum BootstrapSource {
    /// A root-owned file of mode 0600 (image or config disk).
    File(PathBuf),
    /// A push from the host: listen on this endpoint (usually
    /// `{"vsock": {"cid": 4294967295, "port": N}}`) and accept the first valid document;
    /// one the service refuses is discarded and the guest listens again. Needs `service`.
    Push {
        /// Where to listen.
        listen: Endpoint,
    },
}

/// Which key store holds the private key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyStoreKind {
    /// PKCS#8 files in the root-only state directory; survives reboots.
    #[default]
    File,
    /// Protected memory only; re-enroll every boot. Not for `guest-init enroll`.
    Memory,
    /// Created in the VM's TPM 2.0 (`/dev/tpmrm0`); only a TPM-wrapped blob on disk.
    Tpm,
}

/// The default state directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/guest-init/enroll";
/// The default publish directory (`cert.pem` for local consumers).
pub const DEFAULT_PUBLISH_DIR: &str = "/run/guest-init/identity";

fn default_state_dir() -> PathBuf {
    PathBuf::from(DEFAULT_STATE_DIR)
}
fn default_publish_dir() -> PathBuf {
    PathBuf::from(DEFAULT_PUBLISH_DIR)
}
fn default_timeout_ms() -> u64 {
    10_000
}

/// The `enrollment` section of the configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnrollConfig {
    /// Where the bootstrap material comes from.
    pub bootstrap: BootstrapSource,
    /// The key store (`file`, `memory` or `tpm`; default `file`).
    #[serde(default)]
    pub key_store: KeyStoreKind,
    /// Root-only state directory (key files, CSR, records, the epoch floor). Default
    /// `/var/lib/guest-init/enroll`. Keep it on a persistent disk with either store: the
    /// epoch floor lives there (with the memory store it holds no key).
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// Where `cert.pem` is published, world-readable. Default `/run/guest-init/identity`.
    #[serde(default = "default_publish_dir")]
    pub publish_dir: PathBuf,
    /// The service endpoint. Default: vsock CID 2, the material's `enrollment_port`
    /// (host-relay). Required with a push source. Tests set a Unix socket.
    #[serde(default)]
    pub service: Option<Endpoint>,
    /// Per-attempt deadline in milliseconds (connect, send, answer). Default 10000.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Retry policy for retryable errors.
    #[serde(default)]
    pub retry: RetryPolicy,
    /// The management CA the image pins (standard base64 of its DER). Required with a push
    /// source: a pushed document must not choose the CA it is checked against. With a file
    /// source it is optional; when set, the material's `management_ca` must be this CA.
    #[serde(default)]
    pub management_ca: Option<ca::ManagementCa>,
    /// When PID 1 renews the certificate, as a percentage of its lifetime (notBefore to
    /// notAfter), over mutual TLS with the certificate itself (see [`renew`]). Default 67;
    /// 10 to 90.
    #[serde(default = "renew::default_percent")]
    pub renew_at_percent_of_lifetime: u8,
}

/// An enrollment error. Messages never contain the token or key material.
#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    /// The configuration section is invalid.
    #[error("enrollment configuration: {0}")]
    Config(String),
    /// The bootstrap material is unusable.
    #[error(transparent)]
    Material(#[from] material::MaterialError),
    /// No material and no valid enrollment.
    #[error(
        "no bootstrap material and no valid enrolled certificate; provision bootstrap material"
    )]
    NoMaterial,
    /// The material's epoch is lower than the highest epoch the service has confirmed.
    #[error("bootstrap material has revocation epoch {offered}, lower than the enrolled epoch {floor} (the highest the service has confirmed for this VM); epochs only go up, provision current material")]
    EpochRollback {
        /// The material's epoch.
        offered: u64,
        /// The floor: the highest confirmed epoch.
        floor: u64,
    },
    /// The key store failed.
    #[error(transparent)]
    KeyStore(#[from] keystore::KeyStoreError),
    /// The pending CSR's key is gone (memory store after a restart) and the token is the same.
    #[error("the key of the pending CSR is gone (memory key store restarted); the service denies a second CSR for the same token, so provision fresh bootstrap material")]
    KeyLost,
    /// The state directory failed.
    #[error("enrollment state: {what}: {source}")]
    State {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The CSR could not be built.
    #[error("cannot build the CSR: {0}")]
    Csr(String),
    /// The service refused for good.
    #[error("enrollment denied ({code}): {message}")]
    Denied {
        /// The service's code.
        code: ErrorCode,
        /// Its explanation.
        message: String,
    },
    /// Every attempt failed with a retryable error.
    #[error("enrollment service unavailable after {attempts} attempts: {last}")]
    Unavailable {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        last: String,
    },
    /// The returned certificate failed verification.
    #[error("the returned certificate was rejected: {0}")]
    BadCertificate(String),
}

impl EnrollError {
    /// Whether a later run with the same material could succeed (the service was
    /// unavailable), as opposed to a final refusal or a local fault.
    pub fn retryable(&self) -> bool {
        matches!(self, EnrollError::Unavailable { .. })
    }

    /// Whether the error condemns the material itself (the service refused it, its epoch
    /// is below the floor, its key is lost, or its certificate failed verification), as
    /// opposed to a local fault or an unavailable service. A guest waiting for pushes
    /// discards such material and waits for the next push.
    pub fn refuses_material(&self) -> bool {
        matches!(
            self,
            EnrollError::Denied { .. }
                | EnrollError::EpochRollback { .. }
                | EnrollError::KeyLost
                | EnrollError::BadCertificate(_)
        )
    }

    /// The process exit code for `guest-init enroll`: 2 configuration or material, 3 final
    /// refusal (denied, rollback, key lost, bad certificate), 4 unavailable, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            EnrollError::Config(_) | EnrollError::Material(_) | EnrollError::NoMaterial => 2,
            EnrollError::Denied { .. }
            | EnrollError::EpochRollback { .. }
            | EnrollError::KeyLost
            | EnrollError::BadCertificate(_) => 3,
            EnrollError::Unavailable { .. } => 4,
            _ => 1,
        }
    }
}

/// Checks the section without touching the system; `Err` names the field and the fix.
pub fn validate(cfg: &EnrollConfig) -> Result<(), String> {
    match &cfg.bootstrap {
        BootstrapSource::File(p) if !p.is_absolute() => {
            return Err(format!(
                "bootstrap.file: {} is relative; use an absolute path",
                p.display()
            ))
        }
        BootstrapSource::Push { listen } => {
            listen
                .validate()
                .map_err(|e| format!("bootstrap.push.listen: {e}"))?;
            // Any host process may push: a pushed document must not choose where the
            // token goes, which service confirms the epoch, or which CA it trusts.
            if cfg.service.is_none() {
                return Err(
                    "service: required with bootstrap.push (a pushed document must not choose the enrollment service); set it, e.g. {\"vsock\": {\"cid\": 2, \"port\": 5002}}".into(),
                );
            }
            if cfg.management_ca.is_none() {
                return Err(
                    "management_ca: required with bootstrap.push (a pushed document must not choose the CA its certificate is checked against); set it to the base64 DER of the management CA certificate".into(),
                );
            }
        }
        _ => {}
    }
    for (field, p) in [
        ("state_dir", &cfg.state_dir),
        ("publish_dir", &cfg.publish_dir),
    ] {
        if !p.is_absolute() || p == Path::new("/") {
            return Err(format!(
                "{field}: {} must be an absolute path below /",
                p.display()
            ));
        }
    }
    if cfg.publish_dir.starts_with(&cfg.state_dir) || cfg.state_dir.starts_with(&cfg.publish_dir) {
        return Err(
            "publish_dir: must not be inside state_dir or contain it (the state is root-only, the published certificate world-readable)".into(),
        );
    }
    if let Some(s) = &cfg.service {
        s.validate().map_err(|e| format!("service: {e}"))?;
    }
    if cfg.timeout_ms == 0 {
        return Err("timeout_ms: must be at least 1".into());
    }
    renew::validate_percent(cfg.renew_at_percent_of_lifetime)?;
    let r = &cfg.retry;
    if r.max_attempts == 0 || r.initial_ms == 0 || r.max_ms < r.initial_ms {
        return Err(
            "retry: needs max_attempts >= 1, initial_ms >= 1 and max_ms >= initial_ms".into(),
        );
    }
    Ok(())
}

/// The process-wide memory store: keys must outlive one enrollment run (they are the
/// VM's identity until the next boot).
fn memory_store() -> Result<&'static memory_store::MemoryKeyStore, EnrollError> {
    static STORE: OnceLock<memory_store::MemoryKeyStore> = OnceLock::new();
    if let Some(s) = STORE.get() {
        return Ok(s);
    }
    let s = memory_store::MemoryKeyStore::new()?;
    Ok(STORE.get_or_init(|| s))
}

/// Runs one enrollment with `cfg`: reads the material, runs the state machine.
///
/// With a push source, material that the run refuses ([`EnrollError::refuses_material`]:
/// the service's final refusal, an epoch below the floor, ...) is discarded and the guest
/// waits for the next push: anyone on the host may push, so a rogue document can delay
/// enrollment but not end it.
pub async fn run(cfg: &EnrollConfig) -> Result<Outcome, EnrollError> {
    validate(cfg).map_err(EnrollError::Config)?;
    match &cfg.bootstrap {
        BootstrapSource::File(p) => {
            let material = material::read_file(p)?;
            if let Some(m) = &material {
                pinned_by_config(cfg, m).map_err(|reason| material::MaterialError::Invalid {
                    origin: p.display().to_string(),
                    reason,
                })?;
            }
            with_store(cfg, false, |e| Box::pin(e.run(material))).await
        }
        BootstrapSource::Push { listen } => loop {
            crate::info!("enroll: waiting for the host to push bootstrap material on {listen}");
            let material = receive(cfg, listen).await?;
            if let Err(why) = pinned_by_config(cfg, &material) {
                crate::warn!(
                    "enroll: the pushed bootstrap material was refused ({why}); discarded, waiting for another push"
                );
                continue;
            }
            match with_store(cfg, true, |e| Box::pin(e.run(Some(material)))).await {
                Err(e) if e.refuses_material() => {
                    crate::warn!(
                        "enroll: the pushed bootstrap material was refused ({e}); discarded, waiting for another push"
                    );
                }
                other => return other,
            }
        },
    }
}

/// One pushed document on `listen`.
async fn receive(cfg: &EnrollConfig, listen: &Endpoint) -> Result<material::Material, EnrollError> {
    material::receive_push(listen, Duration::from_millis(cfg.timeout_ms))
        .await
        .map_err(|e| EnrollError::State {
            what: format!("listen for bootstrap material on {listen}"),
            source: e,
        })
}

/// With a configured `management_ca`, the material must pin that same CA.
fn pinned_by_config(cfg: &EnrollConfig, m: &material::Material) -> Result<(), String> {
    match &cfg.management_ca {
        Some(ca) if ca.der() != m.management_ca.der() => Err(format!(
            "management_ca: the material pins {} (key sha256 {}), but the configuration pins {} (key sha256 {}); provision material for this image's management CA",
            m.management_ca.subject(),
            m.management_ca.spki_sha256_hex(),
            ca.subject(),
            ca.spki_sha256_hex()
        )),
        _ => Ok(()),
    }
}

type RunFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Outcome, EnrollError>> + Send + 'a>>;

/// Opens the key store (and so the state directory) and runs `f` with an enroller. Only
/// called once the material is known to be good: bad input writes nothing.
async fn with_store(
    cfg: &EnrollConfig,
    discard_refused: bool,
    f: impl for<'a> FnOnce(&'a state::Enroller<'a>) -> RunFuture<'a>,
) -> Result<Outcome, EnrollError> {
    let store = OpenStore::open(cfg)?;
    f(&enroller(cfg, store.get(), discard_refused)).await
}

/// The configured key store, opened.
enum OpenStore {
    File(file_store::FileKeyStore),
    Memory(&'static memory_store::MemoryKeyStore),
    Tpm(Box<dyn KeyStore>),
}

impl OpenStore {
    fn open(cfg: &EnrollConfig) -> Result<OpenStore, EnrollError> {
        Ok(match cfg.key_store {
            KeyStoreKind::File => {
                OpenStore::File(file_store::FileKeyStore::open_dir(&cfg.state_dir)?)
            }
            KeyStoreKind::Memory => OpenStore::Memory(memory_store()?),
            KeyStoreKind::Tpm => OpenStore::Tpm(Box::new(open_tpm_store(&cfg.state_dir)?)),
        })
    }

    fn get(&self) -> &dyn KeyStore {
        match self {
            OpenStore::File(s) => s,
            OpenStore::Memory(s) => *s,
            OpenStore::Tpm(s) => s.as_ref(),
        }
    }
}

fn enroller<'a>(
    cfg: &EnrollConfig,
    store: &'a dyn KeyStore,
    discard_refused: bool,
) -> state::Enroller<'a> {
    state::Enroller {
        state_dir: cfg.state_dir.clone(),
        publish_dir: cfg.publish_dir.clone(),
        store,
        service: cfg.service.clone(),
        timeout: Duration::from_millis(cfg.timeout_ms),
        retry: cfg.retry.clone(),
        discard_refused,
    }
}

/// The enrolled credentials the agent serves with.
pub struct Credentials {
    /// The identity in force.
    pub identity: identity::Identity,
    /// Its key, in the key store.
    pub key: std::sync::Arc<dyn keystore::MachineKey>,
    /// Its certificate (DER).
    pub cert_der: Vec<u8>,
    /// The management CA it was verified against.
    pub ca: ca::ManagementCa,
    /// The enrollment port the certificate came through (renewal dials it again), when
    /// recorded.
    pub enrollment_port: Option<u32>,
}

/// The credentials in force after [`boot_step`] succeeded.
pub fn credentials(cfg: &EnrollConfig) -> Result<Credentials, EnrollError> {
    let store = OpenStore::open(cfg)?;
    enroller(cfg, store.get(), false).credentials()
}

/// After boot, with a push source: waits for the next pushed document and enrolls it.
/// `Ok(Some(..))` with the new credentials when it changed the identity (a higher epoch,
/// a new key and certificate); `Ok(None)` when it was the identity already in force, or
/// the document pins another CA than the image (logged, ignored). With a file source it
/// never returns.
pub async fn next_push(cfg: &EnrollConfig) -> Result<Option<Credentials>, EnrollError> {
    let BootstrapSource::Push { listen } = &cfg.bootstrap else {
        return std::future::pending().await;
    };
    crate::info!("enroll: listening for new bootstrap material on {listen}");
    let material = receive(cfg, listen).await?;
    if let Err(why) = pinned_by_config(cfg, &material) {
        crate::warn!("enroll: the pushed bootstrap material was refused ({why})");
        return Ok(None);
    }
    match with_store(cfg, true, |e| Box::pin(e.run(Some(material)))).await? {
        Outcome::Enrolled { .. } => credentials(cfg).map(Some),
        Outcome::AlreadyEnrolled { .. } => Ok(None),
    }
}

/// The TPM store on `/dev/tpmrm0`. A VM without it is a configuration error naming
/// `key_store`, found before anything is written; never a fallback to another store.
#[cfg(feature = "tpm")]
fn open_tpm_store(state_dir: &Path) -> Result<tpm::TpmKeyStore, EnrollError> {
    let device = Path::new(tpm::DEVICE);
    tpm::require_device(device).map_err(EnrollError::Config)?;
    Ok(tpm::TpmKeyStore::with_device(state_dir, device)?)
}

/// Built without the `tpm` feature (only to measure its cost): the store is refused.
#[cfg(not(feature = "tpm"))]
fn open_tpm_store(_: &Path) -> Result<file_store::FileKeyStore, EnrollError> {
    Err(EnrollError::Config(
        "key_store: \"tpm\" is not in this build (built without the `tpm` feature); use a standard build".into(),
    ))
}

/// The boot step: called by PID 1 after the forwarders are up and before the app starts.
/// It returns when the VM holds a valid certificate for its current identity, or when
/// enrollment cannot succeed (`Err`, already logged without secrets).
pub async fn boot_step(cfg: &EnrollConfig) -> Result<(), EnrollError> {
    match run(cfg).await {
        Ok(_) => Ok(()),
        Err(e) => {
            let kind = if e.retryable() { "retryable" } else { "final" };
            crate::error!("enroll: {kind} failure: {e}");
            Err(e)
        }
    }
}

/// The largest configuration file `cli_main` reads.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Reads the enrollment section from a configuration file: the `enrollment` member of a
/// full guest-init configuration, or a file holding only the section.
pub fn load_config(path: &Path) -> Result<EnrollConfig, EnrollError> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_CONFIG_BYTES).read_to_end(&mut bytes))
        .map_err(|e| EnrollError::Config(format!("cannot read {}: {e}", path.display())))?;
    let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
        EnrollError::Config(format!(
            "{} is not JSON: {}",
            path.display(),
            material::redact(&e.to_string())
        ))
    })?;
    // `guest-init enroll` has no other configuration pass: honour the file's `log_level`.
    if let Some(level) = value.get("log_level").and_then(|l| l.as_str()) {
        let level = match level {
            "error" => Some(crate::log::Level::Error),
            "warn" => Some(crate::log::Level::Warn),
            "info" => Some(crate::log::Level::Info),
            "debug" => Some(crate::log::Level::Debug),
            _ => None,
        };
        if let Some(l) = level {
            crate::log::set_max_level(l);
        }
    }
    let section = match value {
        serde_json::Value::Object(mut m) if m.contains_key("enrollment") => {
            m.remove("enrollment").unwrap_or_default()
        }
        v => v,
    };
    serde_json::from_value(section).map_err(|e| {
        EnrollError::Config(format!(
            "{}: enrollment: {}",
            path.display(),
            material::redact(&e.to_string())
        ))
    })
}

/// What `guest-init enroll` refuses on top of [`validate`]: the memory store. The
/// subcommand is its own process, so a memory key would die with it, leaving a published
/// certificate for a key that no longer exists (and voiding PID 1's enrollment).
pub fn cli_check(cfg: &EnrollConfig) -> Result<(), EnrollError> {
    if cfg.key_store == KeyStoreKind::Memory {
        return Err(EnrollError::Config(
            "key_store: \"memory\" cannot be used with `guest-init enroll`: the key would die with this process and leave a certificate for a key that no longer exists; use key_store \"file\", or let guest-init enroll at boot (the enrollment section of its own configuration)".into(),
        ));
    }
    Ok(())
}

/// `guest-init enroll --config FILE`: enrollment alone, as an ordinary process; returns the
/// process exit code (0 enrolled or already enrolled; see [`EnrollError::exit_code`]).
pub fn cli_main(config_path: &std::path::Path) -> i32 {
    let cfg = match load_config(config_path).and_then(|c| cli_check(&c).map(|()| c)) {
        Ok(c) => c,
        Err(e) => {
            crate::error!("enroll: {e}");
            return e.exit_code();
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            crate::error!("enroll: cannot start the runtime: {e}");
            return 1;
        }
    };
    match rt.block_on(boot_step(&cfg)) {
        Ok(()) => 0,
        Err(e) => e.exit_code(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(json: serde_json::Value) -> EnrollConfig {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_push_source_needs_a_configured_service_and_ca() {
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD
            .encode(ca::tests::TestCa::new("management CA").pin.der());
        let push = serde_json::json!({"push": {"listen": {"unix": "/run/push.sock"}}});
        let e = validate(&section(serde_json::json!({"bootstrap": push}))).unwrap_err();
        assert!(
            e.starts_with("service: required with bootstrap.push"),
            "{e}"
        );
        let e = validate(&section(serde_json::json!({
            "bootstrap": push,
            "service": {"vsock": {"cid": 2, "port": 5002}},
        })))
        .unwrap_err();
        assert!(
            e.starts_with("management_ca: required with bootstrap.push"),
            "{e}"
        );
        validate(&section(serde_json::json!({
            "bootstrap": push,
            "service": {"vsock": {"cid": 2, "port": 5002}},
            "management_ca": ca,
        })))
        .unwrap();
    }

    #[test]
    fn the_subcommand_refuses_the_memory_store() {
        let cfg = section(serde_json::json!({
            "bootstrap": {"file": "/b.json"}, "key_store": "memory",
        }));
        validate(&cfg).unwrap();
        let e = cli_check(&cfg).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("key_store"), "{e}");
    }
}
