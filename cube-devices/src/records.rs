//! The devices' saved state as a snapshot stores it: which virtio device a state
//! belongs to ([`DeviceKind`], [`DeviceRecord`]) and COM1's registers
//! ([`SerialRecord`]).
//!
//! These are plain, serializable records; a snapshot's reader checks them for shape
//! and each device checks its own state field by field when it is restored.

use serde::{Deserialize, Serialize};

use crate::virtio::persist::VirtioMmioState;

/// Most bytes a 16550's receive FIFO holds.
pub const SERIAL_FIFO_BYTES: usize = 64;

/// The registers of the COM1 UART (vm-superio's `SerialState`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialRecord {
    /// Divisor latch, low byte.
    pub baud_divisor_low: u8,
    /// Divisor latch, high byte.
    pub baud_divisor_high: u8,
    /// Interrupt enable register.
    pub interrupt_enable: u8,
    /// Interrupt identification register.
    pub interrupt_identification: u8,
    /// Line control register.
    pub line_control: u8,
    /// Line status register.
    pub line_status: u8,
    /// Modem control register.
    pub modem_control: u8,
    /// Modem status register.
    pub modem_status: u8,
    /// Scratch register.
    pub scratch: u8,
    /// Received bytes the guest has not read (at most [`SERIAL_FIFO_BYTES`]).
    #[serde(with = "serde_bytes")]
    pub in_buffer: Vec<u8>,
}

/// Which virtio device a saved state belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceKind {
    /// virtio-blk.
    Block,
    /// virtio-vsock.
    Vsock,
    /// virtio-net.
    Net,
    /// virtio-rng.
    Rng,
}

impl DeviceKind {
    /// The kind of device type `device_type`, if Cube has such a device.
    pub fn from_device_type(device_type: u32) -> Option<Self> {
        [
            DeviceKind::Block,
            DeviceKind::Vsock,
            DeviceKind::Net,
            DeviceKind::Rng,
        ]
        .into_iter()
        .find(|k| k.device_type() == device_type)
    }

    /// The virtio device type id of this kind.
    pub fn device_type(self) -> u32 {
        match self {
            DeviceKind::Block => crate::virtio::block::VIRTIO_ID_BLOCK,
            DeviceKind::Vsock => crate::virtio::vsock::VIRTIO_ID_VSOCK,
            DeviceKind::Net => crate::virtio::net::VIRTIO_ID_NET,
            DeviceKind::Rng => crate::virtio::VIRTIO_ID_RNG,
        }
    }
}

/// One virtio device in a snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRecord {
    /// What the device is.
    pub kind: DeviceKind,
    /// Transport and device state.
    pub state: VirtioMmioState,
}
