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

use cube_storage::durable_marker::PendingFlush;
use cube_storage::{SandboxDir, SnapshotDir};
use cube_vmm::persist::state::read_state;
use cube_vmm::test_guest::mailbox::field;
use cube_vmm::test_guest::{Machine, MachineError, Mode};
use cube_vmm::vstate::KvmContext;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::backend::{awake, SandboxBackend, TestGuestControl};
use crate::confinement::Profile;
use crate::error_report::chain as error_chain;
use crate::flush::Flushes;
use crate::protocol::{ErrorKind, Failure, MachineStatus, Source, StatusReport, MAX_FRAME};
use crate::records::{Engine, SnapshotMeta};
use crate::resident_memory::own_rss_kib;
use crate::snapshot_transaction::{
    write_hibernation_image, PendingCommit, SnapshotTransaction, Staged,
};

/// One test-guest sandbox.
pub struct TestGuestSandbox {
    ctx: Arc<KvmContext>,
    id: String,
    dir: SandboxDir,
    /// Background flushes of snapshots this sandbox wrote.
    flushes: Flushes,
    /// The snapshot staged last, until the library has moved it into place.
    pending: Option<PendingCommit>,
    machine: Option<Machine>,
    hibernated: bool,
}

/// The failure of a machine operation: a wrong state is the caller's, the rest is the
/// machine's.
fn machine_failure(e: impl Into<MachineError>) -> Failure {
    let e = e.into();
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
            flushes: Flushes::default(),
            pending: None,
            dir: SandboxDir::new(dir),
            machine: Some(machine),
            hibernated: false,
        })
    }

    fn machine(&mut self) -> Result<&mut Machine, Failure> {
        awake(&mut self.machine, self.hibernated, NO_MACHINE)
    }
}

const NO_MACHINE: &str = "sandbox has no running machine";

impl SandboxBackend for TestGuestSandbox {
    fn dir(&self) -> &Path {
        &self.dir
    }

    fn confinement(&self) -> Profile {
        Profile::Vm
    }

    fn status(&mut self) -> StatusReport {
        let rss_kib = own_rss_kib();
        let pid = std::process::id();
        match &self.machine {
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

    fn pause(&mut self) -> Result<(), Failure> {
        self.machine()?.pause().map_err(machine_failure)
    }

    fn resume(&mut self) -> Result<(), Failure> {
        self.machine()?.resume().map_err(machine_failure)
    }

    /// Memory, vCPUs and the rootfs (cloned) of one instant. A running machine's
    /// vCPUs stop only while that instant is taken: its memory is copied while it runs
    /// on (a live snapshot), and the record says how long it was stopped.
    fn snapshot(&mut self, staging: &Path, dest: &Path) -> Result<SnapshotMeta, Failure> {
        let rootfs = self.dir.rootfs();
        let m = awake(&mut self.machine, self.hibernated, NO_MACHINE)?;
        let tx = SnapshotTransaction::begin(staging, dest)?;
        let staged_dir = tx.create_staging()?;
        let disk = rootfs.exists().then_some(rootfs.as_path());
        let stats = m
            .snapshot(&staged_dir, disk)
            .map_err(|e| Failure::from(error_chain(&e)))?;
        let (meta, pending) = tx.stage(&self.id, Engine::Vm, Staged::full(stats))?;
        self.pending = Some(pending);
        Ok(meta)
    }

    fn snapshot_committed(&mut self, dest: &Path) -> Result<(), Failure> {
        let pending = PendingCommit::take_for(&mut self.pending, dest)?;
        let m = awake(&mut self.machine, self.hibernated, NO_MACHINE)?;
        let committed = |staged: &PendingFlush| {
            m.snapshot_committed_from(PendingCommit::memory(staged)?);
            Ok(())
        };
        pending.finish(committed, &mut self.flushes)
    }

    /// Loads the snapshot into the running VM where its shape allows, else builds a
    /// new one; the snapshot (and its rootfs copy) is checked first.
    fn rollback(&mut self, snapshot: &Path) -> Result<(), Failure> {
        // Validate before touching anything: a bad snapshot leaves the sandbox as is.
        let state = read_state(snapshot).map_err(snapshot_failure)?;
        let staged_rootfs = stage_rootfs(snapshot, &self.dir).map_err(snapshot_failure)?;
        let in_place = match self.machine.as_mut() {
            Some(m) if !self.hibernated => match m.load_in_place(snapshot, state) {
                Ok(done) => done,
                Err(e) => {
                    // Half-restored: discard it and build a fresh machine below.
                    tracing::warn!(
                        "rollback in place failed, restoring anew: {}",
                        error_chain(&e)
                    );
                    retire(self.machine.take());
                    false
                }
            },
            _ => false,
        };
        if !in_place {
            let restored = Machine::restore(&self.ctx, snapshot).map_err(snapshot_failure)?;
            retire(self.machine.replace(restored));
        }
        if let Some(staged) = staged_rootfs {
            std::fs::rename(&staged, self.dir.rootfs())
                .map_err(|e| format!("replacing rootfs: {e}"))?;
        }
        self.hibernated = false;
        Ok(())
    }

    /// The rootfs stays where it is: only memory and CPU state leave.
    fn hibernate(&mut self) -> Result<(), Failure> {
        let dir = self.dir.clone();
        let m = awake(&mut self.machine, self.hibernated, NO_MACHINE)?;
        let was_running = m.is_running();
        let written = write_hibernation_image(&dir, &mut self.flushes, |staging| {
            // Stopped for good once its state is taken: the image is the machine's last
            // instant, so nothing it does after the image is taken may be lost on wake.
            m.final_snapshot(staging, None)
                .map(drop)
                .map_err(snapshot_failure)
        });
        if let Err(e) = written {
            if was_running {
                let _ = m.resume();
            }
            return Err(e);
        }
        m.snapshot_committed(&dir.hibernation())
            .map_err(snapshot_failure)?;
        self.machine = None;
        self.hibernated = true;
        Ok(())
    }

    fn wake(&mut self) -> Result<(), Failure> {
        if !self.hibernated {
            return Err(Failure::bad_state("sandbox is not hibernated"));
        }
        let image = self.dir.hibernation();
        let m = Machine::restore(&self.ctx, &image).map_err(snapshot_failure)?;
        self.machine = Some(m);
        self.hibernated = false;
        Ok(())
    }

    /// Releases the VM and its memory, and waits for the snapshots' flushes.
    fn destroy(&mut self) {
        // Dropping the machine stops the vCPUs, closes the VM and unmaps memory.
        self.machine = None;
        self.flushes.join();
    }

    fn test_guest(&mut self) -> Option<&mut dyn TestGuestControl> {
        Some(self)
    }
}

impl TestGuestControl for TestGuestSandbox {
    fn guest_dirty(&mut self, mib: u64, pattern: u64) -> Result<(), Failure> {
        let m = self.machine()?;
        m.guest_dirty(mib, pattern).map_err(machine_failure)
    }

    fn guest_mode(&mut self, spin: bool) -> Result<(), Failure> {
        let mode = if spin { Mode::Spin } else { Mode::Idle };
        self.machine()?
            .guest_set_mode(mode)
            .map_err(machine_failure)
    }

    fn wait_working_set(&mut self) -> Result<(), Failure> {
        self.machine()?.wait_working_set().map_err(machine_failure)
    }

    fn read_memory(&mut self, addr: u64, len: u32) -> Result<Vec<u8>, Failure> {
        if len > MAX_FRAME / 2 {
            return Err(Failure::invalid(format!(
                "read of {len} bytes exceeds {}",
                MAX_FRAME / 2
            )));
        }
        let m = self.machine()?;
        let mut buf = vec![0u8; len as usize];
        m.memory()
            .inner()
            .read_slice(&mut buf, GuestAddress(addr))
            .map_err(|e| Failure::invalid(format!("reading guest memory at {addr:#x}: {e}")))?;
        Ok(buf)
    }

    fn memory_digest(&mut self) -> Result<Vec<u32>, Failure> {
        let m = self.machine()?;
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
        Ok(digests)
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
