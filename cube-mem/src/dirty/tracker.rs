//! What a dirty-page tracker is: a mechanism ([`DirtyTrackerKind`]) that reports the
//! pages written since it last looked ([`DirtyTracker`]).

use super::bitmap::DirtyBitmap;
use super::error::DirtyError;

/// Which mechanism a tracker uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DirtyTrackerKind {
    /// `KVM_GET_DIRTY_LOG` on dirty-logging memslots.
    KvmDirtyLog,
    /// `/proc/self/clear_refs` + pagemap soft-dirty bit.
    SoftDirty,
    /// userfaultfd asynchronous write-protect + `PAGEMAP_SCAN`.
    UffdWriteProtect,
    /// vm-memory's record of the VMM's own writes.
    VmmWriteLog,
}

/// Something that can tell which pages of guest memory were written.
pub trait DirtyTracker {
    /// The mechanism in use.
    fn kind(&self) -> DirtyTrackerKind;

    /// Begins tracking: pages written before this call are forgotten.
    fn start(&mut self) -> Result<(), DirtyError>;

    /// Pages written since [`DirtyTracker::start`] or the previous successful collect;
    /// resets the record. If it fails, whatever was already gathered is kept and
    /// returned by the next successful collect, so no write is lost.
    fn collect(&mut self) -> Result<DirtyBitmap, DirtyError>;
}
