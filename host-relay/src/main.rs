//! The `host-relay` command: `run`, `check-config` and `connect` (see `docs/RELAY.md`).
//!
//! `run` does its work in a fixed order, because the order is the security design:
//! 1. read and validate the configuration (nothing is touched on error);
//! 2. raise the open-file limit to its hard limit (a burst of N connections holds 2N);
//! 3. bind every listener, as the user the relay was started as (usually root);
//! 4. if `run_as` is set, become the app (groups, gid, uid) while still single-threaded;
//! 5. only then start the tokio runtime, so every thread has the app's credentials;
//! 6. serve until SIGTERM or SIGINT, then remove the socket files and exit 0.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use host_relay::config::Config;
use tokio::signal::unix::{signal, SignalKind};
use vm_transport::hybrid::{self, ConnectOptions};

#[derive(Parser)]
#[command(
    name = "host-relay",
    version,
    about = "Host side of a micro-VM's platform services"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the configured app until SIGTERM/SIGINT.
    Run {
        /// The JSON configuration.
        #[arg(long)]
        config: PathBuf,
    },
    /// Validate a configuration and exit.
    CheckConfig {
        /// The JSON configuration.
        file: PathBuf,
    },
    /// Connect to a guest port through a hybrid vsock socket; copy stdin/stdout.
    Connect {
        /// The VMM's hybrid vsock Unix socket.
        #[arg(long)]
        uds: PathBuf,
        /// The guest's vsock port.
        #[arg(long)]
        port: u32,
        /// Stop retrying after this many milliseconds.
        #[arg(long, default_value_t = 10_000)]
        timeout_ms: u64,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match Cli::parse().cmd {
        Cmd::CheckConfig { file } => {
            let c = Config::load(&file)?;
            println!(
                "ok: app {} with {} service(s), {} undeclared",
                c.app,
                c.services.len(),
                c.undeclared.len()
            );
            Ok(())
        }
        Cmd::Run { config } => run(&config),
        Cmd::Connect {
            uds,
            port,
            timeout_ms,
        } => connect(uds, port, timeout_ms),
    }
}

fn run(path: &std::path::Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    if let Err(e) = vm_transport::fdlimit::raise_fd_limit() {
        tracing::warn!(error = %e, "cannot raise the open-file limit; bursts may be capped");
    }
    let bound = host_relay::listen::bind_all(&config)?;
    if let Some(run_as) = &config.run_as {
        host_relay::privileges::drop_to(run_as)?;
        tracing::info!(uid = run_as.uid, gid = run_as.gid, groups = ?run_as.groups,
            "dropped to the app's credentials");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the runtime")?;
    rt.block_on(async {
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let shutdown = async move {
            let which = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            tracing::info!(signal = which, "shutting down");
        };
        host_relay::serve::serve(&config, bound, shutdown).await
    })?;
    Ok(())
}

fn connect(uds: PathBuf, port: u32, timeout_ms: u64) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let opts = ConnectOptions {
            timeout: Duration::from_millis(timeout_ms),
            ..ConnectOptions::default()
        };
        let conn = hybrid::connect(&uds, port, &opts)
            .await
            .with_context(|| format!("connect to guest port {port} via {}", uds.display()))?;
        let (mut rd, mut wr) = tokio::io::split(conn);
        let up = async {
            tokio::io::copy(&mut tokio::io::stdin(), &mut wr).await?;
            tokio::io::AsyncWriteExt::shutdown(&mut wr).await
        };
        let mut stdout = tokio::io::stdout();
        let down = tokio::io::copy(&mut rd, &mut stdout);
        let (u, d) = tokio::join!(up, down);
        u.context("stdin to guest")?;
        d.context("guest to stdout")?;
        anyhow::Ok(())
    })
}
