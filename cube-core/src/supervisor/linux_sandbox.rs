//! A Linux-guest VM sandbox as its supervisor holds it: a [`LinuxVm`] restored (never
//! booted) from a template or snapshot, with its own copy of the root disk
//! (`rootfs.img` in the sandbox directory), its vsock device's host socket at
//! `<sandbox dir>/vsock.sock` (where [`crate::Sandbox::agent`] connects) and its
//! entropy device, which moves to a new generation because every restore here is a
//! clone; once the guest's agent answers, the host has it reseed the kernel CRNG.
//!
//! The devices are attached in the order a VM template's guest had them
//! ([`template_devices`]); a snapshot of another layout is refused by the restore.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::protocol::{MachineStatus, Response, StatusReport};
use crate::devices::virtio::block::{Block, BlockOptions};
use crate::devices::virtio::device::VirtioDevice;
use crate::devices::virtio::rng::Rng;
use crate::devices::virtio::vsock::Vsock;
use crate::error_report::chain as error_chain;
use crate::sandbox::metadata::Engine;
use crate::snapshot::format::ROOTFS_FILE;
use crate::vm_template::TEMPLATE_GUEST_CID;
use crate::vmm::linux_boot::LinuxVm;
use crate::vstate::KvmContext;

/// File the guest's serial console goes to, in the sandbox directory.
pub const CONSOLE_LOG: &str = "console.log";

/// The devices of a VM template's guest, in their order: the root disk `disk`, vsock
/// with its host side in `dir`, entropy.
pub fn template_devices(disk: &Path, dir: &Path) -> Result<Vec<Box<dyn VirtioDevice>>, String> {
    Ok(vec![
        Box::new(
            Block::open(disk, BlockOptions::default())
                .map_err(|e| format!("opening {}: {}", disk.display(), error_chain(&e)))?,
        ),
        Box::new(Vsock::new(TEMPLATE_GUEST_CID, dir).map_err(|e| error_chain(&e))?),
        Box::new(Rng::new()),
    ])
}

/// One Linux-guest sandbox.
pub struct LinuxSandbox {
    dir: PathBuf,
    vm: Option<LinuxVm>,
    paused: bool,
    generation: u64,
    /// Tells the clone-reseed thread to give up (the sandbox is going away).
    stop_reseed: Arc<AtomicBool>,
}

/// How long after a restore the host keeps trying to reach the agent to reseed it.
const RESEED_WINDOW: Duration = Duration::from_secs(30);

/// Has the restored guest's agent reseed the kernel CRNG with fresh host entropy, as
/// soon as it answers: a clone must not keep the random state of the snapshot it
/// shares with its siblings. (The agent also watches the rng's generation counter
/// where the guest kernel lets it read it.)
fn reseed_when_ready(dir: PathBuf, stop: Arc<AtomicBool>) {
    let spawned = std::thread::Builder::new()
        .name("reseed-clone".into())
        .spawn(move || {
            let deadline = Instant::now() + RESEED_WINDOW;
            while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                match crate::vm_agent::agent_client(&dir, Duration::from_millis(500)) {
                    Ok(client) => {
                        let mut entropy = vec![0u8; 64];
                        // SAFETY: `entropy` is writable for its length.
                        let n = unsafe {
                            libc::getrandom(entropy.as_mut_ptr().cast(), entropy.len(), 0)
                        };
                        if n != 64 {
                            tracing::warn!("no host entropy for the clone's reseed");
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
                    Err(crate::vm_agent::VmAgentError::NotReady { .. }) => {}
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
    /// `dir/console.log`.
    pub fn restore(ctx: &Arc<KvmContext>, dir: &Path, snapshot: &Path) -> Result<Self, String> {
        let disk = dir.join(ROOTFS_FILE);
        if !disk.is_file() {
            return Err(format!(
                "{} has no root disk ({ROOTFS_FILE}); a Linux VM sandbox needs one",
                snapshot.display()
            ));
        }
        let console = std::fs::File::create(dir.join(CONSOLE_LOG))
            .map_err(|e| format!("creating the console log: {e}"))?;
        let devices = template_devices(&disk, dir)?;
        let vm = LinuxVm::restore(ctx, snapshot, Box::new(console), devices, true)
            .map_err(|e| error_chain(&e))?;
        vm.resume().map_err(|e| error_chain(&e))?;
        let stop_reseed = Arc::new(AtomicBool::new(false));
        reseed_when_ready(dir.to_path_buf(), Arc::clone(&stop_reseed));
        Ok(LinuxSandbox {
            dir: dir.to_path_buf(),
            vm: Some(vm),
            paused: false,
            generation: 1,
            stop_reseed,
        })
    }

    /// The sandbox's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn vm(&self) -> Result<&LinuxVm, String> {
        self.vm.as_ref().ok_or_else(|| "the VM is gone".to_string())
    }

    /// Carries out one request.
    pub fn handle(&mut self, request: super::Request) -> Result<Response, String> {
        use super::Request;
        match request {
            Request::Adopt { .. } => Err("already adopted".into()),
            Request::Destroy => Ok(Response::Ok),
            Request::Status => Ok(Response::Status(self.status())),
            Request::Pause => {
                self.vm()?.pause().map_err(|e| error_chain(&e))?;
                self.paused = true;
                Ok(Response::Ok)
            }
            Request::Resume => {
                self.vm()?.resume().map_err(|e| error_chain(&e))?;
                self.paused = false;
                Ok(Response::Ok)
            }
            Request::Snapshot { .. }
            | Request::Rollback { .. }
            | Request::Hibernate
            | Request::Wake => Err(
                "snapshot, rollback and hibernate of Linux VM sandboxes are not wired into the \
                 supervisor yet (LinuxVm::snapshot exists; clone from the template instead)"
                    .into(),
            ),
            Request::NetworkStatus
            | Request::SetPolicy(_)
            | Request::Expose(_)
            | Request::Unexpose { .. } => Err(
                "Linux VM sandboxes have no network yet (the TAP from cube-net's pool is not \
                 wired into the VM engine)"
                    .into(),
            ),
            Request::GuestDirty { .. }
            | Request::GuestMode { .. }
            | Request::GuestWaitWorkingSet
            | Request::ReadMemory { .. }
            | Request::MemoryDigest => {
                Err("a Linux VM sandbox runs no test guest (this request is for test VMs)".into())
            }
        }
    }

    fn status(&self) -> StatusReport {
        let status = match &self.vm {
            None => MachineStatus::Failed("the VM is gone".into()),
            Some(vm) => match vm.fatal() {
                Some(why) => MachineStatus::Failed(why),
                None if self.paused => MachineStatus::Paused,
                None => MachineStatus::Running,
            },
        };
        StatusReport {
            status,
            pid: std::process::id(),
            counter: 0,
            generation: self.generation,
            guest_error: false,
            config: None,
            rss_kib: super::server::own_rss_kib(),
            engine: Engine::Vm,
            jail: None,
        }
    }

    /// Stops the vCPUs and releases the VM; the vsock socket goes too.
    pub fn destroy(&mut self) {
        self.stop_reseed.store(true, Ordering::Relaxed);
        self.vm = None;
        let _ = std::fs::remove_file(
            self.dir
                .join(crate::devices::virtio::vsock::HOST_SOCKET_NAME),
        );
    }
}
