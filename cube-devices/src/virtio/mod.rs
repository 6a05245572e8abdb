//! Virtio devices over the virtio-mmio (version 2) transport.
//!
//! The transport ([`mmio::MmioTransport`]) owns the registers a driver programs; a
//! device ([`device::VirtioDevice`]) owns its queues once the driver sets DRIVER_OK.
//! Every value the guest provides (queue geometry, descriptor chains, ring indices) is
//! validated before use: a malformed request is refused, never trusted.

pub mod block;
pub mod chain_io;
pub mod device;
pub mod interrupt;
pub mod mmio;
pub mod net;
pub mod persist;
pub mod queue;
pub mod rng;
pub mod slot;
pub mod tap;
#[cfg(any(test, feature = "test-driver"))]
#[doc(hidden)]
pub mod test_driver;
pub mod vsock;

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::GuestMemoryMmap;

/// Guest memory as devices see it: writes through its `Bytes` API are recorded in the
/// per-region bitmap, so device writes reach snapshots (see `cube_mem::GuestMemory`).
pub type VirtioMemory = GuestMemoryMmap<AtomicBitmap>;

/// Virtio device type of the entropy device (virtio spec 5.4).
pub const VIRTIO_ID_RNG: u32 = 4;

/// Feature bit: the device complies with virtio 1.x (required by the modern transport).
pub const VIRTIO_F_VERSION_1: u32 = 32;

/// Device status bit: the guest has noticed the device.
pub const STATUS_ACKNOWLEDGE: u32 = 1;
/// Device status bit: the guest knows how to drive the device.
pub const STATUS_DRIVER: u32 = 2;
/// Device status bit: the driver is set up and ready to drive the device.
pub const STATUS_DRIVER_OK: u32 = 4;
/// Device status bit: feature negotiation is complete.
pub const STATUS_FEATURES_OK: u32 = 8;
/// Device status bit: the device hit an error it cannot recover from without a reset.
pub const STATUS_DEVICE_NEEDS_RESET: u32 = 0x40;
/// Device status bit: the guest gave up on the device.
pub const STATUS_FAILED: u32 = 0x80;
