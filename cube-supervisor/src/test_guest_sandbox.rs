//! A test-guest VM sandbox as its supervisor holds it: Cube's synthetic guest in a
//! [`Machine`], booted or restored from a template or snapshot, with an optional
//! writable disk image (`rootfs.img`, cloned along with every snapshot).
//!
//! A snapshot is written into a staging directory with its record and renamed into
//! place, so a failed one leaves the sandbox running and every earlier snapshot as it
//! was; a rollback loads the snapshot into the running VM where its shape allows,
//! else builds a new one first; hibernation writes the same kind of image into the
//! sandbox's directory and releases the VM.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cube_storage::{Durability, SandboxDir, SnapshotDir};
use cube_vmm::persist::state::read_state;
use cube_vmm::persist::SnapshotStats;
use cube_vmm::test_guest::mailbox::field;
use cube_vmm::test_guest::{Machine, MachineError, Mode};
use cube_vmm::vstate::KvmContext;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::error_report::chain as error_chain;
use crate::flush::flush_in_background;
use crate::protocol::{
    ErrorKind, Failure, MachineStatus, Request, Response, Source, StatusReport, MAX_FRAME,
};
use crate::records::{now_unix, Engine, SnapshotKind, SnapshotMeta};
use crate::resident_memory::own_rss_kib;

/// One test-guest sandbox.
pub struct TestGuestSandbox {
    ctx: Arc<KvmContext>,
    id: String,
    dir: SandboxDir,
    /// Background flushes of snapshots this sandbox wrote; joined before its files go.
    flushes: Vec<std::thread::JoinHandle<()>>,
    machine: Option<Machine>,
    hibernated: bool,
}

/// The failure of a machine operation: a wrong state is the caller's, the rest is the
/// machine's.
fn machine_failure(e: MachineError) -> Failure {
    let kind = match e {
        MachineError::WrongState(_) => ErrorKind::BadState,
        _ => ErrorKind::Internal,
    };
    Failure::new(kind, error_chain(&e))
}

/// The failure of reading or restoring a snapshot (or hibernation image).
fn snapshot_failure(e: impl std::error::Error) -> Failure {
    Failure::new(ErrorKind::SnapshotFailed, error_chain(&e))
}

impl TestGuestSandbox {
    /// Starts the sandbox from `source` (a snapshot or a fresh boot), loading a
    /// snapshot into the pre-built `shell` where its shape fits.
    pub fn start(
        ctx: Arc<KvmContext>,
        id: &str,
        dir: &Path,
        source: &Source,
        shell: Option<Machine>,
    ) -> Result<Self, Failure> {
        let machine = start_machine(&ctx, source, shell)?;
        Ok(TestGuestSandbox {
            ctx,
            id: id.to_string(),
            flushes: Vec::new(),
            dir: SandboxDir::new(dir),
            machine: Some(machine),
            hibernated: false,
        })
    }

    /// The sandbox's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Releases the VM and its memory, and waits for the snapshots' flushes.
    pub fn destroy(&mut self) {
        // Dropping the machine stops the vCPUs, closes the VM and unmaps memory.
        self.machine = None;
        // A flush still writing into a snapshot directory would race its removal.
        for flush in std::mem::take(&mut self.flushes) {
            let _ = flush.join();
        }
    }

    fn machine(&mut self) -> Result<&mut Machine, Failure> {
        if self.hibernated {
            return Err(Failure::bad_state("sandbox is hibernated: wake it first"));
        }
        self.machine
            .as_mut()
            .ok_or_else(|| Failure::bad_state("sandbox has no running machine"))
    }

    /// Carries out one request.
    pub fn handle(&mut self, request: Request) -> Result<Response, Failure> {
        let sandbox = self;
        let fail = machine_failure;
        match request {
            Request::Adopt { .. } => Err(Failure::invalid("already adopted")),
            Request::Destroy => Ok(Response::Ok),
            Request::Status => Ok(Response::Status(sandbox.status())),
            Request::Pause => {
                sandbox.machine()?.pause().map_err(fail)?;
                Ok(Response::Ok)
            }
            Request::Resume => {
                sandbox.machine()?.resume().map_err(fail)?;
                Ok(Response::Ok)
            }
            Request::Snapshot { staging, dest } => {
                let dir = sandbox.dir.clone();
                let id = sandbox.id.clone();
                let m = sandbox.machine()?;
                let stats = write_snapshot(m, &id, &dir, &staging, &dest)
                    .map_err(|f| f.or_kind(ErrorKind::SnapshotFailed))?;
                sandbox.track_flush(flush_in_background(dest));
                Ok(Response::Snapshot {
                    stats,
                    kind: SnapshotKind::Full,
                    fallback: None,
                })
            }
            Request::Rollback { snapshot } => {
                // Validate before touching anything: a bad snapshot leaves the sandbox as is.
                let state = read_state(&snapshot).map_err(snapshot_failure)?;
                let staged_rootfs =
                    stage_rootfs(&snapshot, &sandbox.dir).map_err(snapshot_failure)?;
                let in_place = match sandbox.machine.as_mut() {
                    Some(m) if !sandbox.hibernated => match m.load_in_place(&snapshot, state) {
                        Ok(done) => done,
                        Err(e) => {
                            // Half-restored: discard it and build a fresh machine below.
                            tracing::warn!(
                                "rollback in place failed, restoring anew: {}",
                                error_chain(&e)
                            );
                            retire(sandbox.machine.take());
                            false
                        }
                    },
                    _ => false,
                };
                if !in_place {
                    let restored =
                        Machine::restore(&sandbox.ctx, &snapshot).map_err(snapshot_failure)?;
                    retire(sandbox.machine.replace(restored));
                }
                if let Some(staged) = staged_rootfs {
                    std::fs::rename(&staged, sandbox.dir.rootfs())
                        .map_err(|e| format!("replacing rootfs: {e}"))?;
                }
                sandbox.hibernated = false;
                Ok(Response::Ok)
            }
            Request::Hibernate => {
                let dir = sandbox.dir.clone();
                let m = sandbox.machine()?;
                let image = dir.hibernation();
                let staging = dir.hibernation_staging();
                let old = dir.hibernation_old();
                let _ = std::fs::remove_dir_all(&staging);
                let _ = std::fs::remove_dir_all(&old);
                // The rootfs stays where it is: only memory and CPU state leave.
                std::fs::create_dir(&staging)
                    .map_err(|e| format!("creating {}: {e}", staging.display()))?;
                if let Err(e) = m.snapshot(&staging) {
                    let _ = std::fs::remove_dir_all(&staging);
                    return Err(snapshot_failure(e));
                }
                if image.exists() {
                    std::fs::rename(&image, &old).map_err(|e| format!("moving old image: {e}"))?;
                }
                std::fs::rename(&staging, &image).map_err(|e| format!("committing image: {e}"))?;
                let _ = std::fs::remove_dir_all(&old);
                m.snapshot_committed(&image).map_err(snapshot_failure)?;
                sandbox.machine = None;
                sandbox.track_flush(flush_in_background(image.into_path()));
                sandbox.hibernated = true;
                Ok(Response::Ok)
            }
            Request::Wake => {
                if !sandbox.hibernated {
                    return Err(Failure::bad_state("sandbox is not hibernated"));
                }
                let image = sandbox.dir.hibernation();
                let m = Machine::restore(&sandbox.ctx, &image).map_err(snapshot_failure)?;
                sandbox.machine = Some(m);
                sandbox.hibernated = false;
                Ok(Response::Ok)
            }
            Request::GuestDirty { mib, pattern } => {
                sandbox.machine()?.guest_dirty(mib, pattern).map_err(fail)?;
                Ok(Response::Ok)
            }
            Request::GuestMode { spin } => {
                let mode = if spin { Mode::Spin } else { Mode::Idle };
                sandbox.machine()?.guest_set_mode(mode).map_err(fail)?;
                Ok(Response::Ok)
            }
            Request::GuestWaitWorkingSet => {
                sandbox.machine()?.wait_working_set().map_err(fail)?;
                Ok(Response::Ok)
            }
            Request::ReadMemory { addr, len } => {
                if len > MAX_FRAME / 2 {
                    return Err(Failure::invalid(format!(
                        "read of {len} bytes exceeds {}",
                        MAX_FRAME / 2
                    )));
                }
                let m = sandbox.machine()?;
                let mut buf = vec![0u8; len as usize];
                m.memory()
                    .inner()
                    .read_slice(&mut buf, GuestAddress(addr))
                    .map_err(|e| {
                        Failure::invalid(format!("reading guest memory at {addr:#x}: {e}"))
                    })?;
                Ok(Response::Memory(buf))
            }
            Request::MemoryDigest => {
                let m = sandbox.machine()?;
                let mut digests = Vec::new();
                let mut chunk = vec![0u8; 1 << 20];
                for region in m.memory().inner().iter() {
                    let mut hasher = crc32fast::Hasher::new();
                    let start = region.start_addr().0;
                    let len = region.len();
                    let mut offset = 0;
                    while offset < len {
                        let n = (len - offset).min(chunk.len() as u64) as usize;
                        m.memory()
                            .inner()
                            .read_slice(&mut chunk[..n], GuestAddress(start + offset))
                            .map_err(|e| format!("reading guest memory: {e}"))?;
                        hasher.update(&chunk[..n]);
                        offset += n as u64;
                    }
                    digests.push(hasher.finalize());
                }
                Ok(Response::Digest(digests))
            }
            Request::NetworkStatus
            | Request::SetPolicy(_)
            | Request::Expose(_)
            | Request::Unexpose { .. } => Err(Failure::unsupported(
                "Cube's test guest has no network device",
            )),
        }
    }

    fn status(&self) -> StatusReport {
        let sandbox = self;
        let rss_kib = own_rss_kib();
        let pid = std::process::id();
        match &sandbox.machine {
            Some(m) => {
                let mb = m.mailbox();
                StatusReport {
                    status: match m.fatal() {
                        Some(reason) => MachineStatus::Failed(reason),
                        None if m.is_running() => MachineStatus::Running,
                        None => MachineStatus::Paused,
                    },
                    pid,
                    counter: mb.counter().unwrap_or(0),
                    generation: mb.read(field::ACK_GENERATION).unwrap_or(0),
                    guest_error: mb.read(field::ERROR).unwrap_or(0) != 0,
                    config: Some(m.config()),
                    rss_kib,
                    engine: Engine::Vm,
                    jail: None,
                }
            }
            None => StatusReport {
                status: MachineStatus::Hibernated,
                pid,
                counter: 0,
                generation: 0,
                guest_error: false,
                config: None,
                rss_kib,
                engine: Engine::Vm,
                jail: None,
            },
        }
    }

    fn track_flush(&mut self, flush: Option<std::thread::JoinHandle<()>>) {
        self.flushes.retain(|f| !f.is_finished());
        self.flushes.extend(flush);
    }
}

fn start_machine(
    ctx: &Arc<KvmContext>,
    source: &Source,
    shell: Option<Machine>,
) -> Result<Machine, Failure> {
    match source {
        Source::Jail { .. } | Source::JailOverlay { .. } => {
            Err(Failure::invalid("a jail source cannot start a VM"))
        }
        Source::Snapshot(dir) => {
            let state = read_state(dir).map_err(snapshot_failure)?;
            if let Some(mut shell) = shell {
                match shell.load_in_place(dir, state) {
                    Ok(true) => return Ok(shell),
                    // Another shape: the shell is of no use.
                    Ok(false) => retire(Some(shell)),
                    Err(e) => {
                        tracing::warn!("loading into the pre-built VM: {}", error_chain(&e));
                        retire(Some(shell));
                    }
                }
            }
            Machine::restore(ctx, dir).map_err(snapshot_failure)
        }
        Source::BootTestGuest {
            config,
            working_set,
        } => {
            retire(shell);
            Machine::boot_test_guest(ctx, *config, *working_set).map_err(machine_failure)
        }
    }
}

/// Tears a replaced machine down off the request path: closing a VM and unmapping
/// its memory takes milliseconds the caller need not wait for.
pub(crate) fn retire(machine: Option<Machine>) {
    if let Some(machine) = machine {
        let spawned = std::thread::Builder::new()
            .name("retire".into())
            .spawn(move || drop(machine));
        // If no thread can be started the machine was dropped with the closure.
        if let Err(e) = spawned {
            tracing::warn!("retiring a machine inline: {e}");
        }
    }
}

/// Snapshot into `staging` with the rootfs and metadata, move the directory to `dest`,
/// and make it durable in the background.
fn write_snapshot(
    m: &mut Machine,
    sandbox_id: &str,
    sandbox_dir: &SandboxDir,
    staging: &Path,
    dest: &Path,
) -> Result<SnapshotStats, Failure> {
    let snapshot_id = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| format!("{} has no snapshot id", dest.display()))?;
    if dest.exists() {
        return Err(Failure::new(
            ErrorKind::AlreadyExists,
            format!("{} already exists", dest.display()),
        ));
    }
    std::fs::create_dir(staging).map_err(|e| format!("creating {}: {e}", staging.display()))?;
    let staging = SnapshotDir::new(staging);
    let was_running = m.is_running();
    let result = (|| {
        // Memory, vCPUs and disk must be taken at the same instant.
        m.pause().map_err(|e| error_chain(&e))?;
        let stats = m.snapshot(&staging).map_err(|e| error_chain(&e))?;
        let rootfs = sandbox_dir.rootfs();
        if rootfs.exists() {
            cube_storage::clone_file(&rootfs, &staging.rootfs()).map_err(|e| error_chain(&e))?;
        }
        if was_running {
            m.resume().map_err(|e| error_chain(&e))?;
        }
        let meta = SnapshotMeta {
            id: snapshot_id,
            sandbox: sandbox_id.to_string(),
            created_unix: now_unix(),
            stats,
            kind: SnapshotKind::Full,
            engine: Engine::Vm,
            fallback: None,
        };
        let meta_bytes = serde_json::to_vec(&meta).map_err(|e| e.to_string())?;
        cube_storage::write_atomic_bytes_with(
            &staging.record(),
            SnapshotDir::RECORD_KIND,
            &meta_bytes,
            Durability::Deferred,
        )
        .map_err(|e| error_chain(&e))?;
        std::fs::rename(&staging, dest).map_err(|e| format!("committing snapshot: {e}"))?;
        Ok(stats)
    })();
    match result {
        Ok(stats) => {
            m.snapshot_committed(dest).map_err(|e| error_chain(&e))?;
            Ok(stats)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            if was_running {
                let _ = m.resume();
            }
            Err(e)
        }
    }
}

/// Clones the snapshot's rootfs next to the sandbox's, ready to be renamed over it.
fn stage_rootfs(
    snapshot: &Path,
    sandbox_dir: &SandboxDir,
) -> Result<Option<PathBuf>, cube_storage::CloneError> {
    let src = SnapshotDir::new(snapshot).rootfs();
    if !src.exists() {
        return Ok(None);
    }
    let tmp = sandbox_dir.rootfs_rollback();
    let _ = std::fs::remove_file(&tmp);
    cube_storage::clone_file(&src, &tmp)?;
    Ok(Some(tmp))
}
