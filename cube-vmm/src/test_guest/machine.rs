//! The test guest's microVM: a [`MicroVm`] whose guest is the synthetic test
//! program, booted fresh, restored from a snapshot or loaded in place into a
//! pre-built shell, and driven through its mailbox. (A Linux guest is the same
//! machine with other guest parts, [`crate::linux_vm::LinuxVm`].)

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cube_mem::dirty::DirtyTrackerKind;
use cube_storage::SnapshotDir;

use super::mailbox::{field, op, Mailbox, MailboxError, Mode};
use super::program::{self, dirty_area_pages, ProgramError};
use crate::microvm::{open_parent, MicroVm, MicroVmBuilder, MicroVmError};
use crate::persist::snapshot_writer::{AfterSnapshot, GuestRecords, SnapshotGuest};
use crate::persist::state::{self as format, GuestKind, MachineConfig, MachineState, WorkingSet};
use crate::persist::SnapshotStats;
use crate::vcpu_runner::{VcpuHandle, VcpuRunnerError};
use crate::vstate::vcpu::Vcpu;
use crate::vstate::KvmContext;

/// How long the host waits for the test guest to answer.
const GUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Extra time allowed per MiB a dirty command writes: the first touch of each page
/// faults into the host, and on a host loaded with other work 1 GiB took over 30 s,
/// so a fixed bound failed healthy guests there.
const DIRTY_TIMEOUT_PER_MIB: Duration = Duration::from_millis(60);

/// Why a machine operation failed.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// The microVM under the test guest failed.
    #[error(transparent)]
    Machine(#[from] MicroVmError),
    /// Guest memory could not be remapped.
    #[error("Guest memory")]
    Memory(#[from] cube_mem::MemoryError),
    /// A KVM VM operation failed.
    #[error("KVM VM")]
    Vm(#[from] crate::vstate::vm::VmError),
    /// A KVM vCPU operation failed.
    #[error("KVM vCPU")]
    Vcpu(#[from] crate::vstate::vcpu::VcpuError),
    /// Controlling a vCPU thread failed.
    #[error("vCPU thread")]
    Runner(#[from] VcpuRunnerError),
    /// Dirty-page tracking failed.
    #[error("Dirty-page tracking")]
    Dirty(#[from] cube_mem::dirty::DirtyError),
    /// The test guest could not be loaded.
    #[error("Loading the test guest")]
    Program(#[from] ProgramError),
    /// The test guest did not behave.
    #[error("Test guest")]
    Mailbox(#[from] MailboxError),
    /// The snapshot on disk is unusable.
    #[error("Snapshot")]
    Format(#[from] format::FormatError),
    /// The snapshot is of a Linux guest (see `LinuxVm::restore`).
    #[error("Snapshot holds a Linux guest, which this test-guest machine cannot run")]
    LinuxSnapshot,
    /// The machine is hibernated or otherwise has no VM.
    #[error("The machine is not in a state that allows {0}")]
    WrongState(&'static str),
}

/// The test guest's own part of its machine: which program it runs.
pub struct TestGuest {
    kind: GuestKind,
}

impl SnapshotGuest for TestGuest {
    // The test-guest machine has no virtio devices and no serial port.
    type Still<'a> = ();

    fn hold_still(&self) {}

    fn records(&self, _still: &()) -> Result<GuestRecords, MicroVmError> {
        Ok(GuestRecords {
            kind: self.kind,
            devices: Vec::new(),
            serial: None,
        })
    }
}

/// A running (or paused) microVM with the test guest in it.
pub type Machine = MicroVm<TestGuest>;

impl MicroVm<TestGuest> {
    /// Joins `builder`'s VM and memory with one vCPU thread per vCPU of its shape,
    /// each set up by `vcpu_setup` (initial registers, or restored state).
    fn assemble(
        builder: MicroVmBuilder,
        kind: GuestKind,
        vcpu_setup: impl Fn(&mut Vcpu, u8) -> Result<(), MachineError>,
    ) -> Result<Machine, MachineError> {
        let vcpu_count = builder.config().vcpus;
        let mut vcpus = Vec::with_capacity(vcpu_count as usize);
        for index in 0..vcpu_count {
            let mut vcpu = Vcpu::new(builder.vm(), index)?;
            vcpu.configure_cpuid()?;
            vcpu_setup(&mut vcpu, index)?;
            vcpus.push(VcpuHandle::spawn(vcpu)?);
        }
        tracing::debug!("assemble: vCPUs ready");
        Ok(builder.build(vcpus, TestGuest { kind }, false))
    }

    /// Boots the synthetic test guest in fresh, zeroed memory and waits until it runs.
    pub fn boot_test_guest(
        ctx: &Arc<KvmContext>,
        config: MachineConfig,
        working_set: WorkingSet,
    ) -> Result<Machine, MachineError> {
        let builder = MicroVmBuilder::fresh(ctx, config)?;
        let registers = program::load(
            builder.memory().inner(),
            builder.ram(),
            config.vcpus,
            working_set,
        )?;
        let mut machine = Machine::assemble(
            builder,
            GuestKind::TestGuest { working_set },
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
        let builder = MicroVmBuilder::fresh(ctx, config)?;
        let kind = GuestKind::TestGuest {
            working_set: WorkingSet::default(),
        };
        Machine::assemble(builder, kind, |_, _| Ok(()))
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
        let builder = MicroVmBuilder::restored(ctx, &state, dir)?;
        let MachineState {
            guest,
            vm: vm_state,
            vcpus: vcpu_states,
            ..
        } = state;
        let mut machine = Machine::assemble(builder, guest, |vcpu, index| {
            vcpu.restore_state(&vcpu_states[index as usize])?;
            Ok(())
        })?;
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
            || self.diff.tracker_kind() != DirtyTrackerKind::KvmDirtyLog
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
        self.diff.rebased(parent)?;
        for (handle, vcpu_state) in self.vcpus.iter().zip(state.vcpus) {
            handle.with_vcpu(move |v| v.restore_state(&vcpu_state))??;
        }
        self.vm.restore_state(&state.vm)?;
        self.guest.kind = state.guest;
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
        self.guest_command_within(operation, arg, pattern, GUEST_TIMEOUT)
    }

    /// [`Self::guest_command`] with its own bound on the wait.
    fn guest_command_within(
        &self,
        operation: u64,
        arg: u64,
        pattern: u64,
        timeout: Duration,
    ) -> Result<(), MachineError> {
        if !self.running {
            return Err(MachineError::WrongState("guest commands while paused"));
        }
        let mailbox = self.mailbox();
        let seq = mailbox.post(operation, arg, pattern)?;
        self.ring_doorbell();
        mailbox.wait_for(field::DONE_SEQ, seq, "finish a command", timeout)?;
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
        let allowance =
            DIRTY_TIMEOUT_PER_MIB.saturating_mul(u32::try_from(mib).unwrap_or(u32::MAX));
        self.guest_command_within(
            op::DIRTY,
            mib * 256,
            pattern,
            GUEST_TIMEOUT.saturating_add(allowance),
        )
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

    /// Writes a complete snapshot into `dir` (an empty staging directory): only the
    /// pages dirtied since the parent image are written, into a reflinked copy of it;
    /// with `disk`, a clone of that file (the root disk) goes with it.
    ///
    /// A running machine's vCPUs stop only while its state is taken and the dirty
    /// pages are write-protected, and continue while the pages are copied (a live
    /// snapshot, see [`crate::persist::snapshot_writer`]); `paused_us` in the result
    /// says for how long. On failure the dirty pages are kept for the next attempt,
    /// so no write is lost. Call [`MicroVm::snapshot_committed`] once `dir` has
    /// reached its final place.
    pub fn snapshot(
        &mut self,
        dir: &Path,
        disk: Option<&Path>,
    ) -> Result<SnapshotStats, MachineError> {
        Ok(self.snapshot_running(dir, disk, AfterSnapshot::Continue)?)
    }

    /// Writes the machine's last snapshot into `dir`, as [`Self::snapshot`] does,
    /// and leaves it stopped (a hibernation image): a running machine's dirty pages
    /// are pre-copied while it runs, and it stops only for the rest and its state.
    /// On failure it runs on as before, and the dirty pages are kept.
    pub fn final_snapshot(
        &mut self,
        dir: &Path,
        disk: Option<&Path>,
    ) -> Result<SnapshotStats, MachineError> {
        Ok(self.snapshot_running(dir, disk, AfterSnapshot::Stop)?)
    }
}
