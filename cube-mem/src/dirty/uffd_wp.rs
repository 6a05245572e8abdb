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
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::{DirtyBitmap, DirtyError, DirtyTracker, DirtyTrackerKind, UffdError};
use crate::guest_memory::{GuestMemory, MemoryLayout, PAGE_SIZE};

// Definitions from the kernel's uapi headers, which the libc crate lacks:
// include/uapi/linux/userfaultfd.h and include/uapi/linux/fs.h (PAGEMAP_SCAN, 6.7+).

/// `_IOC(dir, type, nr, size)` from include/uapi/asm-generic/ioctl.h.
const fn ioc(dir: u64, ty: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (ty << 8) | nr
}
const IOC_NONE: u64 = 0;
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;

const UFFD_API: u64 = 0xAA;
const UFFDIO: u64 = 0xAA;
const UFFDIO_API: u64 = ioc(IOC_READ | IOC_WRITE, UFFDIO, 0x3F, size_of::<UffdioApi>());
const UFFDIO_REGISTER: u64 = ioc(
    IOC_READ | IOC_WRITE,
    UFFDIO,
    0x00,
    size_of::<UffdioRegister>(),
);
const UFFDIO_UNREGISTER: u64 = ioc(IOC_READ, UFFDIO, 0x01, size_of::<UffdioRange>());
const UFFDIO_WRITEPROTECT: u64 = ioc(
    IOC_READ | IOC_WRITE,
    UFFDIO,
    0x06,
    size_of::<UffdioWriteprotect>(),
);
/// Bit of `_UFFDIO_WRITEPROTECT` in `uffdio_register.ioctls`.
const UFFDIO_WRITEPROTECT_BIT: u64 = 1 << 0x06;
/// `USERFAULTFD_IOC_NEW` on /dev/userfaultfd.
const USERFAULTFD_IOC_NEW: u64 = ioc(IOC_NONE, 0xAA, 0x00, 0);
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;

const PAGEMAP_SCAN: u64 = ioc(
    IOC_READ | IOC_WRITE,
    b'f' as u64,
    16,
    size_of::<PmScanArg>(),
);
const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
const PAGE_IS_WRITTEN: u64 = 1 << 1;

// The numbers the kernel headers produce, checked at compile time.
const _: () = assert!(UFFDIO_API == 0xC018_AA3F);
const _: () = assert!(UFFDIO_REGISTER == 0xC020_AA00);
const _: () = assert!(UFFDIO_UNREGISTER == 0x8010_AA01);
const _: () = assert!(UFFDIO_WRITEPROTECT == 0xC018_AA06);
const _: () = assert!(USERFAULTFD_IOC_NEW == 0xAA00);
const _: () = assert!(PAGEMAP_SCAN == 0xC060_6610);

/// `struct uffdio_api`.
#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// `struct uffdio_range`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

/// `struct uffdio_register`.
#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

/// `struct uffdio_writeprotect`.
#[repr(C)]
#[derive(Default)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

/// `struct page_region` (include/uapi/linux/fs.h).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// `struct pm_scan_arg` (include/uapi/linux/fs.h).
#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

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
        let supported = api(&open_uffd()?, 0)?;
        if supported & UFFD_FEATURE_WP_ASYNC == 0 {
            return Err(UffdError::MissingFeatures { supported });
        }
        let wanted = UFFD_FEATURE_WP_ASYNC
            | (supported & (UFFD_FEATURE_WP_UNPOPULATED | UFFD_FEATURE_WP_HUGETLBFS_SHMEM));
        let uffd = open_uffd()?;
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
        for (index, region) in mem.regions().iter().enumerate() {
            let mut reg = UffdioRegister {
                range: UffdioRange {
                    start: region.host_addr,
                    len: region.size as u64,
                },
                mode: UFFDIO_REGISTER_MODE_WP,
                ioctls: 0,
            };
            // SAFETY: `reg` is a properly laid out `struct uffdio_register` that lives
            // across the call; the kernel only writes its `ioctls` field.
            let rc = unsafe { libc::ioctl(tracker.uffd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) };
            if rc < 0 {
                // Drop unregisters whatever was registered so far.
                return Err(UffdError::Register {
                    region: index,
                    source: std::io::Error::last_os_error(),
                });
            }
            if reg.ioctls & UFFDIO_WRITEPROTECT_BIT == 0 {
                return Err(UffdError::NoWriteProtect { region: index });
            }
        }
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
        for region in self.mem.regions() {
            let mut range = UffdioRange {
                start: region.host_addr,
                len: region.size as u64,
            };
            // SAFETY: `range` is a valid `struct uffdio_range` that outlives the call;
            // unregistering a range that was never registered is a harmless error.
            unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_UNREGISTER, &mut range) };
        }
    }
}

/// Opens a userfaultfd that may also handle faults the kernel takes on the guest's
/// behalf (KVM), falling back to /dev/userfaultfd and then user-mode-only.
fn open_uffd() -> Result<OwnedFd, UffdError> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    let from_raw = |fd: libc::c_long| -> Result<OwnedFd, std::io::Error> {
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = i32::try_from(fd).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
        // SAFETY: `fd` is a fresh descriptor just returned by the kernel; we own it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    };
    // SAFETY: userfaultfd takes only a flags integer.
    let first = from_raw(unsafe { libc::syscall(libc::SYS_userfaultfd, flags) });
    if let Ok(fd) = first {
        return Ok(fd);
    }
    if let Ok(dev) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")
    {
        // SAFETY: USERFAULTFD_IOC_NEW takes the new descriptor's flags by value.
        let fd = unsafe { libc::ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW, flags) };
        if let Ok(fd) = from_raw(fd.into()) {
            return Ok(fd);
        }
    }
    // Asynchronous write-protect never delivers a fault to user space, so a
    // user-mode-only descriptor still tracks writes the kernel makes (KVM).
    // SAFETY: userfaultfd takes only a flags integer.
    from_raw(unsafe { libc::syscall(libc::SYS_userfaultfd, flags | UFFD_USER_MODE_ONLY) })
        .map_err(UffdError::Open)
}

/// `UFFDIO_API` handshake enabling `features`; returns every feature the kernel
/// supports. A descriptor accepts only one handshake.
fn api(uffd: &OwnedFd, features: u64) -> Result<u64, UffdError> {
    let mut api = UffdioApi {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    // SAFETY: `api` is a valid `struct uffdio_api` that outlives the call.
    let rc = unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_API, &mut api) };
    if rc < 0 {
        return Err(UffdError::Api(std::io::Error::last_os_error()));
    }
    Ok(api.features)
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
