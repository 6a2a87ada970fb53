//! The `host-relay` command: `run`, `check-config`, `connect` (see `docs/RELAY.md`) and
//! `agent` (the operator's client for a guest's agent, `docs/AGENT.md`).
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
    /// Send one request to a guest's agent over mutual TLS; print the JSON answer.
    /// Exit 0 for an ok answer, 1 for an error answer, 2 when there is no answer (the
    /// guest was refused by the peer-authorizer, refused us, or cannot be reached).
    Agent(AgentArgs),
}

#[derive(clap::Args)]
struct AgentArgs {
    /// The VMM's hybrid vsock Unix socket (with --port).
    #[arg(long, conflicts_with_all = ["cid", "unix"])]
    uds: Option<PathBuf>,
    /// The guest's CID under kernel vhost-vsock (with --port).
    #[arg(long, conflicts_with = "unix")]
    cid: Option<u32>,
    /// The agent's vsock port.
    #[arg(long)]
    port: Option<u32>,
    /// A Unix socket the agent listens on (tests).
    #[arg(long)]
    unix: Option<PathBuf>,
    /// The operator's certificate (PEM).
    #[arg(long)]
    cert: PathBuf,
    /// The operator's private key (PEM, PKCS#8).
    #[arg(long)]
    key: PathBuf,
    /// The management CA certificate (PEM).
    #[arg(long)]
    ca: PathBuf,
    /// The current-identity file, read on every handshake.
    #[arg(long)]
    current_identity: PathBuf,
    #[command(subcommand)]
    op: AgentOp,
}

#[derive(Subcommand)]
enum AgentOp {
    /// Identity, epoch, certificate expiry, app state, uptime.
    Status,
    /// The orderly shutdown.
    Stop,
    /// Run a command as a user the guest lists.
    Exec {
        /// The user to run as.
        #[arg(long)]
        user: String,
        /// Deadline in milliseconds (the guest's default is 20000).
        #[arg(long)]
        deadline_ms: Option<u64>,
        /// The command (absolute path) and its arguments.
        #[arg(last = true, required = true)]
        argv: Vec<String>,
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
        Cmd::Agent(args) => std::process::exit(agent(args)),
    }
}

fn agent(a: AgentArgs) -> i32 {
    use host_relay::agent_client::{Client, Target};
    let target = match (a.uds, a.cid, a.port, a.unix) {
        (Some(uds), None, Some(port), None) => Target::Hybrid(uds, port),
        (None, Some(cid), Some(port), None) => {
            Target::Endpoint(vm_transport::Endpoint::Vsock { cid, port })
        }
        (None, None, None, Some(path)) => Target::Endpoint(vm_transport::Endpoint::Unix(path)),
        _ => {
            eprintln!("error: give --uds PATH --port N, --cid N --port N, or --unix PATH");
            return 2;
        }
    };
    let request = match a.op {
        AgentOp::Status => serde_json::json!({"v": 1, "op": "status"}),
        AgentOp::Stop => serde_json::json!({"v": 1, "op": "stop"}),
        AgentOp::Exec {
            user,
            deadline_ms,
            argv,
        } => {
            let mut r = serde_json::json!({"v": 1, "op": "exec", "user": user, "argv": argv});
            if let Some(d) = deadline_ms {
                r["deadline_ms"] = d.into();
            }
            r
        }
    };
    let client = match Client::from_files(&a.cert, &a.key, &a.ca, &a.current_identity) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return 2;
        }
    };
    match rt.block_on(client.call(&target, &request.to_string())) {
        Ok(answer) => {
            println!("{answer}");
            match serde_json::from_str::<serde_json::Value>(&answer) {
                Ok(v) if v["status"] == "ok" => 0,
                _ => 1,
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
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
