//! Copying a set of guest pages into a memory file while the guest runs on: a live
//! snapshot's memory.
//!
//! With the vCPUs stopped, [`LiveCopy::protect`] write-protects the pages to copy
//! through a userfaultfd in synchronous write-protect mode; the vCPUs then continue.
//! [`LiveCopy::copy_into`] writes the pages into the file run by run, lifting each
//! page's protection once it is written, and between runs serves the write faults the
//! guest took meanwhile: a page the guest writes is copied first, then let go. So the
//! file holds every page as it was when the vCPUs stopped, and a vCPU waits only for
//! the one page it touches. Guest writes made through KVM fault the same way as the
//! VMM's own (the kernel resolves KVM's accesses through these page tables).
//!
//! Needs a userfaultfd that handles faults the kernel takes (not user-mode-only: KVM's
//! are kernel faults) and write-protect on the memory's kind of mapping: fresh (memfd)
//! memory has it, memory restored from a file (a private file mapping) does not. Where
//! it is missing, or another userfaultfd holds the memory (the write-protect dirty
//! tracker), [`LiveCopy::protect`] fails and the caller copies with the guest stopped.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};

use crate::dirty::{DirtyBitmap, UffdError};
use crate::guest_memory::{GuestMemory, MemoryBacking, PAGE_SIZE};
use crate::pwrite::pwrite_all;
use crate::uffd_sys::{
    api, open_uffd, register_wp, unregister_all, UffdioRange, UffdioWriteprotect,
    UFFDIO_WRITEPROTECT, UFFDIO_WRITEPROTECT_MODE_WP, UFFD_EVENT_PAGEFAULT,
    UFFD_FEATURE_WP_HUGETLBFS_SHMEM, UFFD_FEATURE_WP_UNPOPULATED, UFFD_MSG_SIZE,
};

/// Pages written between two looks at the guest's faults: a vCPU that writes a
/// protected page waits at most this long for its copy.
const CHUNK_PAGES: usize = 16;

/// Fault messages read at once.
const MSGS_PER_READ: usize = 64;

/// Why a live copy failed.
#[derive(Debug, thiserror::Error)]
pub enum LiveCopyError {
    /// No userfaultfd that handles the kernel's faults could be set up.
    #[error("Synchronous userfaultfd write-protect")]
    Uffd(#[from] UffdError),
    /// The kernel cannot write-protect this memory's mapping.
    #[error("Kernel cannot write-protect guest memory (features {supported:#x})")]
    Unsupported {
        /// The feature bits the kernel offers.
        supported: u64,
    },
    /// Guest memory is a private mapping of a memory file (restored from a
    /// snapshot): the kernel write-protects only anonymous and shared memory
    /// synchronously (registering it fails with EINVAL).
    #[error("Guest memory restored from a file cannot be write-protected synchronously")]
    FileBacked,
    /// The dirty bitmap was made for a different memory layout.
    #[error("Dirty bitmap does not match the guest memory layout")]
    Shape,
    /// Protecting or releasing a range failed.
    #[error("Write-protecting {len} bytes at {start:#x}")]
    Protect {
        /// The range's host address.
        start: u64,
        /// Its length.
        len: u64,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// Reading the guest's write faults failed.
    #[error("Reading write faults")]
    Read(#[source] std::io::Error),
    /// Writing a page into the memory file failed.
    #[error("Writing guest memory at file offset {offset}")]
    Write {
        /// Where in the file.
        offset: u64,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
}

/// Guest pages write-protected for a copy into a memory file (see the module docs).
/// Dropping it lifts every protection left and unregisters the memory, so a failed
/// copy never leaves a vCPU waiting.
#[derive(Debug)]
pub struct LiveCopy {
    uffd: OwnedFd,
    mem: GuestMemory,
    /// The pages to copy; a page leaves it once copied.
    pending: DirtyBitmap,
}

impl LiveCopy {
    /// Whether `mem` can be write-protected at all: memory in a memfd (a fresh boot),
    /// not memory restored from a file (see [`LiveCopyError::FileBacked`]).
    pub fn applies_to(mem: &GuestMemory) -> bool {
        matches!(mem.backing(), MemoryBacking::Memfd(_))
    }

    /// Write-protects the pages of `mem` in `dirty`. Call with every vCPU stopped and no
    /// device writing guest memory: from here on, a write to one of those pages waits
    /// until [`LiveCopy::copy_into`] has copied it.
    pub fn protect(mem: &GuestMemory, dirty: &DirtyBitmap) -> Result<LiveCopy, LiveCopyError> {
        if dirty.region_count() != mem.regions().len()
            || mem
                .regions()
                .iter()
                .enumerate()
                .any(|(i, r)| dirty.region_pages(i) != Some(r.pages()))
        {
            return Err(LiveCopyError::Shape);
        }
        if !Self::applies_to(mem) {
            return Err(LiveCopyError::FileBacked);
        }
        // KVM's accesses are kernel faults: a user-mode-only descriptor would let them
        // through unseen.
        let supported = api(&open_uffd(false)?, 0)?;
        let needed = UFFD_FEATURE_WP_HUGETLBFS_SHMEM | UFFD_FEATURE_WP_UNPOPULATED;
        if supported & needed != needed {
            return Err(LiveCopyError::Unsupported { supported });
        }
        let uffd = open_uffd(false)?;
        api(&uffd, needed)?;
        let copy = LiveCopy {
            uffd,
            mem: mem.clone(),
            pending: dirty.clone(),
        };
        register_wp(&copy.uffd, mem)?;
        for run in dirty.runs() {
            let (start, len) = copy.host_range(run.region, run.first_page, run.pages)?;
            copy.write_protect(start, len, true)?;
        }
        Ok(copy)
    }

    /// Copies every protected page into `file` (at the offsets of the memory file
    /// layout), the pages the guest writes first, and lifts their protection.
    /// Returns the bytes written.
    pub fn copy_into(mut self, file: &File) -> Result<u64, LiveCopyError> {
        let runs: Vec<(usize, usize, usize)> = self
            .pending
            .runs()
            .map(|r| (r.region, r.first_page, r.pages))
            .collect();
        let mut written = 0u64;
        for (region, first, pages) in runs {
            let mut page = first;
            while page < first + pages {
                self.serve_faults(file, &mut written)?;
                let end = (page + CHUNK_PAGES).min(first + pages);
                // Pages a fault copied already are skipped: written again now, they
                // could hold what the guest wrote after their copy.
                let mut at = page;
                while at < end {
                    if !self.pending.get(region, at) {
                        at += 1;
                        continue;
                    }
                    let mut stop = at;
                    while stop < end && self.pending.get(region, stop) {
                        stop += 1;
                    }
                    written += self.copy_pages(file, region, at, stop - at)?;
                    at = stop;
                }
                page = end;
            }
        }
        // Faults taken on pages just released are resolved already; read them off.
        self.serve_faults(file, &mut written)?;
        Ok(written)
    }

    /// Copies the faulting pages the guest waits on, and lets it go on.
    fn serve_faults(&mut self, file: &File, written: &mut u64) -> Result<(), LiveCopyError> {
        let mut buf = [0u8; UFFD_MSG_SIZE * MSGS_PER_READ];
        loop {
            // SAFETY: reads at most `buf.len()` bytes into `buf`, which outlives the
            // call; the descriptor is non-blocking.
            let n =
                unsafe { libc::read(self.uffd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                let err = std::io::Error::last_os_error();
                match err.kind() {
                    std::io::ErrorKind::WouldBlock => return Ok(()),
                    std::io::ErrorKind::Interrupted => continue,
                    _ => return Err(LiveCopyError::Read(err)),
                }
            }
            let n = n as usize;
            if n == 0 {
                return Ok(());
            }
            for msg in buf[..n].chunks_exact(UFFD_MSG_SIZE) {
                if msg[0] != UFFD_EVENT_PAGEFAULT {
                    continue;
                }
                let mut address = [0u8; 8];
                address.copy_from_slice(&msg[16..24]);
                let address = u64::from_ne_bytes(address) & !(PAGE_SIZE as u64 - 1);
                match self.locate(address) {
                    Some((region, page)) if self.pending.get(region, page) => {
                        *written += self.copy_pages(file, region, page, 1)?;
                    }
                    // Copied already (the fault raced the bulk copy): only wake it.
                    _ => self.write_protect(address, PAGE_SIZE as u64, false)?,
                }
            }
            if n < buf.len() {
                return Ok(());
            }
        }
    }

    /// Writes `pages` pages of `region` from `first` into `file`, then lifts their
    /// protection (which wakes a vCPU waiting on one of them).
    fn copy_pages(
        &mut self,
        file: &File,
        region: usize,
        first: usize,
        pages: usize,
    ) -> Result<u64, LiveCopyError> {
        let (start, len) = self.host_range(region, first, pages)?;
        let info = self.mem.regions().get(region).ok_or(LiveCopyError::Shape)?;
        let host = self.mem.host_ptr(region).ok_or(LiveCopyError::Shape)?;
        let offset = first * PAGE_SIZE;
        // SAFETY: `host_range` checked that the pages fit the region, so the source lies
        // inside its live mapping; they are write-protected, so nothing changes them
        // during the copy.
        let src = unsafe { host.add(offset) };
        pwrite_all(file, src, len as usize, info.file_offset + offset as u64)
            .map_err(|(offset, source)| LiveCopyError::Write { offset, source })?;
        for page in first..first + pages {
            self.pending.clear_page(region, page);
        }
        self.write_protect(start, len, false)?;
        Ok(len)
    }

    /// The region and page of host address `address`, if it is guest memory.
    fn locate(&self, address: u64) -> Option<(usize, usize)> {
        self.mem.regions().iter().enumerate().find_map(|(i, r)| {
            (address >= r.host_addr && address < r.host_addr + r.size as u64)
                .then(|| (i, ((address - r.host_addr) as usize) / PAGE_SIZE))
        })
    }

    /// The host address range of `pages` pages of `region` from `first`.
    fn host_range(
        &self,
        region: usize,
        first: usize,
        pages: usize,
    ) -> Result<(u64, u64), LiveCopyError> {
        let info = self.mem.regions().get(region).ok_or(LiveCopyError::Shape)?;
        if (first + pages) * PAGE_SIZE > info.size {
            return Err(LiveCopyError::Shape);
        }
        Ok((
            info.host_addr + (first * PAGE_SIZE) as u64,
            (pages * PAGE_SIZE) as u64,
        ))
    }

    /// Sets (`protect`) or lifts write-protection of a registered range; lifting it
    /// wakes whoever waits on a page in it.
    fn write_protect(&self, start: u64, len: u64, protect: bool) -> Result<(), LiveCopyError> {
        let mut wp = UffdioWriteprotect {
            range: UffdioRange { start, len },
            mode: if protect {
                UFFDIO_WRITEPROTECT_MODE_WP
            } else {
                0
            },
        };
        // SAFETY: `wp` is a valid `struct uffdio_writeprotect` that outlives the call,
        // for a range inside memory registered on this descriptor.
        let rc = unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut wp) };
        if rc < 0 {
            return Err(LiveCopyError::Protect {
                start,
                len,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

impl Drop for LiveCopy {
    fn drop(&mut self) {
        // Whatever is still protected (a copy that failed) is let go first, so no vCPU
        // stays blocked; then the memory leaves the descriptor.
        for region in self.mem.regions() {
            let _ = self.write_protect(region.host_addr, region.size as u64, false);
        }
        unregister_all(&self.uffd, &self.mem);
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use vm_memory::GuestAddress;

    use super::*;
    use crate::guest_memory::MemoryLayout;

    /// A thread of this process writes every protected page while the copy runs; the
    /// file holds each page as it was when it was protected, and the writer's bytes
    /// land in memory once their page was copied.
    #[test]
    fn writes_during_the_copy_wait_for_their_page_and_the_file_keeps_the_old_bytes() {
        let layout = MemoryLayout::new(&[(GuestAddress(0), 4 << 20)]).unwrap();
        let mem = GuestMemory::anonymous(layout).unwrap();
        let info = mem.regions()[0];
        let pages = info.size / PAGE_SIZE;
        let host = info.host_addr as usize;
        for page in 0..pages {
            // SAFETY: inside the live 4 MiB mapping, which only this test uses.
            unsafe { ((host + page * PAGE_SIZE) as *mut u64).write_volatile(page as u64) };
        }
        let mut dirty = DirtyBitmap::for_memory(&mem);
        dirty.set_range(0, 0, pages).unwrap();
        let copy = match LiveCopy::protect(&mem, &dirty) {
            Ok(copy) => copy,
            Err(e) => {
                println!("skipped: no synchronous userfaultfd write-protect here: {e}");
                return;
            }
        };
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("memory"))
            .unwrap();
        file.set_len(info.size as u64).unwrap();
        let writer = std::thread::spawn(move || {
            // From the last page down, against the copy's direction: most of these
            // writes hit pages not copied yet and must wait for them.
            for page in (0..pages).rev() {
                // SAFETY: as above; a write to a protected page blocks until the copy
                // lifts its protection.
                unsafe {
                    ((host + page * PAGE_SIZE) as *mut u64)
                        .write_volatile(0xdead_0000 + page as u64)
                };
            }
        });
        let written = copy.copy_into(&file).unwrap();
        writer.join().unwrap();
        assert_eq!(written, info.size as u64);
        for page in 0..pages {
            let mut word = [0u8; 8];
            file.read_exact_at(&mut word, (page * PAGE_SIZE) as u64)
                .unwrap();
            assert_eq!(
                u64::from_ne_bytes(word),
                page as u64,
                "page {page} in the file"
            );
            // SAFETY: as above; the copy is over, nothing is protected.
            let now = unsafe { ((host + page * PAGE_SIZE) as *const u64).read_volatile() };
            assert_eq!(now, 0xdead_0000 + page as u64, "page {page} in memory");
        }
    }

    /// Memory restored from a file is refused up front, before any userfaultfd is
    /// made (the kernel would refuse to register it).
    #[test]
    fn memory_restored_from_a_file_is_refused_by_kind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        let size = 4 << 20;
        std::fs::File::create(&path).unwrap().set_len(size).unwrap();
        let layout = MemoryLayout::new(&[(GuestAddress(0), size as usize)]).unwrap();
        let mem = GuestMemory::restore_private(layout, &path).unwrap();
        let dirty = DirtyBitmap::for_memory(&mem);
        assert!(matches!(
            LiveCopy::protect(&mem, &dirty),
            Err(LiveCopyError::FileBacked)
        ));
    }
}
