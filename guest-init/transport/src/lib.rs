//! `vm-transport`: the socket plumbing guest-init and host-relay share.
//!
//! Both ends of a VM's forwarding do the same things with sockets: publish a Unix socket
//! at a path other people can write to, accept in a loop that must never die, dial with
//! a deadline, and move bytes exactly as they arrive. This crate is that code, written
//! once, so the two sides cannot drift apart (they did, twice: a backlog silently capped
//! at 128 on one side, a live socket taken over on the other). It holds no policy:
//! admission, filtering and logging belong to the binaries.
//!
//! Modules, from the bottom up:
//! - [`vsock`]: named `VMADDR_*` addresses.
//! - [`mode`]: the socket-file mode type; [`field`]: the configuration error type.
//! - [`pool`]: the buffer pool; [`conn`]: one connected socket of any transport.
//! - [`endpoint`]: `unix:`, `vsock:` and `tcp:` addresses, dialled or bound.
//! - [`listener`]: listening with the real backlog, accepting, the peer's address.
//! - [`publish`]: a Unix socket at a path, owner and mode set before listen, no symlink
//!   followed, never over a live service, only our own inode removed.
//! - [`accept`]: the accept loop and its one table of errors and backoffs.
//! - [`pump`]: byte-exact relaying that holds no buffer while idle; [`splice`]: its
//!   copy-free path between Unix stream sockets.
//! - [`hybrid`]: the host side of hybrid vsock (`CONNECT <port>`).
//! - [`fdlimit`]: lifting the open-file limit for bursts.

pub mod accept;
pub mod conn;
pub mod endpoint;
pub mod fdlimit;
pub mod field;
pub mod hybrid;
pub mod listener;
pub mod mode;
pub mod pool;
pub mod publish;
pub mod pump;
pub mod splice;
pub mod vsock;

pub use conn::Conn;
pub use endpoint::Endpoint;
pub use listener::{Listener, Peer};

/// Helpers for the unit tests of several modules.
#[cfg(test)]
pub(crate) mod testing {
    use crate::{Conn, Endpoint};

    /// A connected pair of Unix stream sockets through a listener at `dir/name`: the
    /// dialled end first, the accepted end second.
    pub(crate) async fn pair(dir: &std::path::Path, name: &str) -> (Conn, Conn) {
        let ep = Endpoint::Unix(dir.join(name));
        let l = crate::listener::listen(&ep).unwrap();
        let (c, s) = tokio::join!(ep.connect(), l.accept());
        (c.unwrap(), s.unwrap().0)
    }
}
