//! Copy-on-write file clones: `FICLONE` where the filesystem can share extents, a
//! hole-preserving copy where it cannot.
//!
//! Creating a sandbox reflinks the template's root filesystem and memory file, so on
//! XFS or btrfs a clone costs a few milliseconds whatever the file size. On ext4 or
//! tmpfs the same call still works but copies the data regions; the first time that
//! happens on a filesystem a single warning says so, because it changes the cost of
//! every create and snapshot by orders of magnitude.

use std::collections::{HashMap, HashSet};
use std::fs::{self, DirBuilder, File, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{
    lchown, symlink, DirBuilderExt, FileExt, FileTypeExt, MetadataExt, OpenOptionsExt,
    PermissionsExt,
};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use nix::errno::Errno;
use nix::sys::stat::{mknod, utimensat, Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;
use nix::unistd::{lseek, Whence};

use crate::random_id::random_hex;
use crate::removal_guard::RemovalGuard;

/// How [`clone_file`] produced the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloneMethod {
    /// The destination shares the source's extents (`FICLONE`): constant time, no
    /// data written, blocks copied only when either side is later modified.
    Reflink,
    /// The filesystem cannot share extents: the source's data regions were copied and
    /// its holes left as holes.
    SparseCopy,
}

/// What [`clone_tree`] created.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TreeCloneStats {
    /// Regular files cloned with `FICLONE`.
    pub reflinked_files: u64,
    /// Regular files copied because the filesystem cannot reflink.
    pub copied_files: u64,
    /// Extra names of a file already cloned, recreated as hard links.
    pub hard_links: u64,
    /// Symbolic links recreated with the same target.
    pub symlinks: u64,
    /// Directories created, the top-level destination included.
    pub directories: u64,
    /// FIFOs and device nodes recreated with `mknod`.
    pub special_files: u64,
    /// Unix socket files left out: a socket file is only a name for a socket some
    /// process bound, meaningless once copied (a process restored with its socket
    /// binds the name anew).
    pub skipped_sockets: u64,
}

/// How [`clone_tree_with`] and [`clone_tree_into`] walk the source.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TreeOptions {
    /// Stay on the source's filesystem: a directory (or file) where another
    /// filesystem is mounted becomes an empty one (with the mounted root's permission
    /// bits, owner and times), a mount point again for whoever mounts there.
    pub one_file_system: bool,
    /// Copying between filesystems is the point (a tmpfs saved to disk and back): no
    /// warning that files are copied rather than reflinked.
    pub expect_copies: bool,
}

/// Errors from cloning files and trees.
#[derive(Debug, thiserror::Error)]
pub enum CloneError {
    /// The source could not be opened or inspected.
    #[error("Cannot open clone source {path}")]
    OpenSource {
        /// The source path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The source of [`clone_file`] is not a regular file.
    #[error("Clone source {path} is not a regular file")]
    NotRegularFile {
        /// The source path.
        path: PathBuf,
    },
    /// The source of [`clone_tree`] is not a directory.
    #[error("Clone source {path} is not a directory")]
    NotDirectory {
        /// The source path.
        path: PathBuf,
    },
    /// The destination could not be created (it may already exist).
    #[error("Cannot create clone destination {path}")]
    CreateDestination {
        /// The destination path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// `FICLONE` failed for a reason other than the filesystem lacking reflinks.
    #[error("FICLONE from {src} to {dst} failed")]
    Reflink {
        /// The source path.
        src: PathBuf,
        /// The destination path.
        dst: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Copying data regions failed in the sparse-copy fallback.
    #[error("Sparse copy from {src} to {dst} failed")]
    SparseCopy {
        /// The source path.
        src: PathBuf,
        /// The destination path.
        dst: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The destination's mode, owner, size or times could not be set.
    #[error("Cannot set attributes of {path}")]
    SetAttributes {
        /// The path whose attributes were being set.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// `statfs` failed, so the filesystem type is unknown.
    #[error("Cannot identify the filesystem of {path}")]
    Statfs {
        /// The path given to `statfs`.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The reflink probe could not create, fill or clone its scratch files.
    #[error("Reflink probe in {dir} failed")]
    Probe {
        /// The directory probed.
        dir: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A directory of the source tree could not be listed.
    #[error("Cannot read directory {path}")]
    ReadDir {
        /// The directory path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A symbolic link could not be read or recreated.
    #[error("Cannot copy symbolic link {path}")]
    Symlink {
        /// The source link path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A second name of an already cloned file could not be hard-linked.
    #[error("Cannot recreate hard link {path}")]
    HardLink {
        /// The destination link path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A FIFO or device node could not be recreated.
    #[error("Cannot recreate special file {path}")]
    SpecialFile {
        /// The source path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The destination of [`clone_tree`] lies inside its source, so the walk would
    /// never end.
    #[error("Clone destination {dst} is inside source {src}")]
    DestinationInsideSource {
        /// The source directory.
        src: PathBuf,
        /// The destination directory.
        dst: PathBuf,
    },
}

/// Clones `src` to a new file `dst`, by reflink when the filesystem can, otherwise by
/// a sparse copy.
///
/// `dst` must not exist; it is created with mode 0600 while being filled and given
/// the source's permission bits (setuid/setgid/sticky included) at the end. The
/// first fallback to a sparse copy on a filesystem logs one warning for the whole
/// process. On any error the partial `dst` is removed.
pub fn clone_file(src: &Path, dst: &Path) -> Result<CloneMethod, CloneError> {
    let src_file = File::open(src).map_err(|source| CloneError::OpenSource {
        path: src.to_owned(),
        source,
    })?;
    clone_open_file(src_file, src, dst, true)
}

/// [`clone_file`] from a file already open for reading, named `src` in errors: a
/// process that may no longer open the source where it lies (a confined VM
/// supervisor and the snapshot its next diff builds on) still clones it.
pub fn clone_open(src_file: &File, src: &Path, dst: &Path) -> Result<CloneMethod, CloneError> {
    let src_file = src_file
        .try_clone()
        .map_err(|source| CloneError::OpenSource {
            path: src.to_owned(),
            source,
        })?;
    clone_open_file(src_file, src, dst, true)
}

/// Like [`clone_file`] for an entry of a tree walk, which may belong to a sandbox: a
/// symlink put in the file's place is not followed (the copy could otherwise read any
/// host file into the sandbox's snapshot) and a FIFO put there does not block the open.
/// A fallback to a sparse copy is warned of only when `warn`.
fn clone_tree_file(src: &Path, dst: &Path, warn: bool) -> Result<CloneMethod, CloneError> {
    let src_file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(src)
        .map_err(|source| CloneError::OpenSource {
            path: src.to_owned(),
            source,
        })?;
    clone_open_file(src_file, src, dst, warn)
}

fn clone_open_file(
    src_file: File,
    src: &Path,
    dst: &Path,
    warn: bool,
) -> Result<CloneMethod, CloneError> {
    let src_meta = src_file
        .metadata()
        .map_err(|source| CloneError::OpenSource {
            path: src.to_owned(),
            source,
        })?;
    if !src_meta.file_type().is_file() {
        return Err(CloneError::NotRegularFile {
            path: src.to_owned(),
        });
    }

    let dst_file = create_exclusive(dst).map_err(|source| CloneError::CreateDestination {
        path: dst.to_owned(),
        source,
    })?;
    let guard = RemovalGuard::file(dst);

    let method = match ficlone(&src_file, &dst_file) {
        Ok(()) => CloneMethod::Reflink,
        Err(e) if is_reflink_unsupported(&e) => {
            if warn {
                warn_sparse_fallback(&src_file, src, &dst_file, dst, &e);
            }
            sparse_copy(&src_file, &dst_file, src_meta.len()).map_err(|source| {
                CloneError::SparseCopy {
                    src: src.to_owned(),
                    dst: dst.to_owned(),
                    source,
                }
            })?;
            CloneMethod::SparseCopy
        }
        Err(source) => {
            return Err(CloneError::Reflink {
                src: src.to_owned(),
                dst: dst.to_owned(),
                source,
            })
        }
    };

    dst_file
        .set_permissions(Permissions::from_mode(src_meta.mode() & 0o7777))
        .map_err(|source| CloneError::SetAttributes {
            path: dst.to_owned(),
            source,
        })?;
    guard.disarm();
    Ok(method)
}

/// Tells whether files in `dir` can be reflinked, by cloning a small scratch file
/// there (the only reliable test: the same filesystem type can be made with or
/// without reflink support).
///
/// The scratch files are removed whatever the outcome.
pub fn supports_reflink(dir: &Path) -> Result<bool, CloneError> {
    let probe_err = |source: io::Error| CloneError::Probe {
        dir: dir.to_owned(),
        source,
    };
    let tag = random_hex(8).map_err(probe_err)?;
    let stem = format!(".cube-reflink-probe-{}-{tag}", std::process::id());
    let src_path = dir.join(format!("{stem}.src"));
    let dst_path = dir.join(format!("{stem}.dst"));

    let mut src = create_exclusive(&src_path).map_err(probe_err)?;
    let _src_guard = RemovalGuard::file(&src_path);
    // One full block: some filesystems only share whole blocks.
    src.write_all(&[0x5a; 4096]).map_err(probe_err)?;
    let dst = create_exclusive(&dst_path).map_err(probe_err)?;
    let _dst_guard = RemovalGuard::file(&dst_path);

    match ficlone(&src, &dst) {
        Ok(()) => Ok(true),
        Err(e) if is_reflink_unsupported(&e) => Ok(false),
        Err(e) => Err(probe_err(e)),
    }
}

/// Names the filesystem holding `path`: `"ext4"`, `"xfs"`, `"btrfs"`, `"tmpfs"`, ...
/// or the `statfs` magic number in hex when it is not one this crate knows.
///
/// ext2, ext3 and ext4 share a magic number and are all reported as `"ext4"`.
pub fn filesystem_name(path: &Path) -> Result<String, CloneError> {
    let stat = nix::sys::statfs::statfs(path).map_err(|e| CloneError::Statfs {
        path: path.to_owned(),
        source: e.into(),
    })?;
    Ok(name_of_magic(magic_of(&stat)))
}

/// Clones the directory tree `src_dir` into a new directory `dst_dir`.
///
/// Regular files go through [`clone_file`] (reflink or sparse copy), directories are
/// recreated, symlinks keep their target verbatim (they are never followed), extra
/// names of a hard-linked file become hard links again, FIFOs and device nodes are
/// recreated with `mknod`. Permission bits, access and modification times are kept;
/// owners are kept when running as root (otherwise everything belongs to the
/// caller). Extended attributes are not copied. Socket files are left out (see
/// [`TreeCloneStats::skipped_sockets`]): a sandbox's layer may hold one, and its
/// snapshot must not fail for it.
///
/// `dst_dir` must not exist and must not lie inside `src_dir`. On any error the
/// partial `dst_dir` is removed.
pub fn clone_tree(src_dir: &Path, dst_dir: &Path) -> Result<TreeCloneStats, CloneError> {
    clone_tree_with(src_dir, dst_dir, TreeOptions::default())
}

/// [`clone_tree`], walking as `options` say.
pub fn clone_tree_with(
    src_dir: &Path,
    dst_dir: &Path,
    options: TreeOptions,
) -> Result<TreeCloneStats, CloneError> {
    let src_meta = fs::symlink_metadata(src_dir).map_err(|source| CloneError::OpenSource {
        path: src_dir.to_owned(),
        source,
    })?;
    if !src_meta.file_type().is_dir() {
        return Err(CloneError::NotDirectory {
            path: src_dir.to_owned(),
        });
    }
    let dst_parent = match dst_dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dst_parent_canonical =
        fs::canonicalize(dst_parent).map_err(|source| CloneError::CreateDestination {
            path: dst_dir.to_owned(),
            source,
        })?;
    // By identity, not by name: a source reached through a magic link
    // (/proc/PID/root/...) has a name that says nothing of where it is.
    let inside = dst_parent_canonical.ancestors().any(|a| {
        fs::metadata(a).is_ok_and(|m| m.dev() == src_meta.dev() && m.ino() == src_meta.ino())
    });
    if inside {
        return Err(CloneError::DestinationInsideSource {
            src: src_dir.to_owned(),
            dst: dst_dir.to_owned(),
        });
    }

    create_private_dir(dst_dir).map_err(|source| CloneError::CreateDestination {
        path: dst_dir.to_owned(),
        source,
    })?;
    let guard = RemovalGuard::tree(dst_dir);

    let mut walk = TreeWalk::new(options, src_meta.dev());
    walk.clone_entries(src_dir, dst_dir)?;
    walk.apply_attributes(dst_dir, &src_meta)?;
    guard.disarm();
    Ok(walk.stats)
}

/// Clones the contents of the directory `src_dir` into the existing, empty
/// directory `dst_dir` (the root of a new filesystem, say), which then gets
/// `src_dir`'s permission bits, owner and times; otherwise as [`clone_tree_with`].
/// On error what was cloned so far stays, for the caller to discard with `dst_dir`.
pub fn clone_tree_into(
    src_dir: &Path,
    dst_dir: &Path,
    options: TreeOptions,
) -> Result<TreeCloneStats, CloneError> {
    let src_meta = fs::symlink_metadata(src_dir).map_err(|source| CloneError::OpenSource {
        path: src_dir.to_owned(),
        source,
    })?;
    if !src_meta.file_type().is_dir() {
        return Err(CloneError::NotDirectory {
            path: src_dir.to_owned(),
        });
    }
    let mut walk = TreeWalk::new(options, src_meta.dev());
    walk.clone_entries(src_dir, dst_dir)?;
    walk.apply_attributes(dst_dir, &src_meta)?;
    Ok(walk.stats)
}

/// State of one [`clone_tree`] walk.
struct TreeWalk {
    stats: TreeCloneStats,
    /// Destination path of the first name seen for each multiply-linked source inode.
    first_names: HashMap<(u64, u64), PathBuf>,
    preserve_owner: bool,
    options: TreeOptions,
    /// The source root's device, for [`TreeOptions::one_file_system`].
    root_dev: u64,
}

impl TreeWalk {
    fn new(options: TreeOptions, root_dev: u64) -> TreeWalk {
        TreeWalk {
            stats: TreeCloneStats {
                directories: 1,
                ..TreeCloneStats::default()
            },
            first_names: HashMap::new(),
            preserve_owner: nix::unistd::geteuid().is_root(),
            options,
            root_dev,
        }
    }

    fn clone_entries(&mut self, src_dir: &Path, dst_dir: &Path) -> Result<(), CloneError> {
        let read_dir_err = |source| CloneError::ReadDir {
            path: src_dir.to_owned(),
            source,
        };
        for entry in fs::read_dir(src_dir).map_err(read_dir_err)? {
            let entry = entry.map_err(read_dir_err)?;
            let src = entry.path();
            let dst = dst_dir.join(entry.file_name());
            // DirEntry::metadata does not follow symlinks.
            let meta = entry.metadata().map_err(|source| CloneError::OpenSource {
                path: src.clone(),
                source,
            })?;
            let file_type = meta.file_type();

            if file_type.is_dir() {
                // Private while being filled; the source mode is applied once the
                // contents are in, so a read-only directory can still be populated.
                create_private_dir(&dst).map_err(|source| CloneError::CreateDestination {
                    path: dst.clone(),
                    source,
                })?;
                self.stats.directories += 1;
                // A mount point (another filesystem's root) stays empty.
                if !(self.options.one_file_system && meta.dev() != self.root_dev) {
                    self.clone_entries(&src, &dst)?;
                }
                self.apply_attributes(&dst, &meta)?;
            } else if file_type.is_file() {
                if self.options.one_file_system && meta.dev() != self.root_dev {
                    // A file mounted over another: an empty mount point again.
                    create_exclusive(&dst).map_err(|source| CloneError::CreateDestination {
                        path: dst.clone(),
                        source,
                    })?;
                    self.apply_attributes(&dst, &meta)?;
                    continue;
                }
                if meta.nlink() > 1 {
                    if let Some(first) = self.first_names.get(&(meta.dev(), meta.ino())) {
                        fs::hard_link(first, &dst)
                            .map_err(|source| CloneError::HardLink { path: dst, source })?;
                        self.stats.hard_links += 1;
                        continue;
                    }
                    self.first_names
                        .insert((meta.dev(), meta.ino()), dst.clone());
                }
                match clone_tree_file(&src, &dst, !self.options.expect_copies)? {
                    CloneMethod::Reflink => self.stats.reflinked_files += 1,
                    CloneMethod::SparseCopy => self.stats.copied_files += 1,
                }
                self.apply_attributes(&dst, &meta)?;
            } else if file_type.is_symlink() {
                let target = fs::read_link(&src).map_err(|source| CloneError::Symlink {
                    path: src.clone(),
                    source,
                })?;
                symlink(&target, &dst).map_err(|source| CloneError::Symlink {
                    path: src.clone(),
                    source,
                })?;
                self.stats.symlinks += 1;
                self.apply_attributes(&dst, &meta)?;
            } else if file_type.is_fifo()
                || file_type.is_char_device()
                || file_type.is_block_device()
            {
                let kind = SFlag::from_bits_truncate(meta.mode() & libc::S_IFMT);
                let perm = Mode::from_bits_truncate(meta.mode() & 0o7777);
                mknod(&dst, kind, perm, meta.rdev()).map_err(|e| CloneError::SpecialFile {
                    path: src.clone(),
                    source: e.into(),
                })?;
                self.stats.special_files += 1;
                self.apply_attributes(&dst, &meta)?;
            } else if file_type.is_socket() {
                self.stats.skipped_sockets += 1;
            } else {
                return Err(CloneError::OpenSource {
                    path: src,
                    source: io::ErrorKind::Unsupported.into(),
                });
            }
        }
        Ok(())
    }

    /// Gives `dst` the owner (as root), permission bits and times of `src_meta`.
    ///
    /// The owner goes first because `chown` clears setuid/setgid bits.
    fn apply_attributes(&self, dst: &Path, src_meta: &fs::Metadata) -> Result<(), CloneError> {
        let attr_err = |source: io::Error| CloneError::SetAttributes {
            path: dst.to_owned(),
            source,
        };
        let is_symlink = src_meta.file_type().is_symlink();
        if self.preserve_owner {
            lchown(dst, Some(src_meta.uid()), Some(src_meta.gid())).map_err(attr_err)?;
        }
        if !is_symlink {
            fs::set_permissions(dst, Permissions::from_mode(src_meta.mode() & 0o7777))
                .map_err(attr_err)?;
        }
        let atime = TimeSpec::new(src_meta.atime(), src_meta.atime_nsec());
        let mtime = TimeSpec::new(src_meta.mtime(), src_meta.mtime_nsec());
        utimensat(
            nix::fcntl::AT_FDCWD,
            dst,
            &atime,
            &mtime,
            UtimensatFlags::NoFollowSymlink,
        )
        .map_err(|e| attr_err(e.into()))
    }
}

/// Creates `path` as a new file (never opening an existing one), mode 0600, open
/// for reading too so that it can serve as a `FICLONE` source.
fn create_exclusive(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
}

/// Creates the directory `path` (not its parents), mode 0700.
fn create_private_dir(path: &Path) -> io::Result<()> {
    DirBuilder::new().mode(0o700).create(path)
}

/// Makes `dst` share all of `src`'s extents.
fn ficlone(src: &File, dst: &File) -> io::Result<()> {
    // SAFETY: FICLONE takes the source descriptor as its integer argument and reads
    // no memory of ours; both descriptors stay open for the duration of the call.
    let ret = unsafe { libc::ioctl(dst.as_raw_fd(), libc::FICLONE, src.as_raw_fd()) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Tells whether a `FICLONE` error means "this filesystem (pair) cannot reflink"
/// rather than a real failure.
fn is_reflink_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::EXDEV | libc::EINVAL | libc::ENOTTY | libc::ENOSYS)
    )
}

/// Logs, once per process for each filesystem (or pair of filesystems for a
/// cross-device clone), that clones there are full copies.
fn warn_sparse_fallback(
    src_file: &File,
    src: &Path,
    dst_file: &File,
    dst: &Path,
    reason: &io::Error,
) {
    let dst_dev = dst_file.metadata().map(|m| m.dev()).unwrap_or(0);
    let cross_device = reason.raw_os_error() == Some(libc::EXDEV);
    let src_dev = if cross_device {
        src_file.metadata().map(|m| m.dev()).unwrap_or(0)
    } else {
        dst_dev
    };
    if !first_fallback_between(src_dev, dst_dev) {
        return;
    }

    let dst_fs = fd_filesystem_name(dst_file);
    let dst_dir = dst.parent().unwrap_or(dst);
    if cross_device {
        let src_fs = fd_filesystem_name(src_file);
        tracing::warn!(
            "{} ({src_fs}) and {} ({dst_fs}) are different filesystems, which cannot share extents: clones between them are full sparse copies",
            src.parent().unwrap_or(src).display(),
            dst_dir.display(),
        );
    } else {
        tracing::warn!(
            "Filesystem {dst_fs} holding {} cannot reflink ({reason}): clones there are full sparse copies, slower and using disk space",
            dst_dir.display(),
        );
    }
}

/// Records a fallback between the filesystems with device ids `src_dev` and
/// `dst_dev`; true the first time this process sees that pair.
fn first_fallback_between(src_dev: u64, dst_dev: u64) -> bool {
    static SEEN: OnceLock<Mutex<HashSet<(u64, u64)>>> = OnceLock::new();
    SEEN.get_or_init(|| Mutex::new(HashSet::new()))
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .insert((src_dev, dst_dev))
}

/// Like [`filesystem_name`] for an open file; `"unknown"` when `fstatfs` fails,
/// because it only decorates a log line.
fn fd_filesystem_name(file: &File) -> String {
    match nix::sys::statfs::fstatfs(file) {
        Ok(stat) => name_of_magic(magic_of(&stat)),
        Err(_) => "unknown".to_owned(),
    }
}

/// The filesystem magic number of a `statfs` result.
#[allow(clippy::unnecessary_cast)] // f_type is signed on some targets, unsigned on others.
fn magic_of(stat: &nix::sys::statfs::Statfs) -> u64 {
    // Magic numbers are 32-bit; a signed f_type may sign-extend them.
    (stat.filesystem_type().0 as u64) & 0xffff_ffff
}

/// Maps a filesystem magic number to a name.
fn name_of_magic(magic: u64) -> String {
    let name = match magic {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x794C_7630 => "overlayfs",
        0x2FC1_2FC1 => "zfs",
        0xCA45_1A4E => "bcachefs",
        0xF2F5_2010 => "f2fs",
        0x6969 => "nfs",
        0xFF53_4D42 => "cifs",
        0xFE53_4D42 => "smb2",
        0x6573_5546 => "fuse",
        0x7371_7368 => "squashfs",
        0x8584_58F6 => "ramfs",
        0x7461_636F => "ocfs2",
        0x4D44 => "vfat",
        0x2011_BAB0 => "exfat",
        0x5346_544E => "ntfs",
        _ => return format!("{magic:#x}"),
    };
    name.to_owned()
}

/// Copies the data regions of `src` (the first `len` bytes) into the empty `dst`,
/// leaving holes where `src` has holes, then sets `dst`'s length to `len`.
fn sparse_copy(src: &File, dst: &File, len: u64) -> io::Result<()> {
    let len = i64::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut pos = 0i64;
    while pos < len {
        let data_start = match lseek(src, pos, Whence::SeekData) {
            Ok(offset) => offset,
            // No data after `pos`: the rest is a hole.
            Err(Errno::ENXIO) => break,
            // No SEEK_DATA support: treat everything left as data.
            Err(Errno::EINVAL | Errno::EOPNOTSUPP) => pos,
            Err(e) => return Err(e.into()),
        };
        if data_start >= len {
            break;
        }
        let data_end = match lseek(src, data_start, Whence::SeekHole) {
            Ok(offset) => offset.min(len),
            Err(Errno::ENXIO) => break, // the file shrank under us
            Err(Errno::EINVAL | Errno::EOPNOTSUPP) => len,
            Err(e) => return Err(e.into()),
        };
        let copied_to = copy_range(src, dst, data_start, data_end)?;
        if copied_to < data_end {
            break; // the file shrank under us; set_len below keeps the expected size
        }
        pos = data_end;
    }
    dst.set_len(len.unsigned_abs())
}

/// Copies bytes `[start, end)` of `src` to the same offsets of `dst`, in the kernel
/// where it can. Returns the offset reached, short of `end` only if `src` shrank.
fn copy_range(src: &File, dst: &File, start: i64, end: i64) -> io::Result<i64> {
    const MAX_CHUNK: i64 = 1 << 30;
    let mut off_in = start;
    let mut off_out = start;
    while off_in < end {
        let chunk = usize::try_from((end - off_in).min(MAX_CHUNK))
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: both descriptors are open for the duration of the call, and the
        // two offset pointers refer to live, exclusively borrowed i64 locals that the
        // kernel reads and advances.
        let ret = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut off_in,
                dst.as_raw_fd(),
                &mut off_out,
                chunk,
                0,
            )
        };
        match Errno::result(ret) {
            Ok(0) => return Ok(off_in),
            Ok(_) => {}
            Err(Errno::EINTR) => {}
            // Kernels or filesystems without in-kernel copy for this pair.
            Err(Errno::EXDEV | Errno::ENOSYS | Errno::EOPNOTSUPP | Errno::EINVAL) => {
                return copy_range_userspace(src, dst, off_in, end);
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(off_in)
}

/// [`copy_range`] through a userspace buffer.
fn copy_range_userspace(src: &File, dst: &File, start: i64, end: i64) -> io::Result<i64> {
    let mut buf = vec![0u8; 1 << 20];
    let mut offset = start.unsigned_abs();
    let end = end.unsigned_abs();
    while offset < end {
        let want = usize::try_from(end - offset).map_or(buf.len(), |n| n.min(buf.len()));
        let n = match src.read_at(&mut buf[..want], offset) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        dst.write_all_at(&buf[..n], offset)?;
        offset += n as u64;
    }
    i64::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    const MIB: u64 = 1 << 20;

    /// A file with data at both ends and a 64 MiB hole between.
    fn write_holey_file(path: &Path) -> Vec<u8> {
        let mut f = File::create(path).unwrap();
        let head: Vec<u8> = (0..MIB).map(|i| (i * 7 % 251) as u8).collect();
        f.write_all(&head).unwrap();
        let tail_at = 65 * MIB;
        f.write_all_at(b"tail data", tail_at).unwrap();
        f.sync_all().unwrap();
        let mut expected = head;
        expected.resize(tail_at as usize, 0);
        expected.extend_from_slice(b"tail data");
        expected
    }

    #[test]
    fn clone_on_filesystem_without_reflink_is_sparse_copy() {
        let dir = tempfile::tempdir().unwrap();
        if supports_reflink(dir.path()).unwrap() {
            println!(
                "skipped: {} ({}) supports reflink, so there is no fallback to test",
                dir.path().display(),
                filesystem_name(dir.path()).unwrap()
            );
            return;
        }
        let src = dir.path().join("src");
        let dst = dir.path().join("dst");
        let expected = write_holey_file(&src);
        fs::set_permissions(&src, Permissions::from_mode(0o640)).unwrap();

        assert_eq!(clone_file(&src, &dst).unwrap(), CloneMethod::SparseCopy);

        assert_eq!(fs::read(&dst).unwrap(), expected);
        let meta = fs::metadata(&dst).unwrap();
        assert_eq!(meta.len(), expected.len() as u64);
        assert_eq!(meta.mode() & 0o7777, 0o640);
        // 512-byte blocks: a dense copy would hold 66 MiB; the copy holds ~1 MiB.
        let allocated = meta.blocks() * 512;
        assert!(
            allocated < 4 * MIB,
            "hole was not preserved: {allocated} bytes allocated"
        );
    }

    #[test]
    fn sparse_copy_of_file_ending_in_hole_keeps_size() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let dst = dir.path().join("dst");
        let f = File::create(&src).unwrap();
        f.write_all_at(b"abc", 4096).unwrap();
        f.set_len(32 * MIB).unwrap();
        drop(f);

        clone_file(&src, &dst).unwrap();

        assert_eq!(fs::read(&dst).unwrap(), fs::read(&src).unwrap());
        assert_eq!(fs::metadata(&dst).unwrap().len(), 32 * MIB);
        assert!(fs::metadata(&dst).unwrap().blocks() * 512 < MIB);
    }

    #[test]
    fn empty_file_clones() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let dst = dir.path().join("dst");
        File::create(&src).unwrap();
        clone_file(&src, &dst).unwrap();
        assert_eq!(fs::metadata(&dst).unwrap().len(), 0);
    }

    #[test]
    fn existing_destination_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let dst = dir.path().join("dst");
        fs::write(&src, b"new").unwrap();
        fs::write(&dst, b"old").unwrap();
        let err = clone_file(&src, &dst).unwrap_err();
        assert!(matches!(err, CloneError::CreateDestination { .. }), "{err}");
        assert_eq!(fs::read(&dst).unwrap(), b"old");
    }

    #[test]
    fn missing_or_non_regular_source_is_refused_without_leaving_dst() {
        let dir = tempfile::tempdir().unwrap();
        let dst = dir.path().join("dst");
        let err = clone_file(&dir.path().join("missing"), &dst).unwrap_err();
        assert!(matches!(err, CloneError::OpenSource { .. }), "{err}");
        let err = clone_file(dir.path(), &dst).unwrap_err();
        assert!(matches!(err, CloneError::NotRegularFile { .. }), "{err}");
        assert!(!dst.exists());
    }

    #[test]
    fn failed_copy_removes_partial_destination() {
        if !nix::unistd::geteuid().is_root() {
            println!("skipped: mounting a tiny tmpfs needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("small");
        fs::create_dir(&small).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &small,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=256k"),
        )
        .unwrap();
        struct Unmount<'a>(&'a Path);
        impl Drop for Unmount<'_> {
            fn drop(&mut self) {
                let _ = nix::mount::umount2(self.0, nix::mount::MntFlags::MNT_DETACH);
            }
        }
        let _unmount = Unmount(&small);
        let src = dir.path().join("src");
        fs::write(&src, vec![0xa5u8; 4 * MIB as usize]).unwrap();
        let dst = small.join("dst");

        // Cross-filesystem, so a sparse copy, which runs out of space.
        let err = clone_file(&src, &dst).unwrap_err();

        assert!(matches!(err, CloneError::SparseCopy { .. }), "{err}");
        assert!(!dst.exists(), "partial destination left behind");
    }

    #[test]
    fn fallback_warning_is_once_per_filesystem() {
        // Device ids no real filesystem in this process uses.
        let (a, b) = (u64::MAX - 10, u64::MAX - 11);
        assert!(first_fallback_between(a, a));
        assert!(!first_fallback_between(a, a));
        assert!(first_fallback_between(a, b));
        assert!(first_fallback_between(b, b));
        assert!(!first_fallback_between(a, b));
    }

    #[test]
    fn reflink_probe_leaves_no_files() {
        let dir = tempfile::tempdir().unwrap();
        supports_reflink(dir.path()).unwrap();
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn reflink_probe_in_missing_dir_fails() {
        let dir = tempfile::tempdir().unwrap();
        let err = supports_reflink(&dir.path().join("missing")).unwrap_err();
        assert!(matches!(err, CloneError::Probe { .. }), "{err}");
    }

    #[test]
    fn filesystem_names() {
        assert_eq!(name_of_magic(0xEF53), "ext4");
        assert_eq!(name_of_magic(0x5846_5342), "xfs");
        assert_eq!(name_of_magic(0x1234), "0x1234");
        let name = filesystem_name(Path::new("/proc")).unwrap();
        assert_eq!(name, "0x9fa0", "procfs has a fixed magic");
        assert!(filesystem_name(Path::new("/nonexistent/path")).is_err());
    }

    #[test]
    fn tree_clone_keeps_structure_links_and_modes() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("rootfs");
        let dst = dir.path().join("clone");
        fs::create_dir_all(src.join("usr/bin")).unwrap();
        fs::create_dir_all(src.join("etc")).unwrap();
        fs::write(src.join("usr/bin/tool"), b"#!/bin/sh\necho hi\n").unwrap();
        fs::set_permissions(src.join("usr/bin/tool"), Permissions::from_mode(0o4755)).unwrap();
        fs::write(src.join("etc/config"), b"key=value\n").unwrap();
        fs::set_permissions(src.join("etc/config"), Permissions::from_mode(0o600)).unwrap();
        fs::hard_link(src.join("usr/bin/tool"), src.join("usr/bin/tool-alias")).unwrap();
        symlink("usr/bin", src.join("bin")).unwrap();
        symlink("/does/not/exist", src.join("dangling")).unwrap();
        nix::unistd::mkfifo(&src.join("etc/fifo"), Mode::from_bits_truncate(0o640)).unwrap();
        fs::set_permissions(src.join("etc"), Permissions::from_mode(0o555)).unwrap();
        let old = TimeSpec::new(1_000_000_000, 0);
        utimensat(
            nix::fcntl::AT_FDCWD,
            &src.join("etc/config"),
            &old,
            &old,
            UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();

        let stats = clone_tree(&src, &dst).unwrap();

        assert_eq!(stats.reflinked_files + stats.copied_files, 2);
        assert_eq!(stats.hard_links, 1);
        assert_eq!(stats.symlinks, 2);
        assert_eq!(stats.directories, 4);
        assert_eq!(stats.special_files, 1);
        assert_eq!(
            fs::read(dst.join("usr/bin/tool")).unwrap(),
            b"#!/bin/sh\necho hi\n"
        );
        assert_eq!(fs::read(dst.join("etc/config")).unwrap(), b"key=value\n");
        let mode = |p: &str| fs::symlink_metadata(dst.join(p)).unwrap().mode() & 0o7777;
        assert_eq!(mode("usr/bin/tool"), 0o4755);
        assert_eq!(mode("etc/config"), 0o600);
        assert_eq!(mode("etc"), 0o555);
        assert_eq!(mode("etc/fifo"), 0o640);
        assert!(fs::symlink_metadata(dst.join("etc/fifo"))
            .unwrap()
            .file_type()
            .is_fifo());
        assert_eq!(
            fs::read_link(dst.join("bin")).unwrap(),
            Path::new("usr/bin")
        );
        assert_eq!(
            fs::read_link(dst.join("dangling")).unwrap(),
            Path::new("/does/not/exist")
        );
        let tool = fs::metadata(dst.join("usr/bin/tool")).unwrap();
        let alias = fs::metadata(dst.join("usr/bin/tool-alias")).unwrap();
        assert_eq!(tool.ino(), alias.ino());
        assert_eq!(
            fs::metadata(dst.join("etc/config")).unwrap().mtime(),
            1_000_000_000
        );
        // The clone is independent of the source.
        fs::write(dst.join("usr/bin/tool"), b"changed").unwrap();
        assert_eq!(
            fs::read(src.join("usr/bin/tool")).unwrap(),
            b"#!/bin/sh\necho hi\n"
        );

        fs::set_permissions(src.join("etc"), Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn tree_clone_refuses_destination_inside_source() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        fs::create_dir(&src).unwrap();
        let err = clone_tree(&src, &src.join("inner")).unwrap_err();
        assert!(
            matches!(err, CloneError::DestinationInsideSource { .. }),
            "{err}"
        );
        assert!(!src.join("inner").exists());
    }

    #[test]
    fn socket_files_are_left_out_of_a_tree_clone() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let dst = dir.path().join("dst");
        fs::create_dir(&src).unwrap();
        fs::write(src.join("a"), b"a").unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(src.join("sock")).unwrap();

        let stats = clone_tree(&src, &dst).unwrap();

        assert_eq!(stats.skipped_sockets, 1);
        assert_eq!(fs::read(dst.join("a")).unwrap(), b"a");
        assert!(fs::symlink_metadata(dst.join("sock")).is_err());
    }

    #[test]
    fn failed_tree_clone_removes_partial_destination() {
        // A sparse file larger than the destination's filesystem allows (tmpfs takes
        // 17 TiB, ext4 stops at 16): its copy fails after the first file went in.
        let Ok(shm) = tempfile::tempdir_in("/dev/shm") else {
            println!("skipped: no /dev/shm");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        if filesystem_name(dir.path()).unwrap() != "ext4" {
            println!("skipped: the temporary directory is not on ext4");
            return;
        }
        let src = shm.path().join("src");
        let dst = dir.path().join("dst");
        fs::create_dir(&src).unwrap();
        fs::write(src.join("a"), b"a").unwrap();
        File::create(src.join("huge"))
            .unwrap()
            .set_len(17 << 40)
            .unwrap();

        assert!(clone_tree(&src, &dst).is_err());
        assert!(!dst.exists());
    }

    #[test]
    fn a_tree_is_cloned_into_an_existing_directory_without_its_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let dst = dir.path().join("dst");
        fs::create_dir(&src).unwrap();
        fs::create_dir(src.join("sub")).unwrap();
        fs::write(src.join("sub/a"), b"a").unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(src.join("sock")).unwrap();
        fs::set_permissions(&src, Permissions::from_mode(0o1777)).unwrap();
        fs::create_dir(&dst).unwrap();
        let stats = clone_tree_into(&src, &dst, TreeOptions::default()).unwrap();

        assert_eq!(fs::read(dst.join("sub/a")).unwrap(), b"a");
        assert!(!dst.join("sock").exists());
        assert_eq!(stats.skipped_sockets, 1);
        assert_eq!(stats.directories, 2);
        // The existing root takes the source root's mode.
        assert_eq!(fs::metadata(&dst).unwrap().mode() & 0o7777, 0o1777);
    }

    #[test]
    fn one_file_system_leaves_mount_points_empty() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: mounting a tmpfs needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        fs::create_dir_all(src.join("mnt")).unwrap();
        fs::write(src.join("kept"), b"k").unwrap();
        // A private mount namespace on a thread of its own, so the test's tmpfs is
        // nobody else's and goes with the thread.
        let cloned = std::thread::spawn(move || {
            nix::sched::unshare(
                nix::sched::CloneFlags::CLONE_NEWNS | nix::sched::CloneFlags::CLONE_FS,
            )
            .unwrap();
            nix::mount::mount(
                None::<&str>,
                "/",
                None::<&str>,
                nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_PRIVATE,
                None::<&str>,
            )
            .unwrap();
            nix::mount::mount(
                Some("tmpfs"),
                &src.join("mnt"),
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some("mode=0750"),
            )
            .unwrap();
            fs::write(src.join("mnt/hidden"), b"h").unwrap();
            let dst = src.with_file_name("dst");
            let options = TreeOptions {
                one_file_system: true,
                expect_copies: true,
            };
            clone_tree_with(&src, &dst, options).unwrap();
            let everything = src.with_file_name("all");
            clone_tree(&src, &everything).unwrap();
            (dst, everything)
        })
        .join()
        .unwrap();
        let (dst, everything) = cloned;
        assert_eq!(fs::read(dst.join("kept")).unwrap(), b"k");
        assert!(dst.join("mnt").is_dir());
        assert!(!dst.join("mnt/hidden").exists());
        assert_eq!(
            fs::metadata(dst.join("mnt")).unwrap().mode() & 0o7777,
            0o750
        );
        assert!(everything.join("mnt/hidden").exists());
    }
}
