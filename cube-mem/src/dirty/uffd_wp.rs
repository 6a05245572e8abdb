//! userfaultfd asynchronous write-protect + `PAGEMAP_SCAN`: a soft-dirty replacement
//! that works without `CONFIG_MEM_SOFT_DIRTY` (Linux 6.7+).
//!
//! Every region is registered for write-protect faults on a userfaultfd created with
//! `UFFD_FEATURE_WP_ASYNC`, so the kernel resolves a write to a protected page by itself
//! (no fault-handling thread) and merely clears the page's write-protect bit. `start`
//! protects everything; `collect` runs `PAGEMAP_SCAN` with `PM_SCAN_WP_MATCHING`, which
//! reports the pages whose bit is clear (`PAGE_IS_WRITTEN`) and protects them again in
//! the same page-table walk, so a write is seen either by this collect or the next. It
//! sees every write to the mapping: guest writes through KVM (which faults the page in
//! through the same page tables), VMM writes, anything in this process.

use std::fs::File;
use std::mem::size_of;
use std::os::fd::{AsRawFd, OwnedFd};

use super::{DirtyBitmap, DirtyError, DirtyTracker, DirtyTrackerKind, UffdError};
use crate::guest_memory::{GuestMemory, MemoryLayout, PAGE_SIZE};

use crate::uffd_sys::*;

/// Ranges fetched per `PAGEMAP_SCAN` call; more ranges just take more calls.
const SCAN_VEC_LEN: usize = 1024;

/// Dirty tracking through asynchronous userfaultfd write-protect and `PAGEMAP_SCAN`.
///
/// Holds a clone of the memory so the registered ranges stay mapped; dropping the
/// tracker unregisters them.
#[derive(Debug)]
pub struct UffdWriteProtect {
    uffd: OwnedFd,
    pagemap: File,
    mem: GuestMemory,
    carry: DirtyBitmap,
    /// Reused `PAGEMAP_SCAN` output buffer.
    scan_out: Vec<PageRegion>,
    features: u64,
}

impl UffdWriteProtect {
    /// Creates a userfaultfd in asynchronous write-protect mode and registers every
    /// region of `mem` on it. Tracking begins with [`DirtyTracker::start`].
    pub fn new(mem: &GuestMemory) -> Result<Self, UffdError> {
        let supported = api(&open_uffd(true)?, 0)?;
        if supported & UFFD_FEATURE_WP_ASYNC == 0 {
            return Err(UffdError::MissingFeatures { supported });
        }
        let wanted = UFFD_FEATURE_WP_ASYNC
            | (supported & (UFFD_FEATURE_WP_UNPOPULATED | UFFD_FEATURE_WP_HUGETLBFS_SHMEM));
        let uffd = open_uffd(true)?;
        // The reply lists everything the kernel supports; `wanted` is what is enabled.
        api(&uffd, wanted)?;
        let pagemap = File::open("/proc/self/pagemap").map_err(UffdError::OpenPagemap)?;
        let tracker = Self {
            uffd,
            pagemap,
            carry: DirtyBitmap::for_memory(mem),
            mem: mem.clone(),
            scan_out: vec![PageRegion::default(); SCAN_VEC_LEN],
            features: wanted,
        };
        register_wp(&tracker.uffd, mem)?;
        Ok(tracker)
    }

    /// The userfaultfd feature bits asked for (the kernel adds `WP_UNPOPULATED` to
    /// `WP_ASYNC` by itself).
    pub fn features(&self) -> u64 {
        self.features
    }

    /// Whether asynchronous write-protect + `PAGEMAP_SCAN` finds exactly one written page
    /// of a scratch memfd mapping.
    pub fn probe() -> bool {
        let Ok(layout) = MemoryLayout::new(&[(vm_memory::GuestAddress(0), 4 * PAGE_SIZE)]) else {
            return false;
        };
        let Ok(mem) = GuestMemory::anonymous(layout) else {
            return false;
        };
        let Ok(mut tracker) = Self::new(&mem) else {
            return false;
        };
        if tracker.start().is_err() {
            return false;
        }
        let host = mem.regions()[0].host_addr as *mut u8;
        // SAFETY: offset 2 pages is inside the live 4-page scratch mapping, which
        // nothing else references.
        unsafe { host.add(2 * PAGE_SIZE).write_volatile(1) };
        let first = tracker.collect();
        let second = tracker.collect();
        matches!((first, second), (Ok(a), Ok(b))
            if a.runs().map(|r| (r.first_page, r.pages)).eq([(2, 1)]) && b.is_empty())
    }

    /// Scans region `index`, adding its written pages to `carry` and re-protecting them.
    fn scan_region(&mut self, index: usize) -> Result<(), UffdError> {
        let Some(region) = self.mem.regions().get(index).copied() else {
            return Err(UffdError::BadScanResult { region: index });
        };
        let end = region.host_addr + region.size as u64;
        let vec = &mut self.scan_out;
        let mut start = region.host_addr;
        while start < end {
            let mut arg = PmScanArg {
                size: size_of::<PmScanArg>() as u64,
                flags: PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
                start,
                end,
                vec: vec.as_mut_ptr() as u64,
                vec_len: vec.len() as u64,
                category_mask: PAGE_IS_WRITTEN,
                return_mask: PAGE_IS_WRITTEN,
                ..Default::default()
            };
            // SAFETY: `arg` is a valid `struct pm_scan_arg` whose `vec` points at
            // `vec_len` writable `struct page_region`s; both outlive the call, and the
            // scanned range is our own registered mapping.
            let n = unsafe { libc::ioctl(self.pagemap.as_raw_fd(), PAGEMAP_SCAN, &mut arg) };
            if n < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(UffdError::Scan {
                    region: index,
                    source: err,
                });
            }
            let found = vec
                .get(..n as usize)
                .ok_or(UffdError::BadScanResult { region: index })?;
            for r in found {
                if r.start < region.host_addr || r.end > end || r.start >= r.end {
                    return Err(UffdError::BadScanResult { region: index });
                }
                let first = ((r.start - region.host_addr) / PAGE_SIZE as u64) as usize;
                let pages = ((r.end - r.start) / PAGE_SIZE as u64) as usize;
                self.carry
                    .set_range(index, first, pages)
                    .map_err(|_| UffdError::BadScanResult { region: index })?;
            }
            if arg.walk_end <= start || arg.walk_end > end {
                return Err(UffdError::BadScanResult { region: index });
            }
            start = arg.walk_end;
        }
        Ok(())
    }
}

impl DirtyTracker for UffdWriteProtect {
    fn kind(&self) -> DirtyTrackerKind {
        DirtyTrackerKind::UffdWriteProtect
    }

    fn start(&mut self) -> Result<(), DirtyError> {
        for (index, region) in self.mem.regions().iter().enumerate() {
            let mut wp = UffdioWriteprotect {
                range: UffdioRange {
                    start: region.host_addr,
                    len: region.size as u64,
                },
                mode: UFFDIO_WRITEPROTECT_MODE_WP,
            };
            // SAFETY: `wp` is a valid `struct uffdio_writeprotect` for a range registered
            // on this userfaultfd; it outlives the call.
            let rc = unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut wp) };
            if rc < 0 {
                return Err(UffdError::WriteProtect {
                    region: index,
                    source: std::io::Error::last_os_error(),
                }
                .into());
            }
        }
        self.carry.clear();
        Ok(())
    }

    fn collect(&mut self) -> Result<DirtyBitmap, DirtyError> {
        for index in 0..self.mem.regions().len() {
            self.scan_region(index)?;
        }
        let out = self.carry.clone();
        self.carry.clear();
        Ok(out)
    }
}

impl Drop for UffdWriteProtect {
    fn drop(&mut self) {
        unregister_all(&self.uffd, &self.mem);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvm_ioctls::Kvm;
    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::dirty::{register_slots, test_guest};

    fn supported() -> bool {
        let ok = UffdWriteProtect::probe();
        if !ok {
            println!("skipped: kernel lacks userfaultfd async write-protect + PAGEMAP_SCAN");
        }
        ok
    }

    fn poke(mem: &GuestMemory, region: usize, offset: usize) {
        let info = mem.regions()[region];
        assert!(offset < info.size);
        // SAFETY: `offset` is inside the region's live mapping.
        unsafe { (info.host_addr as *mut u8).add(offset).write_volatile(0xee) };
    }

    fn peek(mem: &GuestMemory, region: usize, offset: usize) -> u8 {
        let info = mem.regions()[region];
        assert!(offset < info.size);
        // SAFETY: `offset` is inside the region's live mapping.
        unsafe { (info.host_addr as *const u8).add(offset).read_volatile() }
    }

    fn exercise(mem: &GuestMemory) {
        let mut tracker = UffdWriteProtect::new(mem).unwrap();
        assert_eq!(tracker.kind(), DirtyTrackerKind::UffdWriteProtect);
        // Populate some pages before tracking starts: they must not be reported.
        poke(mem, 0, 9 * PAGE_SIZE);
        peek(mem, 0, 10 * PAGE_SIZE);
        tracker.start().unwrap();
        assert!(tracker.collect().unwrap().is_empty());

        poke(mem, 0, 0);
        poke(mem, 0, 7 * PAGE_SIZE + 5);
        poke(mem, 0, 8 * PAGE_SIZE);
        poke(mem, 0, 9 * PAGE_SIZE + 100);
        poke(mem, 0, mem.regions()[0].size - 1);
        poke(mem, 1, 3 * PAGE_SIZE);
        // Reads, of populated and unpopulated pages, are not writes.
        peek(mem, 0, 10 * PAGE_SIZE);
        peek(mem, 0, 20 * PAGE_SIZE);
        peek(mem, 1, 0);
        // Writes through vm-memory go through the same mapping.
        let r1 = mem.regions()[1].guest_addr;
        mem.inner()
            .write_slice(&[1; 2], GuestAddress(r1.0 + 10 * PAGE_SIZE as u64 - 1))
            .unwrap();

        let last = mem.regions()[0].pages() - 1;
        let dirty = tracker.collect().unwrap();
        let expected = [
            (0, 0),
            (0, 7),
            (0, 8),
            (0, 9),
            (0, last),
            (1, 3),
            (1, 9),
            (1, 10),
        ];
        assert_eq!(dirty.iter().collect::<Vec<_>>(), expected);
        assert!(tracker.collect().unwrap().is_empty());

        poke(mem, 0, 7 * PAGE_SIZE);
        assert!(tracker.collect().unwrap().iter().eq([(0, 7)]));
        // start forgets what was written before it.
        poke(mem, 1, 0);
        tracker.start().unwrap();
        assert!(tracker.collect().unwrap().is_empty());
    }

    fn layout() -> MemoryLayout {
        MemoryLayout::new(&[
            (GuestAddress(0), 1 << 20),
            (GuestAddress(1 << 32), 64 * PAGE_SIZE),
        ])
        .unwrap()
    }

    #[test]
    fn tracks_anonymous_memory() {
        if !supported() {
            return;
        }
        exercise(&GuestMemory::anonymous(layout()).unwrap());
    }

    #[test]
    fn tracks_restored_memory() {
        if !supported() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mem");
        let content: Vec<u8> = (0..layout().total_size())
            .map(|i| (i / 4096) as u8)
            .collect();
        std::fs::write(&path, &content).unwrap();
        let mem = GuestMemory::restore_private(layout(), &path).unwrap();
        exercise(&mem);
        assert_eq!(peek(&mem, 0, 20 * PAGE_SIZE), 20);
        assert_eq!(std::fs::read(&path).unwrap(), content);
    }

    #[test]
    fn tracks_guest_writes_through_kvm() {
        if !supported() || !test_guest::kvm_present() {
            return;
        }
        let mem = GuestMemory::anonymous(test_guest::layout()).unwrap();
        test_guest::load(&mem);
        let mut tracker = UffdWriteProtect::new(&mem).unwrap();
        tracker.start().unwrap();
        let vm = Arc::new(Kvm::new().unwrap().create_vm().unwrap());
        // SAFETY: `mem` is declared before `vm`, so it outlives the VM.
        unsafe { register_slots(&vm, &mem, false) }.unwrap();
        test_guest::run(&vm);
        test_guest::check_stores(&mem);
        assert!(tracker.collect().unwrap().iter().eq(test_guest::WRITTEN));
    }
}
