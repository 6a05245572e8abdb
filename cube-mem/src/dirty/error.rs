//! Why dirty-page tracking failed: one error for bitmaps and trackers, wrapping each
//! backend's own (kept here with it, so the backends and the bitmap they fill depend
//! on this file and it on none of them).

/// Errors from dirty bitmaps and trackers.
#[derive(Debug, thiserror::Error)]
pub enum DirtyError {
    /// A region index past the end of the bitmap.
    #[error("No region {region}: bitmap has {regions}")]
    RegionOutOfRange {
        /// The index asked for.
        region: usize,
        /// How many regions the bitmap has.
        regions: usize,
    },
    /// A page range past the end of its region.
    #[error("Pages {first}..{end} are outside region {region} of {pages} pages")]
    PageOutOfRange {
        /// The region.
        region: usize,
        /// First page of the range.
        first: usize,
        /// One past the last page of the range.
        end: usize,
        /// Pages in the region.
        pages: usize,
    },
    /// Two bitmaps with different region counts or sizes were combined.
    #[error("Bitmaps cover different memory layouts")]
    ShapeMismatch,
    /// A raw word array has the wrong length for its region.
    #[error("Region {region} needs {expected} bitmap words, got {actual}")]
    WordCount {
        /// The region.
        region: usize,
        /// Words needed for the region's pages.
        expected: usize,
        /// Words given.
        actual: usize,
    },
    /// The KVM dirty log backend failed.
    #[error("KVM dirty log")]
    KvmDirtyLog(#[from] KvmDirtyLogError),
    /// The soft-dirty backend failed.
    #[error("Soft-dirty tracking")]
    SoftDirty(#[from] SoftDirtyError),
    /// The userfaultfd write-protect backend failed.
    #[error("Userfaultfd write-protect tracking")]
    Uffd(#[from] UffdError),
}

/// Errors from KVM memslots and the dirty log.
#[derive(Debug, thiserror::Error)]
pub enum KvmDirtyLogError {
    /// `KVM_SET_USER_MEMORY_REGION` failed.
    #[error("Failed to register memslot {slot}")]
    SetMemoryRegion {
        /// The slot.
        slot: u32,
        /// What KVM said.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// `KVM_GET_DIRTY_LOG` failed (ENOENT: the slot does not log dirty pages).
    #[error("Failed to read the dirty log of memslot {slot}")]
    GetDirtyLog {
        /// The slot.
        slot: u32,
        /// What KVM said.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// Errors from the soft-dirty backend.
#[derive(Debug, thiserror::Error)]
pub enum SoftDirtyError {
    /// The kernel does not track soft-dirty bits (no `CONFIG_MEM_SOFT_DIRTY`).
    #[error("Kernel lacks soft-dirty tracking (CONFIG_MEM_SOFT_DIRTY)")]
    Unsupported,
    /// Another soft-dirty tracker exists in this process.
    #[error("Another soft-dirty tracker is active in this process")]
    InUse,
    /// A /proc file could not be opened.
    #[error("Failed to open {path}")]
    Open {
        /// The file.
        path: &'static str,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// Writing `/proc/self/clear_refs` failed.
    #[error("Failed to clear soft-dirty bits")]
    Clear(#[source] std::io::Error),
    /// Reading `/proc/self/pagemap` failed.
    #[error("Failed to read pagemap of region {region}")]
    ReadPagemap {
        /// The region.
        region: usize,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
}

/// Errors from the userfaultfd write-protect backend.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    /// No way to create a userfaultfd worked (syscall, /dev/userfaultfd).
    #[error("Failed to create a userfaultfd")]
    Open(#[source] std::io::Error),
    /// The `UFFDIO_API` handshake failed.
    #[error("UFFDIO_API handshake failed")]
    Api(#[source] std::io::Error),
    /// The kernel lacks `UFFD_FEATURE_WP_ASYNC`.
    #[error("Kernel lacks asynchronous userfaultfd write-protect (features {supported:#x})")]
    MissingFeatures {
        /// The feature bits the kernel offers.
        supported: u64,
    },
    /// `UFFDIO_REGISTER` of a region failed.
    #[error("Failed to register region {region} for write-protect")]
    Register {
        /// The region.
        region: usize,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// A registered region does not offer `UFFDIO_WRITEPROTECT`.
    #[error("Region {region} cannot be write-protected")]
    NoWriteProtect {
        /// The region.
        region: usize,
    },
    /// `UFFDIO_WRITEPROTECT` of a region failed.
    #[error("Failed to write-protect region {region}")]
    WriteProtect {
        /// The region.
        region: usize,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// /proc/self/pagemap could not be opened.
    #[error("Failed to open /proc/self/pagemap")]
    OpenPagemap(#[source] std::io::Error),
    /// `PAGEMAP_SCAN` failed (ENOTTY: kernel older than 6.7).
    #[error("PAGEMAP_SCAN of region {region} failed")]
    Scan {
        /// The region.
        region: usize,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// `PAGEMAP_SCAN` reported a range outside the region or made no progress.
    #[error("PAGEMAP_SCAN of region {region} returned a bad result")]
    BadScanResult {
        /// The region.
        region: usize,
    },
}
