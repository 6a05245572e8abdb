//! A private anonymous page for probes to write to: no other allocation shares it, so
//! nothing but the probe itself dirties it.

use crate::guest_memory::PAGE_SIZE;

/// One anonymous page, unmapped on drop.
pub(crate) struct ScratchPage {
    addr: *mut u8,
}

impl ScratchPage {
    /// Maps a fresh page (not yet populated).
    pub(crate) fn new() -> std::io::Result<Self> {
        // SAFETY: a fresh anonymous mapping with no fixed address aliases nothing.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { addr: addr.cast() })
    }

    /// Address of the page.
    pub(crate) fn addr(&self) -> *mut u8 {
        self.addr
    }

    /// Stores `value` into the page's first byte.
    pub(crate) fn write(&self, value: u8) {
        // SAFETY: `addr` is the start of a live, writable page owned by `self`.
        unsafe { self.addr.write_volatile(value) };
    }
}

impl Drop for ScratchPage {
    fn drop(&mut self) {
        // SAFETY: `addr` is the page mapped in `new`, and nothing references it anymore.
        unsafe { libc::munmap(self.addr.cast(), PAGE_SIZE) };
    }
}
