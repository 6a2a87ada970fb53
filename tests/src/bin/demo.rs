//! `demo`: the whole path of a sign-in, once, with real parts, narrated for a person.
//!
//! `scripts/demo.sh` sets the machine up and runs this. It boots a micro-VM with
//! `guest-init` as PID 1 and Radicale 3.9 inside (on a cached root disk), starts the
//! host's relay and a real Dovecot, signs in over HTTP with a right and a wrong password,
//! and prints what happened at each hop (Radicale's own log from the guest console, the
//! relay's log, Dovecot's log) and how long each phase took. Then it asks the guest to
//! stop over the control port and shows QEMU's exit status.
//!
//! The scenario itself is [`e2e::radicale_vm`], shared with VM test 9, so what the demo
//! shows is what CI checks. The exit status is 0 only when every expectation held: right
//! password 2xx, wrong 401, no gateway address at Dovecot, a clean stop.
//!
//! The guest kernel is a parameter: `demo --kernel VERSION` (or `MICROVM_KERNEL=VERSION`),
//! a full release or a prefix such as `6.12`; by default the cache's `current` (6.1).

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use e2e::radicale_vm::{
    secs, Options, Phase, Requirements, Scenario, APP_CLIENT_ADDRESS, GATEWAY, PASSWORD, USER,
};

const PATH: &[&str] = &[
    "  host    HTTP client --127.0.0.1:PORT--> QEMU user networking (hostfwd)",
    "  guest   --> Radicale 3.9.0 on 10.0.2.15:5232 (uid 1001; every client looks like 10.0.2.2)",
    "          Radicale --/var/run/dovecot/auth-client--> guest-init (PID 1) forwarder",
    "          --AF_VSOCK CID 2 port 5001--> virtio-vsock",
    "  host    --> vhost-device-vsock --<vm.vsock>_5001--> host-relay (admits this VM only;",
    "          rewrites rip 10.0.2.2 -> the app's own address) --> Dovecot 2.3 auth-client",
];

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            println!("\nDEMO FAILED: an expectation did not hold (see above).");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("\ndemo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn new_part(after: &str, before_len: usize) -> String {
    after.get(before_len..).unwrap_or("").to_string()
}

/// Radicale's log lines without their timestamp and thread prefix.
fn radicale_lines(text: &str, keys: &[&str]) -> Vec<String> {
    text.lines()
        .filter(|l| keys.iter().any(|k| l.contains(k)))
        .map(|l| match l.rfind("] [") {
            Some(i) => l[i + 2..].to_string(),
            None => l.to_string(),
        })
        .collect()
}

fn lines_with(text: &str, keys: &[&str]) -> Vec<String> {
    text.lines()
        .filter(|l| keys.iter().any(|k| l.contains(k)))
        .map(|l| l.replace('\t', " "))
        .collect()
}

fn show(label: &str, lines: &[String]) {
    for l in lines {
        println!("    {label:<9} {l}");
    }
}

/// `--kernel VERSION` / `--kernel=VERSION` from the command line, else `$MICROVM_KERNEL`.
fn kernel_arg() -> anyhow::Result<Option<String>> {
    let mut args = std::env::args().skip(1);
    let mut version = None;
    while let Some(a) = args.next() {
        if a == "--kernel" {
            let v = args
                .next()
                .context("--kernel needs a version, e.g. --kernel 6.12")?;
            version = Some(v);
        } else if let Some(v) = a.strip_prefix("--kernel=") {
            version = Some(v.to_string());
        } else {
            bail!("unknown argument {a:?}; usage: demo [--kernel VERSION]");
        }
    }
    Ok(version.or_else(|| {
        std::env::var(qemu_harness::kernel::KERNEL_ENV)
            .ok()
            .filter(|v| !v.trim().is_empty())
    }))
}

fn run() -> anyhow::Result<bool> {
    let t0 = Instant::now();
    let kernel = match kernel_arg()? {
        Some(v) => Some(
            qemu_harness::Kernel::by_version(&e2e::util::cache_dir(), v.trim())
                .context("--kernel / MICROVM_KERNEL")?,
        ),
        None => None,
    };
    println!("== Radicale in a micro-VM: one sign-in through the whole path ==");
    for l in PATH {
        println!("{l}");
    }
    println!();
    let req = Requirements::check();
    if !req.ok() {
        bail!(
            "missing: {} (run scripts/setup.sh as root)",
            req.missing.join(", ")
        );
    }
    println!("-- phases: [clock at the end of the phase] name, its duration, what happened --");
    let mut clock = std::time::Duration::ZERO;
    let mut print_phase = |p: &Phase| {
        clock += p.took;
        println!(
            "[{:>6}] {:<13} {:>7}  {}",
            secs(clock),
            p.name,
            secs(p.took),
            p.detail
        );
    };
    let opts = Options {
        progress: false,
        kernel,
        ..Options::default()
    };
    let mut sc = Scenario::start(&opts, &mut print_phase).context("starting the scenario")?;
    println!(
        "  boot-to-ready {} (QEMU start to guest-init's ready line), boot-to-HTTP {} ({} accelerator)",
        secs(sc.boot_to_ready),
        secs(sc.boot_to_http),
        sc.vm().accel().name()
    );

    let mut ok = true;
    for (what, password, want) in [
        ("right password", PASSWORD, "2xx"),
        ("wrong password", "not-the-password", "401"),
    ] {
        let (c0, r0, d0) = (
            sc.console().len(),
            sc.relay_log().len(),
            sc.dovecot_log().len(),
        );
        println!("\n-- sign-in as {USER}, {what}: PROPFIND /{USER}/ (Basic auth) --");
        let reply = sc
            .sign_in(USER, password)
            .with_context(|| format!("sign-in with the {what}"))?;
        // Give the console and logs a moment to catch up with the reply.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let console = new_part(&sc.console(), c0);
        let relay = new_part(&sc.relay_log(), r0);
        let dovecot = new_part(&sc.dovecot_log(), d0);
        show(
            "radicale",
            &radicale_lines(
                &console,
                &[
                    "request for",
                    "Authentication request",
                    "Successful login",
                    "Failed login",
                    "Dovecot",
                ],
            ),
        );
        show("relay", &lines_with(&relay, &[""]));
        show(
            "dovecot",
            &lines_with(
                &dovecot,
                &[
                    "client in: AUTH",
                    "client passdb out",
                    "mismatch",
                    "unknown user",
                ],
            ),
        );
        let first_line = reply.head.lines().next().unwrap_or("").to_string();
        let good = match want {
            "2xx" => (200..300).contains(&reply.status),
            _ => reply.status == 401,
        };
        println!(
            "  => {first_line} in {} (want {want}) {}",
            secs(reply.elapsed),
            if good { "OK" } else { "UNEXPECTED" }
        );
        ok &= good;
    }

    let console = sc.console();
    let dlog = sc.dovecot_log();
    let radicale_saw_gateway = console.contains(&format!("received from {GATEWAY}"));
    let dovecot_saw_gateway = dlog.contains(GATEWAY);
    let dovecot_saw_app = dlog.contains(&format!("rip={APP_CLIENT_ADDRESS}"));
    println!("\n-- the client address (Dovecot's attempt budget is keyed on it) --");
    println!(
        "  Radicale saw its client as {GATEWAY} (QEMU's gateway): {}",
        yes(radicale_saw_gateway)
    );
    println!(
        "  Dovecot was given rip={APP_CLIENT_ADDRESS} (this app's own address): {}",
        yes(dovecot_saw_app)
    );
    println!(
        "  Dovecot's log mentions {GATEWAY} anywhere: {}",
        yes(dovecot_saw_gateway)
    );
    ok &= radicale_saw_gateway && dovecot_saw_app && !dovecot_saw_gateway;

    println!("\n-- stop: the host asks guest-init to stop over vsock port 1024 --");
    let stop = sc.stop()?;
    let console = sc.console();
    show(
        "console",
        &lines_with(
            &console,
            &[
                "guest-init: shutdown",
                "guest-init: app ",
                "guest-init: powering off",
            ],
        ),
    );
    let code = stop.exit.and_then(|s| s.code());
    println!(
        "  => guest answered {:?}; QEMU exited {} after {}{}",
        stop.reply,
        code.map(|c| c.to_string())
            .unwrap_or_else(|| "by a signal".into()),
        secs(stop.elapsed),
        if stop.killed {
            " (KILLED after the stop timeout)"
        } else {
            " by itself"
        }
    );
    ok &= stop.clean();

    println!("\n-- summary --");
    println!(
        "  root disk: {} MiB image ({} MiB of files), {} in {}",
        sc.rootfs.image_bytes >> 20,
        sc.rootfs.content_bytes >> 20,
        if sc.rootfs.from_cache {
            "found in the cache"
        } else {
            "built"
        },
        secs(sc.rootfs.elapsed)
    );
    println!("  initramfs: {} KiB", sc.vm().image_size() >> 10);
    println!(
        "  boot-to-ready {}, boot-to-HTTP {}, whole demo {}",
        secs(sc.boot_to_ready),
        secs(sc.boot_to_http),
        secs(t0.elapsed())
    );
    println!(
        "  result: {}",
        if ok {
            "every expectation held"
        } else {
            "FAILED"
        }
    );
    Ok(ok)
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}
