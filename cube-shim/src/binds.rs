//! The spec's bind mounts (volumes, the kubelet's `/etc/hosts`, `/etc/hostname` and
//! `/etc/resolv.conf`, `ctr run --mount`): made in a pod container's root filesystem
//! on the host, before that root is cloned into the pod's sandbox (the clone takes
//! them along); for a container with a sandbox of its own, made in the running
//! sandbox's root, moved in by a helper in its mount namespace
//! ([`crate::mount_helper`]).
//!
//! Destinations are resolved inside the container's root (`openat2` with
//! `RESOLVE_IN_ROOT`): the image is untrusted, and a symlink in it must not send a
//! bind to a path of the host. Missing destinations are created there (directories
//! for a directory, an empty file for a file), as runc does; a destination that is a
//! link to nothing (an image's `/etc/resolv.conf` naming systemd's file) is made where
//! the link leads, resolved inside the root too. Every bind is
//! `nosuid,nodev`, read-only where the spec says `ro`.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStringExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, AT_FDCWD};

use crate::detached_tree::{DetachedTree, TreeError};
use crate::spec::MountSpec;

/// Why a bind could not be made.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// The source is not there.
    #[error("bind source {0}")]
    Source(PathBuf, #[source] std::io::Error),
    /// The destination is not an absolute path inside the container.
    #[error("bind destination {0:?} is not an absolute path")]
    Destination(String),
    /// The destination could not be opened or made inside the container's root.
    #[error("bind destination {0} in the container's root")]
    Target(String, #[source] Errno),
    /// The mount itself failed.
    #[error("binding {0}")]
    Mount(String, #[source] TreeError),
    /// The sandbox's root could not be opened (the sandbox ended).
    #[error("opening the root of the sandbox (pid {0})")]
    SandboxRoot(u32, #[source] std::io::Error),
    /// Moving the binds into the sandbox failed.
    #[error("binding into the sandbox")]
    InSandbox(#[from] crate::mount_helper::HelperError),
}

/// Makes every bind of `binds` under `root`, the container's root filesystem mounted
/// on the host.
pub fn bind_into<'a>(
    root: &Path,
    binds: impl Iterator<Item = &'a MountSpec>,
) -> Result<(), BindError> {
    let root_fd = open_path(AT_FDCWD, root, OFlag::O_DIRECTORY, ResolveFlag::empty())
        .map_err(|e| BindError::Target(root.display().to_string(), e))?;
    for bind in binds {
        let (tree, target) = prepare(&root_fd, bind)?;
        tree.move_onto(target.as_fd())
            .map_err(|e| BindError::Mount(bind.destination.clone(), e))?;
    }
    Ok(())
}

/// The steps of the helper that moves binds into a sandbox, numbered for its report.
const SANDBOX_STEPS: [&str; 2] = ["joining the mount namespace", "moving a bind in"];

/// Makes every bind of `binds` in the running sandbox whose PID 1 is `jail_pid`:
/// destinations resolved and made inside its root (reached through
/// `/proc/<pid>/root`), the clones of the sources moved onto them from inside its
/// mount namespace.
pub fn bind_into_sandbox<'a>(
    jail_pid: u32,
    binds: impl Iterator<Item = &'a MountSpec>,
) -> Result<(), BindError> {
    let root = std::fs::File::open(format!("/proc/{jail_pid}/root"))
        .map_err(|e| BindError::SandboxRoot(jail_pid, e))?;
    let root = OwnedFd::from(root);
    let prepared = binds
        .map(|bind| prepare(&root, bind))
        .collect::<Result<Vec<_>, _>>()?;
    if prepared.is_empty() {
        return Ok(());
    }
    // Descriptor pairs made before the fork: the helper must not allocate.
    let moves: Vec<(RawFd, RawFd)> = prepared
        .iter()
        .map(|(tree, target)| (tree.as_raw_fd(), target.as_raw_fd()))
        .collect();
    let ns = crate::mount_helper::open_namespace(jail_pid)?;
    crate::mount_helper::run(&SANDBOX_STEPS, || {
        crate::mount_helper::join(0, ns.as_raw_fd())?;
        for (tree, target) in &moves {
            // SAFETY: both paths are empty and the flags say so: the descriptors name
            // the detached tree and the target, a mount of this namespace now.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_move_mount,
                    *tree,
                    c"".as_ptr(),
                    *target,
                    c"".as_ptr(),
                    libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH,
                )
            };
            crate::mount_helper::check(1, rc as libc::c_int)?;
        }
        Ok(())
    })?;
    Ok(())
}

/// One bind's clone of its source and its destination inside `root`, made where
/// missing (a directory for a directory, an empty file for a file).
fn prepare(root: &OwnedFd, bind: &MountSpec) -> Result<(DetachedTree, OwnedFd), BindError> {
    let source = Path::new(&bind.source);
    let is_dir = std::fs::metadata(source)
        .map_err(|e| BindError::Source(source.to_path_buf(), e))?
        .is_dir();
    let dest = relative(&bind.destination)?;
    let target = if is_dir {
        ensure_dir(root, &dest)
    } else {
        ensure_file(root, &dest)
    }
    .map_err(|e| BindError::Target(bind.destination.clone(), e))?;
    let tree = DetachedTree::clone_of(source, bind.read_only())
        .map_err(|e| BindError::Mount(bind.destination.clone(), e))?;
    Ok((tree, target))
}

/// `/a/b` as `a/b`; refuses relative paths and `..`.
fn relative(destination: &str) -> Result<PathBuf, BindError> {
    let path = Path::new(destination);
    if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
        return Err(BindError::Destination(destination.to_string()));
    }
    let rel: PathBuf = path
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .collect();
    if rel.as_os_str().is_empty() {
        return Err(BindError::Destination(destination.to_string()));
    }
    Ok(rel)
}

/// `openat2(dir, path, O_PATH | flags, resolve)`.
fn open_path(
    dir: BorrowedFd<'_>,
    path: &Path,
    flags: OFlag,
    resolve: ResolveFlag,
) -> Result<OwnedFd, Errno> {
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC | flags)
        // Magic links (/proc/self/...) are never what a destination means.
        .resolve(resolve | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    nix::fcntl::openat2(dir, path, how)
}

/// `rel` inside `root` (symlinks resolved as if `root` were `/`).
fn open_in_root(root: &OwnedFd, rel: &Path, flags: OFlag) -> Result<OwnedFd, Errno> {
    open_path(root.as_fd(), rel, flags, ResolveFlag::RESOLVE_IN_ROOT)
}

/// Most symbolic links followed to make one destination (the kernel's own limit).
const MAX_LINKS: usize = 40;

/// What a missing destination is made as.
#[derive(Clone, Copy)]
enum Kind {
    Dir,
    File,
}

impl Kind {
    /// `openat2` flags that open an existing one.
    fn flags(self) -> OFlag {
        match self {
            Kind::Dir => OFlag::O_DIRECTORY,
            Kind::File => OFlag::empty(),
        }
    }
}

/// The directory `rel` inside `root`, made (with its parents) where missing.
fn ensure_dir(root: &OwnedFd, rel: &Path) -> Result<OwnedFd, Errno> {
    ensure(root, rel, Kind::Dir, 0)
}

/// The file `rel` inside `root`, made empty (with its parent directories) where
/// missing.
fn ensure_file(root: &OwnedFd, rel: &Path) -> Result<OwnedFd, Errno> {
    ensure(root, rel, Kind::File, 0)
}

/// `rel` inside `root`, made as `kind` where missing. Where `rel` (or a directory on
/// the way) is a symbolic link to nothing, as an image's `/etc/resolv.conf` pointing at
/// `/run/systemd/...` is, what the link names is made instead, resolved inside `root`
/// as the kernel would resolve it there (`links` counts the links followed so far).
fn ensure(root: &OwnedFd, rel: &Path, kind: Kind, links: usize) -> Result<OwnedFd, Errno> {
    match open_in_root(root, rel, kind.flags()) {
        Err(Errno::ENOENT) => {}
        other => return other,
    }
    let (parent, name) = parent_and_name(root, rel, links)?;
    if let Some(target) = dangling_link(&parent, &name)? {
        if links >= MAX_LINKS {
            return Err(Errno::ELOOP);
        }
        let rel = link_destination(root, &parent, &target)?;
        return ensure(root, &rel, kind, links + 1);
    }
    // SAFETY: `name` is a live NUL-terminated string; `parent` an open directory.
    let made = unsafe {
        match kind {
            Kind::Dir => libc::mkdirat(parent.as_raw_fd(), name.as_ptr(), 0o755),
            // O_NOFOLLOW: a link made there meanwhile is refused rather than followed.
            Kind::File => libc::openat(
                parent.as_raw_fd(),
                name.as_ptr(),
                libc::O_CREAT | libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o644,
            ),
        }
    };
    match kind {
        Kind::Dir if made != 0 && Errno::last() != Errno::EEXIST => return Err(Errno::last()),
        Kind::File if made < 0 => return Err(Errno::last()),
        // SAFETY: a new descriptor, closed at once.
        Kind::File => drop(unsafe { OwnedFd::from_raw_fd(made) }),
        Kind::Dir => {}
    }
    open_in_root(root, rel, kind.flags())
}

/// The target of `name` in `parent` where it is a symbolic link; None where it is
/// anything else or nothing.
fn dangling_link(parent: &OwnedFd, name: &CString) -> Result<Option<PathBuf>, Errno> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: `name` is NUL-terminated and `buf` writable for its length.
    let n = unsafe {
        libc::readlinkat(
            parent.as_raw_fd(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return match Errno::last() {
            // Not a link, or not there.
            Errno::EINVAL | Errno::ENOENT => Ok(None),
            e => Err(e),
        };
    }
    buf.truncate(n.unsigned_abs());
    Ok(Some(PathBuf::from(std::ffi::OsString::from_vec(buf))))
}

/// Where a link in directory `parent` whose target is `target` leads, relative to
/// `root`: an absolute target from `root` itself, a relative one from `parent`'s real
/// place in `root`; leading `..` stop at `root`, as `RESOLVE_IN_ROOT` does.
fn link_destination(root: &OwnedFd, parent: &OwnedFd, target: &Path) -> Result<PathBuf, Errno> {
    let mut dest = if target.is_absolute() {
        PathBuf::new()
    } else {
        let place = |fd: &OwnedFd| std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        let (root_at, parent_at) = (place(root), place(parent));
        let (Ok(root_at), Ok(parent_at)) = (root_at, parent_at) else {
            return Err(Errno::ENOENT);
        };
        parent_at
            .strip_prefix(&root_at)
            .map_err(|_| Errno::EXDEV)?
            .to_path_buf()
    };
    let mut rest = target.components().peekable();
    // `..` right after a real directory is its parent; later ones are left to the
    // kernel, which resolves the path inside the root again.
    while let Some(c) = rest.peek() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir => {
                dest.pop();
            }
            _ => break,
        }
        rest.next();
    }
    dest.extend(rest);
    if dest.as_os_str().is_empty() {
        return Err(Errno::EEXIST);
    }
    Ok(dest)
}

/// The directory that holds `rel` (made where missing) and `rel`'s last name.
fn parent_and_name(root: &OwnedFd, rel: &Path, links: usize) -> Result<(OwnedFd, CString), Errno> {
    let name = rel.file_name().ok_or(Errno::EINVAL)?;
    let name = CString::new(name.as_encoded_bytes()).map_err(|_| Errno::EINVAL)?;
    let parent = match rel.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => ensure(root, p, Kind::Dir, links)?,
        None => open_in_root(root, Path::new("."), OFlag::O_DIRECTORY)?,
    };
    Ok((parent, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_are_absolute_paths_without_dot_dot() {
        assert_eq!(relative("/etc/hosts").unwrap(), PathBuf::from("etc/hosts"));
        assert_eq!(relative("/data/").unwrap(), PathBuf::from("data"));
        for bad in ["etc/hosts", "/", "/a/../b", ""] {
            assert!(relative(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_symlink_in_the_root_cannot_send_a_destination_out_of_it() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        // The image's /etc points at a host directory, absolutely and relatively.
        std::os::unix::fs::symlink(outside.path(), root.path().join("etc")).unwrap();
        std::os::unix::fs::symlink("../../../../..", root.path().join("up")).unwrap();
        let root_fd = open_path(
            AT_FDCWD,
            root.path(),
            OFlag::O_DIRECTORY,
            ResolveFlag::empty(),
        )
        .unwrap();
        // Where /etc leads inside the root is missing: made there, nothing outside.
        ensure_file(&root_fd, Path::new("etc/hosts")).unwrap();
        let inside = root.path().join(outside.path().strip_prefix("/").unwrap());
        assert!(inside.join("hosts").is_file());
        // `..` past the root stays at the root.
        ensure_dir(&root_fd, Path::new("up/data")).unwrap();
        assert!(root.path().join("data").is_dir());
        assert!(
            std::fs::read_dir(outside.path()).unwrap().next().is_none(),
            "a file was made outside the root"
        );
    }

    /// An image's `/etc/resolv.conf` is a link to a file that only exists once systemd
    /// runs: the bind's file is made where the link leads, inside the root, for
    /// absolute and relative links, and through a link to a link; a loop is refused.
    #[test]
    fn a_dangling_link_at_the_destination_is_followed_inside_the_root() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir(r.join("etc")).unwrap();
        let link = |target: &str, at: &str| std::os::unix::fs::symlink(target, r.join(at)).unwrap();
        link("/run/systemd/resolve/stub-resolv.conf", "etc/resolv.conf");
        link("../run/hostname-real", "etc/hostname");
        link("/etc/hosts-link", "etc/hosts");
        link("../../../../srv/hosts", "etc/hosts-link");
        link("loop-b", "loop-a");
        link("loop-a", "loop-b");
        let root_fd = open_path(AT_FDCWD, r, OFlag::O_DIRECTORY, ResolveFlag::empty()).unwrap();
        for dest in ["etc/resolv.conf", "etc/hostname", "etc/hosts"] {
            ensure_file(&root_fd, Path::new(dest)).unwrap();
        }
        assert!(r.join("run/systemd/resolve/stub-resolv.conf").is_file());
        assert!(r.join("run/hostname-real").is_file());
        assert!(r.join("srv/hosts").is_file());
        assert_eq!(
            ensure_file(&root_fd, Path::new("loop-a")).unwrap_err(),
            Errno::ELOOP
        );
        // A directory bind through a dangling link to a directory.
        link("/var/lib/data", "data");
        ensure_dir(&root_fd, Path::new("data")).unwrap();
        assert!(r.join("var/lib/data").is_dir());
    }
}
