//! The on-disk store: one root directory holding templates, snapshots and sandboxes.
//!
//! ```text
//! root/
//!   templates/<name>/   snapshots/<id>/   sandboxes/<id>/
//!   tmp/                staging and removal scratch, same filesystem as the rest
//! ```
//!
//! Entries appear and disappear atomically: a new entry is built in `tmp/` and
//! renamed into place ([`StagingDir::commit`]), a removed one is renamed into `tmp/`
//! before it is deleted. A crash therefore leaves either a whole entry or debris in
//! `tmp/`, which [`Store::clean_stale_staging`] clears on the next start.

use std::ffi::OsString;
use std::fs::{self, DirBuilder, File};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use nix::errno::Errno;
use nix::fcntl::{renameat2, RenameFlags, AT_FDCWD};

use crate::layout::{SandboxDir, SnapshotDir, TemplateDir};
use crate::random_id::random_hex;
use crate::reflink::{self, CloneError};
use crate::supervisor_group;

/// Longest name or id accepted, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// Length of the random part of ids made by [`Store::new_id`], in hex digits.
const ID_RANDOM_HEX_LEN: usize = 16;

/// Errors from the on-disk store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No store location could be derived: none of `CUBE_HOME`, `XDG_DATA_HOME` and
    /// `HOME` is set.
    #[error("Cannot locate the Cube store: set CUBE_HOME or HOME")]
    NoHome,
    /// A store directory could not be created or inspected.
    #[error("Cannot create store directory {path}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A store path exists but is not a directory (symlinks are refused too).
    #[error("Store path {path} is not a directory")]
    NotADirectory {
        /// The path.
        path: PathBuf,
    },
    /// A template name, snapshot id, sandbox id or id prefix has the wrong form.
    #[error("Invalid {what} {name:?}: use 1 to 64 of A-Z a-z 0-9 . _ - and do not start with '.'")]
    InvalidName {
        /// What the name was for.
        what: &'static str,
        /// The name given.
        name: String,
    },
    /// The kernel's random generator could not be read.
    #[error("Cannot read random bytes")]
    Random {
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A store directory could not be listed.
    #[error("Cannot list {path}")]
    List {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The store lies so deep that a sandbox's sockets would not fit a unix socket
    /// address (108 bytes with its terminating zero).
    #[error(
        "Store path too long: {path} is {len} bytes, and unix socket paths allow {max}; \
         use a store (CUBE_HOME) with a shorter path"
    )]
    SocketPathTooLong {
        /// The longest socket path the entry would hold.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
        /// The most a socket path may have.
        max: usize,
    },
    /// The template, snapshot or sandbox does not exist.
    #[error("{what} {name} does not exist")]
    NotFound {
        /// What kind of entry.
        what: &'static str,
        /// Its name or id.
        name: String,
    },
    /// A staging directory cannot be committed because the target exists.
    #[error("Cannot commit staged directory: {path} already exists")]
    AlreadyExists {
        /// The target.
        path: PathBuf,
    },
    /// Moving a directory within the store failed.
    #[error("Cannot move {from} to {to}")]
    Rename {
        /// The source path.
        from: PathBuf,
        /// The target path.
        to: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Deleting a directory tree failed.
    #[error("Cannot remove {path}")]
    Remove {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Syncing a directory failed, so a change in it may not survive a crash.
    #[error("Cannot sync directory {path}")]
    Sync {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The process start time could not be read from `/proc`.
    #[error("Cannot determine when this process started")]
    ProcessStart {
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Probing the store's filesystem for reflink support failed.
    #[error("Cannot probe the store for reflink support")]
    ReflinkProbe {
        /// The underlying error.
        #[source]
        source: CloneError,
    },
}

/// The three kinds of entry a store holds.
#[derive(Debug, Clone, Copy)]
enum Category {
    Template,
    Snapshot,
    Sandbox,
}

impl Category {
    const ALL: [Category; 3] = [Category::Template, Category::Snapshot, Category::Sandbox];

    fn dir_name(self) -> &'static str {
        match self {
            Category::Template => "templates",
            Category::Snapshot => "snapshots",
            Category::Sandbox => "sandboxes",
        }
    }

    /// Whether its area is shared with the VM supervisors' group: those whose
    /// entries a supervisor removes itself (see [`supervisor_group`]).
    fn shared_with_supervisors(self) -> bool {
        matches!(self, Category::Snapshot | Category::Sandbox)
    }

    fn what(self) -> &'static str {
        match self {
            Category::Template => "template",
            Category::Snapshot => "snapshot",
            Category::Sandbox => "sandbox",
        }
    }
}

/// Name of the scratch directory under the root.
const TMP_DIR: &str = "tmp";

/// An opened store root.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

impl Store {
    /// Opens the store at `root`, creating it and its `templates`, `snapshots`,
    /// `sandboxes` and `tmp` directories (mode 0700) where missing. Opened by root,
    /// `snapshots` and `sandboxes` are shared with the VM supervisors' group, and the
    /// root is searched by it (see [`supervisor_group`]).
    pub fn open(root: impl Into<PathBuf>) -> Result<Store, StoreError> {
        let root = root.into();
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&root)
            .map_err(|source| StoreError::CreateDir {
                path: root.clone(),
                source,
            })?;
        let root = fs::canonicalize(&root).map_err(|source| StoreError::CreateDir {
            path: root.clone(),
            source,
        })?;
        supervisor_group::open_root_to_group(&root).map_err(|source| StoreError::CreateDir {
            path: root.clone(),
            source,
        })?;
        let areas = Category::ALL
            .iter()
            .map(|c| (c.dir_name(), c.shared_with_supervisors()))
            .chain([(TMP_DIR, false)]);
        for (sub, shared) in areas {
            let path = root.join(sub);
            match DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(source) => return Err(StoreError::CreateDir { path, source }),
            }
            let meta = fs::symlink_metadata(&path).map_err(|source| StoreError::CreateDir {
                path: path.clone(),
                source,
            })?;
            if !meta.file_type().is_dir() {
                return Err(StoreError::NotADirectory { path });
            }
            if shared {
                supervisor_group::share_area(&path, &meta)
                    .map_err(|source| StoreError::CreateDir { path, source })?;
            }
        }
        Ok(Store { root })
    }

    /// The default store location: `$CUBE_HOME` if set; otherwise `/var/lib/cube`
    /// for root, `$XDG_DATA_HOME/cube` or `~/.local/share/cube` for other users.
    pub fn default_root() -> Result<PathBuf, StoreError> {
        default_root_from(
            std::env::var_os("CUBE_HOME"),
            nix::unistd::geteuid().is_root(),
            std::env::var_os("XDG_DATA_HOME"),
            std::env::var_os("HOME"),
        )
    }

    /// The store's root directory (absolute, symlinks resolved).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Directory of the template `name` (which need not exist yet).
    pub fn template_dir(&self, name: &str) -> Result<PathBuf, StoreError> {
        self.entry_dir(Category::Template, name)
    }

    /// Directory of the snapshot `id` (which need not exist yet).
    pub fn snapshot_dir(&self, id: &str) -> Result<PathBuf, StoreError> {
        self.entry_dir(Category::Snapshot, id)
    }

    /// Directory of the sandbox `id` (which need not exist yet).
    pub fn sandbox_dir(&self, id: &str) -> Result<PathBuf, StoreError> {
        self.entry_dir(Category::Sandbox, id)
    }

    /// The layout of template `name`'s directory (which need not exist yet).
    /// Fails where the store lies too deep for the socket a VM template's build binds.
    pub fn template(&self, name: &str) -> Result<TemplateDir, StoreError> {
        let dir = TemplateDir::new(self.template_dir(name)?);
        socket_path_fits(dir.build_vsock_socket())?;
        Ok(dir)
    }

    /// The layout of snapshot `id`'s directory (which need not exist yet).
    pub fn snapshot(&self, id: &str) -> Result<SnapshotDir, StoreError> {
        self.snapshot_dir(id).map(SnapshotDir::new)
    }

    /// The layout of sandbox `id`'s directory (which need not exist yet). Fails where
    /// the store lies too deep for the sockets a sandbox binds: found here, the error
    /// names the cause, where a bind deep inside a supervisor would only show as a
    /// supervisor that went away.
    pub fn sandbox(&self, id: &str) -> Result<SandboxDir, StoreError> {
        let dir = SandboxDir::new(self.sandbox_dir(id)?);
        socket_path_fits(dir.longest_socket())?;
        Ok(dir)
    }

    /// Removes sandbox `id`'s directory and every snapshot whose record names it as
    /// owner. A directory already gone is not an error. One that cannot be removed
    /// does not stop the others; the first such error is returned.
    pub fn remove_sandbox_files(&self, id: &str) -> Result<(), StoreError> {
        self.remove_sandbox_and_snapshots(id, |snapshot| snapshot.owner().as_deref() == Some(id))
    }

    /// What a confined VM supervisor removes when its sandbox ends without a library
    /// present (a lifetime's end, its creator gone): its own directory, sandbox
    /// `id`'s, and the snapshots whose directories its uid `uid` owns (those it
    /// staged), which it finds without reading them: it may read no snapshot's
    /// record. Errors as for [`Store::remove_sandbox_files`].
    pub fn remove_sandbox_files_of_uid(&self, id: &str, uid: u32) -> Result<(), StoreError> {
        self.remove_sandbox_and_snapshots(id, |snapshot| {
            fs::symlink_metadata(snapshot).is_ok_and(|m| m.is_dir() && m.uid() == uid)
        })
    }

    /// Removes the snapshots `owned` picks and sandbox `id`'s directory, going on past
    /// failures; the first is returned.
    fn remove_sandbox_and_snapshots(
        &self,
        id: &str,
        owned: impl Fn(&SnapshotDir) -> bool,
    ) -> Result<(), StoreError> {
        let mut first_error = None;
        for snap in self.list_snapshots()? {
            let snapshot = self.snapshot(&snap)?;
            if owned(&snapshot) {
                if let Err(e) = remove_entry(snapshot.into_path()) {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Err(e) = remove_entry(self.sandbox_dir(id)?) {
            first_error.get_or_insert(e);
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Creates a fresh, private directory under `tmp/` to build an entry in.
    ///
    /// It is deleted when the guard drops, unless [`StagingDir::commit`] moved it
    /// into place.
    pub fn stage(&self) -> Result<StagingDir, StoreError> {
        let path = self.tmp_dir().join(scratch_name("stage")?);
        DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|source| StoreError::CreateDir {
                path: path.clone(),
                source,
            })?;
        Ok(StagingDir { path, armed: true })
    }

    /// Names of all templates, sorted.
    pub fn list_templates(&self) -> Result<Vec<String>, StoreError> {
        self.list(Category::Template)
    }

    /// Ids of all snapshots, sorted.
    pub fn list_snapshots(&self) -> Result<Vec<String>, StoreError> {
        self.list(Category::Snapshot)
    }

    /// Ids of all sandboxes, sorted.
    pub fn list_sandboxes(&self) -> Result<Vec<String>, StoreError> {
        self.list(Category::Sandbox)
    }

    /// Deletes the template `name` and everything in it.
    pub fn remove_template(&self, name: &str) -> Result<(), StoreError> {
        self.remove(Category::Template, name)
    }

    /// Deletes the snapshot `id` and everything in it.
    pub fn remove_snapshot(&self, id: &str) -> Result<(), StoreError> {
        self.remove(Category::Snapshot, id)
    }

    /// Deletes the sandbox `id` and everything in it.
    pub fn remove_sandbox(&self, id: &str) -> Result<(), StoreError> {
        self.remove(Category::Sandbox, id)
    }

    /// Makes a new random id `<prefix>-<16 hex digits>`, e.g. `sb-3f9a0c21d4e87b56`.
    ///
    /// The prefix must be a valid name of at most 47 bytes so the id is one too.
    pub fn new_id(prefix: &str) -> Result<String, StoreError> {
        let fits = prefix.len() + 1 + ID_RANDOM_HEX_LEN <= MAX_NAME_LEN;
        if !fits || !is_valid_name(prefix) {
            return Err(StoreError::InvalidName {
                what: "id prefix",
                name: prefix.to_owned(),
            });
        }
        let random =
            random_hex(ID_RANDOM_HEX_LEN / 2).map_err(|source| StoreError::Random { source })?;
        Ok(format!("{prefix}-{random}"))
    }

    /// Deletes what crashed processes left in `tmp/`: entries last modified before
    /// this process started whose creator is no longer running. Returns how many
    /// entries were removed.
    ///
    /// Entries of live processes (this one included) are kept, so several processes
    /// may share a store. Every entry is tried; the first failure is returned.
    pub fn clean_stale_staging(&self) -> Result<usize, StoreError> {
        let started = process_start_time()?;
        let tmp = self.tmp_dir();
        let list_err = |source| StoreError::List {
            path: tmp.clone(),
            source,
        };
        let mut removed = 0;
        let mut first_error = None;
        for entry in fs::read_dir(&tmp).map_err(list_err)? {
            let entry = entry.map_err(list_err)?;
            let path = entry.path();
            if let Some(owner) = entry.file_name().to_str().and_then(parse_scratch_owner) {
                if owner.is_alive() {
                    continue;
                }
            }
            let modified = match entry.metadata().and_then(|m| m.modified()) {
                Ok(t) => t,
                // Vanished meanwhile, or unreadable: nothing to do or nothing we can do.
                Err(_) => continue,
            };
            if modified >= started {
                continue;
            }
            match remove_path(&path) {
                Ok(()) => {
                    tracing::debug!(path = %path.display(), "Removed stale store scratch entry");
                    removed += 1;
                }
                Err(source) => {
                    tracing::warn!(path = %path.display(), error = %source, "Cannot remove stale store scratch entry");
                    first_error.get_or_insert(StoreError::Remove { path, source });
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(removed),
        }
    }

    /// Tells whether the store's filesystem can reflink, i.e. whether creating a
    /// sandbox from a template is O(1) or a full copy.
    pub fn supports_reflink(&self) -> Result<bool, StoreError> {
        reflink::supports_reflink(&self.tmp_dir())
            .map_err(|source| StoreError::ReflinkProbe { source })
    }

    /// The scratch directory (`tmp/`), on the same filesystem as every entry: staging
    /// and removal happen here.
    pub fn tmp_dir(&self) -> PathBuf {
        Self::tmp_dir_at(&self.root)
    }

    /// The scratch directory of the store rooted at `root`, for a caller that needs
    /// scratch space on the store's filesystem without opening (or creating) the store.
    pub fn tmp_dir_at(root: &Path) -> PathBuf {
        root.join(TMP_DIR)
    }

    /// The top-level directories of the store rooted at `root`, without opening (or
    /// creating) it: for a caller that grants or withholds access to each.
    pub fn areas_at(root: &Path) -> StoreAreas {
        StoreAreas {
            templates: root.join(Category::Template.dir_name()),
            snapshots: root.join(Category::Snapshot.dir_name()),
            sandboxes: root.join(Category::Sandbox.dir_name()),
            tmp: Self::tmp_dir_at(root),
        }
    }

    fn entry_dir(&self, category: Category, name: &str) -> Result<PathBuf, StoreError> {
        if !is_valid_name(name) {
            return Err(StoreError::InvalidName {
                what: category.what(),
                name: name.to_owned(),
            });
        }
        Ok(self.root.join(category.dir_name()).join(name))
    }

    fn list(&self, category: Category) -> Result<Vec<String>, StoreError> {
        let dir = self.root.join(category.dir_name());
        let list_err = |source| StoreError::List {
            path: dir.clone(),
            source,
        };
        let mut names = Vec::new();
        for entry in fs::read_dir(&dir).map_err(list_err)? {
            let entry = entry.map_err(list_err)?;
            let is_dir = entry.file_type().map_err(list_err)?.is_dir();
            // Hidden and malformed names are temp files or foreign debris, not entries.
            match entry.file_name().into_string() {
                Ok(name) if is_dir && is_valid_name(&name) => names.push(name),
                _ => {}
            }
        }
        names.sort();
        Ok(names)
    }

    fn remove(&self, category: Category, name: &str) -> Result<(), StoreError> {
        let path = self.entry_dir(category, name)?;
        // Move out of sight first, so a crash mid-delete never leaves half an entry.
        let grave = self.tmp_dir().join(scratch_name("remove")?);
        match fs::rename(&path, &grave) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::NotFound {
                    what: category.what(),
                    name: name.to_owned(),
                })
            }
            Err(source) => {
                return Err(StoreError::Rename {
                    from: path,
                    to: grave,
                    source,
                })
            }
        }
        let parent = self.root.join(category.dir_name());
        sync_dir(&parent).map_err(|source| StoreError::Sync {
            path: parent,
            source,
        })?;
        remove_path(&grave).map_err(|source| StoreError::Remove {
            path: grave,
            source,
        })
    }
}

/// The top-level directories of a store (see [`Store::areas_at`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreAreas {
    /// Every template, one directory each.
    pub templates: PathBuf,
    /// Every snapshot, one directory each.
    pub snapshots: PathBuf,
    /// Every sandbox, one directory each.
    pub sandboxes: PathBuf,
    /// Scratch space: staging and removal.
    pub tmp: PathBuf,
}

/// A directory being built under the store's `tmp/`; deleted on drop unless
/// committed.
#[derive(Debug)]
pub struct StagingDir {
    path: PathBuf,
    armed: bool,
}

impl StagingDir {
    /// Where to build the entry.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves the directory to `target` atomically (it must not exist and must be on
    /// the store's filesystem, e.g. a path from [`Store::sandbox_dir`]) and syncs
    /// the directory holding it.
    ///
    /// Files inside should already be synced by whoever wrote them. On error the
    /// staging directory is deleted.
    pub fn commit(mut self, target: impl AsRef<Path>) -> Result<(), StoreError> {
        let target = target.as_ref();
        sync_dir(&self.path).map_err(|source| StoreError::Sync {
            path: self.path.clone(),
            source,
        })?;
        rename_no_replace(&self.path, target)?;
        self.armed = false;
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        sync_dir(parent).map_err(|source| StoreError::Sync {
            path: parent.to_owned(),
            source,
        })
    }
}

impl Drop for StagingDir {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        match fs::remove_dir_all(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(
                path = %self.path.display(),
                error = %e,
                "Cannot remove abandoned staging directory"
            ),
        }
    }
}

/// Tells whether `name` is a valid template name or id: 1 to 64 bytes of
/// `[A-Za-z0-9._-]`, not starting with `.` (which rules out `.` and `..` and keeps
/// hidden names free for temporary files).
pub fn is_valid_name(name: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The default store root for the given environment.
fn default_root_from(
    cube_home: Option<OsString>,
    is_root: bool,
    xdg_data_home: Option<OsString>,
    home: Option<OsString>,
) -> Result<PathBuf, StoreError> {
    let non_empty = |v: Option<OsString>| v.filter(|s| !s.is_empty()).map(PathBuf::from);
    if let Some(dir) = non_empty(cube_home) {
        return Ok(dir);
    }
    if is_root {
        return Ok(PathBuf::from("/var/lib/cube"));
    }
    // The XDG spec says relative values are invalid and must be ignored.
    if let Some(dir) = non_empty(xdg_data_home).filter(|p| p.is_absolute()) {
        return Ok(dir.join("cube"));
    }
    non_empty(home)
        .map(|h| h.join(".local/share/cube"))
        .ok_or(StoreError::NoHome)
}

/// The most bytes a unix socket path may have: `sun_path` holds 108, the last of
/// them the terminating zero.
const MAX_SOCKET_PATH: usize = 107;

/// Checks that `path` can be bound as a unix socket.
fn socket_path_fits(path: PathBuf) -> Result<(), StoreError> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(StoreError::SocketPathTooLong {
            path,
            len,
            max: MAX_SOCKET_PATH,
        });
    }
    Ok(())
}

/// The process that created a scratch entry, from its name.
#[derive(Debug, PartialEq, Eq)]
struct ScratchOwner {
    pid: u32,
    /// Start time in clock ticks after boot, which tells a reused pid apart.
    start_ticks: u64,
}

impl ScratchOwner {
    fn is_alive(&self) -> bool {
        read_start_ticks(&format!("/proc/{}/stat", self.pid)).is_ok_and(|t| t == self.start_ticks)
    }
}

/// A name for an entry of the store's `tmp/` that this process owns while it lives:
/// [`Store::clean_stale_staging`] leaves it alone until then. `purpose` must hold no
/// `-`.
pub fn scratch_entry_name(purpose: &str) -> Result<String, StoreError> {
    scratch_name(purpose)
}

/// Removes the entries of `tmp_dir` (a store's `tmp/`) named by
/// [`scratch_entry_name`]`(purpose)` whose creating process has ended: what a process
/// killed outright left. Cheaper than [`Store::clean_stale_staging`] (one directory
/// read, nothing created), for a path as hot as `cube run`'s start; the owner named
/// in the entry (pid and start time) is exact, so no age check is needed. Returns the
/// names removed; errors are skipped (the next sweep tries again).
pub fn remove_dead_scratch(tmp_dir: &Path, purpose: &str) -> Vec<String> {
    let Ok(entries) = fs::read_dir(tmp_dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let dead = name
            .strip_prefix(purpose)
            .is_some_and(|rest| rest.starts_with('-'))
            && parse_scratch_owner(&name).is_some_and(|owner| !owner.is_alive());
        if dead && remove_path(&entry.path()).is_ok() {
            removed.push(name);
        }
    }
    removed
}

/// `<purpose>-<pid>-<start ticks>-<random>`: unique, and says who made it.
fn scratch_name(purpose: &str) -> Result<String, StoreError> {
    let me = own_identity()?;
    let random = random_hex(8).map_err(|source| StoreError::Random { source })?;
    Ok(format!("{purpose}-{}-{}-{random}", me.pid, me.start_ticks))
}

fn parse_scratch_owner(name: &str) -> Option<ScratchOwner> {
    let mut parts = name.split('-');
    let _purpose = parts.next()?;
    let pid = parts.next()?.parse().ok()?;
    let start_ticks = parts.next()?.parse().ok()?;
    Some(ScratchOwner { pid, start_ticks })
}

fn own_identity() -> Result<&'static ScratchOwner, StoreError> {
    static OWN: OnceLock<ScratchOwner> = OnceLock::new();
    if let Some(me) = OWN.get() {
        return Ok(me);
    }
    let start_ticks = read_start_ticks("/proc/self/stat")
        .map_err(|source| StoreError::ProcessStart { source })?;
    Ok(OWN.get_or_init(|| ScratchOwner {
        pid: std::process::id(),
        start_ticks,
    }))
}

/// Field 22 of `/proc/<pid>/stat`: start time in clock ticks after boot.
fn read_start_ticks(stat_path: &str) -> io::Result<u64> {
    let stat = fs::read_to_string(stat_path)?;
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "malformed /proc stat line");
    // The command name (field 2) may hold spaces and parentheses; it ends at the
    // last ')'. Field 3 is the first after it, so field 22 is the 20th.
    let after_comm = stat.rsplit_once(')').ok_or_else(malformed)?.1;
    after_comm
        .split_whitespace()
        .nth(19)
        .and_then(|f| f.parse().ok())
        .ok_or_else(malformed)
}

/// Wall-clock time this process started.
fn process_start_time() -> Result<SystemTime, StoreError> {
    let err = |source| StoreError::ProcessStart { source };
    let me = own_identity()?;
    let boot_secs = fs::read_to_string("/proc/stat")
        .map_err(err)?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<u64>().ok())
        .ok_or_else(|| {
            err(io::Error::new(
                io::ErrorKind::InvalidData,
                "no btime in /proc/stat",
            ))
        })?;
    // SAFETY: sysconf reads a configuration value and touches no memory of ours.
    let ticks_per_sec = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks_per_sec = u64::try_from(ticks_per_sec)
        .ok()
        .filter(|&t| t > 0)
        .ok_or_else(|| err(io::Error::other("sysconf(_SC_CLK_TCK) failed")))?;
    let since_boot = Duration::from_secs(me.start_ticks / ticks_per_sec)
        + Duration::from_nanos((me.start_ticks % ticks_per_sec) * 1_000_000_000 / ticks_per_sec);
    Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(boot_secs) + since_boot)
}

/// Renames `from` to `to`, failing if `to` exists (even as an empty directory,
/// which plain rename(2) would replace).
fn rename_no_replace(from: &Path, to: &Path) -> Result<(), StoreError> {
    let rename_err = |source: io::Error| StoreError::Rename {
        from: from.to_owned(),
        to: to.to_owned(),
        source,
    };
    match renameat2(AT_FDCWD, from, AT_FDCWD, to, RenameFlags::RENAME_NOREPLACE) {
        Ok(()) => Ok(()),
        Err(Errno::EEXIST) => Err(StoreError::AlreadyExists {
            path: to.to_owned(),
        }),
        // Filesystems without RENAME_NOREPLACE: check, then rename. Racy, but only
        // against another process committing the same new id.
        Err(Errno::EINVAL) => {
            if fs::symlink_metadata(to).is_ok() {
                return Err(StoreError::AlreadyExists {
                    path: to.to_owned(),
                });
            }
            fs::rename(from, to).map_err(rename_err)
        }
        Err(e) => Err(rename_err(e.into())),
    }
}

/// Deletes a directory tree or a single non-directory entry.
fn remove_path(path: &Path) -> io::Result<()> {
    if fs::symlink_metadata(path)?.file_type().is_dir() {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    }
}

/// Removes the directory tree `path` of a sandbox or snapshot; one already gone is
/// not an error.
fn remove_entry(path: PathBuf) -> Result<(), StoreError> {
    match fs::remove_dir_all(&path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(StoreError::Remove { path, source: e })
        }
        _ => Ok(()),
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_temp() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("store")).unwrap();
        (dir, store)
    }

    #[test]
    fn open_creates_private_layout_and_is_idempotent() {
        let (_dir, store) = open_temp();
        for sub in ["templates", "snapshots", "sandboxes", "tmp"] {
            let meta = fs::symlink_metadata(store.root().join(sub)).unwrap();
            assert!(meta.is_dir(), "{sub}");
            let shared = nix::unistd::geteuid().is_root() && sub.starts_with('s');
            let mode = if shared {
                supervisor_group::SHARED_AREA_MODE
            } else {
                0o700
            };
            assert_eq!(meta.mode() & 0o7777, mode, "{sub}");
        }
        Store::open(store.root()).unwrap();
        let areas = Store::areas_at(store.root());
        assert_eq!(areas.templates, store.root().join("templates"));
        assert_eq!(areas.snapshots, store.root().join("snapshots"));
        assert_eq!(areas.sandboxes, store.root().join("sandboxes"));
        assert_eq!(areas.tmp, store.tmp_dir());
        assert_eq!(
            store.sandbox_dir("sb-1").unwrap().parent(),
            Some(&*areas.sandboxes)
        );
    }

    #[test]
    fn open_refuses_file_in_place_of_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("store");
        fs::create_dir(&root).unwrap();
        fs::write(root.join("snapshots"), b"").unwrap();
        let err = Store::open(&root).unwrap_err();
        assert!(matches!(err, StoreError::NotADirectory { .. }), "{err}");
        fs::write(dir.path().join("file"), b"").unwrap();
        assert!(Store::open(dir.path().join("file")).is_err());
    }

    #[test]
    fn names_are_validated() {
        for good in [
            "a",
            "ubuntu-22.04",
            "sb-0123456789abcdef",
            "A_b.c-9",
            &"x".repeat(64),
        ] {
            assert!(is_valid_name(good), "{good:?}");
        }
        for bad in [
            "",
            ".",
            "..",
            ".hidden",
            "a/b",
            "../etc",
            "a b",
            "é",
            "a\0",
            &"x".repeat(65),
        ] {
            assert!(!is_valid_name(bad), "{bad:?}");
        }
        let (_dir, store) = open_temp();
        assert_eq!(
            store.sandbox_dir("sb-1").unwrap(),
            store.root().join("sandboxes/sb-1")
        );
        for bad in ["..", "a/b", ""] {
            let err = store.template_dir(bad).unwrap_err();
            assert!(
                matches!(
                    err,
                    StoreError::InvalidName {
                        what: "template",
                        ..
                    }
                ),
                "{err}"
            );
            assert!(store.snapshot_dir(bad).is_err());
            assert!(store.sandbox_dir(bad).is_err());
            assert!(store.remove_sandbox(bad).is_err());
        }
    }

    #[test]
    fn staging_dir_is_removed_on_drop() {
        let (_dir, store) = open_temp();
        let staged = store.stage().unwrap();
        let path = staged.path().to_owned();
        fs::write(path.join("file"), b"data").unwrap();
        assert!(path.starts_with(store.root().join("tmp")));
        drop(staged);
        assert!(!path.exists());
    }

    #[test]
    fn staging_dir_commits_into_place() {
        let (_dir, store) = open_temp();
        let staged = store.stage().unwrap();
        let staged_path = staged.path().to_owned();
        fs::write(staged.path().join("rootfs.img"), b"image").unwrap();
        let target = store.sandbox_dir("sb-1").unwrap();
        staged.commit(&target).unwrap();
        assert!(!staged_path.exists());
        assert_eq!(fs::read(target.join("rootfs.img")).unwrap(), b"image");
        assert_eq!(store.list_sandboxes().unwrap(), ["sb-1"]);
    }

    #[test]
    fn commit_onto_existing_target_fails_and_keeps_it() {
        let (_dir, store) = open_temp();
        let target = store.template_dir("base").unwrap();
        fs::create_dir(&target).unwrap(); // empty: rename(2) alone would replace it
        let staged = store.stage().unwrap();
        let staged_path = staged.path().to_owned();
        let err = staged.commit(&target).unwrap_err();
        assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err}");
        assert!(target.is_dir());
        assert!(!staged_path.exists(), "failed commit must clean up");
    }

    #[test]
    fn listings_are_sorted_and_skip_staging_hidden_and_files() {
        let (_dir, store) = open_temp();
        for id in ["sb-b", "sb-a", "sb-c"] {
            fs::create_dir(store.sandbox_dir(id).unwrap()).unwrap();
        }
        let sandboxes = store.root().join("sandboxes");
        fs::create_dir(sandboxes.join(".cube-meta-1234.tmp")).unwrap();
        fs::write(sandboxes.join("stray-file"), b"").unwrap();
        let _staged = store.stage().unwrap();
        fs::create_dir(store.template_dir("t1").unwrap()).unwrap();

        assert_eq!(store.list_sandboxes().unwrap(), ["sb-a", "sb-b", "sb-c"]);
        assert_eq!(store.list_templates().unwrap(), ["t1"]);
        assert!(store.list_snapshots().unwrap().is_empty());
    }

    #[test]
    fn remove_deletes_entries_and_reports_missing_ones() {
        let (_dir, store) = open_temp();
        let snap = store.snapshot_dir("snap-1").unwrap();
        fs::create_dir_all(snap.join("deep/inside")).unwrap();
        fs::write(snap.join("deep/inside/mem"), b"x").unwrap();
        fs::create_dir(store.template_dir("t").unwrap()).unwrap();
        fs::create_dir(store.sandbox_dir("s").unwrap()).unwrap();

        store.remove_snapshot("snap-1").unwrap();
        store.remove_template("t").unwrap();
        store.remove_sandbox("s").unwrap();

        assert!(!snap.exists());
        assert!(store.list_templates().unwrap().is_empty());
        assert!(store.list_sandboxes().unwrap().is_empty());
        assert_eq!(fs::read_dir(store.root().join("tmp")).unwrap().count(), 0);
        let err = store.remove_snapshot("snap-1").unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::NotFound {
                    what: "snapshot",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_sandbox_removes_its_own_snapshots_by_record_or_by_uid() {
        let (_tmp, store) = open_temp();
        let snapshot = |id: &str, owner: &str| {
            let dir = store.snapshot_dir(id).unwrap();
            fs::create_dir(&dir).unwrap();
            let record = SnapshotDir::new(&dir).record();
            let body = format!("{{\"sandbox\":\"{owner}\"}}");
            crate::write_atomic_bytes(&record, SnapshotDir::RECORD_KIND, body.as_bytes()).unwrap();
            dir
        };
        for id in ["sb-a", "sb-b"] {
            fs::create_dir(store.sandbox_dir(id).unwrap()).unwrap();
        }
        let a1 = snapshot("snap-a1", "sb-a");
        let b1 = snapshot("snap-b1", "sb-b");
        store.remove_sandbox_files("sb-a").unwrap();
        assert!(!a1.exists() && !store.sandbox_dir("sb-a").unwrap().exists());
        assert!(b1.exists());
        // By uid: what the uid owns goes, whatever its record says (it is not read).
        if !nix::unistd::geteuid().is_root() {
            println!("skipped the uid half: giving a directory to a uid needs root");
            return;
        }
        let staged = snapshot("snap-b2", "sb-b");
        let uid = 0x7000_0123;
        std::os::unix::fs::lchown(&staged, Some(uid), None).unwrap();
        store.remove_sandbox_files_of_uid("sb-b", uid).unwrap();
        assert!(!staged.exists() && !store.sandbox_dir("sb-b").unwrap().exists());
        assert!(b1.exists(), "a snapshot of another uid stays");
        // Gone already: not an error.
        store.remove_sandbox_files_of_uid("sb-b", uid).unwrap();
    }

    #[test]
    fn a_store_too_deep_for_socket_paths_is_refused_by_name() {
        let base = tempfile::tempdir().unwrap();
        // Deep enough that `sandboxes/sb-<16 hex>/supervisor.sock` passes 107 bytes.
        let deep = base
            .path()
            .join("d".repeat(110 - base.path().as_os_str().len()));
        let store = Store::open(&deep).unwrap();
        let id = Store::new_id("sb").unwrap();
        let err = store.sandbox(&id).unwrap_err();
        assert!(
            matches!(err, StoreError::SocketPathTooLong { max: 107, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("CUBE_HOME"), "{err}");
        assert!(store.template("t").is_err());

        let (_dir, shallow) = open_temp();
        let dir = shallow.sandbox(&id).unwrap();
        assert!(dir.longest_socket().as_os_str().len() <= MAX_SOCKET_PATH);
    }

    #[test]
    fn new_ids_are_prefixed_random_and_valid() {
        let a = Store::new_id("sb").unwrap();
        let b = Store::new_id("sb").unwrap();
        assert_ne!(a, b);
        assert!(is_valid_name(&a));
        let hex = a.strip_prefix("sb-").unwrap();
        assert_eq!(hex.len(), 16);
        assert!(hex.bytes().all(|c| c.is_ascii_hexdigit()));
        assert!(is_valid_name(&Store::new_id(&"p".repeat(47)).unwrap()));
        for bad in ["", "a/b", ".x", &"p".repeat(48)] {
            let err = Store::new_id(bad).unwrap_err();
            assert!(
                matches!(err, StoreError::InvalidName { .. }),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn clean_stale_staging_removes_only_dead_leftovers() {
        let (_dir, store) = open_temp();
        let tmp = store.root().join("tmp");
        let set_old = |p: &Path| {
            let hour_ago = SystemTime::now() - Duration::from_secs(3600);
            File::open(p).unwrap().set_modified(hour_ago).unwrap();
        };
        // A crash leftover: unknown owner, older than this process.
        let leftover = tmp.join("stage-leftover");
        fs::create_dir_all(leftover.join("sub")).unwrap();
        fs::write(leftover.join("sub/f"), b"x").unwrap();
        set_old(&leftover);
        // Written by a dead process (pid above the kernel's maximum).
        let dead = tmp.join("stage-99999999-1-00");
        fs::write(&dead, b"").unwrap();
        set_old(&dead);
        // Ours, even if old: this process is alive.
        let staged = store.stage().unwrap();
        set_old(staged.path());
        // Unknown owner but newer than this process: maybe another live process.
        let fresh = tmp.join("stage-fresh");
        fs::create_dir(&fresh).unwrap();

        assert_eq!(store.clean_stale_staging().unwrap(), 2);

        assert!(!leftover.exists());
        assert!(!dead.exists());
        assert!(staged.path().exists());
        assert!(fresh.exists());
    }

    #[test]
    fn dead_scratch_of_one_purpose_goes_live_and_other_scratch_stays() {
        let (_dir, store) = open_temp();
        let tmp = store.root().join("tmp");
        let dead = tmp.join("run-99999999-1-00");
        fs::create_dir(&dead).unwrap();
        let other_purpose = tmp.join("stage-99999999-1-00");
        fs::create_dir(&other_purpose).unwrap();
        let mine = tmp.join(scratch_entry_name("run").unwrap());
        fs::create_dir(&mine).unwrap();
        let unnamed = tmp.join("run-leftover");
        fs::create_dir(&unnamed).unwrap();

        assert_eq!(remove_dead_scratch(&tmp, "run"), vec!["run-99999999-1-00"]);

        assert!(!dead.exists());
        assert!(other_purpose.exists());
        assert!(mine.exists());
        assert!(unnamed.exists());
    }

    #[test]
    fn process_start_is_in_the_past() {
        let started = process_start_time().unwrap();
        assert!(started <= SystemTime::now());
        assert!(own_identity().unwrap().is_alive());
        let name = scratch_entry_name("jail").unwrap();
        let owner = parse_scratch_owner(&name).unwrap();
        assert!(owner.is_alive(), "{name} names this live process");
        let me = own_identity().unwrap();
        let name = scratch_name("stage").unwrap();
        assert_eq!(parse_scratch_owner(&name).as_ref(), Some(me));
    }

    #[test]
    fn default_root_follows_environment() {
        let s = |v: &str| Some(OsString::from(v));
        let root = |cube, is_root, xdg, home| default_root_from(cube, is_root, xdg, home).unwrap();
        assert_eq!(
            root(s("/srv/cube"), true, None, s("/root")),
            Path::new("/srv/cube")
        );
        assert_eq!(root(s(""), true, None, None), Path::new("/var/lib/cube"));
        assert_eq!(
            root(None, true, s("/x"), s("/root")),
            Path::new("/var/lib/cube")
        );
        assert_eq!(
            root(None, false, s("/data"), s("/home/u")),
            Path::new("/data/cube")
        );
        assert_eq!(
            root(None, false, s("relative"), s("/home/u")),
            Path::new("/home/u/.local/share/cube")
        );
        assert_eq!(
            root(None, false, None, s("/home/u")),
            Path::new("/home/u/.local/share/cube")
        );
        assert!(matches!(
            default_root_from(None, false, None, None),
            Err(StoreError::NoHome)
        ));
    }

    #[test]
    fn reflink_probe_runs_in_store() {
        let (_dir, store) = open_temp();
        let expected = reflink::supports_reflink(store.root()).unwrap();
        assert_eq!(store.supports_reflink().unwrap(), expected);
    }
}
