//! Switching to the root device: mount it at `/newroot`, move `/dev`, `/proc`, `/sys` and
//! `/run` into it, then make it `/` (see the [`boot`](super) documentation). A device that
//! does not appear in time is an error naming `root.device` and its driver.

use std::fs;
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};

use super::{mounts, BootError};
use crate::config::RootConfig;
use crate::info;

fn root_err(what: impl Into<String>) -> impl FnOnce(nix::errno::Errno) -> BootError {
    let what = what.into();
    move |e| BootError::Root {
        what,
        source: e.into(),
    }
}

/// Mounts the root device and makes it `/`, as described in the module documentation.
pub fn switch_root(root: &RootConfig) -> Result<(), BootError> {
    let deadline = Instant::now() + Duration::from_millis(root.wait_ms);
    while !root.device.exists() {
        if Instant::now() >= deadline {
            return Err(BootError::Root {
                what: format!(
                    "device {} did not appear within {} ms; check root.device and that its driver (virtio_blk) is in `modules`",
                    root.device.display(),
                    root.wait_ms
                ),
                source: io::ErrorKind::NotFound.into(),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let new = Path::new("/newroot");
    fs::create_dir_all(new).map_err(|source| BootError::Root {
        what: "cannot create /newroot".into(),
        source,
    })?;
    let mut flags = MsFlags::empty();
    if root.read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    let data = (!root.options.is_empty()).then_some(root.options.as_str());
    mount(
        Some(root.device.as_path()),
        new,
        Some(root.fstype.as_str()),
        flags,
        data,
    )
    .map_err(root_err(format!(
        "cannot mount {} ({}) on /newroot",
        root.device.display(),
        root.fstype
    )))?;
    let present = mounts::mounted_now();
    for d in ["/dev", "/proc", "/sys", "/run"] {
        if !present.iter().any(|p| p == Path::new(d)) {
            continue;
        }
        let target = new.join(&d[1..]);
        fs::create_dir_all(&target).map_err(|source| BootError::Root {
            what: format!("cannot create {}", target.display()),
            source,
        })?;
        mount(
            Some(d),
            &target,
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .map_err(root_err(format!("cannot move {d} into the new root")))?;
    }
    nix::unistd::chdir(new).map_err(root_err("chdir /newroot"))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(root_err("cannot move /newroot to /"))?;
    nix::unistd::chroot(".").map_err(root_err("chroot"))?;
    nix::unistd::chdir("/").map_err(root_err("chdir /"))?;
    mounts::record_switch_root();
    info!(
        "switched root to {} ({})",
        root.device.display(),
        root.fstype
    );
    Ok(())
}
