//! Dirty-page tracking: which 4 KiB pages of guest memory changed since a point in time.
//!
//! A [`DirtyTracker`] reports pages written since [`DirtyTracker::start`] or its last
//! [`DirtyTracker::collect`] as a [`DirtyBitmap`]. Backends, each in its own module:
//! - [`KvmDirtyLog`]: `KVM_GET_DIRTY_LOG` on memslots registered with dirty logging;
//!   sees guest writes only.
//! - [`SoftDirty`]: `/proc/self/clear_refs` + pagemap bit 55; needs
//!   `CONFIG_MEM_SOFT_DIRTY`.
//! - [`UffdWriteProtect`]: userfaultfd asynchronous write-protect + `PAGEMAP_SCAN`; sees
//!   every write to the mapping (guest through KVM, VMM, anyone in the process).
//! - [`VmmWriteLog`]: the vm-memory bitmaps that record the VMM's own writes made through
//!   the `Bytes` API.
//!
//! [`CombinedTracker`] ORs a primary backend with the VMM write log so that neither kind
//! of write is lost. [`probe`] says which backends work on this host by trying each.

mod bitmap;
mod combined;
mod error;
mod kvm_log;
mod scratch_page;
mod soft_dirty;
#[cfg(test)]
mod test_guest;
mod tracker;
mod uffd_wp;
mod vmm_log;

pub use bitmap::{DirtyBitmap, DirtyRun, DirtyRuns};
pub use combined::CombinedTracker;
pub use error::{DirtyError, KvmDirtyLogError, SoftDirtyError, UffdError};
pub use kvm_log::{register_slots, KvmDirtyLog};
pub use soft_dirty::SoftDirty;
pub use tracker::{DirtyTracker, DirtyTrackerKind};
pub use uffd_wp::UffdWriteProtect;
pub use vmm_log::VmmWriteLog;

/// Which tracking mechanisms work on this host, each found by trying it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TrackerSupport {
    /// A memslot with `KVM_MEM_LOG_DIRTY_PAGES` accepts `KVM_GET_DIRTY_LOG`.
    pub kvm_dirty_log: bool,
    /// A VM accepts `KVM_ENABLE_CAP(KVM_CAP_DIRTY_LOG_RING)`.
    pub kvm_dirty_ring: bool,
    /// The pagemap soft-dirty bit follows writes after a `clear_refs` of 4.
    pub soft_dirty: bool,
    /// Asynchronous userfaultfd write-protect with `PAGEMAP_SCAN` finds a written page.
    pub uffd_wp: bool,
}

/// Tries each tracking mechanism on a scratch page or VM and reports what works.
pub fn probe() -> TrackerSupport {
    let kvm = kvm_log::probe();
    TrackerSupport {
        kvm_dirty_log: kvm.dirty_log,
        kvm_dirty_ring: kvm.dirty_ring,
        soft_dirty: SoftDirty::probe(),
        uffd_wp: UffdWriteProtect::probe(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest_memory::GuestMemory;

    #[test]
    fn probe_agrees_with_the_trackers() {
        let started = std::time::Instant::now();
        let support = probe();
        println!("probe: {support:?} in {:?}", started.elapsed());
        let layout = crate::MemoryLayout::new(&[(vm_memory::GuestAddress(0), 0x10000)]).unwrap();
        let mem = GuestMemory::anonymous(layout).unwrap();
        assert_eq!(support.uffd_wp, UffdWriteProtect::new(&mem).is_ok());
        assert_eq!(
            support.soft_dirty,
            !matches!(SoftDirty::new(&mem), Err(SoftDirtyError::Unsupported))
        );
        if !std::path::Path::new("/dev/kvm").exists() {
            assert!(!support.kvm_dirty_log && !support.kvm_dirty_ring);
        }
        assert!(support.kvm_dirty_log || !support.kvm_dirty_ring);
    }
}
