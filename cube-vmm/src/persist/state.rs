//! The on-disk snapshot: a directory holding the memory file, a checksummed state file
//! and (when the sandbox has one) its root filesystem image.
//!
//! Every byte of the state file is untrusted: the checksummed envelope catches
//! truncation and bit rot, and [`decode`] then checks every field against the limits
//! the VMM can honour before anything reaches KVM.

use std::path::Path;

use serde::{Deserialize, Serialize};

use cube_devices::records::{DeviceRecord, SerialRecord, SERIAL_FIFO_BYTES};
use cube_storage::durable_marker::{self, DurabilityError};
use cube_storage::SnapshotDir;

use crate::arch::x86_64::layout::{ram_ranges, RamRange};
use crate::device_manager::MAX_VIRTIO_DEVICES;
use crate::vstate::vcpu::VcpuState;
use crate::vstate::vm::VmState;

/// Envelope kind of the state file.
pub const STATE_KIND: &str = "cube-vm-state";
/// Version of the state layout this build writes (it reads this one,
/// [`FORMAT_VERSION_UNSEALED`] and [`FORMAT_VERSION_NO_DEVICES`]). Version 3 kept each
/// device's state as bare bytes without its kind and version; those files are refused,
/// as their device states cannot be checked.
pub const FORMAT_VERSION: u32 = 5;
/// The previous layout: the same state without the memory file's seal (see
/// [`cube_mem::memory_seal`]), whose memory file is guest memory alone.
pub const FORMAT_VERSION_UNSEALED: u32 = 4;
/// The previous layout: the same state without virtio devices.
pub const FORMAT_VERSION_NO_DEVICES: u32 = 2;
/// Largest encoded device-specific state accepted for one virtio device.
pub const MAX_DEVICE_STATE_BYTES: usize = 64 << 10;
/// Largest state file accepted (a few KiB per vCPU in practice).
pub const MAX_STATE_BYTES: u64 = 8 << 20;
/// Most vCPUs a snapshot may describe.
pub const MAX_VCPUS: u8 = 64;

/// Why a snapshot could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The state file's envelope is damaged or unreadable.
    #[error("Snapshot state file is unreadable")]
    Envelope(#[source] cube_storage::MetadataError),
    /// The state does not decode.
    #[error("Snapshot state does not decode")]
    Decode(#[source] postcard::Error),
    /// The state could not be encoded.
    #[error("Encoding the snapshot state failed")]
    Encode(#[source] postcard::Error),
    /// The state was written by another format version.
    #[error(
        "Snapshot format version {found} is not supported (this build reads {FORMAT_VERSION})"
    )]
    Version {
        /// Version in the file.
        found: u32,
    },
    /// A field is outside what the VMM accepts.
    #[error("Snapshot state is invalid: {0}")]
    Invalid(String),
    /// The memory file is missing or has the wrong size.
    #[error("Snapshot memory file {path} is {found} bytes, expected {expected}")]
    MemoryFileSize {
        /// The memory file.
        path: String,
        /// Its size on disk.
        found: u64,
        /// The size the state records.
        expected: u64,
    },
    /// The snapshot may be incomplete.
    #[error("Snapshot cannot be trusted")]
    Durability(#[from] DurabilityError),
    /// The memory file cannot be inspected.
    #[error("Snapshot memory file {0} is missing")]
    MemoryFileMissing(String, #[source] std::io::Error),
    /// The memory file is not the one written with this state.
    #[error("Snapshot memory file does not match its state")]
    MemorySeal(#[from] cube_mem::SealError),
}

/// Largest working set either pass of the test guest may touch (its read and write
/// areas must not overlap).
pub const WORKING_SET_MAX_BYTES: u64 = 16 << 20;

/// What the test guest does after every start or restore: part of its snapshot's
/// state, so that a restored guest touches what the original did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkingSet {
    /// Bytes read, one load per page.
    pub read_bytes: u64,
    /// Bytes written, one store per page.
    pub write_bytes: u64,
}

impl Default for WorkingSet {
    /// About what an idle Linux guest with its agent touches after a restore.
    fn default() -> Self {
        WorkingSet {
            read_bytes: 16 << 20,
            write_bytes: 4 << 20,
        }
    }
}

/// The shape of a microVM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineConfig {
    /// Number of vCPUs.
    pub vcpus: u8,
    /// Guest RAM in bytes.
    pub memory_bytes: u64,
    /// Whether the VM has an in-kernel interrupt controller (PIC, IOAPIC, LAPIC, PIT).
    pub irqchip: bool,
}

impl Default for MachineConfig {
    /// The reference benchmark's spec: 2 vCPU, 2 GiB.
    fn default() -> Self {
        MachineConfig {
            vcpus: 2,
            memory_bytes: 2 << 30,
            irqchip: true,
        }
    }
}

/// What runs inside the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GuestKind {
    /// The project's synthetic test guest.
    TestGuest {
        /// What it touches after every start or restore.
        working_set: WorkingSet,
    },
    /// A Linux kernel (and whatever it runs) with virtio devices
    /// ([`crate::linux_vm::LinuxVm`]).
    Linux,
}

/// Everything but memory and disk that a restore needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MachineState {
    /// [`FORMAT_VERSION`] at write time.
    pub format_version: u32,
    /// The VM's shape.
    pub config: MachineConfig,
    /// RAM ranges, in memory-file order.
    pub ram: Vec<RamRange>,
    /// The guest program.
    pub guest: GuestKind,
    /// VM-wide KVM state.
    pub vm: VmState,
    /// Per-vCPU KVM state, by index.
    pub vcpus: Vec<VcpuState>,
    /// The host boot during which the snapshot was written (see
    /// [`cube_storage::durable_marker`]).
    pub boot_id: String,
    /// The virtio devices, in attachment order (window and interrupt follow from the
    /// position). Checked here for shape; each is checked against its device and
    /// guest memory when restored.
    pub devices: Vec<DeviceRecord>,
    /// The COM1 UART's registers, for a guest that has one (Linux).
    pub serial: Option<SerialRecord>,
    /// The seal written after guest memory in the memory file (see
    /// [`cube_mem::memory_seal`]), checked before the file is mapped. None for a
    /// memory file without one (written by a build of [`FORMAT_VERSION_UNSEALED`] or
    /// older; its state keeps None when upgraded and written again), which must then
    /// be guest memory alone.
    pub memory_seal: Option<[u8; 16]>,
}

/// [`MachineState`] as format version 4 wrote it.
#[derive(Deserialize)]
struct MachineStateV4 {
    format_version: u32,
    config: MachineConfig,
    ram: Vec<RamRange>,
    guest: GuestKind,
    vm: VmState,
    vcpus: Vec<VcpuState>,
    boot_id: String,
    devices: Vec<DeviceRecord>,
    serial: Option<SerialRecord>,
}

impl MachineStateV4 {
    /// The state in this build's layout (in memory): a memory file without a seal, as
    /// it was.
    fn upgrade(self) -> MachineState {
        MachineState {
            format_version: FORMAT_VERSION,
            config: self.config,
            ram: self.ram,
            guest: self.guest,
            vm: self.vm,
            vcpus: self.vcpus,
            boot_id: self.boot_id,
            devices: self.devices,
            serial: self.serial,
            memory_seal: None,
        }
    }
}

/// [`MachineState`] as format version 2 wrote it.
#[derive(Deserialize)]
struct MachineStateV2 {
    format_version: u32,
    config: MachineConfig,
    ram: Vec<RamRange>,
    guest: GuestKind,
    vm: VmState,
    vcpus: Vec<VcpuState>,
    boot_id: String,
}

impl MachineState {
    /// Total bytes of RAM, which is also the memory file's size.
    pub fn memory_bytes(&self) -> u64 {
        self.ram.iter().map(|r| r.size).sum()
    }
}

/// Serializes a state (without the envelope).
pub fn encode(state: &MachineState) -> Result<Vec<u8>, FormatError> {
    postcard::to_allocvec(state).map_err(FormatError::Encode)
}

/// Decodes and validates a state (without the envelope).
pub fn decode(bytes: &[u8]) -> Result<MachineState, FormatError> {
    // The version leads the encoding: check it first, so that a file of another
    // version gets a clear answer instead of a decoding error.
    let (found, _) = postcard::take_from_bytes::<u32>(bytes).map_err(FormatError::Decode)?;
    let state = match found {
        FORMAT_VERSION => postcard::from_bytes(bytes).map_err(FormatError::Decode)?,
        FORMAT_VERSION_UNSEALED => {
            let old: MachineStateV4 = postcard::from_bytes(bytes).map_err(FormatError::Decode)?;
            debug_assert_eq!(old.format_version, FORMAT_VERSION_UNSEALED);
            old.upgrade()
        }
        FORMAT_VERSION_NO_DEVICES => {
            let old: MachineStateV2 = postcard::from_bytes(bytes).map_err(FormatError::Decode)?;
            debug_assert_eq!(old.format_version, FORMAT_VERSION_NO_DEVICES);
            // A VM without devices, as it was.
            MachineStateV4 {
                format_version: FORMAT_VERSION_UNSEALED,
                config: old.config,
                ram: old.ram,
                guest: old.guest,
                vm: old.vm,
                vcpus: old.vcpus,
                boot_id: old.boot_id,
                devices: Vec::new(),
                serial: None,
            }
            .upgrade()
        }
        found => return Err(FormatError::Version { found }),
    };
    validate(&state)?;
    Ok(state)
}

/// Decodes a whole state file's bytes: envelope, then state.
pub fn decode_file_bytes(bytes: &[u8]) -> Result<MachineState, FormatError> {
    let payload =
        cube_storage::decode_envelope(bytes, STATE_KIND).map_err(FormatError::Envelope)?;
    decode(payload)
}

fn validate(state: &MachineState) -> Result<(), FormatError> {
    let invalid = |m: String| Err(FormatError::Invalid(m));
    if state.format_version != FORMAT_VERSION {
        return Err(FormatError::Version {
            found: state.format_version,
        });
    }
    if state.boot_id.is_empty() || state.boot_id.len() > 64 {
        return invalid(format!("boot id of {} bytes", state.boot_id.len()));
    }
    let c = &state.config;
    if c.vcpus == 0 || c.vcpus > MAX_VCPUS {
        return invalid(format!("{} vCPUs (1..={MAX_VCPUS} allowed)", c.vcpus));
    }
    if state.vcpus.len() != c.vcpus as usize {
        return invalid(format!(
            "config has {} vCPUs but {} vCPU states are stored",
            c.vcpus,
            state.vcpus.len()
        ));
    }
    let expected = ram_ranges(c.memory_bytes).map_err(|e| FormatError::Invalid(e.to_string()))?;
    if expected != state.ram {
        return invalid("RAM ranges do not match the memory size".to_string());
    }
    match state.guest {
        GuestKind::TestGuest { working_set } => {
            let max = WORKING_SET_MAX_BYTES;
            if working_set.read_bytes > max || working_set.write_bytes > max {
                return invalid("test guest working set too large".to_string());
            }
            if !state.devices.is_empty() || state.serial.is_some() {
                return invalid("the test guest has no virtio devices or serial port".to_string());
            }
        }
        GuestKind::Linux => {
            if !c.irqchip {
                return invalid("a Linux guest needs the in-kernel irqchip".to_string());
            }
        }
    }
    for (i, vcpu) in state.vcpus.iter().enumerate() {
        vcpu.validate()
            .map_err(|e| FormatError::Invalid(format!("vCPU {i}: {e}")))?;
        if vcpu.lapic.is_some() != c.irqchip {
            return invalid(format!(
                "vCPU {i}: LAPIC state does not match irqchip setting"
            ));
        }
    }
    if state.vm.irqchip.is_some() != c.irqchip {
        return invalid("VM irqchip state does not match irqchip setting".to_string());
    }
    state
        .vm
        .validate()
        .map_err(|e| FormatError::Invalid(format!("VM: {e}")))?;
    if let Some(serial) = &state.serial {
        if serial.in_buffer.len() > SERIAL_FIFO_BYTES {
            return invalid(format!(
                "serial receive FIFO holds {} bytes (at most {SERIAL_FIFO_BYTES})",
                serial.in_buffer.len()
            ));
        }
    }
    validate_devices(&state.devices)
}

fn validate_devices(devices: &[DeviceRecord]) -> Result<(), FormatError> {
    let invalid = |m: String| Err(FormatError::Invalid(m));
    if devices.len() > MAX_VIRTIO_DEVICES {
        return invalid(format!(
            "{} virtio devices (at most {MAX_VIRTIO_DEVICES})",
            devices.len()
        ));
    }
    for (i, d) in devices.iter().enumerate() {
        if d.state.device_type != d.kind.device_type() {
            return invalid(format!(
                "virtio device {i} is a {:?} but its state is for device type {}",
                d.kind, d.state.device_type
            ));
        }
        if d.state.queues.len() > 16 {
            return invalid(format!(
                "virtio device {i} has {} queues",
                d.state.queues.len()
            ));
        }
        let saved = &d.state.device_state;
        saved
            .check_header(d.kind, d.kind.state_version())
            .map_err(|e| FormatError::Invalid(format!("virtio device {i}: {e}")))?;
        if saved.bytes.len() > MAX_DEVICE_STATE_BYTES {
            return invalid(format!(
                "virtio device {i} state is {} bytes (at most {MAX_DEVICE_STATE_BYTES})",
                saved.bytes.len()
            ));
        }
    }
    Ok(())
}

/// Writes `state` into `dir`'s state file atomically, to the page cache: the
/// snapshot's background flush makes it durable.
pub fn write_state(dir: &Path, state: &MachineState) -> Result<(), FormatError> {
    let bytes = encode(state)?;
    cube_storage::write_atomic_bytes_with(
        &SnapshotDir::new(dir).state(),
        STATE_KIND,
        &bytes,
        cube_storage::Durability::Deferred,
    )
    .map_err(FormatError::Envelope)
}

/// Reads and validates the state in `dir`, and checks the memory file beside it: its
/// size, and its seal where the state has one (the file is the one written with this
/// state, not another snapshot's).
pub fn read_state(dir: &Path) -> Result<MachineState, FormatError> {
    let snapshot = SnapshotDir::new(dir);
    // No link followed: the snapshot's directory may be a VM supervisor's uid's (see
    // `cube_storage::no_follow`).
    let payload =
        cube_storage::read_verified_bytes_no_follow(&snapshot.state(), STATE_KIND, MAX_STATE_BYTES)
            .map_err(FormatError::Envelope)?;
    let state = decode(&payload)?;
    durable_marker::check_usable(dir, &state.boot_id)?;
    let memory = snapshot.memory();
    if let Some(seal) = state.memory_seal {
        cube_mem::Seal(seal).check(&memory, state.memory_bytes())?;
        return Ok(state);
    }
    let found = std::fs::metadata(&memory)
        .map_err(|e| FormatError::MemoryFileMissing(memory.display().to_string(), e))?
        .len();
    if found != state.memory_bytes() {
        return Err(FormatError::MemoryFileSize {
            path: memory.display().to_string(),
            found,
            expected: state.memory_bytes(),
        });
    }
    Ok(state)
}

#[cfg(test)]
// The tests write and read the state of a real machine: the test guest's.
#[cfg(feature = "test-guest")]
mod tests {
    use super::*;
    use crate::test_guest::machine::Machine;
    use crate::vstate::KvmContext;
    use cube_devices::records::DeviceKind;
    use cube_devices::virtio::rng::Rng;
    use cube_devices::virtio::test_driver::{memory, Driver, Ring};
    use std::sync::Arc;

    /// [`MachineState`] as format version 2 wrote it, to write old files.
    #[derive(Serialize)]
    struct WriteV2<'a> {
        format_version: u32,
        config: &'a MachineConfig,
        ram: &'a Vec<RamRange>,
        guest: &'a GuestKind,
        vm: &'a VmState,
        vcpus: &'a Vec<VcpuState>,
        boot_id: &'a String,
    }

    /// The state of a real (test-guest) machine, or `None` where KVM is missing.
    fn real_state() -> Option<MachineState> {
        let ctx = match KvmContext::open() {
            Ok(c) => Arc::new(c),
            Err(e) => {
                eprintln!("skipping: KVM unavailable: {e}");
                return None;
            }
        };
        let config = MachineConfig {
            vcpus: 1,
            memory_bytes: 128 << 20,
            irqchip: true,
        };
        let mut machine = Machine::boot_test_guest(&ctx, config, WorkingSet::default()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        machine.snapshot(dir.path(), None).unwrap();
        Some(read_state(dir.path()).unwrap())
    }

    fn rng_record() -> DeviceRecord {
        let mem = memory();
        let mut d = Driver::new(Box::new(Rng::new()), &mem);
        d.bring_up(&Ring::new(&mem, 16));
        DeviceRecord {
            kind: DeviceKind::Rng,
            state: d.transport.save().unwrap(),
        }
    }

    #[test]
    fn version_2_files_still_load_as_machines_without_devices() {
        let Some(state) = real_state() else { return };
        assert_eq!(state.format_version, FORMAT_VERSION);
        let old = postcard::to_allocvec(&WriteV2 {
            format_version: FORMAT_VERSION_NO_DEVICES,
            config: &state.config,
            ram: &state.ram,
            guest: &state.guest,
            vm: &state.vm,
            vcpus: &state.vcpus,
            boot_id: &state.boot_id,
        })
        .unwrap();
        let loaded = decode(&old).unwrap();
        assert_eq!(
            loaded,
            MachineState {
                memory_seal: None,
                ..state.clone()
            }
        );
        // Written again, the upgraded state stays unsealed.
        assert_eq!(decode(&encode(&loaded).unwrap()).unwrap(), loaded);
        // Other versions get a clear answer.
        let mut future = encode(&state).unwrap();
        future[0] = 9;
        assert!(matches!(
            decode(&future),
            Err(FormatError::Version { found: 9 })
        ));
        // Version 3 kept device states without kind and version: refused, by name.
        future[0] = 3;
        let err = decode(&future).unwrap_err();
        assert!(matches!(err, FormatError::Version { found: 3 }), "{err}");
        assert!(
            err.to_string().contains("version 3 is not supported"),
            "{err}"
        );
    }

    #[test]
    fn device_records_round_trip_and_malformed_ones_are_refused() {
        let Some(mut state) = real_state() else {
            return;
        };
        state.guest = GuestKind::Linux;
        state.devices = vec![rng_record()];
        state.serial = Some(SerialRecord::default());
        let bytes = encode(&state).unwrap();
        assert_eq!(decode(&bytes).unwrap(), state);

        let refused = |state: &MachineState, what: &str| {
            let err = decode(&encode(state).unwrap()).unwrap_err();
            assert!(err.to_string().contains(what), "{err} lacks {what:?}");
        };
        let mut wrong_kind = state.clone();
        wrong_kind.devices[0].kind = DeviceKind::Block;
        refused(&wrong_kind, "device type 4");
        let mut huge = state.clone();
        huge.devices[0].state.device_state.bytes = vec![0; MAX_DEVICE_STATE_BYTES + 1];
        refused(&huge, "bytes");
        let mut foreign = state.clone();
        foreign.devices[0].state.device_state.kind = DeviceKind::Net;
        refused(&foreign, "is for a virtio-net device");
        let mut future = state.clone();
        future.devices[0].state.device_state.version += 1;
        refused(&future, "is not supported");
        let mut many = state.clone();
        many.devices = vec![rng_record(); MAX_VIRTIO_DEVICES + 1];
        refused(&many, "virtio devices");
        let mut serial = state.clone();
        serial.serial = Some(SerialRecord {
            in_buffer: vec![0; SERIAL_FIFO_BYTES + 1],
            ..Default::default()
        });
        refused(&serial, "FIFO");
        let mut test_guest = state.clone();
        test_guest.guest = GuestKind::TestGuest {
            working_set: WorkingSet::default(),
        };
        refused(&test_guest, "no virtio devices");
        // Truncated device state does not decode at all.
        let cut = &bytes[..bytes.len() - 3];
        assert!(decode(cut).is_err());
    }
}
