//! Publishing a Unix socket at a path: owner and mode set before anyone can connect, no
//! symlink ever followed, a live service never taken over, and only our own file removed.
//!
//! Both sides publish sockets in directories other people can write to: the host relay
//! its per-VM sockets in a directory the VMM's user (and, with `run_as`, the app's user)
//! may write; guest-init the app's unchanged paths, whose parents the app may own. Often
//! as root. So every step is written against a neighbour who swaps files under us.
//!
//! # Threats, and the call that defends against each
//! - **A swapped symlink turns root's `chown`/`chmod` onto another file.** Binding at the
//!   path and then calling `chown(path)` and `chmod(path)` follows a symlink put there in
//!   between: root then hands `/etc/...` or a block device to the socket's owner. Here no
//!   call that follows a link ever names the final path. The socket is bound inside a
//!   *private directory* this process creates next to the path (mode 0700, checked to be
//!   ours through its descriptor), reached through `/proc/self/fd/N` so its name cannot be
//!   swapped either. Mode and owner are set there with `fchmodat`/`fchownat` relative to
//!   that directory's descriptor, where nobody else can create or swap an entry; then
//!   `renameat2(RENAME_NOREPLACE)` moves the finished socket into place. (`fchmod` on a
//!   socket descriptor would not do: it changes the socket, not the file.)
//! - **Reachable with default permissions.** The file is complete (mode, owner) before it
//!   appears at the path, and `listen(2)` comes after that: until then every connect is
//!   refused.
//! - **Taking over a live service.** A socket at the path that accepts a connect is some
//!   running service's: publishing refuses, naming the path, instead of unlinking it and
//!   silently stealing its callers (a second relay started with the same configuration
//!   once did exactly that). A socket nobody listens on is a stale leftover and is
//!   replaced. Anything else (file, directory, symlink, device) is refused: it is not ours
//!   to delete. The final `rename` refuses to replace whatever appeared meanwhile.
//! - **Removing someone else's file.** [`SocketFile`] remembers the device and inode it
//!   put in place and removes the path only while it still names that inode, with
//!   `fstatat`/`unlinkat` relative to the parent's descriptor (neither follows a link).
//!   Callers remove the file *before* they stop listening: while we listen, any other
//!   publisher sees a live socket and refuses, so the path cannot be legitimately re-used
//!   between our check and our unlink. Only someone who can write the directory could
//!   swap it in that instant, and they could delete the file anyway.
//!
//! Parent directories: the host relay requires them to exist; guest-init creates missing
//! ones with mode 0755 (`create_parents`), so the app, which is not root, can reach its
//! socket.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;
use nix::fcntl::{openat, OFlag, AT_FDCWD};
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
use nix::sys::stat::{fchmodat, fstat, fstatat, mkdirat, FchmodatFlags, FileStat, Mode, SFlag};
use nix::unistd::{fchownat, unlinkat, Gid, Uid, UnlinkatFlags};

use crate::listener::listen_on;
use crate::mode::SocketMode;

/// Who may connect: the file's mode, and optionally its owner and group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    /// Permission bits of the socket file.
    pub mode: SocketMode,
    /// Owner to set, or leave the creator's.
    pub uid: Option<u32>,
    /// Group to set, or leave the creator's.
    pub gid: Option<u32>,
}

/// Why a socket could not be published.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Something that is not a socket is at the path.
    #[error("{} is {what}, not a socket; refusing to delete it (remove it yourself or choose another path)", path.display())]
    InTheWay {
        /// The path.
        path: PathBuf,
        /// What is there: "a regular file", "a symbolic link"...
        what: &'static str,
    },
    /// A running service listens at the path.
    #[error("another process is listening at {}; stop it or choose another path", path.display())]
    Live {
        /// The path.
        path: PathBuf,
    },
    /// Something was created at the path while the socket was being published.
    #[error("{}: something else created a file there while this socket was being published; refusing to replace it (find out what else uses the path)", path.display())]
    Appeared {
        /// The path.
        path: PathBuf,
    },
    /// The path cannot name a socket.
    #[error("{}: {reason}", path.display())]
    BadPath {
        /// The path.
        path: PathBuf,
        /// Why.
        reason: &'static str,
    },
    /// A system call failed.
    #[error("{}: cannot {action}: {source}", path.display())]
    Io {
        /// The path (or the directory) it concerns.
        path: PathBuf,
        /// What was being done.
        action: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

impl PublishError {
    fn io(path: &Path, action: &'static str, source: impl Into<io::Error>) -> Self {
        PublishError::Io {
            path: path.to_path_buf(),
            action,
            source: source.into(),
        }
    }
}

/// A published socket: listening, and its file.
#[derive(Debug)]
pub struct Published {
    /// The listening descriptor (non-blocking, close-on-exec).
    pub fd: OwnedFd,
    /// The file at the path; removes itself when dropped.
    pub file: SocketFile,
}

/// A socket file this process put in place, identified by device and inode.
#[derive(Debug)]
pub struct SocketFile {
    parent: OwnedFd,
    name: OsString,
    path: PathBuf,
    dev: u64,
    ino: u64,
    removed: bool,
}

impl SocketFile {
    /// The path it was published at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the path still names the inode this process put there.
    pub fn is_ours(&self) -> bool {
        matches!(stat_at(&self.parent, &self.name), Ok(Some(st)) if self.same(&st))
    }

    fn same(&self, st: &FileStat) -> bool {
        st.st_dev == self.dev && st.st_ino == self.ino
    }

    /// Removes the file if the path still names our inode; a file someone else put there
    /// is left alone. Call it while still listening (see the module documentation).
    /// Idempotent.
    pub fn remove(&mut self) -> io::Result<()> {
        if std::mem::replace(&mut self.removed, true) {
            return Ok(());
        }
        match stat_at(&self.parent, &self.name)? {
            Some(st) if self.same(&st) => {
                match unlinkat(
                    &self.parent,
                    self.name.as_os_str(),
                    UnlinkatFlags::NoRemoveDir,
                ) {
                    Ok(()) | Err(Errno::ENOENT) => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
            _ => Ok(()),
        }
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        // Errors here have nowhere to go; callers that care call `remove` themselves.
        let _ = self.remove();
    }
}

/// `fstatat` without following a link; `Ok(None)` if nothing is there.
fn stat_at(dir: &OwnedFd, name: &OsStr) -> io::Result<Option<FileStat>> {
    match fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn kind_of(st: &FileStat) -> &'static str {
    match SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT {
        SFlag::S_IFSOCK => "a socket",
        SFlag::S_IFREG => "a regular file",
        SFlag::S_IFDIR => "a directory",
        SFlag::S_IFLNK => "a symbolic link",
        _ => "a special file",
    }
}

/// Publishes a listening Unix socket at `path` with `access`, as the module documentation
/// describes. With `create_parents`, missing parent directories are made with mode 0755.
pub fn publish(
    path: &Path,
    access: Access,
    create_parents: bool,
) -> Result<Published, PublishError> {
    let bad = |reason| PublishError::BadPath {
        path: path.to_path_buf(),
        reason,
    };
    if !path.is_absolute() {
        return Err(bad("a socket path must be absolute"));
    }
    if path.as_os_str().len() >= 108 {
        return Err(bad("longer than the 107 bytes a socket address holds"));
    }
    let (Some(parent_path), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(bad("has no file name"));
    };
    if create_parents {
        make_parents(parent_path)?;
    }
    let parent = openat(
        AT_FDCWD,
        parent_path,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| PublishError::io(parent_path, "open the directory", e))?;
    clear_stale(&parent, name, path)?;

    let private = PrivateDir::create(&parent, name, parent_path)?;
    let fd = bind_finished(&private, access, path)?;
    let st = fstatat(
        &private.fd,
        PrivateDir::ENTRY,
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(|e| PublishError::io(path, "inspect the new socket", e))?;
    match rename_noreplace(&private.fd, PrivateDir::ENTRY.as_ref(), &parent, name) {
        Ok(()) => {}
        Err(Errno::EEXIST) => {
            // Something appeared at the path after it was cleared: not ours to replace.
            return Err(PublishError::Appeared {
                path: path.to_path_buf(),
            });
        }
        Err(e) => return Err(PublishError::io(path, "move the socket into place", e)),
    }
    let mut file = SocketFile {
        parent,
        name: name.to_os_string(),
        path: path.to_path_buf(),
        dev: st.st_dev,
        ino: st.st_ino,
        removed: false,
    };
    drop(private);
    if let Err(e) = listen_on(&fd) {
        let _ = file.remove();
        return Err(PublishError::io(path, "listen", e));
    }
    Ok(Published { fd, file })
}

/// `renameat2(..., RENAME_NOREPLACE)`: moves `from` to `to` unless something is there.
///
/// Through `libc::syscall`: nix offers `renameat2` only with glibc, and guest-init is a
/// musl binary; the system call itself is the same everywhere (Linux 3.15+).
fn rename_noreplace(
    from_dir: &OwnedFd,
    from: &OsStr,
    to_dir: &OwnedFd,
    to: &OsStr,
) -> Result<(), Errno> {
    let from = std::ffi::CString::new(from.as_bytes()).map_err(|_| Errno::EINVAL)?;
    let to = std::ffi::CString::new(to.as_bytes()).map_err(|_| Errno::EINVAL)?;
    // SAFETY: both paths are NUL-terminated C strings that outlive the call, and both
    // directory descriptors are open (borrowed for the call); renameat2 reads only those
    // arguments and writes no memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            from_dir.as_raw_fd(),
            from.as_ptr(),
            to_dir.as_raw_fd(),
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(Errno::last())
    }
}

/// A stale socket (nobody listening) is removed; a live one, or anything else, refused.
fn clear_stale(parent: &OwnedFd, name: &OsStr, path: &Path) -> Result<(), PublishError> {
    let Some(st) = stat_at(parent, name).map_err(|e| PublishError::io(path, "inspect", e))? else {
        return Ok(());
    };
    let what = kind_of(&st);
    if what != "a socket" {
        return Err(PublishError::InTheWay {
            path: path.to_path_buf(),
            what,
        });
    }
    if socket_is_live(path) {
        return Err(PublishError::Live {
            path: path.to_path_buf(),
        });
    }
    neighbour("judged stale", path);
    // Unlink only the inode just inspected: another stale or live socket that replaced it
    // meanwhile would make the final rename refuse instead.
    match stat_at(parent, name) {
        Ok(Some(now)) if now.st_dev == st.st_dev && now.st_ino == st.st_ino => {
            match unlinkat(parent, name, UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => Ok(()),
                Err(e) => Err(PublishError::io(path, "remove the stale socket", e)),
            }
        }
        _ => Ok(()),
    }
}

/// Whether something accepts connections at a socket path. A non-blocking connect never
/// waits: a full backlog (`EAGAIN`) also means somebody is listening.
pub fn socket_is_live(path: &Path) -> bool {
    let Ok(fd) = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    ) else {
        return false;
    };
    let Ok(addr) = UnixAddr::new(path) else {
        return false;
    };
    matches!(
        socket::connect(fd.as_raw_fd(), &addr),
        Ok(()) | Err(Errno::EAGAIN) | Err(Errno::EINPROGRESS)
    )
}

/// A directory only this process can write, beside the final path, removed on drop.
struct PrivateDir {
    parent: OwnedFd,
    name: OsString,
    fd: OwnedFd,
    path: PathBuf,
}

impl PrivateDir {
    /// The socket's name inside the private directory.
    const ENTRY: &'static str = "s";

    fn create(parent: &OwnedFd, name: &OsStr, parent_path: &Path) -> Result<Self, PublishError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let parent = parent
            .try_clone()
            .map_err(|e| PublishError::io(parent_path, "duplicate a descriptor", e))?;
        loop {
            let mut tmp = OsString::from(".");
            tmp.push(name);
            tmp.push(format!(
                ".{}.{}.publish",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            ));
            match mkdirat(&parent, tmp.as_os_str(), Mode::S_IRWXU) {
                Ok(()) => {}
                Err(Errno::EEXIST) => continue,
                Err(e) => return Err(PublishError::io(
                    parent_path,
                    "create a private directory for the new socket (is the directory writable?)",
                    e,
                )),
            }
            let path = parent_path.join(&tmp);
            neighbour("made the private directory", &path);
            let opened = openat(
                &parent,
                tmp.as_os_str(),
                OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            );
            let dir = PrivateDir {
                parent,
                name: tmp,
                fd: match opened {
                    Ok(fd) => fd,
                    Err(e) => return Err(PublishError::io(&path, "open the private directory", e)),
                },
                path,
            };
            // The directory behind the descriptor must be the one just made: ours, 0700.
            let st = fstat(dir.fd.as_fd())
                .map_err(|e| PublishError::io(&dir.path, "inspect the private directory", e))?;
            if !is_private(st.st_uid, st.st_mode, Uid::effective().as_raw()) {
                return Err(PublishError::io(
                    &dir.path,
                    "trust the private directory",
                    io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        "it was replaced by someone else's directory",
                    ),
                ));
            }
            return Ok(dir);
        }
    }

    /// The socket's address: through `/proc/self/fd`, which names the directory by its
    /// descriptor so nobody can swap it, or by path where `/proc` is not mounted.
    fn socket_addr(&self) -> io::Result<UnixAddr> {
        let by_fd = PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()));
        let dir = if by_fd.exists() {
            by_fd
        } else {
            self.path.clone()
        };
        let full = dir.join(Self::ENTRY);
        if full.as_os_str().as_bytes().len() >= 108 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the private directory's path is too long for a socket address and /proc is not mounted",
            ));
        }
        Ok(UnixAddr::new(&full)?)
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = unlinkat(&self.fd, Self::ENTRY, UnlinkatFlags::NoRemoveDir);
        neighbour("removing the private directory", &self.path);
        // Remove the directory only if its name still names it.
        if let (Ok(mine), Ok(Some(now))) =
            (fstat(self.fd.as_fd()), stat_at(&self.parent, &self.name))
        {
            if mine.st_dev == now.st_dev && mine.st_ino == now.st_ino {
                let _ = unlinkat(
                    &self.parent,
                    self.name.as_os_str(),
                    UnlinkatFlags::RemoveDir,
                );
            }
        }
    }
}

/// Whether a directory with this owner and mode is private to `euid`: its owner, and mode
/// exactly 0700 (anything else is not the directory just made with 0700, or was opened to
/// others).
fn is_private(owner: u32, mode: u32, euid: u32) -> bool {
    owner == euid && mode & 0o7777 == 0o700
}

/// Binds a socket inside the private directory and gives it its mode and owner there.
fn bind_finished(dir: &PrivateDir, access: Access, path: &Path) -> Result<OwnedFd, PublishError> {
    let fd = crate::endpoint::new_socket(AddressFamily::Unix)
        .map_err(|e| PublishError::io(path, "create a socket", e))?;
    let addr = dir
        .socket_addr()
        .map_err(|e| PublishError::io(path, "name the socket", e))?;
    socket::bind(fd.as_raw_fd(), &addr).map_err(|e| PublishError::io(path, "bind", e))?;
    // Mode first: once the owner is someone else, a non-root publisher could not change it.
    // (Linux has no lchmod; inside a directory only we can write, the entry is our socket.)
    fchmodat(
        &dir.fd,
        PrivateDir::ENTRY,
        Mode::from_bits_truncate(access.mode.bits()),
        FchmodatFlags::FollowSymlink,
    )
    .map_err(|e| PublishError::io(path, "set the socket's mode", e))?;
    if access.uid.is_some() || access.gid.is_some() {
        fchownat(
            &dir.fd,
            PrivateDir::ENTRY,
            access.uid.map(Uid::from_raw),
            access.gid.map(Gid::from_raw),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| PublishError::io(path, "set the socket's owner and group", e))?;
    }
    Ok(fd)
}

/// Creates `dir` and its missing ancestors with mode 0755 exactly (whatever the umask).
/// Existing directories are left as they are.
fn make_parents(dir: &Path) -> Result<(), PublishError> {
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|d| std::fs::symlink_metadata(d).is_err())
        .collect();
    for d in missing.into_iter().rev() {
        neighbour("making a parent", d);
        match std::fs::DirBuilder::new().mode(0o755).create(d) {
            // Exactly 0755 whatever the umask, set through a descriptor opened without
            // following a link, so a swapped-in symlink cannot redirect the chmod.
            Ok(()) => {
                neighbour("made a parent", d);
                std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
                    .open(d)
                    .and_then(|f| f.set_permissions(std::fs::Permissions::from_mode(0o755)))
            }
            // Someone else made it meanwhile: theirs to keep as it is.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(e),
        }
        .map_err(|e| PublishError::io(d, "create the parent directory", e))?;
    }
    Ok(())
}

/// A point in [`publish`] where a neighbour could swap files under us. In unit tests a
/// hook stands in for that neighbour, deterministically, at exactly that point (the races
/// no test could otherwise schedule; `publish/races.rs`). Nothing in a normal build.
fn neighbour(_point: &'static str, _path: &Path) {
    #[cfg(test)]
    races::NEIGHBOUR.with(|h| {
        if let Some(f) = h.borrow_mut().as_mut() {
            f(_point, _path);
        }
    });
}

#[cfg(test)]
mod races;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_own_0700_directory_is_private() {
        const DIR: u32 = 0o040_000;
        assert!(is_private(1000, DIR | 0o700, 1000));
        assert!(!is_private(1001, DIR | 0o700, 1000), "someone else's");
        assert!(
            !is_private(0, DIR | 0o700, 1000),
            "root's, seen by a non-root publisher"
        );
        for mode in [
            0o701, 0o710, 0o750, 0o755, 0o777, 0o600, 0o500, 0o1700, 0o2700,
        ] {
            assert!(!is_private(1000, DIR | mode, 1000), "{mode:o}");
        }
    }
}
