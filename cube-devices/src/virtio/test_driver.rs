//! The guest's side of virtio for tests: lays out split virtqueues in real guest
//! memory and drives an [`MmioTransport`] through its registers the way Linux's
//! virtio_mmio driver does. Public (hidden) for the VMM crate's tests, behind the
//! `test-driver` feature.

#![allow(clippy::unwrap_used, clippy::should_implement_trait, missing_docs)]

use std::sync::{Arc, Mutex};

use vm_memory::{Bytes, GuestAddress};

use super::interrupt::{InterruptError, InterruptLine};
use super::mmio::{regs, MmioTransport};
use super::queue::QueueLayout;
use super::{
    VirtioMemory, STATUS_ACKNOWLEDGE, STATUS_DRIVER, STATUS_DRIVER_OK, STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
};

/// Size of each of the two RAM regions.
pub const REGION_SIZE: u64 = 1 << 20;
/// Start of the second RAM region; between the two lies a hole.
pub const HIGH_REGION: u64 = 2 << 20;
pub const DESC: u64 = 0x1000;
pub const AVAIL: u64 = 0x3000;
pub const USED: u64 = 0x4000;
/// Where test buffers go.
pub const BUF: u64 = 0x10000;

/// Two 1 MiB regions with a hole between them, from `cube_mem` like a real guest's.
pub fn memory() -> VirtioMemory {
    let layout = cube_mem::MemoryLayout::new(&[
        (GuestAddress(0), REGION_SIZE as usize),
        (GuestAddress(HIGH_REGION), REGION_SIZE as usize),
    ])
    .unwrap();
    cube_mem::GuestMemory::anonymous(layout)
        .unwrap()
        .inner()
        .clone()
}

/// One split virtqueue as the driver sees it.
pub struct Ring {
    pub mem: VirtioMemory,
    pub layout: QueueLayout,
    avail_idx: u16,
}

impl Ring {
    pub fn new(mem: &VirtioMemory, size: u16) -> Self {
        Ring {
            mem: mem.clone(),
            layout: QueueLayout {
                size,
                desc_table: DESC,
                avail_ring: AVAIL,
                used_ring: USED,
            },
            avail_idx: 0,
        }
    }

    /// A ring of at most 256 entries whose table and rings lie in the 16 KiB at
    /// `base`, for devices with several queues.
    pub fn at(mem: &VirtioMemory, size: u16, base: u64) -> Self {
        assert!(size <= 256);
        Ring {
            mem: mem.clone(),
            layout: QueueLayout {
                size,
                desc_table: base,
                avail_ring: base + 0x2000,
                used_ring: base + 0x3000,
            },
            avail_idx: 0,
        }
    }

    pub fn set_desc(&self, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = self.layout.desc_table + 16 * u64::from(index);
        self.mem.write_obj(addr, GuestAddress(at)).unwrap();
        self.mem.write_obj(len, GuestAddress(at + 8)).unwrap();
        self.mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
        self.mem.write_obj(next, GuestAddress(at + 14)).unwrap();
    }

    /// Puts `head` in the available ring and publishes it.
    pub fn publish(&mut self, head: u16) {
        let slot = u64::from(self.avail_idx % self.layout.size);
        self.mem
            .write_obj(head, GuestAddress(self.layout.avail_ring + 4 + 2 * slot))
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx, GuestAddress(self.layout.avail_ring + 2))
            .unwrap();
    }

    /// Writes the available index directly, as a misbehaving driver might.
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.avail_idx = idx;
        self.mem
            .write_obj(idx, GuestAddress(self.layout.avail_ring + 2))
            .unwrap();
    }

    pub fn set_avail_flags(&self, flags: u16) {
        self.mem
            .write_obj(flags, GuestAddress(self.layout.avail_ring))
            .unwrap();
    }

    pub fn used_idx(&self) -> u16 {
        self.mem
            .read_obj(GuestAddress(self.layout.used_ring + 2))
            .unwrap()
    }

    /// The used element at ring position `n`: (descriptor id, length).
    pub fn used(&self, n: u16) -> (u32, u32) {
        let at = self.layout.used_ring + 4 + 8 * u64::from(n % self.layout.size);
        (
            self.mem.read_obj(GuestAddress(at)).unwrap(),
            self.mem.read_obj(GuestAddress(at + 4)).unwrap(),
        )
    }

    pub fn read_buf(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }
}

/// A transport and the recording interrupt line behind it.
pub struct Driver {
    pub transport: MmioTransport,
    pub line: Arc<RecordingLine>,
}

impl Driver {
    pub fn new(device: Box<dyn super::device::VirtioDevice>, mem: &VirtioMemory) -> Self {
        let line = Arc::new(RecordingLine::default());
        let transport = MmioTransport::new(device, mem.clone(), line.clone());
        Driver { transport, line }
    }

    /// The guest memory the transport was made with.
    pub fn transport_memory(&self) -> VirtioMemory {
        self.transport.memory().clone()
    }

    pub fn read32(&self, offset: u64) -> u32 {
        let mut data = [0xAAu8; 4];
        self.transport.read(offset, &mut data);
        u32::from_le_bytes(data)
    }

    pub fn write32(&mut self, offset: u64, value: u32) {
        self.transport.write(offset, &value.to_le_bytes());
    }

    pub fn add_status(&mut self, bit: u32) {
        let status = self.read32(regs::STATUS);
        self.write32(regs::STATUS, status | bit);
    }

    pub fn device_features(&mut self) -> u64 {
        self.write32(regs::DEVICE_FEATURES_SEL, 0);
        let low = self.read32(regs::DEVICE_FEATURES);
        self.write32(regs::DEVICE_FEATURES_SEL, 1);
        let high = self.read32(regs::DEVICE_FEATURES);
        u64::from(low) | (u64::from(high) << 32)
    }

    pub fn write_driver_features(&mut self, features: u64) {
        self.write32(regs::DRIVER_FEATURES_SEL, 0);
        self.write32(regs::DRIVER_FEATURES, features as u32);
        self.write32(regs::DRIVER_FEATURES_SEL, 1);
        self.write32(regs::DRIVER_FEATURES, (features >> 32) as u32);
    }

    /// ACKNOWLEDGE, DRIVER, accept `features`, FEATURES_OK; whether the device took them.
    pub fn negotiate(&mut self, features: u64) -> bool {
        self.write32(regs::STATUS, 0);
        self.add_status(STATUS_ACKNOWLEDGE);
        self.add_status(STATUS_DRIVER);
        self.write_driver_features(features);
        self.add_status(STATUS_FEATURES_OK);
        self.read32(regs::STATUS) & STATUS_FEATURES_OK != 0
    }

    /// Programs queue `index` at `layout` and enables it; whether the device took it.
    pub fn setup_queue(&mut self, index: u32, layout: &QueueLayout) -> bool {
        self.write32(regs::QUEUE_SEL, index);
        assert_eq!(self.read32(regs::QUEUE_READY), 0);
        self.write32(regs::QUEUE_NUM, u32::from(layout.size));
        self.write32(regs::QUEUE_DESC_LOW, layout.desc_table as u32);
        self.write32(regs::QUEUE_DESC_HIGH, (layout.desc_table >> 32) as u32);
        self.write32(regs::QUEUE_DRIVER_LOW, layout.avail_ring as u32);
        self.write32(regs::QUEUE_DRIVER_HIGH, (layout.avail_ring >> 32) as u32);
        self.write32(regs::QUEUE_DEVICE_LOW, layout.used_ring as u32);
        self.write32(regs::QUEUE_DEVICE_HIGH, (layout.used_ring >> 32) as u32);
        self.write32(regs::QUEUE_READY, 1);
        self.read32(regs::QUEUE_READY) == 1
    }

    /// Full bring-up of a one-queue device with VIRTIO_F_VERSION_1 and `ring`.
    pub fn bring_up(&mut self, ring: &Ring) {
        assert!(self.negotiate(1 << VIRTIO_F_VERSION_1));
        assert!(self.setup_queue(0, &ring.layout));
        self.add_status(STATUS_DRIVER_OK);
        assert!(self.transport.is_activated());
    }

    /// Full bring-up of a device with `features` and one ring per queue.
    pub fn bring_up_queues(&mut self, features: u64, rings: &[&Ring]) {
        assert!(self.negotiate(features));
        for (index, ring) in rings.iter().enumerate() {
            assert!(
                self.setup_queue(index as u32, &ring.layout),
                "queue {index}"
            );
        }
        self.add_status(STATUS_DRIVER_OK);
        assert!(self.transport.is_activated());
    }

    pub fn notify(&mut self, queue: u32) {
        self.write32(regs::QUEUE_NOTIFY, queue);
    }
}

/// A small deterministic generator (xorshift64) for the randomised robustness tests.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Fills `len` bytes of guest memory at `addr` with noise.
    pub fn scribble(&mut self, mem: &VirtioMemory, addr: u64, len: usize) {
        let bytes: Vec<u8> = (0..len).map(|_| self.next() as u8).collect();
        mem.write_slice(&bytes, GuestAddress(addr)).unwrap();
    }
}

/// Records what the device did to its line, standing in for the guest's irqchip.
#[derive(Default)]
pub struct RecordingLine {
    /// `true` for each raise, `false` for each lower, in order.
    pub events: Mutex<Vec<bool>>,
}

impl RecordingLine {
    /// How many times the line was raised.
    pub fn raises(&self) -> usize {
        self.events.lock().unwrap().iter().filter(|e| **e).count()
    }

    /// Whether the line is raised now.
    pub fn asserted(&self) -> bool {
        self.events.lock().unwrap().last().copied().unwrap_or(false)
    }
}

impl InterruptLine for RecordingLine {
    fn raise(&self) -> Result<(), InterruptError> {
        self.events.lock().unwrap().push(true);
        Ok(())
    }
    fn lower(&self) -> Result<(), InterruptError> {
        self.events.lock().unwrap().push(false);
        Ok(())
    }
}
