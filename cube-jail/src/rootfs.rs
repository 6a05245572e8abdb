//! The sandbox's root filesystem: a per-sandbox directory (the writable layer), the
//! template (the host's userland bound read-only, or template trees under an overlay),
//! fresh /proc, a minimal /dev, private /tmp, then `pivot_root`.
//!
//! The parent prepares everything that needs allocation: it creates the sandbox
//! directory and the mount points in it, and turns the mounts into a [`MountPlan`] of
//! ready-made C strings. The child, inside its new mount namespace, executes the plan
//! with raw system calls. For [`RootSpec::HostUserlandInMemory`] the mount points and
//! small files are steps of the plan too, made by the child on a tmpfs of its own: the
//! disk sees one empty directory. All mounts therefore exist only in the sandbox's mount
//! namespace (propagation is made private first) and vanish with its last process; the
//! host's mount table never sees them.

use std::ffi::{CStr, CString};
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;

use crate::capabilities::Identity;

/// Errors from preparing or removing a sandbox root.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    /// The sandbox directory exists already; each sandbox needs a fresh one.
    #[error("sandbox directory {0} already exists")]
    StateDirExists(PathBuf),
    /// A path is not absolute, or holds a character overlayfs options cannot carry
    /// (`,`, `:`, NUL) or that is not UTF-8.
    #[error("unusable path {0}")]
    InvalidPath(PathBuf),
    /// A template tree does not exist or is not a directory.
    #[error("template tree {0} is not a directory")]
    MissingTemplate(PathBuf),
    /// A file operation while preparing or removing the root failed.
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
    /// A read-only bind's target is not an absolute path of the writable layer: it is
    /// relative, `/`, has `..`, or lies in a mount of the root itself (/proc, /dev, /tmp,
    /// the host userland) where no mount point can be made.
    #[error("cannot bind onto {0} in the sandbox")]
    InvalidBindTarget(PathBuf),
    /// A read-only bind's source is not a regular file or directory on the host.
    #[error("bind source {0} is not a file or directory")]
    InvalidBindSource(PathBuf),
    /// A root kept in memory cannot start from a layer on disk.
    #[error("a root kept in memory cannot be seeded from a layer on disk")]
    SeedInMemory,
    /// A seeded layer could not be given to the sandbox's uid.
    #[error(transparent)]
    GiveLayer(#[from] crate::sandbox_uid::SandboxUidError),
    /// The sandbox directory could not be tagged with its disk project.
    #[error(transparent)]
    DiskProject(#[from] cube_storage::project_quota::ProjectQuotaError),
    /// A mount under the sandbox directory could not be detached.
    #[error("cannot unmount {path}")]
    Unmount {
        /// The mount point.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: Errno,
    },
}

type Result<T> = std::result::Result<T, RootfsError>;

/// What a sandbox's root filesystem is made of.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum RootSpec {
    /// The host's own userland, read-only: /usr (and the /bin, /lib... links or dirs next
    /// to it) and selected files of /etc, bound from the host; ready at once on a
    /// Debian-like host, with python3. Everything else (/, /home/user) lives in the
    /// sandbox directory.
    #[default]
    HostUserland,
    /// Like [`RootSpec::HostUserland`], but `/` is a tmpfs made inside the sandbox's own
    /// mount namespace: the set-up writes nothing to disk, nothing is left to delete,
    /// and what the sandbox writes (its home) lives in memory charged to its cgroup and
    /// goes with it. For sandboxes that keep nothing (`cube run`); such a root has no
    /// layer to snapshot.
    HostUserlandInMemory,
    /// Template trees under an overlayfs whose upper and work directories are in the
    /// sandbox directory: writes are copied up, the templates stay untouched. The first
    /// tree is the topmost.
    Overlay {
        /// Template trees, topmost first.
        lower: Vec<PathBuf>,
        /// Also bind the host userland read-only on top, as [`RootSpec::HostUserland`]
        /// does: for templates that carry data but no programs.
        host_userland: bool,
    },
}

/// Sizes and the disk project of a root: what [`crate::Limits`] ask of its filesystem.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RootLimits {
    /// Size of the tmpfs at /tmp and at /dev/shm, each; None: the kernel's default
    /// (half the host's memory).
    pub tmpfs_bytes: Option<u64>,
    /// Size of a root kept in memory ([`RootSpec::HostUserlandInMemory`]).
    pub root_bytes: Option<u64>,
    /// XFS project the sandbox directory and everything in it is tagged with, so that
    /// the project's quota limits it (see `cube_storage::project_quota`).
    pub project: Option<u32>,
}

/// A host file or directory shown read-only inside the sandbox: how a jail gets host
/// programs (such as the agent) that are not part of its root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadOnlyBind {
    /// The host path.
    pub source: PathBuf,
    /// Where it appears, an absolute path inside the sandbox.
    pub target: PathBuf,
}

/// Directories of /etc (or files) taken from the host by [`RootSpec::HostUserland`].
/// Secrets (shadow, gshadow, ssh, sudoers, machine-id) are deliberately absent.
pub const HOST_ETC_ENTRIES: &[&str] = &[
    "passwd",
    "group",
    "nsswitch.conf",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "alternatives",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "mime.types",
    "os-release",
    "debian_version",
    "lsb-release",
    "profile",
    "profile.d",
    "bash.bashrc",
    "environment",
    "shells",
    "inputrc",
    "protocols",
    "services",
    "networks",
    "host.conf",
    "gai.conf",
    "locale.alias",
    "python3",
    "python3.11",
    "magic",
    "magic.mime",
];

/// Top-level host directories bound read-only by [`RootSpec::HostUserland`]; on
/// merged-/usr hosts most are symlinks, which are copied as symlinks.
pub const HOST_TOP_DIRS: &[&str] = &["usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"];

/// The sandbox user's home and default working directory, inside the sandbox.
pub const HOME: &str = "/home/user";

/// Device nodes of the minimal /dev: name, major, minor.
const DEVICES: &[(&str, u32, u32)] = &[
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];

/// One step of the child's mount set-up.
#[derive(Debug)]
pub(crate) enum Step {
    Mount {
        source: Option<CString>,
        target: CString,
        fstype: Option<CString>,
        flags: libc::c_ulong,
        data: Option<CString>,
    },
    /// mkdir, then chmod (the umask must not narrow the mode).
    Mkdir {
        path: CString,
        mode: libc::mode_t,
    },
    /// A new regular file (never following a link) holding `content`.
    WriteFile {
        path: CString,
        content: Vec<u8>,
        mode: libc::mode_t,
    },
    Chown {
        path: CString,
        uid: libc::uid_t,
        gid: libc::gid_t,
    },
    Mknod {
        path: CString,
        mode: libc::mode_t,
        dev: libc::dev_t,
    },
    Symlink {
        target: CString,
        link: CString,
    },
}

/// The mounts and nodes the child creates, in order, and where it pivots to.
#[derive(Debug)]
pub struct MountPlan {
    steps: Vec<Step>,
    descriptions: Vec<String>,
    root: CString,
}

impl MountPlan {
    fn push(&mut self, step: Step, description: String) {
        self.steps.push(step);
        self.descriptions.push(description);
    }

    /// Number of steps.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// Whether the plan is empty (never for a prepared root).
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Human-readable description of step `index`, for error messages.
    pub fn describe(&self, index: usize) -> &str {
        self.descriptions
            .get(index)
            .map(String::as_str)
            .unwrap_or("unknown step")
    }

    fn mount(
        &mut self,
        source: Option<&Path>,
        target: &Path,
        fstype: Option<&str>,
        flags: libc::c_ulong,
        data: Option<&str>,
    ) -> Result<()> {
        let description = format!(
            "mount {} on {} ({})",
            source
                .map(|s| s.display().to_string())
                .unwrap_or_else(|| "-".into()),
            target.display(),
            fstype.unwrap_or("bind/remount")
        );
        let step = Step::Mount {
            source: source.map(cpath).transpose()?,
            target: cpath(target)?,
            fstype: fstype.map(cstr).transpose()?,
            flags,
            data: data.map(cstr).transpose()?,
        };
        self.push(step, description);
        Ok(())
    }

    fn bind_readonly(&mut self, source: &Path, target: &Path) -> Result<()> {
        self.mount(
            Some(source),
            target,
            None,
            libc::MS_BIND | libc::MS_REC,
            None,
        )?;
        self.mount(
            None,
            target,
            None,
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
            None,
        )
    }

    /// Executes the plan in the child (inside its own mount namespace), then makes the
    /// prepared root the process's `/` with `pivot_root` and detaches the old root.
    /// On failure returns the index of the failed step (`len()` for the pivot) and the
    /// error. Async-signal-safe.
    pub(crate) fn execute_in_child(&self) -> std::result::Result<(), (usize, Errno)> {
        for (i, step) in self.steps.iter().enumerate() {
            run_step(step).map_err(|e| (i, e))?;
        }
        pivot_in_child(&self.root).map_err(|e| (self.steps.len(), e))
    }
}

fn opt_ptr(s: &Option<CString>) -> *const libc::c_char {
    s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr())
}

fn check(r: libc::c_int) -> std::result::Result<(), Errno> {
    if r != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

fn run_step(step: &Step) -> std::result::Result<(), Errno> {
    match step {
        Step::Mount {
            source,
            target,
            fstype,
            flags,
            data,
        } => {
            // SAFETY: every pointer is null or a live NUL-terminated string of `step`.
            check(unsafe {
                libc::mount(
                    opt_ptr(source),
                    target.as_ptr(),
                    opt_ptr(fstype),
                    *flags,
                    opt_ptr(data).cast(),
                )
            })
        }
        Step::Mkdir { path, mode } => {
            // SAFETY: `path` is a live NUL-terminated string.
            check(unsafe { libc::mkdir(path.as_ptr(), *mode) })?;
            // SAFETY: as above.
            check(unsafe { libc::chmod(path.as_ptr(), *mode) })
        }
        Step::WriteFile {
            path,
            content,
            mode,
        } => {
            // SAFETY: `path` is a live NUL-terminated string.
            let fd = unsafe {
                libc::open(
                    path.as_ptr(),
                    libc::O_WRONLY
                        | libc::O_CREAT
                        | libc::O_EXCL
                        | libc::O_NOFOLLOW
                        | libc::O_CLOEXEC,
                    *mode,
                )
            };
            if fd < 0 {
                return Err(Errno::last());
            }
            let mut written = 0;
            let mut result = Ok(());
            while written < content.len() {
                // SAFETY: the pointer and length stay inside `content`.
                let n = unsafe {
                    libc::write(
                        fd,
                        content[written..].as_ptr().cast(),
                        content.len() - written,
                    )
                };
                if n < 0 {
                    if Errno::last() == Errno::EINTR {
                        continue;
                    }
                    result = Err(Errno::last());
                    break;
                }
                written += n as usize;
            }
            // SAFETY: `fd` is the descriptor opened above; fchmod and close touch no memory.
            unsafe {
                if result.is_ok() && libc::fchmod(fd, *mode) != 0 {
                    result = Err(Errno::last());
                }
                libc::close(fd);
            }
            result
        }
        Step::Chown { path, uid, gid } => {
            // SAFETY: `path` is a live NUL-terminated string.
            check(unsafe { libc::lchown(path.as_ptr(), *uid, *gid) })
        }
        Step::Mknod { path, mode, dev } => {
            // SAFETY: `path` is a live NUL-terminated string.
            check(unsafe { libc::mknod(path.as_ptr(), *mode, *dev) })
        }
        Step::Symlink { target, link } => {
            // SAFETY: both are live NUL-terminated strings.
            check(unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) })
        }
    }
}

fn pivot_in_child(root: &CStr) -> std::result::Result<(), Errno> {
    let dot = c".";
    // SAFETY: live NUL-terminated string.
    check(unsafe { libc::chdir(root.as_ptr()) })?;
    // pivot_root(".", ".") stacks the old root on top of the new one; detaching "."
    // then leaves only the new root, without needing a put_old directory.
    // SAFETY: live NUL-terminated strings.
    let r = unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) };
    if r != 0 {
        return Err(Errno::last());
    }
    // SAFETY: live NUL-terminated string.
    check(unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) })?;
    // SAFETY: live NUL-terminated string.
    check(unsafe { libc::chdir(c"/".as_ptr()) })
}

/// tmpfs mount options: `base`, and a size when one is given.
fn tmpfs_options(base: &str, bytes: Option<u64>) -> String {
    match bytes {
        Some(bytes) => format!("{base},size={bytes}"),
        None => base.to_string(),
    }
}

fn cpath(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| RootfsError::InvalidPath(p.to_path_buf()))
}

fn cstr(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| RootfsError::InvalidPath(PathBuf::from(s)))
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> RootfsError + 'a {
    move |source| RootfsError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// Paths of one sandbox's directory. Dropping it removes the directory (after detaching
/// any mount found under it); [`RootfsLayout::remove`] does the same and reports errors.
#[derive(Debug)]
pub struct RootfsLayout {
    state_dir: PathBuf,
    root: PathBuf,
    /// Where the sandbox's writes persist: the root itself, or the overlay's upper dir.
    layer: PathBuf,
    /// Where the layer came from, while a spawn seeded from it may still fail: removal
    /// then moves the layer back there instead of deleting the caller's files.
    seed: Option<PathBuf>,
    removed: bool,
}

impl RootfsLayout {
    /// The sandbox's own directory (writable layer, overlay work dir, root mount point).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The directory that becomes `/` inside the sandbox.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The writable layer: the directory that holds everything the sandbox wrote to its
    /// root and that outlives its processes (the root itself for
    /// [`RootSpec::HostUserland`], the overlay's upper directory otherwise). /tmp,
    /// /dev/shm and /proc are memory and are not in it.
    pub fn layer(&self) -> &Path {
        &self.layer
    }

    /// Moves the whole sandbox directory to `to` (same filesystem; `to` must not
    /// exist). Safe while the sandbox runs: its mounts were made from the paths before
    /// `pivot_root` and do not follow the host's names.
    pub fn relocate(&mut self, to: &Path) -> Result<()> {
        validate_path(to)?;
        fs::rename(&self.state_dir, to).map_err(io_err("move", &self.state_dir))?;
        let rebase = |p: &Path| match p.strip_prefix(&self.state_dir) {
            Ok(rest) => to.join(rest),
            Err(_) => p.to_path_buf(),
        };
        self.root = rebase(&self.root);
        self.layer = rebase(&self.layer);
        self.state_dir = to.to_path_buf();
        Ok(())
    }

    /// Detaches whatever is mounted under the sandbox directory (normally nothing: the
    /// mounts lived in the sandbox's namespace) and deletes the directory.
    pub fn remove(mut self) -> Result<()> {
        self.remove_inner()
    }

    /// The sandbox runs on its seeded layer: from now on the layer is the sandbox's and
    /// removal deletes it.
    pub fn seed_consumed(&mut self) {
        self.seed = None;
    }

    /// Like [`RootfsLayout::remove`], but first moves the writable layer to `keep`
    /// (same filesystem; `keep` must not exist), where a later sandbox can be seeded
    /// from it. Call only once the sandbox's processes are gone.
    pub fn remove_keeping_layer(mut self, keep: &Path) -> Result<()> {
        fs::rename(&self.layer, keep).map_err(io_err("move", &self.layer))?;
        self.remove_inner()
    }

    fn remove_inner(&mut self) -> Result<()> {
        if self.removed {
            return Ok(());
        }
        let mut mounts = mounts_under(&self.state_dir)?;
        if let Some(seed) = self.seed.take() {
            // A spawn that failed: the caller's layer goes back where it was.
            if let Err(e) = fs::rename(&self.layer, &seed) {
                tracing::warn!(error = %e, seed = %seed.display(), "cannot give a seed layer back");
            }
        }
        mounts.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
        for m in mounts {
            let c = cpath(&m)?;
            // SAFETY: live NUL-terminated string.
            if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
                return Err(RootfsError::Unmount {
                    path: m,
                    source: Errno::last(),
                });
            }
        }
        match fs::remove_dir_all(&self.state_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("remove", &self.state_dir)(e)),
        }
        self.removed = true;
        Ok(())
    }
}

impl Drop for RootfsLayout {
    fn drop(&mut self) {
        if let Err(e) = self.remove_inner() {
            tracing::warn!(error = %e, dir = %self.state_dir.display(), "leaving a sandbox directory behind");
        }
    }
}

impl RootfsLayout {
    /// Creates an empty sandbox directory `state_dir` (it must not exist) whose root
    /// directory is to be filled by the caller, e.g. with a checkpoint's writable layer.
    /// Like a prepared layout it is removed on drop.
    /// `spec` says where its writable layer will be (see [`RootfsLayout::layer`]).
    pub fn create_empty(state_dir: &Path, spec: &RootSpec) -> Result<RootfsLayout> {
        validate_path(state_dir)?;
        match fs::DirBuilder::new().mode(0o700).create(state_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(RootfsError::StateDirExists(state_dir.to_path_buf()))
            }
            Err(e) => return Err(io_err("create", state_dir)(e)),
        }
        let root = state_dir.join("root");
        let layer = match spec {
            RootSpec::HostUserland | RootSpec::HostUserlandInMemory => root.clone(),
            RootSpec::Overlay { .. } => state_dir.join("upper"),
        };
        Ok(RootfsLayout {
            state_dir: state_dir.to_path_buf(),
            root,
            layer,
            seed: None,
            removed: false,
        })
    }
}

/// Mount points in this process's mount namespace at or below `dir`.
pub fn mounts_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let info = Path::new("/proc/self/mountinfo");
    let text = fs::read_to_string(info).map_err(io_err("read", info))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(dir))
        .collect())
}

/// Creates the sandbox directory `state_dir` and everything the child needs in it, and
/// returns its layout with the plan the child executes.
pub fn prepare(
    state_dir: &Path,
    spec: &RootSpec,
    identity: Identity,
    hostname: &str,
    binds: &[ReadOnlyBind],
) -> Result<(RootfsLayout, MountPlan)> {
    prepare_seeded(
        state_dir,
        spec,
        identity,
        hostname,
        binds,
        None,
        RootLimits::default(),
    )
}

/// Like [`prepare`], but the writable layer starts as `seed` (a layer an earlier
/// sandbox left, see [`RootfsLayout::layer`]), which is moved into place: it must be on
/// the sandbox directory's filesystem. Mount points and files the set-up makes are
/// reused where the seed has them with the right type, and a seed whose entry has the
/// wrong type (a symlink where a directory belongs) is refused, never followed.
pub fn prepare_seeded(
    state_dir: &Path,
    spec: &RootSpec,
    identity: Identity,
    hostname: &str,
    binds: &[ReadOnlyBind],
    seed: Option<&Path>,
    limits: RootLimits,
) -> Result<(RootfsLayout, MountPlan)> {
    validate_path(state_dir)?;
    if let Some(seed) = seed {
        if *spec == RootSpec::HostUserlandInMemory {
            return Err(RootfsError::SeedInMemory);
        }
        match fs::symlink_metadata(seed) {
            Ok(m) if m.is_dir() => {}
            _ => return Err(RootfsError::MissingTemplate(seed.to_path_buf())),
        }
    }
    if let RootSpec::Overlay { lower, .. } = spec {
        if lower.is_empty() {
            return Err(RootfsError::MissingTemplate(PathBuf::new()));
        }
        for l in lower {
            validate_path(l)?;
            if !l.is_dir() {
                return Err(RootfsError::MissingTemplate(l.clone()));
            }
        }
    }
    match fs::DirBuilder::new().mode(0o700).create(state_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(RootfsError::StateDirExists(state_dir.to_path_buf()))
        }
        Err(e) => return Err(io_err("create", state_dir)(e)),
    }
    // From here on the layout owns the directory and removes it on error.
    let (root, layer) = match spec {
        RootSpec::HostUserland => (state_dir.join("root"), state_dir.join("root")),
        // The tmpfs is mounted on the (empty) sandbox directory itself.
        RootSpec::HostUserlandInMemory => (state_dir.to_path_buf(), state_dir.to_path_buf()),
        RootSpec::Overlay { .. } => (state_dir.join("root"), state_dir.join("upper")),
    };
    let layout = RootfsLayout {
        state_dir: state_dir.to_path_buf(),
        root: root.clone(),
        layer,
        seed: seed.map(Path::to_path_buf),
        removed: false,
    };
    match (seed, limits.project) {
        (Some(seed), project) => {
            // Into the directory before it is tagged: XFS refuses a rename into a
            // directory of another project (EXDEV).
            fs::rename(seed, &layout.layer).map_err(io_err("move", seed))?;
            // The layer's files belong to the sandbox that wrote them; this one runs
            // as another uid (see `sandbox_uid`).
            crate::sandbox_uid::give_tree(&layout.layer, identity)?;
            if let Some(project) = project {
                cube_storage::project_quota::tag_tree(state_dir, project)?;
            }
        }
        // Empty: whatever is made in it from now on takes its project.
        (None, Some(project)) => cube_storage::project_quota::tag_tree(state_dir, project)?,
        (None, None) => {}
    }
    let mut plan = MountPlan {
        steps: Vec::new(),
        descriptions: Vec::new(),
        root: cpath(&root)?,
    };
    let mut skeleton = match spec {
        RootSpec::HostUserlandInMemory => Skeleton::InChild,
        _ => {
            ensure_dir(&root, 0o755)?;
            Skeleton::OnDisk
        }
    };
    // Nothing the sandbox mounts may propagate back to the host.
    plan.mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )?;

    // `prep` is where mount points and files are made: the root itself, or the
    // overlay's upper directory, whose contents show through the merged root.
    let prep = match spec {
        RootSpec::HostUserland => {
            plan.mount(Some(&root), &root, None, libc::MS_BIND | libc::MS_REC, None)?;
            plan.mount(
                None,
                &root,
                None,
                libc::MS_REMOUNT | libc::MS_BIND | libc::MS_NOSUID | libc::MS_NODEV,
                None,
            )?;
            root.clone()
        }
        RootSpec::HostUserlandInMemory => {
            plan.mount(
                Some(Path::new("tmpfs")),
                &root,
                Some("tmpfs"),
                libc::MS_NOSUID | libc::MS_NODEV,
                Some(&tmpfs_options("mode=755", limits.root_bytes)),
            )?;
            root.clone()
        }
        RootSpec::Overlay { lower, .. } => {
            let upper = state_dir.join("upper");
            let work = state_dir.join("work");
            ensure_dir(&upper, 0o755)?;
            mkdir(&work, 0o700)?;
            let lowers: Vec<String> = lower.iter().map(|p| p.display().to_string()).collect();
            let data = format!(
                "lowerdir={},upperdir={},workdir={}",
                lowers.join(":"),
                upper.display(),
                work.display()
            );
            plan.mount(
                Some(Path::new("overlay")),
                &root,
                Some("overlay"),
                libc::MS_NOSUID | libc::MS_NODEV,
                Some(&data),
            )?;
            upper
        }
    };

    if matches!(
        spec,
        RootSpec::HostUserland
            | RootSpec::HostUserlandInMemory
            | RootSpec::Overlay {
                host_userland: true,
                ..
            }
    ) {
        add_host_userland(&mut plan, &mut skeleton, &prep, &root, hostname)?;
    }

    // Home of the sandbox user: the one place in / it may write.
    skeleton.dir(&mut plan, &prep.join("home"), 0o755)?;
    let home = prep.join(HOME.trim_start_matches('/'));
    skeleton.dir(&mut plan, &home, 0o700)?;
    skeleton.chown(&mut plan, &home, identity)?;

    // Fresh /proc of the sandbox's PID namespace, with the kernel knobs read-only.
    let proc_dir = root.join("proc");
    skeleton.mount_point_dir(&mut plan, &prep.join("proc"), 0o555)?;
    plan.mount(
        Some(Path::new("proc")),
        &proc_dir,
        Some("proc"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )?;
    for knob in ["sys", "sysrq-trigger"] {
        // Same kernel inside and out: what the host's /proc lacks, the sandbox's does too.
        if !Path::new("/proc").join(knob).exists() {
            continue;
        }
        let p = proc_dir.join(knob);
        plan.bind_readonly(&p, &p)?;
    }

    // Minimal /dev on its own tmpfs: a few character devices, private ptys, shm.
    let dev = root.join("dev");
    skeleton.mount_point_dir(&mut plan, &prep.join("dev"), 0o755)?;
    plan.mount(
        Some(Path::new("tmpfs")),
        &dev,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("mode=755,size=64k"),
    )?;
    for (name, major, minor) in DEVICES {
        let path = dev.join(name);
        plan.push(
            Step::Mknod {
                path: cpath(&path)?,
                mode: libc::S_IFCHR | 0o666,
                dev: libc::makedev(*major, *minor),
            },
            format!("mknod {}", path.display()),
        );
    }
    for (name, mode) in [("pts", 0o755), ("shm", 0o1777)] {
        let path = dev.join(name);
        plan.push(
            Step::Mkdir {
                path: cpath(&path)?,
                mode,
            },
            format!("mkdir {}", path.display()),
        );
    }
    plan.mount(
        Some(Path::new("devpts")),
        &dev.join("pts"),
        Some("devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    plan.mount(
        Some(Path::new("tmpfs")),
        &dev.join("shm"),
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        Some(&tmpfs_options("mode=1777", limits.tmpfs_bytes)),
    )?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let path = dev.join(link);
        plan.push(
            Step::Symlink {
                target: cstr(target)?,
                link: cpath(&path)?,
            },
            format!("symlink {}", path.display()),
        );
    }

    // Private /tmp; its pages are charged to the sandbox's memory cgroup, and its size
    // is bounded even where the host has no memory controller.
    skeleton.mount_point_dir(&mut plan, &prep.join("tmp"), 0o1777)?;
    plan.mount(
        Some(Path::new("tmpfs")),
        &root.join("tmp"),
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some(&tmpfs_options("mode=1777", limits.tmpfs_bytes)),
    )?;
    for bind in binds {
        add_bind(&mut plan, &mut skeleton, &prep, &root, bind)?;
    }
    Ok((layout, plan))
}

/// Where the directories, mount points and small files of a root are made.
enum Skeleton {
    /// On disk, by the parent, before the clone; what a seeded layer has already (with
    /// the right type) is reused, anything else in the way is replaced.
    OnDisk,
    /// By the child, as steps of the plan, in the fresh tmpfs of an in-memory root,
    /// where nothing exists yet.
    InChild,
}

impl Skeleton {
    fn dir(&mut self, plan: &mut MountPlan, path: &Path, mode: u32) -> Result<()> {
        match self {
            Skeleton::OnDisk => ensure_dir(path, mode),
            Skeleton::InChild => {
                plan.push(
                    Step::Mkdir {
                        path: cpath(path)?,
                        mode,
                    },
                    format!("mkdir {}", path.display()),
                );
                Ok(())
            }
        }
    }

    /// A directory something is mounted on: its mode does not matter once covered, so
    /// one a seeded layer has is left alone.
    fn mount_point_dir(&mut self, plan: &mut MountPlan, path: &Path, mode: u32) -> Result<()> {
        match self {
            Skeleton::OnDisk => mkdir_all(path, mode),
            Skeleton::InChild => self.dir(plan, path, mode),
        }
    }

    fn file(&mut self, plan: &mut MountPlan, path: &Path, content: &[u8], mode: u32) -> Result<()> {
        match self {
            Skeleton::OnDisk => ensure_file(path, content, mode),
            Skeleton::InChild => {
                plan.push(
                    Step::WriteFile {
                        path: cpath(path)?,
                        content: content.to_vec(),
                        mode,
                    },
                    format!("create {}", path.display()),
                );
                Ok(())
            }
        }
    }

    fn symlink(&mut self, plan: &mut MountPlan, dest: &Path, link: &Path) -> Result<()> {
        match self {
            Skeleton::OnDisk => {
                // A seeded layer has the link already; anything else there is replaced.
                if fs::read_link(link).is_ok_and(|have| have == dest) {
                    return Ok(());
                }
                if fs::symlink_metadata(link).is_ok() {
                    remove_entry(link)?;
                }
                std::os::unix::fs::symlink(dest, link).map_err(io_err("create symlink", link))
            }
            Skeleton::InChild => {
                plan.push(
                    Step::Symlink {
                        target: cpath(dest)?,
                        link: cpath(link)?,
                    },
                    format!("symlink {}", link.display()),
                );
                Ok(())
            }
        }
    }

    fn chown(&mut self, plan: &mut MountPlan, path: &Path, identity: Identity) -> Result<()> {
        match self {
            Skeleton::OnDisk => {
                std::os::unix::fs::lchown(path, Some(identity.uid), Some(identity.gid))
                    .map_err(io_err("chown", path))
            }
            Skeleton::InChild => {
                plan.push(
                    Step::Chown {
                        path: cpath(path)?,
                        uid: identity.uid,
                        gid: identity.gid,
                    },
                    format!("chown {}", path.display()),
                );
                Ok(())
            }
        }
    }

    /// What is at `path` already (None: nothing). A child-made skeleton has only what
    /// the plan made.
    fn existing(&self, plan: &MountPlan, path: &Path) -> Result<Option<Entry>> {
        match self {
            Skeleton::OnDisk => match fs::symlink_metadata(path) {
                Ok(m) if m.is_dir() => Ok(Some(Entry::Dir)),
                Ok(m) if m.is_file() => Ok(Some(Entry::File)),
                Ok(_) => Ok(Some(Entry::Other)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(io_err("inspect", path)(e)),
            },
            Skeleton::InChild => {
                let wanted = path.as_os_str().as_bytes();
                Ok(plan.steps.iter().rev().find_map(|step| match step {
                    Step::Mkdir { path, .. } if path.as_bytes() == wanted => Some(Entry::Dir),
                    Step::WriteFile { path, .. } if path.as_bytes() == wanted => Some(Entry::File),
                    Step::Mknod { path, .. } if path.as_bytes() == wanted => Some(Entry::Other),
                    Step::Symlink { link, .. } if link.as_bytes() == wanted => Some(Entry::Other),
                    _ => None,
                }))
            }
        }
    }
}

/// The kind of an entry a skeleton has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    Dir,
    File,
    /// A symlink, device node or anything else no mount point may be.
    Other,
}

/// Makes the mount point of `bind` in the writable layer (`prep`) and adds the bind to
/// the plan. A target inside a mount the plan already makes is refused: its mount
/// point would be hidden by that mount, or could not be created at all.
fn add_bind(
    plan: &mut MountPlan,
    skeleton: &mut Skeleton,
    prep: &Path,
    root: &Path,
    bind: &ReadOnlyBind,
) -> Result<()> {
    let bad_target = || RootfsError::InvalidBindTarget(bind.target.clone());
    let relative = bind.target.strip_prefix("/").map_err(|_| bad_target())?;
    let components: Vec<&std::ffi::OsStr> = relative
        .components()
        .map(|c| match c {
            std::path::Component::Normal(n) => Ok(n),
            _ => Err(bad_target()),
        })
        .collect::<Result<_>>()?;
    let Some((last, parents)) = components.split_last() else {
        return Err(bad_target());
    };
    let target = root.join(relative);
    for step in &plan.steps {
        if let Step::Mount { target: m, .. } = step {
            let m = Path::new(std::ffi::OsStr::from_bytes(m.as_bytes()));
            // The root's own mounts (and the host-wide `/` one) hold the writable layer.
            if m != root && m.starts_with(root) && target.starts_with(m) {
                return Err(bad_target());
            }
        }
    }
    let meta = fs::metadata(&bind.source)
        .map_err(|_| RootfsError::InvalidBindSource(bind.source.clone()))?;
    let mut dir = prep.to_path_buf();
    for part in parents {
        dir.push(part);
        match skeleton.existing(plan, &dir)? {
            Some(Entry::Dir) => {}
            // A symlink could lead the mount point out of the sandbox directory.
            Some(_) => return Err(bad_target()),
            None => skeleton.dir(plan, &dir, 0o755)?,
        }
    }
    let point = dir.join(last);
    let existing = skeleton.existing(plan, &point)?;
    // On disk the entry is (re)made either way, as a seeded layer's may have the wrong
    // mode; in the child only once.
    let make = existing.is_none() || matches!(skeleton, Skeleton::OnDisk);
    if meta.is_dir() {
        if existing.is_some_and(|e| e != Entry::Dir) {
            return Err(bad_target());
        }
        if make {
            skeleton.dir(plan, &point, 0o755)?;
        }
    } else if meta.is_file() {
        if existing.is_some_and(|e| e != Entry::File) {
            return Err(bad_target());
        }
        if make {
            skeleton.file(plan, &point, b"", 0o644)?;
        }
    } else {
        return Err(RootfsError::InvalidBindSource(bind.source.clone()));
    }
    plan.bind_readonly(&bind.source, &target)
}

fn add_host_userland(
    plan: &mut MountPlan,
    skeleton: &mut Skeleton,
    prep: &Path,
    root: &Path,
    hostname: &str,
) -> Result<()> {
    let host_root = Path::new("/");
    for name in HOST_TOP_DIRS {
        mirror_host_entry(
            plan,
            skeleton,
            &host_root.join(name),
            &prep.join(name),
            &root.join(name),
        )?;
    }
    let etc = prep.join("etc");
    skeleton.dir(plan, &etc, 0o755)?;
    for name in HOST_ETC_ENTRIES {
        mirror_host_entry(
            plan,
            skeleton,
            &Path::new("/etc").join(name),
            &etc.join(name),
            &root.join("etc").join(name),
        )?;
    }
    for (name, content) in [
        ("hostname", format!("{hostname}\n")),
        (
            "hosts",
            format!("127.0.0.1\tlocalhost {hostname}\n::1\tlocalhost\n"),
        ),
        ("resolv.conf", String::new()),
    ] {
        skeleton.file(plan, &etc.join(name), content.as_bytes(), 0o644)?;
    }
    Ok(())
}

/// Copies a host symlink as a symlink, or creates a mount point and a read-only bind of
/// a host file or directory. Entries the host lacks are skipped.
fn mirror_host_entry(
    plan: &mut MountPlan,
    skeleton: &mut Skeleton,
    host: &Path,
    prep: &Path,
    target: &Path,
) -> Result<()> {
    let meta = match fs::symlink_metadata(host) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err("inspect", host)(e)),
    };
    if meta.file_type().is_symlink() {
        let dest = fs::read_link(host).map_err(io_err("read link", host))?;
        return skeleton.symlink(plan, &dest, prep);
    }
    if meta.is_dir() {
        skeleton.dir(plan, prep, 0o755)?;
    } else if meta.is_file() {
        skeleton.file(plan, prep, b"", 0o644)?;
    } else {
        return Ok(());
    }
    plan.bind_readonly(host, target)
}

fn mkdir(path: &Path, mode: u32) -> Result<()> {
    fs::DirBuilder::new()
        .mode(mode)
        .create(path)
        .map_err(io_err("create", path))?;
    // The umask may have narrowed the mode (sticky /tmp, world-readable dirs).
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io_err("chmod", path))
}

fn mkdir_all(path: &Path, mode: u32) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => Ok(()),
        _ => mkdir(path, mode),
    }
}

/// A directory at `path` with `mode`: made, or (in a seeded layer) reused. Anything
/// else there, a symlink above all, is removed first so that nothing the sandbox
/// planted is followed.
fn ensure_dir(path: &Path, mode: u32) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .map_err(io_err("chmod", path)),
        Ok(_) => {
            remove_entry(path)?;
            mkdir(path, mode)
        }
        Err(_) => mkdir(path, mode),
    }
}

/// A regular file at `path` holding `content`, written without following a symlink
/// (one is replaced by a new file).
fn ensure_file(path: &Path, content: &[u8], mode: u32) -> Result<()> {
    if fs::symlink_metadata(path).is_ok_and(|m| !m.is_file()) {
        remove_entry(path)?;
    }
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io_err("create", path))?;
    io::Write::write_all(&mut f, content).map_err(io_err("write", path))?;
    f.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(io_err("chmod", path))
}

fn remove_entry(path: &Path) -> Result<()> {
    let is_dir = fs::symlink_metadata(path).is_ok_and(|m| m.is_dir());
    if is_dir {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    }
    .map_err(io_err("remove", path))
}

fn validate_path(p: &Path) -> Result<()> {
    let ok = p.is_absolute()
        && p.to_str()
            .is_some_and(|s| !s.contains([',', ':', '\0', '\n', ' ']));
    if !ok {
        return Err(RootfsError::InvalidPath(p.to_path_buf()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> Identity {
        Identity {
            uid: 65534,
            gid: 65534,
        }
    }

    #[test]
    fn prepares_and_removes_a_host_userland_root() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("sb");
        let (layout, plan) = prepare(&dir, &RootSpec::HostUserland, id(), "box", &[]).unwrap();
        assert!(plan.len() > 10);
        assert!(layout.root().join("home/user").is_dir());
        assert_eq!(
            fs::read_to_string(layout.root().join("etc/hostname")).unwrap(),
            "box\n"
        );
        assert!(!layout.root().join("etc/shadow").exists());
        assert!(plan.describe(0).contains("mount"));
        layout.remove().unwrap();
        assert!(!dir.exists());
    }

    #[test]
    fn an_in_memory_root_is_all_plan_and_no_disk() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("sb");
        let agent = ReadOnlyBind {
            source: PathBuf::from("/bin/sh"),
            target: PathBuf::from("/.cube/agent"),
        };
        let (layout, plan) = prepare(
            &dir,
            &RootSpec::HostUserlandInMemory,
            id(),
            "box",
            std::slice::from_ref(&agent),
        )
        .unwrap();
        // Only the (empty) mount point of the tmpfs is on disk.
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
        assert_eq!(layout.root(), dir);
        let described: Vec<&str> = (0..plan.len()).map(|i| plan.describe(i)).collect();
        let has = |what: &str| described.iter().any(|d| d.contains(what));
        assert!(
            has(&format!("on {} (tmpfs)", dir.display())),
            "{described:?}"
        );
        assert!(has("create ") && has("/etc/hostname"), "{described:?}");
        assert!(
            has("chown ") && has("mkdir ") && has("/.cube"),
            "{described:?}"
        );
        // The tmpfs comes first (after making / private), every step after it.
        assert!(described[1].contains("(tmpfs)"), "{described:?}");
        // A bind target whose parent the plan made as a file is refused.
        let bad = ReadOnlyBind {
            source: PathBuf::from("/bin/sh"),
            target: PathBuf::from("/etc/hostname/x"),
        };
        assert!(matches!(
            prepare(
                &tmp.path().join("sb2"),
                &RootSpec::HostUserlandInMemory,
                id(),
                "h",
                &[bad]
            ),
            Err(RootfsError::InvalidBindTarget(_))
        ));
        // Nothing on disk to seed it from.
        let seed = tmp.path().join("seed");
        fs::create_dir(&seed).unwrap();
        assert!(matches!(
            prepare_seeded(
                &tmp.path().join("sb3"),
                &RootSpec::HostUserlandInMemory,
                id(),
                "h",
                &[],
                Some(&seed),
                RootLimits::default(),
            ),
            Err(RootfsError::SeedInMemory)
        ));
        layout.remove().unwrap();
        assert!(!dir.exists());
    }

    #[test]
    fn refuses_an_existing_state_dir_and_bad_paths() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(matches!(
            prepare(tmp.path(), &RootSpec::HostUserland, id(), "h", &[]),
            Err(RootfsError::StateDirExists(_))
        ));
        assert!(matches!(
            prepare(
                Path::new("relative"),
                &RootSpec::HostUserland,
                id(),
                "h",
                &[]
            ),
            Err(RootfsError::InvalidPath(_))
        ));
        let spec = RootSpec::Overlay {
            lower: vec![tmp.path().join("missing")],
            host_userland: false,
        };
        assert!(matches!(
            prepare(&tmp.path().join("sb"), &spec, id(), "h", &[]),
            Err(RootfsError::MissingTemplate(_))
        ));
        assert!(!tmp.path().join("sb").exists());
    }

    #[test]
    fn overlay_root_prepares_upper_and_work() {
        let tmp = tempfile::tempdir().unwrap();
        let lower = tmp.path().join("tpl");
        fs::create_dir(&lower).unwrap();
        let dir = tmp.path().join("sb");
        let spec = RootSpec::Overlay {
            lower: vec![lower.clone()],
            host_userland: false,
        };
        let (layout, plan) = prepare(&dir, &spec, id(), "h", &[]).unwrap();
        assert!(dir.join("upper/home/user").is_dir());
        assert!(dir.join("work").is_dir());
        assert!((0..plan.len()).any(|i| plan.describe(i).contains("overlay")));
        drop(layout);
        assert!(!dir.exists(), "drop removes the sandbox directory");
    }

    #[test]
    fn read_only_binds_get_mount_points_and_bad_targets_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("prog");
        fs::write(&file, b"#!/bin/sh\n").unwrap();
        let bind = |target: &str| ReadOnlyBind {
            source: file.clone(),
            target: PathBuf::from(target),
        };
        let dir = tmp.path().join("sb");
        let (layout, plan) = prepare(
            &dir,
            &RootSpec::HostUserland,
            id(),
            "h",
            &[
                bind("/.cube/agent"),
                ReadOnlyBind {
                    source: tmp.path().to_path_buf(),
                    target: PathBuf::from("/opt/data"),
                },
            ],
        )
        .unwrap();
        assert!(layout.root().join(".cube/agent").is_file());
        assert!(layout.root().join("opt/data").is_dir());
        assert!((0..plan.len()).any(|i| plan.describe(i).contains("/.cube/agent")));
        drop(layout);
        for target in [
            "relative",
            "/",
            "/tmp/x",
            "/proc/x",
            "/usr/bin/x",
            "/a/../b",
            "/dev/x",
        ] {
            let r = prepare(&dir, &RootSpec::HostUserland, id(), "h", &[bind(target)]);
            assert!(
                matches!(r, Err(RootfsError::InvalidBindTarget(_))),
                "{target}: {r:?}"
            );
            assert!(!dir.exists(), "a refused bind leaves no sandbox directory");
        }
        let missing = ReadOnlyBind {
            source: tmp.path().join("missing"),
            target: PathBuf::from("/x"),
        };
        assert!(matches!(
            prepare(&dir, &RootSpec::HostUserland, id(), "h", &[missing]),
            Err(RootfsError::InvalidBindSource(_))
        ));
    }
}
