//! The root disk of a Radicale guest: Debian's Python 3.11 and Radicale 3.9.0 from PyPI,
//! with Radicale's stock Dovecot sign-in configuration, as an ext4 image cached by its
//! inputs.
//!
//! # Why this shape
//!
//! Radicale is a Python program of some 60 MB with its interpreter: too big for an
//! initramfs that the kernel unpacks into RAM on every boot. It lives on a virtio-blk
//! disk instead, and `guest-init` (from the initramfs) switches root into it, then runs
//! Radicale as its own user. The disk holds nothing but what Radicale needs; there is
//! no init system, no shell and no package manager on it.
//!
//! # How it is built, without network beyond the package registries
//!
//! 1. **Python from Debian.** `apt-get download` fetches a fixed list of bookworm
//!    packages ([`DEBS`]: `python3.11-minimal`, `libpython3.11-stdlib` and the shared
//!    libraries they link) from the mirror this machine's apt already uses, and
//!    `dpkg-deb -x` unpacks each into a staging directory. No maintainer script runs, so
//!    nothing needs a chroot with a working package manager, and the result holds about
//!    30 packages instead of the ~100 of a `debootstrap --variant=minbase`. The list was
//!    made from `apt-cache depends --recurse python3.11-minimal libpython3.11-stdlib`,
//!    minus what only maintainer scripts and `mailcap` need (perl, dpkg, tar).
//! 2. **Radicale from PyPI.** The host's `pip` (the `.cache/venv` one `scripts/setup.sh`
//!    makes, else `python3 -m pip`) downloads wheels pinned in [`WHEELS`] for CPython
//!    3.11 on manylinux x86_64, whatever the host's own Python is, and installs them with
//!    `--target` into the guest's `/usr/lib/python3/dist-packages`.
//! 3. **Byte-compiled by the guest's own interpreter**, run in a `chroot` of the staging
//!    directory, with `--invalidation-mode unchecked-hash` so the `.pyc` files do not
//!    depend on file times. Without them every boot would compile the standard library
//!    under TCG, which costs seconds.
//! 4. **Configuration** ([`RADICALE_CONFIG`]): `[auth] type = dovecot` with
//!    `dovecot_socket = /var/run/dovecot/auth-client`, exactly as natively. A `radicale`
//!    user (uid/gid [`RADICALE_UID`]) owns only its storage directory.
//! 5. **The image** is made by `mke2fs -d` from the staging
//!    directory ([`vm_image::rootdisk`]: fixed UUID, times set to the epoch), with
//!    room to spare for Radicale's storage.
//!
//! # Cache
//!
//! The image is cached under `<cache>/rootfs/radicale-<key>/rootfs.ext4`, where `<key>`
//! is a SHA-256 over everything that determines its content: the recipe version, the
//! exact `.deb` files apt would fetch (name, version and SHA-256, from
//! `apt-get download --print-uris`, which needs no network), the pinned wheels and every
//! file this module writes. A new Debian point release or a change here makes a new key
//! and a rebuild; otherwise nothing is downloaded again. A build happens in a private
//! temporary directory and is renamed into place whole, so concurrent builders and a
//! build killed half-way never leave a broken image behind.
//!
//! Building needs root: `dpkg-deb -x` must create root-owned files for `mke2fs -d` to
//! copy, the storage directory must belong to the `radicale` uid, and byte-compiling runs
//! in a chroot. A VM must not write to the cached image: the Radicale scenario
//! (`e2e::radicale_vm`) gives each VM a sparse private copy.

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

mod build;
use build::*;

/// Radicale's version on the disk (from PyPI).
pub const RADICALE_VERSION: &str = "3.9.0";
/// The `radicale` user and group id on the disk.
pub const RADICALE_UID: u32 = 1001;
/// The port Radicale listens on in the guest (all addresses).
pub const RADICALE_PORT: u16 = 5232;
/// Where Radicale opens Dovecot's sign-in socket: the host's path, unchanged.
pub const DOVECOT_SOCKET: &str = "/var/run/dovecot/auth-client";
/// The guest's Python interpreter.
pub const GUEST_PYTHON: &str = "/usr/bin/python3";
/// Radicale's configuration file on the disk.
pub const RADICALE_CONFIG_PATH: &str = "/etc/radicale/config";

/// Bumped whenever the recipe below changes in a way the other inputs do not show.
const RECIPE: &str = "radicale-rootfs/1";

/// Debian bookworm packages unpacked onto the disk: Python 3.11 and its libraries.
pub const DEBS: &[&str] = &[
    "gcc-12-base",
    "libbz2-1.0",
    "libc6",
    "libcom-err2",
    "libcrypt1",
    "libdb5.3",
    "libexpat1",
    "libffi8",
    "libgcc-s1",
    "libgssapi-krb5-2",
    "libk5crypto3",
    "libkeyutils1",
    "libkrb5-3",
    "libkrb5support0",
    "liblzma5",
    "libncursesw6",
    "libnsl2",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "libreadline8",
    "libsqlite3-0",
    "libssl3",
    "libtinfo6",
    "libtirpc-common",
    "libtirpc3",
    "libuuid1",
    "media-types",
    "python3.11-minimal",
    "readline-common",
    "zlib1g",
];

/// Radicale and its dependencies, pinned (what `pip` resolved for `radicale==3.9.0`).
pub const WHEELS: &[&str] = &[
    "radicale==3.9.0",
    "certifi==2026.10.19.post1",
    "charset-normalizer==3.5.3",
    "defusedxml==0.7.1",
    "idna==3.20",
    "libpass==1.9.4",
    "pika==1.4.4",
    "python-dateutil==4.0.0",
    "pytz==2026.6",
    "requests==2.34.2",
    "six==1.17.0",
    "tzdata==2026.6",
    "urllib3==2.8.0",
    "vobject==0.9.9",
];

/// Radicale's configuration: the stock Dovecot backend, listening on all addresses.
pub const RADICALE_CONFIG: &str = "\
# Radicale in a micro-VM. The [auth] section is Radicale's stock Dovecot configuration,
# the same as on a host: guest-init listens at this path and forwards each connection to
# the host's Dovecot through vsock and host-relay.
[server]
hosts = 0.0.0.0:5232

[auth]
type = dovecot
dovecot_socket = /var/run/dovecot/auth-client

[storage]
filesystem_folder = /var/lib/radicale/collections

[logging]
level = info
mask_passwords = True
";

/// Small system files Python and Radicale look at: (path, mode, content).
const ETC_FILES: &[(&str, u32, &str)] = &[
    (
        "etc/passwd",
        0o644,
        "root:x:0:0:root:/root:/usr/sbin/nologin\n\
         radicale:x:1001:1001:Radicale:/var/lib/radicale:/usr/sbin/nologin\n\
         nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    ),
    (
        "etc/group",
        0o644,
        "root:x:0:\nradicale:x:1001:\nnogroup:x:65534:\n",
    ),
    (
        "etc/nsswitch.conf",
        0o644,
        "passwd: files\ngroup: files\nshadow: files\nhosts: files\n",
    ),
    ("etc/hosts", 0o644, "127.0.0.1 localhost\n::1 localhost\n"),
    ("etc/hostname", 0o644, "radicale-vm\n"),
    (
        "etc/os-release",
        0o644,
        "PRETTY_NAME=\"Radicale micro-VM root (Debian 12 packages)\"\nID=debian\nVERSION_ID=\"12\"\n",
    ),
];

/// Directories on the disk: (path, mode, owner uid).
const DIRS: &[(&str, u32, u32)] = &[
    ("dev", 0o755, 0),
    ("proc", 0o555, 0),
    ("sys", 0o555, 0),
    ("run", 0o755, 0),
    ("tmp", 0o1777, 0),
    ("root", 0o700, 0),
    ("var/lib/radicale", 0o750, RADICALE_UID),
    ("var/lib/radicale/collections", 0o750, RADICALE_UID),
];

/// Unpacked content the guest never reads, removed to keep the disk small.
const PRUNE: &[&str] = &[
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/lintian",
    "usr/share/locale",
    "usr/lib/python3.11/ensurepip",
    "usr/lib/python3.11/idlelib",
    "usr/lib/python3.11/lib2to3",
    "usr/lib/python3.11/pydoc_data",
    "usr/lib/python3.11/turtledemo",
];

/// Free space left on the disk beyond its content, for Radicale's storage.
const HEADROOM_BYTES: u64 = 64 << 20;

/// Where and how to build.
#[derive(Clone, Debug)]
pub struct RootfsOptions {
    /// The cache directory (`$MICROVM_CACHE` or `<repo>/.cache`); the image goes under
    /// `rootfs/` in it.
    pub cache_dir: PathBuf,
    /// The `pip` to use; default: `<cache>/venv/bin/pip` if present, else
    /// `python3 -m pip`.
    pub pip: Option<PathBuf>,
}

impl RootfsOptions {
    /// Options with the default `pip`.
    pub fn new(cache_dir: impl Into<PathBuf>) -> Self {
        RootfsOptions {
            cache_dir: cache_dir.into(),
            pip: None,
        }
    }
}

/// A root disk ready to attach.
#[derive(Clone, Debug)]
pub struct RadicaleRootfs {
    /// The ext4 image (read-only use: attach with `snapshot=on` or copy it).
    pub image: PathBuf,
    /// The cache key (hex SHA-256 prefix of the inputs).
    pub key: String,
    /// The image's size in bytes.
    pub image_bytes: u64,
    /// The bytes of files on the disk.
    pub content_bytes: u64,
    /// Whether the image came from the cache (no build).
    pub from_cache: bool,
    /// How long [`ensure`] took.
    pub elapsed: Duration,
}

/// Why a root disk could not be built.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    /// Building needs root.
    #[error(
        "building the Radicale root disk needs root (dpkg-deb must create root-owned files \
         and byte-compiling runs in a chroot); run it as root, as CI does"
    )]
    NotRoot,
    /// A program the build runs is missing.
    #[error("{program} is missing: {fix}")]
    MissingTool {
        /// The program.
        program: String,
        /// How to get it.
        fix: String,
    },
    /// A step failed.
    #[error("{step} failed ({status}): {detail}")]
    Step {
        /// What was being done.
        step: String,
        /// The exit status.
        status: String,
        /// The end of its standard error, and what to check.
        detail: String,
    },
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The image could not be made.
    #[error("making the ext4 image: {0}")]
    Image(String),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> RootfsError + '_ {
    move |source| RootfsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Returns the cached Radicale root disk, building it first if its inputs changed.
/// `progress` receives one line per step of a build.
pub fn ensure(
    opts: &RootfsOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<RadicaleRootfs, RootfsError> {
    let start = Instant::now();
    for (program, fix) in [
        ("apt-get", "this builder needs a Debian host"),
        ("dpkg-deb", "this builder needs a Debian host"),
        ("chroot", "install coreutils"),
        (
            "mke2fs",
            "apt-get install e2fsprogs (scripts/setup.sh does)",
        ),
    ] {
        if !on_path(program) {
            return Err(RootfsError::MissingTool {
                program: program.into(),
                fix: fix.into(),
            });
        }
    }
    let debs = match resolve_debs() {
        Ok(d) => d,
        Err(_) => {
            progress("apt lists do not know every package: apt-get update");
            apt_update()?;
            resolve_debs()?
        }
    };
    let key = input_key(&debs);
    let dir = opts
        .cache_dir
        .join("rootfs")
        .join(format!("radicale-{key}"));
    let image = dir.join("rootfs.ext4");
    if image.is_file() {
        return Ok(RadicaleRootfs {
            image_bytes: fs::metadata(&image).map_err(io_err(&image))?.len(),
            content_bytes: read_content_bytes(&dir),
            image,
            key,
            from_cache: true,
            elapsed: start.elapsed(),
        });
    }
    if !nix_is_root() {
        return Err(RootfsError::NotRoot);
    }
    progress(&format!(
        "building the Radicale root disk (key {key}): Python 3.11 from Debian, Radicale \
         {RADICALE_VERSION} from PyPI"
    ));
    let parent = opts.cache_dir.join("rootfs");
    fs::create_dir_all(&parent).map_err(io_err(&parent))?;
    let work = parent.join(format!(
        ".build-radicale-{key}-{}-{}",
        std::process::id(),
        start.elapsed().as_nanos()
    ));
    let result = build_into(&work, opts, &debs, progress);
    let content_bytes = match result {
        Ok(n) => n,
        Err(e) => {
            let _ = fs::remove_dir_all(&work);
            return Err(e);
        }
    };
    // Publish whole: only the image and its size note remain.
    let _ = fs::remove_dir_all(work.join("root"));
    let _ = fs::remove_dir_all(work.join("debs"));
    let _ = fs::remove_dir_all(work.join("wheels"));
    if let Err(e) = fs::rename(&work, &dir) {
        // Another builder won the race: use its image.
        let _ = fs::remove_dir_all(&work);
        if !image.is_file() {
            return Err(RootfsError::Io {
                path: dir,
                source: e,
            });
        }
    }
    let image_bytes = fs::metadata(&image).map_err(io_err(&image))?.len();
    progress(&format!(
        "root disk ready: {} ({} MiB image, {} MiB of files) in {:.1} s",
        image.display(),
        image_bytes >> 20,
        content_bytes >> 20,
        start.elapsed().as_secs_f64()
    ));
    Ok(RadicaleRootfs {
        image,
        key,
        image_bytes,
        content_bytes,
        from_cache: false,
        elapsed: start.elapsed(),
    })
}

/// The content of every file this module writes, in a fixed order (part of the key).
fn written_files() -> Vec<(String, u32, String)> {
    let mut v: Vec<(String, u32, String)> = ETC_FILES
        .iter()
        .map(|(p, m, c)| (p.to_string(), *m, c.to_string()))
        .collect();
    v.push((
        RADICALE_CONFIG_PATH.trim_start_matches('/').to_string(),
        0o644,
        RADICALE_CONFIG.to_string(),
    ));
    v
}

/// SHA-256 over every input, as 16 hex digits.
fn input_key(debs: &[String]) -> String {
    let mut h = Sha256::new();
    let mut feed = |label: &str, value: &str| {
        h.update(label.as_bytes());
        h.update([0]);
        h.update(value.as_bytes());
        h.update([0]);
    };
    feed("recipe", RECIPE);
    for d in debs {
        feed("deb", d);
    }
    for w in WHEELS {
        feed("wheel", w);
    }
    for (p, m, c) in written_files() {
        feed("file", &format!("{p} {m:o}"));
        feed("content", &c);
    }
    for (p, m, u) in DIRS {
        feed("dir", &format!("{p} {m:o} {u}"));
    }
    for p in PRUNE {
        feed("prune", p);
    }
    feed("headroom", &HEADROOM_BYTES.to_string());
    let digest = h.finalize();
    let mut s = String::new();
    for b in &digest[..8] {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_radicales_stock_dovecot_backend() {
        assert!(RADICALE_CONFIG.contains("\n[auth]\ntype = dovecot\n"));
        assert!(RADICALE_CONFIG.contains(&format!("dovecot_socket = {DOVECOT_SOCKET}\n")));
        assert!(RADICALE_CONFIG.contains(&format!("hosts = 0.0.0.0:{RADICALE_PORT}\n")));
    }

    #[test]
    fn radicale_user_matches_its_uid_and_owns_its_storage() {
        let passwd = ETC_FILES.iter().find(|f| f.0 == "etc/passwd").unwrap().2;
        assert!(passwd.contains(&format!("radicale:x:{RADICALE_UID}:{RADICALE_UID}:")));
        assert!(DIRS
            .iter()
            .any(|(p, _, u)| *p == "var/lib/radicale/collections" && *u == RADICALE_UID));
    }

    #[test]
    fn key_changes_with_any_package_and_is_stable() {
        let a = vec!["libc6_2.36-9_amd64.deb SHA256:aa".to_string()];
        let b = vec!["libc6_2.36-10_amd64.deb SHA256:bb".to_string()];
        assert_eq!(input_key(&a), input_key(&a));
        assert_ne!(input_key(&a), input_key(&b));
        assert_eq!(input_key(&a).len(), 16);
    }

    #[test]
    fn pinned_radicale_is_the_documented_version() {
        assert!(WHEELS.contains(&"radicale==3.9.0"));
        assert_eq!(RADICALE_VERSION, "3.9.0");
    }
}
