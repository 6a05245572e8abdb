//! Sandbox cgroups: finds the host's cgroup layout (pure v2, pure v1 or hybrid), creates
//! one cgroup per sandbox in every hierarchy it needs, applies memory/CPU/pids limits,
//! freezes and thaws, kills everything inside and removes the directories.
//!
//! Controllers are taken from the v2 hierarchy when it has them, from the v1 hierarchy
//! that carries them otherwise. A sandbox always joins the v2 hierarchy when one is
//! mounted, even one without controllers: it still gives `cgroup.freeze`, `cgroup.kill`
//! and `cgroup.events`, which are more reliable than their v1 counterparts.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Name of the directory, under each hierarchy's parent, that holds all sandbox cgroups.
pub const PARENT_DIR: &str = "cube";

/// CFS period used for CPU quotas, in microseconds.
const CPU_PERIOD_US: u64 = 100_000;

/// How long a freeze, thaw or kill may take before it is reported as stuck.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors from cgroup detection, set-up and control.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A limit was asked for but no mounted hierarchy has the controller enforcing it.
    #[error("no cgroup hierarchy provides the {0} controller")]
    MissingController(&'static str),
    /// Pause or resume was asked for but neither v2 `cgroup.freeze` nor a v1 freezer exists.
    #[error("no cgroup freezer is available")]
    NoFreezer,
    /// A cgroup control file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A value could not be written to a cgroup control file.
    #[error("cannot write {value:?} to {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// What was written.
        value: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A cgroup directory could not be created.
    #[error("cannot create cgroup {path}")]
    Create {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A cgroup directory could not be removed.
    #[error("cannot remove cgroup {path}")]
    Remove {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// `/proc/self/mountinfo`, `/proc/self/cgroup` or a control file held a line this
    /// module does not understand.
    #[error("malformed {what}: {line:?}")]
    Malformed {
        /// Which file.
        what: &'static str,
        /// The offending line.
        line: String,
    },
    /// A freeze, thaw or kill did not settle in time.
    #[error("cgroup {path} did not become {state} within {timeout:?}")]
    Timeout {
        /// The cgroup directory.
        path: PathBuf,
        /// The state waited for.
        state: &'static str,
        /// How long it waited.
        timeout: Duration,
    },
    /// A limit is out of range.
    #[error("invalid limit: {0}")]
    InvalidLimit(&'static str),
}

type Result<T> = std::result::Result<T, CgroupError>;

/// Memory a sandbox may use unless it names its own limit: 2 GiB (its tmpfs included).
pub const DEFAULT_MEMORY_BYTES: u64 = 2 << 30;
/// CPU a sandbox may use unless it names its own limit: one core.
pub const DEFAULT_CPU_QUOTA: f64 = 1.0;
/// Processes and threads a sandbox may have at once unless it names its own limit: a
/// fork bomb stops there.
pub const DEFAULT_PIDS_MAX: u64 = 4096;
/// What a sandbox's writable root may hold unless it names its own limit: 4 GiB.
pub const DEFAULT_DISK_BYTES: u64 = 4 << 30;

/// Resource limits of one sandbox. `None` leaves a resource unlimited;
/// [`Limits::with_defaults`] fills in the defaults.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// Most memory (anonymous, page cache, tmpfs) the sandbox may use, in bytes; swap is
    /// forbidden where the host allows controlling it. Each of its tmpfs (/tmp,
    /// /dev/shm, a root kept in memory) is also this big at most.
    pub memory_bytes: Option<u64>,
    /// CPU time as a fraction of one core: 0.5 is half a core, 2.0 two full cores.
    pub cpu_quota: Option<f64>,
    /// Most processes and threads alive at once.
    pub pids_max: Option<u64>,
    /// Most bytes the sandbox's writable root may hold: an XFS project quota on its
    /// directory (the store's filesystem must enforce project quotas), or the size of
    /// a root kept in memory. Writes past it fail with ENOSPC inside the sandbox.
    #[serde(default)]
    pub disk_bytes: Option<u64>,
}

impl Limits {
    /// Whether no limit is set.
    pub fn is_unlimited(&self) -> bool {
        *self == Limits::default()
    }

    /// These limits with every unset one at its default (`DEFAULT_*`) where this host
    /// can enforce it: memory, CPU and pids where `layout` has the controller, disk
    /// where `dir` (where the sandbox's directory will be) is on a filesystem with
    /// project quotas. A limit the caller set stays, enforceable or not (asking for
    /// one the host cannot enforce is an error at spawn).
    pub fn with_defaults(mut self, layout: &CgroupLayout, dir: &Path) -> Limits {
        let has = |c: &str| layout.provider(c).is_some();
        if self.memory_bytes.is_none() && has("memory") {
            self.memory_bytes = Some(DEFAULT_MEMORY_BYTES);
        }
        if self.cpu_quota.is_none() && has("cpu") {
            self.cpu_quota = Some(DEFAULT_CPU_QUOTA);
        }
        if self.pids_max.is_none() && has("pids") {
            self.pids_max = Some(DEFAULT_PIDS_MAX);
        }
        if self.disk_bytes.is_none() && cube_storage::project_quota::enforced(dir) {
            self.disk_bytes = Some(DEFAULT_DISK_BYTES);
        }
        self
    }

    /// Whether any limit needs a cgroup.
    pub fn needs_cgroup(&self) -> bool {
        self.memory_bytes.is_some() || self.cpu_quota.is_some() || self.pids_max.is_some()
    }

    /// Rejects limits the kernel would refuse or that make no sense.
    pub fn validate(&self) -> Result<()> {
        if self.memory_bytes == Some(0) {
            return Err(CgroupError::InvalidLimit("memory_bytes must be positive"));
        }
        if let Some(q) = self.cpu_quota {
            if !q.is_finite() || q <= 0.0 || q > 4096.0 {
                return Err(CgroupError::InvalidLimit(
                    "cpu_quota must be a positive number of cores",
                ));
            }
        }
        if self.pids_max == Some(0) {
            return Err(CgroupError::InvalidLimit("pids_max must be positive"));
        }
        if self.disk_bytes == Some(0) {
            return Err(CgroupError::InvalidLimit("disk_bytes must be positive"));
        }
        Ok(())
    }
}

/// Which cgroup interface a hierarchy speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    /// The legacy, one-hierarchy-per-controller interface.
    V1,
    /// The unified hierarchy.
    V2,
}

/// One mounted cgroup hierarchy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hierarchy {
    /// v1 or v2.
    pub version: CgroupVersion,
    /// Where it is mounted.
    pub mount: PathBuf,
    /// Controllers it carries (for v2: those listed in its root `cgroup.controllers`).
    pub controllers: Vec<String>,
    /// This process's cgroup in it, relative to `mount`.
    pub own_path: PathBuf,
}

impl Hierarchy {
    fn has(&self, controller: &str) -> bool {
        self.controllers.iter().any(|c| c == controller)
    }
}

/// Overall shape of the host's cgroups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutKind {
    /// Only the v2 hierarchy is mounted.
    Unified,
    /// Only v1 hierarchies are mounted.
    Legacy,
    /// v1 controllers plus a v2 hierarchy (usually without controllers).
    Hybrid,
}

/// The cgroup hierarchies this process can use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupLayout {
    /// The v2 hierarchy, if mounted.
    pub v2: Option<Hierarchy>,
    /// The v1 hierarchies that carry at least one controller.
    pub v1: Vec<Hierarchy>,
}

impl CgroupLayout {
    /// Reads `/proc/self/mountinfo`, `/proc/self/cgroup` and the v2 root's
    /// `cgroup.controllers`.
    pub fn detect() -> Result<Self> {
        let mountinfo = read("/proc/self/mountinfo")?;
        let own = read("/proc/self/cgroup")?;
        let mut layout = Self::parse(&mountinfo, &own)?;
        if let Some(v2) = layout.v2.as_mut() {
            let list = read(v2.mount.join("cgroup.controllers"))?;
            v2.controllers = list.split_whitespace().map(str::to_owned).collect();
        }
        Ok(layout)
    }

    /// Builds the layout from the text of `/proc/self/mountinfo` and `/proc/self/cgroup`;
    /// v2 controllers are left empty (they live in a file of the hierarchy).
    pub fn parse(mountinfo: &str, proc_cgroup: &str) -> Result<Self> {
        // (hierarchy controllers, own path) from /proc/self/cgroup.
        let mut own: Vec<(Vec<String>, String)> = Vec::new();
        for line in proc_cgroup.lines().filter(|l| !l.is_empty()) {
            let mut parts = line.splitn(3, ':');
            let (Some(_id), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(malformed("/proc/self/cgroup", line));
            };
            let ctrls = ctrls
                .split(',')
                .filter(|c| !c.is_empty())
                .map(str::to_owned)
                .collect();
            own.push((ctrls, path.to_owned()));
        }
        let mut layout = CgroupLayout {
            v2: None,
            v1: Vec::new(),
        };
        for line in mountinfo.lines().filter(|l| !l.is_empty()) {
            let fields: Vec<&str> = line.split(' ').collect();
            let Some(sep) = fields.iter().position(|f| *f == "-") else {
                return Err(malformed("/proc/self/mountinfo", line));
            };
            if sep < 5 || fields.len() < sep + 4 {
                return Err(malformed("/proc/self/mountinfo", line));
            }
            let root = unescape(fields[3]);
            let mount = PathBuf::from(unescape(fields[4]));
            let fstype = fields[sep + 1];
            let superopts = fields[sep + 3];
            match fstype {
                "cgroup2" if layout.v2.is_none() => {
                    let path = own
                        .iter()
                        .find(|(c, _)| c.is_empty())
                        .map(|(_, p)| p.as_str())
                        .unwrap_or("/");
                    layout.v2 = Some(Hierarchy {
                        version: CgroupVersion::V2,
                        mount,
                        controllers: Vec::new(),
                        own_path: relative_to_root(path, &root),
                    });
                }
                "cgroup" => {
                    let ctrls: Vec<String> = superopts
                        .split(',')
                        .filter(|o| KNOWN_V1_CONTROLLERS.contains(o))
                        .map(str::to_owned)
                        .collect();
                    if ctrls.is_empty() || layout.v1.iter().any(|h| h.controllers == ctrls) {
                        continue;
                    }
                    let mut sorted = ctrls.clone();
                    sorted.sort();
                    let path = own
                        .iter()
                        .find(|(c, _)| {
                            let mut c = c.clone();
                            c.sort();
                            c == sorted
                        })
                        .map(|(_, p)| p.as_str())
                        .unwrap_or("/");
                    layout.v1.push(Hierarchy {
                        version: CgroupVersion::V1,
                        mount,
                        controllers: ctrls,
                        own_path: relative_to_root(path, &root),
                    });
                }
                _ => {}
            }
        }
        Ok(layout)
    }

    /// Pure v2, pure v1 or both.
    pub fn kind(&self) -> LayoutKind {
        match (&self.v2, self.v1.is_empty()) {
            (Some(_), true) => LayoutKind::Unified,
            (Some(_), false) => LayoutKind::Hybrid,
            (None, _) => LayoutKind::Legacy,
        }
    }

    /// The hierarchy that enforces `controller`: v2 if it has it, else a v1 one.
    pub fn provider(&self, controller: &str) -> Option<&Hierarchy> {
        self.v2
            .iter()
            .chain(self.v1.iter())
            .find(|h| h.has(controller))
    }

    /// Where [`SandboxCgroup::create`] makes sandbox cgroups: under the v2 root, and
    /// under this process's own cgroup in each v1 hierarchy.
    fn parents(&self) -> Vec<PathBuf> {
        let v2 = self.v2.iter().map(|h| h.mount.join(PARENT_DIR));
        let v1 = self
            .v1
            .iter()
            .map(|h| h.mount.join(&h.own_path).join(PARENT_DIR));
        v2.chain(v1).collect()
    }

    /// Removes the sandbox cgroups named `<prefix><pid>`, or `<prefix><pid>-<start
    /// ticks>-<anything>` (a store scratch name, whose start time tells a reused pid
    /// apart), whose process is gone (or a zombie): what a process that named its
    /// cgroups after itself left behind when it was killed (SIGKILL gives it no chance
    /// to remove them). Its jails die with it, but may still be exiting when this
    /// runs: what is still inside is thawed and killed, and the removal waits for it
    /// (see [`end_and_remove`]). Cgroups of live processes are left alone. Returns how
    /// many directories were removed.
    pub fn remove_orphaned(&self, prefix: &str) -> usize {
        let mut orphans = Vec::new();
        for parent in self.parents() {
            let Ok(entries) = fs::read_dir(&parent) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name();
                let Some(owner) = name
                    .to_str()
                    .and_then(|n| n.strip_prefix(prefix))
                    .and_then(parse_owner)
                else {
                    continue;
                };
                if !owner_runs(owner) {
                    orphans.push(entry.path());
                }
            }
        }
        let found = orphans.len();
        found - end_and_remove(orphans, ORPHAN_SWEEP_LIMIT).len()
    }

    /// Ends and removes the cgroups of the jails named `<name>-<n>` (one per start of
    /// a sandbox's jail): what a supervisor killed outright leaves, its processes
    /// possibly still running, or frozen (killed mid-snapshot), where no lifeline can
    /// wake them. Thaws them, SIGKILLs what is inside, waits for it to go, removes the
    /// directories. Returns the directories it could not remove.
    pub fn remove_jails_of(&self, name: &str) -> Vec<PathBuf> {
        let mut dirs = Vec::new();
        for parent in self.parents() {
            let Ok(entries) = fs::read_dir(&parent) else {
                continue;
            };
            for entry in entries.flatten() {
                let file_name = entry.file_name();
                let is_jail = file_name
                    .to_str()
                    .and_then(|n| n.strip_prefix(name))
                    .and_then(|n| n.strip_prefix('-'))
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
                if is_jail {
                    dirs.push(entry.path());
                }
            }
        }
        end_and_remove(dirs, 2 * SETTLE_TIMEOUT)
    }
}

/// How long a sweep of dead owners' cgroups (on the start of a `cube run` or of a
/// pooled supervisor) waits for what it killed to go: a killed process is gone in
/// milliseconds, and one that never goes (stuck in the kernel) must not hold up every
/// later start; the next sweep tries again.
const ORPHAN_SWEEP_LIMIT: Duration = Duration::from_secs(1);

/// Thaws the cgroups `dirs` and those nested in them (a jail may have made its own),
/// SIGKILLs what is inside and removes them, innermost first. A killed process leaves
/// its cgroup only once its last thread has exited (its leader shows as a zombie
/// before that): this retries until every directory goes or `limit` has passed.
/// Returns the directories it could not remove.
fn end_and_remove(mut dirs: Vec<PathBuf>, limit: Duration) -> Vec<PathBuf> {
    let start = Instant::now();
    loop {
        dirs.retain(|dir| match end_and_remove_tree(dir) {
            Ok(()) => false,
            Err(e) => e.kind() != io::ErrorKind::NotFound,
        });
        if dirs.is_empty() || start.elapsed() > limit {
            return dirs;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One pass over cgroup `dir`: its nested cgroups first, then its own processes and
/// the directory itself.
fn end_and_remove_tree(dir: &Path) -> io::Result<()> {
    // Best effort: a controller without a freezer has no file to write.
    let _ = fs::write(dir.join("freezer.state"), "THAWED");
    let _ = fs::write(dir.join("cgroup.freeze"), "0");
    // A cgroup's files are not directories: every directory in it is a nested cgroup.
    let mut nested_left = None;
    for entry in fs::read_dir(dir)?.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            if let Err(e) = end_and_remove_tree(&entry.path()) {
                nested_left.get_or_insert(e);
            }
        }
    }
    let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        // SAFETY: kill() has no memory effects; the pid is in a cgroup whose owner is
        // gone (an exited one gives ESRCH).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    match nested_left {
        Some(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => fs::remove_dir(dir),
    }
}

const KNOWN_V1_CONTROLLERS: &[&str] = &[
    "cpu",
    "cpuacct",
    "cpuset",
    "memory",
    "devices",
    "freezer",
    "blkio",
    "pids",
    "net_cls",
    "net_prio",
    "perf_event",
    "hugetlb",
    "rdma",
    "misc",
];

fn relative_to_root(path: &str, mount_root: &str) -> PathBuf {
    let rel = Path::new(path)
        .strip_prefix(mount_root)
        .unwrap_or(Path::new(path));
    rel.strip_prefix("/").unwrap_or(rel).to_path_buf()
}

/// Undoes the octal escapes (`\040` for space) of mountinfo fields.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let oct = std::str::from_utf8(&bytes[i + 1..i + 4]).unwrap_or("");
            if let Ok(v) = u8::from_str_radix(oct, 8) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn malformed(what: &'static str, line: &str) -> CgroupError {
    CgroupError::Malformed {
        what,
        line: line.to_owned(),
    }
}

fn read(path: impl AsRef<Path>) -> Result<String> {
    let path = path.as_ref();
    fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn write(path: impl AsRef<Path>, value: &str) -> Result<()> {
    let path = path.as_ref();
    fs::write(path, value).map_err(|source| CgroupError::Write {
        path: path.to_path_buf(),
        value: value.to_owned(),
        source,
    })
}

/// How a sandbox is frozen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Freezer {
    /// `cgroup.freeze` of this v2 cgroup directory.
    V2(PathBuf),
    /// `freezer.state` of this v1 cgroup directory.
    V1(PathBuf),
}

/// The cgroup directories of one sandbox. Dropping it kills what is left inside and
/// removes the directories; [`SandboxCgroup::remove`] does the same and reports errors.
#[derive(Debug)]
pub struct SandboxCgroup {
    /// Every directory the sandbox's processes join, v2 first.
    dirs: Vec<(CgroupVersion, PathBuf)>,
    memory: Option<(CgroupVersion, PathBuf)>,
    pids: Option<(CgroupVersion, PathBuf)>,
    freezer: Option<Freezer>,
    removed: bool,
}

impl SandboxCgroup {
    /// Creates the sandbox's cgroup `name` in every hierarchy needed for `limits`, the
    /// freezer and process tracking, and writes the limits.
    pub fn create(layout: &CgroupLayout, name: &str, limits: &Limits) -> Result<Self> {
        limits.validate()?;
        let mut cg = SandboxCgroup {
            dirs: Vec::new(),
            memory: None,
            pids: None,
            freezer: None,
            removed: false,
        };
        // v2 controllers to enable on the way down.
        let v2_ctrls: Vec<&'static str> = ["memory", "cpu", "pids"]
            .into_iter()
            .filter(|c| layout.v2.as_ref().is_some_and(|h| h.has(c)))
            .collect();
        if let Some(v2) = &layout.v2 {
            // Directly under the hierarchy root: v2 forbids controllers on a cgroup
            // that holds processes, which this process's own cgroup usually does.
            let parent = v2.mount.join(PARENT_DIR);
            let dir = parent.join(name);
            create_under_shared_parent(&parent, &dir, |parent| {
                for c in &v2_ctrls {
                    enable_controller(&v2.mount, c)?;
                    enable_controller(parent, c)?;
                }
                Ok(())
            })?;
            cg.dirs.push((CgroupVersion::V2, dir.clone()));
            if dir.join("cgroup.freeze").exists() {
                cg.freezer = Some(Freezer::V2(dir));
            }
        }
        let wanted: [(&'static str, bool); 4] = [
            ("memory", true),
            ("cpu", limits.cpu_quota.is_some()),
            ("pids", true),
            ("freezer", cg.freezer.is_none()),
        ];
        for (ctrl, want) in wanted {
            if !want {
                continue;
            }
            let Some(h) = layout.provider(ctrl) else {
                continue;
            };
            let dir = match h.version {
                CgroupVersion::V2 => cg.dirs[0].1.clone(),
                CgroupVersion::V1 => {
                    // Under this process's own cgroup: v1 allows it and it keeps whatever
                    // limits the launcher of this process imposed.
                    let parent = h.mount.join(&h.own_path).join(PARENT_DIR);
                    let dir = parent.join(name);
                    if !cg.dirs.iter().any(|(_, d)| *d == dir) {
                        if let Err(e) = create_under_shared_parent(&parent, &dir, |_| Ok(())) {
                            cg.cleanup_quietly();
                            return Err(e);
                        }
                        cg.dirs.push((CgroupVersion::V1, dir.clone()));
                    }
                    dir
                }
            };
            match ctrl {
                "memory" => cg.memory = Some((h.version, dir)),
                "pids" => cg.pids = Some((h.version, dir)),
                "freezer" => cg.freezer = Some(Freezer::V1(dir)),
                _ => {}
            }
        }
        if let Err(e) = cg.apply_limits(layout, limits) {
            cg.cleanup_quietly();
            return Err(e);
        }
        Ok(cg)
    }

    /// Writes new limits into the existing cgroups (memory and pids always; CPU only
    /// where the sandbox was created with a CPU limit).
    pub fn set_limits(&self, layout: &CgroupLayout, limits: &Limits) -> Result<()> {
        limits.validate()?;
        self.apply_limits(layout, limits)
    }

    fn apply_limits(&self, layout: &CgroupLayout, limits: &Limits) -> Result<()> {
        if let Some(bytes) = limits.memory_bytes {
            let (version, dir) = self
                .memory
                .as_ref()
                .ok_or(CgroupError::MissingController("memory"))?;
            let v = bytes.to_string();
            match version {
                CgroupVersion::V2 => {
                    write(dir.join("memory.max"), &v)?;
                    let swap = dir.join("memory.swap.max");
                    if swap.exists() {
                        write(swap, "0")?;
                    }
                }
                CgroupVersion::V1 => {
                    let memory = dir.join("memory.limit_in_bytes");
                    let memsw = dir.join("memory.memsw.limit_in_bytes");
                    if !memsw.exists() {
                        write(memory, &v)?;
                    } else {
                        // The kernel keeps memory at most memory+swap at every step:
                        // a limit raised moves memory+swap first, a lowered one last.
                        let current = std::fs::read_to_string(&memory)
                            .ok()
                            .and_then(|s| s.trim().parse::<u64>().ok());
                        if current.is_some_and(|c| bytes > c) {
                            write(memsw, &v)?;
                            write(memory, &v)?;
                        } else {
                            write(memory, &v)?;
                            write(memsw, &v)?;
                        }
                    }
                }
            }
        }
        if let Some(quota) = limits.cpu_quota {
            let h = layout
                .provider("cpu")
                .ok_or(CgroupError::MissingController("cpu"))?;
            let dir = self.dir_in(h)?;
            let q = ((quota * CPU_PERIOD_US as f64) as u64).max(1000);
            match h.version {
                CgroupVersion::V2 => write(dir.join("cpu.max"), &format!("{q} {CPU_PERIOD_US}"))?,
                CgroupVersion::V1 => {
                    write(dir.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                    write(dir.join("cpu.cfs_quota_us"), &q.to_string())?;
                }
            }
        }
        if let Some(max) = limits.pids_max {
            let (_, dir) = self
                .pids
                .as_ref()
                .ok_or(CgroupError::MissingController("pids"))?;
            write(dir.join("pids.max"), &max.to_string())?;
        }
        Ok(())
    }

    fn dir_in(&self, h: &Hierarchy) -> Result<&Path> {
        self.dirs
            .iter()
            .find(|(v, d)| *v == h.version && d.starts_with(&h.mount))
            .map(|(_, d)| d.as_path())
            .ok_or(CgroupError::MissingController("cpu"))
    }

    /// The directories the sandbox's processes belong to.
    pub fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.dirs.iter().map(|(_, d)| d.as_path())
    }

    /// The `cgroup.procs` files a process writes `0` into to join the sandbox.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .map(|(_, d)| d.join("cgroup.procs"))
            .collect()
    }

    /// How a new, single-threaded process joins the sandbox without the kernel's
    /// global cgroup migration lock, whose write side waits for an RCU grace period
    /// (intermittently 10-20 ms on the CI hosts): the v2 directory, to be given to
    /// `clone3` with `CLONE_INTO_CGROUP` (a fork needs only the lock's read side), and
    /// the v1 `tasks` files, into which the process writes `0` (moving only the calling
    /// thread skips the lock; for a single-threaded process that is the whole process).
    pub fn join_points(&self) -> (Option<&Path>, Vec<PathBuf>) {
        let v2 = self
            .dirs
            .iter()
            .find(|(v, _)| *v == CgroupVersion::V2)
            .map(|(_, d)| d.as_path());
        let v1 = self
            .dirs
            .iter()
            .filter(|(v, _)| *v == CgroupVersion::V1)
            .map(|(_, d)| d.join("tasks"))
            .collect();
        (v2, v1)
    }

    /// The freezer in use, if any.
    pub fn freezer(&self) -> Option<&Freezer> {
        self.freezer.as_ref()
    }

    /// Host PIDs of every process in any of the sandbox's cgroups.
    pub fn procs(&self) -> Result<Vec<i32>> {
        let mut pids = Vec::new();
        for (_, dir) in &self.dirs {
            let path = dir.join("cgroup.procs");
            for line in read(&path)?.lines() {
                let pid: i32 = line
                    .trim()
                    .parse()
                    .map_err(|_| malformed("cgroup.procs", line))?;
                if !pids.contains(&pid) {
                    pids.push(pid);
                }
            }
        }
        Ok(pids)
    }

    /// How many times the memory limit triggered the OOM killer (None without memory
    /// controller or counter).
    pub fn oom_kills(&self) -> Result<Option<u64>> {
        let Some((version, dir)) = &self.memory else {
            return Ok(None);
        };
        let (file, key) = match version {
            CgroupVersion::V2 => ("memory.events", "oom_kill"),
            CgroupVersion::V1 => ("memory.oom_control", "oom_kill"),
        };
        keyed_counter(&dir.join(file), key)
    }

    /// Processes and threads charged against `pids.max` now (`pids.current`): one
    /// number the kernel keeps, unlike [`SandboxCgroup::procs`], which reads each
    /// hierarchy's list at a different moment.
    pub fn pids_current(&self) -> Result<Option<u64>> {
        let Some((_, dir)) = &self.pids else {
            return Ok(None);
        };
        let path = dir.join("pids.current");
        let text = read(&path)?;
        text.trim()
            .parse()
            .map(Some)
            .map_err(|_| malformed("pids.current", &text))
    }

    /// How many times a fork was refused because of `pids.max`.
    pub fn pids_max_hits(&self) -> Result<Option<u64>> {
        let Some((_, dir)) = &self.pids else {
            return Ok(None);
        };
        keyed_counter(&dir.join("pids.events"), "max")
    }

    /// Stops every process of the sandbox and waits until the kernel reports it frozen.
    pub fn freeze(&self) -> Result<()> {
        match self.freezer.as_ref().ok_or(CgroupError::NoFreezer)? {
            Freezer::V2(dir) => {
                write(dir.join("cgroup.freeze"), "1")?;
                wait_for(dir, "frozen", || {
                    Ok(keyed_counter(&dir.join("cgroup.events"), "frozen")? == Some(1))
                })
            }
            Freezer::V1(dir) => {
                let state = dir.join("freezer.state");
                write(&state, "FROZEN")?;
                // The v1 freezer can stay in FREEZING when a task was forking or in the
                // middle of a signal; asking again restarts the freeze, as runc does.
                wait_for(dir, "frozen", || {
                    if read(&state)?.trim() == "FROZEN" {
                        return Ok(true);
                    }
                    write(&state, "FROZEN")?;
                    Ok(false)
                })
            }
        }
    }

    /// Lets the sandbox's processes run again.
    pub fn thaw(&self) -> Result<()> {
        match self.freezer.as_ref().ok_or(CgroupError::NoFreezer)? {
            Freezer::V2(dir) => {
                write(dir.join("cgroup.freeze"), "0")?;
                wait_for(dir, "thawed", || {
                    Ok(keyed_counter(&dir.join("cgroup.events"), "frozen")? == Some(0))
                })
            }
            Freezer::V1(dir) => {
                let state = dir.join("freezer.state");
                write(&state, "THAWED")?;
                wait_for(dir, "thawed", || Ok(read(&state)?.trim() == "THAWED"))
            }
        }
    }

    /// SIGKILLs every process in the sandbox's cgroups, thawing them first so the signal
    /// is delivered, and waits until none is left. Zombies whose parent is outside the
    /// sandbox stay listed until reaped, so the caller reaps its child before calling.
    pub fn kill_all(&self) -> Result<()> {
        if self.freezer.is_some() {
            self.thaw()?;
        }
        let v2_kill = self
            .dirs
            .iter()
            .find(|(v, _)| *v == CgroupVersion::V2)
            .map(|(_, d)| d.join("cgroup.kill"))
            .filter(|p| p.exists());
        let start = Instant::now();
        loop {
            let pids = self.procs()?;
            if pids.is_empty() {
                return Ok(());
            }
            if let Some(kill) = &v2_kill {
                write(kill, "1")?;
            } else {
                for pid in pids {
                    // SAFETY: kill() has no memory effects; a PID that has exited in the
                    // meantime gives ESRCH, which is fine.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            if start.elapsed() > SETTLE_TIMEOUT {
                return Err(CgroupError::Timeout {
                    path: self.dirs.first().map(|d| d.1.clone()).unwrap_or_default(),
                    state: "empty",
                    timeout: SETTLE_TIMEOUT,
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Kills what is left and removes every directory of the sandbox.
    pub fn remove(mut self) -> Result<()> {
        self.remove_inner()
    }

    fn remove_inner(&mut self) -> Result<()> {
        if self.removed {
            return Ok(());
        }
        self.kill_all()?;
        for (_, dir) in self.dirs.iter().rev() {
            remove_dir(dir)?;
            // The shared parent goes too once empty, so that nothing of Cube stays in
            // someone else's cgroup; a sibling still in use keeps it (EBUSY).
            if let Some(parent) = dir.parent() {
                let _ = fs::remove_dir(parent);
            }
        }
        self.removed = true;
        Ok(())
    }

    fn cleanup_quietly(&mut self) {
        if let Err(e) = self.remove_inner() {
            tracing::warn!(error = %e, "leaving a sandbox cgroup behind");
        }
    }
}

impl Drop for SandboxCgroup {
    fn drop(&mut self) {
        self.cleanup_quietly();
    }
}

fn keyed_counter(path: &Path, key: &str) -> Result<Option<u64>> {
    if !path.exists() {
        return Ok(None);
    }
    for line in read(path)?.lines() {
        let mut it = line.split_whitespace();
        if it.next() == Some(key) {
            let v = it
                .next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| malformed("cgroup counter file", line))?;
            return Ok(Some(v));
        }
    }
    Ok(None)
}

fn wait_for(dir: &Path, state: &'static str, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(20);
    loop {
        if done()? {
            return Ok(());
        }
        if start.elapsed() > SETTLE_TIMEOUT {
            return Err(CgroupError::Timeout {
                path: dir.to_path_buf(),
                state,
                timeout: SETTLE_TIMEOUT,
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(2));
    }
}

/// Creates `dir` inside the shared `parent`, creating the parent (and running `prepare`
/// on it) as needed. A concurrent destroy may remove an empty parent between the two
/// steps, so a vanished parent is retried.
fn create_under_shared_parent(
    parent: &Path,
    dir: &Path,
    prepare: impl Fn(&Path) -> Result<()>,
) -> Result<()> {
    let mut attempts = 0;
    loop {
        attempts += 1;
        ensure_dir(parent)?;
        let prepared = prepare(parent).and_then(|()| create_dir(dir));
        match prepared {
            Err(
                CgroupError::Create { source, .. }
                | CgroupError::Write { source, .. }
                | CgroupError::Read { source, .. },
            ) if source.kind() == io::ErrorKind::NotFound && attempts < 5 => {}
            other => return other,
        }
    }
}

fn ensure_dir(path: &Path) -> Result<()> {
    match fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(CgroupError::Create {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn create_dir(path: &Path) -> Result<()> {
    fs::create_dir(path).map_err(|source| CgroupError::Create {
        path: path.to_path_buf(),
        source,
    })
}

fn remove_dir(path: &Path) -> Result<()> {
    let start = Instant::now();
    loop {
        match fs::remove_dir(path) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            // The kernel may still be tearing down just-killed tasks.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && start.elapsed() < SETTLE_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(source) => {
                return Err(CgroupError::Remove {
                    path: path.to_path_buf(),
                    source,
                })
            }
        }
    }
}

/// `<pid>` or `<pid>-<start ticks>-<anything>`: the pid, and the start time when given.
fn parse_owner(name: &str) -> Option<(u32, Option<u64>)> {
    let mut parts = name.splitn(3, '-');
    let pid = parts.next()?.parse().ok()?;
    match parts.next() {
        None => Some((pid, None)),
        Some(ticks) => Some((pid, Some(ticks.parse().ok()?))),
    }
}

/// Whether the process `(pid, start ticks)` has not exited: a zombie (killed, not yet
/// reaped by its parent) counts as gone, and so does another process that got the pid
/// since (its start time differs).
fn owner_runs((pid, start_ticks): (u32, Option<u64>)) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        // The state follows the command name, which is in parentheses and may itself
        // hold ") "; the start time is the 20th field after it.
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| {
            let mut fields = rest.split_whitespace();
            let running = fields.next().is_some_and(|state| state != "Z");
            running
                && start_ticks.is_none_or(|want| {
                    fields.nth(18).and_then(|t| t.parse::<u64>().ok()) == Some(want)
                })
        }),
    }
}

fn enable_controller(dir: &Path, controller: &str) -> Result<()> {
    let control = dir.join("cgroup.subtree_control");
    if read(&control)?.split_whitespace().any(|c| c == controller) {
        return Ok(());
    }
    write(control, &format!("+{controller}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID_MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
38 31 0:35 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
39 31 0:36 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
40 31 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const HYBRID_CGROUP: &str = "\
9:name=systemd:/
8:pids:/
4:memory:/process_api/abc
1:cpu:/
0::/
";

    #[test]
    fn parses_a_hybrid_layout() {
        let l = CgroupLayout::parse(HYBRID_MOUNTINFO, HYBRID_CGROUP).unwrap();
        assert_eq!(l.kind(), LayoutKind::Hybrid);
        let v2 = l.v2.as_ref().unwrap();
        assert_eq!(v2.mount, Path::new("/sys/fs/cgroup/unified"));
        assert_eq!(l.v1.len(), 3, "name=systemd carries no controller");
        let mem = l.provider("memory").unwrap();
        assert_eq!(mem.version, CgroupVersion::V1);
        assert_eq!(mem.own_path, Path::new("process_api/abc"));
        assert!(l.provider("freezer").is_none());
    }

    #[test]
    fn parses_a_unified_layout_and_prefers_v2_controllers() {
        let mi = "25 20 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n";
        let mut l = CgroupLayout::parse(mi, "0::/user.slice/session-1.scope\n").unwrap();
        assert_eq!(l.kind(), LayoutKind::Unified);
        l.v2.as_mut().unwrap().controllers = vec!["memory".into(), "pids".into()];
        assert_eq!(l.provider("memory").unwrap().version, CgroupVersion::V2);
        assert_eq!(
            l.v2.as_ref().unwrap().own_path,
            Path::new("user.slice/session-1.scope")
        );
        assert!(l.provider("cpu").is_none());
    }

    #[test]
    fn rejects_malformed_input() {
        assert!(CgroupLayout::parse("garbage line\n", "").is_err());
        assert!(CgroupLayout::parse("", "no-colons\n").is_err());
    }

    #[test]
    fn unescapes_mountinfo_fields() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape("/plain"), "/plain");
    }

    #[test]
    fn validates_limits() {
        assert!(Limits::default().validate().is_ok());
        let bad = Limits {
            cpu_quota: Some(f64::NAN),
            ..Limits::default()
        };
        assert!(bad.validate().is_err());
        let bad = Limits {
            pids_max: Some(0),
            ..Limits::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn detects_this_host() {
        let l = CgroupLayout::detect().unwrap();
        assert!(
            l.v2.is_some() || !l.v1.is_empty(),
            "no cgroups mounted: {l:?}"
        );
    }
}
