//! The MMIO bus: guest physical address ranges in the MMIO hole, each owned by one
//! device, looked up on every MMIO exit of a vCPU.
//!
//! Accesses that hit no device read as zeros and are otherwise dropped, the way an
//! empty slot behaves; an access that straddles the end of a device's window is not
//! decoded by it.

use std::collections::BTreeMap;
use std::sync::Arc;

/// A device on the MMIO bus, called on the vCPU thread that made the access.
pub trait MmioDevice: Send + Sync {
    /// Fills `data` with what the device returns at `offset` into its window.
    fn read(&self, offset: u64, data: &mut [u8]);
    /// Delivers `data` written at `offset` into the device's window.
    fn write(&self, offset: u64, data: &[u8]);
}

/// Why a device could not be put on the bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MmioBusError {
    /// The window is empty or runs past the end of the address space.
    #[error("MMIO window {base:#x}+{len:#x} is empty or wraps")]
    BadWindow {
        /// First address.
        base: u64,
        /// Length in bytes.
        len: u64,
    },
    /// The window overlaps one already on the bus.
    #[error("MMIO window {base:#x}+{len:#x} overlaps the device at {other:#x}")]
    Overlap {
        /// First address.
        base: u64,
        /// Length in bytes.
        len: u64,
        /// Base of the device it overlaps.
        other: u64,
    },
}

struct Slot {
    len: u64,
    device: Arc<dyn MmioDevice>,
}

/// Address ranges and the devices that answer them.
#[derive(Default)]
pub struct MmioBus {
    slots: BTreeMap<u64, Slot>,
}

impl MmioBus {
    /// An empty bus.
    pub fn new() -> Self {
        MmioBus::default()
    }

    /// Puts `device` at `base..base + len`.
    pub fn insert(
        &mut self,
        base: u64,
        len: u64,
        device: Arc<dyn MmioDevice>,
    ) -> Result<(), MmioBusError> {
        let end = base
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(MmioBusError::BadWindow { base, len })?;
        // The nearest window starting below `end` is the only one that can overlap.
        if let Some((&other, slot)) = self.slots.range(..end).next_back() {
            if other + slot.len > base {
                return Err(MmioBusError::Overlap { base, len, other });
            }
        }
        self.slots.insert(base, Slot { len, device });
        Ok(())
    }

    /// The device whose window holds all of `addr..addr + len`, and the offset into it.
    fn find(&self, addr: u64, len: usize) -> Option<(&Arc<dyn MmioDevice>, u64)> {
        let (&base, slot) = self.slots.range(..=addr).next_back()?;
        let offset = addr - base;
        let end = offset.checked_add(len as u64)?;
        (end <= slot.len).then_some((&slot.device, offset))
    }

    /// Handles a guest read at `addr`; whether a device answered (zeros if not).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((device, offset)) => {
                device.read(offset, data);
                true
            }
            None => {
                data.fill(0);
                false
            }
        }
    }

    /// Handles a guest write at `addr`; whether a device took it.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((device, offset)) => {
                device.write(offset, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A one-register device recording what it was written.
    #[derive(Default)]
    struct Register(Mutex<Vec<(u64, Vec<u8>)>>);

    impl MmioDevice for Register {
        fn read(&self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8 + 1);
        }
        fn write(&self, offset: u64, data: &[u8]) {
            self.0.lock().unwrap().push((offset, data.to_vec()));
        }
    }

    #[test]
    fn accesses_reach_the_device_owning_the_address() {
        let a = Arc::new(Register::default());
        let b = Arc::new(Register::default());
        let mut bus = MmioBus::new();
        bus.insert(0xd000_1000, 0x1000, a.clone()).unwrap();
        bus.insert(0xd000_2000, 0x1000, b.clone()).unwrap();
        let mut data = [0u8; 4];
        assert!(bus.read(0xd000_1004, &mut data));
        assert_eq!(data, [5; 4]);
        assert!(bus.write(0xd000_2ffc, &[1, 2, 3, 4]));
        assert_eq!(b.0.lock().unwrap().as_slice(), &[(0xffc, vec![1, 2, 3, 4])]);
        assert!(a.0.lock().unwrap().is_empty());
    }

    #[test]
    fn gaps_and_straddling_accesses_hit_nothing() {
        let a = Arc::new(Register::default());
        let mut bus = MmioBus::new();
        bus.insert(0x1000, 0x1000, a.clone()).unwrap();
        let mut data = [0xAAu8; 4];
        assert!(!bus.read(0x0ffc, &mut data));
        assert_eq!(data, [0; 4]);
        assert!(!bus.read(0x1ffe, &mut data));
        assert!(!bus.write(0x2000, &[1]));
        assert!(!bus.write(u64::MAX, &[1, 2]));
        assert!(a.0.lock().unwrap().is_empty());
    }

    #[test]
    fn overlapping_or_empty_windows_are_refused() {
        let mut bus = MmioBus::new();
        let dev = Arc::new(Register::default());
        bus.insert(0x2000, 0x1000, dev.clone()).unwrap();
        for (base, len) in [(0x2800, 0x1000), (0x1800, 0x1000), (0x1000, 0x3000)] {
            assert_eq!(
                bus.insert(base, len, dev.clone()),
                Err(MmioBusError::Overlap {
                    base,
                    len,
                    other: 0x2000
                })
            );
        }
        assert!(bus.insert(0x1000, 0, dev.clone()).is_err());
        assert!(bus.insert(u64::MAX, 2, dev.clone()).is_err());
        bus.insert(0x1000, 0x1000, dev.clone()).unwrap();
        bus.insert(0x3000, 0x1000, dev).unwrap();
    }
}
