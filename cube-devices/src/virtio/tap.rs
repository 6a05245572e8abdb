//! A TAP network device (`/dev/net/tun`, IFF_TAP | IFF_NO_PI | IFF_VNET_HDR): frames
//! travel with a 12-byte virtio-net header, the same layout virtio 1.x drivers use, so
//! the device passes headers through without converting them.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};

/// Length of the virtio-net header on TAP frames (virtio_net_hdr_v1).
pub const VNET_HDR_LEN: usize = 12;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;

/// Why a TAP device could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// The interface name is empty, too long or not plain text.
    #[error("TAP name {0:?} is not 1 to 15 characters of [A-Za-z0-9_.-]")]
    Name(String),
    /// `/dev/net/tun` could not be opened.
    #[error("Opening /dev/net/tun failed")]
    Open(#[source] std::io::Error),
    /// An ioctl on the TAP failed.
    #[error("{what} on TAP {name} failed")]
    Ioctl {
        /// Which request.
        what: &'static str,
        /// The interface.
        name: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// An open TAP interface (non-blocking); the interface goes away when it is closed,
/// unless it was made persistent elsewhere.
pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Opens (creating if needed) TAP interface `name` in the calling thread's network
    /// namespace.
    pub fn open(name: &str) -> Result<Self, TapError> {
        let valid = !name.is_empty()
            && name.len() < libc::IFNAMSIZ
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !valid {
            return Err(TapError::Name(name.to_string()));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(TapError::Open)?;
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        let ioctl_err = |what| TapError::Ioctl {
            what,
            name: name.to_string(),
            source: std::io::Error::last_os_error(),
        };
        // SAFETY: TUNSETIFF reads (and writes back) an ifreq; `req` is one, alive for
        // the call, on a descriptor of /dev/net/tun this function owns.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) } < 0 {
            return Err(ioctl_err("TUNSETIFF"));
        }
        let hdr_len: libc::c_int = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int from the pointer, which is valid.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETVNETHDRSZ, &hdr_len) } < 0 {
            return Err(ioctl_err("TUNSETVNETHDRSZ"));
        }
        Ok(Tap {
            file,
            name: name.to_string(),
        })
    }

    /// A second handle on the same TAP queue (a dup of the descriptor): a VM that
    /// replaces another (rollback) takes over the device while the old one still
    /// holds it.
    pub fn try_clone(&self) -> std::io::Result<Tap> {
        Ok(Tap {
            file: self.file.try_clone()?,
            name: self.name.clone(),
        })
    }

    /// The interface name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads one frame (virtio-net header first); `WouldBlock` when none is queued.
    pub fn read_frame(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.file.read(buf)
    }

    /// Writes one frame (virtio-net header first).
    pub fn write_frame(&mut self, frame: &[u8]) -> std::io::Result<usize> {
        self.file.write(frame)
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

use std::os::unix::fs::OpenOptionsExt;
