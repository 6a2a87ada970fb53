//! Publishing Unix sockets against a hostile neighbour: each test breaks one promise of
//! `vm_transport::publish` if it regresses.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vm_transport::mode::SocketMode;
use vm_transport::publish::{publish, Access, PublishError};

const NOBODY: u32 = 65534;

fn access(mode: u32) -> Access {
    Access {
        mode: SocketMode::new(mode).unwrap(),
        uid: None,
        gid: None,
    }
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".publish"))
        .collect()
}

#[test]
fn mode_and_owner_are_set_before_the_socket_listens() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let mut a = access(0o640);
    if is_root() {
        a.uid = Some(NOBODY);
        a.gid = Some(NOBODY);
    }
    let p = publish(&path, a, false).unwrap();
    let m = std::fs::symlink_metadata(&path).unwrap();
    assert_eq!(m.permissions().mode() & 0o7777, 0o640);
    if is_root() {
        assert_eq!((m.uid(), m.gid()), (NOBODY, NOBODY));
    }
    UnixStream::connect(&path).expect("published socket accepts connects");
    assert!(
        leftovers(dir.path()).is_empty(),
        "private directory left behind"
    );
    drop(p);
    assert!(!path.exists(), "the socket file is removed when dropped");
}

#[test]
fn a_live_socket_is_refused_and_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let first = publish(&path, access(0o600), false).unwrap();
    let err = publish(&path, access(0o600), false).unwrap_err();
    assert!(matches!(err, PublishError::Live { .. }), "{err}");
    assert!(
        err.to_string().contains("another process is listening"),
        "{err}"
    );
    // The second attempt neither unlinked nor replaced the first one's file.
    assert!(first.file.is_ours());
    UnixStream::connect(&path).expect("the first publisher is still reachable");
    // Nor does dropping the failed attempt remove anything.
    assert!(leftovers(dir.path()).is_empty());
}

#[test]
fn a_stale_socket_is_replaced_and_other_files_are_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    drop(UnixListener::bind(&path).unwrap());
    let p = publish(&path, access(0o600), false).expect("stale socket replaced");
    drop(p);

    let target = dir.path().join("target");
    std::fs::write(&target, b"keep").unwrap();
    for (what, make) in [
        (
            "a regular file",
            Box::new(|p: &Path| std::fs::write(p, b"data").unwrap()) as Box<dyn Fn(&Path)>,
        ),
        (
            "a directory",
            Box::new(|p: &Path| std::fs::create_dir(p).unwrap()),
        ),
        (
            "a symbolic link",
            Box::new(|p: &Path| std::os::unix::fs::symlink(dir.path().join("target"), p).unwrap()),
        ),
    ] {
        make(&path);
        let before = std::fs::symlink_metadata(&path).unwrap();
        let err = publish(&path, access(0o600), false).unwrap_err();
        assert!(err.to_string().contains(what), "{what}: {err}");
        let after = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!(
            (before.ino(), before.mode()),
            (after.ino(), after.mode()),
            "{what} was changed"
        );
        if after.is_dir() {
            std::fs::remove_dir(&path).unwrap();
        } else {
            std::fs::remove_file(&path).unwrap();
        }
    }
    assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    assert!(leftovers(dir.path()).is_empty());
}

#[test]
fn only_our_own_inode_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let mut p = publish(&path, access(0o600), false).unwrap();
    // Someone replaces the file (say, an operator starting another service there).
    std::fs::remove_file(&path).unwrap();
    let theirs = UnixListener::bind(&path).unwrap();
    assert!(!p.file.is_ours());
    p.file.remove().unwrap();
    drop(p);
    assert!(path.exists(), "another process's socket was removed");
    UnixStream::connect(&path).unwrap();
    drop(theirs);
}

#[test]
fn missing_parents_are_made_0755_whatever_the_umask() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a/b/s");
    let p = publish(&path, access(0o666), true).unwrap();
    for d in [dir.path().join("a"), dir.path().join("a/b")] {
        let m = std::fs::metadata(&d).unwrap();
        assert_eq!(m.permissions().mode() & 0o7777, 0o755, "{}", d.display());
    }
    drop(p);
}

/// The attack of the security review: a neighbour who can write the socket's directory
/// swaps the fresh socket for a symlink to a root-owned file, hoping that root's owner and
/// mode change follows it. A bounded loop of publishes against a swapping thread must
/// leave the victim untouched. (Bind-then-`chown(path)`/`chmod(path)` fails this within
/// seconds here.)
#[test]
fn a_symlink_swapped_in_during_publishing_never_redirects_owner_or_mode() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let victim = tempfile::NamedTempFile::new().unwrap();
    std::fs::set_permissions(victim.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
    let before = std::fs::metadata(victim.path()).unwrap();
    let path = dir.path().join("vm.vsock_5001");

    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicU64::new(0));
    let swapper = {
        let (stop, swaps, path) = (stop.clone(), swaps.clone(), path.clone());
        let victim = victim.path().to_path_buf();
        let junk = dir.path().join("junk");
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if std::fs::rename(&path, &junk).is_ok()
                    && std::os::unix::fs::symlink(&victim, &path).is_ok()
                {
                    swaps.fetch_add(1, Ordering::Relaxed);
                }
                std::hint::spin_loop();
            }
        })
    };
    let mut a = access(0o600);
    if is_root() {
        a.uid = Some(NOBODY);
        a.gid = Some(NOBODY);
    }
    let (mut attempts, mut published) = (0u64, 0u64);
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        attempts += 1;
        // Clear the neighbour's symlink so most attempts get as far as binding.
        let _ = std::fs::remove_file(&path);
        if let Ok(p) = publish(&path, a, false) {
            published += 1;
            drop(p);
        }
        let after = std::fs::metadata(victim.path()).unwrap();
        assert_eq!(
            (after.uid(), after.gid(), after.mode()),
            (before.uid(), before.gid(), before.mode()),
            "the victim's owner or mode changed after {attempts} attempts"
        );
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    assert!(
        published > 100,
        "the race was not exercised: {published} of {attempts} published"
    );
    assert!(
        swaps.load(Ordering::Relaxed) > 100,
        "the neighbour never swapped"
    );
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(dir.path().join("junk"));
    assert!(
        leftovers(dir.path()).is_empty(),
        "{:?}",
        leftovers(dir.path())
    );
}

/// Every descriptor a publish leaves open (the listener, the directory handle the socket
/// file keeps for its removal) is close-on-exec: a program the process starts, the app
/// included, must not inherit a handle on the socket's directory or the listener.
#[test]
fn no_descriptor_is_inherited_by_a_program_started_later() {
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let p = publish(&dir.path().join("s"), access(0o600), true).unwrap();
    // The directory handle: found by what it names (other tests open descriptors too).
    let canonical = dir.path().canonicalize().unwrap();
    let handles: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let fd: i32 = e.file_name().to_str()?.parse().ok()?;
            (std::fs::read_link(e.path()).ok()? == canonical).then_some(fd)
        })
        .collect();
    assert!(
        !handles.is_empty(),
        "no descriptor names {}",
        canonical.display()
    );
    for fd in handles.into_iter().chain([p.fd.as_raw_fd()]) {
        // SAFETY: F_GETFD only reads a descriptor's flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        assert!(flags >= 0, "descriptor {fd}");
        assert_ne!(
            flags & libc::FD_CLOEXEC,
            0,
            "descriptor {fd} lacks FD_CLOEXEC"
        );
    }
    drop(p);
}

/// The directory is held by a handle opened as a directory (`O_DIRECTORY`): a parent that
/// is a file fails right there, saying so, before anything is inspected or created.
#[test]
fn a_parent_that_is_not_a_directory_is_refused_when_opened() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, b"").unwrap();
    let e = publish(&file.join("s"), access(0o600), false).unwrap_err();
    assert!(e.to_string().contains("cannot open the directory"), "{e}");
    assert_eq!(std::fs::read(&file).unwrap(), b"");
}

/// Only a group (the usual way to let one service's users in): the group is set, the
/// owner stays the publisher.
#[test]
fn a_group_alone_is_set() {
    if !is_root() {
        eprintln!("skipped: setting another group needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let mut a = access(0o660);
    a.gid = Some(NOBODY);
    let p = publish(&path, a, false).unwrap();
    let m = std::fs::symlink_metadata(&path).unwrap();
    assert_eq!((m.uid(), m.gid()), (0, NOBODY));
    drop(p);
}

/// A parent that cannot be made (here: below a regular file) fails where it is made,
/// naming it.
#[test]
fn a_parent_that_cannot_be_made_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, b"").unwrap();
    let e = publish(&file.join("a/s"), access(0o600), true).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("cannot create the parent directory"), "{msg}");
    assert!(msg.contains("file/a"), "{msg}");
}

/// A live service too busy to take another connection (its backlog full) is still live:
/// the probe never waits for it, and publishing refuses.
#[test]
fn a_live_socket_with_a_full_backlog_is_refused_without_waiting() {
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    // A listener with the smallest backlog that never accepts, filled up.
    let fd = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::Stream,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    let addr = nix::sys::socket::UnixAddr::new(&path).unwrap();
    nix::sys::socket::bind(fd.as_raw_fd(), &addr).unwrap();
    nix::sys::socket::listen(&fd, nix::sys::socket::Backlog::new(0).unwrap()).unwrap();
    let mut queued = Vec::new();
    loop {
        let c = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::Stream,
            nix::sys::socket::SockFlag::SOCK_NONBLOCK | nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        match nix::sys::socket::connect(c.as_raw_fd(), &addr) {
            Ok(()) => queued.push(c),
            Err(nix::errno::Errno::EAGAIN) => break,
            Err(e) => panic!("filling the backlog: {e}"),
        }
        assert!(queued.len() < 64, "the backlog never filled");
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.clone();
    std::thread::spawn(move || {
        let _ = tx.send(publish(&p, access(0o600), false).map(drop));
    });
    let result = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("publishing waited on a busy live socket");
    let err = result.unwrap_err();
    assert!(matches!(err, PublishError::Live { .. }), "{err}");
    drop(queued);
}
