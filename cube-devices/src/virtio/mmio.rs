//! The virtio-mmio transport, version 2 ("modern", virtio 1.x section 4.2).
//!
//! A guest driver finds the device at a 4 KiB window of the MMIO hole, negotiates
//! features, programs queue geometry and sets DRIVER_OK; the transport then activates
//! the [`VirtioDevice`] and forwards queue notifications to it. Register accesses of
//! the wrong width or alignment read as zero and are otherwise ignored, and writes that
//! the status state machine does not allow at that point are dropped: nothing a guest
//! writes here can make the VMM panic.

use std::sync::Arc;

use super::device::VirtioDevice;
use super::device_state::DeviceStateError;
use super::interrupt::{InterruptLine, VirtioInterrupt};
use super::persist::{PersistError, QueueState, VirtioMmioState};
use super::queue::{Queue, QueueLayout, MAX_QUEUE_SIZE};
use super::{
    VirtioMemory, STATUS_ACKNOWLEDGE, STATUS_DEVICE_NEEDS_RESET, STATUS_DRIVER, STATUS_DRIVER_OK,
    STATUS_FAILED, STATUS_FEATURES_OK, VIRTIO_F_VERSION_1,
};

/// Size of one device's MMIO window.
pub const MMIO_WINDOW_SIZE: u64 = 0x1000;
/// "virt" in little-endian: the MagicValue register.
pub const MMIO_MAGIC_VALUE: u32 = 0x7472_6976;
/// The transport version this implements (2: virtio 1.x, no legacy).
pub const MMIO_VERSION: u32 = 2;
/// VendorID register value: "CUBE" in little-endian.
pub const MMIO_VENDOR_ID: u32 = 0x4542_5543;

/// Register offsets of the virtio-mmio window.
pub mod regs {
    /// Magic value, read-only.
    pub const MAGIC_VALUE: u64 = 0x000;
    /// Transport version, read-only.
    pub const VERSION: u64 = 0x004;
    /// Virtio device type, read-only.
    pub const DEVICE_ID: u64 = 0x008;
    /// Vendor id, read-only.
    pub const VENDOR_ID: u64 = 0x00c;
    /// 32 bits of the device features, chosen by DEVICE_FEATURES_SEL.
    pub const DEVICE_FEATURES: u64 = 0x010;
    /// Which 32 bits DEVICE_FEATURES shows.
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    /// 32 bits of the features the driver accepts, chosen by DRIVER_FEATURES_SEL.
    pub const DRIVER_FEATURES: u64 = 0x020;
    /// Which 32 bits DRIVER_FEATURES sets.
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    /// Which queue the QUEUE_* registers address.
    pub const QUEUE_SEL: u64 = 0x030;
    /// Largest size of the selected queue (0: no such queue).
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    /// Size of the selected queue.
    pub const QUEUE_NUM: u64 = 0x038;
    /// Whether the selected queue is enabled.
    pub const QUEUE_READY: u64 = 0x044;
    /// Write a queue index: it has new buffers.
    pub const QUEUE_NOTIFY: u64 = 0x050;
    /// Why the interrupt fired.
    pub const INTERRUPT_STATUS: u64 = 0x060;
    /// Write bits of INTERRUPT_STATUS that the driver handled.
    pub const INTERRUPT_ACK: u64 = 0x064;
    /// Device status.
    pub const STATUS: u64 = 0x070;
    /// Descriptor table address, low 32 bits.
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    /// Descriptor table address, high 32 bits.
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    /// Available (driver) ring address, low 32 bits.
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    /// Available (driver) ring address, high 32 bits.
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    /// Used (device) ring address, low 32 bits.
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    /// Used (device) ring address, high 32 bits.
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    /// Changes whenever the device changes its configuration space.
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    /// Start of the device configuration space.
    pub const CONFIG: u64 = 0x100;
}

/// What the driver programmed for one queue.
#[derive(Clone, Copy, Debug)]
struct QueueConfig {
    max_size: u16,
    size: u16,
    ready: bool,
    desc_table: u64,
    avail_ring: u64,
    used_ring: u64,
}

impl QueueConfig {
    fn new(max_size: u16) -> Self {
        QueueConfig {
            max_size: max_size.min(MAX_QUEUE_SIZE),
            size: max_size.min(MAX_QUEUE_SIZE),
            ready: false,
            desc_table: 0,
            avail_ring: 0,
            used_ring: 0,
        }
    }

    fn layout(&self) -> QueueLayout {
        QueueLayout {
            size: self.size,
            desc_table: self.desc_table,
            avail_ring: self.avail_ring,
            used_ring: self.used_ring,
        }
    }
}

fn set_low(value: &mut u64, low: u32) {
    *value = (*value & !0xffff_ffff) | u64::from(low);
}

fn set_high(value: &mut u64, high: u32) {
    *value = (*value & 0xffff_ffff) | (u64::from(high) << 32);
}

/// A virtio device behind a virtio-mmio register window.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    memory: VirtioMemory,
    interrupt: Arc<VirtioInterrupt>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_select: u32,
    queues: Vec<QueueConfig>,
    config_generation: u32,
    activated: bool,
}

impl MmioTransport {
    /// A transport for `device` in its reset state, using `memory` and raising `line`.
    pub fn new(
        device: Box<dyn VirtioDevice>,
        memory: VirtioMemory,
        line: Arc<dyn InterruptLine>,
    ) -> Self {
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&max| QueueConfig::new(max))
            .collect();
        MmioTransport {
            device,
            memory,
            interrupt: Arc::new(VirtioInterrupt::new(line)),
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_select: 0,
            queues,
            config_generation: 0,
            activated: false,
        }
    }

    /// The Status register.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// Whether the device is running (the driver set DRIVER_OK and activation worked).
    pub fn is_activated(&self) -> bool {
        self.activated
    }

    /// The device behind the transport.
    pub fn device(&self) -> &dyn VirtioDevice {
        self.device.as_ref()
    }

    /// The device behind the transport, for a host-side owner (tests, set-up).
    pub fn device_mut(&mut self) -> &mut dyn VirtioDevice {
        self.device.as_mut()
    }

    /// The guest memory the device works on.
    pub fn memory(&self) -> &VirtioMemory {
        &self.memory
    }

    /// How many queues the device has.
    pub fn queue_count(&self) -> usize {
        self.queues.len()
    }

    /// A queue notification that arrived through an ioeventfd rather than a register
    /// write.
    pub fn notify_queue(&mut self, index: u16) {
        self.notify(u32::from(index));
    }

    /// Lets an activated device move what its host side has into its queues.
    pub fn process_backend(&mut self) {
        if !self.activated {
            return;
        }
        if let Err(e) = self.device.process_backend() {
            tracing::warn!(error = %e, "virtio-mmio: serving the device backend failed");
        }
    }

    /// Tells the device it was restored as a clone, and the driver that its
    /// configuration changed (the config generation moves on).
    pub fn mark_cloned(&mut self) -> Result<(), super::device::DeviceError> {
        self.device.on_clone()?;
        self.config_generation = self.config_generation.wrapping_add(1);
        if self.activated {
            self.interrupt
                .signal_config_change()
                .map_err(super::device::DeviceError::Interrupt)?;
        }
        Ok(())
    }

    /// Handles a guest read of `data.len()` bytes at `offset` into the window.
    pub fn read(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset >= regs::CONFIG {
            if offset < MMIO_WINDOW_SIZE {
                self.device.read_config(offset - regs::CONFIG, data);
            }
            return;
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            return;
        }
        let value = match offset {
            regs::MAGIC_VALUE => MMIO_MAGIC_VALUE,
            regs::VERSION => MMIO_VERSION,
            regs::DEVICE_ID => self.device.device_type(),
            regs::VENDOR_ID => MMIO_VENDOR_ID,
            regs::DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device.features() as u32,
                1 => (self.device.features() >> 32) as u32,
                _ => 0,
            },
            regs::QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| u32::from(q.max_size)),
            regs::QUEUE_READY => self.selected_queue().map_or(0, |q| u32::from(q.ready)),
            regs::INTERRUPT_STATUS => self.interrupt.status(),
            regs::STATUS => self.status,
            regs::CONFIG_GENERATION => self.config_generation,
            _ => 0,
        };
        data.copy_from_slice(&value.to_le_bytes());
    }

    /// Handles a guest write of `data` at `offset` into the window.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= regs::CONFIG {
            let driving = self.status & STATUS_DRIVER != 0 && self.status & STATUS_FAILED == 0;
            if driving && offset < MMIO_WINDOW_SIZE {
                self.device.write_config(offset - regs::CONFIG, data);
            }
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            return;
        };
        if !offset.is_multiple_of(4) {
            return;
        }
        let value = u32::from_le_bytes(bytes);
        match offset {
            regs::DEVICE_FEATURES_SEL => self.device_features_sel = value,
            regs::DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            // Features may change only between DRIVER and FEATURES_OK.
            regs::DRIVER_FEATURES if self.features_writable() => match self.driver_features_sel {
                0 => set_low(&mut self.driver_features, value),
                1 => set_high(&mut self.driver_features, value),
                _ => {}
            },
            regs::QUEUE_SEL => self.queue_select = value,
            regs::QUEUE_NUM => {
                if let Some(q) = self.configurable_queue() {
                    // Only sizes the device can honour are taken; a bad one leaves
                    // the previous (valid) size, which the driver can read back.
                    match u16::try_from(value) {
                        Ok(size) if size.is_power_of_two() && size <= q.max_size => q.size = size,
                        _ => tracing::warn!(value, "virtio-mmio: queue size refused"),
                    }
                }
            }
            regs::QUEUE_READY => self.set_queue_ready(value),
            regs::QUEUE_DESC_LOW => self.with_queue(|q| set_low(&mut q.desc_table, value)),
            regs::QUEUE_DESC_HIGH => self.with_queue(|q| set_high(&mut q.desc_table, value)),
            regs::QUEUE_DRIVER_LOW => self.with_queue(|q| set_low(&mut q.avail_ring, value)),
            regs::QUEUE_DRIVER_HIGH => self.with_queue(|q| set_high(&mut q.avail_ring, value)),
            regs::QUEUE_DEVICE_LOW => self.with_queue(|q| set_low(&mut q.used_ring, value)),
            regs::QUEUE_DEVICE_HIGH => self.with_queue(|q| set_high(&mut q.used_ring, value)),
            regs::QUEUE_NOTIFY => self.notify(value),
            regs::INTERRUPT_ACK => {
                if let Err(e) = self.interrupt.acknowledge(value) {
                    tracing::warn!(error = %e, "virtio-mmio: lowering the interrupt failed");
                }
            }
            regs::STATUS => self.set_status(value),
            _ => {}
        }
    }

    fn features_writable(&self) -> bool {
        self.status & (STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_FAILED) == STATUS_DRIVER
    }

    fn selected_queue(&self) -> Option<&QueueConfig> {
        usize::try_from(self.queue_select)
            .ok()
            .and_then(|i| self.queues.get(i))
    }

    /// The selected queue, while the driver may still program it.
    fn configurable_queue(&mut self) -> Option<&mut QueueConfig> {
        let phase = self.status & (STATUS_FEATURES_OK | STATUS_DRIVER_OK | STATUS_FAILED);
        if phase != STATUS_FEATURES_OK {
            return None;
        }
        let index = usize::try_from(self.queue_select).ok()?;
        self.queues.get_mut(index).filter(|q| !q.ready)
    }

    fn with_queue(&mut self, f: impl FnOnce(&mut QueueConfig)) {
        if let Some(q) = self.configurable_queue() {
            f(q);
        }
    }

    fn set_queue_ready(&mut self, value: u32) {
        let phase = self.status & (STATUS_FEATURES_OK | STATUS_DRIVER_OK | STATUS_FAILED);
        if phase != STATUS_FEATURES_OK {
            return;
        }
        let Some(index) = usize::try_from(self.queue_select).ok() else {
            return;
        };
        let memory = &self.memory;
        let Some(q) = self.queues.get_mut(index) else {
            return;
        };
        match value {
            0 => q.ready = false,
            1 => match q.layout().validate(memory, q.max_size) {
                Ok(()) => q.ready = true,
                // Left not ready: the driver reads QueueReady back and gives up.
                Err(e) => tracing::warn!(queue = index, error = %e, "virtio-mmio: queue refused"),
            },
            _ => {}
        }
    }

    fn notify(&mut self, value: u32) {
        if !self.activated {
            return;
        }
        let Ok(index) = u16::try_from(value) else {
            return;
        };
        if let Err(e) = self.device.process_queue(index) {
            tracing::warn!(queue = index, error = %e, "virtio-mmio: serving a queue failed");
        }
    }

    fn set_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        let old = self.status;
        if value & !old & STATUS_FAILED != 0 {
            self.status |= STATUS_FAILED;
            return;
        }
        // Bits are only ever added, one initialisation step at a time.
        if value & old != old {
            return;
        }
        let added = value & !old;
        let expected = match added {
            STATUS_ACKNOWLEDGE => 0,
            STATUS_DRIVER => STATUS_ACKNOWLEDGE,
            STATUS_FEATURES_OK => STATUS_ACKNOWLEDGE | STATUS_DRIVER,
            STATUS_DRIVER_OK => STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK,
            _ => return,
        };
        if old != expected {
            return;
        }
        match added {
            STATUS_FEATURES_OK => {
                let offered = self.device.features();
                let acked = self.driver_features;
                // Not setting FEATURES_OK is how the device refuses: the driver
                // reads the status back.
                if acked & !offered != 0 || acked & (1 << VIRTIO_F_VERSION_1) == 0 {
                    tracing::warn!(acked, offered, "virtio-mmio: feature set refused");
                    return;
                }
                self.status = value;
            }
            STATUS_DRIVER_OK => {
                self.status = value;
                if let Err(e) = self.activate(&[]) {
                    tracing::warn!(error = %e, "virtio-mmio: activation failed");
                    self.needs_reset();
                }
            }
            _ => self.status = value,
        }
    }

    fn needs_reset(&mut self) {
        self.status |= STATUS_DEVICE_NEEDS_RESET;
        if let Err(e) = self.interrupt.signal_config_change() {
            tracing::warn!(error = %e, "virtio-mmio: interrupting the guest failed");
        }
    }

    /// Builds the queues (at `positions`, or at 0 for a fresh start) and starts the
    /// device.
    fn activate(&mut self, positions: &[(u16, u16)]) -> Result<(), PersistError> {
        let mut queues = Vec::with_capacity(self.queues.len());
        for (index, q) in self.queues.iter().enumerate() {
            if !q.ready {
                return Err(PersistError::QueueNotReady { index });
            }
            let (next_avail, next_used) = positions.get(index).copied().unwrap_or((0, 0));
            let queue = Queue::new(&self.memory, q.layout(), q.max_size, next_avail, next_used)
                .map_err(|source| PersistError::Queue { index, source })?;
            queues.push(queue);
        }
        self.device
            .activate(
                self.driver_features,
                self.memory.clone(),
                queues,
                Arc::clone(&self.interrupt),
            )
            .map_err(PersistError::Device)?;
        self.activated = true;
        Ok(())
    }

    /// Returns the device and transport to their power-on state (Status written 0).
    pub fn reset(&mut self) {
        self.device.reset();
        self.activated = false;
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.queue_select = 0;
        for q in &mut self.queues {
            *q = QueueConfig::new(q.max_size);
        }
        if let Err(e) = self.interrupt.set_status(0) {
            tracing::warn!(error = %e, "virtio-mmio: lowering the interrupt failed");
        }
    }

    /// The transport's and device's state, for a snapshot taken while the guest is
    /// stopped; fails only when the device's state does not encode.
    pub fn save(&self) -> Result<VirtioMmioState, DeviceStateError> {
        let running = self.device.queues();
        let queues = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, q)| {
                let position = running.get(i).filter(|_| self.activated);
                QueueState {
                    size: q.size,
                    ready: q.ready,
                    desc_table: q.desc_table,
                    avail_ring: q.avail_ring,
                    used_ring: q.used_ring,
                    next_avail: position.map_or(0, |r| r.next_avail()),
                    next_used: position.map_or(0, |r| r.next_used()),
                }
            })
            .collect();
        Ok(VirtioMmioState {
            device_type: self.device.device_type(),
            status: self.status,
            driver_features: self.driver_features,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            queue_select: self.queue_select,
            queues,
            interrupt_status: self.interrupt.status(),
            config_generation: self.config_generation,
            device_state: self.device.save_state()?,
        })
    }

    /// A transport for a fresh `device` in the state `state`, after checking it
    /// against the device and `memory`; an activated device is activated again with
    /// its queues at the saved ring positions.
    pub fn restore(
        mut device: Box<dyn VirtioDevice>,
        memory: VirtioMemory,
        line: Arc<dyn InterruptLine>,
        state: &VirtioMmioState,
    ) -> Result<Self, PersistError> {
        state.validate(device.as_ref(), &memory)?;
        device
            .restore_state(&state.device_state)
            .map_err(PersistError::DeviceState)?;
        let mut transport = MmioTransport::new(device, memory, line);
        transport.status = state.status;
        transport.driver_features = state.driver_features;
        transport.device_features_sel = state.device_features_sel;
        transport.driver_features_sel = state.driver_features_sel;
        transport.queue_select = state.queue_select;
        transport.config_generation = state.config_generation;
        for (config, saved) in transport.queues.iter_mut().zip(&state.queues) {
            config.size = saved.size;
            config.ready = saved.ready;
            config.desc_table = saved.desc_table;
            config.avail_ring = saved.avail_ring;
            config.used_ring = saved.used_ring;
        }
        // Re-raise a pending interrupt: the guest has not seen it handled yet. Before
        // the activation, which may signal causes of its own (vsock's transport reset
        // event): set afterwards, the saved status would wipe them and lower the line,
        // and the guest would never look at the buffers used for it.
        if let Err(e) = transport.interrupt.set_status(state.interrupt_status) {
            tracing::warn!(error = %e, "virtio-mmio: restoring the interrupt failed");
        }
        if state.is_activated() {
            let positions: Vec<(u16, u16)> = state
                .queues
                .iter()
                .map(|q| (q.next_avail, q.next_used))
                .collect();
            transport.activate(&positions)?;
        }
        Ok(transport)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::interrupt::{INTERRUPT_CONFIG_CHANGE, INTERRUPT_USED_BUFFER};
    use crate::virtio::queue::VIRTQ_DESC_F_WRITE as W;
    use crate::virtio::rng::Rng;
    use crate::virtio::test_driver::RecordingLine;
    use crate::virtio::test_driver::{memory, Driver, Ring, BUF, REGION_SIZE};
    use crate::virtio::VIRTIO_ID_RNG;
    use vm_memory::{Bytes, GuestAddress};

    const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;

    fn rng_driver() -> (Driver, Ring) {
        let mem = memory();
        (Driver::new(Box::new(Rng::new()), &mem), Ring::new(&mem, 16))
    }

    #[test]
    fn identification_registers() {
        let (d, _) = rng_driver();
        assert_eq!(d.read32(regs::MAGIC_VALUE), 0x7472_6976);
        assert_eq!(d.read32(regs::VERSION), 2);
        assert_eq!(d.read32(regs::DEVICE_ID), VIRTIO_ID_RNG);
        assert_eq!(d.read32(regs::VENDOR_ID), MMIO_VENDOR_ID);
        assert_eq!(d.read32(regs::QUEUE_NUM_MAX), 256);
        assert_eq!(d.read32(regs::STATUS), 0);
    }

    #[test]
    fn odd_accesses_read_zero_and_change_nothing() {
        let (mut d, _) = rng_driver();
        for (offset, len) in [
            (0u64, 1usize),
            (0, 2),
            (0, 8),
            (2, 4),
            (0x71, 4),
            (0x0f0, 4),
        ] {
            let mut data = vec![0xAAu8; len];
            d.transport.read(offset, &mut data);
            assert!(data.iter().all(|b| *b == 0), "{offset:#x}/{len}");
        }
        let mut empty = [];
        d.transport.read(0, &mut empty);
        // Writes of the wrong width or alignment, or to read-only registers, do nothing.
        d.transport.write(regs::STATUS, &[1]);
        d.transport.write(regs::STATUS, &[1, 0]);
        d.transport.write(regs::STATUS + 1, &[1, 0, 0, 0]);
        d.transport.write(regs::STATUS, &[1, 0, 0, 0, 0, 0, 0, 0]);
        d.write32(regs::MAGIC_VALUE, 0);
        d.write32(regs::DEVICE_ID, 0);
        assert_eq!(d.read32(regs::STATUS), 0);
        assert_eq!(d.read32(regs::MAGIC_VALUE), MMIO_MAGIC_VALUE);
        // Past the window, and at the very top of the address space.
        let mut data = [0xAAu8; 4];
        d.transport.read(MMIO_WINDOW_SIZE, &mut data);
        assert_eq!(data, [0; 4]);
        d.transport.read(u64::MAX, &mut data);
        d.transport.write(u64::MAX, &data);
    }

    #[test]
    fn config_space_of_the_rng_is_empty_and_reads_zero() {
        let (mut d, ring) = rng_driver();
        d.bring_up(&ring);
        for len in [1usize, 2, 4, 8] {
            for offset in [regs::CONFIG, regs::CONFIG + 3, MMIO_WINDOW_SIZE - 1] {
                let mut data = vec![0xAAu8; len];
                d.transport.read(offset, &mut data);
                assert!(data.iter().all(|b| *b == 0));
                d.transport.write(offset, &data);
            }
        }
        assert_eq!(d.read32(regs::CONFIG_GENERATION), 0);
    }

    #[test]
    fn feature_negotiation_through_registers() {
        let (mut d, _) = rng_driver();
        assert_eq!(d.device_features(), VERSION_1);
        // Reading past the two feature words shows nothing.
        d.write32(regs::DEVICE_FEATURES_SEL, 2);
        assert_eq!(d.read32(regs::DEVICE_FEATURES), 0);
        // A driver without VIRTIO_F_VERSION_1 is refused.
        assert!(!d.negotiate(0));
        // So is one that accepts a feature the device does not offer.
        assert!(!d.negotiate(VERSION_1 | 1 << 28));
        assert!(d.negotiate(VERSION_1));
        assert_eq!(d.transport.save().unwrap().driver_features, VERSION_1);
        // Once FEATURES_OK is set the features are frozen.
        d.write_driver_features(0);
        assert_eq!(d.transport.save().unwrap().driver_features, VERSION_1);
    }

    #[test]
    fn status_steps_must_come_in_order() {
        let (mut d, ring) = rng_driver();
        d.write32(regs::STATUS, STATUS_DRIVER);
        assert_eq!(d.read32(regs::STATUS), 0);
        d.add_status(STATUS_ACKNOWLEDGE);
        d.write32(
            regs::STATUS,
            STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK,
        );
        assert_eq!(d.read32(regs::STATUS), STATUS_ACKNOWLEDGE);
        d.add_status(STATUS_DRIVER);
        // DRIVER_OK before FEATURES_OK is ignored.
        d.add_status(STATUS_DRIVER_OK);
        assert_eq!(d.read32(regs::STATUS), STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        // Features may not be negotiated before DRIVER.
        d.write32(regs::STATUS, 0);
        d.add_status(STATUS_ACKNOWLEDGE);
        d.write_driver_features(VERSION_1);
        d.add_status(STATUS_DRIVER);
        d.add_status(STATUS_FEATURES_OK);
        assert_eq!(d.read32(regs::STATUS) & STATUS_FEATURES_OK, 0);
        // Queues cannot be programmed before FEATURES_OK.
        assert!(!d.setup_queue(0, &ring.layout));
        // Bits cannot be taken away except by a reset.
        d.write32(regs::STATUS, STATUS_DRIVER);
        assert_eq!(d.read32(regs::STATUS), STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        // FAILED sticks, and then nothing else changes.
        d.add_status(STATUS_FAILED);
        d.write_driver_features(VERSION_1);
        d.add_status(STATUS_FEATURES_OK);
        assert_eq!(
            d.read32(regs::STATUS),
            STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FAILED
        );
        d.bring_up(&ring);
    }

    #[test]
    fn bad_queue_settings_are_refused() {
        let (mut d, ring) = rng_driver();
        assert!(d.negotiate(VERSION_1));
        d.write32(regs::QUEUE_SEL, 1);
        assert_eq!(d.read32(regs::QUEUE_NUM_MAX), 0);
        assert!(!d.setup_queue(1, &ring.layout));
        d.write32(regs::QUEUE_SEL, 0);
        for size in [0u32, 3, 512, 0x1_0010] {
            d.write32(regs::QUEUE_NUM, size);
            assert_eq!(
                d.transport.save().unwrap().queues[0].size,
                256,
                "size {size}"
            );
        }
        let outside = QueueLayout {
            used_ring: REGION_SIZE - 0x10,
            ..ring.layout
        };
        assert!(!d.setup_queue(0, &outside));
        let misaligned = QueueLayout {
            desc_table: 0x1004,
            ..ring.layout
        };
        assert!(!d.setup_queue(0, &misaligned));
        assert!(d.setup_queue(0, &ring.layout));
        // A ready queue cannot be moved.
        d.write32(regs::QUEUE_DESC_LOW, 0x8000);
        assert_eq!(
            d.transport.save().unwrap().queues[0].desc_table,
            ring.layout.desc_table
        );
    }

    #[test]
    fn driver_ok_without_ready_queues_needs_reset() {
        let (mut d, ring) = rng_driver();
        assert!(d.negotiate(VERSION_1));
        d.add_status(STATUS_DRIVER_OK);
        assert!(!d.transport.is_activated());
        assert_ne!(d.read32(regs::STATUS) & STATUS_DEVICE_NEEDS_RESET, 0);
        assert_eq!(d.read32(regs::INTERRUPT_STATUS), INTERRUPT_CONFIG_CHANGE);
        // Notifications go nowhere, and a reset brings the device back.
        d.notify(0);
        d.bring_up(&ring);
    }

    #[test]
    fn reset_returns_to_power_on_state() {
        let (mut d, mut ring) = rng_driver();
        d.bring_up(&ring);
        ring.set_desc(0, BUF, 16, W, 0);
        ring.publish(0);
        d.notify(0);
        assert_eq!(d.read32(regs::INTERRUPT_STATUS), INTERRUPT_USED_BUFFER);
        d.write32(regs::STATUS, 0);
        assert_eq!(d.read32(regs::STATUS), 0);
        assert_eq!(d.read32(regs::INTERRUPT_STATUS), 0);
        assert!(!d.line.asserted());
        assert!(!d.transport.is_activated());
        assert!(d.transport.device().queues().is_empty());
        let state = d.transport.save().unwrap();
        assert_eq!(state.driver_features, 0);
        assert!(state.queues.iter().all(|q| !q.ready && q.size == 256));
        // Notifications after a reset are ignored.
        ring.publish(0);
        d.notify(0);
        assert_eq!(ring.used_idx(), 1);
        // And the driver can start over, at ring position 0.
        ring.mem
            .write_obj(0u16, GuestAddress(ring.layout.used_ring + 2))
            .unwrap();
        let mut ring = Ring::new(&ring.mem, 16);
        d.bring_up(&ring);
        ring.set_desc(0, BUF, 16, W, 0);
        ring.publish(0);
        d.notify(0);
        assert_eq!(ring.used(0), (0, 16));
    }

    /// Round-trips a state through its serialised form, as a snapshot file would.
    fn through_file(state: &VirtioMmioState) -> VirtioMmioState {
        let bytes = postcard::to_allocvec(state).unwrap();
        postcard::from_bytes(&bytes).unwrap()
    }

    #[test]
    fn a_request_made_before_a_snapshot_is_served_after_restore() {
        let (mut d, mut ring) = rng_driver();
        d.bring_up(&ring);
        // One request served before the snapshot, so ring positions are not zero.
        ring.set_desc(0, BUF, 32, W, 0);
        ring.publish(0);
        d.notify(0);
        d.write32(regs::INTERRUPT_ACK, INTERRUPT_USED_BUFFER);
        // The guest makes a request available but the snapshot comes before it notifies.
        ring.mem
            .write_slice(&[0u8; 64], GuestAddress(BUF + 0x100))
            .unwrap();
        ring.set_desc(5, BUF + 0x100, 64, W, 0);
        ring.publish(5);
        let state = through_file(&d.transport.save().unwrap());
        assert_eq!(state.queues[0].next_avail, 1);
        assert_eq!(state.queues[0].next_used, 1);
        drop(d);

        let line = Arc::new(RecordingLine::default());
        let mut restored =
            MmioTransport::restore(Box::new(Rng::new()), ring.mem.clone(), line.clone(), &state)
                .unwrap();
        assert!(restored.is_activated());
        assert_eq!(restored.save().unwrap(), state);
        restored.write(regs::QUEUE_NOTIFY, &0u32.to_le_bytes());
        assert_eq!(ring.used_idx(), 2);
        assert_eq!(ring.used(1), (5, 64));
        assert!(ring.read_buf(BUF + 0x100, 64).iter().any(|b| *b != 0));
        assert_eq!(line.raises(), 1);
    }

    #[test]
    fn a_device_the_driver_marked_failed_still_restores() {
        let (mut d, mut ring) = rng_driver();
        d.bring_up(&ring);
        ring.set_desc(0, BUF, 8, W, 0);
        ring.publish(0);
        d.notify(0);
        d.add_status(STATUS_FAILED);
        let state = through_file(&d.transport.save().unwrap());
        let restored = MmioTransport::restore(
            Box::new(Rng::new()),
            ring.mem.clone(),
            Arc::new(RecordingLine::default()),
            &state,
        )
        .unwrap();
        assert_eq!(restored.save().unwrap(), state);
    }

    #[test]
    fn a_snapshot_taken_while_the_driver_wrote_unoffered_features_restores() {
        let (mut d, _) = rng_driver();
        d.add_status(STATUS_ACKNOWLEDGE);
        d.add_status(STATUS_DRIVER);
        // Not yet accepted: the register just holds what the driver wrote.
        d.write_driver_features(1 | VERSION_1);
        let state = through_file(&d.transport.save().unwrap());
        let mem = d.transport_memory();
        let mut restored = Driver::new(Box::new(Rng::new()), &mem);
        restored.transport =
            MmioTransport::restore(Box::new(Rng::new()), mem, restored.line.clone(), &state)
                .unwrap();
        // The device still refuses them at FEATURES_OK.
        restored.add_status(STATUS_FEATURES_OK);
        assert_eq!(restored.read32(regs::STATUS) & STATUS_FEATURES_OK, 0);
    }

    #[test]
    fn the_transport_can_move_to_another_thread() {
        fn is_send<T: Send>() {}
        is_send::<MmioTransport>();
    }

    #[test]
    fn a_pending_interrupt_is_raised_again_on_restore() {
        let (mut d, mut ring) = rng_driver();
        d.bring_up(&ring);
        ring.set_desc(0, BUF, 8, W, 0);
        ring.publish(0);
        d.notify(0);
        let state = d.transport.save().unwrap();
        assert_eq!(state.interrupt_status, INTERRUPT_USED_BUFFER);
        let line = Arc::new(RecordingLine::default());
        let restored =
            MmioTransport::restore(Box::new(Rng::new()), ring.mem.clone(), line.clone(), &state)
                .unwrap();
        assert!(line.asserted());
        let mut data = [0u8; 4];
        restored.read(regs::INTERRUPT_STATUS, &mut data);
        assert_eq!(u32::from_le_bytes(data), INTERRUPT_USED_BUFFER);
    }

    #[test]
    fn a_device_saved_mid_negotiation_can_finish_after_restore() {
        let (mut d, ring) = rng_driver();
        assert!(d.negotiate(VERSION_1));
        let state = through_file(&d.transport.save().unwrap());
        let mut restored = Driver::new(Box::new(Rng::new()), &ring.mem);
        restored.transport = MmioTransport::restore(
            Box::new(Rng::new()),
            ring.mem.clone(),
            restored.line.clone(),
            &state,
        )
        .unwrap();
        assert!(!restored.transport.is_activated());
        assert!(restored.setup_queue(0, &ring.layout));
        restored.add_status(STATUS_DRIVER_OK);
        assert!(restored.transport.is_activated());
    }

    #[test]
    fn random_register_writes_and_ring_garbage_never_panic() {
        use crate::virtio::test_driver::{XorShift, AVAIL, DESC, USED};
        let (mut d, ring) = rng_driver();
        let mut rng = XorShift(0x2545_F491_4F6C_DD1D);
        let offsets = [
            regs::DEVICE_FEATURES_SEL,
            regs::DRIVER_FEATURES,
            regs::DRIVER_FEATURES_SEL,
            regs::QUEUE_SEL,
            regs::QUEUE_NUM,
            regs::QUEUE_READY,
            regs::QUEUE_NOTIFY,
            regs::INTERRUPT_ACK,
            regs::STATUS,
            regs::QUEUE_DESC_LOW,
            regs::QUEUE_DESC_HIGH,
            regs::QUEUE_DRIVER_LOW,
            regs::QUEUE_DEVICE_LOW,
            regs::CONFIG,
        ];
        for round in 0..5000u32 {
            if round.is_multiple_of(100) {
                rng.scribble(&ring.mem, DESC, 16 * 16);
                rng.scribble(&ring.mem, AVAIL, 64);
                rng.scribble(&ring.mem, USED, 64);
            }
            if round.is_multiple_of(500) {
                d.bring_up(&ring);
            }
            let v = rng.next();
            let offset = if v.is_multiple_of(4) {
                (v >> 8) % (MMIO_WINDOW_SIZE + 16)
            } else {
                offsets[(v >> 8) as usize % offsets.len()]
            };
            let value = match (v >> 32) % 4 {
                0 => (v >> 40) as u32 & 0xff,
                1 => 0,
                _ => (v >> 32) as u32,
            };
            let len = [4usize, 4, 4, 1, 2, 8][(v >> 20) as usize % 6];
            let mut data = value.to_le_bytes().to_vec();
            data.resize(len, 0);
            d.transport.write(offset, &data);
            d.transport.read(offset, &mut data);
        }
        // The device still comes up and serves a request afterwards.
        let mut ring = Ring::new(&ring.mem, 16);
        ring.mem.write_obj(0u16, GuestAddress(USED + 2)).unwrap();
        ring.set_avail_idx(0);
        ring.set_avail_flags(0);
        d.bring_up(&ring);
        ring.set_desc(0, BUF, 16, W, 0);
        ring.publish(0);
        d.notify(0);
        assert_eq!(ring.used(0), (0, 16));
    }
}
