//! One rustls verifier for every peer the platform judges by its own certificate profile.
//!
//! rustls asks a custom verifier three things; [`PeerVerifier`] answers them the same way
//! for every peer, as a server's client verifier or a client's server verifier:
//!
//! 1. **The certificate.** Only the end-entity certificate is judged, by the caller's
//!    [`PeerCheck`] (the peer's profile: issued *directly* by the pinned CA, validity,
//!    purpose, names). Intermediates the peer sends are ignored: no profile accepts a
//!    chain, so sending one cannot widen what is trusted. The server name and OCSP answer
//!    play no part: a profile names the peer in its URI subject alternative name, and
//!    rustls' clock is not used (a check reads the clock it documents).
//! 2. **TLS 1.2 signatures** are refused (`Tls12NotOffered`). Every configuration using
//!    this verifier is TLS 1.3 only; this is the second lock on that door.
//! 3. **The TLS 1.3 `CertificateVerify`** (the peer proves it holds the certificate's key)
//!    is verified with the algorithms of the caller's crypto provider and no others, and
//!    those are exactly the schemes the verifier advertises. [`only_scheme`] narrows a
//!    provider's set to one scheme (host-relay: ring's ECDSA P-256 SHA-256, the one scheme
//!    an enrolled guest key has).
//!
//! As a client verifier it always asks for, and requires, a client certificate, and hints
//! the pinned CA's subject ([`PeerVerifier::with_root_hint`]).
//!
//! Threat: a peer whose certificate fits the profile but who does not hold its key (the
//! `CertificateVerify` check), a downgrade to TLS 1.2 or to a signature scheme the
//! provider was not meant to offer, and a profile applied to something other than the
//! peer's own certificate.

use std::fmt;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

/// A peer's certificate profile: judges the peer's end-entity certificate (DER).
pub trait PeerCheck: fmt::Debug + Send + Sync {
    /// `Ok` admits the peer; the error is what the handshake fails with (its TLS alert).
    fn check(&self, end_entity: &CertificateDer<'_>) -> Result<(), rustls::Error>;
}

/// The verifier: `check` for the certificate, `algorithms` for the handshake signature.
#[derive(Debug)]
pub struct PeerVerifier<C> {
    check: C,
    algorithms: WebPkiSupportedAlgorithms,
    root_hints: Vec<DistinguishedName>,
}

impl<C: PeerCheck> PeerVerifier<C> {
    /// A verifier judging certificates with `check` and handshake signatures with
    /// `algorithms` (the provider's `signature_verification_algorithms`, or a narrowing).
    pub fn new(check: C, algorithms: WebPkiSupportedAlgorithms) -> PeerVerifier<C> {
        PeerVerifier {
            check,
            algorithms,
            root_hints: Vec::new(),
        }
    }

    /// As a client verifier, names the CA (its subject, DER) in the certificate request.
    pub fn with_root_hint(mut self, ca_subject_der: &[u8]) -> PeerVerifier<C> {
        self.root_hints
            .push(DistinguishedName::from(ca_subject_der.to_vec()));
        self
    }
}

/// `algorithms` narrowed to the one signature `scheme`, with the same verification
/// algorithms for it; `None` when the provider does not have the scheme.
pub fn only_scheme(
    algorithms: WebPkiSupportedAlgorithms,
    scheme: SignatureScheme,
) -> Option<WebPkiSupportedAlgorithms> {
    let i = algorithms.mapping.iter().position(|(s, _)| *s == scheme)?;
    let mapping = &algorithms.mapping[i..=i];
    Some(WebPkiSupportedAlgorithms {
        all: mapping[0].1,
        mapping,
    })
}

/// The handshake-signature answers, the same in both verifier traits (whose methods have
/// the same names and signatures): TLS 1.2 refused, TLS 1.3 with `self.algorithms`.
macro_rules! handshake_signatures {
    () => {
        fn verify_tls12_signature(
            &self,
            _message: &[u8],
            _cert: &CertificateDer<'_>,
            _dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Err(rustls::Error::PeerIncompatible(
                rustls::PeerIncompatible::Tls12NotOffered,
            ))
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.algorithms.supported_schemes()
        }
    };
}

impl<C: PeerCheck> ServerCertVerifier for PeerVerifier<C> {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check
            .check(end_entity)
            .map(|()| ServerCertVerified::assertion())
    }

    handshake_signatures!();
}

impl<C: PeerCheck> ClientCertVerifier for PeerVerifier<C> {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.root_hints
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check
            .check(end_entity)
            .map(|()| ClientCertVerified::assertion())
    }

    handshake_signatures!();
}

#[cfg(test)]
mod tests {
    //! Real TLS 1.3 handshakes in memory, with ring (the host's provider) on both ends.

    use std::sync::{Arc, Mutex};

    use rustls::crypto::ring::default_provider;
    use rustls::pki_types::PrivateKeyDer;
    use rustls::sign::{CertifiedKey, SingleCertAndKey};
    use rustls::{ClientConfig, ClientConnection, ServerConfig, ServerConnection};

    use super::*;

    /// A check that records what it was shown and admits or refuses.
    #[derive(Debug, Default)]
    struct Recorder {
        refuse: bool,
        seen: Mutex<Vec<Vec<u8>>>,
    }

    impl PeerCheck for Arc<Recorder> {
        fn check(&self, end_entity: &CertificateDer<'_>) -> Result<(), rustls::Error> {
            self.seen.lock().unwrap().push(end_entity.to_vec());
            if self.refuse {
                return Err(rustls::Error::General("refused by the profile".into()));
            }
            Ok(())
        }
    }

    /// A CA and an end entity it issued (`alg`), as the chain `[ee, ca]` and the EE's key.
    fn chain(
        alg: &'static rcgen::SignatureAlgorithm,
    ) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(vec![]).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_der = ca.self_signed(&ca_key).unwrap().der().clone();
        let issuer = rcgen::Issuer::new(ca, ca_key);
        let key = rcgen::KeyPair::generate_for(alg).unwrap();
        let ee = rcgen::CertificateParams::new(vec!["peer.invalid".into()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        let key = PrivateKeyDer::try_from(key.serialize_der()).unwrap();
        (vec![ee.der().clone(), ca_der], key)
    }

    fn p256_only() -> WebPkiSupportedAlgorithms {
        only_scheme(
            default_provider().signature_verification_algorithms,
            SignatureScheme::ECDSA_NISTP256_SHA256,
        )
        .unwrap()
    }

    /// Runs the handshake to its end or to the first error (either side's).
    fn handshake(c: &mut ClientConnection, s: &mut ServerConnection) -> Result<(), rustls::Error> {
        for _ in 0..16 {
            let mut buf = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut buf).unwrap();
            }
            if !buf.is_empty() {
                s.read_tls(&mut buf.as_slice()).unwrap();
                s.process_new_packets()?;
            }
            let mut buf = Vec::new();
            while s.wants_write() {
                s.write_tls(&mut buf).unwrap();
            }
            if !buf.is_empty() {
                c.read_tls(&mut buf.as_slice()).unwrap();
                c.process_new_packets()?;
            }
            if !c.is_handshaking() && !s.is_handshaking() {
                return Ok(());
            }
        }
        panic!("the handshake did not end");
    }

    /// Mutual TLS 1.3: the client judges the server with `to_server`, the server the
    /// client with `to_client`; each presents a chain with a key of `alg`.
    fn mutual(
        to_server: PeerVerifier<Arc<Recorder>>,
        to_client: PeerVerifier<Arc<Recorder>>,
        alg: &'static rcgen::SignatureAlgorithm,
    ) -> (
        Result<(), rustls::Error>,
        Vec<CertificateDer<'static>>,
        Vec<CertificateDer<'static>>,
    ) {
        mutual_over(
            Arc::new(to_server),
            Arc::new(to_client),
            alg,
            &rustls::version::TLS13,
        )
    }

    /// Which side signs its handshake with a key that is not its certificate's.
    #[derive(Clone, Copy, PartialEq)]
    enum WrongKey {
        Neither,
        Server,
        Client,
    }

    fn mutual_over(
        to_server: Arc<dyn ServerCertVerifier>,
        to_client: Arc<dyn ClientCertVerifier>,
        alg: &'static rcgen::SignatureAlgorithm,
        version: &'static rustls::SupportedProtocolVersion,
    ) -> (
        Result<(), rustls::Error>,
        Vec<CertificateDer<'static>>,
        Vec<CertificateDer<'static>>,
    ) {
        mutual_keyed(to_server, to_client, alg, version, WrongKey::Neither)
    }

    fn mutual_keyed(
        to_server: Arc<dyn ServerCertVerifier>,
        to_client: Arc<dyn ClientCertVerifier>,
        alg: &'static rcgen::SignatureAlgorithm,
        version: &'static rustls::SupportedProtocolVersion,
        wrong: WrongKey,
    ) -> (
        Result<(), rustls::Error>,
        Vec<CertificateDer<'static>>,
        Vec<CertificateDer<'static>>,
    ) {
        let (server_chain, server_key) = chain(alg);
        let (client_chain, client_key) = chain(alg);
        let load = |k: &PrivateKeyDer<'static>| {
            default_provider()
                .key_provider
                .load_private_key(k.clone_key())
                .unwrap()
        };
        let (sk, ck) = match wrong {
            WrongKey::Neither => (load(&server_key), load(&client_key)),
            WrongKey::Server => (load(&client_key), load(&client_key)),
            WrongKey::Client => (load(&server_key), load(&server_key)),
        };
        let presented = |chain: &Vec<CertificateDer<'static>>, key| {
            Arc::new(SingleCertAndKey::from(CertifiedKey::new(
                chain.clone(),
                key,
            )))
        };
        let versions = &[version];
        let server = ServerConfig::builder_with_provider(Arc::new(default_provider()))
            .with_protocol_versions(versions)
            .unwrap()
            .with_client_cert_verifier(to_client)
            .with_cert_resolver(presented(&server_chain, sk));
        let client = ClientConfig::builder_with_provider(Arc::new(default_provider()))
            .with_protocol_versions(versions)
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(to_server)
            .with_client_cert_resolver(presented(&client_chain, ck));
        let name = ServerName::try_from("peer.invalid").unwrap();
        let mut c = ClientConnection::new(Arc::new(client), name).unwrap();
        let mut s = ServerConnection::new(Arc::new(server)).unwrap();
        (handshake(&mut c, &mut s), server_chain, client_chain)
    }

    #[test]
    fn a_peer_without_its_certificates_key_fails_the_handshake() {
        let run = |wrong| {
            mutual_keyed(
                Arc::new(PeerVerifier::new(Arc::<Recorder>::default(), p256_only())),
                Arc::new(PeerVerifier::new(Arc::<Recorder>::default(), p256_only())),
                &rcgen::PKCS_ECDSA_P256_SHA256,
                &rustls::version::TLS13,
                wrong,
            )
            .0
        };
        let bad = Err(rustls::Error::InvalidCertificate(
            rustls::CertificateError::BadSignature,
        ));
        assert_eq!(run(WrongKey::Server), bad);
        assert_eq!(run(WrongKey::Client), bad);
        run(WrongKey::Neither).unwrap();
    }

    #[test]
    fn each_side_judges_only_the_peers_end_entity_certificate() {
        let (sr, cr) = (Arc::<Recorder>::default(), Arc::<Recorder>::default());
        let (r, server_chain, client_chain) = mutual(
            PeerVerifier::new(sr.clone(), p256_only()),
            PeerVerifier::new(cr.clone(), p256_only()),
            &rcgen::PKCS_ECDSA_P256_SHA256,
        );
        r.unwrap();
        assert_eq!(*sr.seen.lock().unwrap(), [server_chain[0].to_vec()]);
        assert_eq!(*cr.seen.lock().unwrap(), [client_chain[0].to_vec()]);
    }

    #[test]
    fn a_refusing_check_fails_the_handshake_with_its_error() {
        let refuse = || {
            Arc::new(Recorder {
                refuse: true,
                ..Default::default()
            })
        };
        let want = rustls::Error::General("refused by the profile".into());
        let (r, _, _) = mutual(
            PeerVerifier::new(refuse(), p256_only()),
            PeerVerifier::new(Arc::default(), p256_only()),
            &rcgen::PKCS_ECDSA_P256_SHA256,
        );
        assert_eq!(r, Err(want.clone()));
        let (r, _, _) = mutual(
            PeerVerifier::new(Arc::default(), p256_only()),
            PeerVerifier::new(refuse(), p256_only()),
            &rcgen::PKCS_ECDSA_P256_SHA256,
        );
        assert_eq!(r, Err(want));
    }

    #[test]
    fn only_the_given_algorithms_are_offered_and_verified() {
        // Keys on P-384: a verifier narrowed to P-256 SHA-256 offers no scheme they can
        // sign with, so neither side completes the handshake.
        let (r, _, _) = mutual(
            PeerVerifier::new(Arc::default(), p256_only()),
            PeerVerifier::new(
                Arc::default(),
                default_provider().signature_verification_algorithms,
            ),
            &rcgen::PKCS_ECDSA_P384_SHA384,
        );
        assert!(r.is_err(), "{r:?}");
        let (r, _, _) = mutual(
            PeerVerifier::new(
                Arc::default(),
                default_provider().signature_verification_algorithms,
            ),
            PeerVerifier::new(Arc::default(), p256_only()),
            &rcgen::PKCS_ECDSA_P384_SHA384,
        );
        assert!(r.is_err(), "{r:?}");
        // With the provider's whole set both complete.
        let all = || default_provider().signature_verification_algorithms;
        let (r, _, _) = mutual(
            PeerVerifier::new(Arc::default(), all()),
            PeerVerifier::new(Arc::default(), all()),
            &rcgen::PKCS_ECDSA_P384_SHA384,
        );
        r.unwrap();
    }

    /// A server verifier that accepts anything, to reach the server's own TLS 1.2 check.
    #[derive(Debug)]
    struct AcceptAll;

    impl ServerCertVerifier for AcceptAll {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }

        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Ok(HandshakeSignatureValid::assertion())
        }

        fn verify_tls13_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Ok(HandshakeSignatureValid::assertion())
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            vec![SignatureScheme::ECDSA_NISTP256_SHA256]
        }
    }

    #[test]
    fn a_tls12_handshake_signature_is_refused_in_both_directions() {
        let tls12 = |to_server: Arc<dyn ServerCertVerifier>| {
            let to_client = PeerVerifier::new(Arc::<Recorder>::default(), p256_only());
            mutual_over(
                to_server,
                Arc::new(to_client),
                &rcgen::PKCS_ECDSA_P256_SHA256,
                &rustls::version::TLS12,
            )
            .0
        };
        let refused = Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls12NotOffered,
        ));
        // As a server verifier: the server's key-exchange signature.
        let as_server = PeerVerifier::new(Arc::<Recorder>::default(), p256_only());
        assert_eq!(tls12(Arc::new(as_server)), refused);
        // As a client verifier: the client's CertificateVerify (the client accepts all).
        assert_eq!(tls12(Arc::new(AcceptAll)), refused);
        // The same pair over TLS 1.3 completes.
        let (r, _, _) = mutual_over(
            Arc::new(AcceptAll),
            Arc::new(PeerVerifier::new(Arc::<Recorder>::default(), p256_only())),
            &rcgen::PKCS_ECDSA_P256_SHA256,
            &rustls::version::TLS13,
        );
        r.unwrap();
    }

    #[test]
    fn only_scheme_keeps_that_schemes_algorithms() {
        let ring = default_provider().signature_verification_algorithms;
        let one = p256_only();
        assert_eq!(
            one.supported_schemes(),
            [SignatureScheme::ECDSA_NISTP256_SHA256]
        );
        let (_, want) = ring
            .mapping
            .iter()
            .find(|(s, _)| *s == SignatureScheme::ECDSA_NISTP256_SHA256)
            .unwrap();
        assert!(std::ptr::eq(one.mapping[0].1, *want));
        assert!(std::ptr::eq(one.all, *want));
        assert!(only_scheme(ring, SignatureScheme::Unknown(0x0a0a)).is_none());
    }

    #[test]
    fn both_directions_advertise_the_algorithms_and_hint_the_ca() {
        let v =
            PeerVerifier::new(Arc::<Recorder>::default(), p256_only()).with_root_hint(b"\x30\x00");
        let schemes = [SignatureScheme::ECDSA_NISTP256_SHA256];
        assert_eq!(ServerCertVerifier::supported_verify_schemes(&v), schemes);
        assert_eq!(ClientCertVerifier::supported_verify_schemes(&v), schemes);
        let hints: Vec<&[u8]> = ClientCertVerifier::root_hint_subjects(&v)
            .iter()
            .map(|h| h.as_ref())
            .collect();
        assert_eq!(hints, [b"\x30\x00"]);
        assert!(v.offer_client_auth() && v.client_auth_mandatory());
    }
}
