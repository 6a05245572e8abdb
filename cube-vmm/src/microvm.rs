//! The microVM: one KVM VM with its vCPU threads, guest memory and dirty-page
//! tracker, whatever guest it runs. The guest's own parts (the test guest's kind, a
//! Linux guest's serial port and virtio devices) are its type parameter, so both
//! guests share one pause model, one diff base (parent memory file and pending dirty
//! pages) and one snapshot writer ([`crate::persist::snapshot_writer`]).
//!
//! A machine is made with a [`MicroVmBuilder`]: [`MicroVmBuilder::fresh`] for a boot
//! into zeroed memory, [`MicroVmBuilder::restored`] for a snapshot's memory mapped
//! copy-on-write; the guest's code then creates its vCPUs and devices on the
//! builder's VM and memory, and [`MicroVmBuilder::build`] joins them.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cube_mem::dirty::{CombinedTracker, DirtyBitmap, DirtyTracker, DirtyTrackerKind};
use cube_mem::GuestMemory;
use cube_storage::durable_marker::DurabilityError;
use cube_storage::SnapshotDir;

use crate::arch::x86_64::layout::{ram_ranges, RamRange};
use crate::dirty_tracking::{self, TrackingError};
use crate::memory::{memory_layout, register_guest_memory};
use crate::persist::state::{FormatError, MachineConfig, MachineState};
use crate::vcpu_runner::{VcpuHandle, VcpuRunnerError};
use crate::vstate::vm::{Vm, VmConfig, VmError};
use crate::vstate::KvmContext;

/// Why building, pausing or snapshotting a microVM failed.
#[derive(Debug, thiserror::Error)]
pub enum MicroVmError {
    /// The memory size cannot be laid out.
    #[error("Invalid machine shape")]
    Layout(#[from] crate::arch::x86_64::layout::LayoutError),
    /// Guest memory could not be set up.
    #[error("Guest memory")]
    Memory(#[from] cube_mem::MemoryError),
    /// A KVM VM operation failed.
    #[error("KVM VM")]
    Vm(#[from] VmError),
    /// A KVM vCPU operation failed.
    #[error("KVM vCPU")]
    Vcpu(#[from] crate::vstate::vcpu::VcpuError),
    /// Controlling a vCPU thread failed.
    #[error("vCPU thread")]
    Runner(#[from] VcpuRunnerError),
    /// No dirty-page tracking could be set up.
    #[error("Dirty-page tracking setup")]
    Tracking(#[source] Box<TrackingError>),
    /// Collecting the dirty pages failed.
    #[error("Dirty-page tracking")]
    Dirty(#[source] Box<cube_mem::dirty::DirtyError>),
    /// Writing the memory file failed.
    #[error("Writing the memory file")]
    MemoryFile(#[source] Box<cube_mem::memory_file::MemoryFileError>),
    /// The memory file a snapshot's diff is written against cannot be opened.
    #[error("Opening memory file {0}")]
    Parent(PathBuf, #[source] std::io::Error),
    /// The snapshot's state file could not be written.
    #[error("Snapshot state")]
    State(#[source] Box<FormatError>),
    /// The snapshot's durability could not be recorded.
    #[error("Snapshot durability")]
    Durability(#[from] DurabilityError),
    /// No seal could be drawn for the memory file.
    #[error("Sealing the memory file")]
    Seal(#[from] cube_mem::SealError),
    /// The root disk could not be copied into the snapshot.
    #[error("Copying the root disk into the snapshot")]
    Disk(#[source] Box<cube_storage::CloneError>),
    /// A virtio device's state could not be saved into the snapshot.
    #[error("Saving the virtio devices' state")]
    Devices(#[source] Box<crate::device_manager::VirtioDevicesError>),
}

// Boxed: these errors are large, and a machine error travels inside SandboxError.
impl From<TrackingError> for MicroVmError {
    fn from(e: TrackingError) -> Self {
        MicroVmError::Tracking(Box::new(e))
    }
}

impl From<cube_mem::dirty::DirtyError> for MicroVmError {
    fn from(e: cube_mem::dirty::DirtyError) -> Self {
        MicroVmError::Dirty(Box::new(e))
    }
}

impl From<cube_mem::memory_file::MemoryFileError> for MicroVmError {
    fn from(e: cube_mem::memory_file::MemoryFileError) -> Self {
        MicroVmError::MemoryFile(Box::new(e))
    }
}

impl From<FormatError> for MicroVmError {
    fn from(e: FormatError) -> Self {
        MicroVmError::State(Box::new(e))
    }
}

impl From<cube_storage::CloneError> for MicroVmError {
    fn from(e: cube_storage::CloneError) -> Self {
        MicroVmError::Disk(Box::new(e))
    }
}

/// What the next snapshot's memory file is written against: the dirty-page tracker,
/// the complete memory file that (plus the pages dirtied since) equals guest memory,
/// and the pages an uncommitted snapshot took.
pub(crate) struct DiffBase {
    tracker: CombinedTracker,
    /// The memory file restored from, then each committed snapshot's. Held open so
    /// that removing that snapshot (or template) cannot break later diffs. None after
    /// a fresh boot.
    parent: Option<File>,
    /// Dirty pages collected by a snapshot not committed yet (or that failed): they
    /// are not safely anywhere but guest memory, so the next snapshot writes them too.
    carry: Option<DirtyBitmap>,
}

impl DiffBase {
    /// Every page dirtied since the last committed snapshot: the tracker's and the
    /// carried ones. Hand them back with [`DiffBase::keep_pending`].
    pub(crate) fn take_pending(&mut self) -> Result<DirtyBitmap, MicroVmError> {
        let mut dirty = self.tracker.collect()?;
        if let Some(carry) = self.carry.take() {
            dirty.or(&carry)?;
        }
        Ok(dirty)
    }

    /// Keeps `dirty` for the next snapshot, until [`DiffBase::committed`].
    pub(crate) fn keep_pending(&mut self, dirty: DirtyBitmap) {
        self.carry = Some(dirty);
    }

    /// The pages dirtied since the tracker was last collected, without the carried
    /// ones: a pre-copy round's. They are pending too: the caller keeps them.
    pub(crate) fn collect_new(&mut self) -> Result<DirtyBitmap, MicroVmError> {
        Ok(self.tracker.collect()?)
    }

    /// Adds `dirty` to the pages kept for the next snapshot.
    pub(crate) fn add_pending(&mut self, dirty: DirtyBitmap) -> Result<(), MicroVmError> {
        match self.carry.as_mut() {
            Some(carry) => carry.or(&dirty)?,
            None => self.carry = Some(dirty),
        }
        Ok(())
    }

    /// The snapshot in `dir` is committed: its memory file is the new parent, and
    /// the pages it holds are no longer pending.
    pub(crate) fn committed(&mut self, dir: &Path) -> Result<(), MicroVmError> {
        self.committed_from(open_parent(&SnapshotDir::new(dir).memory())?);
        Ok(())
    }

    /// [`DiffBase::committed`] for the snapshot whose memory file is `memory`.
    pub(crate) fn committed_from(&mut self, memory: File) {
        self.parent = Some(memory);
        self.carry = None;
    }

    /// Guest memory was replaced by the memory file `parent` (a load in place):
    /// whatever was dirty belonged to the memory replaced. (Only the test guest loads
    /// in place.)
    #[cfg(feature = "test-guest")]
    pub(crate) fn rebased(&mut self, parent: File) -> Result<(), MicroVmError> {
        self.tracker.collect()?;
        self.parent = Some(parent);
        self.carry = None;
        Ok(())
    }

    pub(crate) fn parent(&self) -> Option<&File> {
        self.parent.as_ref()
    }

    /// The mechanism tracking dirty pages (the test guest loads in place only under
    /// KVM's dirty log).
    #[cfg(feature = "test-guest")]
    pub(crate) fn tracker_kind(&self) -> DirtyTrackerKind {
        self.tracker.primary().kind()
    }
}

/// A running (or paused) microVM with the guest parts `G`.
///
/// Field order is drop order: vCPU threads stop first, then the guest's parts (a
/// device event loop) and the tracker, then the VM closes, and guest memory is
/// unmapped last, so KVM and the device threads never see it gone.
pub struct MicroVm<G> {
    pub(crate) vcpus: Vec<VcpuHandle>,
    pub(crate) guest: G,
    pub(crate) diff: DiffBase,
    pub(crate) vm: Vm,
    pub(crate) memory: GuestMemory,
    pub(crate) config: MachineConfig,
    pub(crate) ram: Vec<RamRange>,
    pub(crate) running: bool,
}

impl<G> MicroVm<G> {
    /// Guest memory.
    pub fn memory(&self) -> &GuestMemory {
        &self.memory
    }

    /// The machine's shape.
    pub fn config(&self) -> MachineConfig {
        self.config
    }

    /// Whether the vCPUs are running.
    pub fn is_running(&self) -> bool {
        self.running
    }

    /// Why the guest stopped for good (triple fault, power-off, KVM error), if it did.
    pub fn fatal(&self) -> Option<String> {
        self.vcpus.iter().find_map(|v| v.fatal())
    }

    /// A path that opens the memory file this machine's memory is based on, if any.
    pub fn parent_memory_file(&self) -> Option<PathBuf> {
        self.diff.parent().map(fd_path)
    }

    /// Stops every vCPU at its current instruction. Idempotent.
    pub fn pause(&mut self) -> Result<(), MicroVmError> {
        if !self.running {
            return Ok(());
        }
        for vcpu in &self.vcpus {
            vcpu.request_pause()?;
        }
        for vcpu in &self.vcpus {
            vcpu.wait_parked()?;
        }
        self.running = false;
        Ok(())
    }

    /// Lets every vCPU run again. Idempotent.
    pub fn resume(&mut self) -> Result<(), MicroVmError> {
        if self.running {
            return Ok(());
        }
        for vcpu in &self.vcpus {
            vcpu.resume()?;
        }
        self.running = true;
        Ok(())
    }

    /// Records that the snapshot last written now lives in `dir`: its memory file is
    /// the parent of the next diff, and the pages it holds are no longer pending.
    pub fn snapshot_committed(&mut self, dir: &Path) -> Result<(), MicroVmError> {
        self.diff.committed(dir)
    }

    /// [`MicroVm::snapshot_committed`] for the snapshot whose memory file is
    /// `memory`, opened by the caller while it was staged: a confined supervisor may
    /// not open it where the snapshot now lies.
    pub fn snapshot_committed_from(&mut self, memory: File) {
        self.diff.committed_from(memory);
    }
}

/// A microVM's VM, memory and tracker before its vCPUs and devices exist. Field order
/// is drop order, as in [`MicroVm`].
pub struct MicroVmBuilder {
    tracker: CombinedTracker,
    vm: Vm,
    memory: GuestMemory,
    config: MachineConfig,
    ram: Vec<RamRange>,
    parent: Option<File>,
}

impl MicroVmBuilder {
    /// A VM of shape `config` over fresh, zeroed memory.
    pub fn fresh(ctx: &Arc<KvmContext>, config: MachineConfig) -> Result<Self, MicroVmError> {
        let ram = ram_ranges(config.memory_bytes)?;
        let memory = GuestMemory::anonymous(memory_layout(&ram)?)?;
        Self::assemble(ctx, config, ram, memory, None)
    }

    /// A VM of the shape `state` records, over the memory file of the snapshot in
    /// `dir` mapped private and copy-on-write (so this costs the same for any guest
    /// size); that file is the parent of the machine's first diff.
    pub fn restored(
        ctx: &Arc<KvmContext>,
        state: &MachineState,
        dir: &Path,
    ) -> Result<Self, MicroVmError> {
        let memory_path = SnapshotDir::new(dir).memory();
        let memory = GuestMemory::restore_private(memory_layout(&state.ram)?, &memory_path)?;
        let parent = open_parent(&memory_path)?;
        Self::assemble(ctx, state.config, state.ram.clone(), memory, Some(parent))
    }

    fn assemble(
        ctx: &Arc<KvmContext>,
        config: MachineConfig,
        ram: Vec<RamRange>,
        memory: GuestMemory,
        parent: Option<File>,
    ) -> Result<Self, MicroVmError> {
        let vm = Vm::new(
            ctx,
            &VmConfig {
                vcpus: config.vcpus,
                irqchip: config.irqchip,
            },
        )?;
        let kind = dirty_tracking::chosen_kind()?;
        // SAFETY: `memory` moves into the builder and then the MicroVm, both of which
        // drop it only after the VM (field order), so KVM never sees the mapping gone.
        unsafe { register_guest_memory(&vm, &memory, kind == DirtyTrackerKind::KvmDirtyLog)? };
        let tracker = dirty_tracking::start(kind, &vm, &memory)?;
        Ok(MicroVmBuilder {
            tracker,
            vm,
            memory,
            config,
            ram,
            parent,
        })
    }

    /// The VM, for creating vCPUs and devices on it.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// Guest memory, for loading a guest into it.
    pub fn memory(&self) -> &GuestMemory {
        &self.memory
    }

    /// The machine's shape.
    pub fn config(&self) -> MachineConfig {
        self.config
    }

    /// The guest's RAM ranges.
    pub fn ram(&self) -> &[RamRange] {
        &self.ram
    }

    /// The machine, with its vCPU threads (`running` says whether they were let run)
    /// and the guest's own parts.
    pub fn build<G>(self, vcpus: Vec<VcpuHandle>, guest: G, running: bool) -> MicroVm<G> {
        MicroVm {
            vcpus,
            guest,
            diff: DiffBase {
                tracker: self.tracker,
                parent: self.parent,
                carry: None,
            },
            vm: self.vm,
            memory: self.memory,
            config: self.config,
            ram: self.ram,
            running,
        }
    }
}

/// Opens the memory file at `path` as the parent of later diffs, following no link
/// in its snapshot's directory (as the mapping: see [`cube_storage::no_follow`]).
pub(crate) fn open_parent(path: &Path) -> Result<File, MicroVmError> {
    cube_storage::no_follow::open_file(path)
        .map_err(|e| MicroVmError::Parent(path.to_path_buf(), e))
}

/// A path through which `file` opens again even after it was unlinked.
pub(crate) fn fd_path(file: &File) -> PathBuf {
    use std::os::fd::AsRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}
