//! A reflink-capable store filesystem for hosts whose own filesystem cannot reflink.
//!
//! On an ext4 host every sandbox create would copy the template's root filesystem
//! and memory file. An XFS filesystem (made with `-m reflink=1`) in a sparse image
//! file, attached to a loop device and mounted where the store lives, makes those
//! clones O(1) again at the cost of one image file on the host.
//!
//! The mount is meant to outlive the process that made it (it is the store), so
//! [`LoopStore`] does not unmount on drop; [`LoopStore::unmount_and_detach`] does.
//! While it is being set up, every step is undone if a later one fails.
//!
//! It is mounted with project quotas (`prjquota`), which per-sandbox disk limits use
//! (see [`crate::project_quota`]), where the kernel's XFS has quota support. XFS takes
//! quota options only at mount time: a store mounted without them keeps working,
//! without disk limits, until it is mounted again.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::thread;
use std::time::{Duration, Instant};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::reflink::{self, CloneError};
use crate::removal_guard::RemovalGuard;

/// `ioctl` on `/dev/loop-control`: allocate or find a free loop device.
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
/// `ioctl` on a loop device: bind a backing file and set its parameters at once.
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
/// `ioctl` on a loop device: unbind its backing file.
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
/// Loop flag: unbind automatically when the last user (the mount) lets go.
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;

/// How often to retry when another process takes the free loop device first.
const ATTACH_ATTEMPTS: usize = 16;
/// How long to wait for the kernel to release a loop device after unmount.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// The filesystem type the image is formatted with.
const FILESYSTEM: &str = "xfs";
/// Mount options: project quota accounting and enforcement.
const MOUNT_OPTIONS: &str = "prjquota";
/// What the image format says at offset 0.
const XFS_SUPERBLOCK_MAGIC: &[u8; 4] = b"XFSB";

/// `struct loop_info64` from `<linux/loop.h>`.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

/// `struct loop_config` from `<linux/loop.h>`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// Errors from preparing and tearing down a loop-mounted store.
#[derive(Debug, thiserror::Error)]
pub enum LoopStoreError {
    /// The image size is zero.
    #[error("Image size must be greater than zero")]
    ZeroSize,
    /// `mkfs.xfs` is not on this host.
    #[error("mkfs.xfs not found: install the xfsprogs package")]
    MkfsMissing,
    /// `mkfs.xfs` could not be started.
    #[error("Cannot run mkfs.xfs")]
    RunMkfs {
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// `mkfs.xfs` ran and failed (e.g. image below XFS's 300 MB minimum).
    #[error("mkfs.xfs failed on {image} ({status}): {stderr}")]
    Mkfs {
        /// The image.
        image: PathBuf,
        /// Its exit status.
        status: ExitStatus,
        /// What it printed on stderr.
        stderr: String,
    },
    /// The image file could not be created, sized or opened.
    #[error("Cannot create image {path}")]
    CreateImage {
        /// The image.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The image exists but holds no XFS filesystem; it is not formatted over,
    /// since it may be someone's data.
    #[error("Image {path} exists but does not hold an XFS filesystem")]
    NotXfsImage {
        /// The image.
        path: PathBuf,
    },
    /// No loop device could be bound to the image.
    #[error("Cannot attach {image} to a loop device")]
    AttachLoop {
        /// The image.
        image: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The loop device could not be unbound, or was not released in time.
    #[error("Cannot detach loop device {device}")]
    DetachLoop {
        /// The loop device.
        device: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The mountpoint directory could not be created.
    #[error("Cannot create mountpoint {path}")]
    CreateMountpoint {
        /// The mountpoint.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// `mount(2)` failed.
    #[error("Cannot mount {device} on {mountpoint}")]
    Mount {
        /// The loop device.
        device: PathBuf,
        /// The mountpoint.
        mountpoint: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// `umount(2)` failed (`EBUSY`: files are still open there).
    #[error("Cannot unmount {mountpoint}")]
    Unmount {
        /// The mountpoint.
        mountpoint: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Something that cannot reflink is already mounted at the mountpoint; it is
    /// left alone rather than mounted over.
    #[error("{mountpoint} already holds a {filesystem} mount that cannot reflink")]
    MountedWithoutReflink {
        /// The mountpoint.
        mountpoint: PathBuf,
        /// The filesystem type mounted there.
        filesystem: String,
    },
    /// The freshly mounted filesystem failed the reflink probe.
    #[error("The XFS filesystem mounted at {mountpoint} cannot reflink")]
    NoReflinkAfterMount {
        /// The mountpoint.
        mountpoint: PathBuf,
    },
    /// The reflink probe itself failed.
    #[error("Cannot probe reflink support")]
    Probe {
        /// The underlying error.
        #[source]
        source: CloneError,
    },
    /// `/proc/self/mountinfo` could not be read.
    #[error("Cannot read the mount table")]
    MountTable {
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A path could not be resolved to an absolute one.
    #[error("Cannot resolve {path}")]
    ResolvePath {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The mount is not a loop device backed by this store's image, so tearing it
    /// down could destroy something else.
    #[error("{mountpoint} is not mounted from a loop device of {image}; not unmounting it")]
    NotOurMount {
        /// The mountpoint.
        mountpoint: PathBuf,
        /// The image this store expected.
        image: PathBuf,
    },
}

/// A mounted, reflink-capable store filesystem.
#[derive(Debug)]
#[must_use = "the mount stays until unmount_and_detach is called"]
pub struct LoopStore {
    mountpoint: PathBuf,
    image: PathBuf,
    loop_device: Option<PathBuf>,
    newly_mounted: bool,
}

impl LoopStore {
    /// Where the filesystem is mounted (absolute).
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// The image file (absolute).
    pub fn image(&self) -> &Path {
        &self.image
    }

    /// The loop device backing the mount: `None` when an existing reflink-capable
    /// mount was found that is not backed by this image.
    pub fn loop_device(&self) -> Option<&Path> {
        self.loop_device.as_deref()
    }

    /// True if this call mounted the filesystem, false if it was mounted already.
    pub fn newly_mounted(&self) -> bool {
        self.newly_mounted
    }

    /// Unmounts the filesystem and unbinds the loop device, waiting until the kernel
    /// has released it. Refuses mounts not backed by this store's image.
    pub fn unmount_and_detach(self) -> Result<(), LoopStoreError> {
        let Some(device) = self.loop_device else {
            return Err(LoopStoreError::NotOurMount {
                mountpoint: self.mountpoint,
                image: self.image,
            });
        };
        umount2(&self.mountpoint, MntFlags::empty()).map_err(|e| LoopStoreError::Unmount {
            mountpoint: self.mountpoint.clone(),
            source: e.into(),
        })?;
        detach_loop(&device).map_err(|source| LoopStoreError::DetachLoop {
            device: device.clone(),
            source,
        })?;
        wait_until_released(&device, &self.image)
            .map_err(|source| LoopStoreError::DetachLoop { device, source })
    }
}

/// Makes `mountpoint` a mounted, reflink-capable XFS filesystem stored in `image`.
///
/// Idempotent: if a reflink-capable filesystem is already mounted at `mountpoint`
/// it is returned as it is. Otherwise the image is created sparse with
/// `size_bytes` and formatted with `mkfs.xfs -m reflink=1` if it does not exist
/// (an existing XFS image is reused with its data, never reformatted), attached to
/// a free loop device (auto-clearing, so it is released when unmounted) and
/// mounted. Needs root. On error everything this call set up is undone.
///
/// Whatever `mountpoint` already contains is hidden (not lost) while the store is
/// mounted. The mount is not recorded in fstab: after a reboot, calling this again
/// reattaches the same image with its data.
pub fn prepare_xfs_loop_store(
    image: &Path,
    size_bytes: u64,
    mountpoint: &Path,
) -> Result<LoopStore, LoopStoreError> {
    if size_bytes == 0 {
        return Err(LoopStoreError::ZeroSize);
    }
    fs::create_dir_all(mountpoint).map_err(|source| LoopStoreError::CreateMountpoint {
        path: mountpoint.to_owned(),
        source,
    })?;
    let mountpoint = canonical(mountpoint)?;
    let image = absolute_image_path(image)?;

    if let Some(mounted) = find_mount(&mountpoint)? {
        if !reflink::supports_reflink(&mountpoint)
            .map_err(|source| LoopStoreError::Probe { source })?
        {
            return Err(LoopStoreError::MountedWithoutReflink {
                mountpoint,
                filesystem: mounted.fstype,
            });
        }
        let loop_device = loop_device_backed_by(&mounted.source, &image);
        return Ok(LoopStore {
            mountpoint,
            image,
            loop_device,
            newly_mounted: false,
        });
    }

    let image_guard = if fs::symlink_metadata(&image).is_ok() {
        None
    } else {
        Some(create_sparse_image(&image, size_bytes)?)
    };
    if image_guard.is_some() {
        run_mkfs_xfs(&image)?;
    } else if !holds_xfs(&image)? {
        return Err(LoopStoreError::NotXfsImage { path: image });
    }

    let image_file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&image)
        .map_err(|source| LoopStoreError::CreateImage {
            path: image.clone(),
            source,
        })?;
    let device = AttachedLoop::attach(&image_file, &image)?;
    // Project quotas: the per-sandbox disk limits (see `project_quota`). A kernel
    // built without XFS quota support (CONFIG_XFS_QUOTA) refuses the option with
    // EINVAL: the store is then mounted without it, and has no disk limits.
    let mount_store = |options: Option<&str>| {
        mount(
            Some(device.path()),
            &mountpoint,
            Some(FILESYSTEM),
            MsFlags::empty(),
            options,
        )
    };
    mount_store(Some(MOUNT_OPTIONS))
        .or_else(|e| match e {
            nix::errno::Errno::EINVAL => {
                tracing::warn!(
                    "this kernel's XFS has no quota support: the store gets no disk limits"
                );
                mount_store(None)
            }
            e => Err(e),
        })
        .map_err(|e| LoopStoreError::Mount {
            device: device.path().to_owned(),
            mountpoint: mountpoint.clone(),
            source: e.into(),
        })?;
    let mounted = MountGuard {
        mountpoint: &mountpoint,
        armed: true,
    };

    if !reflink::supports_reflink(&mountpoint).map_err(|source| LoopStoreError::Probe { source })? {
        return Err(LoopStoreError::NoReflinkAfterMount {
            mountpoint: mountpoint.clone(),
        });
    }

    mounted.disarm();
    let device_path = device.keep();
    if let Some(guard) = image_guard {
        guard.disarm();
    }
    Ok(LoopStore {
        mountpoint,
        image,
        loop_device: Some(device_path),
        newly_mounted: true,
    })
}

/// Tells whether `path` is the root of a mount (in this process's mount
/// namespace). A path that does not exist is not a mountpoint.
pub fn is_mountpoint(path: &Path) -> Result<bool, LoopStoreError> {
    let path = match fs::canonicalize(path) {
        Ok(p) => p,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(source) => {
            return Err(LoopStoreError::ResolvePath {
                path: path.to_owned(),
                source,
            })
        }
    };
    Ok(find_mount(&path)?.is_some())
}

/// The parts of a `/proc/self/mountinfo` line this module needs.
#[derive(Debug, PartialEq, Eq)]
struct MountEntry {
    mountpoint: PathBuf,
    fstype: String,
    source: PathBuf,
}

/// The topmost mount whose root is exactly `mountpoint` (already canonical).
fn find_mount(mountpoint: &Path) -> Result<Option<MountEntry>, LoopStoreError> {
    let table = fs::read_to_string("/proc/self/mountinfo")
        .map_err(|source| LoopStoreError::MountTable { source })?;
    // Later lines are mounted on top of earlier ones.
    Ok(table
        .lines()
        .filter_map(parse_mountinfo_line)
        .rfind(|m| m.mountpoint == mountpoint))
}

/// Parses `id parent major:minor root mountpoint options [optional...] - fstype
/// source superoptions`.
fn parse_mountinfo_line(line: &str) -> Option<MountEntry> {
    let (before, after) = line.split_once(" - ")?;
    let mountpoint = before.split(' ').nth(4)?;
    let mut after = after.split(' ');
    let fstype = after.next()?;
    let source = after.next()?;
    Some(MountEntry {
        mountpoint: PathBuf::from(unescape_mountinfo(mountpoint)),
        fstype: unescape_mountinfo(fstype).to_string_lossy().into_owned(),
        source: PathBuf::from(unescape_mountinfo(source)),
    })
}

/// Undoes the kernel's `\ooo` octal escaping of spaces, tabs, newlines and
/// backslashes in mountinfo fields.
fn unescape_mountinfo(field: &str) -> OsString {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|_| bytes[i] == b'\\')
            .and_then(|d| std::str::from_utf8(d).ok())
            .and_then(|d| u8::from_str_radix(d, 8).ok());
        match octal {
            Some(b) => {
                out.push(b);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    OsString::from_vec(out)
}

/// `source` if it is a loop device currently backed by `image`.
fn loop_device_backed_by(source: &Path, image: &Path) -> Option<PathBuf> {
    let name = source.file_name()?.to_str()?;
    if !source.starts_with("/dev") || !name.starts_with("loop") {
        return None;
    }
    (backing_file(name).as_deref() == Some(image)).then(|| source.to_owned())
}

/// The file bound to loop device `name` (e.g. `loop3`), if any.
fn backing_file(name: &str) -> Option<PathBuf> {
    let text = fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()?;
    Some(PathBuf::from(text.trim_end_matches('\n')))
}

/// The image's absolute path as sysfs reports it for a bound loop device: fully
/// resolved if it exists, else its resolved directory joined with its name.
fn absolute_image_path(image: &Path) -> Result<PathBuf, LoopStoreError> {
    if fs::symlink_metadata(image).is_ok() {
        return canonical(image);
    }
    let name = image
        .file_name()
        .ok_or_else(|| LoopStoreError::ResolvePath {
            path: image.to_owned(),
            source: io::Error::from(io::ErrorKind::InvalidInput),
        })?;
    let dir = match image.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    Ok(canonical(dir)?.join(name))
}

fn canonical(path: &Path) -> Result<PathBuf, LoopStoreError> {
    fs::canonicalize(path).map_err(|source| LoopStoreError::ResolvePath {
        path: path.to_owned(),
        source,
    })
}

/// Creates the image as a sparse file: it only takes space as XFS writes to it.
fn create_sparse_image(path: &Path, size: u64) -> Result<RemovalGuard, LoopStoreError> {
    let create_err = |source| LoopStoreError::CreateImage {
        path: path.to_owned(),
        source,
    };
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(create_err)?;
    let guard = RemovalGuard::file(path);
    file.set_len(size).map_err(create_err)?;
    Ok(guard)
}

fn holds_xfs(image: &Path) -> Result<bool, LoopStoreError> {
    let mut magic = [0u8; 4];
    let read = File::open(image).and_then(|mut f| f.read_exact(&mut magic));
    match read {
        Ok(()) => Ok(&magic == XFS_SUPERBLOCK_MAGIC),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(source) => Err(LoopStoreError::CreateImage {
            path: image.to_owned(),
            source,
        }),
    }
}

fn run_mkfs_xfs(image: &Path) -> Result<(), LoopStoreError> {
    let mkfs = find_program("mkfs.xfs").ok_or(LoopStoreError::MkfsMissing)?;
    let output = Command::new(mkfs)
        .args(["-q", "-m", "reflink=1"])
        .arg(image)
        .output()
        .map_err(|source| LoopStoreError::RunMkfs { source })?;
    if output.status.success() {
        Ok(())
    } else {
        Err(LoopStoreError::Mkfs {
            image: image.to_owned(),
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}

/// Finds an executable on `$PATH` or in the sbin directories, which a non-login
/// root shell or a test harness may leave off `$PATH`.
fn find_program(name: &str) -> Option<PathBuf> {
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path_var)
        .chain(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| {
            fs::metadata(candidate).is_ok_and(|m| m.is_file())
                && nix::unistd::access(candidate, nix::unistd::AccessFlags::X_OK).is_ok()
        })
}

/// A loop device bound to an image, unbound on drop unless kept.
struct AttachedLoop {
    device: File,
    path: PathBuf,
    armed: bool,
}

impl AttachedLoop {
    fn attach(image_file: &File, image: &Path) -> Result<Self, LoopStoreError> {
        let attach_err = |source| LoopStoreError::AttachLoop {
            image: image.to_owned(),
            source,
        };
        let control = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/loop-control")
            .map_err(attach_err)?;
        let image_fd = u32::try_from(image_file.as_raw_fd())
            .map_err(|_| attach_err(io::Error::from(io::ErrorKind::InvalidInput)))?;
        let mut last_error = io::Error::from(io::ErrorKind::ResourceBusy);
        for _ in 0..ATTACH_ATTEMPTS {
            // SAFETY: LOOP_CTL_GET_FREE takes no argument and reads no memory of
            // ours; `control` is open for the duration of the call.
            let number = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
            if number < 0 {
                return Err(attach_err(io::Error::last_os_error()));
            }
            let path = PathBuf::from(format!("/dev/loop{number}"));
            let device = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
                .map_err(attach_err)?;
            let config = LoopConfig {
                fd: image_fd,
                block_size: 0,
                info: loop_info(image),
                reserved: [0; 8],
            };
            // SAFETY: `config` is a fully initialised `struct loop_config` that
            // outlives the call; the kernel only reads it. Both descriptors are open.
            let ret = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CONFIGURE, &config) };
            if ret == 0 {
                return Ok(AttachedLoop {
                    device,
                    path,
                    armed: true,
                });
            }
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EBUSY) {
                return Err(attach_err(err));
            }
            // Another process bound this device between GET_FREE and CONFIGURE.
            last_error = err;
        }
        Err(attach_err(last_error))
    }

    fn path(&self) -> &Path {
        &self.path
    }

    /// Leaves the device bound (the mount now holds it; auto-clear unbinds it at
    /// unmount) and returns its path.
    fn keep(mut self) -> PathBuf {
        self.armed = false;
        std::mem::take(&mut self.path)
    }
}

impl Drop for AttachedLoop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // SAFETY: LOOP_CLR_FD takes no argument and reads no memory of ours; the
        // device descriptor is open.
        let ret = unsafe { libc::ioctl(self.device.as_raw_fd(), LOOP_CLR_FD) };
        if ret != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::ENXIO) {
                tracing::warn!(device = %self.path.display(), error = %err, "Cannot detach loop device");
            }
        }
    }
}

/// `struct loop_info64` for a read-write, auto-clearing binding of `image`.
fn loop_info(image: &Path) -> LoopInfo64 {
    let mut file_name = [0u8; LO_NAME_SIZE];
    // Informational only (the kernel reports the real path in sysfs); keep the
    // terminating NUL.
    let bytes = image.as_os_str().as_encoded_bytes();
    let len = bytes.len().min(LO_NAME_SIZE - 1);
    file_name[..len].copy_from_slice(&bytes[..len]);
    LoopInfo64 {
        lo_device: 0,
        lo_inode: 0,
        lo_rdevice: 0,
        lo_offset: 0,
        lo_sizelimit: 0,
        lo_number: 0,
        lo_encrypt_type: 0,
        lo_encrypt_key_size: 0,
        lo_flags: LO_FLAGS_AUTOCLEAR,
        lo_file_name: file_name,
        lo_crypt_name: [0; LO_NAME_SIZE],
        lo_encrypt_key: [0; LO_KEY_SIZE],
        lo_init: [0; 2],
    }
}

/// Unmounts on drop unless disarmed.
struct MountGuard<'a> {
    mountpoint: &'a Path,
    armed: bool,
}

impl MountGuard<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for MountGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = umount2(self.mountpoint, MntFlags::empty()) {
                tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e, "Cannot unmount");
            }
        }
    }
}

/// Unbinds a loop device; one already unbound (auto-clear got there first) is fine.
fn detach_loop(device: &Path) -> io::Result<()> {
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(device)
    {
        Ok(f) => f,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENXIO)) => return Ok(()),
        Err(e) => return Err(e),
    };
    // SAFETY: LOOP_CLR_FD takes no argument and reads no memory of ours; `file` is
    // open for the duration of the call.
    let ret = unsafe { libc::ioctl(file.as_raw_fd(), LOOP_CLR_FD) };
    if ret == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENXIO) {
        Ok(())
    } else {
        Err(err)
    }
}

/// Waits until `device` no longer holds `image` (the kernel unbinds auto-clearing
/// devices asynchronously after the last close).
fn wait_until_released(device: &Path, image: &Path) -> io::Result<()> {
    let name = device
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let deadline = Instant::now() + RELEASE_TIMEOUT;
    loop {
        if backing_file(name).as_deref() != Some(image) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "loop device still bound to the image",
            ));
        }
        thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reflink::{clone_file, filesystem_name, CloneMethod};

    const MIB: u64 = 1 << 20;

    /// Why this host cannot run the loop-mount tests, if it cannot.
    fn missing_capability() -> Option<String> {
        if !nix::unistd::geteuid().is_root() {
            return Some("loop mounts need root".into());
        }
        if find_program("mkfs.xfs").is_none() {
            return Some("mkfs.xfs not found (package xfsprogs)".into());
        }
        if !Path::new("/dev/loop-control").exists() {
            return Some("no /dev/loop-control".into());
        }
        None
    }

    /// Tears the store down if the test fails half-way.
    struct Teardown(Option<LoopStore>);

    impl Drop for Teardown {
        fn drop(&mut self) {
            if let Some(store) = self.0.take() {
                let _ = store.unmount_and_detach();
            }
        }
    }

    #[test]
    fn xfs_loop_store_reflinks_and_tears_down() {
        if let Some(reason) = missing_capability() {
            println!("skipped: {reason}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("store.img");
        let mnt = dir.path().join("mnt");

        let store = prepare_xfs_loop_store(&image, 512 * MIB, &mnt).unwrap();
        let mut teardown = Teardown(Some(store));
        let store = teardown.0.as_ref().unwrap();
        assert!(store.newly_mounted());
        assert!(is_mountpoint(&mnt).unwrap());
        assert_eq!(filesystem_name(&mnt).unwrap(), "xfs");
        let device = store.loop_device().unwrap().to_owned();
        let device_name = device.file_name().unwrap().to_str().unwrap().to_owned();
        assert_eq!(backing_file(&device_name).unwrap(), store.image());
        assert_eq!(fs::metadata(&image).unwrap().len(), 512 * MIB);

        // Idempotent: a second call finds the mount and reports the same device.
        let again = prepare_xfs_loop_store(&image, 512 * MIB, &mnt).unwrap();
        assert!(!again.newly_mounted());
        assert_eq!(again.loop_device(), Some(device.as_path()));

        let src = mnt.join("memory.img");
        let dst = mnt.join("memory-clone.img");
        let content: Vec<u8> = (0..8 * MIB).map(|i| (i % 253) as u8).collect();
        fs::write(&src, &content).unwrap();
        assert_eq!(clone_file(&src, &dst).unwrap(), CloneMethod::Reflink);
        assert_eq!(fs::read(&dst).unwrap(), content);
        {
            use std::os::unix::fs::FileExt;
            let f = OpenOptions::new().write(true).open(&dst).unwrap();
            f.write_all_at(b"written to the clone", 4096).unwrap();
        }
        assert_eq!(
            fs::read(&src).unwrap(),
            content,
            "clone write leaked into source"
        );
        assert_ne!(fs::read(&dst).unwrap(), content);

        teardown.0.take().unwrap().unmount_and_detach().unwrap();
        assert!(!is_mountpoint(&mnt).unwrap());
        assert_ne!(
            backing_file(&device_name).as_deref(),
            Some(canonical(&image).unwrap().as_path()),
            "loop device still bound"
        );

        // The image is reused with its data, not reformatted.
        let store = prepare_xfs_loop_store(&image, 512 * MIB, &mnt).unwrap();
        let teardown = Teardown(Some(store));
        assert!(teardown.0.as_ref().unwrap().newly_mounted());
        assert_eq!(fs::read(&src).unwrap(), content);
    }

    #[test]
    fn project_quotas_limit_a_tagged_directory_and_nothing_else() {
        if let Some(reason) = missing_capability() {
            println!("skipped: {reason}");
            return;
        }
        use crate::project_quota;
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("mnt");
        let store = prepare_xfs_loop_store(&dir.path().join("store.img"), 512 * MIB, &mnt).unwrap();
        let _teardown = Teardown(Some(store));
        if !project_quota::enforced(&mnt) {
            println!("skipped: this kernel's XFS enforces no project quotas (CONFIG_XFS_QUOTA)");
            return;
        }

        let limited = mnt.join("sandbox");
        fs::create_dir(&limited).unwrap();
        let project = 0x7000_1234;
        project_quota::tag_tree(&limited, project).unwrap();
        project_quota::set_limit(&mnt, project, 4 * MIB).unwrap();
        let write = |path: &Path, len: u64| -> io::Result<()> {
            let mut f = File::create(path)?;
            let chunk = vec![7u8; MIB as usize];
            for _ in 0..len / MIB {
                f.write_all(&chunk)?;
            }
            f.sync_all()
        };
        // Past the limit: ENOSPC, as for a full disk.
        let full = write(&limited.join("big"), 8 * MIB).unwrap_err();
        assert_eq!(full.raw_os_error(), Some(libc::ENOSPC), "{full}");
        // A directory made inside inherits the project, and the limit.
        fs::create_dir(limited.join("sub")).unwrap();
        assert!(write(&limited.join("sub/more"), 2 * MIB).is_err());
        // The rest of the filesystem is not limited.
        write(&mnt.join("free"), 8 * MIB).unwrap();
        let usage = project_quota::usage(&mnt, project).unwrap();
        assert!(usage.bytes <= 4 * MIB, "{usage:?}");
        assert_eq!(usage.limit_bytes, 4 * MIB);
        assert!(usage.files >= 3, "{usage:?}");
        // Lifted, the directory takes more.
        project_quota::set_limit(&mnt, project, 0).unwrap();
        write(&limited.join("sub/more"), 2 * MIB).unwrap();
    }

    #[test]
    fn refuses_non_reflink_mount_and_foreign_image() {
        if let Some(reason) = missing_capability() {
            println!("skipped: {reason}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).unwrap();
        mount(
            Some("tmpfs"),
            &mnt,
            Some("tmpfs"),
            MsFlags::empty(),
            Some("size=1m"),
        )
        .unwrap();
        let tmpfs = MountGuard {
            mountpoint: &mnt,
            armed: true,
        };
        let image = dir.path().join("a.img");
        let err = prepare_xfs_loop_store(&image, 512 * MIB, &mnt).unwrap_err();
        drop(tmpfs);
        assert!(
            matches!(&err, LoopStoreError::MountedWithoutReflink { filesystem, .. } if filesystem == "tmpfs"),
            "{err}"
        );
        assert!(
            !image.exists(),
            "image created for a failed prepare was left"
        );

        let foreign = dir.path().join("foreign.img");
        fs::write(&foreign, vec![0xffu8; 1 << 16]).unwrap();
        let err = prepare_xfs_loop_store(&foreign, 512 * MIB, &mnt).unwrap_err();
        assert!(matches!(err, LoopStoreError::NotXfsImage { .. }), "{err}");
        assert_eq!(fs::read(&foreign).unwrap(), vec![0xffu8; 1 << 16]);
        assert!(!is_mountpoint(&mnt).unwrap());
    }

    #[test]
    fn too_small_image_fails_in_mkfs_and_is_removed() {
        if let Some(reason) = missing_capability() {
            println!("skipped: {reason}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("tiny.img");
        let err = prepare_xfs_loop_store(&image, MIB, &dir.path().join("mnt")).unwrap_err();
        assert!(matches!(err, LoopStoreError::Mkfs { .. }), "{err}");
        assert!(!image.exists());
    }

    #[test]
    fn mountpoints_are_recognised() {
        assert!(is_mountpoint(Path::new("/")).unwrap());
        assert!(is_mountpoint(Path::new("/proc")).unwrap());
        let dir = tempfile::tempdir().unwrap();
        assert!(!is_mountpoint(dir.path()).unwrap());
        assert!(!is_mountpoint(&dir.path().join("missing")).unwrap());
    }

    #[test]
    fn mountinfo_lines_parse_with_escapes() {
        let line = "36 35 98:0 / /mnt/with\\040space rw,noatime master:1 - xfs /dev/loop3 rw,attr2";
        assert_eq!(
            parse_mountinfo_line(line),
            Some(MountEntry {
                mountpoint: PathBuf::from("/mnt/with space"),
                fstype: "xfs".into(),
                source: PathBuf::from("/dev/loop3"),
            })
        );
        assert_eq!(parse_mountinfo_line("garbage"), None);
        assert_eq!(unescape_mountinfo("a\\134b\\"), OsString::from("a\\b\\"));
    }

    #[test]
    fn missing_mkfs_error_names_the_package() {
        assert!(find_program("cube-no-such-program").is_none());
        assert!(LoopStoreError::MkfsMissing.to_string().contains("xfsprogs"));
    }

    #[test]
    fn loop_structs_match_the_kernel_abi() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }
}
