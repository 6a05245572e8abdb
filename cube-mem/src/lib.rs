//! Guest memory for Cube's microVMs.
//!
//! - [`GuestMemory`]: guest RAM as a vm-memory [`GuestMemoryMmap`](vm_memory::GuestMemoryMmap)
//!   with a per-region [`AtomicBitmap`](vm_memory::bitmap::AtomicBitmap) recording the
//!   VMM's own writes; fresh (memfd) or restored from a memory file `MAP_PRIVATE`.
//! - [`dirty`]: which pages changed, through KVM's dirty log, soft-dirty bits,
//!   userfaultfd write-protect, and the VMM write log, and [`probe`] to find out which
//!   of them work on this host.
//! - [`memory_file`]: writing guest memory to a memory file, whole or as a reflinked copy
//!   of the parent file plus the dirty pages, with the guest stopped or (through
//!   [`live_copy`]) running on, sealed ([`memory_seal`]) to the snapshot state written
//!   with it.

// Tests may unwrap (CONTRIBUTING.md); library code may not.

pub mod dirty;
pub mod guest_memory;
pub mod live_copy;
pub mod memory_file;
pub mod memory_seal;
mod pwrite;
mod uffd_sys;

pub use dirty::{
    probe, register_slots, CombinedTracker, DirtyBitmap, DirtyError, DirtyRun, DirtyRuns,
    DirtyTracker, DirtyTrackerKind, KvmDirtyLog, KvmDirtyLogError, SoftDirty, SoftDirtyError,
    TrackerSupport, UffdError, UffdWriteProtect, VmmWriteLog,
};
pub use guest_memory::{
    GuestMemory, LayoutRegion, MemoryBacking, MemoryError, MemoryLayout, RegionInfo, PAGE_SIZE,
};
pub use memory_file::{
    prepare_diff, write_diff, write_full, DiffStats, LiveDiff, MemoryFileError, PreparedDiff,
    WriteStats,
};
pub use memory_seal::{Seal, SealError, SEAL_BYTES};
