//! Setting up the app's socket path: parents, stale sockets, files that must not be
//! touched, owner/group/mode, and clean removal. Each test breaks if the property it names
//! regresses (see the threat model in `guest-init/src/forward.rs`).

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use crate::support::forward::*;
use guest_init::forward::{self, ForwardError};
use guest_init::ids::IdRef;

fn is_socket(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket())
}

async fn round_trip(p: &Path) {
    let c = unix(p).connect().await.unwrap();
    c.write_all(b"ping").await.unwrap();
    c.shutdown_write().unwrap();
    assert_eq!(guard("echo", read_all(&c)).await.unwrap(), b"ping");
}

#[tokio::test]
async fn a_stale_socket_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("app.sock");
    let host = unix(&dir.path().join("host.sock"));
    spawn_echo_server(&host);
    // A socket file left behind by a previous run: bound, then its listener gone.
    drop(std::os::unix::net::UnixListener::bind(&app_path).unwrap());
    assert!(is_socket(&app_path));
    let _fwd = forward::start(&[service("stale", &app_path, host)], &[])
        .await
        .unwrap();
    // Connections now reach the forwarder (the old file was unlinked and a new one bound;
    // inode numbers are no evidence, filesystems reuse them at once).
    round_trip(&app_path).await;
}

#[tokio::test]
async fn a_regular_file_at_the_path_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("app.sock");
    std::fs::write(&app_path, b"precious data").unwrap();
    let err = forward::start(
        &[service("svc", &app_path, unix(&dir.path().join("host")))],
        &[],
    )
    .await
    .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ForwardError::Publish { .. }), "{msg}");
    assert!(msg.starts_with("svc: cannot listen: "), "{msg}");
    assert!(msg.contains(&app_path.display().to_string()), "{msg}");
    assert!(
        msg.contains("regular file") && msg.contains("refusing to delete"),
        "{msg}"
    );
    assert_eq!(std::fs::read(&app_path).unwrap(), b"precious data");
}

#[tokio::test]
async fn a_directory_or_symlink_at_the_path_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let target = unix(&dir.path().join("host"));
    let d = dir.path().join("adir");
    std::fs::create_dir(&d).unwrap();
    let msg = forward::start(&[service("svc", &d, target.clone())], &[])
        .await
        .unwrap_err()
        .to_string();
    assert!(msg.contains("is a directory"), "{msg}");
    assert!(d.is_dir());

    // A symlink to a stale socket elsewhere: neither the link nor what it points to is
    // removed.
    let elsewhere = dir.path().join("elsewhere.sock");
    drop(std::os::unix::net::UnixListener::bind(&elsewhere).unwrap());
    let link = dir.path().join("link.sock");
    std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
    let msg = forward::start(&[service("svc", &link, target)], &[])
        .await
        .unwrap_err()
        .to_string();
    assert!(msg.contains("symbolic link"), "{msg}");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(is_socket(&elsewhere));
}

#[tokio::test]
async fn a_live_socket_is_not_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("app.sock");
    let live = std::os::unix::net::UnixListener::bind(&app_path).unwrap();
    let ino = std::fs::metadata(&app_path).unwrap().ino();
    let msg = forward::start(
        &[service("svc", &app_path, unix(&dir.path().join("host")))],
        &[],
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(msg.contains("another process is listening"), "{msg}");
    assert_eq!(std::fs::metadata(&app_path).unwrap().ino(), ino);
    drop(live);
}

#[tokio::test]
async fn parents_owner_group_and_mode_are_set() {
    if !require(is_root(), "root, to give a socket to another user") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("run/dovecot/auth-client");
    let host = unix(&dir.path().join("host.sock"));
    spawn_echo_server(&host);
    let mut spec = service("dovecot-auth", &app_path, host.clone());
    spec.owner = Some(IdRef::Id(20001));
    spec.group = Some(IdRef::Name("20002".into()));
    spec.mode = Some("0640".parse().unwrap());
    let other = dir.path().join("run/other.sock");
    let _fwd = forward::start(&[spec, service("other", &other, host)], &[])
        .await
        .unwrap();
    for d in ["run", "run/dovecot"] {
        let m = std::fs::metadata(dir.path().join(d)).unwrap();
        assert_eq!(m.permissions().mode() & 0o7777, 0o755, "{d}");
    }
    let m = std::fs::symlink_metadata(&app_path).unwrap();
    assert!(m.file_type().is_socket());
    assert_eq!((m.uid(), m.gid()), (20001, 20002));
    assert_eq!(m.permissions().mode() & 0o7777, 0o640);
    // No mode configured: the documented default.
    let m = std::fs::symlink_metadata(&other).unwrap();
    assert_eq!(
        m.permissions().mode() & 0o7777,
        forward::DEFAULT_MODE.bits()
    );
    assert_eq!((m.uid(), m.gid()), (0, 0));
    round_trip(&app_path).await;
}

#[tokio::test]
async fn an_unknown_owner_is_an_error_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("app.sock");
    let mut spec = service("svc", &app_path, unix(&dir.path().join("host")));
    spec.owner = Some(IdRef::Name("no-such-user-forward".into()));
    let msg = forward::start(&[spec], &[]).await.unwrap_err().to_string();
    assert!(msg.starts_with("services[0].owner: "), "{msg}");
    assert!(msg.contains("no-such-user-forward"), "{msg}");
    assert!(
        !app_path.exists(),
        "nothing is created for an invalid configuration"
    );
}

#[tokio::test]
async fn close_removes_only_the_sockets_it_created() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.sock");
    let b = dir.path().join("b.sock");
    let host = unix(&dir.path().join("host.sock"));
    spawn_echo_server(&host);
    let mut fwd = forward::start(
        &[service("a", &a, host.clone()), service("b", &b, host)],
        &[],
    )
    .await
    .unwrap();
    assert_eq!(fwd.listeners(), 2);
    assert_eq!(
        fwd.socket_paths().collect::<Vec<_>>(),
        [a.as_path(), b.as_path()]
    );
    // Someone replaces b with their own file; close must leave it alone.
    std::fs::remove_file(&b).unwrap();
    std::fs::write(&b, b"not ours").unwrap();
    fwd.close();
    assert!(!a.exists(), "our socket is removed");
    assert_eq!(std::fs::read(&b).unwrap(), b"not ours");
    assert!(
        unix(&a).connect().await.is_err(),
        "nothing accepts any more"
    );
    fwd.close(); // idempotent
}

#[tokio::test]
async fn a_failed_start_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.sock");
    let b = dir.path().join("b.sock");
    std::fs::write(&b, b"in the way").unwrap();
    let host = unix(&dir.path().join("host.sock"));
    let err = forward::start(
        &[service("a", &a, host.clone()), service("b", &b, host)],
        &[],
    )
    .await
    .unwrap_err();
    assert!(err.to_string().starts_with("b: "), "{err}");
    assert!(
        !a.exists(),
        "the first service's socket must be removed again"
    );
}

#[tokio::test]
async fn dropping_the_forwarders_stops_accepting_and_unlinks() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.sock");
    let host = unix(&dir.path().join("host.sock"));
    spawn_echo_server(&host);
    let fwd = forward::start(&[service("a", &a, host)], &[])
        .await
        .unwrap();
    round_trip(&a).await;
    drop(fwd);
    assert!(!a.exists());
}

/// Radicale's Dovecot client does `settimeout(5)` then `connect`: a non-blocking connect.
/// Against the app's forwarded socket, with the accept loop not running yet, the kernel
/// must queue far more than 128 such connects (nix's `Backlog` once capped it there and
/// the 129th caller got `EAGAIN`). Checked from outside, by the connects the kernel
/// takes (host-relay's test also reads the backlog with `ss`).
#[test]
fn the_apps_socket_queues_thousands_of_nonblocking_connects() {
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
    use std::os::fd::AsRawFd;
    vm_transport::fdlimit::raise_fd_limit().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let app_path = dir.path().join("auth-client");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // `start` returns with the socket listening; the runtime is then never driven again,
    // so nobody accepts and the kernel's queue is all there is.
    let fwd = rt
        .block_on(forward::start(
            &[service("auth", &app_path, unix(&dir.path().join("host")))],
            &[],
        ))
        .unwrap();
    let addr = UnixAddr::new(&app_path).unwrap();
    let mut held = Vec::new();
    for n in 0..2000 {
        let fd = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK,
            None,
        )
        .unwrap();
        if let Err(e) = connect(fd.as_raw_fd(), &addr) {
            panic!("non-blocking connect {} refused ({e})", n + 1);
        }
        held.push(fd);
    }
    drop(fwd);
    drop(rt);
}

/// The security review's finding against the forwarder: in ordinary-process mode an app
/// that owns the socket's parent directory swaps the fresh socket for a symlink, and the
/// forwarder's `chmod` (default mode 0666) makes the link's target world-writable. A
/// bounded swap loop against repeated starts must leave the victim's mode alone.
#[tokio::test]
async fn a_symlink_swapped_in_never_receives_the_sockets_mode() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"secret").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    let sockdir = dir.path().join("app");
    std::fs::create_dir(&sockdir).unwrap();
    let path = sockdir.join("s");
    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let (stop, path, victim) = (stop.clone(), path.clone(), victim.clone());
        let junk = sockdir.join("junk");
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if std::fs::rename(&path, &junk).is_ok() {
                    let _ = std::os::unix::fs::symlink(&victim, &path);
                }
            }
        })
    };
    let target = unix(&dir.path().join("host"));
    let (mut started, deadline) = (
        0,
        std::time::Instant::now() + std::time::Duration::from_secs(3),
    );
    while std::time::Instant::now() < deadline {
        let _ = std::fs::remove_file(&path);
        if let Ok(fwd) = forward::start(&[service("s", &path, target.clone())], &[]).await {
            started += 1;
            drop(fwd);
        }
        let mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o7777;
        assert_eq!(
            mode, 0o600,
            "the victim became {mode:o} after {started} starts"
        );
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    assert!(
        started > 50,
        "the race was not exercised ({started} starts)"
    );
}
