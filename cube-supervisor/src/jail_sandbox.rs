//! A jail sandbox as its supervisor holds it: the jail whose PID 1 is Cube's agent,
//! the agent's socket, the writable layer and what snapshots copy of it.
//!
//! The agent binds its listening socket inside the sandbox ([`AGENT_INNER_SOCKET`], on
//! the sandbox's private /tmp), so that CRIU can save and restore it with the rest of
//! the sandbox. The public path `<sandbox dir>/agent.sock` is a symlink to it through
//! `/proc/<PID 1>/root`, replaced whenever PID 1 changes (rollback, wake); a connect
//! through it reaches the agent of the moment. Before every checkpoint the supervisor
//! has the agent close its host connections ([`DISCONNECT_SIGNAL`]): CRIU cannot save a
//! stream whose peer is outside the sandbox. Clients reconnect.
//!
//! Snapshots are of kind [`SnapshotKind::Full`] where a working CRIU exists (probed
//! once per supervisor): the processes are dumped with the writable layer reflinked
//! alongside, and rollback, clone and wake restore them, interpreter variables and all.
//! A sandbox with a network is dumped without its device (CRIU cannot hold the host
//! end) and gets a new one, same policy and ports, when it runs on or is restored.
//! Where CRIU is missing or a dump fails, snapshots fall back to
//! [`SnapshotKind::Filesystem`] with the reason in the snapshot's record and the
//! supervisor's log: the layer is cloned while the processes are frozen, and a
//! rollback or wake starts a new jail on a copy, so processes start afresh.
//!
//! Either kind is written to the page cache and flushed in the background, as a VM's
//! snapshot is: its record names the boot it was written in, and a restore in a later
//! boot needs the durability marker the flush leaves (see [`crate::jail_snapshot`]).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cube_agent::init::DISCONNECT_SIGNAL;
use cube_jail::checkpoint::{self, Checkpoint};
use cube_jail::{Criu, Jail, JailConfig, JailExit, Limits, Stdio};
use cube_storage::{SandboxDir, SnapshotDir};
use cube_vmm::persist::SnapshotStats;

use crate::backend::{held_network, NetworkControl, Networked, SandboxBackend};
use crate::confinement::Profile;
use crate::error_report::chain as error_chain;
use crate::flush::Flushes;
use crate::jail_network::{JailNetwork, JailNetworkError};
use crate::jail_snapshot;
use crate::jail_spec::{locate_agent, JailSpec, AGENT_PATH};
use crate::network::NetnsChoice;
use crate::protocol::{
    ErrorKind, Failure, JailStatus, LimitChange, MachineStatus, Settings, StatusReport,
};
use crate::records::{Engine, SnapshotKind, SnapshotMeta};
use crate::resident_memory::own_rss_kib;
use crate::snapshot_transaction::{PendingCommit, SnapshotTransaction, Staged};

/// Where the agent listens inside the sandbox: on its private /tmp, which CRIU saves.
pub const AGENT_INNER_SOCKET: &str = "/tmp/.cube-agent.sock";
/// How long a starting or restored agent has to listen.
const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the agent has to close its host connections before a checkpoint.
const DISCONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The host's CRIU, probed once per supervisor; the error says why full-state
/// snapshots are unavailable.
fn criu() -> Result<&'static Criu, &'static str> {
    static CRIU: OnceLock<Result<Criu, String>> = OnceLock::new();
    CRIU.get_or_init(|| {
        let probed = Criu::probe().map_err(|e| error_chain(&e));
        match &probed {
            Ok(c) => tracing::debug!(criu = %c.path().display(), version = %c.version(), "full-state jail snapshots through CRIU"),
            Err(why) => tracing::warn!("jail snapshots hold files only: {why}"),
        }
        probed
    })
    .as_ref()
    .map_err(String::as_str)
}

/// Whether `dir` holds a CRIU checkpoint (a full-state snapshot or hibernation).
fn is_checkpoint(dir: &Path) -> bool {
    dir.join(checkpoint::MANIFEST).is_file()
}

/// Copies the hibernation checkpoint `hibernated` into `staging`, for a snapshot of a
/// hibernated sandbox, after checking it as a wake would ([`jail_snapshot::open`]).
/// The copy gets its own manifest and record; the hibernation's flush marker does not
/// go with it (the snapshot's own flush writes one).
fn copy_hibernated(hibernated: &Path, staging: &Path) -> Result<Duration, String> {
    jail_snapshot::open(hibernated).map_err(|e| error_chain(&e))?;
    cube_storage::clone_tree(hibernated, staging)
        .map_err(|e| format!("copying the hibernated checkpoint: {}", error_chain(&e)))?;
    let copy = SnapshotDir::new(staging);
    for inherited in [copy.durable_marker(), copy.record()] {
        match std::fs::remove_file(&inherited) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{}: {e}", inherited.display())),
        }
    }
    Ok(Duration::ZERO)
}

/// One jail sandbox.
pub struct JailSandbox {
    id: String,
    dir: SandboxDir,
    settings: Settings,
    /// A built template's tree under the overlay root; None: the host's userland.
    tree: Option<PathBuf>,
    agent: PathBuf,
    /// None while hibernated (or after destroy).
    jail: Option<Jail>,
    /// The write end of the running jail's lifeline (see [`Lifeline`]).
    lifeline: Option<std::os::fd::OwnedFd>,
    paused: bool,
    /// Bumped on every (re)start of the jail.
    generation: u64,
    /// Teardowns of replaced jails still under way; joined by destroy.
    retiring: Vec<std::thread::JoinHandle<()>>,
    /// The sandbox's network, when it asked for one (see [`JailNetwork`]).
    network: Option<Box<JailNetwork>>,
    /// Background flushes of the snapshots this sandbox wrote; joined by destroy.
    flushes: Flushes,
    /// The snapshot staged last, until the library has moved it into place.
    pending: Option<PendingCommit>,
}

impl JailSandbox {
    /// Starts the jail on the template tree `tree` (the host's userland when None): on a
    /// copy of `layer` when given, the layer of a snapshot (a clone), restoring its
    /// processes too when that snapshot is a full-state one. The snapshot is checked
    /// first (see [`jail_snapshot::open`]).
    pub fn start(
        id: &str,
        dir: &Path,
        tree: Option<PathBuf>,
        layer: Option<&Path>,
        settings: Settings,
    ) -> Result<JailSandbox, Failure> {
        if let Some(layer) = layer {
            let snapshot = layer.parent().ok_or_else(|| {
                Failure::invalid(format!("{} is no snapshot's layer", layer.display()))
            })?;
            jail_snapshot::open(snapshot)?;
        }
        let agent = locate_agent()?;
        let mut sandbox = JailSandbox {
            id: id.to_string(),
            dir: SandboxDir::new(dir),
            settings,
            tree,
            agent,
            jail: None,
            lifeline: None,
            paused: false,
            generation: 0,
            retiring: Vec::new(),
            network: None,
            flushes: Flushes::default(),
            pending: None,
        };
        let snapshot = layer.and_then(Path::parent).filter(|s| is_checkpoint(s));
        if let Some(snapshot) = snapshot {
            match criu() {
                Ok(criu) => {
                    sandbox
                        .restore(criu, snapshot)
                        .map_err(|e| Failure::new(ErrorKind::SnapshotFailed, e))?;
                    return Ok(sandbox);
                }
                Err(why) => tracing::warn!(
                    sandbox = %id,
                    "starting from the files of full-state snapshot {} only: {why}",
                    snapshot.display()
                ),
            }
        }
        let seed = match layer {
            Some(layer) => Some(
                sandbox
                    .stage_seed(layer)
                    .map_err(|e| Failure::new(ErrorKind::SnapshotFailed, e))?,
            ),
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
    ) -> Result<JailSandbox, Failure> {
        let dir = SandboxDir::new(dir);
        let PrespawnedJail {
            mut jail,
            agent,
            lifeline,
            network: standby,
        } = ready;
        jail.relocate(&dir.jail()).map_err(|e| error_chain(&e))?;
        // Started ahead at the pool's lower priority, as its supervisor was.
        crate::priority::normal_priority(jail.pid() as u32);
        publish_socket(&dir, jail.pid())?;
        // The pool started the jail with the default settings' limits.
        let limits = limits(&settings, dir.path())?;
        if limits != self::limits(&Settings::default(), dir.path())? {
            jail.set_limits(&limits).map_err(|e| error_chain(&e))?;
        }
        if !settings.env.is_empty() {
            let client = connect_agent(&dir.agent_socket())
                .map_err(cube_agent::client::ClientError::Connect)
                .and_then(cube_agent::client::Client::new)
                .map_err(|e| format!("connecting to the agent: {}", error_chain(&e)))?;
            client
                .set_env(settings.env.clone(), Vec::new())
                .map_err(|e| format!("setting the environment: {}", error_chain(&e)))?;
        }
        let mut sandbox = JailSandbox {
            id: id.to_string(),
            dir: dir.clone(),
            settings,
            tree: None,
            agent,
            jail: Some(jail),
            lifeline: Some(lifeline),
            paused: false,
            generation: 0,
            retiring: Vec::new(),
            network: None,
            flushes: Flushes::default(),
            pending: None,
        };
        match (standby, sandbox.settings.network.clone()) {
            // The device attached while the jail waited: only its policy and ports
            // are left to write.
            (Some(standby), Some(options)) => {
                let network = standby
                    .activate(&options, &dir)
                    .map_err(|e| format!("attaching the network: {}", error_chain(&e)))?;
                sandbox.network = Some(Box::new(network));
            }
            // No network asked for: the device goes, leaving loopback only.
            (Some(standby), None) => drop(standby),
            (None, _) => sandbox.connect_network()?,
        }
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

    /// The name of the next jail: each start gets its own cgroups, since a replaced
    /// jail's may still be going away.
    fn next_name(&self) -> String {
        format!("{}-{}", self.id, self.generation + 1)
    }

    fn spawn(&mut self, seed: Option<PathBuf>) -> Result<(), String> {
        let config = jail_config(
            &self.next_name(),
            &self.dir.jail(),
            &self.agent,
            &self.settings,
            self.tree.as_deref(),
            seed.clone(),
        )?;
        let lifeline = Lifeline::new()?;
        let spawned = Jail::spawn_with_fds(&config, AGENT_ARGV, &lifeline.fds());
        match spawned {
            Ok(jail) => {
                self.install(jail, lifeline)?;
                self.connect_network()
            }
            Err(e) => {
                // A failed spawn gives the seed back: a copy made for this start goes,
                // a hibernated layer stays for the next wake.
                if let Some(seed) = seed.filter(|s| *s == self.dir.seed_layer()) {
                    let _ = std::fs::remove_dir_all(seed);
                }
                Err(format!("starting the jail: {}", error_chain(&e)))
            }
        }
    }

    /// Restores the checkpoint in `image_dir` as this sandbox's jail.
    /// The configuration a restored jail gets.
    fn restore_config(&self) -> Result<JailConfig, String> {
        jail_config(
            &self.next_name(),
            &self.dir.jail(),
            &self.agent,
            &self.settings,
            self.tree.as_deref(),
            None,
        )
    }

    fn restore(&mut self, criu: &Criu, image_dir: &Path) -> Result<(), String> {
        let config = self.restore_config()?;
        let lifeline = Lifeline::new()?;
        let start = Instant::now();
        let jail = checkpoint::restore(criu, image_dir, &config, &lifeline.fds())
            .map_err(|e| format!("restoring the jail: {}", error_chain(&e)))?;
        let restored = Instant::now();
        self.install(jail, lifeline)?;
        tracing::debug!(
            restore_ms = (restored - start).as_secs_f64() * 1e3,
            agent_listening_ms = restored.elapsed().as_secs_f64() * 1e3,
            "jail restored"
        );
        self.connect_network()
    }

    /// Makes `jail` the running one once its agent listens.
    fn install(&mut self, mut jail: Jail, lifeline: Lifeline) -> Result<(), String> {
        if let Err(e) = publish_socket(&self.dir, jail.pid()) {
            let _ = jail.kill();
            let _ = jail.wait();
            let _ = jail.destroy();
            return Err(e);
        }
        self.jail = Some(jail);
        self.lifeline = Some(lifeline.write);
        self.paused = false;
        self.generation += 1;
        Ok(())
    }

    /// Clones `layer` next to the jail, ready to be moved in as the next start's layer.
    fn stage_seed(&self, layer: &Path) -> Result<PathBuf, String> {
        let seed = self.dir.seed_layer();
        let _ = std::fs::remove_dir_all(&seed);
        cube_storage::clone_tree(layer, &seed)
            .map_err(|e| format!("copying layer {}: {}", layer.display(), error_chain(&e)))?;
        Ok(seed)
    }

    fn running(&mut self) -> Result<&mut Jail, Failure> {
        self.jail
            .as_mut()
            .ok_or_else(|| Failure::bad_state("sandbox is hibernated: wake it first"))
    }

    /// The writable layer on the host, running or hibernated.
    fn layer(&self) -> PathBuf {
        match self.jail.as_ref().and_then(Jail::layer_dir) {
            Some(l) => l.to_path_buf(),
            None if self.dir.hibernated_checkpoint().exists() => {
                SnapshotDir::new(self.dir.hibernated_checkpoint()).layer()
            }
            None => self.dir.hibernated_layer(),
        }
    }

    /// Dumps the running jail into `image_dir` (made here) through CRIU, leaving it
    /// running or not. The agent first closes its host connections; a client that
    /// connects again before the freeze makes the dump fail, so it is tried twice.
    ///
    /// A sandbox with a network is dumped without its device: CRIU cannot hold the
    /// device's host end, which lives outside the sandbox. The device is released
    /// for the dump (its guest end, eth0, goes with it, so the checkpoint's network
    /// namespace holds loopback only) and a new one with the same policy and ports is
    /// attached when the jail runs on, here, or when a checkpoint is restored
    /// ([`JailSandbox::restore`]). Connections through the device end with it (CRIU
    /// would refuse an established one); listening sockets carry over.
    /// Returns how long the processes were stopped for it (0 when they were paused
    /// already).
    fn dump(
        &mut self,
        criu: &Criu,
        image_dir: &Path,
        leave_running: bool,
    ) -> Result<Duration, String> {
        if self.jail.is_none() {
            return Err("sandbox is hibernated: wake it first".to_string());
        }
        let detached = match self.network.as_mut() {
            Some(network) => {
                network.disconnect();
                true
            }
            None => false,
        };
        let dumped = self.dump_processes(criu, image_dir, leave_running);
        if detached && leave_running {
            // Running on, dumped or not: its network comes back. (A hibernation
            // stops the jail either way; its wake attaches anew.)
            self.connect_network()
                .map_err(|e| format!("after the dump: {e}"))?;
        }
        dumped
    }

    fn dump_processes(
        &mut self,
        criu: &Criu,
        image_dir: &Path,
        leave_running: bool,
    ) -> Result<Duration, String> {
        let was_paused = self.paused;
        let jail = self.running().map_err(|f| f.message)?;
        if was_paused {
            // The agent must run to close its connections; dump freezes it again.
            jail.resume().map_err(|e| error_chain(&e))?;
        }
        let options = checkpoint::DumpOptions {
            leave_running,
            passed_fds: vec![LIFELINE_FD],
        };
        let mut result = Err(String::new());
        for _ in 0..2 {
            let start = Instant::now();
            result = disconnect_agent(jail.pid()).and_then(|()| {
                let disconnected = start.elapsed();
                let dumped = checkpoint::dump(criu, jail, image_dir, &options)
                    .map(|c| match was_paused {
                        true => Duration::ZERO,
                        false => c.source_paused().unwrap_or_default(),
                    })
                    .map_err(|e| error_chain(&e));
                tracing::debug!(
                    disconnect_ms = disconnected.as_secs_f64() * 1e3,
                    dump_ms = (start.elapsed() - disconnected).as_secs_f64() * 1e3,
                    "jail dumped"
                );
                dumped
            });
            if result.is_ok() {
                break;
            }
        }
        if was_paused && leave_running {
            jail.pause().map_err(|e| error_chain(&e))?;
        }
        result
    }

    /// Clones the writable layer into `staging/layer`, the processes frozen meanwhile;
    /// true when every file was reflinked, and how long they were frozen.
    fn snapshot_files(&mut self, staging: &Path) -> Result<(bool, Duration), Failure> {
        if self.jail.is_none() && self.dir.hibernated_checkpoint().exists() {
            // Hibernated with its files alone: checked as a wake would check them.
            jail_snapshot::open(&self.dir.hibernated_checkpoint())?;
        }
        std::fs::create_dir(staging).map_err(|e| format!("creating {}: {e}", staging.display()))?;
        let layer = self.layer();
        let freeze = !self.paused && self.jail.is_some();
        let stopped = Instant::now();
        if freeze {
            self.running()?.pause().map_err(|e| error_chain(&e))?;
        }
        let copied = cube_storage::clone_tree(&layer, &SnapshotDir::new(staging).layer());
        let paused = match freeze {
            true => {
                self.running()?.resume().map_err(|e| error_chain(&e))?;
                stopped.elapsed()
            }
            false => Duration::ZERO,
        };
        // On failure the snapshot's transaction removes `staging`.
        match copied {
            Ok(stats) => Ok((stats.copied_files == 0, paused)),
            Err(e) => Err(format!("copying the layer: {}", error_chain(&e)).into()),
        }
    }

    /// Ends the running jail (if any) and any hibernated state, for a rollback.
    fn stop_current(&mut self) -> Result<(), String> {
        if let Some(jail) = self.jail.take() {
            self.retire(jail)
                .map_err(|e| format!("stopping the jail: {}", error_chain(&e)))?;
        }
        let _ = std::fs::remove_dir_all(self.dir.hibernated_layer());
        let checkpoint = self.dir.hibernated_checkpoint();
        if checkpoint.exists() {
            // Its flush may still be under way: it ends before the files go.
            self.flushes.join();
            let _ = std::fs::remove_dir_all(checkpoint);
        }
        Ok(())
    }

    /// Moves the directory `dir` aside and removes it off the request path (a woken
    /// checkpoint: megabytes of images and a layer copy to unlink).
    fn remove_aside(&mut self, dir: &Path) {
        let aside = self.dir.removed_checkpoint(self.generation);
        let target = match std::fs::rename(dir, &aside) {
            Ok(()) => aside,
            Err(_) => dir.to_path_buf(),
        };
        self.retiring.retain(|t| !t.is_finished());
        let sandbox = self.id.clone();
        let remove = move |target: &Path| {
            if let Err(e) = std::fs::remove_dir_all(target) {
                tracing::warn!(sandbox = %sandbox, "removing {}: {e}", target.display());
            }
        };
        // A flush of the checkpoint may still be under way: it ends before the files
        // go (destroy joins this thread, and so the flushes, as it would have them).
        let mut flushes = std::mem::take(&mut self.flushes);
        let (in_thread, remove_in_thread) = (target.clone(), remove.clone());
        match std::thread::Builder::new()
            .name("remove-aside".into())
            .spawn(move || {
                flushes.join();
                remove_in_thread(&in_thread);
            }) {
            Ok(handle) => self.retiring.push(handle),
            // The flushes went with the thread that never started; they run on.
            Err(_) => remove(&target),
        }
    }

    /// Ends a replaced jail's processes now (so its agent accepts nothing more) and
    /// moves it aside; its cgroups and files go off the request path.
    fn retire(&mut self, mut jail: Jail) -> Result<(), cube_jail::JailError> {
        jail.kill()?;
        jail.wait()?;
        let aside = self.dir.retired_jail(self.generation);
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

    /// Stops `jail` keeping its layer alone in `image_dir`, recorded and flushed as a
    /// filesystem snapshot is (`why`: why CRIU could not dump it), so that a wake
    /// checks the files before starting on them. Where the record cannot be written
    /// the layer goes where an unrecorded one was kept before records existed, and a
    /// wake starts on it unchecked: the files are not lost for a full disk.
    fn hibernate_files(&mut self, jail: Jail, image_dir: &Path, why: String) -> Result<(), String> {
        let _ = std::fs::remove_dir_all(image_dir);
        let legacy = self.dir.hibernated_layer();
        let _ = std::fs::remove_dir_all(&legacy);
        let keep = SnapshotDir::new(image_dir).layer();
        std::fs::create_dir_all(image_dir)
            .map_err(|e| format!("creating {}: {e}", image_dir.display()))?;
        jail.destroy_keeping_layer(&keep)
            .map_err(|e| format!("stopping the jail: {}", error_chain(&e)))?;
        let recorded = jail_snapshot::record_hibernation(
            image_dir,
            &self.id,
            SnapshotStats::default(),
            SnapshotKind::Filesystem,
            Some(why),
        );
        match recorded {
            Ok(()) => self.flushes.start_in_own_dir(image_dir.to_path_buf()),
            Err(e) => {
                tracing::warn!(sandbox = %self.id, "the hibernated files are kept unrecorded: {}", error_chain(&e));
                std::fs::rename(&keep, &legacy)
                    .map_err(|e| format!("keeping the layer at {}: {e}", legacy.display()))?;
                let _ = std::fs::remove_dir_all(image_dir);
            }
        }
        Ok(())
    }
}
impl SandboxBackend for JailSandbox {
    fn dir(&self) -> &Path {
        &self.dir
    }

    fn confinement(&self) -> Profile {
        Profile::Jail
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
            rss_kib: own_rss_kib(),
            engine: Engine::Jail,
            jail: Some(JailStatus {
                pid,
                cgroups,
                layer: self.layer(),
                agent_socket: self.dir.agent_socket(),
            }),
        }
    }

    fn pause(&mut self) -> Result<(), Failure> {
        self.running()?.pause().map_err(|e| error_chain(&e))?;
        self.paused = true;
        Ok(())
    }

    fn resume(&mut self) -> Result<(), Failure> {
        self.running()?.resume().map_err(|e| error_chain(&e))?;
        self.paused = false;
        Ok(())
    }

    /// Writes a snapshot into `staging` with its record, for the library to move to
    /// `dest`: a
    /// full-state one through CRIU where it works, else the layer alone (the reason
    /// recorded). The processes are frozen while the layer is copied, so the copy is
    /// one instant of the files (and of the processes, for a full one).
    fn snapshot(&mut self, staging: &Path, dest: &Path) -> Result<SnapshotMeta, Failure> {
        // The staging directory is made by whichever writer runs (CRIU's dump, the
        // checkpoint's clone, or the layer copy).
        let tx = SnapshotTransaction::begin(staging, dest)?;
        let start = Instant::now();
        let hibernated_full =
            self.jail.is_none() && is_checkpoint(&self.dir.hibernated_checkpoint());
        let full = match criu() {
            Err(why) => Err(format!("no working CRIU: {why}")),
            Ok(_) if hibernated_full => {
                // The hibernation's checkpoint is the state: copy it, checked first.
                // Nothing runs: nothing is stopped for it.
                copy_hibernated(&self.dir.hibernated_checkpoint(), staging)
            }
            Ok(_) if self.jail.is_none() => {
                Err("the sandbox was hibernated without its processes".to_string())
            }
            Ok(criu) => self.dump(criu, staging, true),
        };
        let (kind, fallback, reflinked, paused) = match full {
            // CRIU's dump reflinks the layer where the store's filesystem can.
            Ok(paused) => (
                SnapshotKind::Full,
                None,
                cube_storage::reflink::supports_reflink(staging).unwrap_or(false),
                paused,
            ),
            Err(why) => {
                tracing::warn!(sandbox = %self.id, "snapshot {} holds files only: {why}", tx.id());
                let _ = std::fs::remove_dir_all(staging);
                let (reflinked, paused) = self.snapshot_files(staging)?;
                (SnapshotKind::Filesystem, Some(why), reflinked, paused)
            }
        };
        tracing::debug!(elapsed = ?start.elapsed(), %kind, "snapshot written");
        let staged = Staged {
            stats: SnapshotStats {
                dirty_pages: 0,
                bytes_written: 0,
                reflinked,
                paused_us: paused.as_micros() as u64,
            },
            kind,
            fallback,
        };
        jail_snapshot::record_files(staging, tx.id())?;
        let (meta, pending) = tx.stage(&self.id, Engine::Jail, staged)?;
        self.pending = Some(pending);
        Ok(meta)
    }

    fn snapshot_committed(&mut self, dest: &Path) -> Result<(), Failure> {
        // Nothing to commit in a guest.
        PendingCommit::take_for(&mut self.pending, dest)?.finish(|_| Ok(()), &mut self.flushes)
    }

    /// Puts the snapshot back: a full-state one restores the processes, a filesystem
    /// one restarts them on a copy of its layer.
    fn rollback(&mut self, snapshot: &Path) -> Result<(), Failure> {
        let meta = jail_snapshot::open(snapshot)?;
        let start = Instant::now();
        let criu = match meta.kind {
            SnapshotKind::Full => Some(criu().map_err(|why| {
                Failure::new(
                    ErrorKind::HostCannot,
                    format!(
                        "snapshot {} holds processes, but there is no working CRIU: {why}",
                        meta.id
                    ),
                )
            })?),
            SnapshotKind::Filesystem => None,
        };
        if let Some(criu) = criu {
            // Refuse a damaged checkpoint before the running jail goes: its manifest
            // and images, and the host paths its binds come from.
            let checkpoint = Checkpoint::open(snapshot).map_err(|e| error_chain(&e))?;
            let config = self.restore_config()?;
            checkpoint
                .mount_sources(&config)
                .map_err(|e| format!("restoring the jail: {}", error_chain(&e)))?;
            self.stop_current()?;
            tracing::debug!(elapsed = ?start.elapsed(), "rollback: old jail stopped");
            self.restore(criu, snapshot)?;
            tracing::debug!(elapsed = ?start.elapsed(), "rollback: processes restored");
            return Ok(());
        }
        // Copy first: a snapshot that cannot be copied leaves the sandbox as it was.
        let seed = self.stage_seed(&SnapshotDir::new(snapshot).layer())?;
        tracing::debug!(elapsed = ?start.elapsed(), "rollback: layer copied");
        if let Err(e) = self.stop_current() {
            let _ = std::fs::remove_dir_all(&seed);
            return Err(e.into());
        }
        let spawned = self.spawn(Some(seed));
        tracing::debug!(elapsed = ?start.elapsed(), "rollback: new jail started");
        Ok(spawned?)
    }

    /// Stops the processes, keeping their state on disk: a CRIU checkpoint where it
    /// works, else the layer alone (the processes start afresh at wake).
    fn hibernate(&mut self) -> Result<(), Failure> {
        if self.jail.is_none() {
            return Err(Failure::bad_state("sandbox is already hibernated"));
        }
        let image_dir = self.dir.hibernated_checkpoint();
        let _ = std::fs::remove_dir_all(&image_dir);
        let dumped = match criu() {
            Ok(criu) => self.dump(criu, &image_dir, false).and_then(|paused| {
                let stats = SnapshotStats {
                    paused_us: paused.as_micros() as u64,
                    ..SnapshotStats::default()
                };
                jail_snapshot::record_hibernation(
                    &image_dir,
                    &self.id,
                    stats,
                    SnapshotKind::Full,
                    None,
                )
                .map_err(|e| error_chain(&e))
            }),
            Err(why) => Err(format!("no working CRIU: {why}")),
        };
        let jail = self.jail.take().ok_or("sandbox is already hibernated")?;
        self.lifeline = None;
        self.paused = false;
        let stopped = match dumped {
            Ok(()) => {
                // Synced to disk and marked off the request path, as a snapshot is.
                self.flushes.start_in_own_dir(image_dir);
                jail.destroy()
                    .map_err(|e| format!("removing the dumped jail: {}", error_chain(&e)))
            }
            Err(why) => {
                tracing::warn!(sandbox = %self.id, "hibernating the files only: {why}");
                self.hibernate_files(jail, &image_dir, why)
            }
        };
        stopped?;
        if let Some(network) = self.network.as_mut() {
            network.disconnect();
        }
        Ok(())
    }

    /// Brings a hibernated sandbox back: restores its checkpoint, or starts new
    /// processes on its layer.
    fn wake(&mut self) -> Result<(), Failure> {
        if self.jail.is_some() {
            return Err(Failure::bad_state("sandbox is not hibernated"));
        }
        let image_dir = self.dir.hibernated_checkpoint();
        if image_dir.exists() {
            // A checkpoint, or the files alone, recorded: one a crash cut short, or
            // damaged since, is refused and kept, the sandbox staying hibernated.
            jail_snapshot::open(&image_dir)?;
            if is_checkpoint(&image_dir) {
                let criu = criu().map_err(|why| {
                    Failure::new(
                        ErrorKind::HostCannot,
                        format!("the sandbox was hibernated with its processes, but there is no working CRIU: {why}"),
                    )
                })?;
                self.restore(criu, &image_dir)?;
            } else {
                // The files' flush ends before the layer moves out from under it.
                self.flushes.join();
                self.spawn(Some(SnapshotDir::new(&image_dir).layer()))?;
            }
            self.remove_aside(&image_dir);
            return Ok(());
        }
        // Kept unrecorded (see `hibernate_files`).
        let layer = self.dir.hibernated_layer();
        Ok(self.spawn(Some(layer))?)
    }

    /// Ends every process and removes the jail, its cgroups and its layer; the agent
    /// socket goes too. Waits for the snapshots' flushes.
    fn destroy(&mut self) {
        for handle in std::mem::take(&mut self.retiring) {
            let _ = handle.join();
        }
        self.flushes.join();
        if let Some(jail) = self.jail.take() {
            if let Err(e) = jail.destroy() {
                tracing::warn!(sandbox = %self.id, "destroying the jail: {}", error_chain(&e));
            }
        }
        // The device goes with the jail's namespace; this also clears the datapath.
        if let Some(mut network) = self.network.take() {
            network.disconnect();
        }
        for leftover in self.dir.jail_leftovers() {
            let _ = std::fs::remove_dir_all(leftover);
        }
        let _ = std::fs::remove_file(self.dir.agent_socket());
    }

    /// Writes the new limits to the running jail's cgroups (and a hibernated one's
    /// settings), and keeps them for every later start or restore of its jail. The
    /// sizes of its tmpfs follow at the next start.
    fn set_limits(&mut self, change: LimitChange) -> Result<(), Failure> {
        let settings = change.applied_to(&self.settings);
        let limits = limits(&settings, self.dir.path())?;
        if let Some(jail) = &self.jail {
            jail.set_limits(&limits)
                .map_err(|e| format!("setting limits: {}", error_chain(&e)))?;
        }
        self.settings = settings;
        Ok(())
    }

    fn networked(&mut self) -> Option<&mut dyn Networked> {
        Some(self)
    }
}

impl Networked for JailSandbox {
    fn network(&mut self) -> Result<&mut dyn NetworkControl, Failure> {
        held_network(&mut self.network)
    }
}

/// Connects to the agent of the jail sandbox whose `agent.sock` link is `link`,
/// resolving the path inside the sandbox's root with `openat2(RESOLVE_IN_ROOT)`: the
/// socket sits on the sandbox's own /tmp, where its code can replace it with a
/// symlink, and a plain connect through `/proc/<pid>/root` would follow an absolute
/// one on the host (to any host socket). Here it stays inside the sandbox. The link
/// itself is read as [`read_agent_link`] does.
pub fn connect_agent(link: &Path) -> std::io::Result<std::os::unix::net::UnixStream> {
    use std::io::{Error, ErrorKind};
    let target = read_agent_link(link)?;
    let bad = || {
        Error::new(
            ErrorKind::InvalidData,
            format!("{} is not a jail agent link", link.display()),
        )
    };
    let text = target.to_str().ok_or_else(bad)?;
    let root = text.strip_suffix(AGENT_INNER_SOCKET).ok_or_else(bad)?;
    let pid = root
        .strip_prefix("/proc/")
        .and_then(|r| r.strip_suffix("/root"))
        .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|p| p.parse::<i32>().ok())
        .ok_or_else(bad)?;
    connect_inner(pid)
}

/// Reads the agent link `link` (`<sandbox>/agent.sock`), following no symbolic link
/// in its last two components but the link itself, which must be one a jail
/// supervisor made: root's (or, where the library runs without root, its own uid's).
/// A VM supervisor runs as a uid of its own and owns its sandbox's directory: one
/// taken over could write a record that calls its sandbox a jail and a link into
/// another sandbox's jail beside it, and this sandbox's caller would reach the other
/// sandbox's agent.
fn read_agent_link(link: &Path) -> std::io::Result<PathBuf> {
    use std::io::{Error, ErrorKind};
    use std::os::unix::fs::MetadataExt;
    let opened = cube_storage::no_follow::open(link, 2, libc::O_PATH | libc::O_NOFOLLOW)?;
    let opened = std::fs::File::from(opened);
    let meta = opened.metadata()?;
    if !meta.file_type().is_symlink() {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("{} is not a jail agent link", link.display()),
        ));
    }
    let euid = nix::unistd::geteuid().as_raw();
    if meta.uid() != 0 && meta.uid() != euid {
        return Err(Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "{} was made by uid {}, not by a jail supervisor: refused",
                link.display(),
                meta.uid()
            ),
        ));
    }
    // An empty path reads the link the descriptor (O_PATH | O_NOFOLLOW) names.
    Ok(nix::fcntl::readlinkat(&opened, "")?.into())
}

/// Connects to the agent socket of the jail whose PID 1 is `pid`, resolving
/// [`AGENT_INNER_SOCKET`] inside the jail's root (see [`connect_agent`]): every path
/// the host side follows inside a sandbox stays inside it.
fn connect_inner(pid: i32) -> std::io::Result<std::os::unix::net::UnixStream> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    let root = std::fs::File::open(format!("/proc/{pid}/root"))?;
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let socket = nix::fcntl::openat2(&root, AGENT_INNER_SOCKET.trim_start_matches('/'), how)?;
    cube_storage::no_follow::connect_opened(&socket)
}

/// Where the agent finds the read end of its lifeline.
const LIFELINE_FD: i32 = 3;
/// How the agent is started in a jail.
const AGENT_ARGV: &[&str] = &[
    AGENT_PATH,
    "--listen",
    AGENT_INNER_SOCKET,
    "--lifeline-fd",
    "3",
];

/// A pipe whose read end the agent watches and whose write end only the supervisor
/// holds (close-on-exec, so no other child inherits it): when the supervisor dies,
/// even by SIGKILL, the agent reads the end and shuts its sandbox down. (A parent-death
/// signal would not do: it follows the thread that spawned the jail, and request
/// threads come and go.) A pipe, not a socket, so that CRIU can carry it over.
struct Lifeline {
    read: std::os::fd::OwnedFd,
    write: std::os::fd::OwnedFd,
}

impl Lifeline {
    fn new() -> Result<Lifeline, String> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| format!("creating the agent's lifeline: {e}"))?;
        Ok(Lifeline { read, write })
    }

    fn fds(&self) -> [(std::os::fd::BorrowedFd<'_>, i32); 1] {
        use std::os::fd::AsFd;
        [(self.read.as_fd(), LIFELINE_FD)]
    }
}

/// The agent's socket as the host reaches it while `pid` is the sandbox's PID 1.
fn inner_socket(pid: i32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/root{AGENT_INNER_SOCKET}"))
}

/// Waits until the agent of PID 1 `pid` accepts connections, then points
/// `<dir>/agent.sock` at its socket (replacing the link atomically).
fn publish_socket(dir: &SandboxDir, pid: i32) -> Result<(), String> {
    wait_listening(pid)?;
    let inner = inner_socket(pid);
    let link = dir.agent_socket();
    let tmp = dir.agent_socket_staging();
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&inner, &tmp)
        .and_then(|()| std::fs::rename(&tmp, &link))
        .map_err(|e| format!("linking {} to the agent: {e}", link.display()))
}

/// Has the agent (PID 1 `pid`) close its host connections, and waits until its only
/// socket is the listening one and the signal has been taken: a signal still pending
/// when the sandbox is frozen would be saved with it, and the restored agent would
/// then drop the first connections made to it.
fn disconnect_agent(pid: i32) -> Result<(), String> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), DISCONNECT_SIGNAL)
        .map_err(|e| format!("signalling the agent: {e}"))?;
    let fd_dir = PathBuf::from(format!("/proc/{pid}/fd"));
    let deadline = Instant::now() + DISCONNECT_TIMEOUT;
    loop {
        let sockets = std::fs::read_dir(&fd_dir)
            .map_err(|e| format!("reading {}: {e}", fd_dir.display()))?
            .filter_map(Result::ok)
            .filter(|e| {
                std::fs::read_link(e.path())
                    .map(|l| l.as_os_str().as_encoded_bytes().starts_with(b"socket:"))
                    .unwrap_or(false)
            })
            .count();
        if sockets <= 1 && !signal_pending(pid, DISCONNECT_SIGNAL)? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "the agent still holds {} host connections or has not taken the signal",
                sockets.saturating_sub(1)
            ));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Whether `signal` waits, sent to process `pid` and not yet taken by any of its
/// threads (the `ShdPnd` mask of /proc/PID/status).
fn signal_pending(pid: i32, signal: nix::sys::signal::Signal) -> Result<bool, String> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).map_err(|e| format!("reading {path}: {e}"))?;
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("ShdPnd:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .ok_or_else(|| format!("{path} has no ShdPnd line"))?;
    Ok(mask & (1u64 << (signal as i32 - 1)) != 0)
}

/// Pool jails' cgroups are this followed by their supervisor's pid.
const POOL_CGROUP_PREFIX: &str = "pool-";

/// A jail on the host template with its agent running, started by a pooled
/// supervisor before anyone asked for it: adopting it costs a rename and a symlink
/// instead of a jail start.
pub struct PrespawnedJail {
    jail: Jail,
    agent: PathBuf,
    lifeline: std::os::fd::OwnedFd,
    /// A device attached into the jail's namespace ahead of time, holding a
    /// deny-everything policy (see [`JailNetwork::standby`]).
    network: Option<JailNetwork>,
}

impl PrespawnedJail {
    /// Starts a default jail in a scratch entry of `scratch` and waits for its agent.
    /// `scratch` must be on the store's filesystem (it is renamed into a sandbox).
    pub fn start(scratch: &Path) -> Result<PrespawnedJail, String> {
        let agent = locate_agent()?;
        // Named as the store's scratch entries of a live process, so that no clean-up
        // of stale scratch removes it under a running jail.
        let state_dir = cube_storage::scratch_entry_name("jail")
            .map(|n| scratch.join(n))
            .map_err(|e| error_chain(&e))?;
        // Pool jails' cgroups are named after their supervisor, so what a killed one
        // left is recognisable: the first pooled jail of each supervisor sweeps it.
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(|| {
            if let Ok(layout) = cube_jail::CgroupLayout::detect() {
                let removed = layout.remove_orphaned(POOL_CGROUP_PREFIX);
                if removed > 0 {
                    tracing::info!(removed, "removed cgroups of killed pooled supervisors");
                }
            }
        });
        let name = format!("{POOL_CGROUP_PREFIX}{}", std::process::id());
        let config = jail_config(&name, &state_dir, &agent, &Settings::default(), None, None)?;
        let lifeline = Lifeline::new()?;
        let mut jail = Jail::spawn_with_fds(&config, AGENT_ARGV, &lifeline.fds())
            .map_err(|e| format!("starting the jail: {}", error_chain(&e)))?;
        if let Err(e) = wait_listening(jail.pid()) {
            let _ = jail.kill();
            let _ = jail.wait();
            let _ = jail.destroy();
            return Err(e);
        }
        Ok(PrespawnedJail {
            jail,
            agent,
            lifeline: lifeline.write,
            network: None,
        })
    }

    /// Attaches a network device into the jail's namespace now, for a networked
    /// create to put into service (see [`JailNetwork::standby`]).
    pub fn attach_standby_network(&mut self) -> Result<(), JailNetworkError> {
        if self.network.is_none() {
            self.network = Some(JailNetwork::standby(self.jail.pid())?);
        }
        Ok(())
    }

    /// Whether a device waits in the jail's namespace.
    pub fn has_network(&self) -> bool {
        self.network.is_some()
    }
}

/// Waits until the agent of PID 1 `pid` listens. (The probe connection is closed at
/// once; the agent sees it end.)
fn wait_listening(pid: i32) -> Result<(), String> {
    wait_listening_for(pid, AGENT_READY_TIMEOUT)
}

/// [`wait_listening`] for at most `timeout`. The probe resolves the socket inside the
/// jail's root: the sandbox's code can put a symlink in its place, which a plain
/// connect through `/proc/<pid>/root` would follow on the host, to any host socket.
fn wait_listening_for(pid: i32, timeout: Duration) -> Result<(), String> {
    let inner = inner_socket(pid);
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(50);
    loop {
        match connect_inner(pid) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!(
                    "the agent did not listen at {}: {e}",
                    inner.display()
                ))
            }
            Err(_) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_micros(500));
            }
        }
    }
}

/// The limits `settings` ask for, every one they leave unset at its default where the
/// host can enforce it (see [`Limits::with_defaults`]); `dir` is where the jail's
/// directory will be (its filesystem decides the disk default).
fn limits(settings: &Settings, dir: &Path) -> Result<Limits, String> {
    let mib = |m: u64, what: &str| {
        m.checked_mul(1 << 20)
            .ok_or(format!("{what} limit too large"))
    };
    let asked = Limits {
        memory_bytes: settings.memory_mib.map(|m| mib(m, "memory")).transpose()?,
        cpu_quota: settings.cpu_millis.map(|m| f64::from(m) / 1000.0),
        pids_max: settings.pids_max.map(u64::from),
        disk_bytes: settings.disk_mib.map(|m| mib(m, "disk")).transpose()?,
    };
    // Looked up once per supervisor.
    static LAYOUT: OnceLock<Option<cube_jail::CgroupLayout>> = OnceLock::new();
    let limits = match LAYOUT.get_or_init(|| cube_jail::CgroupLayout::detect().ok()) {
        Some(layout) => asked.with_defaults(layout, dir),
        None => asked,
    };
    limits.validate().map_err(|e| error_chain(&e))?;
    Ok(limits)
}

/// Whether this process's standard error is `/dev/null`.
fn stderr_is_null() -> bool {
    use std::os::unix::fs::MetadataExt;
    match (
        std::fs::metadata("/proc/self/fd/2"),
        std::fs::metadata("/dev/null"),
    ) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The jail of a sandbox: its spec ([`JailSpec`], shared with one-shot jails) with
/// the sandbox's environment and limits, and the agent's diagnostics where the
/// supervisor's go.
fn jail_config(
    name: &str,
    state_dir: &Path,
    agent: &Path,
    settings: &Settings,
    tree: Option<&Path>,
    seed: Option<PathBuf>,
) -> Result<JailConfig, String> {
    let mut env = vec![("RUST_LOG".to_string(), "warn".to_string())];
    env.extend(settings.env.iter().cloned());
    let mut config = JailSpec {
        name,
        state_dir,
        agent,
        tree,
        seed,
        env,
        limits: limits(settings, state_dir.parent().unwrap_or(state_dir))?,
    }
    .config();
    // The agent's own diagnostics go where the supervisor's do. Where that is
    // /dev/null, the jail opens its own: a checkpoint cannot restore one host file as
    // two different kinds of stream (stdin is /dev/null too).
    config.stderr = if stderr_is_null() {
        Stdio::Null
    } else {
        Stdio::Inherit
    };
    if let Some(cwd) = &settings.cwd {
        config.cwd = cwd.clone();
    }
    config.pid1_may_chroot = settings.hosts_containers;
    match &settings.netns {
        NetnsChoice::Own => {}
        NetnsChoice::Host => config.namespaces.net = false,
        NetnsChoice::Join(path) => {
            config.namespaces.net = false;
            config.netns = Some(path.clone());
        }
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::{SigSet, Signal};
    use std::os::unix::process::CommandExt;

    #[test]
    fn a_signal_sent_and_blocked_is_seen_pending() {
        let mut blocked = std::process::Command::new("sleep");
        blocked.arg("30");
        // SAFETY: sigprocmask is async-signal-safe; the child blocks SIGUSR2 for exec.
        unsafe {
            blocked.pre_exec(|| {
                let mut set = SigSet::empty();
                set.add(Signal::SIGUSR2);
                set.thread_block().map_err(std::io::Error::from)
            });
        }
        let mut child = blocked.spawn().unwrap();
        let pid = child.id() as i32;
        assert!(!signal_pending(pid, Signal::SIGUSR2).unwrap());
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGUSR2).unwrap();
        assert!(signal_pending(pid, Signal::SIGUSR2).unwrap());
        assert!(!signal_pending(pid, Signal::SIGUSR1).unwrap());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(signal_pending(-1, Signal::SIGUSR2).is_err());
    }

    #[test]
    fn the_readiness_probe_does_not_follow_a_planted_symlink_to_a_host_socket() {
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } != 0 || cube_jail::CgroupLayout::detect().is_err() {
            println!("skipped: jails need root and a cgroup hierarchy");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        // A host socket the sandbox must never make the supervisor connect to.
        let host_socket = tmp.path().join("host.sock");
        let listener = std::os::unix::net::UnixListener::bind(&host_socket).unwrap();
        listener.set_nonblocking(true).unwrap();
        let mut config = JailConfig::new(
            format!("t{}-probe", std::process::id()),
            tmp.path().join("jail"),
        );
        config.pausable = false;
        // What code in a sandbox can do: replace the agent's socket with a symlink.
        let script = format!(
            "ln -sf {} {AGENT_INNER_SOCKET} && touch /tmp/.planted && sleep 30",
            host_socket.display()
        );
        let jail = Jail::spawn(&config, &["/bin/sh", "-c", &script]).unwrap();
        let pid = jail.pid();
        let root_tmp = PathBuf::from(format!("/proc/{pid}/root/tmp/.planted"));
        for _ in 0..500 {
            if root_tmp.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(root_tmp.exists(), "the symlink was never planted");
        let probed = wait_listening_for(pid, Duration::from_millis(300));
        let reached = listener.accept().is_ok();
        jail.destroy().unwrap();
        assert!(!reached, "the probe connected to the host socket");
        assert!(
            probed.is_err(),
            "the probe found an agent that does not exist"
        );
    }
}
