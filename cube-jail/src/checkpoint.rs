//! Full-process-state checkpoints of a jail through CRIU: [`dump`] writes a running
//! sandbox's processes (memory, registers, descriptors, namespaces, seccomp) and a copy
//! of its writable root layer into a directory; [`restore`] brings it back as a new
//! [`Jail`], under the same or another name, cgroup and sandbox directory (a clone).
//!
//! # The image directory
//! ```text
//! <image_dir>/cube-checkpoint.json   what restore needs besides CRIU's images; written
//!                                    last, so a directory without it is incomplete
//! <image_dir>/images/                CRIU's image files
//! <image_dir>/layer/                 the writable root layer, reflinked where possible
//! <image_dir>/tmpfs/<n>/             the contents of the sandbox's n-th tmpfs mount
//! <image_dir>/dump.log               CRIU's log of the dump
//! ```
//!
//! # How the jail's pieces map onto CRIU
//! - **Consistency**: the sandbox is frozen through its cgroup freezer, the layer is
//!   copied, then CRIU dumps with `--freeze-cgroup` (it finds the tasks frozen and leaves
//!   them so), and the sandbox is thawed: processes and files are from the same instant.
//! - **Root**: restore binds the new sandbox directory's root onto itself in a private
//!   mount namespace of its own (nothing reaches the host's mount table), `nosuid,nodev`
//!   as a spawned jail's root, and passes it as `--root`; CRIU rebuilds the sandbox's
//!   mount tree (fresh /proc, devpts, the tmpfs mounts Cube hands it) on it.
//! - **tmpfs mounts** (/dev, /dev/shm, /tmp): external to CRIU, their contents copied
//!   by Cube while frozen and restored into fresh tmpfs mounts (see `tmpfs_image.rs`).
//! - **Host binds** (the read-only host userland, [`crate::ReadOnlyBind`]s): dumped as
//!   external mounts `--external mnt[<mount point>]:<key>` and bound again from the
//!   host path at restore (the configuration's bind source when it names that target).
//! - **Descriptors from the host** (stdio, passed descriptors such as the agent's
//!   pipes): `--external file[mnt:ino]` at dump, and at restore the jail
//!   configuration's stdio and the caller's new descriptors go in with `--inherit-fd`.
//! - **cgroups**: Cube's, not CRIU's (`--manage-cgroups=ignore`): restore creates the
//!   target's cgroups with its limits and starts criu inside them and in a cgroup
//!   namespace rooted there, which the restored processes inherit (see
//!   `criu_launch.rs`).
//! - **Network namespace**: left out of the images as external (`--external
//!   net[<inode>]:cube-netns`; see [`NETNS_KEY`] for why that loses nothing), and
//!   restore hands CRIU a fresh one with loopback up (`--inherit-fd
//!   fd[<n>]:cube-netns`). No network lock (`--network-lock skip`): it guards TCP
//!   connections, which a sandbox's checkpoint never holds.
//! - **CRIU's start-up**: each run probes the kernel unless it finds its cache on a
//!   tmpfs `/run`; see `kdat_cache.rs` for hosts whose `/run` is none.
//! - **Process tree**: the jail's PID 1 leads its own session, so CRIU finds the whole
//!   tree inside the PID namespace; `--restore-detached --restore-sibling` make the
//!   restored PID 1 a child of the caller, which waits for and kills it like a spawned
//!   jail's.
//! - **Host descriptors must be pipes or files**: CRIU finds sockets through the dumped
//!   network namespace, and a socket the host made before the sandbox existed is not
//!   there, so [`dump`] refuses it up front.
//!
//! Both root kinds work. For [`crate::RootSpec::Overlay`] the layer is the overlay's
//! upper directory, and restore mounts a new overlay (the configuration's template
//! trees under the copied upper directory) as `--root`. Extended attributes are not
//! copied with the layer, so a directory that overlayfs marked opaque (deleted, then
//! made again in the sandbox) shows the template's entries again after a restore.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::capabilities::Identity;
use crate::cgroup::{CgroupError, CgroupLayout, Freezer, SandboxCgroup};
use crate::criu::{error_summary, Criu};
use crate::criu_launch::{CriuLaunch, LaunchError, RootMount};
use crate::disk_limit::{DiskLimit, DiskLimitError};
use crate::jail::{Jail, JailConfig, JailError, Stdio};
use crate::rootfs::{RootfsError, RootfsLayout};
use crate::sandbox_uid::UidLease;
use crate::tmpfs_image::{TmpfsError, TmpfsMount};

/// Name of the manifest file in an image directory.
pub const MANIFEST: &str = "cube-checkpoint.json";
/// Version of the manifest format this module writes and reads.
pub const FORMAT: u32 = 1;
const IMAGES: &str = "images";
/// The saved contents of the sandbox's tmpfs mounts, one directory per mount.
pub const TMPFS: &str = "tmpfs";
const LAYER: &str = "layer";
/// The overlay directories in a sandbox directory, as `rootfs::prepare` makes them.
const OVERLAY_UPPER: &str = "upper";
const OVERLAY_WORK: &str = "work";
const DUMP_LOG: &str = "dump.log";
/// Directory, in the restored sandbox's state directory, for CRIU's restore log.
const RESTORE_WORK: &str = "criu";
/// Largest manifest accepted: a real one is a few KiB.
const MAX_MANIFEST_BYTES: u64 = 1 << 20;
/// Descriptor numbers, in the criu process, where inherited descriptors are placed:
/// high enough to collide with nothing the launcher has open.
const INHERIT_BASE: RawFd = 900;
/// The manifest's name for the v2 hierarchy (CRIU's is the empty string).
const V2_NAME: &str = "unified";
/// CRIU's key for the sandbox's network namespace, dumped as external: the namespace
/// holds nothing the sandbox made (Cube brings loopback up, attaches and removes any
/// other device itself, and the sandbox has no capability to configure it), so instead
/// of CRIU saving and restoring its devices, addresses, routes and firewall tables
/// (nine `ip`/`iptables` processes per dump and per restore), restore is handed a
/// fresh namespace with loopback up. Its sockets are still found and saved.
const NETNS_KEY: &str = "cube-netns";
/// Filesystem types the sandbox mounts itself; every other non-root mount is a host
/// bind and becomes an external mount.
const SANDBOX_FS_TYPES: &[&str] = &["proc", "tmpfs", "devpts", "sysfs", "mqueue", "cgroup2"];

/// Errors from dumping and restoring jails.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The jail's PID 1 has exited or the jail was destroyed.
    #[error("the sandbox is not running")]
    NotRunning,
    /// The image directory exists already; a dump needs a fresh one.
    #[error("image directory {0} already exists")]
    ImageDirExists(PathBuf),
    /// A file operation failed.
    #[error("cannot {action} {path}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// On which path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The sandbox's root is of a kind checkpoints do not support.
    #[error("cannot checkpoint a sandbox whose root is {0}")]
    UnsupportedRoot(String),
    /// A descriptor of the sandbox's PID 1 that came from the host is of a kind that
    /// cannot be carried over.
    #[error("descriptor {fd} of the sandbox's PID 1 ({target}) cannot be checkpointed")]
    UnsupportedFd {
        /// The descriptor number.
        fd: RawFd,
        /// What it refers to.
        target: String,
    },
    /// The jail has no cgroup freezer, so processes and files cannot be taken at one
    /// instant while it keeps running.
    #[error("the sandbox has no cgroup freezer")]
    NoFreezer,
    /// Copying the writable layer failed.
    #[error("cannot copy the writable layer")]
    Layer(#[source] cube_storage::reflink::CloneError),
    /// Creating or controlling the sandbox's cgroups failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// Preparing the sandbox directory failed.
    #[error(transparent)]
    Rootfs(#[from] RootfsError),
    /// The jail configuration is invalid, or pausing/resuming the jail failed.
    #[error(transparent)]
    Jail(#[from] JailError),
    /// The restored sandbox's disk limit could not be set.
    #[error(transparent)]
    Disk(#[from] DiskLimitError),
    /// The criu process failed. Its log went with the partial image or sandbox
    /// directory; `reason` keeps its first error lines.
    #[error("criu {action} failed: {reason}")]
    Criu {
        /// "dump" or "restore".
        action: &'static str,
        /// The first error lines of criu's log.
        reason: String,
    },
    /// The directory holds no manifest: it is no checkpoint, or an incomplete one.
    #[error("{0} is not a complete checkpoint (no {MANIFEST})")]
    NotACheckpoint(PathBuf),
    /// The manifest is malformed or of another format version.
    #[error("malformed checkpoint manifest {path}: {reason}")]
    BadManifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The checkpointed PID 1 had descriptor N from the host and restore was given no
    /// replacement for it.
    #[error("restore needs a descriptor to install as fd {0}")]
    MissingFd(RawFd),
    /// A descriptor given to restore replaces nothing the checkpoint holds, or a number
    /// was given twice.
    #[error("the checkpoint has no host descriptor {0} to replace")]
    UnexpectedFd(RawFd),
    /// Two standard streams were one file at dump time but the configuration wants them
    /// different.
    #[error("fds {0} and {1} were one file at dump time; restore them alike")]
    ConflictingStdio(RawFd, RawFd),
    /// The criu process could not be run.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// Saving or restoring the contents of a tmpfs mount failed.
    #[error(transparent)]
    Tmpfs(#[from] TmpfsError),
    /// CRIU reported success without a readable PID file.
    #[error("criu wrote no valid PID file")]
    BadPidFile,
}

type Result<T> = std::result::Result<T, CheckpointError>;

fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> CheckpointError + 'a {
    move |source| CheckpointError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// How [`dump`] treats the sandbox.
#[derive(Clone, Debug, Default)]
pub struct DumpOptions {
    /// Keep the sandbox running after the dump (snapshot, clone source); otherwise CRIU
    /// kills its processes once they are written out (hibernate).
    pub leave_running: bool,
    /// Descriptor numbers of PID 1 that the host installed with
    /// [`Jail::spawn_with_fds`] (e.g. the agent's socket): their far ends are outside the
    /// sandbox, so [`restore`] takes new ones. Descriptors 0-2 are always treated so.
    pub passed_fds: Vec<RawFd>,
}

/// What a host descriptor of PID 1 was at dump time; its CRIU resource name is the key
/// `--inherit-fd` replaces.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum HostFd {
    /// A pipe; CRIU names it `pipe:[ino]`.
    Pipe { ino: u64 },
    /// A file on a mount the sandbox does not have (the host's /dev/null);
    /// `file[mnt_id:ino]`, both in hex.
    File { mnt_id: u64, ino: u64 },
}

impl HostFd {
    fn resource(&self) -> String {
        match self {
            HostFd::Pipe { ino } => format!("pipe:[{ino}]"),
            HostFd::File { mnt_id, ino } => format!("file[{mnt_id:x}:{ino:x}]"),
        }
    }
}

/// A host bind of the sandbox, restored as an external mount.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct ExternalMount {
    /// Mount point inside the sandbox.
    target: PathBuf,
    /// Where it came from on the host at dump time.
    source: PathBuf,
}

/// The manifest: what restore needs besides CRIU's images.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    criu_version: String,
    source_name: String,
    /// The root was an overlay whose upper directory is the layer.
    overlay: bool,
    mounts: Vec<ExternalMount>,
    /// Host descriptors of PID 1, by number.
    host_fds: BTreeMap<RawFd, HostFd>,
    /// The dumped sandbox's cgroup in each hierarchy, by the hierarchy's controllers
    /// (CRIU's controller names, comma separated; "unified" for v2).
    cgroups: BTreeMap<String, String>,
    /// The sandbox had a network namespace of its own, left out of the images (see
    /// [`NETNS_KEY`]): restore gives it a new one. False in checkpoints of builds
    /// that had CRIU dump the namespace, which CRIU then restores itself.
    #[serde(default)]
    external_netns: bool,
    /// The sandbox's tmpfs mounts, whose contents Cube saved in [`TMPFS`]`/<index>`
    /// (see `tmpfs_image.rs`). Empty in checkpoints of builds that had CRIU save them.
    #[serde(default)]
    tmpfs: Vec<TmpfsMount>,
    /// The uid and gid its processes run as (CRIU restores them so); absent in
    /// checkpoints written before sandboxes had uids of their own.
    #[serde(default)]
    identity: Option<(u32, u32)>,
    /// Length and CRC32 of each file of CRIU's images, by name, checked by
    /// [`Checkpoint::open`] before anything is restored: a truncated, damaged or
    /// swapped image is refused while the running sandbox is still there. Empty in
    /// checkpoints written before (then unchecked).
    #[serde(default)]
    images: BTreeMap<String, ImageDigest>,
    /// CRC32 of this manifest's compact JSON without this field, checked by
    /// [`Checkpoint::open`]: a flipped bit that still parses (a bind source, a mount
    /// target) is refused before the running sandbox goes, not by CRIU after. Absent
    /// in checkpoints written before (then unchecked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    digest: Option<u32>,
}

/// What a checkpoint's image file held when it was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct ImageDigest {
    len: u64,
    crc32: u32,
}

impl ImageDigest {
    fn of(path: &Path) -> Result<ImageDigest> {
        let mut file = File::open(path).map_err(io_err("open", path))?;
        let mut hasher = crc32fast::Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut len = 0u64;
        loop {
            let n = io::Read::read(&mut file, &mut buf).map_err(io_err("read", path))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            len += n as u64;
        }
        Ok(ImageDigest {
            len,
            crc32: hasher.finalize(),
        })
    }
}

/// The digests of the files in `images` (CRIU writes a flat directory).
fn image_digests(images: &Path) -> Result<BTreeMap<String, ImageDigest>> {
    let mut out = BTreeMap::new();
    for entry in fs::read_dir(images).map_err(io_err("list", images))? {
        let entry = entry.map_err(io_err("list", images))?;
        if !entry
            .file_type()
            .map_err(io_err("inspect", images))?
            .is_file()
        {
            continue;
        }
        let name = entry.file_name().to_string_lossy().into_owned();
        out.insert(name, ImageDigest::of(&entry.path())?);
    }
    Ok(out)
}

impl Manifest {
    /// CRC32 of the manifest's compact JSON, its own digest left out.
    fn compute_digest(&self) -> std::result::Result<u32, serde_json::Error> {
        let mut bare = self.clone();
        bare.digest = None;
        Ok(crc32fast::hash(&serde_json::to_vec(&bare)?))
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.format != FORMAT {
            return Err(format!(
                "format {} (this build reads {FORMAT})",
                self.format
            ));
        }
        for m in &self.mounts {
            for p in [&m.target, &m.source] {
                if !p.is_absolute() || p.as_os_str().as_bytes().contains(&0) {
                    return Err(format!("bad mount path {}", p.display()));
                }
            }
            // The key is the target; CRIU's `mnt[key]:path` syntax cannot carry these.
            if m.target
                .as_os_str()
                .as_bytes()
                .iter()
                .any(|b| b"[]:".contains(b))
            {
                return Err(format!("bad mount target {}", m.target.display()));
            }
        }
        for t in &self.tmpfs {
            t.validate()?;
            let target = t.target.as_os_str().as_bytes();
            if !t.target.is_absolute() || target.iter().any(|b| b"[]:\0".contains(b)) {
                return Err(format!("bad tmpfs target {}", t.target.display()));
            }
        }
        if let Some((uid, gid)) = self.identity {
            if uid == 0 || gid == 0 {
                return Err("the sandbox ran as root".into());
            }
        }
        for fd in self.host_fds.keys() {
            if !(0..=crate::jail::MAX_PASSED_FD).contains(fd) {
                return Err(format!("bad descriptor number {fd}"));
            }
        }
        for (ctrl, path) in &self.cgroups {
            if ctrl.is_empty()
                || !ctrl
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_,=".contains(&b))
                || !path.starts_with('/')
                || path.contains(['\0', '\n'])
            {
                return Err(format!("bad cgroup entry {ctrl}:{path}"));
            }
        }
        Ok(())
    }
}

/// A complete checkpoint on disk.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
    /// How long [`dump`] kept the sandbox frozen.
    paused: Option<Duration>,
}

impl Checkpoint {
    /// Each of the checkpoint's bind mounts as (target, host source): the source that
    /// `config` binds at that target (it may have moved), else the one recorded. A
    /// source that does not exist is an error; a caller that must not lose a running
    /// jail checks this before stopping it for [`restore`] (a damaged manifest can name
    /// a path that parses but is not there).
    pub fn mount_sources(&self, config: &JailConfig) -> Result<Vec<(PathBuf, PathBuf)>> {
        let mut out = Vec::with_capacity(self.manifest.mounts.len());
        for m in &self.manifest.mounts {
            let source = config
                .binds
                .iter()
                .find(|b| b.target == m.target)
                .map_or(&m.source, |b| &b.source);
            if fs::symlink_metadata(source).is_err() {
                return Err(CheckpointError::Io {
                    action: "find the bind source",
                    path: source.clone(),
                    source: io::ErrorKind::NotFound.into(),
                });
            }
            out.push((m.target.clone(), source.clone()));
        }
        Ok(out)
    }

    /// Opens the checkpoint in `dir`, rejecting a missing or malformed manifest.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let path = dir.join(MANIFEST);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(CheckpointError::NotACheckpoint(dir.to_path_buf()))
            }
            Err(e) => return Err(io_err("open", &path)(e)),
        };
        let bad = |reason: String| CheckpointError::BadManifest {
            path: path.clone(),
            reason,
        };
        let len = file.metadata().map_err(io_err("inspect", &path))?.len();
        if len > MAX_MANIFEST_BYTES {
            return Err(bad(format!("{len} bytes")));
        }
        let manifest: Manifest =
            serde_json::from_reader(io::BufReader::new(file)).map_err(|e| bad(e.to_string()))?;
        if let Some(want) = manifest.digest {
            let found = manifest.compute_digest().map_err(|e| bad(e.to_string()))?;
            if found != want {
                return Err(bad(format!(
                    "its digest is {found:#010x}, {want:#010x} was written: it was damaged"
                )));
            }
        }
        manifest.validate().map_err(bad)?;
        for part in [IMAGES, LAYER] {
            if !dir.join(part).is_dir() {
                return Err(bad(format!("{part}/ is missing")));
            }
        }
        let images = dir.join(IMAGES);
        for (name, want) in &manifest.images {
            if name.contains('/') || name == ".." {
                return Err(bad(format!("bad image name {name:?}")));
            }
            let path = images.join(name);
            let found = match ImageDigest::of(&path) {
                Ok(d) => d,
                Err(e) => return Err(bad(format!("image {name}: {e}"))),
            };
            if found.len != want.len {
                return Err(bad(format!(
                    "image {name} has {} bytes, {} were written",
                    found.len, want.len
                )));
            }
            if found.crc32 != want.crc32 {
                return Err(bad(format!(
                    "image {name} is damaged (CRC32 {:#010x}, {:#010x} written)",
                    found.crc32, want.crc32
                )));
            }
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            manifest,
            paused: None,
        })
    }

    /// The image directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How long the sandbox was frozen for the dump that wrote this checkpoint: from
    /// before its layer was copied until CRIU let its processes go. None for a
    /// checkpoint opened from disk.
    pub fn source_paused(&self) -> Option<Duration> {
        self.paused
    }

    /// Name of the sandbox that was dumped.
    pub fn source_name(&self) -> &str {
        &self.manifest.source_name
    }

    /// Descriptor numbers (besides stdio) that [`restore`] must be given.
    pub fn passed_fds(&self) -> Vec<RawFd> {
        self.manifest
            .host_fds
            .keys()
            .copied()
            .filter(|fd| *fd > 2)
            .collect()
    }
}

/// One line of a mountinfo file.
#[derive(Debug)]
struct MountEntry {
    id: u64,
    dev: String,
    root: PathBuf,
    mount_point: PathBuf,
    /// Per-mount options (`rw,nosuid,...`).
    mount_options: String,
    fs_type: String,
    /// The filesystem's options (`rw,size=64k,...`).
    fs_options: String,
}

/// Undoes mountinfo's octal escapes (`\040` for a space and so on).
fn unescape(field: &str) -> PathBuf {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            if let Ok(v) = u8::from_str_radix(&field[i + 1..i + 4], 8) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(out))
}

fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let f: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            Some(MountEntry {
                id: f.first()?.parse().ok()?,
                dev: (*f.get(2)?).to_owned(),
                root: unescape(f.get(3)?),
                mount_point: unescape(f.get(4)?),
                mount_options: f.get(5).copied().unwrap_or_default().to_owned(),
                fs_type: (*r.first()?).to_owned(),
                fs_options: r.get(2).copied().unwrap_or_default().to_owned(),
            })
        })
        .collect()
}

fn read_mountinfo(pid: i32) -> Result<Vec<MountEntry>> {
    let path = PathBuf::from(format!("/proc/{pid}/mountinfo"));
    let text = fs::read_to_string(&path).map_err(io_err("read", &path))?;
    Ok(parse_mountinfo(&text))
}

/// The host path a sandbox mount of `entry` shows: a host mount of the same device
/// whose root contains the entry's root, joined with the rest.
fn host_source(entry: &MountEntry, host: &[MountEntry]) -> Option<PathBuf> {
    host.iter()
        .filter(|h| h.dev == entry.dev && entry.root.starts_with(&h.root))
        .max_by_key(|h| h.root.as_os_str().len())
        .and_then(|h| {
            let rest = entry.root.strip_prefix(&h.root).ok()?;
            Some(if rest.as_os_str().is_empty() {
                h.mount_point.clone()
            } else {
                h.mount_point.join(rest)
            })
        })
}

/// CRIU's name for the controllers of the hierarchy holding `dir`.
fn criu_controller_name(layout: &CgroupLayout, dir: &Path) -> Option<String> {
    if let Some(v2) = &layout.v2 {
        if dir.starts_with(&v2.mount) {
            return Some(V2_NAME.to_owned());
        }
    }
    layout
        .v1
        .iter()
        .find(|h| dir.starts_with(&h.mount))
        .map(|h| h.controllers.join(","))
}

/// The sandbox's cgroup in each hierarchy, as CRIU names the controllers, relative to
/// the hierarchy root.
fn cgroup_roots(layout: &CgroupLayout, cgroup: &SandboxCgroup) -> BTreeMap<String, String> {
    let mut roots = BTreeMap::new();
    for dir in cgroup.dirs() {
        let mount = layout
            .v2
            .iter()
            .chain(layout.v1.iter())
            .find(|h| dir.starts_with(&h.mount))
            .map(|h| h.mount.clone());
        let (Some(name), Some(mount)) = (criu_controller_name(layout, dir), mount) else {
            continue;
        };
        if let Ok(rel) = dir.strip_prefix(&mount) {
            roots.insert(name, format!("/{}", rel.display()));
        }
    }
    roots
}

/// The inode of PID `pid`'s network namespace when it is not this process's.
fn own_network_namespace(pid: i32) -> Result<Option<u64>> {
    let theirs = PathBuf::from(format!("/proc/{pid}/ns/net"));
    let ours = Path::new("/proc/self/ns/net");
    let ino = |p: &Path| fs::metadata(p).map(|m| m.ino()).map_err(io_err("stat", p));
    let theirs_ino = ino(&theirs).map_err(|_| CheckpointError::NotRunning)?;
    Ok((theirs_ino != ino(ours)?).then_some(theirs_ino))
}

fn fdinfo_mnt_id(pid: i32, fd: RawFd) -> Result<u64> {
    let path = PathBuf::from(format!("/proc/{pid}/fdinfo/{fd}"));
    let text = fs::read_to_string(&path).map_err(io_err("read", &path))?;
    text.lines()
        .find_map(|l| l.strip_prefix("mnt_id:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| CheckpointError::Io {
            action: "find mnt_id in",
            path,
            source: io::ErrorKind::InvalidData.into(),
        })
}

fn bracketed_ino(link: &str, prefix: &str) -> Option<u64> {
    link.strip_prefix(prefix)?.strip_suffix(']')?.parse().ok()
}

/// Classifies PID 1's host descriptors (0-2 and `passed`); descriptors it no longer
/// has, or whose file lives on one of the sandbox's own mounts, need nothing.
fn host_fds(
    pid: i32,
    passed: &[RawFd],
    sandbox_mounts: &[MountEntry],
) -> Result<BTreeMap<RawFd, HostFd>> {
    let mut out = BTreeMap::new();
    let mut numbers: Vec<RawFd> = vec![0, 1, 2];
    numbers.extend(passed.iter().copied().filter(|fd| *fd > 2));
    numbers.sort_unstable();
    numbers.dedup();
    for fd in numbers {
        let link_path = PathBuf::from(format!("/proc/{pid}/fd/{fd}"));
        let link = match fs::read_link(&link_path) {
            Ok(l) => l,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err("read", &link_path)(e)),
        };
        let text = link.to_string_lossy();
        let host_fd = if let Some(ino) = bracketed_ino(&text, "pipe:[") {
            HostFd::Pipe { ino }
        } else if text.starts_with("socket:[") {
            // CRIU finds sockets through sock_diag of the dumped network namespace; one
            // made by the host before the sandbox existed is not there.
            return Err(CheckpointError::UnsupportedFd {
                fd,
                target: format!("{text}, a socket from outside the sandbox; pass pipes"),
            });
        } else if link.is_absolute() {
            let mnt_id = fdinfo_mnt_id(pid, fd)?;
            if sandbox_mounts.iter().any(|m| m.id == mnt_id) {
                continue;
            }
            // stat through the magic link reaches the open file itself.
            let ino = fs::metadata(&link_path)
                .map_err(io_err("stat", &link_path))?
                .ino();
            HostFd::File { mnt_id, ino }
        } else {
            return Err(CheckpointError::UnsupportedFd {
                fd,
                target: text.into_owned(),
            });
        };
        out.insert(fd, host_fd);
    }
    Ok(out)
}

/// Removes a partly written image directory unless disarmed.
struct DirGuard<'a>(Option<&'a Path>);

impl Drop for DirGuard<'_> {
    fn drop(&mut self) {
        if let Some(dir) = self.0 {
            if let Err(e) = fs::remove_dir_all(dir) {
                tracing::warn!(dir = %dir.display(), error = %e, "leaving a partial checkpoint");
            }
        }
    }
}

/// Writes the running `jail` into `image_dir` (created here; its parent must exist):
/// its processes through CRIU and a copy of its writable layer. With
/// [`DumpOptions::leave_running`] the sandbox goes on afterwards; otherwise its
/// processes are gone and the caller destroys the jail.
///
/// Command line (paths shortened):
/// `criu dump --tree <pid1> --images-dir <dir>/images --work-dir <dir> --log-file
/// dump.log --manage-cgroups --freeze-cgroup <freezer cgroup> --network-lock skip
/// --external net[<netns inode>]:cube-netns [--leave-running] --external
/// mnt[<target>]:<target>... --external file[<mnt_id>:<ino>]...`
pub fn dump(
    criu: &Criu,
    jail: &Jail,
    image_dir: &Path,
    options: &DumpOptions,
) -> Result<Checkpoint> {
    let (Some(cgroup), Some(root_dir)) = (jail.cgroup(), jail.root_dir()) else {
        return Err(CheckpointError::NotRunning);
    };
    let pid = jail.pid();
    let freezer = match cgroup.freezer() {
        Some(Freezer::V2(d)) | Some(Freezer::V1(d)) => d.clone(),
        None => return Err(CheckpointError::NoFreezer),
    };
    let sandbox_mounts = read_mountinfo(pid).map_err(|_| CheckpointError::NotRunning)?;
    let host_mounts = read_mountinfo(std::process::id() as i32)?;
    let root = sandbox_mounts
        .iter()
        .find(|m| m.mount_point == Path::new("/"))
        .ok_or(CheckpointError::NotRunning)?;
    if root.fs_type == "tmpfs" {
        // RootSpec::HostUserlandInMemory: there is no layer on disk to keep.
        return Err(CheckpointError::UnsupportedRoot("kept in memory".into()));
    }
    let overlay = root.fs_type == "overlay";
    // The writable layer: the root directory itself, or the overlay's upper directory.
    let layer = match (overlay, jail.state_dir()) {
        (false, _) => root_dir.to_path_buf(),
        (true, Some(state_dir)) => state_dir.join(OVERLAY_UPPER),
        (true, None) => return Err(CheckpointError::NotRunning),
    };
    // The tmpfs mounts besides the root (an in-memory root was refused above).
    let tmpfs_entries: Vec<&MountEntry> = sandbox_mounts
        .iter()
        .filter(|m| m.fs_type == "tmpfs" && m.mount_point != Path::new("/"))
        .collect();
    let tmpfs: Vec<TmpfsMount> = tmpfs_entries
        .iter()
        .map(|m| TmpfsMount::from_mountinfo(&m.mount_point, &m.mount_options, &m.fs_options))
        .collect();
    let mut mounts = Vec::new();
    for m in &sandbox_mounts {
        if m.mount_point == Path::new("/") || SANDBOX_FS_TYPES.contains(&m.fs_type.as_str()) {
            continue;
        }
        let source = host_source(m, &host_mounts).ok_or_else(|| {
            CheckpointError::UnsupportedRoot(format!(
                "a bind at {} from no host mount",
                m.mount_point.display()
            ))
        })?;
        mounts.push(ExternalMount {
            target: m.mount_point.clone(),
            source,
        });
    }
    let layout = CgroupLayout::detect()?;
    let host_fds = host_fds(pid, &options.passed_fds, &sandbox_mounts)?;
    let netns = own_network_namespace(pid)?;
    let mut manifest = Manifest {
        format: FORMAT,
        criu_version: criu.version().to_string(),
        source_name: jail.name().to_owned(),
        overlay,
        mounts,
        host_fds,
        cgroups: cgroup_roots(&layout, cgroup),
        external_netns: netns.is_some(),
        tmpfs,
        identity: Some((jail.identity().uid, jail.identity().gid)),
        // Filled in once CRIU has written them.
        images: BTreeMap::new(),
        digest: None,
    };
    manifest
        .validate()
        .map_err(CheckpointError::UnsupportedRoot)?;

    match fs::DirBuilder::new().mode(0o700).create(image_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(CheckpointError::ImageDirExists(image_dir.to_path_buf()))
        }
        Err(e) => return Err(io_err("create", image_dir)(e)),
    }
    let mut guard = DirGuard(Some(image_dir));
    let images = image_dir.join(IMAGES);
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&images)
        .map_err(io_err("create", &images))?;

    let mut args: Vec<std::ffi::OsString> = Vec::new();
    let mut arg = |a: &dyn AsRef<std::ffi::OsStr>| args.push(a.as_ref().to_owned());
    arg(&"dump");
    arg(&"--tree");
    arg(&pid.to_string());
    arg(&"--images-dir");
    arg(&images);
    arg(&"--work-dir");
    arg(&image_dir);
    arg(&"--log-file");
    arg(&DUMP_LOG);
    // Cube makes and fills the sandbox's cgroups itself (see criu_launch.rs).
    // An optional argument: one word with the option.
    arg(&"--manage-cgroups=ignore");
    arg(&"--freeze-cgroup");
    arg(&freezer);
    // CRIU's network lock keeps TCP peers from seeing a half-dumped connection; a
    // sandbox's established connections are refused anyway (no --tcp-established), and
    // the lock costs several iptables processes per dump and per restore.
    arg(&"--network-lock");
    arg(&"skip");
    if let Some(ino) = netns {
        arg(&"--external");
        arg(&format!("net[{ino}]:{NETNS_KEY}"));
    }
    // Their contents are Cube's to save; CRIU records the mounts only.
    for t in &manifest.tmpfs {
        let t = t.target.display();
        arg(&"--external");
        arg(&format!("mnt[{t}]:{t}"));
    }
    if options.leave_running {
        arg(&"--leave-running");
    }
    for m in &manifest.mounts {
        let t = m.target.display();
        arg(&"--external");
        arg(&format!("mnt[{t}]:{t}"));
    }
    for fd in manifest.host_fds.values() {
        match fd {
            HostFd::File { .. } => {
                arg(&"--external");
                arg(&fd.resource());
            }
            HostFd::Pipe { .. } => {}
        }
    }

    // The layer is reflinked while the sandbox is frozen, and a reflink first writes
    // the file's dirty pages out: written back now, while the sandbox still runs,
    // that leaves the freeze only what it wrote since (100 MiB just written: ~110 ms
    // frozen otherwise).
    write_back(&layer);
    // Frozen from before the layer copy until CRIU has the tasks: one instant for both.
    let start = Instant::now();
    jail.pause()?;
    let frozen = Instant::now();
    let mut copied = frozen;
    let dumped = fs::canonicalize(&layer)
        .map_err(io_err("resolve", &layer))
        .and_then(|root| {
            cube_storage::reflink::clone_tree(&root, &image_dir.join(LAYER))
                .map_err(CheckpointError::Layer)
        })
        .and_then(|_| save_tmpfs(pid, &manifest.tmpfs, &tmpfs_entries, image_dir))
        .and_then(|_| {
            copied = Instant::now();
            run_criu(
                "dump",
                CriuLaunch::new(criu, args.clone()),
                &image_dir.join(DUMP_LOG),
            )
        });
    // Thawed on every path: a failed dump must leave the sandbox as it was, and without
    // --leave-running the killed tasks of a v1 freezer only die once thawed.
    let dumped_at = Instant::now();
    let thawed = jail.resume();
    let paused = start.elapsed();
    tracing::debug!(
        freeze_ms = ms(frozen - start),
        layer_ms = ms(copied - frozen),
        criu_ms = ms(dumped_at - copied),
        thaw_ms = ms(dumped_at.elapsed()),
        paused_ms = ms(paused),
        "dump"
    );
    dumped?;
    if options.leave_running {
        thawed?;
    }

    manifest.images = image_digests(&images)?;
    let encode_error = |e: serde_json::Error| CheckpointError::Io {
        action: "encode",
        path: image_dir.join(MANIFEST),
        source: io::Error::other(e),
    };
    manifest.digest = Some(manifest.compute_digest().map_err(encode_error)?);
    let text = serde_json::to_vec_pretty(&manifest).map_err(encode_error)?;
    let tmp = image_dir.join(format!("{MANIFEST}.tmp"));
    fs::write(&tmp, text).map_err(io_err("write", &tmp))?;
    let path = image_dir.join(MANIFEST);
    fs::rename(&tmp, &path).map_err(io_err("rename", &tmp))?;
    guard.0 = None;
    Ok(Checkpoint {
        dir: image_dir.to_path_buf(),
        manifest,
        paused: Some(paused),
    })
}

/// Writes the dirty data of the layer `dir` to disk, its files only (not the whole
/// filesystem's, which held the previous snapshot's images still being flushed); best
/// effort: what it leaves is written by the reflink, inside the freeze.
fn write_back(dir: &Path) {
    match cube_storage::writeback::write_back_tree(dir) {
        Ok(stats) => tracing::debug!(
            files = stats.files,
            skipped = stats.skipped,
            "layer written back before a dump"
        ),
        Err(e) => tracing::debug!(error = %e, "writing the layer back before a dump"),
    }
}

/// Copies each tmpfs of process `pid` into `<image_dir>/tmpfs/<index>`.
fn save_tmpfs(
    pid: i32,
    tmpfs: &[TmpfsMount],
    entries: &[&MountEntry],
    image_dir: &Path,
) -> Result<()> {
    let dir = image_dir.join(TMPFS);
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(io_err("create", &dir))?;
    for (i, (t, entry)) in tmpfs.iter().zip(entries).enumerate() {
        t.save(pid, &entry.dev, &dir.join(i.to_string()))?;
    }
    Ok(())
}

/// Runs `launch` (criu `action`); a failure is reported with the first error lines
/// of criu's `log`.
fn run_criu(action: &'static str, launch: CriuLaunch<'_>, log: &Path) -> Result<()> {
    let finished = launch.run()?;
    if finished.success {
        return Ok(());
    }
    let text = fs::read_to_string(log).unwrap_or(finished.stderr);
    tracing::debug!(action, log = %text, "criu failed");
    Err(CheckpointError::Criu {
        action,
        reason: error_summary(&text),
    })
}

/// Milliseconds, for the step timings in the debug log.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A descriptor criu inherits, and the resource it stands for.
struct Inherited {
    fd: OwnedFd,
    resource: String,
}

/// Restores the checkpoint in `image_dir` as the sandbox `config` describes: its name,
/// state directory (created here; it must not exist), limits and stdio. The stdio
/// streams of the checkpointed PID 1 that led to the host are replaced according to
/// `config.stdin/stdout/stderr` (pipes come back through [`Jail::take_stdout`] and
/// friends), and each descriptor in [`Checkpoint::passed_fds`] by the caller's
/// `(fd, number)` in `fds`, as with [`Jail::spawn_with_fds`]. The same checkpoint can
/// be restored any number of times, under different names: clones.
///
/// The restored PID 1 is a child of the calling process. Command line (paths shortened):
/// `criu restore --images-dir <dir>/images --work-dir <state>/criu --log-file
/// restore.log --root <state>/root --restore-detached --restore-sibling
/// --pidfile <state>/criu/pid --manage-cgroups --cgroup-root <ctrl>:<new cgroup>...
/// (`:<new cgroup>` for the v2 hierarchy)
/// --external mnt[<target>]:<host path>... --inherit-fd fd[<n>]:<resource>...`
/// (a new network namespace among the inherited descriptors),
/// run in a private mount namespace where `<state>/root` is bound onto itself.
pub fn restore(
    criu: &Criu,
    image_dir: &Path,
    config: &JailConfig,
    fds: &[(BorrowedFd<'_>, RawFd)],
) -> Result<Jail> {
    let start = Instant::now();
    let checkpoint = Checkpoint::open(image_dir)?;
    let manifest = &checkpoint.manifest;
    config.validate()?;
    let lower = match (&config.root, manifest.overlay) {
        (crate::RootSpec::HostUserland, false) => None,
        (crate::RootSpec::Overlay { lower, .. }, true) => Some(lower),
        (crate::RootSpec::HostUserlandInMemory, _) => {
            return Err(CheckpointError::UnsupportedRoot("kept in memory".into()))
        }
        (_, true) => {
            return Err(CheckpointError::UnsupportedRoot(
                "not an overlay; the checkpoint's was".into(),
            ))
        }
        (_, false) => {
            return Err(CheckpointError::UnsupportedRoot(
                "an overlay; the checkpoint's was not".into(),
            ))
        }
    };
    let mut given: BTreeMap<RawFd, BorrowedFd<'_>> = BTreeMap::new();
    for (fd, number) in fds {
        if *number <= 2 || !manifest.host_fds.contains_key(number) || given.contains_key(number) {
            return Err(CheckpointError::UnexpectedFd(*number));
        }
        given.insert(*number, *fd);
    }

    // Descriptors for criu to inherit, one per resource; pipe parent ends for the jail.
    let mut inherited: Vec<Inherited> = Vec::new();
    let mut stdio_kind: BTreeMap<String, (RawFd, Stdio)> = BTreeMap::new();
    let mut parent_ends: [Option<File>; 3] = [None, None, None];
    for (&number, host_fd) in &manifest.host_fds {
        let resource = host_fd.resource();
        if number <= 2 {
            let spec = [config.stdin, config.stdout, config.stderr][number as usize];
            if let Some((first, kind)) = stdio_kind.get(&resource) {
                if *kind != spec || spec == Stdio::Pipe {
                    return Err(CheckpointError::ConflictingStdio(*first, number));
                }
                continue;
            }
            stdio_kind.insert(resource.clone(), (number, spec));
            let fd = match spec {
                Stdio::Null => OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open("/dev/null")
                    .map_err(io_err("open", Path::new("/dev/null")))?
                    .into(),
                // SAFETY: borrows this process's own standard stream for the clone.
                Stdio::Inherit => unsafe { BorrowedFd::borrow_raw(number) }
                    .try_clone_to_owned()
                    .map_err(io_err("duplicate", Path::new("/dev/stdin")))?,
                // SAFETY: the caller keeps `fd` open until restore returns
                // (`Stdio::Fd`'s contract); it is only duplicated here.
                Stdio::Fd(fd) => unsafe { BorrowedFd::borrow_raw(fd) }
                    .try_clone_to_owned()
                    .map_err(io_err("duplicate", Path::new("a given stream")))?,
                Stdio::Pipe => {
                    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| {
                        CheckpointError::Io {
                            action: "create a pipe for",
                            path: PathBuf::from(format!("fd {number}")),
                            source: e.into(),
                        }
                    })?;
                    let (child, parent) = if number == 0 { (r, w) } else { (w, r) };
                    parent_ends[number as usize] = Some(File::from(parent));
                    child
                }
            };
            inherited.push(Inherited { fd, resource });
        } else {
            let fd = given
                .get(&number)
                .ok_or(CheckpointError::MissingFd(number))?
                .try_clone_to_owned()
                .map_err(io_err("duplicate", Path::new("a passed descriptor")))?;
            inherited.push(Inherited { fd, resource });
        }
    }

    if manifest.external_netns {
        let fd = crate::namespaces::new_network_namespace()
            .map_err(|e| CheckpointError::Jail(JailError::Namespace(e)))?;
        inherited.push(Inherited {
            fd,
            resource: NETNS_KEY.to_owned(),
        });
    }

    let prepared = Instant::now();
    let layout = CgroupLayout::detect()?;
    let cgroup = SandboxCgroup::create(&layout, &config.name, &config.limits)?;
    let cgroups_made = Instant::now();
    let disk = config
        .limits
        .disk_bytes
        .map(|bytes| DiskLimit::lease(&config.state_dir, bytes))
        .transpose()?;
    let rootfs = RootfsLayout::create_empty(&config.state_dir, &config.root)?;
    let state_dir = rootfs.state_dir().to_path_buf();
    if let Some(disk) = &disk {
        // Tagged while empty: the layer copied in below takes the project.
        cube_storage::project_quota::tag_tree(&state_dir, disk.project())
            .map_err(RootfsError::from)?;
        disk.apply()?;
    }
    // The root directory becomes a mount point: a bind of itself, or the overlay.
    let root_mount: RootMount = match lower {
        None => {
            cube_storage::reflink::clone_tree(&image_dir.join(LAYER), rootfs.root())
                .map_err(CheckpointError::Layer)?;
            RootMount::Bind
        }
        Some(lower) => {
            let upper = state_dir.join(OVERLAY_UPPER);
            let work = state_dir.join(OVERLAY_WORK);
            cube_storage::reflink::clone_tree(&image_dir.join(LAYER), &upper)
                .map_err(CheckpointError::Layer)?;
            for (dir, mode) in [(&work, 0o700), (&rootfs.root().to_path_buf(), 0o755)] {
                fs::DirBuilder::new()
                    .mode(mode)
                    .create(dir)
                    .map_err(io_err("create", dir))?;
            }
            let mut paths = lower.clone();
            paths.push(upper.clone());
            paths.push(work.clone());
            for p in &paths {
                // overlayfs options cannot carry these.
                if !p.is_absolute() || p.to_str().is_none_or(|s| s.contains([',', ':', '\0'])) {
                    return Err(RootfsError::InvalidPath(p.clone()).into());
                }
            }
            let lowers: Vec<String> = lower.iter().map(|p| p.display().to_string()).collect();
            let data = format!(
                "lowerdir={},upperdir={},workdir={}",
                lowers.join(":"),
                upper.display(),
                work.display()
            );
            RootMount::Overlay(
                CString::new(data).map_err(|_| RootfsError::InvalidPath(upper.clone()))?,
            )
        }
    };
    let layer_copied = Instant::now();
    let work = state_dir.join(RESTORE_WORK);
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&work)
        .map_err(io_err("create", &work))?;
    let pidfile = work.join("pid");

    let mut args: Vec<std::ffi::OsString> = Vec::new();
    let mut arg = |a: &dyn AsRef<std::ffi::OsStr>| args.push(a.as_ref().to_owned());
    arg(&"restore");
    arg(&"--images-dir");
    arg(&image_dir.join(IMAGES));
    arg(&"--work-dir");
    arg(&work);
    arg(&"--log-file");
    arg(&"restore.log");
    arg(&"--root");
    arg(&rootfs.root());
    arg(&"--restore-detached");
    arg(&"--restore-sibling");
    arg(&"--pidfile");
    arg(&pidfile);
    // criu starts in the new cgroups, and what it restores inherits them.
    // An optional argument: one word with the option.
    arg(&"--manage-cgroups=ignore");
    for (target, source) in checkpoint.mount_sources(config)? {
        arg(&"--external");
        arg(&format!("mnt[{}]:{}", target.display(), source.display()));
    }
    // Each inherited descriptor sits above every target number in the parent, so the
    // child's dup2 calls never overwrite a source.
    let mut sources: Vec<(OwnedFd, RawFd)> = Vec::new();
    for (i, inh) in inherited.iter().enumerate() {
        let target = INHERIT_BASE + i as RawFd;
        let floor = INHERIT_BASE + inherited.len() as RawFd;
        // SAFETY: F_DUPFD_CLOEXEC only creates a new descriptor.
        let high = unsafe { libc::fcntl(inh.fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, floor) };
        if high < 0 {
            return Err(io_err("duplicate", Path::new("an inherited descriptor"))(
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: `high` was just created and nothing else owns it.
        sources.push((unsafe { OwnedFd::from_raw_fd(high) }, target));
        arg(&"--inherit-fd");
        arg(&format!("fd[{target}]:{}", inh.resource));
    }
    let root_c = CString::new(rootfs.root().as_os_str().as_bytes())
        .map_err(|_| RootfsError::InvalidPath(rootfs.root().to_path_buf()))?;
    // Fresh tmpfs mounts, filled from the saved trees, attached in criu's mount
    // namespace where CRIU binds the external mounts from.
    let mut tmpfs_mounts = Vec::with_capacity(manifest.tmpfs.len());
    for (i, t) in manifest.tmpfs.iter().enumerate() {
        let mount = t.restore(&image_dir.join(TMPFS).join(i.to_string()))?;
        let at = work.join(format!("tmpfs-{i}"));
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&at)
            .map_err(io_err("create", &at))?;
        args.push("--external".into());
        args.push(format!("mnt[{}]:{}", t.target.display(), at.display()).into());
        let at = CString::new(at.as_os_str().as_bytes())
            .map_err(|_| RootfsError::InvalidPath(at.clone()))?;
        tmpfs_mounts.push((mount, at));
    }
    let mut launch = CriuLaunch::new(criu, args);
    for (source, target) in &sources {
        launch.inherit(source.as_raw_fd(), *target);
    }
    for (mount, at) in &tmpfs_mounts {
        launch.attach(mount.as_raw_fd(), at.clone());
    }
    launch.root(root_c, root_mount);
    launch.in_cgroup(&cgroup);

    let criu_start = Instant::now();
    let restored = run_criu("restore", launch, &work.join("restore.log"));
    drop(sources);
    drop(inherited);
    tracing::debug!(
        prepare_ms = ms(prepared - start),
        cgroups_ms = ms(cgroups_made - prepared),
        layer_ms = ms(layer_copied - cgroups_made),
        criu_ms = ms(criu_start.elapsed()),
        "restore"
    );
    restored?;
    let pid: libc::pid_t = fs::read_to_string(&pidfile)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|p| *p > 0)
        .ok_or(CheckpointError::BadPidFile)?;
    tracing::debug!(name = %config.name, pid, from = %manifest.source_name, "sandbox restored");
    let identity = manifest
        .identity
        .map_or(crate::jail::DEFAULT_IDENTITY, |(uid, gid)| Identity {
            uid,
            gid,
        });
    // Held by the source when this is a clone of a running sandbox: the two share it.
    let lease = UidLease::claim(identity.uid).unwrap_or_else(|e| {
        tracing::warn!(uid = identity.uid, error = %e, "cannot lease the restored sandbox's uid");
        None
    });
    let mut jail = Jail::from_restored(
        config.name.clone(),
        pid,
        cgroup,
        rootfs,
        parent_ends,
        identity,
        lease,
    );
    if let Some(disk) = disk {
        jail.hold_disk_limit(disk);
    }
    Ok(jail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mountinfo_and_finds_host_sources() {
        let sandbox = parse_mountinfo(
            "100 90 8:1 /srv/sb/root / rw,nosuid - ext4 /dev/sda1 rw\n\
             101 100 8:1 /usr /usr ro,nosuid - ext4 /dev/sda1 rw\n\
             102 100 0:50 / /proc rw - proc proc rw\n\
             103 100 8:1 /opt/my\\040dir/agent /.cube/agent ro - ext4 /dev/sda1 rw\n",
        );
        assert_eq!(sandbox.len(), 4);
        assert_eq!(sandbox[3].mount_point, Path::new("/.cube/agent"));
        assert_eq!(sandbox[3].root, Path::new("/opt/my dir/agent"));
        let host = parse_mountinfo(
            "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n\
             2 1 8:1 /opt /mnt/opt rw - ext4 /dev/sda1 rw\n",
        );
        assert_eq!(host_source(&sandbox[1], &host).unwrap(), Path::new("/usr"));
        assert_eq!(
            host_source(&sandbox[3], &host).unwrap(),
            Path::new("/mnt/opt/my dir/agent")
        );
        assert!(host_source(&sandbox[2], &host).is_none());
    }

    #[test]
    fn resources_use_criu_names() {
        assert_eq!(HostFd::Pipe { ino: 12 }.resource(), "pipe:[12]");
        assert_eq!(
            HostFd::File {
                mnt_id: 26,
                ino: 255
            }
            .resource(),
            "file[1a:ff]"
        );
    }

    fn manifest() -> Manifest {
        Manifest {
            format: FORMAT,
            criu_version: "4.1.1".into(),
            source_name: "a".into(),
            overlay: false,
            mounts: vec![ExternalMount {
                target: "/usr".into(),
                source: "/usr".into(),
            }],
            host_fds: BTreeMap::from([(3, HostFd::Pipe { ino: 5 })]),
            cgroups: BTreeMap::from([("pids".into(), "/cube/a".into())]),
            external_netns: true,
            tmpfs: vec![TmpfsMount::from_mountinfo(
                Path::new("/tmp"),
                "rw,nosuid,nodev",
                "rw,mode=1777",
            )],
            identity: Some((0x7000_0001, 0x7000_0001)),
            images: BTreeMap::new(),
            digest: None,
        }
    }

    #[test]
    fn a_manifest_whose_digest_does_not_match_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir(tmp.path().join(IMAGES)).unwrap();
        fs::create_dir(tmp.path().join(LAYER)).unwrap();
        let mut m = manifest();
        m.digest = Some(m.compute_digest().unwrap());
        let text = serde_json::to_string_pretty(&m).unwrap();
        fs::write(tmp.path().join(MANIFEST), &text).unwrap();
        Checkpoint::open(tmp.path()).unwrap();
        // One letter of a bind source changed: still valid JSON and a valid manifest
        // (the damage CI's snapshot_damage made: a restore then failed in CRIU).
        let damaged = text.replacen("\"/usr\"", "\"/usq\"", 1);
        assert_ne!(damaged, text);
        fs::write(tmp.path().join(MANIFEST), damaged).unwrap();
        match Checkpoint::open(tmp.path()) {
            Err(CheckpointError::BadManifest { reason, .. }) => {
                assert!(reason.contains("digest"), "{reason}")
            }
            other => panic!("a damaged manifest was taken: {other:?}"),
        }
    }

    #[test]
    fn manifest_round_trips_and_bad_ones_are_refused() {
        let m = manifest();
        let text = serde_json::to_string(&m).unwrap();
        let back: Manifest = serde_json::from_str(&text).unwrap();
        assert_eq!(back, m);
        assert!(m.validate().is_ok());
        let mut bad = manifest();
        bad.format = 99;
        assert!(bad.validate().is_err());
        let mut bad = manifest();
        bad.mounts[0].target = "/a:b".into();
        assert!(bad.validate().is_err());
        let mut bad = manifest();
        bad.host_fds.insert(-1, HostFd::Pipe { ino: 1 });
        assert!(bad.validate().is_err());
        let mut bad = manifest();
        bad.cgroups.insert("pids".into(), "relative".into());
        assert!(bad.validate().is_err());
        let mut bad = manifest();
        bad.tmpfs[0].target = "/t[mp]".into();
        assert!(bad.validate().is_err());
        let mut bad = manifest();
        bad.tmpfs[0].options = "size=1m,x y".into();
        assert!(bad.validate().is_err());
    }

    #[test]
    fn manifests_of_earlier_builds_still_load() {
        // Before the network namespace was external and tmpfs contents Cube's,
        // manifests had no such fields.
        let mut old = serde_json::to_value(manifest()).unwrap();
        old.as_object_mut().unwrap().remove("external_netns");
        old.as_object_mut().unwrap().remove("tmpfs");
        let back: Manifest = serde_json::from_value(old).unwrap();
        assert!(!back.external_netns);
        assert!(back.tmpfs.is_empty());
        assert!(back.validate().is_ok());
    }

    #[test]
    fn open_rejects_missing_and_malformed_manifests() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(matches!(
            Checkpoint::open(tmp.path()),
            Err(CheckpointError::NotACheckpoint(_))
        ));
        fs::write(tmp.path().join(MANIFEST), b"{ not json").unwrap();
        assert!(matches!(
            Checkpoint::open(tmp.path()),
            Err(CheckpointError::BadManifest { .. })
        ));
        fs::write(
            tmp.path().join(MANIFEST),
            serde_json::to_vec(&manifest()).unwrap(),
        )
        .unwrap();
        // A valid manifest without the images is still refused.
        assert!(matches!(
            Checkpoint::open(tmp.path()),
            Err(CheckpointError::BadManifest { .. })
        ));
        fs::create_dir(tmp.path().join(IMAGES)).unwrap();
        fs::create_dir(tmp.path().join(LAYER)).unwrap();
        let c = Checkpoint::open(tmp.path()).unwrap();
        assert_eq!(c.passed_fds(), vec![3]);
        assert_eq!(c.source_name(), "a");
    }

    #[test]
    fn open_refuses_truncated_damaged_and_swapped_images() {
        let tmp = tempfile::tempdir().unwrap();
        let images = tmp.path().join(IMAGES);
        fs::create_dir(&images).unwrap();
        fs::create_dir(tmp.path().join(LAYER)).unwrap();
        fs::write(images.join("pages-1.img"), b"page bytes of one moment").unwrap();
        fs::write(images.join("core-1.img"), b"registers").unwrap();
        let mut m = manifest();
        m.images = image_digests(&images).unwrap();
        assert_eq!(m.images.len(), 2);
        fs::write(tmp.path().join(MANIFEST), serde_json::to_vec(&m).unwrap()).unwrap();
        Checkpoint::open(tmp.path()).unwrap();
        let refused = |why: &str| match Checkpoint::open(tmp.path()) {
            Err(CheckpointError::BadManifest { reason, .. }) => {
                assert!(reason.contains(why), "{reason}")
            }
            other => panic!("a {why} image was accepted: {other:?}"),
        };
        let page = images.join("pages-1.img");
        fs::write(&page, b"page bytes of one").unwrap();
        refused("bytes");
        fs::write(&page, b"page bytes of one momenT").unwrap();
        refused("damaged");
        // Another checkpoint's image of the same length.
        fs::write(&page, b"page bytes of another mo").unwrap();
        refused("damaged");
        fs::remove_file(&page).unwrap();
        refused("pages-1.img");
        fs::write(&page, b"page bytes of one moment").unwrap();
        Checkpoint::open(tmp.path()).unwrap();
    }
}
