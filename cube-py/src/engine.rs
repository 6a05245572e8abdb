//! The one place that calls `cube-core`'s Sandbox API: opening runtimes, creating,
//! attaching, listing and cloning sandboxes, and connecting to their agents. The rest of
//! the module goes through these functions, so a change in that API is a change here.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use cube_core::{CreateOptions, Runtime, RuntimeConfig, Sandbox, SandboxError};
use cube_core::{EngineChoice, SandboxMeta, SnapshotKind, HOST_TEMPLATE};

/// Supervisors a Python process keeps started and ready: one hides process start-up
/// from the next create without leaving many idle processes per interpreter.
const POOL_SIZE: usize = 1;

/// Clones started at once by [`clone_sandbox`].
const CLONE_CONCURRENCY: usize = 4;

/// The template a sandbox gets when the caller names none.
pub fn default_template() -> &'static str {
    HOST_TEMPLATE
}

/// Runtimes opened by this process, by store root (`None`: the default store). A
/// runtime owns a supervisor pool, so it is opened once and shared.
static RUNTIMES: Mutex<Option<HashMap<Option<PathBuf>, Arc<Runtime>>>> = Mutex::new(None);

/// The runtime for `store` (the default store when `None`), opened on first use.
pub fn runtime(store: Option<PathBuf>) -> Result<Arc<Runtime>, SandboxError> {
    let mut runtimes = RUNTIMES.lock().unwrap_or_else(PoisonError::into_inner);
    let runtimes = runtimes.get_or_insert_with(HashMap::new);
    if let Some(rt) = runtimes.get(&store) {
        return Ok(Arc::clone(rt));
    }
    let mut config = RuntimeConfig::new()?;
    if let Some(root) = &store {
        config.store_root = root.clone();
    }
    config.pool_size = POOL_SIZE;
    let rt = Arc::new(Runtime::open(config)?);
    runtimes.insert(store, Arc::clone(&rt));
    Ok(rt)
}

/// What the caller asked a new sandbox to be.
pub struct CreateRequest {
    /// `auto`, `jail` or `vm`.
    pub engine: EngineName,
    /// Sandbox-wide environment variables.
    pub env: Vec<(String, String)>,
    /// Labels stored with the sandbox.
    pub metadata: BTreeMap<String, String>,
    /// The sandbox is destroyed after this long.
    pub lifetime: Option<Duration>,
    /// Its network; None: loopback only.
    pub network: Option<cube_core::network::NetworkOptions>,
    /// Memory limit of a jail sandbox, MiB.
    pub memory_mib: Option<u64>,
    /// CPU limit of a jail sandbox, thousandths of a core.
    pub cpu_millis: Option<u32>,
    /// Most processes and threads of a jail sandbox; None: the engine's default.
    pub pids_max: Option<u32>,
    /// Disk limit of a jail sandbox's files, MiB; None: the engine's default.
    pub disk_mib: Option<u64>,
}

/// An engine as named from Python.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineName {
    /// The template's engine.
    Auto,
    /// The namespace jail.
    Jail,
    /// The KVM microVM.
    Vm,
}

impl EngineName {
    /// Parses `auto`, `jail` or `vm`.
    pub fn parse(name: &str) -> Option<EngineName> {
        match name {
            "auto" => Some(EngineName::Auto),
            "jail" => Some(EngineName::Jail),
            "vm" => Some(EngineName::Vm),
            _ => None,
        }
    }
}

/// Where a new sandbox starts from.
pub enum Origin {
    /// A template, by name.
    Template(String),
    /// A snapshot in the store (one of its sandboxes' or an imported one), by id.
    Snapshot(String),
}

/// Creates a sandbox from `origin`.
pub fn create(
    runtime: &Runtime,
    origin: &Origin,
    request: CreateRequest,
) -> Result<Sandbox, SandboxError> {
    let options = CreateOptions {
        engine: match request.engine {
            EngineName::Auto => EngineChoice::Auto,
            EngineName::Jail => EngineChoice::Jail,
            EngineName::Vm => EngineChoice::Vm,
        },
        env: request.env,
        metadata: request.metadata,
        lifetime: request.lifetime,
        network: request.network,
        memory_mib: request.memory_mib,
        cpu_millis: request.cpu_millis,
        pids_max: request.pids_max,
        disk_mib: request.disk_mib,
        ..CreateOptions::default()
    };
    match origin {
        Origin::Template(name) => runtime.create(name, options),
        Origin::Snapshot(id) => runtime.create_from_snapshot(id, options),
    }
}

/// Attaches to a running sandbox.
pub fn attach(runtime: &Runtime, id: &str) -> Result<Sandbox, SandboxError> {
    runtime.attach(id)
}

/// A sandbox as listed.
pub struct SandboxSummary {
    /// Its id.
    pub id: String,
    /// `jail` or `vm`.
    pub engine: String,
    /// The template or snapshot it came from.
    pub origin: String,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix: u64,
    /// The labels it was created with.
    pub metadata: BTreeMap<String, String>,
}

fn summary(meta: SandboxMeta) -> SandboxSummary {
    SandboxSummary {
        id: meta.id,
        engine: meta.engine.to_string(),
        origin: meta.origin,
        created_unix: meta.created_unix,
        metadata: meta.metadata,
    }
}

/// The sandboxes recorded in the runtime's store.
pub fn list(runtime: &Runtime) -> Result<Vec<SandboxSummary>, SandboxError> {
    Ok(runtime.list()?.into_iter().map(summary).collect())
}

/// The engine a sandbox runs on, as Python names it.
pub fn engine_of(sandbox: &Sandbox) -> String {
    sandbox.engine().to_string()
}

/// Where the sandbox's agent listens, when its engine has one: the jail's agent
/// serves `agent.sock` in the sandbox's directory (the Sandbox API contract), which is
/// what `Sandbox::agent` connects to. The module connects itself, on a thread it can
/// abandon, because that handshake has no timeout (see `agent_connect`).
pub fn agent_socket(sandbox: &Sandbox) -> Option<PathBuf> {
    sandbox.agent_socket()
}

/// A snapshot as Python sees it.
pub struct SnapshotSummary {
    /// Its id.
    pub id: String,
    /// `full` (memory and processes too) or `filesystem` (files only: a rollback
    /// restarts the sandbox's processes).
    pub kind: &'static str,
}

fn kind_name(kind: SnapshotKind) -> &'static str {
    match kind {
        SnapshotKind::Full => "full",
        SnapshotKind::Filesystem => "filesystem",
    }
}

/// Takes a snapshot of `sandbox`.
pub fn snapshot(sandbox: &mut Sandbox) -> Result<SnapshotSummary, SandboxError> {
    let snap = sandbox.snapshot()?;
    Ok(SnapshotSummary {
        id: snap.id,
        kind: kind_name(snap.kind),
    })
}

/// Writes snapshot `id` of the runtime's store into the archive file `dest`.
pub fn export_snapshot(
    runtime: &Runtime,
    id: &str,
    dest: &Path,
) -> Result<cube_core::ExportReport, SandboxError> {
    runtime.export_snapshot(id, dest)
}

/// A snapshot an import added to the store.
pub struct ImportedSnapshot {
    /// Its id and kind.
    pub snapshot: SnapshotSummary,
    /// The sandbox it was taken of (on the host it was exported from).
    pub sandbox: String,
    /// The template it lies over.
    pub template: Option<String>,
    /// The archive's length, bytes.
    pub archive_bytes: u64,
}

/// Adds the snapshot in archive `source` to the runtime's store (checked whole first;
/// on any error the store is unchanged).
pub fn import_snapshot(runtime: &Runtime, source: &Path) -> Result<ImportedSnapshot, SandboxError> {
    let report = runtime.import_snapshot(source)?;
    let sandbox = runtime
        .snapshots(None)?
        .into_iter()
        .find(|s| s.id == report.snapshot)
        .map(|s| s.sandbox)
        .unwrap_or_default();
    Ok(ImportedSnapshot {
        snapshot: SnapshotSummary {
            id: report.snapshot,
            kind: kind_name(report.kind),
        },
        sandbox,
        template: report.template,
        archive_bytes: report.archive_bytes,
    })
}

/// Snapshots `sandbox` and starts `n` sandboxes from that snapshot.
pub fn clone_sandbox(
    runtime: &Runtime,
    sandbox: &mut Sandbox,
    n: usize,
) -> Result<Vec<Sandbox>, SandboxError> {
    runtime.clone_sandbox(sandbox, n, CLONE_CONCURRENCY, CreateOptions::default())
}
