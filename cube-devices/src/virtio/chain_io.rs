//! Reading and writing a validated descriptor chain as one byte stream: the readable
//! buffers form one stream, the writable ones another, whatever way the driver split
//! them into descriptors (the spec forbids devices to assume any framing).

use vm_memory::{Bytes, GuestAddress, GuestMemoryError};

use super::queue::{Buffer, Chain};
use super::VirtioMemory;

/// One direction of a chain: its buffers in order.
#[derive(Clone, Debug, Default)]
pub struct Segments {
    parts: Vec<(u64, u32)>,
    len: u64,
}

impl Segments {
    fn from_buffers<'a>(buffers: impl Iterator<Item = &'a Buffer>) -> Self {
        let mut s = Segments::default();
        for b in buffers {
            if b.len > 0 {
                s.parts.push((b.addr.0, b.len));
                s.len += u64::from(b.len);
            }
        }
        s
    }

    /// The device-readable bytes of `chain`.
    pub fn readable(chain: &Chain) -> Self {
        Self::from_buffers(chain.readable())
    }

    /// The device-writable bytes of `chain`.
    pub fn writable(chain: &Chain) -> Self {
        Self::from_buffers(chain.writable())
    }

    /// Total length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Calls `f` with the guest address and length of every piece of the byte range
    /// `offset..offset + len` (which must lie within the segments).
    fn pieces(
        &self,
        mut offset: u64,
        mut len: u64,
        mut f: impl FnMut(u64, usize) -> Result<(), GuestMemoryError>,
    ) -> Result<(), GuestMemoryError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(GuestMemoryError::InvalidBackendAddress);
        }
        for &(addr, part_len) in &self.parts {
            let part_len = u64::from(part_len);
            if offset >= part_len {
                offset -= part_len;
                continue;
            }
            let n = (part_len - offset).min(len);
            f(addr + offset, n as usize)?;
            len -= n;
            offset = 0;
            if len == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Copies bytes `offset..offset + out.len()` out of guest memory.
    pub fn read_at(
        &self,
        mem: &VirtioMemory,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), GuestMemoryError> {
        let mut done = 0usize;
        self.pieces(offset, out.len() as u64, |addr, n| {
            mem.read_slice(&mut out[done..done + n], GuestAddress(addr))?;
            done += n;
            Ok(())
        })
    }

    /// Copies `data` into guest memory at byte `offset` of the segments.
    pub fn write_at(
        &self,
        mem: &VirtioMemory,
        offset: u64,
        data: &[u8],
    ) -> Result<(), GuestMemoryError> {
        let mut done = 0usize;
        self.pieces(offset, data.len() as u64, |addr, n| {
            mem.write_slice(&data[done..done + n], GuestAddress(addr))?;
            done += n;
            Ok(())
        })
    }
}
