//! A test operator's client for the guest agent: an independent TLS 1.3 stack (rustls
//! with ring, not guest-init's own RustCrypto provider) that presents an operator
//! certificate, sends one request line and reads the answer.
//!
//! The server certificate is judged by [`ServerCert`]: it records the certificate the
//! guest presented (so a test can compare it with what the guest published, or with the
//! certificate before a renewal) and, when pinned, accepts exactly that certificate. In
//! both cases the handshake signature is checked by ring against the certificate's key,
//! so a guest presenting a certificate without its key fails the handshake.
//!
//! Used by the host-level agent tests, the renewal tests and `agent_vm_lifecycle` (over
//! the VMM's hybrid socket, judging the guest with `host-relay agent`'s peer-authorizer);
//! `agent_vm` goes through `host-relay agent`'s own client.

use std::io::{Read, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

/// An operator certificate and its PKCS#8 key, both DER.
pub type Credential = (Vec<u8>, Vec<u8>);

/// The server verifier: records the guest's certificate; with a pin, accepts only it.
#[derive(Debug, Default)]
pub struct ServerCert {
    pin: Option<Vec<u8>>,
    seen: Mutex<Option<Vec<u8>>>,
}

impl ServerCert {
    /// Accepts exactly `der` (and records it).
    pub fn pinned(der: Vec<u8>) -> Arc<ServerCert> {
        Arc::new(ServerCert {
            pin: Some(der),
            seen: Mutex::new(None),
        })
    }

    /// Accepts any certificate whose key signs the handshake, and records it.
    pub fn capture() -> Arc<ServerCert> {
        Arc::new(ServerCert::default())
    }

    /// The certificate the server presented, if the handshake got that far.
    pub fn seen(&self) -> Option<Vec<u8>> {
        self.seen.lock().unwrap().clone()
    }
}

fn ring() -> rustls::crypto::CryptoProvider {
    rustls::crypto::ring::default_provider()
}

impl ServerCertVerifier for ServerCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        *self.seen.lock().unwrap() = Some(end_entity.to_vec());
        match &self.pin {
            Some(pin) if pin.as_slice() != end_entity.as_ref() => Err(rustls::Error::General(
                "not the guest's enrolled certificate".into(),
            )),
            _ => Ok(ServerCertVerified::assertion()),
        }
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &ring().signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        ring().signature_verification_algorithms.supported_schemes()
    }
}

/// A new TLS 1.3 client connection presenting `client` (or no certificate), judging the
/// server with `server` ([`ServerCert`], or e.g. `host-relay agent`'s peer-authorizer).
pub fn connection(
    client: Option<&Credential>,
    server: Arc<dyn ServerCertVerifier>,
) -> rustls::ClientConnection {
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(ring()))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(server);
    let config = match client {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from(cert.clone())],
                PrivateKeyDer::Pkcs8(key.clone().into()),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    rustls::ClientConnection::new(Arc::new(config), ServerName::try_from("guest").unwrap()).unwrap()
}

/// Sends `request` (one line) to the agent at `sock` and returns the answer's JSON, or
/// the TLS error (the server's alert, usually) the client saw.
pub fn call(
    sock: &Path,
    client: Option<&Credential>,
    server: Arc<ServerCert>,
    request: &str,
) -> Result<serde_json::Value, String> {
    let sock = std::os::unix::net::UnixStream::connect(sock).unwrap();
    exchange(sock, client, server, request).map(|(answer, _)| answer)
}

/// Sends `request` (one line) on `sock`, a stream already connected to the agent (a Unix
/// path, or the VMM's hybrid socket after `CONNECT`), and returns the answer's JSON and
/// the certificate the guest presented, or the TLS error the client saw.
pub fn exchange(
    sock: std::os::unix::net::UnixStream,
    client: Option<&Credential>,
    server: Arc<dyn ServerCertVerifier>,
    request: &str,
) -> Result<(serde_json::Value, Vec<u8>), String> {
    sock.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut tls = rustls::StreamOwned::new(connection(client, server), sock);
    // A refused client may find the connection closed while it still writes; the
    // server's alert is then still there to read.
    let wrote = tls
        .write_all(format!("{request}\n").as_bytes())
        .and_then(|()| tls.flush());
    let mut answer = String::new();
    let read = match wrote {
        Ok(()) => tls.read_to_string(&mut answer).map(drop),
        Err(e) => Err(e),
    };
    if let Err(e) = read {
        // rustls' stream writes what is pending before it reads, and fails again on
        // the closed socket: read the server's last records directly.
        return Err(match alert(&mut tls.conn, &mut tls.sock) {
            Some(a) => a,
            None => e.to_string(),
        });
    }
    let served = tls
        .conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default();
    let answer = serde_json::from_str(&answer).map_err(|e| format!("not JSON ({e}): {answer}"))?;
    Ok((answer, served))
}

/// The error (an alert, usually) in what the server sent before it closed.
fn alert(
    conn: &mut rustls::ClientConnection,
    sock: &mut std::os::unix::net::UnixStream,
) -> Option<String> {
    loop {
        match conn.read_tls(sock) {
            Ok(0) | Err(_) => return None,
            Ok(_) => {
                if let Err(e) = conn.process_new_packets() {
                    return Some(e.to_string());
                }
            }
        }
    }
}
