//! The neighbour who swaps files while we publish, at exactly the moment each defence is
//! for. [`NEIGHBOUR`] is called at the points `publish` names (see `neighbour`); each test
//! installs a swap for one point and checks that the swap changes nothing it must not.

use std::cell::RefCell;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use super::*;

type Hook = Box<dyn FnMut(&'static str, &Path)>;

thread_local! {
    /// The neighbour's move, if a test installed one (this thread only).
    pub(super) static NEIGHBOUR: RefCell<Option<Hook>> = RefCell::new(None);
}

/// Runs `f` with `hook` standing in for the neighbour at `point` (once).
fn with_neighbour<T>(
    point: &'static str,
    mut hook: impl FnMut(&Path) + 'static,
    f: impl FnOnce() -> T,
) -> T {
    let mut done = false;
    NEIGHBOUR.with(|n| {
        *n.borrow_mut() = Some(Box::new(move |p, path| {
            if p == point && !done {
                done = true;
                hook(path);
            }
        }));
    });
    let out = f();
    NEIGHBOUR.with(|n| *n.borrow_mut() = None);
    out
}

fn access() -> Access {
    Access {
        mode: SocketMode::OWNER_ONLY,
        uid: None,
        gid: None,
    }
}

/// A directory of ours with mode 0700: what `is_private` would accept.
fn victim_dir(dir: &Path) -> std::path::PathBuf {
    let v = dir.join("victim");
    std::fs::DirBuilder::new().mode(0o700).create(&v).unwrap();
    std::fs::set_permissions(&v, std::fs::Permissions::from_mode(0o700)).unwrap();
    v
}

#[test]
fn a_live_socket_that_replaces_the_stale_one_is_not_unlinked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    drop(UnixListener::bind(&path).unwrap()); // stale
    let live = std::rc::Rc::new(RefCell::new(None));
    let (l, d) = (std::rc::Rc::clone(&live), dir.path().to_path_buf());
    let result = with_neighbour(
        "judged stale",
        move |p| {
            // Another service starts and moves its socket over the stale one.
            let tmp = d.join("new");
            *l.borrow_mut() = Some(UnixListener::bind(&tmp).unwrap());
            std::fs::rename(&tmp, p).unwrap();
        },
        || publish(&path, access(), false),
    );
    let err = result.map(drop).unwrap_err();
    assert!(matches!(err, PublishError::Appeared { .. }), "{err}");
    assert!(live.borrow().is_some());
    UnixStream::connect(&path).expect("the other service's socket was unlinked");
}

#[test]
fn a_symlink_swapped_for_the_private_directory_is_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let victim = victim_dir(dir.path());
    let v = victim.clone();
    let result = with_neighbour(
        "made the private directory",
        move |p| {
            std::fs::remove_dir(p).unwrap();
            std::os::unix::fs::symlink(&v, p).unwrap();
        },
        || publish(&dir.path().join("s"), access(), false),
    );
    assert!(result.is_err(), "published through a swapped-in symlink");
    assert_eq!(
        std::fs::read_dir(&victim).unwrap().count(),
        0,
        "used the victim directory"
    );
    assert!(!dir.path().join("s").exists());
}

#[test]
fn a_directory_swapped_in_for_the_private_one_is_not_removed() {
    let dir = tempfile::tempdir().unwrap();
    let swapped = std::rc::Rc::new(RefCell::new(None));
    let (sw, d) = (std::rc::Rc::clone(&swapped), dir.path().to_path_buf());
    let p = with_neighbour(
        "removing the private directory",
        move |p| {
            // Ours is moved away; someone else's (same file system) takes its name.
            std::fs::rename(p, d.join("moved")).unwrap();
            std::fs::create_dir(p).unwrap();
            *sw.borrow_mut() = Some(p.to_path_buf());
        },
        || publish(&dir.path().join("s"), access(), false),
    )
    .unwrap();
    let theirs = swapped.borrow().clone().expect("the neighbour never moved");
    assert!(theirs.is_dir(), "a directory we did not make was removed");
    drop(p);
}

#[test]
fn a_symlink_swapped_for_a_new_parent_is_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let victim = victim_dir(dir.path());
    let v = victim.clone();
    let result = with_neighbour(
        "made a parent",
        move |p| {
            std::fs::remove_dir(p).unwrap();
            std::os::unix::fs::symlink(&v, p).unwrap();
        },
        || publish(&dir.path().join("a/s"), access(), true),
    );
    let err = result.map(drop).unwrap_err();
    assert!(
        err.to_string().contains("create the parent directory"),
        "{err}"
    );
    let mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o700, "the chmod followed the symlink");
}

#[test]
fn a_parent_someone_else_makes_meanwhile_is_theirs_to_keep() {
    let dir = tempfile::tempdir().unwrap();
    let p = with_neighbour(
        "making a parent",
        |p| {
            std::fs::DirBuilder::new().mode(0o750).create(p).unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o750)).unwrap();
        },
        || publish(&dir.path().join("a/s"), access(), true),
    )
    .unwrap();
    let mode = std::fs::metadata(dir.path().join("a"))
        .unwrap()
        .permissions()
        .mode()
        & 0o7777;
    assert_eq!(mode, 0o750, "their directory's mode was changed");
    drop(p);
}
