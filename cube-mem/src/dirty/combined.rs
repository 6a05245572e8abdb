//! A primary tracker (which sees guest writes) joined with the VMM write log (which sees
//! the VMM's own writes), so a snapshot gets both.

use super::{DirtyBitmap, DirtyError, DirtyTracker, DirtyTrackerKind, VmmWriteLog};
use crate::guest_memory::GuestMemory;

/// ORs a primary backend with a [`VmmWriteLog`]. If either half fails during a collect,
/// what the other half already gathered is kept for the next collect.
pub struct CombinedTracker {
    primary: Box<dyn DirtyTracker + Send>,
    vmm: VmmWriteLog,
    carry: DirtyBitmap,
}

impl std::fmt::Debug for CombinedTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CombinedTracker")
            .field("primary", &self.primary.kind())
            .field("carry_pages", &self.carry.count())
            .finish()
    }
}

impl CombinedTracker {
    /// Joins `primary` (tracking `mem`) with a VMM write log over `mem`.
    pub fn new(primary: Box<dyn DirtyTracker + Send>, mem: &GuestMemory) -> Self {
        Self {
            primary,
            vmm: VmmWriteLog::new(mem),
            carry: DirtyBitmap::for_memory(mem),
        }
    }

    /// The primary backend.
    pub fn primary(&self) -> &(dyn DirtyTracker + Send) {
        self.primary.as_ref()
    }
}

impl DirtyTracker for CombinedTracker {
    /// The primary backend's kind.
    fn kind(&self) -> DirtyTrackerKind {
        self.primary.kind()
    }

    fn start(&mut self) -> Result<(), DirtyError> {
        self.carry.clear();
        self.vmm.start()?;
        self.primary.start()
    }

    fn collect(&mut self) -> Result<DirtyBitmap, DirtyError> {
        let vmm = self.vmm.collect()?;
        self.carry.or(&vmm)?;
        let primary = self.primary.collect()?;
        self.carry.or(&primary)?;
        let out = self.carry.clone();
        self.carry.clear();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvm_ioctls::Kvm;
    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::dirty::{register_slots, test_guest, KvmDirtyLog};

    #[test]
    fn joins_guest_and_vmm_writes_and_loses_nothing_on_error() {
        if !test_guest::kvm_present() {
            return;
        }
        let mem = GuestMemory::anonymous(test_guest::layout()).unwrap();
        test_guest::load(&mem);
        let vm = Arc::new(Kvm::new().unwrap().create_vm().unwrap());
        // Logging off: the primary's collect fails until it is switched on.
        // SAFETY: `mem` is declared before `vm`, so it outlives the VM.
        unsafe { register_slots(&vm, &mem, false) }.unwrap();
        let kvm_log = KvmDirtyLog::new(Arc::clone(&vm), &mem);
        let mut tracker = CombinedTracker::new(Box::new(kvm_log), &mem);
        assert_eq!(tracker.kind(), DirtyTrackerKind::KvmDirtyLog);
        assert!(tracker.start().is_err());

        // A device write: KVM's log never sees it.
        mem.inner()
            .write_obj(0xabu8, GuestAddress(0x19000))
            .unwrap();
        assert!(tracker.collect().is_err());

        // SAFETY: as above.
        unsafe { register_slots(&vm, &mem, true) }.unwrap();
        test_guest::run(&vm);
        let dirty = tracker.collect().unwrap();
        let mut expected = test_guest::WRITTEN.to_vec();
        expected.push((1, 9));
        assert_eq!(dirty.iter().collect::<Vec<_>>(), expected);
        assert!(tracker.collect().unwrap().is_empty());
    }
}
