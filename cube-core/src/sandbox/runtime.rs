//! The runtime: the store plus a pool of pre-started supervisors.

use std::path::{Path, PathBuf};

use cube_storage::Store;

use super::metadata::{
    self, Engine, SandboxMeta, TemplateMeta, SANDBOX_META, SANDBOX_META_KIND, TEMPLATE_META,
    TEMPLATE_META_KIND,
};
use super::{remove_sandbox_files, Sandbox, SandboxError};
use crate::snapshot::format::ROOTFS_FILE;
use crate::snapshot::MachineConfig;
use crate::supervisor::protocol::{Request, Source, PROTOCOL_VERSION};
use crate::supervisor::server::SOCKET_FILE;
use crate::supervisor::{locate_supervisor, SupervisorClient, SupervisorPool};
use crate::test_guest::WorkingSet;

/// How a [`Runtime`] is set up.
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Root directory of the store.
    pub store_root: PathBuf,
    /// Supervisors kept started and ready (0: start one per create).
    pub pool_size: usize,
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
            supervisor: None,
        })
    }
}

/// Options for a new sandbox.
#[derive(Clone, Copy, Debug, Default)]
pub struct CreateOptions {
    /// End the sandbox when the handle that created it is dropped (or its process dies).
    pub ephemeral: bool,
}

/// The entry point: creates, lists and reattaches sandboxes, and builds templates.
pub struct Runtime {
    store: Store,
    pool: SupervisorPool,
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
        Ok(Runtime {
            store,
            pool: SupervisorPool::new(exe, config.pool_size),
        })
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Waits until the supervisor pool is full (for benchmarks).
    pub fn wait_pool_ready(&self) {
        self.pool.wait_full();
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
        let dest = self.store.template_dir(name)?;
        if dest.exists() {
            return Err(SandboxError::TemplateExists(name.to_string()));
        }
        let mut builder = self.start(
            Source::BootTestGuest {
                config: machine,
                working_set,
            },
            &format!("build of template {name}"),
            CreateOptions { ephemeral: true },
            |dir| {
                if rootfs_bytes > 0 {
                    let f = std::fs::File::create(dir.join(ROOTFS_FILE))
                        .map_err(io_error("creating the template disk"))?;
                    f.set_len(rootfs_bytes)
                        .map_err(io_error("sizing the template disk"))?;
                }
                Ok(())
            },
        )?;
        let result = (|| -> Result<TemplateMeta, SandboxError> {
            builder.guest_wait_working_set()?;
            let staging = self
                .store
                .root()
                .join("tmp")
                .join(format!("template-{name}.staging"));
            let _ = std::fs::remove_dir_all(&staging);
            builder.call(&Request::Snapshot {
                staging,
                dest: dest.clone(),
            })?;
            // A template outlives reboots: flush it now rather than in the background.
            let boot = crate::snapshot::durability::boot_id()?;
            crate::snapshot::durability::make_durable(&dest, &boot)?;
            let meta = TemplateMeta {
                name: name.to_string(),
                engine: Engine::Vm,
                machine,
                rootfs_bytes,
                created_unix: metadata::now_unix(),
            };
            cube_storage::write_atomic(&dest.join(TEMPLATE_META), TEMPLATE_META_KIND, &meta)?;
            Ok(meta)
        })();
        let destroyed = builder.destroy();
        let meta = result?;
        destroyed?;
        Ok(meta)
    }

    /// Templates in the store.
    pub fn templates(&self) -> Result<Vec<TemplateMeta>, SandboxError> {
        let names = self.store.list_templates()?;
        self.read_records(
            names,
            |n| self.store.template_dir(n),
            TEMPLATE_META,
            TEMPLATE_META_KIND,
        )
    }

    /// Removes a template (running sandboxes keep their mappings of it).
    pub fn remove_template(&self, name: &str) -> Result<(), SandboxError> {
        let dir = self.template_checked(name)?;
        std::fs::remove_dir_all(&dir).map_err(io_error(format!("removing {}", dir.display())))
    }

    fn template_checked(&self, name: &str) -> Result<PathBuf, SandboxError> {
        let dir = self.store.template_dir(name)?;
        if !dir.join(TEMPLATE_META).is_file() {
            return Err(SandboxError::UnknownTemplate(name.to_string()));
        }
        Ok(dir)
    }

    /// Creates a sandbox from template `template`: no boot, the template's memory is
    /// mapped copy-on-write.
    pub fn create(&self, template: &str, options: CreateOptions) -> Result<Sandbox, SandboxError> {
        let dir = self.template_checked(template)?;
        self.create_from_dir(&dir, template, options)
    }

    /// Creates a sandbox from snapshot `snapshot`.
    pub fn create_from_snapshot(
        &self,
        snapshot: &str,
        options: CreateOptions,
    ) -> Result<Sandbox, SandboxError> {
        let dir = self.store.snapshot_dir(snapshot)?;
        if !dir.join(crate::snapshot::format::STATE_FILE).is_file() {
            return Err(SandboxError::UnknownSnapshot(snapshot.to_string()));
        }
        self.create_from_dir(&dir, snapshot, options)
    }

    fn create_from_dir(
        &self,
        source: &Path,
        origin: &str,
        options: CreateOptions,
    ) -> Result<Sandbox, SandboxError> {
        let rootfs = source.join(ROOTFS_FILE);
        self.start(
            Source::Snapshot(source.to_path_buf()),
            origin,
            options,
            |dir| {
                if rootfs.is_file() {
                    cube_storage::clone_file(&rootfs, &dir.join(ROOTFS_FILE))?;
                }
                Ok(())
            },
        )
    }

    fn start(
        &self,
        source: Source,
        origin: &str,
        options: CreateOptions,
        prepare: impl FnOnce(&Path) -> Result<(), SandboxError>,
    ) -> Result<Sandbox, SandboxError> {
        let id = Store::new_id("sb")?;
        let dir = self.store.sandbox_dir(&id)?;
        std::fs::create_dir(&dir).map_err(io_error(format!("creating {}", dir.display())))?;
        let start = std::time::Instant::now();
        let result = (|| {
            prepare(&dir)?;
            tracing::debug!(elapsed = ?start.elapsed(), "create: directory prepared");
            let meta = SandboxMeta {
                id: id.clone(),
                engine: Engine::Vm,
                origin: origin.to_string(),
                created_unix: metadata::now_unix(),
                ephemeral: options.ephemeral,
            };
            // A sandbox does not outlive a host restart (its supervisor does not), so
            // its record needs no sync on the create path.
            let record = serde_json::to_vec(&meta)
                .map_err(|e| SandboxError::Io("encoding the sandbox record".into(), e.into()))?;
            cube_storage::write_atomic_bytes_with(
                &dir.join(SANDBOX_META),
                SANDBOX_META_KIND,
                &record,
                cube_storage::Durability::Deferred,
            )?;
            let supervisor = self.pool.take()?;
            tracing::debug!(elapsed = ?start.elapsed(), "create: supervisor taken");
            let mut sandbox = Sandbox {
                id: id.clone(),
                dir: dir.clone(),
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
                dir: dir.clone(),
                source,
                ephemeral: options.ephemeral,
            })?;
            tracing::debug!(elapsed = ?start.elapsed(), "create: sandbox running");
            Ok(sandbox)
        })();
        if result.is_err() {
            let _ = remove_sandbox_files(&self.store, &id, &dir);
        }
        result
    }

    /// Snapshots `sandbox` and creates `n` sandboxes from that snapshot, `concurrency`
    /// at a time. The snapshot belongs to `sandbox`.
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
                    let r = self.create_from_snapshot(snapshot, options);
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

    /// Reattaches to a running sandbox.
    pub fn attach(&self, id: &str) -> Result<Sandbox, SandboxError> {
        let dir = self.store.sandbox_dir(id)?;
        if !dir.join(SANDBOX_META).is_file() {
            return Err(SandboxError::UnknownSandbox(id.to_string()));
        }
        let client = SupervisorClient::connect(&dir.join(SOCKET_FILE)).map_err(|source| {
            SandboxError::Supervisor {
                id: id.to_string(),
                source,
            }
        })?;
        Ok(Sandbox {
            id: id.to_string(),
            dir,
            client,
            store: self.store.clone(),
        })
    }

    /// Sandboxes recorded in the store (reachable or not).
    pub fn list(&self) -> Result<Vec<SandboxMeta>, SandboxError> {
        let ids = self.store.list_sandboxes()?;
        self.read_records(
            ids,
            |id| self.store.sandbox_dir(id),
            SANDBOX_META,
            SANDBOX_META_KIND,
        )
    }

    /// The records of `names` whose metadata reads back intact; entries being created,
    /// removed or damaged are skipped.
    fn read_records<T: serde::de::DeserializeOwned>(
        &self,
        names: Vec<String>,
        dir: impl Fn(&str) -> Result<PathBuf, cube_storage::StoreError>,
        file: &str,
        kind: &str,
    ) -> Result<Vec<T>, SandboxError> {
        let mut out = Vec::new();
        for name in names {
            if let Ok(meta) = cube_storage::read_verified(&dir(&name)?.join(file), kind) {
                out.push(meta);
            }
        }
        Ok(out)
    }

    /// Removes a sandbox whose supervisor is gone (crashed, or the host rebooted).
    pub fn remove_stale(&self, id: &str) -> Result<(), SandboxError> {
        let dir = self.store.sandbox_dir(id)?;
        remove_sandbox_files(&self.store, id, &dir)
    }
}
