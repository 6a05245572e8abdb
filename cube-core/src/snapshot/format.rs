//! The on-disk snapshot: a directory holding the memory file, a checksummed state file
//! and (when the sandbox has one) its root filesystem image.
//!
//! Every byte of the state file is untrusted: the checksummed envelope catches
//! truncation and bit rot, and [`decode`] then checks every field against the limits
//! the VMM can honour before anything reaches KVM.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::test_guest::WorkingSet;
use crate::vmm::layout::{ram_ranges, RamRange};
use crate::vstate::vcpu::VcpuState;
use crate::vstate::vm::VmState;

/// The memory file inside a snapshot directory.
pub const MEMORY_FILE: &str = "memory.bin";
/// The state file inside a snapshot directory.
pub const STATE_FILE: &str = "state.bin";
/// The root filesystem image inside a snapshot directory, when the sandbox has one.
pub const ROOTFS_FILE: &str = "rootfs.img";
/// Envelope kind of the state file.
pub const STATE_KIND: &str = "cube-vm-state";
/// Version of the state layout this build writes and reads.
pub const FORMAT_VERSION: u32 = 2;
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
    Durability(#[from] super::durability::DurabilityError),
    /// The memory file cannot be inspected.
    #[error("Snapshot memory file {0} is missing")]
    MemoryFileMissing(String, #[source] std::io::Error),
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
    /// [`super::durability`]).
    pub boot_id: String,
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
    if found != FORMAT_VERSION {
        return Err(FormatError::Version { found });
    }
    let state: MachineState = postcard::from_bytes(bytes).map_err(FormatError::Decode)?;
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
    let GuestKind::TestGuest { working_set } = state.guest;
    let max = crate::test_guest::mailbox::WORKING_SET_MAX_BYTES;
    if working_set.read_bytes > max || working_set.write_bytes > max {
        return invalid("test guest working set too large".to_string());
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
    Ok(())
}

/// Writes `state` into `dir`'s state file atomically, to the page cache: the
/// snapshot's background flush makes it durable.
pub fn write_state(dir: &Path, state: &MachineState) -> Result<(), FormatError> {
    let bytes = encode(state)?;
    cube_storage::write_atomic_bytes_with(
        &dir.join(STATE_FILE),
        STATE_KIND,
        &bytes,
        cube_storage::Durability::Deferred,
    )
    .map_err(FormatError::Envelope)
}

/// Reads and validates the state in `dir`, and checks the memory file beside it.
pub fn read_state(dir: &Path) -> Result<MachineState, FormatError> {
    let payload =
        cube_storage::read_verified_bytes(&dir.join(STATE_FILE), STATE_KIND, MAX_STATE_BYTES)
            .map_err(FormatError::Envelope)?;
    let state = decode(&payload)?;
    super::durability::check_usable(dir, &state.boot_id)?;
    let memory = dir.join(MEMORY_FILE);
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
