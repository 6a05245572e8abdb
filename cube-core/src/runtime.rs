//! The runtime: the store plus a pool of pre-started supervisors; every operation
//! on the store as a whole (create, list, attach, templates) is here.

use std::path::{Path, PathBuf};

use cube_storage::{SandboxDir, SnapshotDir, Store, TemplateDir};
use cube_supervisor::client::SupervisorClient;
use cube_supervisor::network::{NetnsChoice, NetworkOptions};
use cube_supervisor::pool::{locate_supervisor, SupervisorPool};
use cube_supervisor::protocol::{Request, Settings, Source, PROTOCOL_VERSION};
use cube_supervisor::records::{
    now_unix, Engine, ProcessDefaults, SandboxMeta, SnapshotMeta, TemplateMeta, HOST_TEMPLATE,
};
use cube_supervisor::server::WarmFor;
use cube_supervisor::templates::{self, tree::TreeSource, vm::VmTemplateSpec};
use cube_vmm::persist::{MachineConfig, WorkingSet};

/// The name (with its builder's pid and start time) under which a test template's
/// image lies among the templates until it is published: hidden from listings, and
/// removed by the next build once its builder has ended.
const TEMPLATE_BEING_BUILT: &str = ".template";

use crate::engine_choice::EngineChoice;
use crate::error::SandboxError;
use crate::portable::{self, ExportReport, ImportReport};
use crate::sandbox::Sandbox;

/// How a [`Runtime`] is set up.
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Root directory of the store.
    pub store_root: PathBuf,
    /// Supervisors kept started and ready (0: start one per create).
    pub pool_size: usize,
    /// Supervisors kept ready for networked jail sandboxes, each with a network
    /// device already attached into its jail (0: networked creates attach on their
    /// own path). Started at the first networked create, so a runtime that never asks
    /// for a network never touches the host's network pool.
    pub network_pool_size: usize,
    /// The supervisor binary (default: found next to the running executable).
    pub supervisor: Option<PathBuf>,
}

impl RuntimeConfig {
    /// The default store root (see [`Store::default_root`]), a pool of 2, and the
    /// supervisor binary found next to the running executable.
    pub fn new() -> Result<Self, SandboxError> {
        Ok(RuntimeConfig {
            store_root: Store::default_root()?,
            pool_size: 2,
            network_pool_size: 2,
            supervisor: None,
        })
    }
}

/// Options for a new sandbox.
///
/// ```
/// use std::time::Duration;
/// use cube_core::{CreateOptions, EngineChoice};
///
/// let options = CreateOptions {
///     engine: EngineChoice::Jail,
///     env: vec![("MODE".into(), "test".into())],
///     metadata: [("team".to_string(), "search".to_string())].into(),
///     lifetime: Some(Duration::from_secs(600)),
///     memory_mib: Some(512),
///     ..CreateOptions::new(false)
/// };
/// assert!(!options.ephemeral);
/// assert_eq!(options.engine.to_string(), "jail");
/// ```
#[derive(Clone, Debug, Default)]
pub struct CreateOptions {
    /// End the sandbox when the handle that created it is dropped (or its process dies).
    pub ephemeral: bool,
    /// The engine asked for; [`EngineChoice::Auto`] takes the template's. Asking for
    /// an engine the template is not made for is an error, never a silent switch.
    pub engine: EngineChoice,
    /// Sandbox-wide environment variables every process in the sandbox starts with
    /// (jail engine).
    pub env: Vec<(String, String)>,
    /// Labels stored in the sandbox's record, shown by list and inspect.
    pub metadata: std::collections::BTreeMap<String, String>,
    /// The supervisor destroys the sandbox this long after it was created.
    pub lifetime: Option<std::time::Duration>,
    /// Memory limit of the whole sandbox, MiB, its tmpfs included (jail engine). None:
    /// [`DEFAULT_MEMORY_MIB`](crate::DEFAULT_MEMORY_MIB) where the host has a memory
    /// cgroup controller.
    pub memory_mib: Option<u64>,
    /// CPU limit in thousandths of a core (jail engine). None:
    /// [`DEFAULT_CPU_MILLIS`](crate::DEFAULT_CPU_MILLIS) where the host has a cpu
    /// cgroup controller.
    pub cpu_millis: Option<u32>,
    /// Most processes and threads at once (jail engine). None:
    /// [`DEFAULT_PIDS_MAX`](crate::DEFAULT_PIDS_MAX) where the host has a pids cgroup
    /// controller, no limit where it has none.
    pub pids_max: Option<u32>,
    /// Most MiB the sandbox's writable root may hold (jail engine): past it, writes
    /// fail with ENOSPC inside the sandbox. Needs a store with project quotas (`cube
    /// store setup`); None: [`DEFAULT_DISK_MIB`](crate::DEFAULT_DISK_MIB) on such a
    /// store, no limit elsewhere.
    pub disk_mib: Option<u64>,
    /// A network from the host's pool: a veth for a jail, a TAP behind a Linux VM's
    /// NIC; None: loopback only (a VM's NIC, if its template has one, stays unplugged).
    pub network: Option<NetworkOptions>,
    /// The network namespace a jail sandbox lives in (see [`NetnsChoice`]): its own by
    /// default; the host's or an existing one for a Kubernetes pod. A Linux VM given
    /// an existing one (a pod's, made by CNI) is put on that namespace's network: its
    /// NIC is spliced to the namespace's interface and the guest takes its address
    /// (not with `network`; the host's is refused for a VM).
    pub netns: NetnsChoice,
    /// A directory to run a jail sandbox on instead of its template's (or snapshot's)
    /// tree: read-only under the sandbox's writable layer, the host's userland left
    /// out. A container's root filesystem as containerd's snapshotter mounts it. A
    /// snapshot of such a sandbox is created from with the same tree again (this set).
    pub rootfs: Option<PathBuf>,
    /// The working directory of the sandbox's processes (jail engine): where exec and
    /// code run unless they name one. None: the template's (a container image's
    /// WorkingDir), else the sandbox user's home.
    pub workdir: Option<PathBuf>,
    /// The sandbox hosts containers, each with a root filesystem of its own (a
    /// Kubernetes pod): its agent may run a process in a root of its own
    /// ([`cube_agent::protocol::RequestBody::ExecInRoot`]), for which a jail's agent
    /// keeps CAP_SYS_CHROOT (and nothing else). Default false.
    pub hosts_containers: bool,
}

impl CreateOptions {
    /// Defaults, and ephemeral or not; usable in constants.
    ///
    /// ```
    /// use cube_core::{CreateOptions, EngineChoice};
    /// const SCRATCH: CreateOptions = CreateOptions::new(true);
    /// assert!(SCRATCH.ephemeral && SCRATCH.engine == EngineChoice::Auto);
    /// ```
    pub const fn new(ephemeral: bool) -> CreateOptions {
        CreateOptions {
            ephemeral,
            engine: EngineChoice::Auto,
            env: Vec::new(),
            metadata: std::collections::BTreeMap::new(),
            lifetime: None,
            memory_mib: None,
            cpu_millis: None,
            pids_max: None,
            disk_mib: None,
            network: None,
            netns: NetnsChoice::Own,
            rootfs: None,
            workdir: None,
            hosts_containers: false,
        }
    }

    fn settings(&self) -> Settings {
        Settings {
            env: self.env.clone(),
            memory_mib: self.memory_mib,
            cpu_millis: self.cpu_millis,
            pids_max: self.pids_max,
            disk_mib: self.disk_mib,
            lifetime_ms: self
                .lifetime
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            network: self.network.clone(),
            netns: self.netns.clone(),
            cwd: self.workdir.clone(),
            hosts_containers: self.hosts_containers,
        }
    }

    fn check_engine(&self, what: &str, engine: Engine) -> Result<(), SandboxError> {
        if self.engine.accepts(engine) {
            return Ok(());
        }
        Err(SandboxError::EngineMismatch {
            what: what.to_string(),
            engine,
            asked: self.engine,
        })
    }
}

/// The entry point: creates, lists and reattaches sandboxes, and builds templates.
///
/// Opening a store and reading it needs no privileges:
///
/// ```
/// use cube_core::{Engine, Runtime, RuntimeConfig, HOST_TEMPLATE};
///
/// let store = tempfile::tempdir().unwrap();
/// let rt = Runtime::open(RuntimeConfig {
///     store_root: store.path().into(),
///     pool_size: 0, // start a supervisor per create instead of keeping some warm
///     network_pool_size: 0,
///     // Started when a sandbox is created; opening and reading the store need none.
///     supervisor: Some("/usr/local/bin/cube-supervisor".into()),
/// })
/// .unwrap();
/// let templates = rt.templates().unwrap();
/// assert!(templates.iter().any(|t| t.name == HOST_TEMPLATE && t.engine == Engine::Jail));
/// assert!(rt.list().unwrap().is_empty());
/// assert!(rt.snapshots(None).unwrap().is_empty());
/// ```
pub struct Runtime {
    store: Store,
    pool: SupervisorPool,
    /// Supervisors for networked jail sandboxes (see
    /// [`RuntimeConfig::network_pool_size`]); started by the first networked create.
    network_pool: std::sync::OnceLock<SupervisorPool>,
    network_pool_size: usize,
}

fn io_error(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> SandboxError {
    let what = what.to_string();
    move |e| SandboxError::Io(what, e)
}

impl Runtime {
    /// Opens the store and starts the supervisor pool.
    pub fn open(config: RuntimeConfig) -> Result<Runtime, SandboxError> {
        let store = Store::open(&config.store_root)?;
        let exe = match config.supervisor {
            Some(p) => p,
            None => locate_supervisor()?,
        };
        // Pooled supervisors start a host-template jail in the store's scratch
        // directory (renamed into the sandbox on adoption) where the host can.
        // Only pooled ones: on the create path it would cost what it saves.
        let scratch = (config.pool_size > 0).then(|| store.tmp_dir());
        Ok(Runtime {
            store,
            pool: SupervisorPool::with_scratch(exe, config.pool_size, scratch),
            network_pool: std::sync::OnceLock::new(),
            network_pool_size: config.network_pool_size,
        })
    }

    /// The pool a create takes its supervisor from: networked jail sandboxes from
    /// their own (started on first use), everything else from the main one.
    fn supervisors_for(&self, engine: Engine, networked: bool) -> &SupervisorPool {
        if engine != Engine::Jail || !networked || self.network_pool_size == 0 {
            return &self.pool;
        }
        self.network_pool.get_or_init(|| {
            SupervisorPool::networked(
                self.pool.exe().to_path_buf(),
                self.network_pool_size,
                self.store.tmp_dir(),
            )
        })
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Waits until the supervisor pool is full (for benchmarks).
    pub fn wait_pool_ready(&self) {
        self.pool.wait_full();
        if let Some(pool) = self.network_pool.get() {
            pool.wait_full();
        }
    }

    /// Boots the synthetic test guest, waits until it has settled, and snapshots it as
    /// template `name`. Each sandbox created from it gets a sparse writable disk image
    /// of `rootfs_bytes` (0: none), copy-on-write from the template's.
    pub fn build_test_template(
        &self,
        name: &str,
        machine: MachineConfig,
        working_set: WorkingSet,
        rootfs_bytes: u64,
    ) -> Result<TemplateMeta, SandboxError> {
        let dest = self.store.template(name)?;
        if dest.exists() || name == HOST_TEMPLATE {
            return Err(SandboxError::TemplateExists(name.to_string()));
        }
        let templates = Store::areas_at(self.store.root()).templates;
        // What builds killed outright left (no listing shows it, being hidden).
        cube_storage::remove_dead_scratch(&templates, TEMPLATE_BEING_BUILT);
        let mut builder = self.start(
            Source::BootTestGuest {
                config: machine,
                working_set,
            },
            Engine::Vm,
            &format!("build of template {name}"),
            CreateOptions::new(true),
            |dir| {
                if rootfs_bytes > 0 {
                    let f = std::fs::File::create(SandboxDir::new(dir).rootfs())
                        .map_err(io_error("creating the template disk"))?;
                    f.set_len(rootfs_bytes)
                        .map_err(io_error("sizing the template disk"))?;
                }
                Ok(())
            },
        )?;
        // Once set up, the builder's supervisor may read the templates but not write
        // them (its file-system confinement): its image is moved in by the library,
        // under a hidden name that listings pass over (the builder reads its memory
        // from there as the parent of any later diff, which scratch space would not
        // let it), and published under `name` once the builder is gone and its flush
        // with it.
        let built = templates.join(cube_storage::scratch_entry_name(TEMPLATE_BEING_BUILT)?);
        let snapshot = (|| -> Result<(), SandboxError> {
            builder.call_ok(&Request::GuestWaitWorkingSet)?;
            builder.write_snapshot(&format!("template-{name}"), &built)?;
            Ok(())
        })();
        let destroyed = builder.destroy();
        let published = snapshot.and(destroyed).and_then(|()| {
            std::fs::rename(&built, &*dest).map_err(io_error("publishing the template"))?;
            // A template outlives reboots: flush it now rather than in the background.
            let boot = cube_storage::durable_marker::boot_id()?;
            cube_storage::durable_marker::make_durable(&dest, &boot)?;
            let meta = TemplateMeta {
                name: name.to_string(),
                engine: Engine::Vm,
                machine,
                rootfs_bytes,
                created_unix: now_unix(),
                tree: None,
                built_from: None,
                process: None,
            };
            cube_storage::write_atomic(&dest.record(), TemplateDir::RECORD_KIND, &meta)?;
            Ok(meta)
        });
        if published.is_err() {
            let _ = std::fs::remove_dir_all(&built);
        }
        published
    }

    /// Templates: those in the store, then the built-in [`HOST_TEMPLATE`].
    pub fn templates(&self) -> Result<Vec<TemplateMeta>, SandboxError> {
        let names = self.store.list_templates()?;
        let mut templates: Vec<TemplateMeta> = self.read_records(
            names,
            |n| Ok(self.store.template(n)?.record()),
            TemplateDir::RECORD_KIND,
        )?;
        templates.push(host_template());
        Ok(templates)
    }

    /// Snapshots in the store, of every sandbox or of `sandbox` only.
    pub fn snapshots(&self, sandbox: Option<&str>) -> Result<Vec<SnapshotMeta>, SandboxError> {
        let ids = self.store.list_snapshots()?;
        let mut all: Vec<SnapshotMeta> = self.read_records(
            ids,
            |id| Ok(self.store.snapshot(id)?.record()),
            SnapshotDir::RECORD_KIND,
        )?;
        if let Some(owner) = sandbox {
            all.retain(|s| s.sandbox == owner);
        }
        all.sort_by_key(|s| s.created_unix);
        Ok(all)
    }

    /// Removes snapshot `id` and its files. Sandboxes created from it keep running (a
    /// jail's layer was cloned, a VM's memory stays mapped), but no sandbox can roll
    /// back to it any more.
    ///
    /// ```
    /// use cube_core::{Runtime, RuntimeConfig, SandboxError};
    ///
    /// let store = tempfile::tempdir().unwrap();
    /// let rt = Runtime::open(RuntimeConfig {
    ///     store_root: store.path().into(),
    ///     pool_size: 0,
    ///     network_pool_size: 0,
    ///     supervisor: Some("/usr/local/bin/cube-supervisor".into()),
    /// })
    /// .unwrap();
    /// assert!(matches!(
    ///     rt.remove_snapshot("snap-0000000000000000"),
    ///     Err(SandboxError::UnknownSnapshot(_))
    /// ));
    /// ```
    pub fn remove_snapshot(&self, id: &str) -> Result<(), SandboxError> {
        if !self.store.snapshot(id)?.record().is_file() {
            return Err(SandboxError::UnknownSnapshot(id.to_string()));
        }
        Ok(self.store.remove_snapshot(id)?)
    }

    /// Removes a template. A VM template's running sandboxes keep their mappings of
    /// it; a jail template whose tree lies under a sandbox's root (or under a snapshot
    /// a sandbox can be cloned from) is refused with the sandboxes that use it.
    pub fn remove_template(&self, name: &str) -> Result<(), SandboxError> {
        if name == HOST_TEMPLATE {
            return Err(SandboxError::BuiltInTemplate(name.to_string()));
        }
        self.template_checked(name)?;
        let users: Vec<String> = self
            .list()?
            .into_iter()
            .filter(|s| s.template.as_deref() == Some(name))
            .map(|s| s.id)
            .collect();
        if !users.is_empty() {
            return Err(SandboxError::TemplateInUse {
                name: name.to_string(),
                sandboxes: users.join(", "),
            });
        }
        // Out of sight first (one rename), so no create finds half a tree.
        self.store.remove_template(name)?;
        Ok(())
    }

    fn template_checked(&self, name: &str) -> Result<TemplateDir, SandboxError> {
        let dir = self.store.template(name)?;
        if !dir.record().is_file() {
            return Err(SandboxError::UnknownTemplate(name.to_string()));
        }
        Ok(dir)
    }

    /// Creates a sandbox from template `template` on the template's engine (see
    /// [`CreateOptions::engine`]). A VM template's memory is mapped copy-on-write, no
    /// boot; [`HOST_TEMPLATE`] starts a jail on the host's userland with an empty
    /// writable layer.
    ///
    /// ```no_run
    /// // no_run: the jail engine needs root (namespaces, mounts, cgroups).
    /// use cube_core::{CreateOptions, Runtime, RuntimeConfig, HOST_TEMPLATE};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let rt = Runtime::open(RuntimeConfig::new()?)?;
    /// let sb = rt.create(HOST_TEMPLATE, CreateOptions::new(false))?;
    /// println!("{} runs on the {} engine", sb.id(), sb.engine());
    /// // Not ephemeral: it outlives this process; `rt.attach(id)` finds it again.
    /// # Ok(())
    /// # }
    /// ```
    pub fn create(&self, template: &str, options: CreateOptions) -> Result<Sandbox, SandboxError> {
        if let Some(tree) = options.rootfs.clone() {
            options.check_engine("a root filesystem directory", Engine::Jail)?;
            if template != HOST_TEMPLATE {
                self.template_checked(template)?;
            }
            return self.start(
                Source::JailOverlay { tree, layer: None },
                Engine::Jail,
                template,
                options,
                |_| Ok(()),
            );
        }
        if template == HOST_TEMPLATE {
            options.check_engine(&format!("template {template}"), Engine::Jail)?;
            return self.start(
                Source::Jail { layer: None },
                Engine::Jail,
                template,
                options,
                |_| Ok(()),
            );
        }
        let dir = self.template_checked(template)?;
        let meta: TemplateMeta =
            cube_storage::read_verified(&dir.record(), TemplateDir::RECORD_KIND)?;
        options.check_engine(&format!("template {template}"), meta.engine)?;
        if meta.engine == Engine::Jail {
            let tree = self.jail_template_tree(template)?;
            let options = match &meta.process {
                Some(defaults) => with_process_defaults(options, defaults),
                None => options,
            };
            return self.start_on_template(
                Source::JailOverlay { tree, layer: None },
                template,
                template,
                options,
            );
        }
        self.create_from_dir(&dir.image(), template, options)
    }

    /// Creates a sandbox from snapshot `snapshot`, on the engine of the sandbox it was
    /// taken from. A jail snapshot's writable layer is cloned; its processes are
    /// restored from a [`crate::SnapshotKind::Full`] one (where CRIU works) and start
    /// afresh from a [`crate::SnapshotKind::Filesystem`] one. The layer lies over
    /// [`CreateOptions::rootfs`] where that is set, else over the tree of the template
    /// the snapshot names.
    pub fn create_from_snapshot(
        &self,
        snapshot: &str,
        options: CreateOptions,
    ) -> Result<Sandbox, SandboxError> {
        let dir = self.store.snapshot(snapshot)?;
        let meta: Option<SnapshotMeta> =
            cube_storage::read_verified(&dir.record(), SnapshotDir::RECORD_KIND).ok();
        if let Some(meta) = meta.filter(|m| m.engine == Engine::Jail) {
            options.check_engine(&format!("snapshot {snapshot}"), meta.engine)?;
            let layer = dir.layer();
            if !layer.is_dir() {
                return Err(SandboxError::UnknownSnapshot(snapshot.to_string()));
            }
            // A directory asked for (a restored container's rootfs) replaces the tree
            // the snapshot's layer was written over, as it does for a plain create.
            if let Some(tree) = options.rootfs.clone() {
                return self.start(
                    Source::JailOverlay {
                        tree,
                        layer: Some(layer),
                    },
                    Engine::Jail,
                    snapshot,
                    options,
                    |_| Ok(()),
                );
            }
            // Written over a directory of its sandbox's, which no template holds: a
            // create from it names the tree to lie over (a restored container's).
            if let Some(tree) = portable::snapshot_rootfs(&self.store, &meta) {
                return Err(SandboxError::NeedsRootfs {
                    snapshot: snapshot.to_string(),
                    tree,
                });
            }
            // The template tree its layer was written over: named by its sandbox's
            // record, or by the snapshot itself when imported.
            let template =
                portable::snapshot_template(&self.store, &meta).filter(|t| t != HOST_TEMPLATE);
            if let Some(template) = template {
                let tree = self.jail_template_tree(&template)?;
                return self.start_on_template(
                    Source::JailOverlay {
                        tree,
                        layer: Some(layer),
                    },
                    snapshot,
                    &template,
                    options,
                );
            }
            return self.start(
                Source::Jail { layer: Some(layer) },
                Engine::Jail,
                snapshot,
                options,
                |_| Ok(()),
            );
        }
        if !dir.state().is_file() {
            return Err(SandboxError::UnknownSnapshot(snapshot.to_string()));
        }
        options.check_engine(&format!("snapshot {snapshot}"), Engine::Vm)?;
        self.create_from_dir(&dir, snapshot, options)
    }

    fn create_from_dir(
        &self,
        source: &SnapshotDir,
        origin: &str,
        options: CreateOptions,
    ) -> Result<Sandbox, SandboxError> {
        let rootfs = source.rootfs();
        self.start(
            Source::Snapshot(source.to_path_buf()),
            Engine::Vm,
            origin,
            options,
            |dir| {
                if rootfs.is_file() {
                    // No link followed: the snapshot's directory may be its VM
                    // supervisor's uid's (see `cube_storage::no_follow`).
                    let source = cube_storage::no_follow::open_file(&rootfs).map_err(|e| {
                        SandboxError::Io(format!("opening {}", rootfs.display()), e)
                    })?;
                    cube_storage::clone_open(&source, &rootfs, &SandboxDir::new(dir).rootfs())?;
                }
                Ok(())
            },
        )
    }

    /// The tree of built jail template `name`, checked.
    fn jail_template_tree(&self, name: &str) -> Result<PathBuf, SandboxError> {
        let dir = self.template_checked(name)?;
        let meta: TemplateMeta =
            cube_storage::read_verified(&dir.record(), TemplateDir::RECORD_KIND)?;
        let tree = meta
            .tree_dir(&dir)
            .map_err(SandboxError::BadTemplate)?
            .ok_or_else(|| {
                SandboxError::BadTemplate(format!("jail template {name} records no tree"))
            })?;
        if !tree.is_dir() {
            return Err(SandboxError::BadTemplate(format!(
                "jail template {name}'s tree {} is missing",
                tree.display()
            )));
        }
        Ok(tree)
    }

    fn start_on_template(
        &self,
        source: Source,
        origin: &str,
        template: &str,
        options: CreateOptions,
    ) -> Result<Sandbox, SandboxError> {
        self.start_recorded(
            source,
            Engine::Jail,
            origin,
            Some(template),
            options,
            |_| Ok(()),
        )
    }

    fn start(
        &self,
        source: Source,
        engine: Engine,
        origin: &str,
        options: CreateOptions,
        prepare: impl FnOnce(&Path) -> Result<(), SandboxError>,
    ) -> Result<Sandbox, SandboxError> {
        self.start_recorded(source, engine, origin, None, options, prepare)
    }

    fn start_recorded(
        &self,
        source: Source,
        engine: Engine,
        origin: &str,
        template: Option<&str>,
        options: CreateOptions,
        prepare: impl FnOnce(&Path) -> Result<(), SandboxError>,
    ) -> Result<Sandbox, SandboxError> {
        if let Some(network) = &options.network {
            network
                .validate()
                .map_err(|e| SandboxError::Network(e.into()))?;
        }
        let id = Store::new_id("sb")?;
        let dir = self.store.sandbox(&id)?;
        std::fs::create_dir(&dir).map_err(io_error(format!("creating {}", dir.display())))?;
        let start = std::time::Instant::now();
        let result = (|| {
            prepare(&dir)?;
            tracing::debug!(elapsed = ?start.elapsed(), "create: directory prepared");
            let meta = SandboxMeta {
                id: id.clone(),
                engine,
                origin: origin.to_string(),
                created_unix: now_unix(),
                ephemeral: options.ephemeral,
                metadata: options.metadata.clone(),
                template: template.map(str::to_string),
                rootfs: options.rootfs.clone(),
            };
            // A sandbox does not outlive a host restart (its supervisor does not), so
            // its record needs no sync on the create path.
            let record = serde_json::to_vec(&meta)
                .map_err(|e| SandboxError::Io("encoding the sandbox record".into(), e.into()))?;
            cube_storage::write_atomic_bytes_with(
                &dir.record(),
                SandboxDir::RECORD_KIND,
                &record,
                cube_storage::Durability::Deferred,
            )?;
            let pool = self.supervisors_for(engine, options.network.is_some());
            // Only a host-template jail with an empty layer uses a jail started ahead.
            let supervisor = pool.take_for(match (engine, &source) {
                (Engine::Vm, _) => WarmFor::Vm,
                (Engine::Jail, Source::Jail { layer: None }) => WarmFor::Jail,
                (Engine::Jail, _) => WarmFor::JailFromImage,
            })?;
            tracing::debug!(elapsed = ?start.elapsed(), "create: supervisor taken");
            let mut sandbox = Sandbox {
                id: id.clone(),
                engine,
                dir: dir.to_path_buf(),
                client: SupervisorClient::from_stream(supervisor.stream).map_err(|source| {
                    SandboxError::Supervisor {
                        id: id.clone(),
                        source,
                    }
                })?,
                store: self.store.clone(),
            };
            sandbox.call_ok(&Request::Adopt {
                version: PROTOCOL_VERSION,
                id: id.clone(),
                dir: dir.to_path_buf(),
                source,
                ephemeral: options.ephemeral,
                settings: Box::new(options.settings()),
            })?;
            tracing::debug!(elapsed = ?start.elapsed(), "create: sandbox running");
            Ok(sandbox)
        })();
        if result.is_err() {
            let _ = self.store.remove_sandbox_files(&id);
        }
        result
    }

    /// Snapshots `sandbox` and creates `n` sandboxes from that snapshot, `concurrency`
    /// at a time. The snapshot belongs to `sandbox`.
    ///
    /// ```no_run
    /// // no_run: the jail engine needs root (namespaces, mounts, cgroups).
    /// use cube_core::{CreateOptions, Runtime, RuntimeConfig, HOST_TEMPLATE};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let rt = Runtime::open(RuntimeConfig::new()?)?;
    /// let mut sb = rt.create(HOST_TEMPLATE, CreateOptions::new(true))?;
    /// // Four copies of its files, made two at a time, each ending with its handle.
    /// let tries = rt.clone_sandbox(&mut sb, 4, 2, CreateOptions::new(true))?;
    /// assert_eq!(tries.len(), 4);
    /// # Ok(())
    /// # }
    /// ```
    pub fn clone_sandbox(
        &self,
        sandbox: &mut Sandbox,
        n: usize,
        concurrency: usize,
        options: CreateOptions,
    ) -> Result<Vec<Sandbox>, SandboxError> {
        let start = std::time::Instant::now();
        let snapshot = sandbox.snapshot()?;
        tracing::debug!(elapsed = ?start.elapsed(), "clone: snapshot taken");
        let clones = self.create_many(&snapshot.id, n, concurrency, options);
        tracing::debug!(elapsed = ?start.elapsed(), "clone: sandboxes created");
        clones
    }

    /// Creates `n` sandboxes from snapshot `snapshot`, `concurrency` at a time.
    pub fn create_many(
        &self,
        snapshot: &str,
        n: usize,
        concurrency: usize,
        options: CreateOptions,
    ) -> Result<Vec<Sandbox>, SandboxError> {
        let concurrency = concurrency.clamp(1, n.max(1));
        let next = std::sync::atomic::AtomicUsize::new(0);
        let results = std::sync::Mutex::new(Vec::with_capacity(n));
        std::thread::scope(|scope| {
            for _ in 0..concurrency {
                scope.spawn(|| loop {
                    if next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= n {
                        return;
                    }
                    let r = self.create_from_snapshot(snapshot, options.clone());
                    results.lock().unwrap_or_else(|e| e.into_inner()).push(r);
                });
            }
        });
        let mut sandboxes = Vec::with_capacity(n);
        let mut first_error = None;
        for r in results.into_inner().unwrap_or_else(|e| e.into_inner()) {
            match r {
                Ok(s) => sandboxes.push(s),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            for s in sandboxes {
                let _ = s.destroy();
            }
            return Err(e);
        }
        Ok(sandboxes)
    }

    /// Reattaches to a running sandbox, from this process or another one.
    ///
    /// ```no_run
    /// // no_run: needs a sandbox made earlier, e.g. by `cube sandbox create` (root).
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let rt = cube_core::Runtime::open(cube_core::RuntimeConfig::new()?)?;
    /// for meta in rt.list()? {
    ///     let mut sb = rt.attach(&meta.id)?;
    ///     println!("{} {:?}", meta.id, sb.status()?.status);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn attach(&self, id: &str) -> Result<Sandbox, SandboxError> {
        let dir = self.store.sandbox(id)?;
        if !dir.record().is_file() {
            return Err(SandboxError::UnknownSandbox(id.to_string()));
        }
        let meta: SandboxMeta =
            cube_storage::read_verified(&dir.record(), SandboxDir::RECORD_KIND)?;
        let client = SupervisorClient::connect(&dir.supervisor_socket()).map_err(|source| {
            SandboxError::Supervisor {
                id: id.to_string(),
                source,
            }
        })?;
        Ok(Sandbox {
            id: id.to_string(),
            engine: meta.engine,
            dir: dir.into_path(),
            client,
            store: self.store.clone(),
        })
    }

    /// Sandboxes recorded in the store (reachable or not).
    pub fn list(&self) -> Result<Vec<SandboxMeta>, SandboxError> {
        let ids = self.store.list_sandboxes()?;
        self.read_records(
            ids,
            |id| Ok(self.store.sandbox(id)?.record()),
            SandboxDir::RECORD_KIND,
        )
    }

    /// The records of `names` whose metadata reads back intact; entries being created,
    /// removed or damaged are skipped.
    fn read_records<T: serde::de::DeserializeOwned>(
        &self,
        names: Vec<String>,
        record: impl Fn(&str) -> Result<PathBuf, cube_storage::StoreError>,
        kind: &str,
    ) -> Result<Vec<T>, SandboxError> {
        let mut out = Vec::new();
        for name in names {
            if let Ok(meta) = cube_storage::read_verified(&record(&name)?, kind) {
                out.push(meta);
            }
        }
        Ok(out)
    }

    /// Removes a sandbox whose supervisor is gone (crashed, killed, or the host
    /// rebooted): ends what is left of its jail (processes its lifeline could not
    /// reach, frozen ones included) and removes its cgroups, releases its network
    /// device, and removes its directory and snapshots.
    pub fn remove_stale(&self, id: &str) -> Result<(), SandboxError> {
        crate::sandbox::release_orphaned(&self.store, id)?;
        Ok(self.store.remove_sandbox_files(id)?)
    }

    /// Writes snapshot `snapshot` into the archive file `dest` (replaced if it exists,
    /// written beside it first so that a failed export leaves no half file); see
    /// [`crate::portable`] for what travels and how.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let rt = cube_core::Runtime::open(cube_core::RuntimeConfig::new()?)?;
    /// let report = rt.export_snapshot("snap-0123456789abcdef", "/tmp/snap.cube".as_ref())?;
    /// println!("{} bytes", report.archive_bytes);
    /// # Ok(())
    /// # }
    /// ```
    pub fn export_snapshot(
        &self,
        snapshot: &str,
        dest: &Path,
    ) -> Result<ExportReport, SandboxError> {
        portable::export(&self.store, snapshot, dest)
    }

    /// Adds the snapshot in archive `source` to this store under its own id, after
    /// checking every byte of it; the store is unchanged when anything is wrong.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let rt = cube_core::Runtime::open(cube_core::RuntimeConfig::new()?)?;
    /// let imported = rt.import_snapshot("/tmp/snap.cube".as_ref())?;
    /// let sb = rt.create_from_snapshot(&imported.snapshot, cube_core::CreateOptions::new(false))?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn import_snapshot(&self, source: &Path) -> Result<ImportReport, SandboxError> {
        portable::import(&self.store, source)
    }

    /// Writes nothing; checks that archive `source` is whole and intact (every chunk
    /// and the file's checksum) and returns its properties.
    pub fn verify_snapshot_archive(
        &self,
        source: &Path,
    ) -> Result<std::collections::BTreeMap<String, String>, SandboxError> {
        portable::verify(source)
    }

    /// Builds jail template `name` from `source`, calling `progress` with each line the
    /// build prints. On any failure nothing named `name` is left in the store.
    pub fn build_jail_template(
        &self,
        name: &str,
        source: &TreeSource,
        progress: &mut dyn FnMut(&str),
    ) -> Result<TemplateMeta, SandboxError> {
        templates::tree::build(&self.store, name, source, progress)
            .map_err(|e| SandboxError::Build(name.to_string(), e))
    }

    /// Builds VM template `name`: image, boot, wait for the agent, snapshot. Fails at
    /// once, with an error of kind [`crate::ErrorKind::HostCannot`], where that cannot
    /// finish (no KVM, or a stock kernel on a PVM host).
    pub fn build_vm_template(
        &self,
        name: &str,
        spec: &VmTemplateSpec,
        progress: &mut dyn FnMut(&str),
    ) -> Result<TemplateMeta, SandboxError> {
        templates::vm::build(&self.store, name, spec, progress)
            .map_err(|e| SandboxError::VmTemplate(name.to_string(), e))
    }
}

/// The record of the built-in [`HOST_TEMPLATE`]: nothing to build, ready on any host
/// that can run jails.
fn host_template() -> TemplateMeta {
    TemplateMeta {
        name: HOST_TEMPLATE.to_string(),
        engine: Engine::Jail,
        machine: MachineConfig::default(),
        rootfs_bytes: 0,
        created_unix: 0,
        tree: None,
        built_from: None,
        process: None,
    }
}

/// `options` over a container image's defaults: the image's environment with the
/// caller's variables replacing those of the same name, and its working directory
/// unless the caller names one.
fn with_process_defaults(mut options: CreateOptions, defaults: &ProcessDefaults) -> CreateOptions {
    let mut env = defaults.env.clone();
    for (key, value) in std::mem::take(&mut options.env) {
        match env.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => env.push((key, value)),
        }
    }
    options.env = env;
    if options.workdir.is_none() {
        options.workdir = defaults.cwd.as_ref().map(PathBuf::from);
    }
    options
}
