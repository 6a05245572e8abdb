//! What a virtio device does behind the transport.
//!
//! Modelled on Firecracker's `VirtioDevice`: the transport negotiates features and
//! collects queue geometry; once the driver sets DRIVER_OK it hands the validated queues,
//! guest memory and the interrupt to the device, which owns them until reset.

use std::sync::Arc;

use super::device_state::PersistDevice;
use super::interrupt::{InterruptError, VirtioInterrupt};
use super::queue::{Queue, QueueError};
use super::VirtioMemory;

/// Why a device could not activate, serve a queue or restore its state.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The device was given a different number of queues than it has.
    #[error("Device has {expected} queues, was given {given}")]
    QueueCount {
        /// How many queues the device has.
        expected: usize,
        /// How many it was given.
        given: usize,
    },
    /// A notification named a queue the device does not have.
    #[error("Device has no queue {0}")]
    NoSuchQueue(u16),
    /// A notification arrived before the device was activated.
    #[error("Device is not activated")]
    NotActivated,
    /// The device was activated twice without a reset.
    #[error("Device is already activated")]
    AlreadyActivated,
    /// A ring could not be read or written.
    #[error("Queue {index} failed")]
    Queue {
        /// The queue.
        index: u16,
        /// What went wrong.
        #[source]
        source: QueueError,
    },
    /// The guest could not be interrupted.
    #[error("Interrupting the guest failed")]
    Interrupt(#[source] InterruptError),
    /// Reading host entropy failed.
    #[error("Reading host entropy failed")]
    Entropy(#[source] std::io::Error),
    /// Writing into a guest buffer failed.
    #[error("Writing guest buffer at {addr:#x} failed")]
    GuestWrite {
        /// Guest physical address of the write.
        addr: u64,
        /// The guest memory error.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// The device's host side failed (a file, socket or TAP device).
    #[error("Device backend failed: {what}")]
    Backend {
        /// What the device was doing.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// A virtio device, driven by a transport such as [`super::mmio::MmioTransport`]; its
/// own snapshot state comes from its [`super::device_state::Persist`] implementation.
pub trait VirtioDevice: PersistDevice + Send {
    /// The virtio device type (virtio spec 5), e.g. [`super::VIRTIO_ID_RNG`].
    fn device_type(&self) -> u32;

    /// The feature bits the device offers; must include VIRTIO_F_VERSION_1.
    fn features(&self) -> u64;

    /// The largest size of each queue, one entry a queue.
    fn queue_max_sizes(&self) -> &[u16];

    /// Fills `data` from device configuration space at `offset`; bytes past the end of
    /// the space are left as they are (the transport zeroes them first).
    fn read_config(&self, offset: u64, data: &mut [u8]);

    /// Takes a driver write of `data` at `offset` of configuration space; writes to
    /// read-only or absent fields are dropped.
    fn write_config(&mut self, offset: u64, data: &[u8]);

    /// Where the device keeps what activation hands it, None before activation and
    /// after reset.
    fn active_queues(&mut self) -> &mut Option<ActiveQueues>;

    /// Starts the device with the features the driver accepted, guest memory, its
    /// queues (validated, one for each entry of [`VirtioDevice::queue_max_sizes`]) and
    /// its interrupt: every device takes them alike (see [`ActiveQueues::install`]),
    /// then [`VirtioDevice::activated`] runs.
    fn activate(
        &mut self,
        _acked_features: u64,
        memory: VirtioMemory,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Result<(), DeviceError> {
        let expected = self.queue_max_sizes().len();
        ActiveQueues::install(self.active_queues(), expected, memory, queues, interrupt)?;
        self.activated();
        Ok(())
    }

    /// What a device does once activated, before any notification (vsock tells a
    /// restored guest its connections are gone).
    fn activated(&mut self) {}

    /// Serves the buffers the driver made available in queue `index`.
    fn process_queue(&mut self, index: u16) -> Result<(), DeviceError>;

    /// The queues of an activated device (their ring positions go into snapshots), or
    /// none before activation.
    fn queues(&self) -> &[Queue];

    /// Drops the queues, memory and interrupt and returns to the state before
    /// activation.
    fn reset(&mut self) {
        *self.active_queues() = None;
    }

    /// A file descriptor the device loop polls for the device's host side (a TAP
    /// device, an epoll set of sockets), if the device has one; when it is readable
    /// the loop calls [`VirtioDevice::process_backend`].
    fn backend_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }

    /// Moves what the host side has for the guest into the device's queues.
    fn process_backend(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }

    /// Called after a restore from a snapshot that other VMs may also be restored
    /// from: anything that must differ between clones (random state, a generation
    /// counter) is changed here.
    fn on_clone(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
}

/// What an activated device owns until reset: guest memory, its queues and its interrupt.
pub struct ActiveQueues {
    /// Guest memory the queues point into.
    pub(crate) memory: VirtioMemory,
    /// The validated queues, in the device's order.
    pub(crate) queues: Vec<Queue>,
    /// The device's interrupt.
    pub(crate) interrupt: Arc<VirtioInterrupt>,
}

impl ActiveQueues {
    /// Activates a device with `expected` queues into `slot`: refused when it is active
    /// already (no reset in between) or when the transport hands over another number of
    /// queues.
    pub(crate) fn install(
        slot: &mut Option<ActiveQueues>,
        expected: usize,
        memory: VirtioMemory,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Result<(), DeviceError> {
        if slot.is_some() {
            return Err(DeviceError::AlreadyActivated);
        }
        if queues.len() != expected {
            return Err(DeviceError::QueueCount {
                expected,
                given: queues.len(),
            });
        }
        *slot = Some(ActiveQueues {
            memory,
            queues,
            interrupt,
        });
        Ok(())
    }
}

/// Copies the part of `config` at `offset` into `data`; bytes past its end stay as
/// they are.
pub(crate) fn copy_config(config: &[u8], offset: u64, data: &mut [u8]) {
    let Ok(offset) = usize::try_from(offset) else {
        return;
    };
    if offset >= config.len() {
        return;
    }
    let n = (config.len() - offset).min(data.len());
    data[..n].copy_from_slice(&config[offset..offset + n]);
}
