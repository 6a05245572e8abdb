//! Disk limits for directories of the store: XFS project quotas.
//!
//! Every sandbox's writable layer lives in one shared store filesystem; without a limit
//! one sandbox can fill it for every other sandbox and for the host. XFS counts the
//! blocks and inodes of every file tagged with a project id and refuses writes past the
//! project's hard limit with ENOSPC, whoever writes. A directory tagged with the
//! project and marked "inherit" passes the tag to everything created below it, so
//! tagging a sandbox's directory once covers what it writes later.
//!
//! The filesystem must be mounted with project quotas on (`prjquota`; `cube store
//! setup` does it); [`enforced`] tells. Limits are set with `quotactl_fd` (Linux 5.14)
//! on a descriptor of the directory, so no device path is needed.
//!
//! A rename into a directory of another project fails with EXDEV on XFS: tag a tree
//! after moving it in ([`tag_tree`]), not before.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// `FS_IOC_FSGETXATTR`: `_IOR('X', 31, struct fsxattr)`.
const FS_IOC_FSGETXATTR: libc::c_ulong = 0x801c_581f;
/// `FS_IOC_FSSETXATTR`: `_IOW('X', 32, struct fsxattr)`.
const FS_IOC_FSSETXATTR: libc::c_ulong = 0x401c_5820;
/// `FS_XFLAG_PROJINHERIT`: new entries of a directory take its project id.
const FS_XFLAG_PROJINHERIT: u32 = 0x0000_0200;
/// `quotactl_fd(2)` on x86-64 (and every architecture with the unified numbering).
const SYS_QUOTACTL_FD: libc::c_long = 443;
/// `PRJQUOTA`: the project quota type.
const PRJQUOTA: u32 = 2;
/// `Q_XGETQUOTA`, `Q_XSETQLIM`, `Q_XGETQSTAT`: `XQM_CMD(3)`, `XQM_CMD(4)`, `XQM_CMD(5)`.
const Q_XGETQUOTA: u32 = 0x5803;
const Q_XSETQLIM: u32 = 0x5804;
const Q_XGETQSTAT: u32 = 0x5805;
/// `FS_DQUOT_VERSION`, `FS_PROJ_QUOTA`, `FS_DQ_BSOFT | FS_DQ_BHARD`.
const FS_DQUOT_VERSION: i8 = 1;
const FS_PROJ_QUOTA: i8 = 2;
const FS_DQ_BLOCK_LIMITS: u16 = (1 << 2) | (1 << 3);
/// `FS_QUOTA_PDQ_ENFD` in `fs_quota_stat.qs_flags`: project limits are enforced.
const FS_QUOTA_PDQ_ENFD: u16 = 1 << 5;
/// Quota limits count 512-byte basic blocks.
const BASIC_BLOCK: u64 = 512;

/// `struct fsxattr` from `<linux/fs.h>`.
#[repr(C)]
#[derive(Default)]
struct FsXattr {
    xflags: u32,
    extsize: u32,
    nextents: u32,
    projid: u32,
    cowextsize: u32,
    pad: [u8; 8],
}

/// `struct fs_disk_quota` from `<linux/dqblk_xfs.h>`.
#[repr(C)]
#[derive(Default)]
struct FsDiskQuota {
    version: i8,
    flags: i8,
    fieldmask: u16,
    id: u32,
    blk_hardlimit: u64,
    blk_softlimit: u64,
    ino_hardlimit: u64,
    ino_softlimit: u64,
    bcount: u64,
    icount: u64,
    itimer: i32,
    btimer: i32,
    iwarns: u16,
    bwarns: u16,
    itimer_hi: i8,
    btimer_hi: i8,
    rtbtimer_hi: i8,
    padding2: i8,
    rtb_hardlimit: u64,
    rtb_softlimit: u64,
    rtbcount: u64,
    rtbtimer: i32,
    rtbwarns: u16,
    padding3: i16,
    padding4: [u8; 8],
}

/// Errors of project quotas.
#[derive(Debug, thiserror::Error)]
pub enum ProjectQuotaError {
    /// The directory's filesystem does not enforce project quotas.
    #[error("{0} is not on a filesystem with project quotas (XFS mounted with prjquota)")]
    Unsupported(PathBuf),
    /// Tagging a file with the project failed.
    #[error("cannot tag {path} with project {project}")]
    Tag {
        /// The file.
        path: PathBuf,
        /// The project id.
        project: u32,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Reading or setting the project's limit failed.
    #[error("cannot {action} the disk limit of project {project} on {path}")]
    Quota {
        /// "set" or "read".
        action: &'static str,
        /// A directory on the filesystem.
        path: PathBuf,
        /// The project id.
        project: u32,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

type Result<T> = std::result::Result<T, ProjectQuotaError>;

/// The usage and limit of one project.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProjectUsage {
    /// Bytes its files hold.
    pub bytes: u64,
    /// Its files (inodes).
    pub files: u64,
    /// Its hard limit in bytes; 0 for none.
    pub limit_bytes: u64,
}

fn open_dir(dir: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
}

fn quotactl(dir: &File, cmd: u32, project: u32, addr: *mut libc::c_void) -> io::Result<()> {
    let cmd = (cmd << 8) | PRJQUOTA;
    // SAFETY: quotactl_fd reads or writes the structure `addr` points at, which the
    // callers size for `cmd`; the descriptor is open.
    let r = unsafe { libc::syscall(SYS_QUOTACTL_FD, dir.as_raw_fd(), cmd, project, addr) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether the filesystem of `dir` enforces project quotas.
pub fn enforced(dir: &Path) -> bool {
    let Ok(file) = open_dir(dir) else {
        return false;
    };
    // `struct fs_quota_stat`: version (s8), then the flags (u16) at offset 2; the rest
    // is not needed. A generous buffer takes the whole structure.
    let mut stat = [0u8; 256];
    stat[0] = FS_DQUOT_VERSION as u8;
    if quotactl(&file, Q_XGETQSTAT, 0, stat.as_mut_ptr().cast()).is_err() {
        return false;
    }
    u16::from_ne_bytes([stat[2], stat[3]]) & FS_QUOTA_PDQ_ENFD != 0
}

/// Tags `root` and every directory and regular file below it (symlinks are not
/// followed) with `project`, directories to pass it on. For a tree just created or
/// moved into place and not in use.
pub fn tag_tree(root: &Path, project: u32) -> Result<()> {
    let mut pending = vec![root.to_path_buf()];
    while let Some(path) = pending.pop() {
        let tag_err = |source| ProjectQuotaError::Tag {
            path: path.clone(),
            project,
            source,
        };
        let meta = fs::symlink_metadata(&path).map_err(tag_err)?;
        if meta.is_dir() {
            for entry in fs::read_dir(&path).map_err(tag_err)? {
                pending.push(entry.map_err(tag_err)?.path());
            }
        } else if !meta.is_file() {
            // Symlinks, sockets and device nodes hold no data blocks worth a limit,
            // and the tagging ioctl needs an open file.
            continue;
        }
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
            .map_err(tag_err)?;
        if file.metadata().map_err(tag_err)?.ino() != meta.ino() {
            return Err(tag_err(io::ErrorKind::InvalidData.into()));
        }
        tag(&file, project, meta.is_dir()).map_err(tag_err)?;
    }
    Ok(())
}

fn tag(file: &File, project: u32, inherit: bool) -> io::Result<()> {
    let mut attr = FsXattr::default();
    // SAFETY: FS_IOC_FSGETXATTR fills in a `struct fsxattr`, which `attr` is.
    if unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FSGETXATTR, &mut attr) } != 0 {
        return Err(io::Error::last_os_error());
    }
    attr.projid = project;
    if inherit {
        attr.xflags |= FS_XFLAG_PROJINHERIT;
    }
    // SAFETY: FS_IOC_FSSETXATTR reads a `struct fsxattr`, which `attr` is.
    if unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FSSETXATTR, &attr) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets the hard (and soft) limit of `project` on the filesystem of `dir` to `bytes`
/// (rounded up to 512-byte blocks; 0 removes the limit).
pub fn set_limit(dir: &Path, project: u32, bytes: u64) -> Result<()> {
    let err = |source| ProjectQuotaError::Quota {
        action: "set",
        path: dir.to_path_buf(),
        project,
        source,
    };
    let file = open_dir(dir).map_err(err)?;
    let blocks = bytes.div_ceil(BASIC_BLOCK);
    let mut quota = FsDiskQuota {
        version: FS_DQUOT_VERSION,
        flags: FS_PROJ_QUOTA,
        fieldmask: FS_DQ_BLOCK_LIMITS,
        id: project,
        blk_hardlimit: blocks,
        blk_softlimit: blocks,
        ..FsDiskQuota::default()
    };
    quotactl(
        &file,
        Q_XSETQLIM,
        project,
        (&mut quota as *mut FsDiskQuota).cast(),
    )
    .map_err(err)
}

/// The usage and limit of `project` on the filesystem of `dir` (zeros for a project
/// nothing was ever tagged with).
pub fn usage(dir: &Path, project: u32) -> Result<ProjectUsage> {
    let err = |source| ProjectQuotaError::Quota {
        action: "read",
        path: dir.to_path_buf(),
        project,
        source,
    };
    let file = open_dir(dir).map_err(err)?;
    let mut quota = FsDiskQuota::default();
    match quotactl(
        &file,
        Q_XGETQUOTA,
        project,
        (&mut quota as *mut FsDiskQuota).cast(),
    ) {
        Ok(()) => Ok(ProjectUsage {
            bytes: quota.bcount * BASIC_BLOCK,
            files: quota.icount,
            limit_bytes: quota.blk_hardlimit * BASIC_BLOCK,
        }),
        // No quota record: nothing was ever charged to it.
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(ProjectUsage::default()),
        Err(e) => Err(err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structs_match_the_kernel_abi() {
        assert_eq!(std::mem::size_of::<FsXattr>(), 28);
        assert_eq!(std::mem::size_of::<FsDiskQuota>(), 112);
        // The ioctl numbers encode the size of struct fsxattr.
        assert_eq!((FS_IOC_FSGETXATTR >> 16) & 0x3fff, 28);
        assert_eq!((FS_IOC_FSSETXATTR >> 16) & 0x3fff, 28);
    }

    #[test]
    fn a_filesystem_without_project_quotas_says_so() {
        let dir = tempfile::tempdir().unwrap();
        // The temporary directory's filesystem (tmpfs or ext4 without quotas here)
        // enforces none.
        if enforced(dir.path()) {
            println!("skipped: this host's temporary directory enforces project quotas");
            return;
        }
        assert!(!enforced(dir.path()));
    }
}
