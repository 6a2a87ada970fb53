//! The naive tokio relay: the third peer the chain is measured against.
//!
//! This is the relay a Rust programmer writes in an afternoon: tokio's default
//! multi-thread runtime, an accept loop, and per connection one dial and one
//! `tokio::io::copy_bidirectional` (tokio's own 8 KiB buffers per direction). Nothing is
//! tuned. It runs as two processes, one per hop, exactly where the chain's and the socat
//! chain's hops are, and the benchmark starts it by running itself as
//! `bench naive-relay LISTEN TARGET`, so no other binary has to be built.
//!
//! The one thing it shares with the other paths is the 4,096 listen backlog (socat is
//! given `backlog=4096` too): with the standard library's 128, a burst would measure the
//! backlog, not the relay.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

/// The subcommand that runs one hop.
pub const SUBCOMMAND: &str = "naive-relay";

/// Runs one hop until killed: accepts at `listen`, relays each connection to `target`.
pub fn run(listen: &Path, target: PathBuf) -> anyhow::Result<()> {
    let rt = tokio::runtime::Runtime::new().context("start the runtime")?;
    rt.block_on(async move {
        let std_listener = super::echo::listen(listen)
            .with_context(|| format!("cannot listen at {}", listen.display()))?;
        std_listener.set_nonblocking(true)?;
        let listener = tokio::net::UnixListener::from_std(std_listener)?;
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                continue;
            };
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::UnixStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    })
}
