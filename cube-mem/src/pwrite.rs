//! Writing a range of guest memory into a file: the one `pwrite` loop of the whole-file,
//! diff and live writers.

use std::fs::File;
use std::os::fd::AsRawFd;

/// Largest single `pwrite`; Linux caps one call near 2 GiB anyway.
const MAX_WRITE: usize = 1 << 30;

/// Writes `len` bytes from `src` at `offset`; on error returns the failing offset.
///
/// The kernel copies straight from the guest mapping, so no Rust reference to memory
/// the guest may share is ever formed.
pub(crate) fn pwrite_all(
    file: &File,
    src: *const u8,
    len: usize,
    offset: u64,
) -> Result<(), (u64, std::io::Error)> {
    let mut done = 0usize;
    while done < len {
        let chunk = (len - done).min(MAX_WRITE);
        let at = offset + done as u64;
        let off = libc::off_t::try_from(at)
            .map_err(|_| (at, std::io::Error::from_raw_os_error(libc::EOVERFLOW)))?;
        // SAFETY: `src + done .. src + done + chunk` lies inside the range the caller
        // vouched for; pwrite only reads it.
        let n = unsafe { libc::pwrite(file.as_raw_fd(), src.add(done).cast(), chunk, off) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err((at, err));
        }
        if n == 0 {
            return Err((at, std::io::Error::from(std::io::ErrorKind::WriteZero)));
        }
        done += n as usize;
    }
    Ok(())
}
