//! Helpers every end-to-end test needs: where the binaries are, and what to do when a
//! required tool is missing.
//!
//! A missing tool (QEMU, Dovecot, the guest kernel...) must never turn a test into one that
//! silently passes. `scripts/test.sh` sets `REQUIRE_ALL=1`, under which [`require`] fails
//! the test with the missing part's name; run by hand without it, the test prints
//! `SKIPPED: <why>` and returns.
//!
//! The VM tests run on every guest kernel [`test_kernels`] names (by default each one
//! `scripts/setup.sh` installed: Debian's 6.1 and 6.12 cloud kernels), one after the
//! other, through [`on_each_kernel`], which runs the test body on every kernel even when
//! one fails and then fails naming the kernels that did.

use std::path::{Path, PathBuf};

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The cache directory (`$MICROVM_CACHE` or `<root>/.cache`).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("MICROVM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".cache"))
}

/// The cargo target directory.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// The package that builds binary `name` (each binary is built with `-p` of its own
/// package, so its features are its own, as shipped: a workspace-wide build would unify
/// features and link, for example, rcgen's `ring` into the guest-init a VM boots).
fn package_of(name: &str) -> &str {
    match name {
        "guest-probe" => "qemu-harness",
        other => other,
    }
}

/// Brings a workspace binary up to date with cargo, once per test process per binary (a
/// no-op when it is current), so a test run with `-p e2e-tests` never exercises a binary
/// built before the last edit: a planted regression in it must fail the test.
fn build_once(name: &str, args: &[&str]) {
    static BUILT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let key = format!("{name} {args:?}");
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if built.contains(&key) {
        return;
    }
    let status = std::process::Command::new(env!("CARGO"))
        .args(["build", "--quiet", "-p", package_of(name), "--bin", name])
        .args(args)
        .current_dir(workspace_root())
        .status()
        .expect("run cargo");
    assert!(status.success(), "cargo build --bin {name} {args:?} failed");
    built.push(key);
}

/// A host binary of the workspace, built for the host in the same profile as the tests
/// (brought up to date first).
pub fn host_bin(name: &str) -> PathBuf {
    if cfg!(debug_assertions) {
        build_once(name, &[]);
        target_dir().join("debug").join(name)
    } else {
        build_once(name, &["--release"]);
        target_dir().join("release").join(name)
    }
}

/// The host `guest-init` started with `--config cfg`, no stdin, its stdout and stderr
/// both appended to the file `log` (created), for tests that read its log.
pub fn spawn_guest_init_logged(cfg: &Path, log: &Path) -> std::process::Child {
    let f = std::fs::File::create(log).unwrap();
    std::process::Command::new(host_bin("guest-init"))
        .arg("--config")
        .arg(cfg)
        .stdin(std::process::Stdio::null())
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .expect("start guest-init")
}

/// A static musl binary of the workspace (what a VM boots), from `$<NAME>_MUSL` or the
/// release musl target directory (brought up to date first).
pub fn musl_bin(name: &str) -> PathBuf {
    let var = format!("{}_MUSL", name.to_uppercase().replace('-', "_"));
    if let Some(p) = std::env::var_os(&var) {
        return PathBuf::from(p);
    }
    build_once(
        name,
        &["--release", "--target", "x86_64-unknown-linux-musl"],
    );
    target_dir()
        .join("x86_64-unknown-linux-musl/release")
        .join(name)
}

/// Whether missing tools fail tests (`REQUIRE_ALL=1`) rather than skip them.
pub fn require_all() -> bool {
    std::env::var("REQUIRE_ALL").is_ok_and(|v| v == "1")
}

/// Returns `true` when `ok`; otherwise fails the test under `REQUIRE_ALL=1`, or prints
/// `SKIPPED: <what>` and returns `false` so the caller can return early.
pub fn require(ok: bool, what: &str) -> bool {
    if ok {
        return true;
    }
    if require_all() {
        panic!("required for this test and missing: {what} (run scripts/setup.sh)");
    }
    eprintln!("SKIPPED: {what} is missing (run scripts/setup.sh)");
    false
}

/// Whether an executable is on `PATH` (or is an existing absolute path).
pub fn have_program(name: &str) -> bool {
    if Path::new(name).is_absolute() {
        return Path::new(name).exists();
    }
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
        .unwrap_or(false)
}

/// Stops a fixture's child process: SIGTERM, up to `grace` for it to exit (servers remove
/// their sockets and files on SIGTERM), then SIGKILL. The child is always reaped.
pub fn stop_child(child: &mut std::process::Child, grace: std::time::Duration) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let deadline = std::time::Instant::now() + grace;
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The kernel lines `scripts/setup.sh` installs; under `REQUIRE_ALL=1` the VM tests fail if
/// one is missing, so the matrix cannot shrink silently.
pub const SETUP_KERNELS: &[&str] = &["6.1", "6.12"];

/// The guest kernels the VM tests run on: the versions (or prefixes such as `6.12`) in
/// `$MICROVM_KERNELS` (separated by commas or spaces), else every kernel installed under
/// `<cache>/kernel/`. Returns `None` when a kernel is missing (the test fails under
/// `REQUIRE_ALL=1`, else it is skipped).
pub fn test_kernels() -> Option<Vec<qemu_harness::Kernel>> {
    use qemu_harness::kernel::{installed, Kernel};
    let cache = cache_dir();
    let wanted: Vec<String> = match std::env::var("MICROVM_KERNELS") {
        Ok(v) if !v.trim().is_empty() => v
            .split([',', ' '])
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
        _ => {
            let all = installed(&cache);
            for line in SETUP_KERNELS {
                let have = Kernel::by_version(&cache, line).is_ok();
                if !require(have, &format!("the guest kernel {line} (in {:?})", all)) {
                    return None;
                }
            }
            all
        }
    };
    let mut out = Vec::new();
    for v in &wanted {
        match Kernel::by_version(&cache, v) {
            Ok(k) => out.push(k),
            Err(e) => {
                require(false, &format!("MICROVM_KERNELS: {e}"));
                return None;
            }
        }
    }
    Some(out)
}

/// Runs `body` once per kernel, in order, printing which one; a failure on one kernel does
/// not stop the others, and afterwards the test fails naming every kernel that failed.
pub fn on_each_kernel(
    kernels: &[qemu_harness::Kernel],
    mut body: impl FnMut(&qemu_harness::Kernel),
) {
    assert!(!kernels.is_empty(), "no guest kernel to run on");
    let mut failed = Vec::new();
    for k in kernels {
        eprintln!("== kernel {} ==", k.version);
        let t = std::time::Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(k)));
        eprintln!(
            "== kernel {}: {} in {:.1} s ==",
            k.version,
            if r.is_ok() { "passed" } else { "FAILED" },
            t.elapsed().as_secs_f64()
        );
        if r.is_err() {
            failed.push(k.version.clone());
        }
    }
    assert!(
        failed.is_empty(),
        "failed on kernel(s): {}",
        failed.join(", ")
    );
}

/// Whether this host can boot the test VMs: QEMU and the cached vhost-device-vsock. Says
/// what is missing through [`require`] (a failure under `REQUIRE_ALL=1`, else a skip).
pub fn require_vm_host() -> bool {
    require(have_program("qemu-system-x86_64"), "qemu-system-x86_64")
        && require(
            cache_dir().join("tools/bin/vhost-device-vsock").is_file(),
            "vhost-device-vsock (.cache/tools/bin, made by scripts/setup.sh)",
        )
}

/// An e2fsprogs tool (`debugfs`, `e2fsck`, `dumpe2fs`, `mke2fs`): on `PATH` or in the
/// usual sbin directories, which a non-login root shell may not have on its `PATH`.
pub fn e2fs_tool(name: &str) -> Option<PathBuf> {
    if have_program(name) {
        return Some(PathBuf::from(name));
    }
    ["/usr/sbin", "/sbin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// Waits until the log file at `path` holds `what` at least `times` times; panics with the
/// whole log once `limit` has passed. Returns the log.
pub fn wait_in_log(path: &Path, what: &str, times: usize, limit: std::time::Duration) -> String {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let log = std::fs::read_to_string(path).unwrap_or_default();
        if log.matches(what).count() >= times {
            return log;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what:?} not {times} time(s) in {} after {limit:?}:\n{log}",
            path.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
