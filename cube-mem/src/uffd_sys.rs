//! The userfaultfd and `PAGEMAP_SCAN` definitions from the kernel's uapi headers that
//! the libc crate lacks, and opening a userfaultfd, shared by the write-protect dirty
//! tracker ([`crate::dirty::UffdWriteProtect`]) and the live copy of a snapshot's
//! pages ([`crate::live_copy`]).

use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::dirty::UffdError;

// Definitions from the kernel's uapi headers, which the libc crate lacks:
// include/uapi/linux/userfaultfd.h and include/uapi/linux/fs.h (PAGEMAP_SCAN, 6.7+).

/// `_IOC(dir, type, nr, size)` from include/uapi/asm-generic/ioctl.h.
const fn ioc(dir: u64, ty: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (ty << 8) | nr
}
pub(crate) const IOC_NONE: u64 = 0;
pub(crate) const IOC_WRITE: u64 = 1;
pub(crate) const IOC_READ: u64 = 2;

pub(crate) const UFFD_API: u64 = 0xAA;
pub(crate) const UFFDIO: u64 = 0xAA;
pub(crate) const UFFDIO_API: u64 = ioc(IOC_READ | IOC_WRITE, UFFDIO, 0x3F, size_of::<UffdioApi>());
pub(crate) const UFFDIO_REGISTER: u64 = ioc(
    IOC_READ | IOC_WRITE,
    UFFDIO,
    0x00,
    size_of::<UffdioRegister>(),
);
pub(crate) const UFFDIO_UNREGISTER: u64 = ioc(IOC_READ, UFFDIO, 0x01, size_of::<UffdioRange>());
pub(crate) const UFFDIO_WRITEPROTECT: u64 = ioc(
    IOC_READ | IOC_WRITE,
    UFFDIO,
    0x06,
    size_of::<UffdioWriteprotect>(),
);
/// Bit of `_UFFDIO_WRITEPROTECT` in `uffdio_register.ioctls`.
pub(crate) const UFFDIO_WRITEPROTECT_BIT: u64 = 1 << 0x06;
/// `USERFAULTFD_IOC_NEW` on /dev/userfaultfd.
pub(crate) const USERFAULTFD_IOC_NEW: u64 = ioc(IOC_NONE, 0xAA, 0x00, 0);
pub(crate) const UFFD_USER_MODE_ONLY: libc::c_int = 1;
pub(crate) const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
pub(crate) const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
pub(crate) const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
pub(crate) const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
pub(crate) const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;

pub(crate) const PAGEMAP_SCAN: u64 = ioc(
    IOC_READ | IOC_WRITE,
    b'f' as u64,
    16,
    size_of::<PmScanArg>(),
);
pub(crate) const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
pub(crate) const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
pub(crate) const PAGE_IS_WRITTEN: u64 = 1 << 1;

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
pub(crate) struct UffdioApi {
    pub(crate) api: u64,
    pub(crate) features: u64,
    pub(crate) ioctls: u64,
}

/// `struct uffdio_range`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
pub(crate) struct UffdioRange {
    pub(crate) start: u64,
    pub(crate) len: u64,
}

/// `struct uffdio_register`.
#[repr(C)]
#[derive(Default)]
pub(crate) struct UffdioRegister {
    pub(crate) range: UffdioRange,
    pub(crate) mode: u64,
    pub(crate) ioctls: u64,
}

/// `struct uffdio_writeprotect`.
#[repr(C)]
#[derive(Default)]
pub(crate) struct UffdioWriteprotect {
    pub(crate) range: UffdioRange,
    pub(crate) mode: u64,
}

/// `struct page_region` (include/uapi/linux/fs.h).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PageRegion {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) categories: u64,
}

/// `struct pm_scan_arg` (include/uapi/linux/fs.h).
#[repr(C)]
#[derive(Default)]
pub(crate) struct PmScanArg {
    pub(crate) size: u64,
    pub(crate) flags: u64,
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) walk_end: u64,
    pub(crate) vec: u64,
    pub(crate) vec_len: u64,
    pub(crate) max_pages: u64,
    pub(crate) category_inverted: u64,
    pub(crate) category_mask: u64,
    pub(crate) category_anyof_mask: u64,
    pub(crate) return_mask: u64,
}

/// Opens a userfaultfd that may also handle faults the kernel takes on the guest's
/// behalf (KVM), falling back to /dev/userfaultfd and then user-mode-only.
pub(crate) fn open_uffd(user_mode_fallback: bool) -> Result<OwnedFd, UffdError> {
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
    if !user_mode_fallback {
        return Err(UffdError::Open(std::io::Error::from_raw_os_error(
            libc::EPERM,
        )));
    }
    // Asynchronous write-protect never delivers a fault to user space, so a
    // user-mode-only descriptor still tracks writes the kernel makes (KVM).
    // SAFETY: userfaultfd takes only a flags integer.
    from_raw(unsafe { libc::syscall(libc::SYS_userfaultfd, flags | UFFD_USER_MODE_ONLY) })
        .map_err(UffdError::Open)
}

/// `UFFDIO_API` handshake enabling `features`; returns every feature the kernel
/// supports. A descriptor accepts only one handshake.
pub(crate) fn api(uffd: &OwnedFd, features: u64) -> Result<u64, UffdError> {
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

/// `UFFD_EVENT_PAGEFAULT`: `uffd_msg.event` of a fault.
pub(crate) const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
/// `sizeof(struct uffd_msg)`: the event byte, padding, then for a page fault its flags
/// at offset 8 and address at offset 16.
pub(crate) const UFFD_MSG_SIZE: usize = 32;

/// Registers every region of `mem` on `uffd` for write-protect faults. On error the
/// regions registered so far stay so: the caller's drop unregisters them
/// ([`unregister_all`]).
pub(crate) fn register_wp(
    uffd: &OwnedFd,
    mem: &crate::guest_memory::GuestMemory,
) -> Result<(), UffdError> {
    for (index, region) in mem.regions().iter().enumerate() {
        let mut reg = UffdioRegister {
            range: UffdioRange {
                start: region.host_addr,
                len: region.size as u64,
            },
            mode: UFFDIO_REGISTER_MODE_WP,
            ioctls: 0,
        };
        // SAFETY: `reg` is a valid `struct uffdio_register` that outlives the call; the
        // kernel writes only its `ioctls` field.
        let rc = unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) };
        if rc < 0 {
            return Err(UffdError::Register {
                region: index,
                source: std::io::Error::last_os_error(),
            });
        }
        if reg.ioctls & UFFDIO_WRITEPROTECT_BIT == 0 {
            return Err(UffdError::NoWriteProtect { region: index });
        }
    }
    Ok(())
}

/// Unregisters every region of `mem` from `uffd`; a region never registered is a
/// harmless error.
pub(crate) fn unregister_all(uffd: &OwnedFd, mem: &crate::guest_memory::GuestMemory) {
    for region in mem.regions() {
        let mut range = UffdioRange {
            start: region.host_addr,
            len: region.size as u64,
        };
        // SAFETY: `range` is a valid `struct uffdio_range` that outlives the call.
        unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_UNREGISTER, &mut range) };
    }
}
