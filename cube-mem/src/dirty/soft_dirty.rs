//! Soft-dirty bits: writing `4` to `/proc/self/clear_refs` write-protects every page of
//! the process and clears its soft-dirty bit; the next write faults and sets bit 55 of
//! the page's `/proc/self/pagemap` entry. Needs `CONFIG_MEM_SOFT_DIRTY`.
//!
//! Two properties shape the API:
//! - The bits are per process, and clearing is process-wide, so only one [`SoftDirty`]
//!   may exist per process (a second one would clear the first one's record).
//! - Reading the bits and clearing them are two steps: a write landing between them is
//!   lost. [`DirtyTracker::collect`] must run while nothing writes guest memory (vCPUs
//!   stopped, device emulation quiet), as it does when taking a snapshot.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};

use super::scratch_page::ScratchPage;
use super::{DirtyBitmap, DirtyError, DirtyTracker, DirtyTrackerKind, SoftDirtyError};
use crate::guest_memory::{GuestMemory, PAGE_SIZE};

/// Bit of a pagemap entry that is set when the page was written since the last clear
/// (Documentation/admin-guide/mm/pagemap.rst).
const PM_SOFT_DIRTY: u64 = 1 << 55;
/// The `clear_refs` value that clears soft-dirty bits.
const CLEAR_SOFT_DIRTY: &[u8] = b"4";
/// Pagemap entries read per `pread`.
const ENTRIES_PER_READ: usize = 16 * 1024;

/// Set while a [`SoftDirty`] tracker (or the probe) owns the process's soft-dirty bits.
static IN_USE: AtomicBool = AtomicBool::new(false);

/// Owns the process-wide soft-dirty state while alive.
#[derive(Debug)]
struct Claim;

impl Claim {
    fn take() -> Option<Self> {
        IN_USE
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| Claim)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        IN_USE.store(false, Ordering::Release);
    }
}

/// The /proc files soft-dirty tracking works through.
#[derive(Debug)]
struct ProcFiles {
    clear_refs: File,
    pagemap: File,
}

impl ProcFiles {
    fn open() -> Result<Self, SoftDirtyError> {
        let clear_refs = OpenOptions::new()
            .write(true)
            .open("/proc/self/clear_refs")
            .map_err(|source| SoftDirtyError::Open {
                path: "/proc/self/clear_refs",
                source,
            })?;
        let pagemap = File::open("/proc/self/pagemap").map_err(|source| SoftDirtyError::Open {
            path: "/proc/self/pagemap",
            source,
        })?;
        Ok(Self {
            clear_refs,
            pagemap,
        })
    }

    fn clear(&mut self) -> Result<(), SoftDirtyError> {
        self.clear_refs
            .write_all(CLEAR_SOFT_DIRTY)
            .map_err(SoftDirtyError::Clear)
    }

    /// Calls `on_dirty(page)` for each soft-dirty page of the `pages` pages at `host`.
    fn scan(
        &self,
        host: u64,
        pages: usize,
        mut on_dirty: impl FnMut(usize),
    ) -> std::io::Result<()> {
        let mut buf = vec![0u8; ENTRIES_PER_READ.min(pages) * 8];
        let mut page = 0;
        while page < pages {
            let n = ENTRIES_PER_READ.min(pages - page);
            let chunk = &mut buf[..n * 8];
            let offset = (host / PAGE_SIZE as u64 + page as u64) * 8;
            self.pagemap.read_exact_at(chunk, offset)?;
            for (i, entry) in chunk.chunks_exact(8).enumerate() {
                let mut bytes = [0u8; 8];
                bytes.copy_from_slice(entry);
                if u64::from_ne_bytes(bytes) & PM_SOFT_DIRTY != 0 {
                    on_dirty(page + i);
                }
            }
            page += n;
        }
        Ok(())
    }
}

/// Dirty tracking through the process's soft-dirty bits. One per process.
#[derive(Debug)]
pub struct SoftDirty {
    files: ProcFiles,
    mem: GuestMemory,
    _claim: Claim,
}

impl SoftDirty {
    /// A soft-dirty tracker over `mem`. Fails if the kernel lacks soft-dirty support or
    /// another tracker exists in this process.
    pub fn new(mem: &GuestMemory) -> Result<Self, SoftDirtyError> {
        let claim = Claim::take().ok_or(SoftDirtyError::InUse)?;
        let mut files = ProcFiles::open()?;
        if !works(&mut files) {
            return Err(SoftDirtyError::Unsupported);
        }
        Ok(Self {
            files,
            mem: mem.clone(),
            _claim: claim,
        })
    }

    /// Whether the soft-dirty bit follows writes on this kernel: clear, check a page is
    /// clean, write it, check it is dirty. True without testing if a tracker is active
    /// (it could only have been created after a successful test, and testing would
    /// clear its record).
    pub fn probe() -> bool {
        let Some(_claim) = Claim::take() else {
            return true;
        };
        ProcFiles::open().is_ok_and(|mut files| works(&mut files))
    }
}

/// The clear / clean / write / dirty test on one scratch page.
fn works(files: &mut ProcFiles) -> bool {
    let Ok(page) = ScratchPage::new() else {
        return false;
    };
    page.write(1);
    let dirty = |files: &ProcFiles| {
        let mut seen = false;
        files
            .scan(page.addr() as u64, 1, |_| seen = true)
            .map(|()| seen)
    };
    if files.clear().is_err() || !matches!(dirty(files), Ok(false)) {
        return false;
    }
    page.write(2);
    matches!(dirty(files), Ok(true))
}

impl DirtyTracker for SoftDirty {
    fn kind(&self) -> DirtyTrackerKind {
        DirtyTrackerKind::SoftDirty
    }

    fn start(&mut self) -> Result<(), DirtyError> {
        Ok(self.files.clear()?)
    }

    fn collect(&mut self) -> Result<DirtyBitmap, DirtyError> {
        let mut out = DirtyBitmap::for_memory(&self.mem);
        for (index, region) in self.mem.regions().iter().enumerate() {
            let mut result = Ok(());
            self.files
                .scan(region.host_addr, region.pages(), |page| {
                    if let Err(e) = out.set(index, page) {
                        result = Err(e);
                    }
                })
                .map_err(|source| SoftDirtyError::ReadPagemap {
                    region: index,
                    source,
                })?;
            result?;
        }
        // Clearing only after every region was read means a failed collect loses
        // nothing: the bits are still set for the next one.
        self.files.clear()?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::GuestAddress;

    use super::*;
    use crate::guest_memory::MemoryLayout;

    fn poke(mem: &GuestMemory, region: usize, offset: usize) {
        let info = mem.regions()[region];
        assert!(offset < info.size);
        // SAFETY: `offset` is inside the region's live mapping.
        unsafe { (info.host_addr as *mut u8).add(offset).write_volatile(0xee) };
    }

    #[test]
    fn finds_exactly_the_written_pages() {
        let layout = MemoryLayout::new(&[
            (GuestAddress(0), 256 * PAGE_SIZE),
            (GuestAddress(1 << 32), 16 * PAGE_SIZE),
        ])
        .unwrap();
        let mem = GuestMemory::anonymous(layout).unwrap();
        if !SoftDirty::probe() {
            // Detection must agree with construction.
            assert!(matches!(
                SoftDirty::new(&mem),
                Err(SoftDirtyError::Unsupported | SoftDirtyError::InUse)
            ));
            println!("skipped: kernel lacks CONFIG_MEM_SOFT_DIRTY");
            return;
        }
        let mut tracker = SoftDirty::new(&mem).unwrap();
        assert!(matches!(SoftDirty::new(&mem), Err(SoftDirtyError::InUse)));
        poke(&mem, 0, 0);
        tracker.start().unwrap();
        assert!(tracker.collect().unwrap().is_empty());
        poke(&mem, 0, 3 * PAGE_SIZE);
        poke(&mem, 0, 200 * PAGE_SIZE + 7);
        poke(&mem, 1, 15 * PAGE_SIZE);
        let dirty = tracker.collect().unwrap();
        assert!(dirty.iter().eq([(0, 3), (0, 200), (1, 15)]));
        assert!(tracker.collect().unwrap().is_empty());
    }
}
