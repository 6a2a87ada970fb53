//! Admission: may this connection reach this instance's service?
//!
//! **Threat.** A guest is untrusted code. It must not reach a platform service on behalf of
//! another app (by connecting from another VM to this app's listener), nor reach a service
//! its app did not declare. The guest never says who it is; who it is comes only from what
//! the platform created:
//! - **Per-VM socket** (hybrid vsock): the listener is a Unix socket named after *this* VM's
//!   vsock socket, mode 0600/0660 in the app's run directory. Only this VM's VMM can open
//!   it, so every connection on it is from this VM. The peer is a Unix peer; anything else
//!   on such a listener is refused.
//! - **CID** (kernel vhost-vsock): the listener is host-wide, so any guest can connect. The
//!   kernel sets the peer CID (a guest cannot forge it), and only the CID the platform
//!   registered for this app is admitted; any other CID is refused at once and logged with
//!   its CID and port.
//! - **Unix** (native use, tests): the socket file's permissions decide, as natively.
//! - **Undeclared**: a listener for a platform service the app did not declare admits
//!   nobody ("service not declared by app"). In per-VM mode a port without a socket is
//!   invisible to the guest (its connect times out); listening and refusing is what makes
//!   the attempt visible in the log.
//!
//! This module is pure (peer + instance → decision), so every rule is unit-tested, CID
//! mode included, without a kernel vhost-vsock (missing on the development machines). The
//! real `AF_VSOCK` accept path produces a [`Peer::Vsock`] from `getpeername`, which is
//! exactly what the tests feed in.

use std::fmt;

use vm_transport::Peer;

/// How an instance's listener identifies its VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// A per-VM Unix socket: the path is the admission.
    PerVmSocket,
    /// A host-wide `AF_VSOCK` listener: only this registered guest CID is admitted.
    Cid {
        /// The CID the platform registered for the app.
        registered: u32,
    },
    /// A Unix socket at an explicit path: its file permissions are the admission.
    Unix,
}

/// One listener's admission rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gate {
    /// How the listener identifies its VM.
    pub transport: Transport,
    /// Whether the app declared this service.
    pub declared: bool,
}

/// Why a connection was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The peer CID is not the one registered for this app.
    WrongCid {
        /// The peer's CID.
        cid: u32,
        /// The peer's port.
        port: u32,
        /// The registered CID.
        expected: u32,
    },
    /// A peer of the wrong kind for this listener (e.g. a Unix peer on a vsock listener).
    WrongTransport(String),
    /// The app did not declare this service.
    NotDeclared,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::WrongCid {
                cid,
                port,
                expected,
            } => write!(
                f,
                "peer CID {cid} (port {port}) is not the app's registered CID {expected}"
            ),
            Reason::WrongTransport(p) => write!(f, "unexpected peer {p} on this listener"),
            Reason::NotDeclared => f.write_str("service not declared by app"),
        }
    }
}

/// The decision for one connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Serve it.
    Admit,
    /// Close it at once and log the reason.
    Refuse(Reason),
}

/// Decides for one accepted connection. Who the peer is comes first (a foreign VM is
/// logged as such even on an undeclared port), then whether the service was declared.
pub fn decide(gate: &Gate, peer: &Peer) -> Decision {
    let identity = match (gate.transport, peer) {
        (Transport::PerVmSocket | Transport::Unix, Peer::Unix) => None,
        (Transport::Cid { registered }, Peer::Vsock { cid, port }) => {
            if *cid == registered {
                None
            } else {
                Some(Reason::WrongCid {
                    cid: *cid,
                    port: *port,
                    expected: registered,
                })
            }
        }
        (_, other) => Some(Reason::WrongTransport(other.to_string())),
    };
    match identity {
        Some(reason) => Decision::Refuse(reason),
        None if gate.declared => Decision::Admit,
        None => Decision::Refuse(Reason::NotDeclared),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DECLARED_CID: Gate = Gate {
        transport: Transport::Cid { registered: 7 },
        declared: true,
    };

    #[test]
    fn cid_mode_admits_only_the_registered_cid() {
        let own = Peer::Vsock { cid: 7, port: 1234 };
        assert_eq!(decide(&DECLARED_CID, &own), Decision::Admit);
        let other = Peer::Vsock { cid: 8, port: 99 };
        assert_eq!(
            decide(&DECLARED_CID, &other),
            Decision::Refuse(Reason::WrongCid {
                cid: 8,
                port: 99,
                expected: 7
            })
        );
        // Neighbouring CIDs, the host and loopback are all someone else.
        for cid in [6, 1, 2, u32::MAX] {
            let d = decide(&DECLARED_CID, &Peer::Vsock { cid, port: 1 });
            assert!(
                matches!(d, Decision::Refuse(Reason::WrongCid { .. })),
                "{cid}"
            );
        }
    }

    #[test]
    fn cid_mode_refuses_non_vsock_peers() {
        assert_eq!(
            decide(&DECLARED_CID, &Peer::Unix),
            Decision::Refuse(Reason::WrongTransport("unix".into()))
        );
        let tcp = Peer::Tcp("127.0.0.1:5".parse().unwrap());
        assert!(matches!(
            decide(&DECLARED_CID, &tcp),
            Decision::Refuse(Reason::WrongTransport(_))
        ));
    }

    #[test]
    fn socket_modes_admit_unix_peers_only() {
        for transport in [Transport::PerVmSocket, Transport::Unix] {
            let gate = Gate {
                transport,
                declared: true,
            };
            assert_eq!(decide(&gate, &Peer::Unix), Decision::Admit);
            assert!(matches!(
                decide(&gate, &Peer::Vsock { cid: 3, port: 1 }),
                Decision::Refuse(Reason::WrongTransport(_))
            ));
        }
    }

    #[test]
    fn undeclared_services_admit_nobody() {
        for transport in [
            Transport::PerVmSocket,
            Transport::Unix,
            Transport::Cid { registered: 7 },
        ] {
            let gate = Gate {
                transport,
                declared: false,
            };
            let peer = match transport {
                Transport::Cid { .. } => Peer::Vsock { cid: 7, port: 1 },
                _ => Peer::Unix,
            };
            assert_eq!(decide(&gate, &peer), Decision::Refuse(Reason::NotDeclared));
        }
        // A foreign VM on an undeclared port is reported as the foreign VM it is.
        let gate = Gate {
            transport: Transport::Cid { registered: 7 },
            declared: false,
        };
        assert!(matches!(
            decide(&gate, &Peer::Vsock { cid: 9, port: 1 }),
            Decision::Refuse(Reason::WrongCid { cid: 9, .. })
        ));
    }

    #[test]
    fn reasons_read_well_in_logs() {
        assert_eq!(
            Reason::NotDeclared.to_string(),
            "service not declared by app"
        );
        let r = Reason::WrongCid {
            cid: 9,
            port: 1025,
            expected: 7,
        };
        assert_eq!(
            r.to_string(),
            "peer CID 9 (port 1025) is not the app's registered CID 7"
        );
        assert_eq!(
            Reason::WrongTransport("unix".into()).to_string(),
            "unexpected peer unix on this listener"
        );
    }
}
