//! The one snapshot writer of every microVM: the memory file (a diff against the
//! parent where there is one), the root disk where asked, and the state file.
//!
//! The guest decides only what is its own ([`SnapshotGuest`]); the order of the
//! writes and what makes them safe are the same for the test guest and Linux guests:
//! the memory file and disk are written first and the checksummed state file last, so
//! a directory without a valid state file is never mistaken for a snapshot.
//!
//! A snapshot is taken live: the parent memory file is cloned while the guest runs;
//! the vCPUs stop, and the guest's devices are held still
//! ([`SnapshotGuest::hold_still`]), only while the dirty set, the vCPU, VM and device
//! state and the disk clone are taken and the dirty pages are write-protected
//! ([`cube_mem::live_copy`]); the pages are copied after the vCPUs and devices
//! continue, a page the guest (or a device on its behalf) writes first. The file holds
//! guest memory exactly as it was when the vCPUs stopped. Memory restored from a file
//! (every sandbox created from a template or snapshot) cannot be write-protected: there
//! the pending pages are pre-copied over the clone while the guest runs, then again
//! those it dirtied meanwhile (devices' writes included: the VMM's own writes are
//! tracked with the guest's), until few are left ([`PRECOPY_ROUNDS`],
//! [`PRECOPY_ENOUGH_PAGES`]); the vCPUs stop only to take the last few and the state.
//! Where the machine has no parent memory file yet, or is paused already, the pages
//! are written before it continues.

use std::path::Path;
use std::time::Instant;

use cube_devices::records::{DeviceRecord, SerialRecord};
use cube_mem::dirty::DirtyBitmap;
use cube_mem::live_copy::LiveCopy;
use cube_mem::memory_file::{prepare_diff, PreparedDiff};
use cube_mem::Seal;
use cube_storage::durable_marker as durability;
use cube_storage::{Durability, SnapshotDir};

use super::state::{self as format, GuestKind, MachineState};
use super::SnapshotStats;
use crate::microvm::{fd_path, MicroVm, MicroVmError};

/// A guest's own part of its machine, as a snapshot sees it.
pub(crate) trait SnapshotGuest {
    /// The guest's devices held still for as long as it lives.
    type Still<'a>
    where
        Self: 'a;

    /// Holds every device still, so that none writes guest memory, its disk or its
    /// state until the returned value is dropped: with the vCPUs paused, memory and
    /// device state then describe one instant.
    fn hold_still(&self) -> Self::Still<'_>;

    /// What the snapshot keeps of the guest beyond its vCPUs, VM and memory, taken
    /// while `still` holds it.
    fn records(&self, still: &Self::Still<'_>) -> Result<GuestRecords, MicroVmError>;
}

/// What a snapshot holds of the guest beyond its vCPUs, VM and memory.
pub(crate) struct GuestRecords {
    /// Which guest the machine runs.
    pub kind: GuestKind,
    /// The virtio devices' saved states.
    pub devices: Vec<DeviceRecord>,
    /// COM1's registers, for a guest that has one.
    pub serial: Option<SerialRecord>,
}

/// What a running machine does once its snapshot's stopped part is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterSnapshot {
    /// Its vCPUs and devices continue, and the memory is copied meanwhile (a live
    /// snapshot).
    Continue,
    /// It stays stopped: the snapshot is its last instant (a hibernation image). Its
    /// memory is still pre-copied while it runs, before the stop.
    Stop,
}

/// Pre-copy rounds at most before the vCPUs stop: a guest that keeps writing faster
/// than the copy does not converge, and its last dirty set is taken stopped.
pub const PRECOPY_ROUNDS: usize = 4;

/// A dirty set this small is left for the stop instead of another round: a round costs
/// a collect of the dirty log and a pass over it, about as much as copying these pages.
pub const PRECOPY_ENOUGH_PAGES: usize = 64;

impl<G> MicroVm<G> {
    /// Takes a live snapshot into the empty directory `dir` (see the module docs), with
    /// `disk` (the root disk) cloned into it as [`SnapshotDir::rootfs`]; then a
    /// running machine continues or stays stopped, as `then` says (a paused one stays
    /// paused). `stats.paused_us` is how long the vCPUs were stopped, for one that
    /// stays stopped until the memory was written (0 for a machine that was paused
    /// already). The pages it takes stay pending until
    /// [`MicroVm::snapshot_committed`]. Nothing is flushed here: the caller's
    /// transaction flushes in the background.
    pub(crate) fn snapshot_running(
        &mut self,
        dir: &Path,
        disk: Option<&Path>,
        then: AfterSnapshot,
    ) -> Result<SnapshotStats, MicroVmError>
    where
        G: SnapshotGuest,
    {
        // Binds the memory file to this snapshot's state.
        let seal = Seal::random()?;
        // The clone of the parent needs no stopped guest.
        let mut prepared = self.prepare_memory(dir)?;
        let was_running = self.running;
        // Whether the vCPUs run again once the stopped part is taken.
        let continues = was_running && then == AfterSnapshot::Continue;
        // Memory that cannot be write-protected, or that no running guest will need
        // protected, is copied ahead while the guest runs.
        let precopied = match prepared.as_mut() {
            Some(prepared) if was_running && !(continues && LiveCopy::applies_to(&self.memory)) => {
                Some(self.precopy(prepared)?)
            }
            _ => None,
        };
        let stopped = Instant::now();
        if let Err(e) = self.pause() {
            if let Some(copied) = precopied {
                self.diff.add_pending(copied.pages)?;
            }
            return Err(e);
        }
        let result = {
            // Nothing writes guest memory from here until `still` is dropped: the
            // vCPUs are paused and the devices wait.
            let still = self.guest.hold_still();
            match self.diff.take_pending() {
                Err(e) => Err(e),
                Ok(dirty) => {
                    let written = self
                        .guest
                        .records(&still)
                        .and_then(|records| self.capture(dir, records, disk, &seal))
                        .and_then(|state| {
                            let memory =
                                self.stopped_memory(dir, &dirty, prepared, &seal, continues)?;
                            Ok((state, memory))
                        });
                    // After a pre-copy, only the pages dirtied since its last round
                    // (and the round it left) are written now; all of them stay pending.
                    let mut pending = dirty;
                    let written =
                        match &precopied {
                            Some(copied) => pending
                                .or(&copied.pages)
                                .map_err(MicroVmError::from)
                                .and(written.map(|(state, memory)| {
                                    (state, memory.after_precopy(copied, &pending))
                                })),
                            None => written,
                        };
                    // Until committed these pages are only in guest memory.
                    self.diff.keep_pending(pending);
                    written
                }
            }
        };
        let result = result.and_then(|(state, memory)| {
            if continues {
                self.resume()?;
            }
            let paused_us = if was_running {
                stopped.elapsed().as_micros() as u64
            } else {
                0
            };
            let stats = match memory {
                Memory::Written(stats) => stats,
                Memory::Live(live) => {
                    let diff = live.finish(&self.memory, &seal, Durability::Deferred)?;
                    SnapshotStats {
                        dirty_pages: diff.pages_written,
                        bytes_written: diff.bytes_written,
                        reflinked: diff.clone_method == cube_storage::CloneMethod::Reflink,
                        paused_us: 0,
                    }
                }
            };
            format::write_state(dir, &state)?;
            Ok(SnapshotStats { paused_us, ..stats })
        });
        if result.is_err() && was_running && !self.running {
            // A failure before the vCPUs continued: they continue now, also where they
            // were to stay stopped, since no image of their last instant was taken.
            self.resume()?;
        }
        result
    }

    /// Copies the pending pages over `prepared` while the guest runs, then those it
    /// dirtied meanwhile, until few are left or [`PRECOPY_ROUNDS`] are done. The last
    /// dirty set collected and not copied stays carried, so that the stopped part
    /// takes it with what the guest dirties until then. On failure every page taken
    /// stays pending.
    fn precopy(&mut self, prepared: &mut PreparedDiff) -> Result<Precopied, MicroVmError> {
        let mut copied = Precopied {
            pages: self.diff.take_pending()?,
            bytes: 0,
            rounds: 0,
        };
        let mut round = copied.pages.clone();
        let result = loop {
            match prepared.precopy(&self.memory, &round) {
                Ok(stats) => copied.bytes += stats.bytes_written,
                Err(e) => break Err(MicroVmError::from(e)),
            }
            copied.rounds += 1;
            let next = match self.diff.collect_new() {
                Ok(next) => next,
                Err(e) => break Err(e),
            };
            if let Err(e) = copied.pages.or(&next) {
                break Err(e.into());
            }
            if copied.rounds == PRECOPY_ROUNDS || next.count() <= PRECOPY_ENOUGH_PAGES {
                break Ok(next);
            }
            round = next;
        };
        match result {
            Ok(left) => {
                self.diff.keep_pending(left);
                tracing::debug!(
                    rounds = copied.rounds,
                    pages = copied.pages.count(),
                    bytes = copied.bytes,
                    "snapshot: pre-copied"
                );
                Ok(copied)
            }
            Err(e) => {
                self.diff.keep_pending(copied.pages);
                Err(e)
            }
        }
    }

    /// The memory part of a live snapshot that needs the vCPUs stopped and the devices
    /// still: the dirty pages write-protected, where the vCPUs `continue` after (or
    /// written, where no live copy can be made or they do not continue).
    fn stopped_memory(
        &self,
        dir: &Path,
        dirty: &DirtyBitmap,
        prepared: Option<PreparedDiff>,
        seal: &Seal,
        continues: bool,
    ) -> Result<Memory, MicroVmError> {
        let memory = match prepared {
            Some(prepared) if continues && LiveCopy::applies_to(&self.memory) => {
                match LiveCopy::protect(&self.memory, dirty) {
                    Ok(copy) => Memory::Live(prepared.live(copy, dirty)),
                    Err(e) => {
                        tracing::debug!(error = %e, "no live copy here: writing with the vCPUs stopped");
                        Memory::Written(self.write_memory(dir, dirty, Some(prepared), seal)?)
                    }
                }
            }
            prepared => Memory::Written(self.write_memory(dir, dirty, prepared, seal)?),
        };
        Ok(memory)
    }

    /// The clone of the parent memory file into `dir`, for a diff over it; None for a
    /// machine with no parent (a fresh boot).
    fn prepare_memory(&self, dir: &Path) -> Result<Option<PreparedDiff>, MicroVmError> {
        let memory_path = SnapshotDir::new(dir).memory();
        match self.diff.parent() {
            Some(parent) => Ok(Some(prepare_diff(
                parent,
                &fd_path(parent),
                &memory_path,
                &self.memory,
            )?)),
            None => Ok(None),
        }
    }

    /// Writes the memory file with the guest stopped: `dirty` over the prepared clone,
    /// or, with none, the pages ever written.
    fn write_memory(
        &self,
        dir: &Path,
        dirty: &DirtyBitmap,
        prepared: Option<PreparedDiff>,
        seal: &Seal,
    ) -> Result<SnapshotStats, MicroVmError> {
        let dirty_pages = dirty.count() as u64;
        let stats = match prepared {
            Some(prepared) => {
                let diff = prepared.write(&self.memory, dirty, seal, Durability::Deferred)?;
                SnapshotStats {
                    dirty_pages,
                    bytes_written: diff.bytes_written,
                    reflinked: diff.clone_method == cube_storage::CloneMethod::Reflink,
                    paused_us: 0,
                }
            }
            None => {
                let written = cube_mem::memory_file::write_full(
                    &SnapshotDir::new(dir).memory(),
                    &self.memory,
                    None,
                    seal,
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
        Ok(stats)
    }

    /// The machine's state with the guest's `records` and the memory file's `seal`,
    /// and `disk` cloned into `dir`: what must be taken with the vCPUs stopped besides
    /// memory.
    fn capture(
        &self,
        dir: &Path,
        records: GuestRecords,
        disk: Option<&Path>,
        seal: &Seal,
    ) -> Result<MachineState, MicroVmError> {
        if let Some(disk) = disk {
            cube_storage::clone_file(disk, &SnapshotDir::new(dir).rootfs())?;
        }
        let mut vcpus = Vec::with_capacity(self.vcpus.len());
        for vcpu in &self.vcpus {
            vcpus.push(vcpu.with_vcpu(|v| v.save_state())??);
        }
        Ok(MachineState {
            format_version: format::FORMAT_VERSION,
            config: self.config,
            ram: self.ram.clone(),
            guest: records.kind,
            vm: self.vm.save_state()?,
            vcpus,
            boot_id: durability::boot_id()?,
            devices: records.devices,
            serial: records.serial,
            memory_seal: Some(seal.0),
        })
    }
}

/// What a pre-copy took while the guest ran.
struct Precopied {
    /// Every page it copied or collected: all pending until the snapshot is committed.
    pages: DirtyBitmap,
    /// Bytes it wrote.
    bytes: u64,
    /// Rounds it made.
    rounds: usize,
}

/// How a snapshot's memory file gets its pages.
enum Memory {
    /// Written already, with the vCPUs stopped.
    Written(SnapshotStats),
    /// Write-protected, to be copied once the vCPUs continue.
    Live(cube_mem::memory_file::LiveDiff),
}

impl Memory {
    /// The stats of a memory file whose stopped part followed `copied`: `pending`
    /// pages in all, and the bytes of both.
    fn after_precopy(self, copied: &Precopied, pending: &DirtyBitmap) -> Memory {
        match self {
            Memory::Written(stats) => Memory::Written(SnapshotStats {
                dirty_pages: pending.count() as u64,
                bytes_written: stats.bytes_written + copied.bytes,
                ..stats
            }),
            live => live,
        }
    }
}

#[cfg(test)]
// The test takes live snapshots of a real machine: the test guest's.
#[cfg(feature = "test-guest")]
mod tests {
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;

    use super::*;
    use crate::persist::state::{read_state, MachineConfig, WorkingSet};
    use crate::test_guest::machine::Machine;
    use crate::test_guest::mailbox::{field, op, DIRTY_AREA_ADDR};
    use crate::vstate::KvmContext;

    /// Pages of the dirty area the guest rewrites during the snapshot.
    const PAGES: u64 = 128 << 8;

    /// The word the guest's dirty command wrote into page `page`.
    fn word(file: &std::fs::File, page: u64) -> u64 {
        let mut buf = [0u8; 8];
        file.read_exact_at(&mut buf, DIRTY_AREA_ADDR + page * 4096)
            .unwrap();
        u64::from_le_bytes(buf)
    }

    /// A booted test guest (memory in a memfd) with a committed snapshot in
    /// `store/base` to diff against; None without KVM.
    fn machine_with_a_parent(store: &Path) -> Option<(Arc<KvmContext>, Machine)> {
        let ctx = match KvmContext::open() {
            Ok(c) => Arc::new(c),
            Err(e) => {
                eprintln!("skipping: KVM unavailable: {e}");
                return None;
            }
        };
        let config = MachineConfig {
            vcpus: 1,
            memory_bytes: 512 << 20,
            irqchip: true,
        };
        let mut machine = Machine::boot_test_guest(&ctx, config, WorkingSet::default()).unwrap();
        let base = store.join("base");
        std::fs::create_dir(&base).unwrap();
        // A parent to diff against: live copies need one.
        machine.snapshot(&base, None).unwrap();
        machine.snapshot_committed(&base).unwrap();
        Some((ctx, machine))
    }

    /// Memory in a memfd: the dirty pages are write-protected and copied after the
    /// vCPUs continue.
    #[test]
    fn a_live_snapshot_holds_memory_as_it_was_when_the_vcpus_stopped() {
        let store = tempfile::tempdir().unwrap();
        let Some((_ctx, mut machine)) = machine_with_a_parent(store.path()) else {
            return;
        };
        snapshots_taken_mid_write_hold_the_stopped_memory(&mut machine, store.path());
    }

    /// Memory restored from a file (as every sandbox's is): the dirty pages are
    /// pre-copied while the guest runs and the last ones taken stopped.
    #[test]
    fn a_precopied_snapshot_of_restored_memory_holds_it_as_it_was_when_the_vcpus_stopped() {
        let store = tempfile::tempdir().unwrap();
        let Some((ctx, machine)) = machine_with_a_parent(store.path()) else {
            return;
        };
        drop(machine);
        let mut restored = Machine::restore(&ctx, &store.path().join("base")).unwrap();
        assert!(!LiveCopy::applies_to(&restored.memory));
        snapshots_taken_mid_write_hold_the_stopped_memory(&mut restored, store.path());
    }

    /// A final snapshot (a hibernation image) of a guest rewriting every page of the
    /// area while the pre-copy runs: the machine is left stopped, and the file holds
    /// its memory exactly as it is now, whether the memory is a memfd or was restored
    /// from a file. Told to, the guest then finishes its command.
    #[test]
    fn a_final_snapshot_leaves_the_machine_stopped_with_its_memory_as_it_is() {
        use vm_memory::{Bytes, GuestAddress};
        for restored in [false, true] {
            let store = tempfile::tempdir().unwrap();
            let Some((ctx, machine)) = machine_with_a_parent(store.path()) else {
                return;
            };
            let mut machine = if restored {
                drop(machine);
                Machine::restore(&ctx, &store.path().join("base")).unwrap()
            } else {
                machine
            };
            let (old, new) = (0x3000_0000_0000u64, 0x4000_0000_0000u64);
            machine.guest_command(op::DIRTY, PAGES, old).unwrap();
            let seq = machine.mailbox().post(op::DIRTY, PAGES, new).unwrap();
            machine.ring_doorbell();
            let dir = store.path().join("final");
            std::fs::create_dir(&dir).unwrap();
            let stats = machine.final_snapshot(&dir, None).unwrap();
            assert!(!machine.is_running(), "restored: {restored}");
            assert!(stats.paused_us > 0, "{stats:?}");
            let file = std::fs::File::open(SnapshotDir::new(&dir).memory()).unwrap();
            let mut differing = 0;
            for page in 0..PAGES {
                let addr = GuestAddress(DIRTY_AREA_ADDR + page * 4096);
                let live: u64 = machine.memory.inner().read_obj(addr).unwrap();
                differing += usize::from(word(&file, page) != live);
            }
            assert_eq!(differing, 0, "restored: {restored}: pages not as in memory");
            eprintln!(
                "final snapshot (restored memory: {restored}): {} dirty pages, \
                 stopped {} us",
                stats.dirty_pages, stats.paused_us
            );
            machine.resume().unwrap();
            machine
                .mailbox()
                .wait_for(
                    field::DONE_SEQ,
                    seq,
                    "finish",
                    std::time::Duration::from_secs(60),
                )
                .unwrap();
        }
    }

    /// The guest rewrites every page of the area while a live snapshot copies them
    /// (each page is pending: all were written since the last committed snapshot). The memory
    /// file holds the pages as they were when the vCPUs stopped: the new pattern below
    /// the guest's write pointer in the snapshot's registers, the old one above it.
    /// A copy that read pages after the guest went on writing would show the new
    /// pattern above the pointer.
    fn snapshots_taken_mid_write_hold_the_stopped_memory(machine: &mut Machine, store: &Path) {
        let mut mid_command = 0;
        for attempt in 0..8u64 {
            let old = 0x1000_0000_0000 + (attempt << 32);
            let new = 0x2000_0000_0000 + (attempt << 32);
            // Every page pending, holding `old + page`.
            machine.guest_command(op::DIRTY, PAGES, old).unwrap();
            // A snapshot left uncommitted keeps those pages pending, and has the dirty
            // log protect them again: the guest's next write to each one traps, which
            // slows its next command enough for a snapshot to land in the middle.
            let uncommitted = store.join(format!("uncommitted-{attempt}"));
            std::fs::create_dir(&uncommitted).unwrap();
            machine.snapshot(&uncommitted, None).unwrap();
            // The guest starts writing `new + page` from page 0 upwards...
            let seq = machine.mailbox().post(op::DIRTY, PAGES, new).unwrap();
            machine.ring_doorbell();
            // ...and is snapshotted while it writes.
            let dir = store.join(format!("live-{attempt}"));
            std::fs::create_dir(&dir).unwrap();
            let stats = machine.snapshot(&dir, None).unwrap();
            assert!(
                stats.paused_us > 0,
                "a running machine was stopped for a while"
            );
            machine.snapshot_committed(&dir).unwrap();
            machine
                .mailbox()
                .wait_for(
                    field::DONE_SEQ,
                    seq,
                    "finish",
                    std::time::Duration::from_secs(60),
                )
                .unwrap();

            let state = read_state(&dir).unwrap();
            let pointer = state.vcpus[0].regs.rdi;
            let at = pointer.saturating_sub(DIRTY_AREA_ADDR) / 4096;
            let file = std::fs::File::open(SnapshotDir::new(&dir).memory()).unwrap();
            let command_ran = state.vcpus[0].regs.rcx != 0 || word(&file, 0) == new;
            for page in 0..PAGES {
                let found = word(&file, page);
                // The page the pointer is at may be written or not: the vCPU may have
                // stopped between the store and the pointer's step.
                let expected: &[u64] = if !command_ran || page > at {
                    &[old + page]
                } else if page < at {
                    &[new + page]
                } else {
                    &[old + page, new + page]
                };
                assert!(
                    expected.contains(&found),
                    "attempt {attempt}: page {page} holds {found:#x}, expected {expected:x?} \
                     (the vCPU stopped at page {at})"
                );
            }
            eprintln!(
                "attempt {attempt}: stopped at page {at} (command ran: {command_ran}), \
                 vCPUs stopped {} us, {} bytes copied",
                stats.paused_us, stats.bytes_written
            );
            if command_ran && at > 0 && at < PAGES {
                mid_command += 1;
                if mid_command == 2 {
                    break;
                }
            }
        }
        assert!(
            mid_command > 0,
            "no snapshot caught the guest in the middle of its writes"
        );
    }
}
