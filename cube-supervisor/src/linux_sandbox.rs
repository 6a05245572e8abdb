//! A Linux-guest VM sandbox as its supervisor holds it: a [`LinuxVm`] restored (never
//! booted) from a template or snapshot, with its own copy of the root disk
//! (`rootfs.img` in the sandbox directory), its vsock device's host socket at
//! `<sandbox dir>/vsock.sock` (where the library's `Sandbox::agent` connects), its entropy
//! device, and its NIC, with a TAP from cube-net's pool behind it when the sandbox was
//! created with a network, which its network keeper holds (see
//! [`crate::network_keeper`]).
//!
//! Every restore here (create, rollback, wake) counts as a clone: the rng moves to a
//! new generation, the vsock device resets the guest's connections (their host ends
//! are gone), and once the guest's agent answers the host has it reseed the kernel
//! CRNG, so a guest never replays random state it already used.
//!
//! Snapshots, rollback and hibernation work as the test-guest VM's do: the memory
//! file is a clone of the parent image with only the pages dirtied since written
//! over it ([`LinuxVm::snapshot`]); a snapshot is written into a staging directory
//! and renamed into place, so a failed or interrupted one leaves the sandbox running
//! as it was and every earlier snapshot untouched; a rollback builds the new VM
//! before it lets the old one go, and a failed one leaves the old one as it was.
//!
//! The devices are attached in the kinds and order the snapshot records
//! ([`crate::vm_devices::snapshot_devices`]); a snapshot with devices Cube cannot give
//! a host side to is refused.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cube_devices::records::DeviceKind;
use cube_devices::virtio::tap::Tap;
use cube_storage::durable_marker::PendingFlush;
use cube_storage::{SandboxDir, SnapshotDir};
use cube_vmm::linux_vm::LinuxVm;
use cube_vmm::persist::state::{read_state, GuestKind};
use cube_vmm::vstate::KvmContext;

use crate::backend::{awake, NetworkControl, Networked, SandboxBackend};
use crate::confinement::Profile;
use crate::error_report::chain as error_chain;
use crate::flush::Flushes;
use crate::network::NetnsChoice;
use crate::network_keeper::NetworkKeeper;
use crate::pod_network::PodLink;
use crate::protocol::{ErrorKind, Failure, MachineStatus, Settings, StatusReport};
use crate::records::{Engine, SnapshotMeta};
use crate::resident_memory::own_rss_kib;
use crate::snapshot_transaction::{
    write_hibernation_image, PendingCommit, SnapshotTransaction, Staged,
};
use crate::vm_agent::{agent_client, VmAgentError};
use crate::vm_devices::{snapshot_devices, TEMPLATE_GUEST_MAC};

/// One Linux-guest sandbox. Field order is drop order: the VM (and its NIC's handle
/// on the TAP) goes before the TAP, the TAP before the network gives it back.
pub struct LinuxSandbox {
    ctx: Arc<KvmContext>,
    dir: SandboxDir,
    /// None while hibernated (or once destroyed).
    vm: Option<LinuxVm>,
    /// The TAP behind the NIC, kept across rollback and hibernation.
    tap: Option<Tap>,
    /// The process that holds the pool's TAP and changes and releases it.
    network: Option<Box<NetworkKeeper>>,
    /// The pod's network the VM stands on, where it joined a pod's namespace.
    pod: Option<PodLink>,
    hibernated: bool,
    /// Bumped on every restore (create, rollback, wake).
    generation: u64,
    /// Tells the clone-reseed thread of the current VM to give up.
    stop_reseed: Arc<AtomicBool>,
    /// Background flushes of snapshots this sandbox wrote.
    flushes: Flushes,
    /// The snapshot staged last, until the library has moved it into place.
    pending: Option<PendingCommit>,
}

/// How long a restored VM on a pod's network has for its agent to answer and take the
/// pod's address (a guest whose kernel runs emulated is slow to answer).
const POD_CONFIGURE_WINDOW: Duration = Duration::from_secs(120);

/// How long after a restore the host keeps trying to reach the agent to reseed it.
const RESEED_WINDOW: Duration = Duration::from_secs(30);

/// Has the restored guest's agent reseed the kernel CRNG with fresh host entropy, as
/// soon as it answers: a clone must not keep the random state of the snapshot it
/// shares with its siblings. (The agent also watches the rng's generation counter
/// where the guest kernel lets it read it.)
fn reseed_when_ready(vsock_socket: PathBuf, stop: Arc<AtomicBool>) {
    let spawned = std::thread::Builder::new()
        .name("reseed-clone".into())
        .spawn(move || {
            let deadline = Instant::now() + RESEED_WINDOW;
            while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                match agent_client(&vsock_socket, Duration::from_millis(500)) {
                    Ok(client) => {
                        let mut entropy = vec![0u8; 64];
                        if let Err(e) = cube_storage::fill_random(&mut entropy) {
                            tracing::warn!("no host entropy for the clone's reseed: {e}");
                            return;
                        }
                        match client.reseed(entropy) {
                            Ok(()) => tracing::debug!("clone's kernel CRNG reseeded"),
                            Err(e) => tracing::warn!(
                                "reseeding the clone's kernel CRNG: {}",
                                error_chain(&e)
                            ),
                        }
                        return;
                    }
                    Err(VmAgentError::NotReady { .. }) => {}
                    Err(_) => std::thread::sleep(Duration::from_millis(200)),
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("starting the clone-reseed thread: {e}");
    }
}

impl LinuxSandbox {
    /// Restores the Linux snapshot in `snapshot` into a running VM whose disk is
    /// `dir/rootfs.img` (already copied there) and whose console goes to
    /// `dir/console.log`; with `settings.network`, a TAP from the host's pool goes
    /// behind the guest's NIC.
    pub fn restore(
        ctx: &Arc<KvmContext>,
        dir: &Path,
        snapshot: &Path,
        settings: &Settings,
    ) -> Result<Self, Failure> {
        let dir = SandboxDir::new(dir);
        let disk = dir.rootfs();
        if !disk.is_file() {
            return Err(Failure::new(
                ErrorKind::SnapshotFailed,
                format!(
                    "{} has no root disk; a Linux VM sandbox needs one",
                    snapshot.display()
                ),
            ));
        }
        let mut sandbox = LinuxSandbox {
            ctx: Arc::clone(ctx),
            dir: dir.clone(),
            vm: None,
            tap: None,
            network: None,
            pod: None,
            hibernated: false,
            generation: 0,
            stop_reseed: Arc::new(AtomicBool::new(true)),
            flushes: Flushes::default(),
            pending: None,
        };
        match &settings.netns {
            NetnsChoice::Own => {}
            NetnsChoice::Host => {
                return Err(Failure::unsupported(
                    "a VM cannot live in the host's network namespace: its guest runs a \
                     kernel of its own (give it a network from the pool instead)",
                ))
            }
            NetnsChoice::Join(path) => {
                if settings.network.is_some() {
                    return Err(Failure::unsupported(
                        "a VM stands either on the network of the namespace it joins or on \
                         one from the host's pool, not both",
                    ));
                }
                let pod = PodLink::open(path).map_err(|e| {
                    format!(
                        "putting the VM on the network of {}: {}",
                        path.display(),
                        error_chain(&e)
                    )
                })?;
                sandbox.tap = Some(
                    pod.tap()
                        .try_clone()
                        .map_err(|e| format!("sharing TAP {}: {e}", pod.tap().name()))?,
                );
                sandbox.pod = Some(pod);
            }
        }
        if let Some(options) = &settings.network {
            let network = NetworkKeeper::attach_tap(TEMPLATE_GUEST_MAC, options, &dir)
                .map_err(|f| f.prefixed("attaching the network"))?;
            let name = network.tap_name().to_string();
            // On an error below the sandbox drops, and the network goes back.
            sandbox.network = Some(Box::new(network));
            sandbox.tap = Some(
                Tap::open(&name).map_err(|e| format!("opening TAP {name}: {}", error_chain(&e)))?,
            );
        }
        let vm = sandbox
            .build_vm(snapshot, &disk, true)
            .map_err(|e| Failure::new(ErrorKind::SnapshotFailed, e))?;
        sandbox.start(vm)?;
        // The snapshot's guest holds another's address (a template's, or a clone
        // source's): the pod's comes before the sandbox is handed out.
        sandbox.address_for_pod()?;
        Ok(sandbox)
    }

    /// A VM restored from `snapshot` with `disk` as its root disk, paused; its console
    /// starts a new log (`fresh`) or continues the sandbox's.
    fn build_vm(&self, snapshot: &Path, disk: &Path, fresh: bool) -> Result<LinuxVm, String> {
        let state = read_state(snapshot).map_err(|e| error_chain(&e))?;
        if state.guest != GuestKind::Linux {
            return Err(format!(
                "{} holds Cube's test guest, not a Linux guest",
                snapshot.display()
            ));
        }
        let console = OpenOptions::new()
            .create(true)
            .write(true)
            .append(!fresh)
            .truncate(fresh)
            .open(self.dir.console_log())
            .map_err(|e| format!("opening the console log: {e}"))?;
        let tap = match &self.tap {
            Some(tap) => Some(
                tap.try_clone()
                    .map_err(|e| format!("sharing TAP {}: {e}", tap.name()))?,
            ),
            None => None,
        };
        let kinds: Vec<DeviceKind> = state.devices.iter().map(|d| d.kind).collect();
        let devices = snapshot_devices(&kinds, disk, &self.dir.vsock_socket(), tap)?;
        LinuxVm::restore(&self.ctx, snapshot, Box::new(console), devices, true)
            .map_err(|e| error_chain(&e))
    }

    /// Lets a freshly restored VM run as the sandbox's, and has its agent reseeded.
    fn start(&mut self, mut vm: LinuxVm) -> Result<(), String> {
        vm.resume().map_err(|e| error_chain(&e))?;
        self.stop_reseed.store(true, Ordering::Relaxed);
        self.stop_reseed = Arc::new(AtomicBool::new(false));
        reseed_when_ready(self.dir.vsock_socket(), Arc::clone(&self.stop_reseed));
        // The old VM (a rollback's) stops here, after the new one took over.
        self.vm = Some(vm);
        self.hibernated = false;
        self.generation += 1;
        Ok(())
    }

    fn vm(&mut self) -> Result<&mut LinuxVm, Failure> {
        awake(&mut self.vm, self.hibernated, VM_GONE)
    }

    /// Has a VM on a pod's network take the pod's address; a no-op for others.
    fn address_for_pod(&self) -> Result<(), String> {
        match &self.pod {
            Some(pod) => pod
                .configure_guest(&self.dir.vsock_socket(), POD_CONFIGURE_WINDOW)
                .map_err(|e| error_chain(&e)),
            None => Ok(()),
        }
    }

    /// [`LinuxSandbox::address_for_pod`] after a rollback or wake: the snapshot was
    /// taken in this pod, so its guest holds the address already, and a failure is
    /// said, not fatal (the VM runs, and the rollback or wake is done).
    fn readdress_for_pod(&self) {
        if let Err(e) = self.address_for_pod() {
            tracing::warn!("the guest did not take its pod's address again: {e}");
        }
    }
}

const VM_GONE: &str = "the VM is gone";

impl SandboxBackend for LinuxSandbox {
    fn dir(&self) -> &Path {
        &self.dir
    }

    fn confinement(&self) -> Profile {
        // A pod's TAP is open already, and a pool's TAP is its keeper's to change and
        // release: nothing of the network is needed here after set-up.
        Profile::Vm
    }

    fn status(&mut self) -> StatusReport {
        let status = match &self.vm {
            None if self.hibernated => MachineStatus::Hibernated,
            None => MachineStatus::Failed("the VM is gone".into()),
            Some(vm) => match vm.fatal() {
                Some(why) => MachineStatus::Failed(why),
                None if vm.is_running() => MachineStatus::Running,
                None => MachineStatus::Paused,
            },
        };
        StatusReport {
            status,
            pid: std::process::id(),
            counter: 0,
            generation: self.generation,
            guest_error: false,
            config: None,
            rss_kib: own_rss_kib(),
            engine: Engine::Vm,
            jail: None,
        }
    }

    fn pause(&mut self) -> Result<(), Failure> {
        self.vm()?
            .pause()
            .map_err(|e| Failure::from(error_chain(&e)))
    }

    fn resume(&mut self) -> Result<(), Failure> {
        self.vm()?
            .resume()
            .map_err(|e| Failure::from(error_chain(&e)))
    }

    /// Memory diff, devices and disk, taken live: the vCPUs and devices stop only
    /// while the state and the dirty set are taken ([`LinuxVm::snapshot`]). The dirty
    /// pages stay pending in the VM until the library says the snapshot is in place.
    fn snapshot(&mut self, staging: &Path, dest: &Path) -> Result<SnapshotMeta, Failure> {
        let sandbox_id = self
            .dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tx = SnapshotTransaction::begin(staging, dest)?;
        let disk = self.dir.rootfs();
        let vm = awake(&mut self.vm, self.hibernated, VM_GONE)?;
        let staged_dir = tx.create_staging()?;
        let stats = vm
            .snapshot(&staged_dir, Some(&disk))
            .map_err(|e| Failure::from(error_chain(&e)))?;
        let (meta, pending) = tx.stage(&sandbox_id, Engine::Vm, Staged::full(stats))?;
        self.pending = Some(pending);
        Ok(meta)
    }

    fn snapshot_committed(&mut self, dest: &Path) -> Result<(), Failure> {
        let pending = PendingCommit::take_for(&mut self.pending, dest)?;
        let vm = awake(&mut self.vm, self.hibernated, VM_GONE)?;
        let committed = |staged: &PendingFlush| {
            vm.snapshot_committed_from(PendingCommit::memory(staged)?);
            Ok(())
        };
        pending.finish(committed, &mut self.flushes)
    }

    /// Replaces the VM with one restored from `snapshot` (its disk copied over the
    /// sandbox's). The new VM is built while the old one waits paused; if that fails
    /// the old one continues as it was, with its disk and vsock socket.
    fn rollback(&mut self, snapshot: &Path) -> Result<(), Failure> {
        let source_disk = SnapshotDir::new(snapshot).rootfs();
        if !source_disk.is_file() {
            return Err(format!("{} has no root disk", snapshot.display()).into());
        }
        let staged = self.dir.rootfs_rollback();
        let _ = std::fs::remove_file(&staged);
        cube_storage::clone_file(&source_disk, &staged).map_err(|e| error_chain(&e))?;
        let was_running = !self.hibernated && self.vm.as_ref().is_some_and(LinuxVm::is_running);
        let socket = self.dir.vsock_socket();
        let aside = self.dir.vsock_socket_aside();
        let hibernated = self.hibernated;
        let paused = match self.vm.as_mut().filter(|_| !hibernated) {
            Some(vm) => vm.pause().map_err(|e| error_chain(&e)),
            None => Ok(()),
        };
        let built = paused.and_then(|()| {
            // The old VM's listener keeps its socket under another name, so that
            // it can have it back if the new VM does not come up.
            if socket.exists() {
                std::fs::rename(&socket, &aside)
                    .map_err(|e| format!("setting the vsock socket aside: {e}"))?;
            }
            self.build_vm(snapshot, &staged, false)
        });
        match built {
            Ok(vm) => {
                std::fs::rename(&staged, self.dir.rootfs())
                    .map_err(|e| format!("replacing the root disk: {e}"))?;
                let _ = std::fs::remove_file(&aside);
                self.start(vm)?;
                self.readdress_for_pod();
                // A hibernation image is of the state just left.
                let _ = std::fs::remove_dir_all(self.dir.hibernation());
                Ok(())
            }
            Err(e) => {
                let _ = std::fs::remove_file(&staged);
                if aside.exists() {
                    let _ = std::fs::remove_file(&socket);
                    let _ = std::fs::rename(&aside, &socket);
                }
                if was_running {
                    if let Some(vm) = &mut self.vm {
                        let _ = vm.resume();
                    }
                }
                Err(e.into())
            }
        }
    }

    /// Writes the state into `hibernate/` (memory as a diff against the parent image)
    /// and releases the VM; the disk stays where it is, the TAP stays attached.
    fn hibernate(&mut self) -> Result<(), Failure> {
        let vm = awake(&mut self.vm, self.hibernated, VM_GONE)?;
        let was_running = vm.is_running();
        let written = write_hibernation_image(&self.dir, &mut self.flushes, |staging| {
            // Stopped for good once its state is taken: nothing the guest does after its
            // image may be lost on wake.
            vm.final_snapshot(staging, None)
                .map_err(|e| error_chain(&e))?;
            Ok(())
        });
        if let Err(e) = written {
            if was_running {
                let _ = vm.resume();
            }
            return Err(e);
        }
        self.stop_reseed.store(true, Ordering::Relaxed);
        self.vm = None;
        let _ = std::fs::remove_file(self.dir.vsock_socket());
        self.hibernated = true;
        Ok(())
    }

    fn wake(&mut self) -> Result<(), Failure> {
        if !self.hibernated {
            return Err(Failure::bad_state("sandbox is not hibernated"));
        }
        let vm = self
            .build_vm(&self.dir.hibernation(), &self.dir.rootfs(), false)
            .map_err(|e| Failure::new(ErrorKind::SnapshotFailed, e))?;
        self.start(vm)?;
        self.readdress_for_pod();
        Ok(())
    }

    /// Stops the vCPUs and releases the VM, then its TAP and network (back to the
    /// pool); the vsock socket goes too.
    fn destroy(&mut self) {
        self.stop_reseed.store(true, Ordering::Relaxed);
        self.vm = None;
        self.tap = None;
        self.pod = None;
        if let Some(mut network) = self.network.take() {
            network.release();
        }
        self.flushes.join();
        let _ = std::fs::remove_file(self.dir.vsock_socket());
    }

    fn networked(&mut self) -> Option<&mut dyn Networked> {
        Some(self)
    }
}

impl Networked for LinuxSandbox {
    /// Never the supervisor's: the library asks a VM's network keeper directly (see
    /// [`crate::network_keeper`]), so that a supervisor taken over by its guest has
    /// no say in its own network.
    fn network(&mut self) -> Result<&mut dyn NetworkControl, Failure> {
        if self.network.is_none() {
            return Err(Failure::bad_state(
                "this sandbox has no network (create it with one)",
            ));
        }
        Err(Failure::bad_state(format!(
            "this VM's network is served by its network keeper at {}, not by its supervisor",
            self.dir.network_keeper_socket().display()
        )))
    }
}

impl Drop for LinuxSandbox {
    fn drop(&mut self) {
        SandboxBackend::destroy(self);
    }
}
