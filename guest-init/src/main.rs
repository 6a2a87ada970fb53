//! The `guest-init` binary: PID 1 of a micro-VM, or a supervisor in an ordinary process.
//!
//! ```text
//! guest-init                           run (config from guest_init.config= or /etc/guest-init.json)
//! guest-init --config PATH             run with this configuration
//! guest-init check-config PATH         validate only; exit 0, or 1 with the message
//! guest-init enroll --config PATH      enrollment alone (see docs/ENROLLMENT.md)
//! ```
//!
//! Design choices:
//! - **Hand-rolled argv parsing.** Four forms do not justify `clap`'s few hundred
//!   kilobytes in a binary that must stay small and start fast as PID 1. As PID 1 the
//!   kernel also passes unrecognised boot parameters (such as `single`) as arguments:
//!   those are logged and ignored, never fatal.
//! - **A current-thread tokio runtime.** Everything PID 1 does is waiting: on signals, on
//!   sockets, on timers. One thread serves that, keeps the idle footprint to one stack, and
//!   makes `fork` for the app safe (no other thread can hold a lock the child needs).
//! - **PID 1 never exits.** Every path ends in the orderly shutdown
//!   (`guest_init::shutdown`), which powers off or reboots; a panic takes the same path
//!   through the hook in `guest_init::panic`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use guest_init::config::{self, Config};
use guest_init::{boot, error, info, panic, shutdown, supervisor, warn};

const USAGE: &str = "usage: guest-init [--config PATH]
       guest-init check-config PATH
       guest-init enroll --config PATH";

enum Cmd {
    Run { config: Option<PathBuf> },
    CheckConfig(PathBuf),
    Enroll(PathBuf),
    Help,
}

fn parse_args(args: &[String], pid1: bool) -> Result<Cmd, String> {
    let s: Vec<&str> = args.iter().map(String::as_str).collect();
    match s.as_slice() {
        ["check-config", path] => Ok(Cmd::CheckConfig(path.into())),
        ["check-config", ..] => Err("check-config takes exactly one argument: the file".into()),
        ["enroll", "--config", path] => Ok(Cmd::Enroll(path.into())),
        ["enroll", ..] => Err("enroll takes --config PATH".into()),
        ["-h" | "--help"] => Ok(Cmd::Help),
        ["--config", path] => Ok(Cmd::Run {
            config: Some(path.into()),
        }),
        [] => Ok(Cmd::Run { config: None }),
        other if pid1 => {
            // Kernel boot parameters the kernel did not recognise land here.
            warn!("ignoring arguments {other:?}");
            Ok(Cmd::Run { config: None })
        }
        other => Err(format!("unexpected arguments {other:?}")),
    }
}

fn main() -> ExitCode {
    let started = Instant::now();
    let pid1 = std::process::id() == 1;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = match parse_args(&args, pid1) {
        // PID 1 must never return from main (the kernel would panic): as PID 1 every form
        // but `--config PATH` is ignored and the VM boots with its default configuration.
        Ok(Cmd::Run { config }) => Ok(Cmd::Run { config }),
        _ if pid1 => {
            warn!("ignoring arguments {args:?}: as PID 1 only --config PATH is accepted");
            Ok(Cmd::Run { config: None })
        }
        other => other,
    };
    match cmd {
        Ok(Cmd::Help) => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Ok(Cmd::CheckConfig(path)) => match Config::load_described(&path) {
            Ok(_) => {
                println!("{}: ok", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::FAILURE
            }
        },
        Ok(Cmd::Enroll(path)) => {
            let code = guest_init::enroll::cli_main(&path);
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
        Ok(Cmd::Run { config }) => run(config, pid1, started),
        Err(e) => {
            eprintln!("guest-init: {e}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn run(flag: Option<PathBuf>, pid1: bool, started: Instant) -> ExitCode {
    shutdown::init(pid1);
    panic::install();
    if pid1 {
        // /proc first: the configuration's path may be on the kernel command line.
        boot::mount_basics();
    } else if let Err(e) = supervisor::become_subreaper() {
        panic::fatal(format_args!("cannot become a child subreaper: {e}"));
    }
    let path = config::choose_path(flag.as_deref(), pid1);
    let cfg = match Config::load_described(&path) {
        Ok(c) => c,
        Err(e) => panic::fatal(e),
    };
    guest_init::log::set_max_level(cfg.log_level.into());
    shutdown::configure(cfg.shutdown.grace_period_ms, cfg.shutdown.action);
    info!(
        "guest-init {} as {} with {}",
        env!("CARGO_PKG_VERSION"),
        if pid1 { "PID 1" } else { "a subreaper" },
        path.display()
    );
    if pid1 {
        boot_steps(&cfg);
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => panic::fatal(format_args!("cannot start the runtime: {e}")),
    };
    let code = rt.block_on(supervisor::run(&cfg, started));
    // Only reached in ordinary mode: as PID 1 the shutdown ends in reboot(2).
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// PID 1's early boot, after the configuration is known. Only a failed switch-root is
/// fatal: without its root the app cannot run. Other failures are logged and the boot goes
/// on (the app may not need what failed, and if it does, its own error says so).
fn boot_steps(cfg: &Config) {
    // With Ctrl-Alt-Del disabled the kernel sends SIGINT to PID 1 instead of rebooting.
    // In a PID namespace (tests) this is refused with EINVAL, which is harmless.
    if let Err(e) = nix::sys::reboot::set_cad_enabled(false) {
        guest_init::debug!("reboot(RB_DISABLE_CAD): {e}");
    }
    if let Some(h) = &cfg.hostname {
        if let Err(e) = boot::set_hostname(h) {
            error!("{e}");
        }
    }
    if let Err(e) = boot::loopback_up() {
        error!("{e}");
    }
    // Errors are logged per module inside.
    let _ = boot::load_modules(&cfg.modules, &cfg.modules_dir);
    if let Some(net) = &cfg.network {
        if let Err(e) = boot::configure_network(net) {
            error!("{e}");
        }
    }
    if let Some(root) = &cfg.root {
        if let Err(e) = boot::switch_root(root) {
            panic::fatal(e);
        }
        // /tmp and anything the new root lacks, on the new root.
        boot::mount_basics();
    }
}
