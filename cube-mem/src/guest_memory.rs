//! Guest RAM: a validated [`MemoryLayout`] mapped into this process as a vm-memory
//! [`GuestMemoryMmap`] whose per-region [`AtomicBitmap`] records every write the VMM
//! itself makes through vm-memory's `Bytes` API (device emulation), so those writes can
//! reach a snapshot even when the primary dirty tracker cannot see them.
//!
//! Two ways to get guest RAM:
//! - [`GuestMemory::anonymous`]: zero-filled, backed by one memfd mapped `MAP_SHARED`
//!   with the regions at consecutive file offsets, so it can be written to a file later.
//! - [`GuestMemory::restore_private`]: a memory file mapped `MAP_PRIVATE | MAP_NORESERVE`.
//!   O(1) in the guest size; every sandbox restored from one file shares its pages through
//!   the page cache, and guest writes become private copy-on-write pages.

use std::ffi::CString;
use std::fs::File;
use std::num::NonZeroUsize;
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vm_memory::bitmap::AtomicBitmap;

use crate::memory_seal::SEAL_BYTES;

// The seal page keeps a memory file a whole number of pages.
const _: () = assert!(SEAL_BYTES == PAGE_SIZE as u64);
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap, VolatileSlice,
};

/// Size of the pages that layouts are aligned to and that dirty tracking counts in.
pub const PAGE_SIZE: usize = 4096;

/// Errors from building a layout or mapping guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// Mapping a memory file over a region in place failed.
    #[error("Remapping region {index} in place failed")]
    Remap {
        /// The region.
        index: usize,
        /// The mmap error.
        #[source]
        source: std::io::Error,
    },
    /// The layout has no regions.
    #[error("Memory layout has no regions")]
    EmptyLayout,
    /// A region has size zero.
    #[error("Region {index} has size zero")]
    EmptyRegion {
        /// Index of the region in the layout.
        index: usize,
    },
    /// A region's guest address or size is not a multiple of [`PAGE_SIZE`].
    #[error("Region {index} (guest address {guest_addr:#x}, size {size:#x}) is not page aligned")]
    Unaligned {
        /// Index of the region in the layout.
        index: usize,
        /// Guest physical address of the region.
        guest_addr: u64,
        /// Size of the region in bytes.
        size: usize,
    },
    /// A region ends past the top of the 64-bit guest address space.
    #[error("Region {index} overflows the guest address space")]
    AddressOverflow {
        /// Index of the region in the layout.
        index: usize,
    },
    /// A region starts below the end of the region before it (regions must be sorted
    /// by guest address and must not overlap).
    #[error("Region {index} overlaps or precedes region {}", index - 1)]
    Overlap {
        /// Index of the offending region in the layout.
        index: usize,
    },
    /// The sum of the region sizes does not fit in a file offset.
    #[error("Total memory size overflows")]
    TotalOverflow,
    /// The host page size is not [`PAGE_SIZE`].
    #[error("Host page size is {0}, only 4096 is supported")]
    HostPageSize(usize),
    /// Creating the memfd failed.
    #[error("Failed to create memfd")]
    Memfd(#[source] std::io::Error),
    /// Sizing the memfd failed.
    #[error("Failed to size memfd to {size} bytes")]
    Truncate {
        /// The size asked for.
        size: u64,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// The memory file could not be opened or inspected.
    #[error("Failed to open memory file {}", path.display())]
    OpenFile {
        /// The memory file.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// The memory file is not a regular file.
    #[error("Memory file {} is not a regular file", path.display())]
    NotRegularFile {
        /// The memory file.
        path: PathBuf,
    },
    /// The memory file's size differs from the layout's total size.
    #[error("Memory file {} is {actual} bytes, the layout needs {expected}", path.display())]
    SizeMismatch {
        /// The memory file.
        path: PathBuf,
        /// Total size of the layout.
        expected: u64,
        /// Size of the file.
        actual: u64,
    },
    /// mmap of a region failed.
    #[error("Failed to map region {index}")]
    Mmap {
        /// Index of the region in the layout.
        index: usize,
        /// What vm-memory said.
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    /// vm-memory refused the set of regions.
    #[error("Failed to assemble guest memory")]
    Collection(#[source] vm_memory::GuestRegionCollectionError),
    /// A region index past the end of the layout was asked for.
    #[error("No region {index}: memory has {count}")]
    NoSuchRegion {
        /// The index asked for.
        index: usize,
        /// How many regions there are.
        count: usize,
    },
    /// vm-memory refused to hand out a region's slice.
    #[error("Failed to slice region {index}")]
    Slice {
        /// Index of the region.
        index: usize,
        /// What vm-memory said.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

/// One region of guest physical memory as the caller asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutRegion {
    /// Guest physical address of the first byte.
    pub guest_addr: GuestAddress,
    /// Size in bytes.
    pub size: usize,
}

/// The guest's physical memory map: regions sorted by guest address, page aligned,
/// non-overlapping. Region `i` lives at file offset `sum(size of regions 0..i)` in a
/// memory file, so the file is exactly [`MemoryLayout::total_size`] bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryLayout {
    regions: Vec<LayoutRegion>,
    total: u64,
}

impl MemoryLayout {
    /// Validates `(guest address, size)` pairs: at least one, each non-empty and page
    /// aligned, sorted by guest address, non-overlapping, no overflow.
    pub fn new(regions: &[(GuestAddress, usize)]) -> Result<Self, MemoryError> {
        if regions.is_empty() {
            return Err(MemoryError::EmptyLayout);
        }
        let mut total: u64 = 0;
        let mut prev_end: Option<u64> = None;
        for (index, &(guest_addr, size)) in regions.iter().enumerate() {
            if size == 0 {
                return Err(MemoryError::EmptyRegion { index });
            }
            if guest_addr.0 % PAGE_SIZE as u64 != 0 || size % PAGE_SIZE != 0 {
                return Err(MemoryError::Unaligned {
                    index,
                    guest_addr: guest_addr.0,
                    size,
                });
            }
            let end = guest_addr
                .0
                .checked_add(size as u64)
                .ok_or(MemoryError::AddressOverflow { index })?;
            if prev_end.is_some_and(|prev| guest_addr.0 < prev) {
                return Err(MemoryError::Overlap { index });
            }
            prev_end = Some(end);
            total = total
                .checked_add(size as u64)
                .filter(|t| i64::try_from(*t).is_ok())
                .ok_or(MemoryError::TotalOverflow)?;
        }
        Ok(Self {
            regions: regions
                .iter()
                .map(|&(guest_addr, size)| LayoutRegion { guest_addr, size })
                .collect(),
            total,
        })
    }

    /// The regions in guest address order.
    pub fn regions(&self) -> &[LayoutRegion] {
        &self.regions
    }

    /// Sum of the region sizes: the size of a memory file for this layout.
    pub fn total_size(&self) -> u64 {
        self.total
    }

    /// File offset of each region, in order.
    fn file_offsets(&self) -> impl Iterator<Item = u64> + '_ {
        self.regions.iter().scan(0u64, |offset, region| {
            let this = *offset;
            *offset += region.size as u64;
            Some(this)
        })
    }
}

/// What the guest memory is mapped from.
#[derive(Debug, Clone)]
pub enum MemoryBacking {
    /// A zero-filled memfd mapped `MAP_SHARED`; writes land in the memfd.
    Memfd(Arc<File>),
    /// A memory file mapped `MAP_PRIVATE`; writes stay in this process, the file is
    /// never modified.
    PrivateFile {
        /// Where the file was opened from.
        path: PathBuf,
        /// The open file (kept open so the mapping's source is pinned).
        file: Arc<File>,
    },
}

impl MemoryBacking {
    /// The open backing file (memfd or memory file).
    pub fn file(&self) -> &Arc<File> {
        match self {
            MemoryBacking::Memfd(file) => file,
            MemoryBacking::PrivateFile { file, .. } => file,
        }
    }
}

/// Where one region lives, for KVM and for the dirty trackers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// Index of the region in the layout; also its KVM memory slot number.
    pub slot: u32,
    /// Guest physical address of the first byte.
    pub guest_addr: GuestAddress,
    /// Size in bytes.
    pub size: usize,
    /// Address of the first byte in this process (`userspace_addr` for KVM).
    pub host_addr: u64,
    /// Offset of the region in the backing file / memory file.
    pub file_offset: u64,
}

impl RegionInfo {
    /// Number of [`PAGE_SIZE`] pages in the region.
    pub fn pages(&self) -> usize {
        self.size / PAGE_SIZE
    }
}

/// Guest RAM mapped into this process. Cloning is cheap and shares the mappings; they
/// are unmapped when the last clone (including clones held by dirty trackers) drops.
#[derive(Debug, Clone)]
pub struct GuestMemory {
    mem: GuestMemoryMmap<AtomicBitmap>,
    layout: MemoryLayout,
    regions: Vec<RegionInfo>,
    backing: MemoryBacking,
}

impl GuestMemory {
    /// Zero-filled guest RAM backed by one memfd (`MAP_SHARED`), regions at consecutive
    /// offsets of the memfd.
    pub fn anonymous(layout: MemoryLayout) -> Result<Self, MemoryError> {
        check_host_page_size()?;
        let file = Arc::new(create_memfd("cube-guest-ram")?);
        file.set_len(layout.total_size())
            .map_err(|source| MemoryError::Truncate {
                size: layout.total_size(),
                source,
            })?;
        let flags = libc::MAP_SHARED | libc::MAP_NORESERVE;
        Self::map(layout, MemoryBacking::Memfd(file), flags)
    }

    /// Maps `memory_file` `MAP_PRIVATE | MAP_NORESERVE`: nothing is read up front, pages
    /// are shared through the page cache with every other mapping of the file, and the
    /// guest's writes become private copies. The file's size must equal the layout's
    /// total size, or that and a seal page ([`crate::memory_seal`]). The file must not be truncated while mapped (accesses would fault).
    pub fn restore_private(layout: MemoryLayout, memory_file: &Path) -> Result<Self, MemoryError> {
        check_host_page_size()?;
        let file = open_memory_file(memory_file, layout.total_size())?;
        let backing = MemoryBacking::PrivateFile {
            path: memory_file.to_path_buf(),
            file: Arc::new(file),
        };
        let flags = libc::MAP_PRIVATE | libc::MAP_NORESERVE;
        Self::map(layout, backing, flags)
    }

    fn map(layout: MemoryLayout, backing: MemoryBacking, flags: i32) -> Result<Self, MemoryError> {
        let mut mapped = Vec::with_capacity(layout.regions().len());
        let mut regions = Vec::with_capacity(layout.regions().len());
        for (index, (region, file_offset)) in layout
            .regions()
            .iter()
            .zip(layout.file_offsets())
            .enumerate()
        {
            let bitmap = AtomicBitmap::new(region.size, page_size_nonzero());
            let mapping = MmapRegionBuilder::new_with_bitmap(region.size, bitmap)
                .with_file_offset(FileOffset::from_arc(
                    Arc::clone(backing.file()),
                    file_offset,
                ))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(flags)
                .build()
                .map_err(|source| MemoryError::Mmap { index, source })?;
            let host_addr = mapping.as_ptr() as u64;
            let guest_region = GuestRegionMmap::new(mapping, region.guest_addr)
                .ok_or(MemoryError::AddressOverflow { index })?;
            regions.push(RegionInfo {
                slot: u32::try_from(index).map_err(|_| MemoryError::TotalOverflow)?,
                guest_addr: region.guest_addr,
                size: region.size,
                host_addr,
                file_offset,
            });
            mapped.push(guest_region);
        }
        let mem = GuestMemoryMmap::from_regions(mapped).map_err(MemoryError::Collection)?;
        Ok(Self {
            mem,
            layout,
            regions,
            backing,
        })
    }

    /// Replaces the contents of every region with `memory_file`, mapped
    /// `MAP_PRIVATE | MAP_NORESERVE` at the same host addresses, so a VM whose memslots
    /// point there sees the file's contents without re-registering anything (the
    /// kernel's MMU notifiers drop the VM's mappings of the old pages). The VMM write
    /// log is cleared: the new contents are the file's.
    ///
    /// On error the regions may be partly remapped: the memory must then be discarded.
    ///
    /// # Safety
    /// Nothing may read or write guest memory during the call: no running vCPU, no
    /// device thread, no slice obtained from this memory or a clone of it.
    pub unsafe fn remap_private(&mut self, memory_file: &Path) -> Result<(), MemoryError> {
        let file = open_memory_file(memory_file, self.layout.total_size())?;
        for (index, region) in self.regions.iter().enumerate() {
            let offset = libc::off_t::try_from(region.file_offset)
                .map_err(|_| MemoryError::TotalOverflow)?;
            // SAFETY: the range is exactly one region this memory mapped and still owns,
            // so MAP_FIXED replaces only our own mapping; the caller guarantees nothing
            // accesses it meanwhile. The new mapping has the same length and protection.
            let addr = unsafe {
                libc::mmap(
                    region.host_addr as *mut libc::c_void,
                    region.size,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_NORESERVE | libc::MAP_FIXED,
                    std::os::fd::AsRawFd::as_raw_fd(&file),
                    offset,
                )
            };
            if addr == libc::MAP_FAILED || addr as u64 != region.host_addr {
                return Err(MemoryError::Remap {
                    index,
                    source: std::io::Error::last_os_error(),
                });
            }
            if let Some(r) = self.vm_region(index) {
                let mapping: &vm_memory::mmap::MmapRegion<AtomicBitmap> = r;
                mapping.bitmap().reset();
            }
        }
        self.backing = MemoryBacking::PrivateFile {
            path: memory_file.to_path_buf(),
            file: Arc::new(file),
        };
        Ok(())
    }

    /// The vm-memory view: use its `Bytes` API for VMM/device writes so they are
    /// recorded in the per-region [`AtomicBitmap`].
    pub fn inner(&self) -> &GuestMemoryMmap<AtomicBitmap> {
        &self.mem
    }

    /// The layout this memory was built from.
    pub fn layout(&self) -> &MemoryLayout {
        &self.layout
    }

    /// Each region's slot, guest address, size, host address and file offset.
    pub fn regions(&self) -> &[RegionInfo] {
        &self.regions
    }

    /// Sum of the region sizes.
    pub fn total_size(&self) -> u64 {
        self.layout.total_size()
    }

    /// What the memory is mapped from.
    pub fn backing(&self) -> &MemoryBacking {
        &self.backing
    }

    /// The vm-memory region for `index` (its bitmap is the VMM write log).
    pub(crate) fn vm_region(&self, index: usize) -> Option<&GuestRegionMmap<AtomicBitmap>> {
        vm_memory::GuestMemoryBackend::iter(&self.mem).nth(index)
    }

    /// Info about region `index`, or an error naming the valid range.
    pub fn region(&self, index: usize) -> Result<&RegionInfo, MemoryError> {
        self.regions.get(index).ok_or(MemoryError::NoSuchRegion {
            index,
            count: self.regions.len(),
        })
    }

    /// A volatile view of region `index` for host-side access that may race with the
    /// guest. Writes through it are not recorded in the VMM write log.
    pub fn as_volatile_slice(
        &self,
        index: usize,
    ) -> Result<VolatileSlice<'_, vm_memory::bitmap::BS<'_, AtomicBitmap>>, MemoryError> {
        let info = self.region(index)?;
        let region = self.vm_region(index).ok_or(MemoryError::NoSuchRegion {
            index,
            count: self.regions.len(),
        })?;
        debug_assert_eq!(region.len(), info.size as u64);
        region
            .as_volatile_slice()
            .map_err(|source| MemoryError::Slice { index, source })
    }

    /// Region `index` as a byte slice, for reading host-side while nothing writes.
    ///
    /// # Safety
    ///
    /// While the returned slice lives, nothing may write region `index`: no vCPU may
    /// run and no thread may write through [`GuestMemory::inner`] or any other view.
    pub unsafe fn as_slice(&self, index: usize) -> Result<&[u8], MemoryError> {
        let info = self.region(index)?;
        // SAFETY: the region is a live mapping of `info.size` bytes owned by `self.mem`
        // (so it outlives `&self`), and the caller guarantees no writes while borrowed.
        Ok(unsafe { std::slice::from_raw_parts(info.host_addr as *const u8, info.size) })
    }

    /// Start of region `index` in this process.
    pub(crate) fn host_ptr(&self, index: usize) -> Option<*const u8> {
        self.regions.get(index).map(|r| r.host_addr as *const u8)
    }

    /// Whether every page that was never written is known to read as zero (fresh
    /// anonymous memory), so a full memory file may leave those pages as holes.
    pub(crate) fn is_zero_based(&self) -> bool {
        matches!(self.backing, MemoryBacking::Memfd(_))
    }
}

/// Opens a memory file to map, checking it is a regular file of `expected` bytes.
/// Neither the file nor its directory may be a symbolic link
/// ([`cube_storage::no_follow`]): the directory of a snapshot a VM supervisor staged
/// is its uid's, and one taken over could link another sandbox's memory there for a
/// restore as root to map.
fn open_memory_file(memory_file: &Path, expected: u64) -> Result<File, MemoryError> {
    let open_err = |source| MemoryError::OpenFile {
        path: memory_file.to_path_buf(),
        source,
    };
    let file = cube_storage::no_follow::open_file(memory_file).map_err(open_err)?;
    let meta = file.metadata().map_err(open_err)?;
    if !meta.is_file() {
        return Err(MemoryError::NotRegularFile {
            path: memory_file.to_path_buf(),
        });
    }
    // Sealed files carry one page after guest memory (checked by whoever restores
    // from them, before this: see `memory_seal`); older files hold guest memory alone.
    if meta.len() != expected && meta.len() != expected.saturating_add(SEAL_BYTES) {
        return Err(MemoryError::SizeMismatch {
            path: memory_file.to_path_buf(),
            expected,
            actual: meta.len(),
        });
    }
    Ok(file)
}

fn page_size_nonzero() -> NonZeroUsize {
    NonZeroUsize::MIN.saturating_add(PAGE_SIZE - 1)
}

fn check_host_page_size() -> Result<(), MemoryError> {
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size != PAGE_SIZE as libc::c_long {
        return Err(MemoryError::HostPageSize(
            usize::try_from(size).unwrap_or(0),
        ));
    }
    Ok(())
}

/// Creates a close-on-exec memfd named `name`.
pub(crate) fn create_memfd(name: &str) -> Result<File, MemoryError> {
    let cname = CString::new(name).map_err(|e| {
        MemoryError::Memfd(std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
    })?;
    // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
    Ok(unsafe { File::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::bitmap::Bitmap;
    use vm_memory::Bytes;

    fn layout(regions: &[(u64, usize)]) -> Result<MemoryLayout, MemoryError> {
        let r: Vec<_> = regions.iter().map(|&(a, s)| (GuestAddress(a), s)).collect();
        MemoryLayout::new(&r)
    }

    #[test]
    fn layout_validation() {
        assert!(matches!(layout(&[]), Err(MemoryError::EmptyLayout)));
        assert!(matches!(
            layout(&[(0, 0)]),
            Err(MemoryError::EmptyRegion { index: 0 })
        ));
        assert!(matches!(
            layout(&[(0, 4096), (0x1800, 4096)]),
            Err(MemoryError::Unaligned { index: 1, .. })
        ));
        assert!(matches!(
            layout(&[(0, 100)]),
            Err(MemoryError::Unaligned { index: 0, .. })
        ));
        assert!(matches!(
            layout(&[(0, 0x2000), (0x1000, 0x1000)]),
            Err(MemoryError::Overlap { index: 1 })
        ));
        assert!(matches!(
            layout(&[(0x10000, 0x1000), (0, 0x1000)]),
            Err(MemoryError::Overlap { index: 1 })
        ));
        assert!(matches!(
            layout(&[(u64::MAX - 0xfff, 0x2000)]),
            Err(MemoryError::AddressOverflow { index: 0 })
        ));
        let l = layout(&[(0, 0x2000), (0x2000, 0x1000), (0x100000, 0x3000)]).unwrap();
        assert_eq!(l.total_size(), 0x6000);
        assert_eq!(
            l.file_offsets().collect::<Vec<_>>(),
            vec![0, 0x2000, 0x3000]
        );
    }

    #[test]
    fn anonymous_regions_share_one_memfd() {
        let l = layout(&[(0, 0x4000), (0x100000, 0x2000)]).unwrap();
        let mem = GuestMemory::anonymous(l).unwrap();
        assert_eq!(mem.total_size(), 0x6000);
        let r = mem.regions();
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[1].slot, r[1].guest_addr, r[1].size),
            (1, GuestAddress(0x100000), 0x2000)
        );
        assert_eq!(r[1].file_offset, 0x4000);
        // A write through vm-memory lands in the memfd at the region's file offset.
        mem.inner()
            .write_slice(b"hello", GuestAddress(0x100010))
            .unwrap();
        let mut buf = [0u8; 5];
        nix::sys::uio::pread(mem.backing().file(), &mut buf, 0x4010).unwrap();
        assert_eq!(&buf, b"hello");
        // SAFETY: nothing writes the memory while the slice is alive.
        let slice = unsafe { mem.as_slice(1) }.unwrap();
        assert_eq!(&slice[0x10..0x15], b"hello");
        assert!(slice[..0x10].iter().all(|&b| b == 0));
        let volatile = mem.as_volatile_slice(1).unwrap();
        assert_eq!(volatile.len(), 0x2000);
        let mut vbuf = [0u8; 5];
        volatile.copy_to(&mut vbuf[..]);
        assert_eq!(&vbuf, b"\0\0\0\0\0");
        assert_eq!(volatile.read_obj::<u8>(0x10).unwrap(), b'h');
        // The VMM write log saw the write.
        assert!(mem.vm_region(1).unwrap().bitmap().dirty_at(0x10));
        assert!(!mem.vm_region(0).unwrap().bitmap().dirty_at(0x10));
        assert!(matches!(
            // SAFETY: region 2 does not exist, so no slice is ever formed.
            unsafe { mem.as_slice(2) },
            Err(MemoryError::NoSuchRegion { index: 2, count: 2 })
        ));
    }

    #[test]
    fn restore_private_rejects_wrong_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mem");
        std::fs::write(&path, vec![0u8; 0x3000]).unwrap();
        let err = GuestMemory::restore_private(layout(&[(0, 0x4000)]).unwrap(), &path).unwrap_err();
        assert!(matches!(
            err,
            MemoryError::SizeMismatch {
                expected: 0x4000,
                actual: 0x3000,
                ..
            }
        ));
        let err =
            GuestMemory::restore_private(layout(&[(0, 0x4000)]).unwrap(), dir.path()).unwrap_err();
        assert!(matches!(err, MemoryError::NotRegularFile { .. }));
        let err = GuestMemory::restore_private(
            layout(&[(0, 0x4000)]).unwrap(),
            &dir.path().join("missing"),
        )
        .unwrap_err();
        assert!(matches!(err, MemoryError::OpenFile { .. }));
    }

    #[test]
    fn restore_private_is_copy_on_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mem");
        let mut content = vec![0u8; 0x3000];
        content[0x1000..0x2000].fill(0xab);
        content[0x2000..].fill(0xcd);
        std::fs::write(&path, &content).unwrap();
        let l = layout(&[(0, 0x2000), (0x10000, 0x1000)]).unwrap();
        let mem = GuestMemory::restore_private(l, &path).unwrap();
        let mut b = [0u8; 1];
        mem.inner()
            .read_slice(&mut b, GuestAddress(0x1000))
            .unwrap();
        assert_eq!(b[0], 0xab);
        mem.inner()
            .read_slice(&mut b, GuestAddress(0x10000))
            .unwrap();
        assert_eq!(b[0], 0xcd);
        mem.inner()
            .write_slice(&[1], GuestAddress(0x10000))
            .unwrap();
        mem.inner()
            .read_slice(&mut b, GuestAddress(0x10000))
            .unwrap();
        assert_eq!(b[0], 1);
        assert_eq!(std::fs::read(&path).unwrap(), content);
        assert!(matches!(mem.backing(), MemoryBacking::PrivateFile { path: p, .. } if *p == path));
    }
}
