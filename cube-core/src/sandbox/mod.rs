//! The engine-neutral `Sandbox` API.
//!
//! A [`Runtime`] owns the store and a pool of pre-started supervisors; a [`Sandbox`] is a
//! handle on one sandbox's supervisor. Sandboxes outlive the handle (and the process)
//! unless created ephemeral: [`Sandbox::destroy`] ends them.
//!
//! Two engines sit behind it ([`Engine`]): KVM microVMs, and jails (namespaces,
//! cgroups, seccomp, a copy-on-write writable layer over the host's read-only
//! userland; weaker isolation, one shared kernel). A template records its engine;
//! [`HOST_TEMPLATE`] is the built-in jail template. A jail's snapshots are of kind
//! [`SnapshotKind::Full`] where a working CRIU exists: processes (interpreter contexts
//! included) and files come back at rollback, clone and wake. Elsewhere they are of
//! kind [`SnapshotKind::Filesystem`], with the reason in [`Snapshot::fallback`]:
//! rollback, clone and wake restore the files and restart the processes.
//!
//! # Example
//!
//! The whole life of a sandbox: create, run a cell, snapshot, break something, roll
//! back, clone, destroy. (`no_run`: the jail engine needs root for namespaces, mounts
//! and cgroups. `cube-core/examples/agent_loop.rs` is the same as a program to run.)
//!
//! ```no_run
//! use cube_agent::protocol::Language;
//! use cube_core::{CreateOptions, Runtime, RuntimeConfig, HOST_TEMPLATE};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let rt = Runtime::open(RuntimeConfig {
//!     store_root: "/var/lib/cube".into(),
//!     pool_size: 0,
//!     network_pool_size: 0,
//!     supervisor: None,
//! })?;
//! let mut sb = rt.create(HOST_TEMPLATE, CreateOptions::new(true))?;
//!
//! let agent = sb.agent()?;
//! agent.create_context("main", Language::Python, Some("/home/user"))?;
//! let r = agent.run_code("main", "open('notes', 'w').write('v1')\n6 * 7", None)?;
//! assert_eq!(r.value.as_deref(), Some("42"));
//!
//! drop(agent);
//! let snap = sb.snapshot()?; // full with CRIU (connections end), else filesystem
//! let agent = sb.agent()?;
//! agent.run_code("main", "import os; os.remove('notes')", None)?;
//! drop(agent);
//! sb.rollback(&snap.id)?; // the file is back (and the interpreter's state, if full)
//!
//! let clones = rt.clone_sandbox(&mut sb, 2, 2, CreateOptions::new(true))?;
//! for clone in clones {
//!     clone.destroy()?;
//! }
//! sb.destroy()?;
//! # Ok(())
//! # }
//! ```

pub mod metadata;
pub mod network;
mod portable;
mod runtime;

use std::path::{Path, PathBuf};

pub use metadata::{Engine, EngineChoice, SandboxMeta, SnapshotKind, SnapshotMeta, TemplateMeta};
pub use network::{
    NetnsChoice, NetworkCounters, NetworkOptions, NetworkPolicy, NetworkReport, PortMapping,
};
pub use portable::{ExportReport, ImportReport, PortableError};
pub use runtime::{CreateOptions, Runtime, RuntimeConfig};

/// The built-in jail template: the host's own userland (with its python3), read-only,
/// under a per-sandbox writable layer. Always listed, nothing to build.
pub const HOST_TEMPLATE: &str = "host";

/// Processes and threads a jail sandbox may have at once when its creator names no
/// limit ([`CreateOptions::pids_max`]), on hosts with a pids cgroup controller: a fork
/// bomb stops here instead of filling the host's PID space, and interpreters, builds
/// and test runners stay far below it.
pub const DEFAULT_PIDS_MAX: u32 = 4096;

use crate::supervisor::protocol::{Request, Response, StatusReport};
use crate::supervisor::{ClientError, SupervisorClient};
use crate::vmm::machine::SnapshotStats;

/// Why a sandbox operation failed.
///
/// Callers match on the variants that mean "the name is wrong"
/// ([`SandboxError::UnknownSandbox`], [`SandboxError::UnknownTemplate`],
/// [`SandboxError::UnknownSnapshot`]) to tell them from failures of the host:
///
/// ```
/// use cube_core::{Runtime, RuntimeConfig, SandboxError};
///
/// let store = tempfile::tempdir().unwrap();
/// let rt = Runtime::open(RuntimeConfig {
///     store_root: store.path().into(),
///     pool_size: 0,
///     network_pool_size: 0,
///     // Started when a sandbox is created; opening and reading the store need none.
///     supervisor: Some("/usr/local/bin/cube-supervisor".into()),
/// })
/// .unwrap();
/// match rt.attach("sb-0000000000000000") {
///     Err(SandboxError::UnknownSandbox(id)) => assert_eq!(id, "sb-0000000000000000"),
///     other => panic!("expected UnknownSandbox, got {:?}", other.err()),
/// }
/// ```
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The store failed.
    #[error("Store")]
    Store(#[from] cube_storage::StoreError),
    /// A metadata file is damaged or could not be written.
    #[error("Metadata")]
    Metadata(#[from] cube_storage::MetadataError),
    /// Copying a file failed.
    #[error("Copying")]
    Clone(#[from] cube_storage::CloneError),
    /// A supervisor could not be started.
    #[error("Supervisor")]
    Pool(#[from] crate::supervisor::PoolError),
    /// The supervisor reported a failure.
    #[error("Sandbox {id}")]
    Supervisor {
        /// The sandbox.
        id: String,
        /// What failed.
        #[source]
        source: ClientError,
    },
    /// No sandbox with this id.
    #[error("No sandbox named {0}")]
    UnknownSandbox(String),
    /// No template with this name.
    #[error("No template named {0} (list them with `cube template ls`)")]
    UnknownTemplate(String),
    /// A template of this name exists.
    #[error("Template {0} already exists")]
    TemplateExists(String),
    /// No snapshot with this id.
    #[error("No snapshot named {0}")]
    UnknownSnapshot(String),
    /// The snapshot belongs to another sandbox.
    #[error("Snapshot {snapshot} belongs to sandbox {owner}, not {sandbox}")]
    NotOwner {
        /// The snapshot.
        snapshot: String,
        /// Its owner.
        owner: String,
        /// The sandbox that asked.
        sandbox: String,
    },
    /// A filesystem operation failed.
    #[error("{0}")]
    Io(String, #[source] std::io::Error),
    /// A snapshot or template could not be made durable.
    #[error("Flushing to disk")]
    Durability(#[from] crate::snapshot::durability::DurabilityError),
    /// A worker thread panicked.
    #[error("A worker thread failed")]
    Thread,
    /// The template or snapshot is made for another engine than the one asked for.
    #[error("{what} runs on the {engine} engine, not {asked} (ask for --engine {engine} or auto)")]
    EngineMismatch {
        /// The template or snapshot.
        what: String,
        /// Its engine.
        engine: Engine,
        /// The engine asked for.
        asked: EngineChoice,
    },
    /// The template is used by sandboxes (their roots lie on its tree).
    #[error("Template {name} is in use by sandbox {sandboxes} (destroy them first)")]
    TemplateInUse {
        /// The template.
        name: String,
        /// The sandboxes using it, comma-separated.
        sandboxes: String,
    },
    /// A template's record or files are damaged.
    #[error("{0}")]
    BadTemplate(String),
    /// A template could not be built.
    #[error("Building template {0}")]
    Build(String, #[source] crate::template_build::TemplateBuildError),
    /// A VM template could not be built.
    #[error("Building VM template {0}")]
    VmTemplate(String, #[source] crate::vm_template::VmTemplateError),
    /// A built-in template cannot be changed.
    #[error("Template {0} is built in")]
    BuiltInTemplate(String),
    /// The sandbox's engine has no in-sandbox agent yet.
    #[error("Sandboxes of the {0} engine have no agent yet")]
    NoAgent(Engine),
    /// The sandbox is hibernated: it has no processes, its agent included.
    #[error("Sandbox {0} is hibernated: wake it first")]
    Hibernated(String),
    /// The sandbox's network could not be set up or changed.
    #[error("Network")]
    Network(#[source] crate::supervisor::jail_network::JailNetworkError),
    /// The agent inside the sandbox's VM could not be reached.
    #[error("Sandbox {0}'s agent")]
    VmAgent(String, #[source] crate::vm_agent::VmAgentError),
    /// The sandbox's agent could not be reached.
    #[error("Sandbox {0}'s agent")]
    Agent(String, #[source] cube_agent::client::ClientError),
    /// A snapshot could not be exported or imported.
    #[error("Snapshot archive")]
    Portable(#[from] PortableError),
}

/// A snapshot a sandbox took.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// Snapshot id.
    pub id: String,
    /// Its directory.
    pub dir: PathBuf,
    /// What writing it cost.
    pub stats: SnapshotStats,
    /// What it holds: the whole state, or the filesystem only.
    pub kind: SnapshotKind,
    /// Why a jail's snapshot holds the filesystem only (no working CRIU, or its dump
    /// failed); None for a full one.
    pub fallback: Option<String>,
}

/// A handle on one sandbox.
pub struct Sandbox {
    id: String,
    engine: Engine,
    dir: PathBuf,
    client: SupervisorClient,
    store: cube_storage::Store,
}

impl Sandbox {
    /// The sandbox's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The sandbox's directory in the store.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The sandbox's engine.
    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// A new connection to the sandbox's agent (handshake done). Any number may be
    /// open at once, from any process: the agent listens on `agent.sock` in the
    /// sandbox's directory. While the sandbox is paused the handshake waits for
    /// [`Sandbox::resume`] (up to [`cube_agent::client::HANDSHAKE_TIMEOUT`]); a
    /// hibernated sandbox is an error. A full-state snapshot, rollback, clone or
    /// hibernation ends every connection (CRIU cannot save one to the host): connect
    /// again afterwards.
    ///
    /// A VM sandbox's agent is reached over the vsock device's host socket
    /// (`vsock.sock`) with its `CONNECT` handshake; a guest whose agent does not
    /// answer within [`crate::vm_agent::DEFAULT_CONNECT_TIMEOUT`] is an error
    /// ([`crate::vm_agent::VmAgentError::NotReady`]), never a hang.
    ///
    /// ```no_run
    /// // no_run: the jail engine needs root (namespaces, mounts, cgroups).
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let rt = cube_core::Runtime::open(cube_core::RuntimeConfig::new()?)?;
    /// let sb = rt.attach("sb-0123456789abcdef")?;
    /// let out = sb.agent()?.exec(cube_agent::protocol::ExecRequest {
    ///     argv: vec!["uname".into(), "-r".into()],
    ///     ..Default::default()
    /// })?;
    /// print!("{}", String::from_utf8_lossy(&out.stdout));
    /// # Ok(())
    /// # }
    /// ```
    pub fn agent(&self) -> Result<cube_agent::client::Client, SandboxError> {
        if self.engine == Engine::Vm {
            return crate::vm_agent::agent_client(
                &self.dir,
                crate::vm_agent::DEFAULT_CONNECT_TIMEOUT,
            )
            .map_err(|e| SandboxError::VmAgent(self.id.clone(), e));
        }
        // A clear error rather than the dangling socket link's "not found".
        if crate::supervisor::jail_sandbox::is_hibernated(&self.dir) {
            return Err(SandboxError::Hibernated(self.id.clone()));
        }
        let socket = self.dir.join(crate::supervisor::jail_sandbox::AGENT_SOCKET);
        crate::supervisor::jail_sandbox::connect_agent(&socket)
            .map_err(cube_agent::client::ClientError::Connect)
            .and_then(cube_agent::client::Client::new)
            .map_err(|e| SandboxError::Agent(self.id.clone(), e))
    }

    fn call(&mut self, request: &Request) -> Result<Response, SandboxError> {
        self.client
            .call(request)
            .map_err(|source| SandboxError::Supervisor {
                id: self.id.clone(),
                source,
            })
    }

    fn call_ok(&mut self, request: &Request) -> Result<(), SandboxError> {
        self.client
            .call_ok(request)
            .map_err(|source| SandboxError::Supervisor {
                id: self.id.clone(),
                source,
            })
    }

    fn unexpected(&self, response: Response) -> SandboxError {
        SandboxError::Supervisor {
            id: self.id.clone(),
            source: ClientError::Unexpected(format!("{response:?}")),
        }
    }

    /// State as the supervisor reports it.
    pub fn status(&mut self) -> Result<StatusReport, SandboxError> {
        match self.call(&Request::Status)? {
            Response::Status(s) => Ok(s),
            other => Err(self.unexpected(other)),
        }
    }

    /// Stops the vCPUs (VM) or freezes every process (jail); memory stays.
    ///
    /// ```no_run
    /// // no_run: the jail engine needs root (namespaces, mounts, cgroups).
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let rt = cube_core::Runtime::open(cube_core::RuntimeConfig::new()?)?;
    /// let mut sb = rt.attach("sb-0123456789abcdef")?;
    /// sb.pause()?; // frozen: no CPU used, memory kept
    /// sb.resume()?;
    /// sb.hibernate()?; // processes end, the files stay on disk
    /// sb.wake()?; // started afresh on the same files
    /// # Ok(())
    /// # }
    /// ```
    pub fn pause(&mut self) -> Result<(), SandboxError> {
        self.call_ok(&Request::Pause)
    }

    /// Continues after [`Sandbox::pause`].
    pub fn resume(&mut self) -> Result<(), SandboxError> {
        self.call_ok(&Request::Resume)
    }

    /// Takes a snapshot; the sandbox keeps running. A VM's is [`SnapshotKind::Full`]
    /// (only dirty pages are written). A jail's is [`SnapshotKind::Full`] where CRIU
    /// works (its processes dumped, its writable layer reflinked alongside, agent
    /// connections ended), else [`SnapshotKind::Filesystem`] with the reason in
    /// [`Snapshot::fallback`]: the layer, cloned while its processes are frozen.
    pub fn snapshot(&mut self) -> Result<Snapshot, SandboxError> {
        let store = &self.store;
        let id = cube_storage::Store::new_id("snap")?;
        let dest = store.snapshot_dir(&id)?;
        let staging = store.root().join("tmp").join(format!("{id}.staging"));
        let (stats, kind, fallback) = match self.call(&Request::Snapshot {
            staging,
            dest: dest.clone(),
        })? {
            Response::Snapshot {
                stats,
                kind,
                fallback,
            } => (stats, kind, fallback),
            other => return Err(self.unexpected(other)),
        };
        Ok(Snapshot {
            id,
            dir: dest,
            stats,
            kind,
            fallback,
        })
    }

    /// Puts the sandbox back to `snapshot`, which this sandbox must own; it keeps its
    /// id. A full snapshot brings back memory, vCPUs, devices and rootfs; a filesystem
    /// snapshot brings back the files and restarts the processes (the agent too:
    /// open agent connections end, interpreter contexts are gone).
    pub fn rollback(&mut self, snapshot: &str) -> Result<(), SandboxError> {
        let store = &self.store;
        let dir = store.snapshot_dir(snapshot)?;
        let meta: SnapshotMeta = cube_storage::read_verified(
            &dir.join(metadata::SNAPSHOT_META),
            metadata::SNAPSHOT_META_KIND,
        )
        .map_err(|e| match e {
            cube_storage::MetadataError::Read { .. } => {
                SandboxError::UnknownSnapshot(snapshot.to_string())
            }
            other => other.into(),
        })?;
        if meta.sandbox != self.id {
            return Err(SandboxError::NotOwner {
                snapshot: snapshot.to_string(),
                owner: meta.sandbox,
                sandbox: self.id.clone(),
            });
        }
        self.call_ok(&Request::Rollback { snapshot: dir })
    }

    /// Writes the state out and releases the guest's memory (CubeSandbox's "pause").
    /// A jail's processes end and its writable layer stays; [`Sandbox::wake`] starts
    /// them afresh on it.
    pub fn hibernate(&mut self) -> Result<(), SandboxError> {
        self.call_ok(&Request::Hibernate)
    }

    /// Restores after [`Sandbox::hibernate`].
    pub fn wake(&mut self) -> Result<(), SandboxError> {
        self.call_ok(&Request::Wake)
    }

    /// Has the test guest dirty `mib` MiB of memory.
    pub fn guest_dirty(&mut self, mib: u64, pattern: u64) -> Result<(), SandboxError> {
        self.call_ok(&Request::GuestDirty { mib, pattern })
    }

    /// Makes the test guest spin on its counter (true) or idle (false).
    pub fn guest_spin(&mut self, spin: bool) -> Result<(), SandboxError> {
        self.call_ok(&Request::GuestMode { spin })
    }

    /// Waits until the test guest has touched its working set after its last start.
    pub fn guest_wait_working_set(&mut self) -> Result<(), SandboxError> {
        self.call_ok(&Request::GuestWaitWorkingSet)
    }

    /// Reads guest memory.
    pub fn read_memory(&mut self, addr: u64, len: u32) -> Result<Vec<u8>, SandboxError> {
        match self.call(&Request::ReadMemory { addr, len })? {
            Response::Memory(m) => Ok(m),
            other => Err(self.unexpected(other)),
        }
    }

    /// CRC32 of each RAM region.
    pub fn memory_digest(&mut self) -> Result<Vec<u32>, SandboxError> {
        match self.call(&Request::MemoryDigest)? {
            Response::Digest(d) => Ok(d),
            other => Err(self.unexpected(other)),
        }
    }

    /// The sandbox's network: device, policy, exposed ports, counters.
    pub fn network(&mut self) -> Result<NetworkReport, SandboxError> {
        match self.call(&Request::NetworkStatus)? {
            Response::Network(report) => Ok(report),
            other => Err(self.unexpected(other)),
        }
    }

    /// Replaces the sandbox's egress policy; new connections see it at once.
    pub fn set_policy(&mut self, policy: &NetworkPolicy) -> Result<(), SandboxError> {
        policy
            .to_egress()
            .map_err(|e| SandboxError::Network(e.into()))?;
        self.call_ok(&Request::SetPolicy(policy.clone()))
    }

    /// Serves sandbox port `port.sandbox_port` at `port.host_port` on the host's
    /// addresses (not 127.0.0.0/8), TCP.
    pub fn expose(&mut self, port: PortMapping) -> Result<(), SandboxError> {
        self.call_ok(&Request::Expose(port))
    }

    /// Withdraws exposed host port `host_port`.
    pub fn unexpose(&mut self, host_port: u16) -> Result<(), SandboxError> {
        self.call_ok(&Request::Unexpose { host_port })
    }

    /// Ends the sandbox: the supervisor releases the VM and exits, and the sandbox's
    /// directory and snapshots are removed.
    pub fn destroy(mut self) -> Result<(), SandboxError> {
        let result = self.call_ok(&Request::Destroy);
        remove_sandbox_files(&self.store, &self.id, &self.dir)?;
        result
    }
}

/// Removes a sandbox's directory and the snapshots it owns.
pub(crate) fn remove_sandbox_files(
    store: &cube_storage::Store,
    id: &str,
    dir: &Path,
) -> Result<(), SandboxError> {
    for snap in store.list_snapshots()? {
        let snap_dir = store.snapshot_dir(&snap)?;
        let owner = cube_storage::read_verified::<SnapshotMeta>(
            &snap_dir.join(metadata::SNAPSHOT_META),
            metadata::SNAPSHOT_META_KIND,
        )
        .map(|m| m.sandbox)
        .ok();
        if owner.as_deref() == Some(id) {
            std::fs::remove_dir_all(&snap_dir)
                .map_err(|e| SandboxError::Io(format!("removing {}", snap_dir.display()), e))?;
        }
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SandboxError::Io(format!("removing {}", dir.display()), e)),
    }
}
