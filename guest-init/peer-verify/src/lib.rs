//! What guest-init and host-relay share to judge the peer of a TLS 1.3 handshake.
//!
//! Three peers of the platform authenticate with certificates from the management CA and
//! are judged by custom rules rather than by a web PKI: the operator connecting to a
//! guest's agent (guest-init's agent, a client certificate), the enrollment service a guest
//! renews with (guest-init's renewal, a server certificate), and the guest an operator's
//! command reaches (host-relay's agent client, a server certificate). Each has its own
//! profile (its issuer, purpose and names), but the machinery around the profile is the
//! same, and lives here once:
//!
//! - [`verifier`]: [`PeerVerifier`], the rustls `ServerCertVerifier` *and*
//!   `ClientCertVerifier` that hands the peer's end-entity certificate to the caller's
//!   [`PeerCheck`], refuses TLS 1.2 signatures, and verifies the TLS 1.3
//!   `CertificateVerify` with the caller's crypto provider's algorithms only;
//! - [`profile`]: the X.509 checks the profiles have in common (one DER certificate and
//!   nothing after it, the validity window with an optional tolerance for a clock behind
//!   the CA, not a CA, an extended key usage, the subject alternative names).
//!
//! **No crypto of its own.** The crate depends on rustls without default features and on
//! x509-parser without `verify`, so it links no provider: guest-init passes its pure-Rust
//! provider's algorithms (it links no ring, no aws-lc, no C), host-relay passes ring's.
//! Checking the issuer's signature is each caller's (guest-init with `p256` against its
//! pinned CA, host-relay with x509-parser's ring backend).
//!
//! Threat: a peer accepted by a verifier that skips a step in one of three hand-written
//! copies (a TLS 1.2 signature, an algorithm the provider was not meant to offer, a
//! certificate check run on an intermediate instead of the end entity), and the guest's
//! binary linking C crypto through a shared dependency.

pub mod profile;
pub mod verifier;

pub use verifier::{only_scheme, PeerCheck, PeerVerifier};
