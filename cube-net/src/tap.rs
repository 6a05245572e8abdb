//! Persistent TAP devices for the VM engine: created once for the pool, opened by
//! the VMM by name (TUNSETIFF with the same flags) when a VM attaches.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;

/// Errors of creating a TAP device.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// /dev/net/tun could not be opened.
    #[error("open /dev/net/tun")]
    OpenTun(#[source] io::Error),
    /// The name does not fit an interface name.
    #[error("bad TAP name {0:?}")]
    BadName(String),
    /// TUNSETIFF or TUNSETPERSIST failed.
    #[error("{op} {name}")]
    Ioctl {
        /// Which ioctl.
        op: &'static str,
        /// The device.
        name: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;

/// Flags a VMM must also pass when it opens one of the pool's TAPs.
pub const TAP_FLAGS: libc::c_short =
    (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    pad: [u8; 22],
}

/// Creates a persistent TAP device named `name` (down; the pool brings it up).
pub fn create_persistent(name: &str) -> Result<(), TapError> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('/') {
        return Err(TapError::BadName(name.to_string()));
    }
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(TapError::OpenTun)?;
    let mut request = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: TAP_FLAGS,
        pad: [0; 22],
    };
    request.name[..name.len()].copy_from_slice(name.as_bytes());
    let ioctl_error = |op: &'static str| TapError::Ioctl {
        op,
        name: name.to_string(),
        source: io::Error::last_os_error(),
    };
    // SAFETY: TUNSETIFF reads and writes one struct ifreq, which `request` is (40
    // bytes, name NUL-terminated), valid for the call.
    if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF as _, &mut request) } < 0 {
        return Err(ioctl_error("TUNSETIFF"));
    }
    // SAFETY: TUNSETPERSIST takes an integer argument by value.
    if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETPERSIST as _, 1 as libc::c_ulong) } < 0 {
        return Err(ioctl_error("TUNSETPERSIST"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_names_that_do_not_fit() {
        assert!(matches!(create_persistent(""), Err(TapError::BadName(_))));
        assert!(matches!(
            create_persistent("a-name-far-too-long"),
            Err(TapError::BadName(_))
        ));
        assert!(matches!(
            create_persistent("a/b"),
            Err(TapError::BadName(_))
        ));
    }
}
