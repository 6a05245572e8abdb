//! KVM's dirty log: memslots registered with `KVM_MEM_LOG_DIRTY_PAGES` record every page
//! the guest writes, read and cleared atomically per slot by `KVM_GET_DIRTY_LOG`. It does
//! not see writes the VMM makes through its own mapping (pair it with the VMM write log),
//! and under shadow paging KVM also marks the guest page-table pages it touches.

use std::sync::Arc;

use kvm_bindings::{kvm_enable_cap, kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::{Cap, Kvm, VmFd};

use super::scratch_page::ScratchPage;
use super::{DirtyBitmap, DirtyError, DirtyTracker, DirtyTrackerKind, KvmDirtyLogError};
use crate::guest_memory::{GuestMemory, PAGE_SIZE};

/// Registers every region of `mem` as a KVM memslot (slot number = region index),
/// with `KVM_MEM_LOG_DIRTY_PAGES` when `log_dirty`. Registering again with a different
/// `log_dirty` switches logging on or off in place.
///
/// # Safety
///
/// The guest reads and writes these host ranges for as long as the slots exist, so
/// `mem` (or a clone of it) must stay alive until the VM is closed or the slots are
/// deleted.
pub unsafe fn register_slots(
    vm: &VmFd,
    mem: &GuestMemory,
    log_dirty: bool,
) -> Result<(), KvmDirtyLogError> {
    for region in mem.regions() {
        let slot = kvm_userspace_memory_region {
            slot: region.slot,
            flags: if log_dirty {
                KVM_MEM_LOG_DIRTY_PAGES
            } else {
                0
            },
            guest_phys_addr: region.guest_addr.0,
            memory_size: region.size as u64,
            userspace_addr: region.host_addr,
        };
        // SAFETY: the host range is a live mapping of `memory_size` bytes owned by `mem`;
        // the caller keeps it alive while the VM may use the slot.
        unsafe { vm.set_user_memory_region(slot) }.map_err(|source| {
            KvmDirtyLogError::SetMemoryRegion {
                slot: region.slot,
                source,
            }
        })?;
    }
    Ok(())
}

/// Dirty tracking through `KVM_GET_DIRTY_LOG` on the memslots [`register_slots`]
/// created with logging on.
#[derive(Debug)]
pub struct KvmDirtyLog {
    vm: Arc<VmFd>,
    mem: GuestMemory,
    carry: DirtyBitmap,
}

impl KvmDirtyLog {
    /// A tracker for `mem`'s regions, registered in `vm` as slots 0.. with dirty logging.
    pub fn new(vm: Arc<VmFd>, mem: &GuestMemory) -> Self {
        Self {
            vm,
            carry: DirtyBitmap::for_memory(mem),
            mem: mem.clone(),
        }
    }

    /// Reads (and thereby clears) every slot's log into `self.carry`.
    fn drain(&mut self) -> Result<(), KvmDirtyLogError> {
        for (index, region) in self.mem.regions().iter().enumerate() {
            let words = self
                .vm
                .get_dirty_log(region.slot, region.size)
                .map_err(|source| KvmDirtyLogError::GetDirtyLog {
                    slot: region.slot,
                    source,
                })?;
            // The word count matches by construction (one bit per page of the slot).
            if self.carry.or_words(index, &words).is_err() {
                tracing::warn!(slot = region.slot, "KVM dirty log has an unexpected size");
                self.carry.set_range(index, 0, region.pages()).ok();
            }
        }
        Ok(())
    }
}

impl DirtyTracker for KvmDirtyLog {
    fn kind(&self) -> DirtyTrackerKind {
        DirtyTrackerKind::KvmDirtyLog
    }

    fn start(&mut self) -> Result<(), DirtyError> {
        self.drain()?;
        self.carry.clear();
        Ok(())
    }

    fn collect(&mut self) -> Result<DirtyBitmap, DirtyError> {
        self.drain()?;
        let out = self.carry.clone();
        self.carry.clear();
        Ok(out)
    }
}

/// What [`probe`] found.
pub(crate) struct KvmProbe {
    pub dirty_log: bool,
    pub dirty_ring: bool,
}

/// Creates a scratch VM with a one-page dirty-logging memslot, reads its log, then tries
/// to enable the dirty ring on it.
pub(crate) fn probe() -> KvmProbe {
    let none = KvmProbe {
        dirty_log: false,
        dirty_ring: false,
    };
    // Declared before `vm` so the page is unmapped only after the VM is closed.
    let Ok(page) = ScratchPage::new() else {
        return none;
    };
    let Ok(kvm) = Kvm::new() else {
        return none;
    };
    let Ok(vm) = kvm.create_vm() else {
        return none;
    };
    let slot = kvm_userspace_memory_region {
        slot: 0,
        flags: KVM_MEM_LOG_DIRTY_PAGES,
        guest_phys_addr: 0,
        memory_size: PAGE_SIZE as u64,
        userspace_addr: page.addr() as u64,
    };
    // SAFETY: the page is a live mapping of PAGE_SIZE bytes that outlives `vm`.
    let dirty_log = unsafe { vm.set_user_memory_region(slot) }.is_ok()
        && vm.get_dirty_log(0, PAGE_SIZE).is_ok();
    let max_ring = vm.check_extension_int(Cap::DirtyLogRing);
    let dirty_ring = max_ring > 0 && {
        // 16-byte entries; the smallest valid ring is one page.
        let size = (64 * 1024).min(max_ring as u64);
        let mut cap = kvm_enable_cap {
            cap: kvm_bindings::KVM_CAP_DIRTY_LOG_RING,
            ..Default::default()
        };
        cap.args[0] = size;
        vm.enable_cap(&cap).is_ok()
    };
    KvmProbe {
        dirty_log,
        dirty_ring,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dirty::test_guest;

    #[test]
    fn dirty_log_has_exactly_the_guest_writes() {
        if !test_guest::kvm_present() {
            return;
        }
        let mem = GuestMemory::anonymous(test_guest::layout()).unwrap();
        test_guest::load(&mem);
        let vm = Arc::new(Kvm::new().unwrap().create_vm().unwrap());
        // SAFETY: `mem` is declared before `vm` and the tracker holds a clone of it, so
        // the mappings outlive the VM.
        unsafe { register_slots(&vm, &mem, true) }.unwrap();
        let mut tracker = KvmDirtyLog::new(Arc::clone(&vm), &mem);
        tracker.start().unwrap();
        assert_eq!(tracker.kind(), DirtyTrackerKind::KvmDirtyLog);

        test_guest::run(&vm);
        test_guest::check_stores(&mem);
        let dirty = tracker.collect().unwrap();
        assert!(dirty.iter().eq(test_guest::WRITTEN));
        assert!(tracker.collect().unwrap().is_empty());
    }

    #[test]
    fn get_dirty_log_fails_without_logging() {
        if !test_guest::kvm_present() {
            return;
        }
        let mem = GuestMemory::anonymous(test_guest::layout()).unwrap();
        let vm = Arc::new(Kvm::new().unwrap().create_vm().unwrap());
        // SAFETY: as above.
        unsafe { register_slots(&vm, &mem, false) }.unwrap();
        let mut tracker = KvmDirtyLog::new(vm, &mem);
        assert!(matches!(
            tracker.collect(),
            Err(DirtyError::KvmDirtyLog(KvmDirtyLogError::GetDirtyLog {
                slot: 0,
                ..
            }))
        ));
    }
}
