//! Reaching an entry of a directory that a sandbox's side owns without following a
//! symbolic link it put there.
//!
//! A confined VM supervisor runs as a uid of its own and owns its sandbox's
//! directory: code that took it over can replace the supervisor's socket, the vsock
//! device's socket or the agent link with a symbolic link to another sandbox's (or to
//! a host socket). Whoever then follows that path as root (the library attaching to
//! the sandbox, or connecting to its guest's agent) would act on the other sandbox
//! for this sandbox's caller. It also owns the directories of the snapshots it
//! staged, which (where the kernel has no Landlock) it could fill with links to
//! another sandbox's snapshot for a restore as root to read. The last components of such a path are therefore
//! resolved with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` from the directory
//! above them (the store's area, which the store's owner chose and only root
//! writes to), and a socket is connected through the descriptor it opened.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Component, Path, PathBuf};

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};

/// Why a path was refused (carried inside the `io::Error` the functions return, so
/// callers keep their own error for "could not open or connect").
#[derive(Debug, thiserror::Error)]
pub enum NoFollowError {
    /// One of the components checked is a symbolic link.
    #[error("{0}: a symbolic link on the way, refused (it may point at another sandbox)")]
    Link(PathBuf),
    /// The path does not end in as many plain names as were to be checked.
    #[error("{path} does not end in {depth} plain names")]
    Shape {
        /// The path.
        path: PathBuf,
        /// How many of its last components were to be checked.
        depth: usize,
    },
    /// The kernel has no `openat2` (Linux 5.6 and later have it).
    #[error("this kernel lacks openat2 (Linux 5.6 or later is needed to reach {0} safely)")]
    NoOpenat2(PathBuf),
}

impl From<NoFollowError> for io::Error {
    fn from(e: NoFollowError) -> io::Error {
        let kind = match e {
            NoFollowError::NoOpenat2(_) => io::ErrorKind::Unsupported,
            _ => io::ErrorKind::InvalidInput,
        };
        io::Error::new(kind, e)
    }
}

/// Opens `path` with `flags` (`O_CLOEXEC` is added), following no symbolic link in
/// its last `depth` components; those above are resolved as usual. With `O_PATH |
/// O_NOFOLLOW` a link in the last place is opened itself (to read it), as `openat2`
/// does.
pub fn open(path: &Path, depth: usize, flags: libc::c_int) -> io::Result<OwnedFd> {
    openat2_no_links(path, depth, flags, 0)
}

/// Opens the file `path` of a store's directory (`<area>/<id>/<name>`: a snapshot's
/// memory, state or disk) for reading, with neither it nor its directory a symbolic
/// link (see [`open`]). Non-blocking, so that a FIFO put in its place does not hang
/// the open; callers check it is a regular file.
pub fn open_file(path: &Path) -> io::Result<File> {
    open(
        path,
        2,
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
    )
    .map(File::from)
}

/// Creates the file `path` with `mode` for writing, following no symbolic link in
/// its last `depth` components; fails where anything, a link included, already has
/// its name (so a root process writing a record in a sandbox's directory writes a
/// file of its own, and only there).
pub fn create_new(path: &Path, depth: usize, mode: libc::mode_t) -> io::Result<File> {
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
    openat2_no_links(path, depth, flags, mode).map(File::from)
}

/// Connects to the unix socket at `path`, following no symbolic link in its last
/// `depth` components (see [`open`]).
pub fn connect(path: &Path, depth: usize) -> io::Result<UnixStream> {
    connect_opened(&open(path, depth, libc::O_PATH)?)
}

/// Connects to the unix socket `socket` names, a descriptor opened (`O_PATH`) without
/// following a link on the way: connect() follows the descriptor's magic link to that
/// very socket, and nothing is resolved by name again.
pub fn connect_opened(socket: &OwnedFd) -> io::Result<UnixStream> {
    UnixStream::connect(format!("/proc/self/fd/{}", socket.as_raw_fd()))
}

/// The path above its last `depth` components, and those components.
fn split(path: &Path, depth: usize) -> io::Result<(PathBuf, PathBuf)> {
    let shape = || NoFollowError::Shape {
        path: path.to_path_buf(),
        depth,
    };
    let components: Vec<Component> = path.components().collect();
    if depth == 0 || components.len() < depth {
        return Err(shape().into());
    }
    let (above, below) = components.split_at(components.len() - depth);
    if !below.iter().all(|c| matches!(c, Component::Normal(_))) {
        return Err(shape().into());
    }
    let base: PathBuf = if above.is_empty() {
        PathBuf::from(".")
    } else {
        above.iter().collect()
    };
    Ok((base, below.iter().collect()))
}

/// `openat2` of the last `depth` components of `path` from the directory above them
/// (opened as usual), with no symbolic link resolved among them.
fn openat2_no_links(
    path: &Path,
    depth: usize,
    flags: libc::c_int,
    mode: libc::mode_t,
) -> io::Result<OwnedFd> {
    let (base, below) = split(path, depth)?;
    let base = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(base)?;
    let how = OpenHow::new()
        .flags(OFlag::from_bits_retain(flags | libc::O_CLOEXEC))
        .mode(nix::sys::stat::Mode::from_bits_truncate(mode))
        .resolve(
            ResolveFlag::RESOLVE_BENEATH
                | ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::RESOLVE_NO_MAGICLINKS,
        );
    nix::fcntl::openat2(&base, below.as_path(), how).map_err(|errno| match errno {
        nix::errno::Errno::ELOOP | nix::errno::Errno::EXDEV => {
            NoFollowError::Link(path.to_path_buf()).into()
        }
        nix::errno::Errno::ENOSYS => NoFollowError::NoOpenat2(path.to_path_buf()).into(),
        other => io::Error::from(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::os::unix::net::UnixListener;

    fn refused(err: io::Error) -> bool {
        err.get_ref()
            .and_then(|e| e.downcast_ref::<NoFollowError>())
            .is_some_and(|e| matches!(e, NoFollowError::Link(_)))
    }

    #[test]
    fn a_socket_is_reached_and_a_link_to_one_is_not() {
        let tmp = tempfile::tempdir().unwrap();
        let (mine, other) = (tmp.path().join("a"), tmp.path().join("b"));
        std::fs::create_dir_all(&mine).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        let listener = UnixListener::bind(other.join("s.sock")).unwrap();
        listener.set_nonblocking(true).unwrap();
        connect(&other.join("s.sock"), 2).unwrap();
        listener.accept().unwrap();

        // A link put in place of the socket.
        symlink(other.join("s.sock"), mine.join("s.sock")).unwrap();
        let err = connect(&mine.join("s.sock"), 2).unwrap_err();
        assert!(refused(err), "a linked socket was followed");
        // The directory itself a link, and a link with a relative target.
        let linked_dir = tmp.path().join("c");
        symlink("b", &linked_dir).unwrap();
        assert!(refused(connect(&linked_dir.join("s.sock"), 2).unwrap_err()));
        std::fs::remove_file(mine.join("s.sock")).unwrap();
        symlink("../b/s.sock", mine.join("s.sock")).unwrap();
        assert!(refused(connect(&mine.join("s.sock"), 2).unwrap_err()));
        assert_eq!(
            listener.accept().unwrap_err().kind(),
            io::ErrorKind::WouldBlock,
            "a refused path still connected"
        );
        // Above the checked components links are followed (the store's own path).
        connect(&linked_dir.join("s.sock"), 1).unwrap();
    }

    #[test]
    fn a_link_itself_is_opened_with_o_path_and_nofollow() {
        let tmp = tempfile::tempdir().unwrap();
        symlink("/etc/passwd", tmp.path().join("link")).unwrap();
        let fd = open(&tmp.path().join("link"), 1, libc::O_PATH | libc::O_NOFOLLOW).unwrap();
        let meta = File::from(fd).metadata().unwrap();
        assert!(meta.file_type().is_symlink());
        assert!(refused(
            open(&tmp.path().join("link"), 1, libc::O_RDONLY).unwrap_err()
        ));
    }

    #[test]
    fn a_new_file_is_made_only_where_nothing_is() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("record");
        create_new(&path, 1, 0o640).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o7777, 0o640 & !current_umask());
        assert_eq!(
            create_new(&path, 1, 0o644).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        // A dangling link in its place is not followed to make its target.
        std::fs::remove_file(&path).unwrap();
        symlink(tmp.path().join("target"), &path).unwrap();
        assert!(create_new(&path, 1, 0o644).is_err());
        assert!(!tmp.path().join("target").exists());
    }

    fn current_umask() -> u32 {
        // SAFETY: umask only swaps the process's mask; it is put back at once.
        let old = unsafe { libc::umask(0o022) };
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        old
    }

    #[test]
    fn parent_components_and_short_paths_are_refused() {
        for (path, depth) in [("a/../b", 2), ("b", 2), ("/", 1), ("a/b", 0)] {
            let err = open(Path::new(path), depth, libc::O_PATH).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{path}");
        }
    }
}
