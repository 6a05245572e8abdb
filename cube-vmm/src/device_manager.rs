//! Virtio devices attached to a running VM: each gets a 4 KiB window on the MMIO bus
//! after the control device, an interrupt line (an irqfd into the in-kernel irqchip),
//! one ioeventfd per queue so queue notifications never stop a vCPU, and an entry on
//! the kernel command line (`virtio_mmio.device=`) so Linux finds it without ACPI.

use std::sync::{Arc, Mutex, MutexGuard};

use kvm_ioctls::{IoEventAddress, VmFd};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::layout::{CONTROL_DEVICE_ADDR, CONTROL_DEVICE_SIZE, MMIO_HOLE_END};
use cube_devices::event_loop::{DeviceEventLoop, EventLoopError, Subscriber};
use cube_devices::mmio_bus::{MmioBus, MmioBusError};
use cube_devices::records::{DeviceKind, DeviceRecord};
use cube_devices::virtio::device::{DeviceError, VirtioDevice};
use cube_devices::virtio::interrupt::IrqFdLine;
use cube_devices::virtio::mmio::{regs, MmioTransport, MMIO_WINDOW_SIZE};
use cube_devices::virtio::persist::{PersistError, VirtioMmioState};
use cube_devices::virtio::slot::{SlotEvents, VirtioSlot};
use cube_devices::virtio::VirtioMemory;

/// Guest physical address of the first virtio-mmio window (right after the control
/// device).
pub const VIRTIO_MMIO_BASE: u64 = CONTROL_DEVICE_ADDR + CONTROL_DEVICE_SIZE;
/// Interrupt line of the first device; 4 is COM1, lines below are the PIT, keyboard
/// and cascade.
pub const VIRTIO_FIRST_IRQ: u32 = 5;
/// Most virtio devices a VM can have: one IOAPIC pin each, up to pin 23.
pub const MAX_VIRTIO_DEVICES: usize = 19;

/// Why devices could not be attached, saved or restored.
#[derive(Debug, thiserror::Error)]
pub enum VirtioDevicesError {
    /// More devices than interrupt lines.
    #[error("{0} virtio devices requested, at most {MAX_VIRTIO_DEVICES} fit")]
    TooMany(usize),
    /// An eventfd could not be created.
    #[error("Creating an eventfd failed")]
    EventFd(#[source] std::io::Error),
    /// `KVM_IRQFD` failed.
    #[error("Registering the irqfd for interrupt {irq} failed")]
    IrqFd {
        /// The interrupt line.
        irq: u32,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// `KVM_IOEVENTFD` failed.
    #[error("Registering the queue-notify ioeventfd at {addr:#x} failed")]
    IoEventFd {
        /// The register's guest physical address.
        addr: u64,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The device window could not go on the bus.
    #[error("Placing a virtio device on the MMIO bus failed")]
    Bus(#[from] MmioBusError),
    /// The event loop did not start.
    #[error("Starting the device event loop failed")]
    EventLoop(#[from] EventLoopError),
    /// The snapshot has a different number of devices than the VM.
    #[error("Snapshot has {state} virtio devices, the VM has {devices}")]
    DeviceCount {
        /// Devices in the snapshot.
        state: usize,
        /// Devices given.
        devices: usize,
    },
    /// A device's saved state was refused.
    #[error("Restoring virtio device {index} failed")]
    Restore {
        /// The device's position.
        index: usize,
        /// Why.
        #[source]
        source: PersistError,
    },
    /// A device's own state could not be saved.
    #[error("Saving virtio device {index} failed")]
    Save {
        /// Position of the device.
        index: usize,
        /// Why.
        #[source]
        source: cube_devices::virtio::device_state::DeviceStateError,
    },
    /// A device of a type snapshots cannot record.
    #[error("Virtio device type {0} cannot be saved")]
    UnknownDevice(u32),
    /// A restored clone could not change its per-clone state.
    #[error("Preparing virtio device {index} as a clone failed")]
    Clone {
        /// The device's position.
        index: usize,
        /// Why.
        #[source]
        source: DeviceError,
    },
}

/// One attached device.
pub struct AttachedDevice {
    /// Guest physical address of its window.
    pub base: u64,
    /// Its interrupt line (GSI).
    pub irq: u32,
    /// The transport, shared with the bus and the event loop.
    pub slot: VirtioSlot,
    notify: Vec<EventFd>,
}

impl AttachedDevice {
    /// The `virtio_mmio.device=` command-line entry Linux finds the device through.
    pub fn cmdline_entry(&self) -> String {
        format!("virtio_mmio.device=4K@{:#x}:{}", self.base, self.irq)
    }

    /// Signals queue `index` the way KVM does for a guest write to QueueNotify.
    pub fn notify_as_guest(&self, index: usize) -> std::io::Result<()> {
        match self.notify.get(index) {
            Some(event) => event.write(1),
            None => Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
        }
    }
}

/// The virtio devices of a VM and the loop serving them. Dropping it stops the loop.
pub struct VirtioDevices {
    devices: Vec<AttachedDevice>,
    event_loop: Option<DeviceEventLoop>,
}

/// What goes into a slot: a fresh device, or one restored from saved state.
enum Start<'a> {
    Fresh,
    Restored(&'a VirtioMmioState),
}

impl VirtioDevices {
    /// Attaches `devices` (in order: first at [`VIRTIO_MMIO_BASE`], interrupt
    /// [`VIRTIO_FIRST_IRQ`]) to `vm`, puts them on `bus` and starts their event loop.
    /// `vm` needs an in-kernel irqchip.
    pub fn attach(
        vm: &VmFd,
        memory: &VirtioMemory,
        bus: &mut MmioBus,
        devices: Vec<Box<dyn VirtioDevice>>,
    ) -> Result<Self, VirtioDevicesError> {
        let starts = devices.into_iter().map(|d| (d, Start::Fresh)).collect();
        Self::build(vm, memory, bus, starts)
    }

    /// Attaches `devices` in the states `states` saved by [`VirtioDevices::save`];
    /// where `cloned`, each device is then told it is a clone (reseeds, bumps its
    /// generation) so two VMs restored from one snapshot never share that state.
    pub fn restore(
        vm: &VmFd,
        memory: &VirtioMemory,
        bus: &mut MmioBus,
        devices: Vec<Box<dyn VirtioDevice>>,
        states: &[DeviceRecord],
        cloned: bool,
    ) -> Result<Self, VirtioDevicesError> {
        if states.len() != devices.len() {
            return Err(VirtioDevicesError::DeviceCount {
                state: states.len(),
                devices: devices.len(),
            });
        }
        let starts = devices
            .into_iter()
            .zip(states)
            .map(|(d, s)| (d, Start::Restored(&s.state)))
            .collect();
        let attached = Self::build(vm, memory, bus, starts)?;
        if cloned {
            for (index, device) in attached.devices.iter().enumerate() {
                device
                    .slot
                    .lock()
                    .mark_cloned()
                    .map_err(|source| VirtioDevicesError::Clone { index, source })?;
            }
        }
        Ok(attached)
    }

    fn build(
        vm: &VmFd,
        memory: &VirtioMemory,
        bus: &mut MmioBus,
        starts: Vec<(Box<dyn VirtioDevice>, Start<'_>)>,
    ) -> Result<Self, VirtioDevicesError> {
        if starts.len() > MAX_VIRTIO_DEVICES {
            return Err(VirtioDevicesError::TooMany(starts.len()));
        }
        let mut devices = Vec::with_capacity(starts.len());
        let mut subscribers: Vec<Subscriber> = Vec::with_capacity(starts.len());
        for (index, (device, start)) in starts.into_iter().enumerate() {
            let base = VIRTIO_MMIO_BASE + index as u64 * MMIO_WINDOW_SIZE;
            debug_assert!(base + MMIO_WINDOW_SIZE < MMIO_HOLE_END);
            let irq = VIRTIO_FIRST_IRQ + index as u32;
            let irqfd = EventFd::new(libc::EFD_NONBLOCK).map_err(VirtioDevicesError::EventFd)?;
            vm.register_irqfd(&irqfd, irq)
                .map_err(|source| VirtioDevicesError::IrqFd { irq, source })?;
            let line = Arc::new(IrqFdLine::new(irqfd));
            let transport = match start {
                Start::Fresh => MmioTransport::new(device, memory.clone(), line),
                Start::Restored(state) => {
                    MmioTransport::restore(device, memory.clone(), line, state)
                        .map_err(|source| VirtioDevicesError::Restore { index, source })?
                }
            };
            let mut notify = Vec::with_capacity(transport.queue_count());
            let notify_addr = base + regs::QUEUE_NOTIFY;
            for queue in 0..transport.queue_count() {
                let event =
                    EventFd::new(libc::EFD_NONBLOCK).map_err(VirtioDevicesError::EventFd)?;
                vm.register_ioevent(&event, &IoEventAddress::Mmio(notify_addr), queue as u32)
                    .map_err(|source| VirtioDevicesError::IoEventFd {
                        addr: notify_addr,
                        source,
                    })?;
                notify.push(event);
            }
            let slot = VirtioSlot::new(transport);
            bus.insert(base, MMIO_WINDOW_SIZE, Arc::new(slot.clone()))?;
            let events = notify
                .iter()
                .map(EventFd::try_clone)
                .collect::<Result<Vec<_>, _>>()
                .map_err(VirtioDevicesError::EventFd)?;
            subscribers.push(Arc::new(Mutex::new(SlotEvents::new(slot.clone(), events))));
            devices.push(AttachedDevice {
                base,
                irq,
                slot,
                notify,
            });
        }
        let event_loop = DeviceEventLoop::start(subscribers)?;
        Ok(VirtioDevices {
            devices,
            event_loop: Some(event_loop),
        })
    }

    /// The attached devices, in attachment order.
    pub fn devices(&self) -> &[AttachedDevice] {
        &self.devices
    }

    /// The command-line entries of every device, space separated.
    pub fn cmdline(&self) -> String {
        self.devices
            .iter()
            .map(AttachedDevice::cmdline_entry)
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The state of every device, for a snapshot taken while the vCPUs are paused.
    pub fn save(&self) -> Result<Vec<DeviceRecord>, VirtioDevicesError> {
        self.quiesce().save()
    }

    /// Holds every device still: each transport stays locked until the returned
    /// guard is dropped, so neither the event loop (queue notifications, host-side
    /// traffic) nor a vCPU can make a device touch guest memory, its disk or its state
    /// meanwhile. With the vCPUs paused, guest memory and device state then describe
    /// one instant. Locks are taken in attachment order.
    pub fn quiesce(&self) -> Quiesced<'_> {
        Quiesced {
            transports: self.devices.iter().map(|d| d.slot.lock()).collect(),
        }
    }
}

/// Every device of a VM held still (see [`VirtioDevices::quiesce`]).
pub struct Quiesced<'a> {
    transports: Vec<MutexGuard<'a, MmioTransport>>,
}

impl Quiesced<'_> {
    /// The state of every device, in attachment order.
    pub fn save(&self) -> Result<Vec<DeviceRecord>, VirtioDevicesError> {
        self.transports
            .iter()
            .enumerate()
            .map(|(index, transport)| {
                let state = transport
                    .save()
                    .map_err(|source| VirtioDevicesError::Save { index, source })?;
                let kind = DeviceKind::from_device_type(state.device_type)
                    .ok_or(VirtioDevicesError::UnknownDevice(state.device_type))?;
                Ok(DeviceRecord { kind, state })
            })
            .collect()
    }
}

impl Drop for VirtioDevices {
    fn drop(&mut self) {
        // Stop serving before the transports (and their memory) go away.
        self.event_loop.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cube_devices::virtio::interrupt::INTERRUPT_USED_BUFFER;
    use cube_devices::virtio::queue::VIRTQ_DESC_F_WRITE;
    use cube_devices::virtio::rng::Rng;
    use cube_devices::virtio::test_driver::{memory, Ring, BUF};
    use cube_devices::virtio::{
        STATUS_ACKNOWLEDGE, STATUS_DRIVER, STATUS_DRIVER_OK, STATUS_FEATURES_OK, VIRTIO_F_VERSION_1,
    };
    use std::time::{Duration, Instant};

    fn vm_with_irqchip() -> Option<VmFd> {
        let kvm = match kvm_ioctls::Kvm::new() {
            Ok(kvm) => kvm,
            Err(e) => {
                eprintln!("skipping: /dev/kvm unavailable: {e}");
                return None;
            }
        };
        let vm = kvm.create_vm().unwrap();
        vm.create_irq_chip().unwrap();
        Some(vm)
    }

    fn bus_write32(bus: &MmioBus, addr: u64, value: u32) {
        assert!(bus.write(addr, &value.to_le_bytes()));
    }

    fn bus_read32(bus: &MmioBus, addr: u64) -> u32 {
        let mut data = [0u8; 4];
        assert!(bus.read(addr, &mut data));
        u32::from_le_bytes(data)
    }

    /// The guest driver's bring-up of the device at `base` with its queue 0 on `ring`,
    /// through the bus as a vCPU's MMIO exits would.
    fn bring_up(bus: &MmioBus, base: u64, ring: &Ring) {
        for status in [STATUS_ACKNOWLEDGE, STATUS_ACKNOWLEDGE | STATUS_DRIVER] {
            bus_write32(bus, base + regs::STATUS, status);
        }
        bus_write32(bus, base + regs::DRIVER_FEATURES_SEL, 1);
        bus_write32(
            bus,
            base + regs::DRIVER_FEATURES,
            1 << (VIRTIO_F_VERSION_1 - 32),
        );
        let features_ok = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK;
        bus_write32(bus, base + regs::STATUS, features_ok);
        let layout = &ring.layout;
        for (reg, value) in [
            (regs::QUEUE_SEL, 0),
            (regs::QUEUE_NUM, 16),
            (regs::QUEUE_DESC_LOW, layout.desc_table as u32),
            (regs::QUEUE_DRIVER_LOW, layout.avail_ring as u32),
            (regs::QUEUE_DEVICE_LOW, layout.used_ring as u32),
            (regs::QUEUE_READY, 1),
            (regs::STATUS, features_ok | STATUS_DRIVER_OK),
        ] {
            bus_write32(bus, base + reg, value);
        }
    }

    /// The master PIC's interrupt request register: an edge on a line sets its bit.
    fn pic_irr(vm: &VmFd) -> u8 {
        let mut chip = kvm_bindings::kvm_irqchip {
            chip_id: kvm_bindings::KVM_IRQCHIP_PIC_MASTER,
            ..Default::default()
        };
        vm.get_irqchip(&mut chip).unwrap();
        // SAFETY: chip_id PIC_MASTER makes KVM fill the `pic` member of the union.
        unsafe { chip.chip.pic.irr }
    }

    #[test]
    fn devices_get_windows_irqs_and_command_line_entries() {
        let Some(vm) = vm_with_irqchip() else { return };
        let mem = memory();
        let mut bus = MmioBus::new();
        let devices: Vec<Box<dyn VirtioDevice>> = vec![Box::new(Rng::new()), Box::new(Rng::new())];
        let attached = VirtioDevices::attach(&vm, &mem, &mut bus, devices).unwrap();
        assert_eq!(
            attached.cmdline(),
            "virtio_mmio.device=4K@0xd0001000:5 virtio_mmio.device=4K@0xd0002000:6"
        );
        for d in attached.devices() {
            assert_eq!(bus_read32(&bus, d.base + regs::MAGIC_VALUE), 0x7472_6976);
            assert_eq!(bus_read32(&bus, d.base + regs::DEVICE_ID), 4);
        }
        let too_many: Vec<Box<dyn VirtioDevice>> = (0..=MAX_VIRTIO_DEVICES)
            .map(|_| Box::new(Rng::new()) as Box<dyn VirtioDevice>)
            .collect();
        assert!(matches!(
            VirtioDevices::attach(&vm, &mem, &mut MmioBus::new(), too_many),
            Err(VirtioDevicesError::TooMany(20))
        ));
    }

    #[test]
    fn a_notification_through_the_ioeventfd_is_served_and_interrupts_through_kvm() {
        let Some(vm) = vm_with_irqchip() else { return };
        let mem = memory();
        let mut bus = MmioBus::new();
        let attached =
            VirtioDevices::attach(&vm, &mem, &mut bus, vec![Box::new(Rng::new())]).unwrap();
        let base = attached.devices()[0].base;
        let mut ring = Ring::new(&mem, 16);
        bring_up(&bus, base, &ring);
        assert!(attached.devices()[0].slot.lock().is_activated());
        assert_eq!(pic_irr(&vm) & (1 << 5), 0);

        ring.set_desc(0, BUF, 64, VIRTQ_DESC_F_WRITE, 0);
        ring.publish(0);
        attached.devices()[0].notify_as_guest(0).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while ring.used_idx() == 0 {
            assert!(
                Instant::now() < deadline,
                "the event loop never served the queue"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(ring.used(0), (0, 64));
        assert_eq!(
            bus_read32(&bus, base + regs::INTERRUPT_STATUS),
            INTERRUPT_USED_BUFFER
        );
        // The irqfd reached KVM's interrupt controller as an edge on line 5.
        let deadline = Instant::now() + Duration::from_secs(10);
        while pic_irr(&vm) & (1 << 5) == 0 {
            assert!(Instant::now() < deadline, "irq 5 never reached the PIC");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn a_disk_request_pending_at_snapshot_is_served_by_the_restored_clone() {
        use cube_devices::virtio::block::{Block, BlockOptions, VIRTIO_BLK_T_OUT};
        use cube_devices::virtio::queue::VIRTQ_DESC_F_NEXT;
        let Some(vm) = vm_with_irqchip() else { return };
        let img = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(img.path(), vec![0u8; 4096]).unwrap();
        let mem = memory();
        let mut bus = MmioBus::new();
        let blk = Block::open(img.path(), BlockOptions::default()).unwrap();
        let attached = VirtioDevices::attach(
            &vm,
            &mem,
            &mut bus,
            vec![Box::new(blk), Box::new(Rng::new())],
        )
        .unwrap();
        let base = attached.devices()[0].base;
        let mut ring = Ring::new(&mem, 16);
        bring_up(&bus, base, &ring);
        // A write request is made available; the VM is snapshotted before the notify.
        let (hdr, data, status) = (BUF, BUF + 0x1000, BUF + 0x2000);
        use vm_memory::{Bytes, GuestAddress};
        mem.write_obj(VIRTIO_BLK_T_OUT, GuestAddress(hdr)).unwrap();
        mem.write_obj(2u64, GuestAddress(hdr + 8)).unwrap();
        mem.write_slice(&[0x77; 512], GuestAddress(data)).unwrap();
        ring.set_desc(0, hdr, 16, VIRTQ_DESC_F_NEXT, 1);
        ring.set_desc(1, data, 512, VIRTQ_DESC_F_NEXT, 2);
        ring.set_desc(2, status, 1, VIRTQ_DESC_F_WRITE, 0);
        ring.publish(0);
        let records = attached.save().unwrap();
        assert_eq!(records[0].kind, DeviceKind::Block);
        assert_eq!(records[1].kind, DeviceKind::Rng);
        drop(attached);

        let vm2 = vm_with_irqchip().unwrap();
        let mut bus2 = MmioBus::new();
        let blk = Block::open(img.path(), BlockOptions::default()).unwrap();
        let restored = VirtioDevices::restore(
            &vm2,
            &mem,
            &mut bus2,
            vec![Box::new(blk), Box::new(Rng::new())],
            &records,
            true,
        )
        .unwrap();
        restored.devices()[0].notify_as_guest(0).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while ring.used_idx() == 0 {
            assert!(
                Instant::now() < deadline,
                "the restored device never served"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(
            &std::fs::read(img.path()).unwrap()[1024..1536],
            &[0x77; 512]
        );
        // The clone's rng moved to a new generation.
        assert_ne!(
            bus_read32(&bus2, restored.devices()[1].base + regs::CONFIG_GENERATION),
            0
        );
        // A snapshot with devices in another order is refused.
        let blk = Block::open(img.path(), BlockOptions::default()).unwrap();
        assert!(VirtioDevices::restore(
            &vm_with_irqchip().unwrap(),
            &mem,
            &mut MmioBus::new(),
            vec![Box::new(Rng::new()), Box::new(blk)],
            &records,
            false,
        )
        .is_err());
    }
}
