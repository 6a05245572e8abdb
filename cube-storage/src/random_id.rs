//! Random identifiers from the kernel's CSPRNG.
//!
//! Sandbox ids and temporary names must not collide across processes that share a
//! store, so they come from `getrandom(2)` rather than from a clock or a counter.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, Read};

/// Fills `buf` with random bytes from `getrandom(2)`, or from `/dev/urandom` on a
/// kernel too old to have the system call.
pub fn fill_random(buf: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: `rest` is a valid, writable buffer of `rest.len()` bytes that lives
        // for the whole call; getrandom writes at most that many bytes into it.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::ENOSYS) => return File::open("/dev/urandom")?.read_exact(rest),
                _ => return Err(err),
            }
        }
        // `n` is non-negative here and bounded by `rest.len()`.
        filled += n.unsigned_abs();
    }
    Ok(())
}

/// Returns `bytes` random bytes written as lowercase hex (`2 * bytes` characters).
pub(crate) fn random_hex(bytes: usize) -> io::Result<String> {
    let mut buf = vec![0u8; bytes];
    fill_random(&mut buf)?;
    let mut out = String::with_capacity(bytes * 2);
    for b in buf {
        // Writing into a String cannot fail.
        let _ = write!(out, "{b:02x}");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_hex_has_requested_length_and_varies() {
        let a = random_hex(8).unwrap();
        let b = random_hex(8).unwrap();
        assert_eq!(a.len(), 16);
        assert!(a
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b, "two 64-bit random values collided");
    }
}
