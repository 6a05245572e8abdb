//! The one snapshot writer of every microVM: the memory file (a diff against the
//! parent where there is one), the root disk where asked, and the state file.
//!
//! The guest decides only what is its own ([`GuestContents`]); the order of the
//! writes and what makes them safe are the same for the test guest and Linux guests:
//! the memory file and disk are written first and the checksummed state file last, so
//! a directory without a valid state file is never mistaken for a snapshot.

use std::path::Path;

use cube_devices::records::{DeviceRecord, SerialRecord};
use cube_mem::dirty::DirtyBitmap;
use cube_storage::durable_marker as durability;
use cube_storage::{Durability, SnapshotDir};

use super::state::{self as format, GuestKind, MachineState};
use super::SnapshotStats;
use crate::microvm::{fd_path, MicroVm, MicroVmError};

/// What a snapshot holds of the guest beyond its vCPUs, VM and memory.
pub(crate) struct GuestContents<'a> {
    /// Which guest the machine runs.
    pub kind: GuestKind,
    /// The virtio devices' saved states (the devices held still meanwhile).
    pub devices: Vec<DeviceRecord>,
    /// COM1's registers, for a guest that has one.
    pub serial: Option<SerialRecord>,
    /// A file (the root disk) cloned into the snapshot as [`SnapshotDir::rootfs`].
    pub disk: Option<&'a Path>,
}

impl<G> MicroVm<G> {
    /// Writes a snapshot of this machine, whose vCPUs are paused and devices still,
    /// into the empty directory `dir`: the pages in `dirty` over a clone of the parent
    /// memory file (a reflink where the filesystem can), or after a fresh boot the
    /// pages ever written (the memfd's data extents: they cover what the VMM wrote
    /// before tracking began, such as the kernel or the test program). Nothing is
    /// flushed here: the caller's transaction flushes in the background.
    pub(crate) fn write_snapshot(
        &self,
        dir: &Path,
        dirty: &DirtyBitmap,
        contents: GuestContents<'_>,
    ) -> Result<SnapshotStats, MicroVmError> {
        let memory_path = SnapshotDir::new(dir).memory();
        let dirty_pages = dirty.count() as u64;
        let stats = match self.diff.parent() {
            Some(parent) => {
                let diff = cube_mem::memory_file::write_diff(
                    &fd_path(parent),
                    &memory_path,
                    &self.memory,
                    dirty,
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
                    None,
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
        if let Some(disk) = contents.disk {
            cube_storage::clone_file(disk, &SnapshotDir::new(dir).rootfs())?;
        }
        let mut vcpus = Vec::with_capacity(self.vcpus.len());
        for vcpu in &self.vcpus {
            vcpus.push(vcpu.with_vcpu(|v| v.save_state())??);
        }
        let state = MachineState {
            format_version: format::FORMAT_VERSION,
            config: self.config,
            ram: self.ram.clone(),
            guest: contents.kind,
            vm: self.vm.save_state()?,
            vcpus,
            boot_id: durability::boot_id()?,
            devices: contents.devices,
            serial: contents.serial,
        };
        format::write_state(dir, &state)?;
        Ok(stats)
    }
}
