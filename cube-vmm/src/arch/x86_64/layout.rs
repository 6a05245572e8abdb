//! Guest physical address layout shared by every microVM.
//!
//! RAM starts at 0 and runs up to the MMIO hole at 3 GiB; whatever does not fit below
//! the hole continues at 4 GiB, the way PCs (and so Linux) expect it.

use std::fmt;

/// First guest physical address of the MMIO hole below 4 GiB.
pub const MMIO_HOLE_START: u64 = 0xC000_0000;
/// First guest physical address above the MMIO hole.
pub const MMIO_HOLE_END: u64 = 0x1_0000_0000;
/// Guest physical address of Cube's control device (one page, inside the MMIO hole).
pub const CONTROL_DEVICE_ADDR: u64 = 0xD000_0000;
/// Size of the control device's MMIO window.
pub const CONTROL_DEVICE_SIZE: u64 = 0x1000;
/// Smallest guest RAM Cube accepts.
pub const MIN_MEMORY_BYTES: u64 = 128 << 20;
/// Largest guest RAM Cube accepts.
pub const MAX_MEMORY_BYTES: u64 = 256 << 30;

/// Why a memory size cannot be laid out.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    /// The size is not a multiple of 2 MiB.
    #[error("Guest memory size {0} bytes is not a multiple of 2 MiB")]
    Unaligned(u64),
    /// The size is outside the supported range.
    #[error("Guest memory size {0} bytes is outside {MIN_MEMORY_BYTES}..={MAX_MEMORY_BYTES}")]
    OutOfRange(u64),
}

/// One contiguous range of guest RAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RamRange {
    /// Guest physical start address.
    pub guest_addr: u64,
    /// Length in bytes.
    pub size: u64,
}

impl fmt::Display for RamRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:#x}..{:#x}",
            self.guest_addr,
            self.guest_addr + self.size
        )
    }
}

/// The RAM ranges of a guest with `memory_bytes` of memory.
pub fn ram_ranges(memory_bytes: u64) -> Result<Vec<RamRange>, LayoutError> {
    if !memory_bytes.is_multiple_of(2 << 20) {
        return Err(LayoutError::Unaligned(memory_bytes));
    }
    if !(MIN_MEMORY_BYTES..=MAX_MEMORY_BYTES).contains(&memory_bytes) {
        return Err(LayoutError::OutOfRange(memory_bytes));
    }
    let low = memory_bytes.min(MMIO_HOLE_START);
    let mut ranges = vec![RamRange {
        guest_addr: 0,
        size: low,
    }];
    if memory_bytes > low {
        ranges.push(RamRange {
            guest_addr: MMIO_HOLE_END,
            size: memory_bytes - low,
        });
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_guest_is_one_range() {
        assert_eq!(
            ram_ranges(2 << 30).unwrap(),
            vec![RamRange {
                guest_addr: 0,
                size: 2 << 30
            }]
        );
    }

    #[test]
    fn large_guest_skips_the_hole() {
        let r = ram_ranges(4 << 30).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].size, MMIO_HOLE_START);
        assert_eq!(r[1].guest_addr, MMIO_HOLE_END);
        assert_eq!(r[0].size + r[1].size, 4 << 30);
    }

    #[test]
    fn bad_sizes_are_refused() {
        assert_eq!(ram_ranges(3 << 20), Err(LayoutError::Unaligned(3 << 20)));
        assert_eq!(ram_ranges(64 << 20), Err(LayoutError::OutOfRange(64 << 20)));
    }
}
