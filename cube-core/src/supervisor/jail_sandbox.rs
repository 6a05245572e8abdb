//! A jail sandbox as its supervisor holds it: the jail whose PID 1 is Cube's agent,
//! the agent's socket, the writable layer and what snapshots copy of it.
//!
//! The supervisor binds `<sandbox dir>/agent.sock` itself and hands the listening
//! descriptor to the agent (`--listen-fd`), so any host process reaches the agent at
//! a path outside the jail's root, and the socket survives an agent restart
//! (rollback, wake): connections made meanwhile wait in its backlog.
//!
//! Snapshots here are of kind [`SnapshotKind::Filesystem`]: the writable layer is
//! cloned (reflinked where the store's filesystem can) while the processes are frozen.
//! A rollback or wake starts a new jail on a copy of a layer, so processes and
//! interpreter contexts start afresh. A full-state (process memory) path slots in at
//! [`JailSandbox::snapshot`] and [`JailSandbox::rollback`] once one exists.

use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use cube_jail::{Jail, JailConfig, JailExit, Limits, ReadOnlyBind, Stdio};
use cube_storage::Durability;

use super::jail_network::{JailNetwork, JailNetworkError};
use super::protocol::{JailStatus, MachineStatus, Response, Settings, StatusReport};
use crate::error_report::chain as error_chain;
use crate::sandbox::metadata::{
    now_unix, Engine, SnapshotKind, SnapshotMeta, SNAPSHOT_META, SNAPSHOT_META_KIND,
};
use crate::vmm::machine::SnapshotStats;

/// The agent's socket inside a jail sandbox's directory.
pub const AGENT_SOCKET: &str = "agent.sock";
/// The jail's own directory (its root and writable layer) inside the sandbox directory.
pub const JAIL_DIR: &str = "jail";
/// A snapshot's copy of the writable layer, inside the snapshot directory.
pub const LAYER_DIR: &str = "layer";
/// Where a hibernated sandbox's layer waits, inside the sandbox directory.
pub const HIBERNATED_LAYER: &str = "layer.hibernated";
/// A layer being put in place for the next start, inside the sandbox directory.
const SEED_LAYER: &str = "layer.seed";
/// Where the agent binary appears inside the jail.
pub const AGENT_PATH: &str = "/.cube/cube-agent";
/// The descriptor number the agent finds its listening socket at.
const AGENT_FD: i32 = 3;
/// Environment variable naming the agent binary.
pub const AGENT_ENV: &str = "CUBE_AGENT";
/// File name of the agent binary.
pub const AGENT_BIN: &str = "cube-agent";

/// Finds the agent binary: `$CUBE_AGENT`, else next to the running executable or one
/// directory up (where cargo puts binaries for test executables).
pub fn locate_agent() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os(AGENT_ENV) {
        return Ok(PathBuf::from(path));
    }
    let not_found = || {
        format!("cannot find the `{AGENT_BIN}` binary (set {AGENT_ENV} or install it next to `cube-supervisor`)")
    };
    let exe = std::env::current_exe().map_err(|_| not_found())?;
    let dir = exe.parent().ok_or_else(not_found)?;
    [dir.join(AGENT_BIN), dir.join("..").join(AGENT_BIN)]
        .into_iter()
        .find(|c| c.is_file())
        .ok_or_else(not_found)
}

/// One jail sandbox.
pub struct JailSandbox {
    id: String,
    dir: PathBuf,
    settings: Settings,
    /// A built template's tree under the overlay root; None: the host's userland.
    tree: Option<PathBuf>,
    agent: PathBuf,
    listener: UnixListener,
    /// None while hibernated (or after destroy).
    jail: Option<Jail>,
    paused: bool,
    /// Bumped on every (re)start of the jail.
    generation: u64,
    /// Teardowns of replaced jails still under way; joined by destroy.
    retiring: Vec<std::thread::JoinHandle<()>>,
    /// The sandbox's network, when it asked for one (see [`JailNetwork`]).
    network: Option<Box<JailNetwork>>,
}

impl JailSandbox {
    /// Binds the agent socket and starts the jail, on the template tree `tree` (the
    /// host's userland when None) and on a copy of `layer` when given.
    pub fn start(
        id: &str,
        dir: &Path,
        tree: Option<PathBuf>,
        layer: Option<&Path>,
        settings: Settings,
    ) -> Result<JailSandbox, String> {
        let agent = locate_agent()?;
        let socket = dir.join(AGENT_SOCKET);
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)
            .map_err(|e| format!("binding {}: {e}", socket.display()))?;
        let mut sandbox = JailSandbox {
            id: id.to_string(),
            dir: dir.to_path_buf(),
            settings,
            tree,
            agent,
            listener,
            jail: None,
            paused: false,
            generation: 0,
            retiring: Vec::new(),
            network: None,
        };
        let seed = match layer {
            Some(layer) => Some(sandbox.stage_seed(layer)?),
            None => None,
        };
        sandbox.spawn(seed)?;
        Ok(sandbox)
    }

    /// Adopts a jail started ahead of time (see [`PrespawnedJail`]): moves it into the
    /// sandbox directory and applies the settings.
    pub fn adopt(
        id: &str,
        dir: &Path,
        ready: PrespawnedJail,
        settings: Settings,
    ) -> Result<JailSandbox, String> {
        let PrespawnedJail {
            mut jail,
            listener,
            agent,
            socket: pool_socket,
        } = ready;
        let socket = dir.join(AGENT_SOCKET);
        jail.relocate(&dir.join(JAIL_DIR))
            .map_err(|e| error_chain(&e))?;
        std::fs::rename(&pool_socket.0, &socket)
            .map_err(|e| format!("moving the agent socket to {}: {e}", socket.display()))?;
        pool_socket.disarm();
        let limits = limits(&settings)?;
        if limits != Limits::default() {
            jail.set_limits(&limits).map_err(|e| error_chain(&e))?;
        }
        if !settings.env.is_empty() {
            let client = cube_agent::client::Client::connect_unix(&socket)
                .map_err(|e| format!("connecting to the agent: {}", error_chain(&e)))?;
            client
                .set_env(settings.env.clone(), Vec::new())
                .map_err(|e| format!("setting the environment: {}", error_chain(&e)))?;
        }
        let mut sandbox = JailSandbox {
            id: id.to_string(),
            dir: dir.to_path_buf(),
            settings,
            tree: None,
            agent,
            listener,
            jail: Some(jail),
            paused: false,
            generation: 0,
            retiring: Vec::new(),
            network: None,
        };
        sandbox.connect_network()?;
        Ok(sandbox)
    }

    /// Gives the running jail its network (a new device after a restart), when the
    /// sandbox has one.
    fn connect_network(&mut self) -> Result<(), String> {
        let Some(options) = self.settings.network.clone() else {
            return Ok(());
        };
        let Some(pid) = self.jail.as_ref().map(Jail::pid) else {
            return Ok(());
        };
        let fail = |e: JailNetworkError| format!("attaching the network: {}", error_chain(&e));
        match self.network.as_mut() {
            Some(network) => network.reconnect(pid).map_err(fail),
            None => {
                self.network = Some(Box::new(
                    JailNetwork::attach(pid, &options, &self.dir).map_err(fail)?,
                ));
                Ok(())
            }
        }
    }

    fn network(&mut self) -> Result<&mut JailNetwork, String> {
        self.network
            .as_deref_mut()
            .ok_or_else(|| "this sandbox has no network (create it with one)".to_string())
    }

    /// The sandbox's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn spawn(&mut self, seed: Option<PathBuf>) -> Result<(), String> {
        // Each start gets its own cgroups: a replaced jail's may still be going away.
        let name = format!("{}-{}", self.id, self.generation + 1);
        let config = jail_config(
            &name,
            &self.dir.join(JAIL_DIR),
            &self.agent,
            &self.settings,
            self.tree.as_deref(),
            seed.clone(),
        )?;
        let spawned = Jail::spawn_with_fds(
            &config,
            &[AGENT_PATH, "--listen-fd", "3"],
            &[(self.listener.as_fd(), AGENT_FD)],
        );
        match spawned {
            Ok(jail) => {
                self.jail = Some(jail);
                self.paused = false;
                self.generation += 1;
                self.connect_network()
            }
            Err(e) => {
                // A failed spawn gives the seed back: a copy made for this start goes,
                // a hibernated layer stays for the next wake.
                if let Some(seed) = seed.filter(|s| *s == self.dir.join(SEED_LAYER)) {
                    let _ = std::fs::remove_dir_all(seed);
                }
                Err(format!("starting the jail: {}", error_chain(&e)))
            }
        }
    }

    /// Clones `layer` next to the jail, ready to be moved in as the next start's layer.
    fn stage_seed(&self, layer: &Path) -> Result<PathBuf, String> {
        let seed = self.dir.join(SEED_LAYER);
        let _ = std::fs::remove_dir_all(&seed);
        cube_storage::clone_tree(layer, &seed)
            .map_err(|e| format!("copying layer {}: {}", layer.display(), error_chain(&e)))?;
        Ok(seed)
    }

    fn running(&mut self) -> Result<&mut Jail, String> {
        self.jail
            .as_mut()
            .ok_or_else(|| "sandbox is hibernated: wake it first".to_string())
    }

    /// The writable layer on the host, running or hibernated.
    fn layer(&self) -> PathBuf {
        match self.jail.as_ref().and_then(Jail::layer_dir) {
            Some(l) => l.to_path_buf(),
            None => self.dir.join(HIBERNATED_LAYER),
        }
    }

    /// Carries out one request.
    pub fn handle(&mut self, request: super::Request) -> Result<Response, String> {
        use super::Request;
        match request {
            Request::Adopt { .. } => Err("already adopted".into()),
            Request::Destroy => Ok(Response::Ok),
            Request::Status => Ok(Response::Status(self.status())),
            Request::Pause => {
                self.running()?.pause().map_err(|e| error_chain(&e))?;
                self.paused = true;
                Ok(Response::Ok)
            }
            Request::Resume => {
                self.running()?.resume().map_err(|e| error_chain(&e))?;
                self.paused = false;
                Ok(Response::Ok)
            }
            Request::Snapshot { staging, dest } => {
                let stats = self.snapshot(&staging, &dest)?;
                Ok(Response::Snapshot {
                    stats,
                    kind: SnapshotKind::Filesystem,
                })
            }
            Request::Rollback { snapshot } => {
                self.rollback(&snapshot)?;
                Ok(Response::Ok)
            }
            Request::Hibernate => {
                let jail = self.jail.take().ok_or("sandbox is already hibernated")?;
                let keep = self.dir.join(HIBERNATED_LAYER);
                let _ = std::fs::remove_dir_all(&keep);
                jail.destroy_keeping_layer(&keep)
                    .map_err(|e| format!("stopping the jail: {}", error_chain(&e)))?;
                if let Some(network) = self.network.as_mut() {
                    network.disconnect();
                }
                self.paused = false;
                Ok(Response::Ok)
            }
            Request::Wake => {
                if self.jail.is_some() {
                    return Err("sandbox is not hibernated".into());
                }
                let layer = self.dir.join(HIBERNATED_LAYER);
                self.spawn(Some(layer))?;
                Ok(Response::Ok)
            }
            Request::GuestDirty { .. }
            | Request::GuestMode { .. }
            | Request::GuestWaitWorkingSet
            | Request::ReadMemory { .. }
            | Request::MemoryDigest => {
                Err("a jail sandbox has no guest memory (this request is for test VMs)".into())
            }
            Request::NetworkStatus => {
                let report = self.network()?.report();
                Ok(Response::Network(report.map_err(|e| error_chain(&e))?))
            }
            Request::SetPolicy(policy) => {
                let set = self.network()?.set_policy(policy);
                set.map_err(|e| error_chain(&e))?;
                Ok(Response::Ok)
            }
            Request::Expose(port) => {
                let exposed = self.network()?.expose(port);
                exposed.map_err(|e| error_chain(&e))?;
                Ok(Response::Ok)
            }
            Request::Unexpose { host_port } => {
                let withdrawn = self.network()?.unexpose(host_port);
                withdrawn.map_err(|e| error_chain(&e))?;
                Ok(Response::Ok)
            }
        }
    }

    fn status(&mut self) -> StatusReport {
        let paused = self.paused;
        let (status, pid, cgroups) = match self.jail.as_mut() {
            None => (MachineStatus::Hibernated, None, Vec::new()),
            Some(jail) => {
                let cgroups = jail
                    .cgroup()
                    .map(|c| c.dirs().map(Path::to_path_buf).collect())
                    .unwrap_or_default();
                let pid = u32::try_from(jail.pid()).ok();
                let status = match jail.try_wait() {
                    Ok(None) if paused => MachineStatus::Paused,
                    Ok(None) => MachineStatus::Running,
                    Ok(Some(JailExit::Exited(c))) => {
                        MachineStatus::Failed(format!("the agent exited with code {c}"))
                    }
                    Ok(Some(JailExit::Signaled(s))) => {
                        MachineStatus::Failed(format!("the agent was killed by signal {s}"))
                    }
                    Err(e) => MachineStatus::Failed(error_chain(&e)),
                };
                (status, pid, cgroups)
            }
        };
        StatusReport {
            status,
            pid: std::process::id(),
            counter: 0,
            generation: self.generation,
            guest_error: false,
            config: None,
            rss_kib: super::server::own_rss_kib(),
            engine: Engine::Jail,
            jail: Some(JailStatus {
                pid,
                cgroups,
                layer: self.layer(),
                agent_socket: self.dir.join(AGENT_SOCKET),
            }),
        }
    }

    /// Clones the writable layer into `staging` with its record, then moves it to
    /// `dest`. The processes are frozen while the layer is copied, so the copy is one
    /// instant of the files.
    fn snapshot(&mut self, staging: &Path, dest: &Path) -> Result<SnapshotStats, String> {
        let snapshot_id = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| format!("{} has no snapshot id", dest.display()))?;
        if dest.exists() {
            return Err(format!("{} already exists", dest.display()));
        }
        std::fs::create_dir(staging).map_err(|e| format!("creating {}: {e}", staging.display()))?;
        let result = (|| {
            let layer = self.layer();
            let freeze = !self.paused && self.jail.is_some();
            if freeze {
                self.running()?.pause().map_err(|e| error_chain(&e))?;
            }
            let copied = cube_storage::clone_tree(&layer, &staging.join(LAYER_DIR));
            if freeze {
                self.running()?.resume().map_err(|e| error_chain(&e))?;
            }
            let copied = copied.map_err(|e| format!("copying the layer: {}", error_chain(&e)))?;
            let stats = SnapshotStats {
                dirty_pages: 0,
                bytes_written: 0,
                reflinked: copied.copied_files == 0,
            };
            let meta = SnapshotMeta {
                id: snapshot_id,
                sandbox: self.id.clone(),
                created_unix: now_unix(),
                stats,
                kind: SnapshotKind::Filesystem,
                engine: Engine::Jail,
            };
            let bytes = serde_json::to_vec(&meta).map_err(|e| e.to_string())?;
            cube_storage::write_atomic_bytes_with(
                &staging.join(SNAPSHOT_META),
                SNAPSHOT_META_KIND,
                &bytes,
                Durability::Deferred,
            )
            .map_err(|e| error_chain(&e))?;
            std::fs::rename(staging, dest).map_err(|e| format!("committing snapshot: {e}"))?;
            Ok(stats)
        })();
        if result.is_err() {
            let _ = std::fs::remove_dir_all(staging);
        }
        result
    }

    /// Puts the snapshot's layer back and restarts the sandbox's processes on it.
    fn rollback(&mut self, snapshot: &Path) -> Result<(), String> {
        let meta: SnapshotMeta =
            cube_storage::read_verified(&snapshot.join(SNAPSHOT_META), SNAPSHOT_META_KIND)
                .map_err(|e| error_chain(&e))?;
        if meta.engine != Engine::Jail || meta.kind != SnapshotKind::Filesystem {
            return Err(format!(
                "snapshot {} is a {} {} snapshot; this jail sandbox takes filesystem ones",
                meta.id, meta.engine, meta.kind
            ));
        }
        let start = std::time::Instant::now();
        // Copy first: a snapshot that cannot be copied leaves the sandbox as it was.
        let seed = self.stage_seed(&snapshot.join(LAYER_DIR))?;
        tracing::debug!(elapsed = ?start.elapsed(), "rollback: layer copied");
        if let Some(jail) = self.jail.take() {
            if let Err(e) = self.retire(jail) {
                let _ = std::fs::remove_dir_all(&seed);
                return Err(format!("stopping the jail: {}", error_chain(&e)));
            }
        }
        tracing::debug!(elapsed = ?start.elapsed(), "rollback: old jail stopped");
        let _ = std::fs::remove_dir_all(self.dir.join(HIBERNATED_LAYER));
        let spawned = self.spawn(Some(seed));
        tracing::debug!(elapsed = ?start.elapsed(), "rollback: new jail started");
        spawned
    }

    /// Ends a replaced jail's processes now (so its agent accepts nothing more) and
    /// moves it aside; its cgroups and files go off the request path.
    fn retire(&mut self, mut jail: Jail) -> Result<(), cube_jail::JailError> {
        jail.kill()?;
        jail.wait()?;
        let aside = self
            .dir
            .join(format!("{JAIL_DIR}.retired-{}", self.generation));
        if let Err(e) = jail.relocate(&aside) {
            tracing::debug!("tearing the old jail down in place: {}", error_chain(&e));
            return jail.destroy();
        }
        self.retiring.retain(|t| !t.is_finished());
        let sandbox = self.id.clone();
        let spawned = std::thread::Builder::new()
            .name("retire-jail".into())
            .spawn(move || {
                if let Err(e) = jail.destroy() {
                    tracing::warn!(sandbox = %sandbox, "removing a replaced jail: {}", error_chain(&e));
                }
            });
        match spawned {
            Ok(handle) => self.retiring.push(handle),
            // The jail was dropped, and so destroyed, with the closure.
            Err(e) => tracing::warn!("retiring a jail inline: {e}"),
        }
        Ok(())
    }

    /// Ends every process and removes the jail, its cgroups and its layer; the agent
    /// socket goes too.
    pub fn destroy(&mut self) {
        for handle in std::mem::take(&mut self.retiring) {
            let _ = handle.join();
        }
        if let Some(jail) = self.jail.take() {
            if let Err(e) = jail.destroy() {
                tracing::warn!(sandbox = %self.id, "destroying the jail: {}", error_chain(&e));
            }
        }
        // The device goes with the jail's namespace; this also clears the datapath.
        if let Some(mut network) = self.network.take() {
            network.disconnect();
        }
        for leftover in [HIBERNATED_LAYER, SEED_LAYER] {
            let _ = std::fs::remove_dir_all(self.dir.join(leftover));
        }
        let _ = std::fs::remove_file(self.dir.join(AGENT_SOCKET));
    }
}

/// A jail on the host template with its agent running, started by a pooled
/// supervisor before anyone asked for it: adopting it costs two renames instead of a
/// jail start.
pub struct PrespawnedJail {
    // Field order is drop order: the jail (destroyed on drop) goes before its socket.
    jail: Jail,
    listener: UnixListener,
    socket: SocketFile,
    agent: PathBuf,
}

/// A socket path removed on drop unless disarmed (once it was moved elsewhere).
struct SocketFile(PathBuf);

impl SocketFile {
    fn disarm(self) {
        std::mem::forget(self);
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl PrespawnedJail {
    /// Starts a default jail in a scratch entry of `scratch` with its socket next to it.
    /// `scratch` must be on the store's filesystem (it is renamed into a sandbox).
    pub fn start(scratch: &Path) -> Result<PrespawnedJail, String> {
        let agent = locate_agent()?;
        // Named as the store's scratch entries of a live process, so that no clean-up
        // of stale scratch removes them under a running jail.
        let entry = |purpose| {
            cube_storage::scratch_entry_name(purpose)
                .map(|n| scratch.join(n))
                .map_err(|e| error_chain(&e))
        };
        let socket = entry("agentsock")?;
        let state_dir = entry("jail")?;
        let listener = UnixListener::bind(&socket)
            .map_err(|e| format!("binding {}: {e}", socket.display()))?;
        let name = format!("pool-{}", std::process::id());
        let config = jail_config(&name, &state_dir, &agent, &Settings::default(), None, None)?;
        let jail = Jail::spawn_with_fds(
            &config,
            &[AGENT_PATH, "--listen-fd", "3"],
            &[(listener.as_fd(), AGENT_FD)],
        )
        .map_err(|e| {
            let _ = std::fs::remove_file(&socket);
            format!("starting the jail: {}", error_chain(&e))
        })?;
        Ok(PrespawnedJail {
            jail,
            listener,
            socket: SocketFile(socket),
            agent,
        })
    }
}

fn limits(settings: &Settings) -> Result<Limits, String> {
    let limits = Limits {
        memory_bytes: settings
            .memory_mib
            .map(|m| m.checked_mul(1 << 20).ok_or("memory limit too large"))
            .transpose()?,
        cpu_quota: settings.cpu_millis.map(|m| f64::from(m) / 1000.0),
        pids_max: settings.pids_max.map(u64::from),
    };
    limits.validate().map_err(|e| error_chain(&e))?;
    Ok(limits)
}

fn jail_config(
    name: &str,
    state_dir: &Path,
    agent: &Path,
    settings: &Settings,
    tree: Option<&Path>,
    seed: Option<PathBuf>,
) -> Result<JailConfig, String> {
    let mut config = JailConfig::new(name, state_dir);
    if let Some(tree) = tree {
        // The template's own userland only: its python3 and pip, not the host's.
        config.root = cube_jail::RootSpec::Overlay {
            lower: vec![tree.to_path_buf()],
            host_userland: false,
        };
    }
    config.binds.push(ReadOnlyBind {
        source: agent.to_path_buf(),
        target: PathBuf::from(AGENT_PATH),
    });
    // The agent's own diagnostics go where the supervisor's do.
    config.stderr = Stdio::Inherit;
    config.env.push(("RUST_LOG".into(), "warn".into()));
    config.env.extend(settings.env.iter().cloned());
    config.limits = limits(settings)?;
    config.seed_layer = seed;
    Ok(config)
}
