//! The test guest's microVM: KVM VM, vCPU threads and guest memory, booted fresh or
//! restored from a snapshot, and the snapshot operation itself. (A Linux guest has its
//! own, [`crate::linux_vm::LinuxVm`].)

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cube_mem::dirty::{CombinedTracker, DirtyBitmap, DirtyTracker, DirtyTrackerKind};
use cube_mem::GuestMemory;
use cube_storage::durable_marker::{self as durability};
use cube_storage::{Durability, SnapshotDir};

use super::mailbox::{field, op, Mailbox, MailboxError, Mode};
use super::program::{self, dirty_area_pages, ProgramError};
use crate::arch::x86_64::layout::{ram_ranges, RamRange};
use crate::dirty_tracking::{self, TrackingError};
use crate::memory::{memory_layout, register_guest_memory};
use crate::persist::state::{self as format, GuestKind, MachineConfig, MachineState, WorkingSet};
use crate::persist::SnapshotStats;
use crate::vcpu_runner::{VcpuHandle, VcpuRunnerError};
use crate::vstate::vcpu::Vcpu;
use crate::vstate::vm::{Vm, VmConfig};
use crate::vstate::KvmContext;

/// How long the host waits for the test guest to answer.
const GUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a machine operation failed.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// The memory size cannot be laid out.
    #[error("Invalid machine shape")]
    Layout(#[from] crate::arch::x86_64::layout::LayoutError),
    /// Guest memory could not be set up.
    #[error("Guest memory")]
    Memory(#[from] cube_mem::MemoryError),
    /// Dirty-page tracking failed.
    #[error("Dirty-page tracking")]
    Dirty(#[from] cube_mem::dirty::DirtyError),
    /// No dirty-page tracking could be set up.
    #[error("Dirty-page tracking setup")]
    Tracking(#[from] TrackingError),
    /// Writing the memory file failed.
    #[error("Writing the memory file")]
    MemoryFile(#[from] cube_mem::memory_file::MemoryFileError),
    /// A KVM VM operation failed.
    #[error("KVM VM")]
    Vm(#[from] crate::vstate::vm::VmError),
    /// A KVM vCPU operation failed.
    #[error("KVM vCPU")]
    Vcpu(#[from] crate::vstate::vcpu::VcpuError),
    /// Controlling a vCPU thread failed.
    #[error("vCPU thread")]
    Runner(#[from] VcpuRunnerError),
    /// The test guest could not be loaded.
    #[error("Loading the test guest")]
    Program(#[from] ProgramError),
    /// The test guest did not behave.
    #[error("Test guest")]
    Mailbox(#[from] MailboxError),
    /// The snapshot on disk is unusable.
    #[error("Snapshot")]
    Format(#[from] format::FormatError),
    /// No seal could be drawn for the memory file.
    #[error("Sealing the memory file")]
    Seal(#[from] cube_mem::SealError),
    /// The parent memory file cannot be opened.
    #[error("Opening memory file {0}")]
    Parent(String, #[source] std::io::Error),
    /// The snapshot's durability could not be recorded.
    #[error("Snapshot durability")]
    Durability(#[from] durability::DurabilityError),
    /// The snapshot is of a Linux guest (see `LinuxVm::restore`).
    #[error("Snapshot holds a Linux guest, which this test-guest machine cannot run")]
    LinuxSnapshot,
    /// The machine is hibernated or otherwise has no VM.
    #[error("The machine is not in a state that allows {0}")]
    WrongState(&'static str),
}

/// A running (or paused) microVM.
///
/// Field order is drop order: vCPU threads stop before the VM closes, and the VM
/// closes before guest memory is unmapped.
pub struct Machine {
    vcpus: Vec<VcpuHandle>,
    tracker: CombinedTracker,
    vm: Vm,
    memory: GuestMemory,
    config: MachineConfig,
    ram: Vec<RamRange>,
    guest: GuestKind,
    /// The complete memory file that, plus the pages dirtied since, equals guest memory.
    /// Held open so that removing its snapshot (or template) cannot break later diffs.
    parent: Option<std::fs::File>,
    /// Dirty pages collected by a snapshot that then failed: they must reach the next.
    carry: Option<DirtyBitmap>,
    running: bool,
}

impl Machine {
    fn assemble(
        ctx: &Arc<KvmContext>,
        config: MachineConfig,
        ram: Vec<RamRange>,
        memory: GuestMemory,
        guest: GuestKind,
        parent: Option<std::fs::File>,
        vcpu_setup: impl Fn(&mut Vcpu, u8) -> Result<(), MachineError>,
    ) -> Result<Machine, MachineError> {
        let vm = Vm::new(
            ctx,
            &VmConfig {
                vcpus: config.vcpus,
                irqchip: config.irqchip,
            },
        )?;
        tracing::debug!("assemble: VM created");
        let tracking = dirty_tracking::chosen_kind()?;
        // SAFETY: `memory` is moved into the returned Machine, which drops it only after
        // the VM (field order), so KVM never sees the mapping gone.
        unsafe {
            register_guest_memory(&vm, &memory, tracking == DirtyTrackerKind::KvmDirtyLog)?;
        }
        tracing::debug!("assemble: VM created, memory registered");
        let tracker = dirty_tracking::start(tracking, &vm, &memory)?;
        let mut vcpus = Vec::with_capacity(config.vcpus as usize);
        for index in 0..config.vcpus {
            let mut vcpu = Vcpu::new(&vm, index)?;
            vcpu.configure_cpuid()?;
            vcpu_setup(&mut vcpu, index)?;
            vcpus.push(VcpuHandle::spawn(vcpu)?);
        }
        tracing::debug!("assemble: vCPUs ready");
        Ok(Machine {
            vcpus,
            tracker,
            vm,
            memory,
            config,
            ram,
            guest,
            parent,
            carry: None,
            running: false,
        })
    }

    /// Boots the synthetic test guest in fresh, zeroed memory and waits until it runs.
    pub fn boot_test_guest(
        ctx: &Arc<KvmContext>,
        config: MachineConfig,
        working_set: WorkingSet,
    ) -> Result<Machine, MachineError> {
        let ram = ram_ranges(config.memory_bytes)?;
        let memory = GuestMemory::anonymous(memory_layout(&ram)?)?;
        let registers = program::load(memory.inner(), &ram, config.vcpus, working_set)?;
        let mut machine = Machine::assemble(
            ctx,
            config,
            ram,
            memory,
            GuestKind::TestGuest { working_set },
            None,
            |vcpu, index| {
                let (regs, sregs) = &registers[index as usize];
                vcpu.set_initial_registers(regs, sregs)?;
                Ok(())
            },
        )?;
        machine.start()?;
        Ok(machine)
    }

    /// A machine with no guest yet: VM, vCPUs and memslots over empty memory, ready for
    /// [`Machine::load_in_place`]. A pooled supervisor builds one while it waits, so
    /// creating a sandbox does not pay for VM creation.
    pub fn shell(ctx: &Arc<KvmContext>, config: MachineConfig) -> Result<Machine, MachineError> {
        let ram = ram_ranges(config.memory_bytes)?;
        let memory = GuestMemory::anonymous(memory_layout(&ram)?)?;
        Machine::assemble(
            ctx,
            config,
            ram,
            memory,
            GuestKind::TestGuest {
                working_set: WorkingSet::default(),
            },
            None,
            |_, _| Ok(()),
        )
    }

    /// Restores the snapshot in `dir`: memory is the snapshot's memory file mapped
    /// private and copy-on-write, so this costs the same for any guest size.
    pub fn restore(ctx: &Arc<KvmContext>, dir: &Path) -> Result<Machine, MachineError> {
        let start = std::time::Instant::now();
        let state = format::read_state(dir)?;
        if state.guest == GuestKind::Linux {
            return Err(MachineError::LinuxSnapshot);
        }
        tracing::debug!(elapsed = ?start.elapsed(), "restore: state read");
        let memory_path = SnapshotDir::new(dir).memory();
        let memory = GuestMemory::restore_private(memory_layout(&state.ram)?, &memory_path)?;
        let parent = open_parent(&memory_path)?;
        let MachineState {
            config,
            ram,
            guest,
            vm: vm_state,
            vcpus: vcpu_states,
            ..
        } = state;
        let mut machine = Machine::assemble(
            ctx,
            config,
            ram,
            memory,
            guest,
            Some(parent),
            |vcpu, index| {
                vcpu.restore_state(&vcpu_states[index as usize])?;
                Ok(())
            },
        )?;
        machine.vm.restore_state(&vm_state)?;
        tracing::debug!(elapsed = ?start.elapsed(), "restore: VM and vCPUs restored");
        machine.start()?;
        tracing::debug!(elapsed = ?start.elapsed(), "restore: guest running");
        Ok(machine)
    }

    /// Loads the snapshot in `dir`, whose state `state` the caller read with
    /// [`format::read_state`], into this machine without building a new VM (a rollback,
    /// or a [`Machine::shell`] becoming a sandbox): the
    /// snapshot's memory file is mapped over guest memory at the same host addresses
    /// (the memslots stay), and vCPU and VM state are restored in place.
    ///
    /// Returns `Ok(false)` without touching anything when the snapshot's shape differs
    /// or the tracker cannot follow a remap (the caller then builds a new machine). On
    /// `Err` the machine may be half-restored and must be discarded.
    pub fn load_in_place(&mut self, dir: &Path, state: MachineState) -> Result<bool, MachineError> {
        let start = std::time::Instant::now();
        if state.guest == GuestKind::Linux {
            return Err(MachineError::LinuxSnapshot);
        }
        // userfaultfd registrations do not survive a remap: only KVM's log does.
        if state.config != self.config
            || state.ram != self.ram
            || self.tracker.primary().kind() != DirtyTrackerKind::KvmDirtyLog
        {
            return Ok(false);
        }
        let memory_path = SnapshotDir::new(dir).memory();
        let parent = open_parent(&memory_path)?;
        self.pause()?;
        // SAFETY: every vCPU is parked and this machine has no device thread, so
        // nothing touches guest memory during the remap.
        unsafe { self.memory.remap_private(&memory_path)? };
        // Whatever was dirty belonged to the memory just replaced.
        self.tracker.collect()?;
        for (handle, vcpu_state) in self.vcpus.iter().zip(state.vcpus) {
            handle.with_vcpu(move |v| v.restore_state(&vcpu_state))??;
        }
        self.vm.restore_state(&state.vm)?;
        self.guest = state.guest;
        self.parent = Some(parent);
        self.carry = None;
        tracing::debug!(elapsed = ?start.elapsed(), "load in place: restored");
        self.start()?;
        tracing::debug!(elapsed = ?start.elapsed(), "load in place: guest running");
        Ok(true)
    }

    /// Tells the guest it was (re)started, lets the vCPUs run and waits until the guest
    /// shows it is executing.
    fn start(&mut self) -> Result<(), MachineError> {
        let generation = self.mailbox().bump_generation()?;
        self.resume()?;
        self.mailbox().wait_for(
            field::ACK_GENERATION,
            generation,
            "start running",
            GUEST_TIMEOUT,
        )?;
        Ok(())
    }

    /// The host's view of the test guest's mailbox.
    pub fn mailbox(&self) -> Mailbox<'_> {
        Mailbox::new(self.memory.inner())
    }

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

    /// A path that opens the memory file this machine's memory is based on, if any.
    pub fn parent_memory_file(&self) -> Option<PathBuf> {
        self.parent.as_ref().map(fd_path)
    }

    /// Stops every vCPU where it is. Idempotent.
    pub fn pause(&mut self) -> Result<(), MachineError> {
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

    /// Lets every vCPU continue. Idempotent.
    pub fn resume(&mut self) -> Result<(), MachineError> {
        if self.running {
            return Ok(());
        }
        for vcpu in &self.vcpus {
            vcpu.resume()?;
        }
        self.running = true;
        Ok(())
    }

    /// Wakes vCPUs idling in the control device so they look at the mailbox.
    pub fn ring_doorbell(&self) {
        for vcpu in &self.vcpus {
            vcpu.ring_doorbell();
        }
    }

    /// Sends the test guest a command and waits until it has carried it out.
    pub fn guest_command(
        &self,
        operation: u64,
        arg: u64,
        pattern: u64,
    ) -> Result<(), MachineError> {
        if !self.running {
            return Err(MachineError::WrongState("guest commands while paused"));
        }
        let mailbox = self.mailbox();
        let seq = mailbox.post(operation, arg, pattern)?;
        self.ring_doorbell();
        mailbox.wait_for(field::DONE_SEQ, seq, "finish a command", GUEST_TIMEOUT)?;
        Ok(())
    }

    /// Has the test guest write one word into each page of `mib` MiB of its dirty area.
    pub fn guest_dirty(&self, mib: u64, pattern: u64) -> Result<(), MachineError> {
        let available = dirty_area_pages(&self.ram) / 256;
        if mib > available {
            return Err(MailboxError::DirtyTooLarge {
                requested_mib: mib,
                available_mib: available,
            }
            .into());
        }
        self.guest_command(op::DIRTY, mib * 256, pattern)
    }

    /// Switches the test guest between idling and spinning on its counter.
    pub fn guest_set_mode(&self, mode: Mode) -> Result<(), MachineError> {
        self.guest_command(op::SET_MODE, mode as u64, 0)
    }

    /// Waits until the guest has finished touching its working set after the last
    /// start or restore.
    pub fn wait_working_set(&self) -> Result<(), MachineError> {
        let mailbox = self.mailbox();
        let generation = mailbox.read(field::HOST_GENERATION)?;
        mailbox.wait_for(
            field::WORKING_SET_GENERATION,
            generation,
            "finish its working set",
            GUEST_TIMEOUT,
        )?;
        Ok(())
    }

    /// A guest that stopped for good (triple fault, KVM error), if any vCPU did.
    pub fn fatal(&self) -> Option<String> {
        self.vcpus.iter().find_map(|v| v.fatal())
    }

    fn collect_dirty(&mut self) -> Result<DirtyBitmap, MachineError> {
        let mut dirty = self.tracker.collect()?;
        if let Some(carry) = self.carry.take() {
            dirty.or(&carry)?;
        }
        Ok(dirty)
    }

    /// Writes a complete snapshot into `dir` (an empty staging directory): only the
    /// pages dirtied since the parent image are written, into a reflinked copy of it.
    ///
    /// The vCPUs are stopped meanwhile and continue afterwards if they were running.
    /// On failure the dirty pages are kept for the next attempt, so no write is lost.
    /// Call [`Machine::snapshot_committed`] once `dir` has reached its final place.
    pub fn snapshot(&mut self, dir: &Path) -> Result<SnapshotStats, MachineError> {
        let was_running = self.running;
        self.pause()?;
        let result = self.snapshot_paused(dir);
        if was_running {
            self.resume()?;
        }
        result
    }

    fn snapshot_paused(&mut self, dir: &Path) -> Result<SnapshotStats, MachineError> {
        let start = std::time::Instant::now();
        let dirty = self.collect_dirty()?;
        tracing::debug!(elapsed = ?start.elapsed(), pages = dirty.count(), "snapshot: dirty set collected");
        let result = self.write_snapshot(dir, &dirty);
        tracing::debug!(elapsed = ?start.elapsed(), "snapshot: written");
        // Whether writing failed or the caller has yet to commit the directory, these
        // pages are not safely anywhere but guest memory: keep them for the next diff.
        self.carry = Some(dirty);
        result
    }

    fn write_snapshot(
        &mut self,
        dir: &Path,
        dirty: &DirtyBitmap,
    ) -> Result<SnapshotStats, MachineError> {
        let memory_path = SnapshotDir::new(dir).memory();
        let dirty_pages = dirty.count() as u64;
        // Binds the memory file to this snapshot's state.
        let seal = cube_mem::Seal::random()?;
        let stats = match &self.parent {
            Some(parent) => {
                let diff = cube_mem::memory_file::write_diff(
                    &fd_path(parent),
                    &memory_path,
                    &self.memory,
                    dirty,
                    &seal,
                    Durability::Deferred,
                )?;
                SnapshotStats {
                    dirty_pages,
                    bytes_written: diff.bytes_written,
                    reflinked: diff.clone_method == cube_storage::CloneMethod::Reflink,
                    paused_us: 0,
                }
            }
            None => {
                let written = cube_mem::memory_file::write_full(
                    &memory_path,
                    &self.memory,
                    Some(dirty),
                    &seal,
                    Durability::Deferred,
                )?;
                SnapshotStats {
                    dirty_pages,
                    bytes_written: written.bytes_written,
                    reflinked: false,
                    paused_us: 0,
                }
            }
        };
        tracing::debug!(?stats, "snapshot: memory file written");
        let mut vcpus = Vec::with_capacity(self.vcpus.len());
        for vcpu in &self.vcpus {
            vcpus.push(vcpu.with_vcpu(|v| v.save_state())??);
        }
        let state = MachineState {
            format_version: format::FORMAT_VERSION,
            config: self.config,
            ram: self.ram.clone(),
            guest: self.guest,
            vm: self.vm.save_state()?,
            vcpus,
            boot_id: durability::boot_id()?,
            // The test-guest machine has no virtio devices and no serial port.
            devices: Vec::new(),
            serial: None,
            memory_seal: Some(seal.0),
        };
        format::write_state(dir, &state)?;
        Ok(stats)
    }

    /// Records that the snapshot last written now lives in `dir`: its memory file is
    /// the new parent image, and the pages it holds are no longer pending.
    pub fn snapshot_committed(&mut self, dir: &Path) -> Result<(), MachineError> {
        self.parent = Some(open_parent(&SnapshotDir::new(dir).memory())?);
        self.carry = None;
        Ok(())
    }
}

fn open_parent(path: &Path) -> Result<std::fs::File, MachineError> {
    std::fs::File::open(path).map_err(|e| MachineError::Parent(path.display().to_string(), e))
}

/// A path through which `file` can be opened again even after it was unlinked.
fn fd_path(file: &std::fs::File) -> PathBuf {
    use std::os::fd::AsRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}
