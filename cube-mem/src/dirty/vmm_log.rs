//! The VMM's own writes: vm-memory marks a region's `AtomicBitmap` on every write made
//! through its `Bytes` API (device emulation, loaders), which KVM's dirty log never sees.

use vm_memory::MmapRegion;

use super::{DirtyBitmap, DirtyError, DirtyTracker, DirtyTrackerKind};
use crate::guest_memory::GuestMemory;

/// Reads and resets the per-region vm-memory write bitmaps of a [`GuestMemory`].
///
/// Holds a clone of the memory, so the mappings outlive the tracker.
#[derive(Debug)]
pub struct VmmWriteLog {
    mem: GuestMemory,
}

impl VmmWriteLog {
    /// A write log over `mem`'s regions. Writes made before [`DirtyTracker::start`]
    /// are reported by the first collect unless start is called.
    pub fn new(mem: &GuestMemory) -> Self {
        Self { mem: mem.clone() }
    }

    fn regions(&self) -> impl Iterator<Item = &MmapRegion<vm_memory::bitmap::AtomicBitmap>> {
        (0..self.mem.regions().len())
            .filter_map(|i| self.mem.vm_region(i))
            .map(|r| &**r)
    }
}

impl DirtyTracker for VmmWriteLog {
    fn kind(&self) -> DirtyTrackerKind {
        DirtyTrackerKind::VmmWriteLog
    }

    fn start(&mut self) -> Result<(), DirtyError> {
        for region in self.regions() {
            region.bitmap().reset();
        }
        Ok(())
    }

    fn collect(&mut self) -> Result<DirtyBitmap, DirtyError> {
        let mut out = DirtyBitmap::for_memory(&self.mem);
        // get_and_reset swaps each word atomically, so a concurrent write lands either
        // in this collect or the next, never nowhere.
        let words: Vec<Vec<u64>> = self.regions().map(|r| r.bitmap().get_and_reset()).collect();
        let mut result = Ok(());
        for (index, words) in words.iter().enumerate() {
            if let Err(e) = out.or_words(index, words) {
                result = Err(e);
            }
        }
        result.map(|()| out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest_memory::MemoryLayout;
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn records_bytes_api_writes_only() {
        let layout =
            MemoryLayout::new(&[(GuestAddress(0), 0x10000), (GuestAddress(0x100000), 0x8000)])
                .unwrap();
        let mem = GuestMemory::anonymous(layout).unwrap();
        mem.inner().write_slice(&[1], GuestAddress(0x3000)).unwrap();
        let mut log = VmmWriteLog::new(&mem);
        log.start().unwrap();
        assert!(log.collect().unwrap().is_empty());

        mem.inner()
            .write_slice(&[1; 0x1002], GuestAddress(0x2fff))
            .unwrap();
        mem.inner().write_obj(7u64, GuestAddress(0x107000)).unwrap();
        // A raw host write bypasses vm-memory and is not recorded here.
        let host = mem.regions()[0].host_addr as *mut u8;
        // SAFETY: offset 0x9000 is inside region 0's live 0x10000-byte mapping.
        unsafe { host.add(0x9000).write_volatile(5) };

        let dirty = log.collect().unwrap();
        assert_eq!(dirty.pages(0).collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(dirty.pages(1).collect::<Vec<_>>(), vec![7]);
        assert!(log.collect().unwrap().is_empty());
        assert_eq!(log.kind(), DirtyTrackerKind::VmmWriteLog);
    }
}
