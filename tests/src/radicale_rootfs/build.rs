//! Building the Radicale root disk: Debian's packages unpacked, Radicale's wheels
//! installed, the image's files written, and the tree made into an ext4 image.
//!
//! Every step is a command whose output is captured and quoted in the error if it fails
//! ([`run_capture`]), so a broken build names the step and shows what the tool said.

use super::*;

/// The `.deb` files apt would fetch for [`DEBS`]: `<file name> <SHA256:...>` each, sorted.
/// Reads only the local package lists.
pub(super) fn resolve_debs() -> Result<Vec<String>, RootfsError> {
    let out = run_capture(
        Command::new("apt-get")
            .args(["download", "--print-uris", "-q"])
            .args(DEBS),
        "apt-get download --print-uris (resolving the Debian packages)",
    )?;
    let mut v: Vec<String> = out
        .lines()
        .filter_map(|l| {
            // 'URI' FILE SIZE SHA256:HEX
            let mut it = l.split_whitespace().skip(1);
            let file = it.next()?;
            let _size = it.next()?;
            let hash = it.next()?;
            Some(format!("{file} {hash}"))
        })
        .collect();
    v.sort();
    if v.len() != DEBS.len() {
        return Err(RootfsError::Step {
            step: "resolving the Debian packages".into(),
            status: format!("{} of {} found", v.len(), DEBS.len()),
            detail: "apt's package lists miss some of them; run apt-get update".into(),
        });
    }
    Ok(v)
}

pub(super) fn apt_update() -> Result<(), RootfsError> {
    run_capture(
        Command::new("apt-get").args(["update", "-q"]),
        "apt-get update",
    )
    .map(|_| ())
}

/// Builds the staging tree and the image in `work`; returns the bytes of files.
pub(super) fn build_into(
    work: &Path,
    opts: &RootfsOptions,
    debs: &[String],
    progress: &mut dyn FnMut(&str),
) -> Result<u64, RootfsError> {
    let root = work.join("root");
    let debdir = work.join("debs");
    let wheeldir = work.join("wheels");
    for d in [&root, &debdir, &wheeldir] {
        fs::create_dir_all(d).map_err(io_err(d))?;
    }

    let t = Instant::now();
    run_capture(
        Command::new("apt-get")
            .current_dir(&debdir)
            // Downloading into a root-owned directory: apt's sandbox user could not write.
            .args(["-q", "-o", "APT::Sandbox::User=root", "download"])
            .args(DEBS),
        "apt-get download (the Debian packages for Python 3.11)",
    )?;
    let mut files: Vec<PathBuf> = fs::read_dir(&debdir)
        .map_err(io_err(&debdir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "deb"))
        .collect();
    files.sort();
    if files.len() != debs.len() {
        return Err(RootfsError::Step {
            step: "apt-get download".into(),
            status: format!("{} of {} packages", files.len(), debs.len()),
            detail: format!("expected {}", debs.join(", ")),
        });
    }
    for f in &files {
        run_capture(
            Command::new("dpkg-deb").arg("-x").arg(f).arg(&root),
            &format!("dpkg-deb -x {}", f.display()),
        )?;
    }
    let python = root.join("usr/bin/python3");
    if !python.exists() {
        symlink("python3.11", &python).map_err(io_err(&python))?;
    }
    progress(&format!(
        "  debian: {} packages fetched and unpacked in {:.1} s",
        files.len(),
        t.elapsed().as_secs_f64()
    ));

    let t = Instant::now();
    let site = root.join("usr/lib/python3/dist-packages");
    fs::create_dir_all(&site).map_err(io_err(&site))?;
    let (pip_prog, pip_pre) = pip_command(opts)?;
    let platform_args = [
        "--only-binary=:all:",
        "--python-version",
        "3.11",
        "--implementation",
        "cp",
        "--abi",
        "cp311",
        "--platform",
        "manylinux2014_x86_64",
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "any",
    ];
    run_capture(
        Command::new(&pip_prog)
            .args(&pip_pre)
            .args(["download", "-q", "--no-cache-dir", "-d"])
            .arg(&wheeldir)
            .args(platform_args)
            .args(WHEELS),
        "pip download (Radicale and its dependencies from PyPI)",
    )?;
    run_capture(
        Command::new(&pip_prog)
            .args(&pip_pre)
            .args([
                "install",
                "-q",
                "--no-cache-dir",
                "--no-index",
                "--no-compile",
                "--no-warn-script-location",
                "--find-links",
            ])
            .arg(&wheeldir)
            .arg("--target")
            .arg(&site)
            .args(platform_args)
            .args(WHEELS),
        "pip install --target (Radicale into the guest's dist-packages)",
    )?;
    progress(&format!(
        "  pypi: {} wheels installed in {:.1} s",
        WHEELS.len(),
        t.elapsed().as_secs_f64()
    ));

    let t = Instant::now();
    for p in PRUNE {
        let path = root.join(p);
        if path.exists() {
            fs::remove_dir_all(&path).map_err(io_err(&path))?;
        }
    }
    for (p, mode, uid) in DIRS {
        let path = root.join(p);
        fs::create_dir_all(&path).map_err(io_err(&path))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(*mode)).map_err(io_err(&path))?;
        std::os::unix::fs::chown(&path, Some(*uid), Some(*uid)).map_err(io_err(&path))?;
    }
    // Debian's convention: /var/run is /run (a tmpfs guest-init mounts), so the sign-in
    // socket guest-init creates there never outlives a boot.
    let var_run = root.join("var/run");
    if fs::symlink_metadata(&var_run).is_err() {
        symlink("/run", &var_run).map_err(io_err(&var_run))?;
    }
    for (p, mode, content) in written_files() {
        let path = root.join(&p);
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(io_err(dir))?;
        }
        fs::write(&path, content).map_err(io_err(&path))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).map_err(io_err(&path))?;
    }
    run_capture(
        Command::new("chroot").arg(&root).args([
            GUEST_PYTHON,
            "-m",
            "compileall",
            "-q",
            "--invalidation-mode",
            "unchecked-hash",
            "-x",
            "/tests?/|/test_",
            "/usr/lib/python3.11",
            "/usr/lib/python3/dist-packages",
        ]),
        "byte-compiling with the guest's python3.11 (chroot)",
    )?;
    // The guest's interpreter must import Radicale: checked here, not at first boot.
    let version = run_capture(
        Command::new("chroot").arg(&root).args([
            GUEST_PYTHON,
            "-c",
            "import radicale, radicale.auth.dovecot; print(radicale.VERSION)",
        ]),
        "importing radicale with the guest's python3.11 (chroot)",
    )?;
    if version.trim() != RADICALE_VERSION {
        return Err(RootfsError::Step {
            step: "checking Radicale's version".into(),
            status: format!("found {}", version.trim()),
            detail: format!("expected {RADICALE_VERSION}"),
        });
    }
    let content_bytes = tree_bytes(&root);
    progress(&format!(
        "  configured and byte-compiled in {:.1} s ({} MiB of files)",
        t.elapsed().as_secs_f64(),
        content_bytes >> 20
    ));

    let t = Instant::now();
    let image = work.join("rootfs.ext4");
    let size = round_up(content_bytes + content_bytes / 4 + HEADROOM_BYTES, 1 << 20);
    let spec = vm_image::rootdisk::RootDiskSpec {
        source: root.clone(),
        size_mib: size >> 20,
        label: "radicale-root".into(),
        normalize_times: true,
    };
    vm_image::rootdisk::build(&spec, &image).map_err(|e| RootfsError::Image(e.to_string()))?;
    let note = work.join("content-bytes");
    fs::write(&note, content_bytes.to_string()).map_err(io_err(&note))?;
    progress(&format!(
        "  ext4 image ({} MiB) made in {:.1} s",
        size >> 20,
        t.elapsed().as_secs_f64()
    ));
    Ok(content_bytes)
}

/// The `pip` program and its leading arguments.
pub(super) fn pip_command(opts: &RootfsOptions) -> Result<(PathBuf, Vec<String>), RootfsError> {
    if let Some(p) = &opts.pip {
        return Ok((p.clone(), Vec::new()));
    }
    let venv_pip = opts.cache_dir.join("venv/bin/pip");
    if venv_pip.is_file() {
        return Ok((venv_pip, Vec::new()));
    }
    let ok = Command::new("python3")
        .args(["-m", "pip", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return Ok(("python3".into(), vec!["-m".into(), "pip".into()]));
    }
    Err(RootfsError::MissingTool {
        program: "pip".into(),
        fix: format!(
            "run scripts/setup.sh (it makes {} with pip)",
            venv_pip.display()
        ),
    })
}

/// Runs a command; returns its standard output, or an error with its standard error's end.
pub(super) fn run_capture(cmd: &mut Command, step: &str) -> Result<String, RootfsError> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| RootfsError::Step {
            step: step.into(),
            status: "not started".into(),
            detail: format!("{program}: {e}"),
        })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(8).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(RootfsError::Step {
            step: step.into(),
            status: out.status.to_string(),
            detail: tail.join(" | "),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(super) fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
        .unwrap_or(false)
}

pub(super) fn nix_is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

pub(super) fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

/// Bytes of regular files under `dir` (symlinks not followed).
pub(super) fn tree_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let Ok(md) = e.path().symlink_metadata() else {
                continue;
            };
            if md.is_dir() {
                stack.push(e.path());
            } else if md.is_file() {
                total += md.len();
            }
        }
    }
    total
}

pub(super) fn read_content_bytes(dir: &Path) -> u64 {
    fs::read_to_string(dir.join("content-bytes"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}
