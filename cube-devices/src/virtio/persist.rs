//! Snapshot state of a virtio-mmio device, and the checks it passes before a restore.
//!
//! A state file may be stale, corrupt or crafted, so [`VirtioMmioState::validate`]
//! checks every field against the device it is restored into and against guest
//! memory before anything is applied.

use serde::{Deserialize, Serialize};

use super::device::{DeviceError, VirtioDevice};
use super::interrupt::{INTERRUPT_CONFIG_CHANGE, INTERRUPT_USED_BUFFER};
use super::queue::{QueueError, QueueLayout, MAX_QUEUE_SIZE};
use super::{
    VirtioMemory, STATUS_ACKNOWLEDGE, STATUS_DEVICE_NEEDS_RESET, STATUS_DRIVER, STATUS_DRIVER_OK,
    STATUS_FAILED, STATUS_FEATURES_OK, VIRTIO_F_VERSION_1,
};

/// Why saved virtio-mmio state cannot be restored.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// The state belongs to another kind of device.
    #[error("State is for device type {state}, device is type {device}")]
    DeviceType {
        /// Device type in the state.
        state: u32,
        /// Device type of the device.
        device: u32,
    },
    /// The state has a different number of queues than the device.
    #[error("State has {state} queues, device has {device}")]
    QueueCount {
        /// Queues in the state.
        state: usize,
        /// Queues of the device.
        device: usize,
    },
    /// The status has unknown bits or skips a step of driver initialisation.
    #[error("Device status {0:#x} is not a reachable status")]
    Status(u32),
    /// The driver features include bits the device does not offer.
    #[error("Driver features {acked:#x} are not a subset of offered {offered:#x}")]
    Features {
        /// Features in the state.
        acked: u64,
        /// Features the device offers.
        offered: u64,
    },
    /// Features were accepted without VIRTIO_F_VERSION_1.
    #[error("Accepted features lack VIRTIO_F_VERSION_1")]
    NoVersion1,
    /// A queue size is not a power of two within the device's maximum.
    #[error("Queue {index} size {size} is not a power of two in 1..={max}")]
    QueueSize {
        /// The queue.
        index: usize,
        /// Its size in the state.
        size: u16,
        /// The device's maximum.
        max: u16,
    },
    /// A ready queue's rings are misplaced.
    #[error("Queue {index} is invalid")]
    Queue {
        /// The queue.
        index: usize,
        /// What is wrong with it.
        #[source]
        source: QueueError,
    },
    /// A queue has ring positions but is not ready.
    #[error("Queue {index} is not ready but has ring positions")]
    PositionsWithoutQueue {
        /// The queue.
        index: usize,
    },
    /// The device is driven (DRIVER_OK) but a queue is not ready.
    #[error("Queue {index} is not ready although the driver is")]
    QueueNotReady {
        /// The queue.
        index: usize,
    },
    /// The interrupt status has unknown bits.
    #[error("Interrupt status {0:#x} has unknown bits")]
    InterruptStatus(u32),
    /// The device refused its state or could not start.
    #[error("Device could not be restored")]
    Device(#[source] DeviceError),
}

/// Saved state of one queue: what the driver programmed and how far the device got.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueState {
    /// Number of descriptors (QueueNum).
    pub size: u16,
    /// Whether the driver enabled the queue (QueueReady).
    pub ready: bool,
    /// Guest physical address of the descriptor table.
    pub desc_table: u64,
    /// Guest physical address of the available ring.
    pub avail_ring: u64,
    /// Guest physical address of the used ring.
    pub used_ring: u64,
    /// Next available-ring entry the device will take.
    pub next_avail: u16,
    /// Next used-ring entry the device will fill.
    pub next_used: u16,
}

impl QueueState {
    /// The ring geometry.
    pub fn layout(&self) -> QueueLayout {
        QueueLayout {
            size: self.size,
            desc_table: self.desc_table,
            avail_ring: self.avail_ring,
            used_ring: self.used_ring,
        }
    }
}

/// Saved state of a virtio-mmio transport and its device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtioMmioState {
    /// The virtio device type, checked on restore.
    pub device_type: u32,
    /// The Status register.
    pub status: u32,
    /// The features the driver accepted.
    pub driver_features: u64,
    /// DeviceFeaturesSel.
    pub device_features_sel: u32,
    /// DriverFeaturesSel.
    pub driver_features_sel: u32,
    /// QueueSel.
    pub queue_select: u32,
    /// One entry a queue of the device.
    pub queues: Vec<QueueState>,
    /// The InterruptStatus register.
    pub interrupt_status: u32,
    /// ConfigGeneration.
    pub config_generation: u32,
    /// The device's own state ([`VirtioDevice::save_state`]).
    #[serde(with = "serde_bytes")]
    pub device_state: Vec<u8>,
}

/// The status bits a driver may have set, in the order it must set them.
const INIT_STEPS: [u32; 4] = [
    STATUS_ACKNOWLEDGE,
    STATUS_DRIVER,
    STATUS_FEATURES_OK,
    STATUS_DRIVER_OK,
];

impl VirtioMmioState {
    /// Whether the device was running (activated) when saved: the driver set DRIVER_OK
    /// and activation did not fail (which sets DEVICE_NEEDS_RESET). A driver may set
    /// FAILED afterwards; the device keeps its queues until reset.
    pub fn is_activated(&self) -> bool {
        self.status & STATUS_DRIVER_OK != 0 && self.status & STATUS_DEVICE_NEEDS_RESET == 0
    }

    /// Checks the state against `device` and `memory`.
    pub fn validate(
        &self,
        device: &dyn VirtioDevice,
        memory: &VirtioMemory,
    ) -> Result<(), PersistError> {
        if self.device_type != device.device_type() {
            return Err(PersistError::DeviceType {
                state: self.device_type,
                device: device.device_type(),
            });
        }
        let max_sizes = device.queue_max_sizes();
        if self.queues.len() != max_sizes.len() {
            return Err(PersistError::QueueCount {
                state: self.queues.len(),
                device: max_sizes.len(),
            });
        }
        validate_status(self.status)?;
        let offered = device.features();
        // Before FEATURES_OK the DriverFeatures register holds whatever the driver
        // wrote (the device refuses bad bits only when FEATURES_OK is set), so only an
        // accepted feature set must be a subset. (Found by the virtio_mmio fuzz target:
        // a guest could otherwise make its own snapshot unrestorable.)
        if self.status & STATUS_FEATURES_OK != 0 && self.driver_features & !offered != 0 {
            return Err(PersistError::Features {
                acked: self.driver_features,
                offered,
            });
        }
        if self.status & STATUS_FEATURES_OK != 0
            && self.driver_features & (1 << VIRTIO_F_VERSION_1) == 0
        {
            return Err(PersistError::NoVersion1);
        }
        let activated = self.is_activated();
        for (index, (queue, &max)) in self.queues.iter().zip(max_sizes).enumerate() {
            let max = max.min(MAX_QUEUE_SIZE);
            if queue.size == 0 || !queue.size.is_power_of_two() || queue.size > max {
                return Err(PersistError::QueueSize {
                    index,
                    size: queue.size,
                    max,
                });
            }
            if queue.ready {
                queue
                    .layout()
                    .validate(memory, max)
                    .map_err(|source| PersistError::Queue { index, source })?;
            } else if activated {
                return Err(PersistError::QueueNotReady { index });
            }
            if !activated && (queue.next_avail != 0 || queue.next_used != 0) {
                return Err(PersistError::PositionsWithoutQueue { index });
            }
        }
        if self.interrupt_status & !(INTERRUPT_USED_BUFFER | INTERRUPT_CONFIG_CHANGE) != 0 {
            return Err(PersistError::InterruptStatus(self.interrupt_status));
        }
        Ok(())
    }
}

fn validate_status(status: u32) -> Result<(), PersistError> {
    let known =
        INIT_STEPS.iter().fold(0, |acc, s| acc | s) | STATUS_DEVICE_NEEDS_RESET | STATUS_FAILED;
    if status & !known != 0 {
        return Err(PersistError::Status(status));
    }
    // The initialisation bits must be a prefix of the steps: no step without the
    // ones before it.
    let mut gap = false;
    for step in INIT_STEPS {
        let set = status & step != 0;
        if set && gap {
            return Err(PersistError::Status(status));
        }
        gap |= !set;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::mmio::MmioTransport;
    use crate::virtio::rng::Rng;
    use crate::virtio::test_driver::RecordingLine;
    use crate::virtio::test_driver::{memory, Driver, Ring, HIGH_REGION, REGION_SIZE};
    use crate::virtio::VIRTIO_ID_RNG;
    use std::sync::Arc;

    /// The state of a running rng with one queue at `ring`.
    fn running_state() -> (VirtioMmioState, VirtioMemory) {
        let mem = memory();
        let mut d = Driver::new(Box::new(Rng::new()), &mem);
        d.bring_up(&Ring::new(&mem, 16));
        (d.transport.save(), mem)
    }

    fn restore(state: &VirtioMmioState, mem: &VirtioMemory) -> Result<MmioTransport, PersistError> {
        MmioTransport::restore(
            Box::new(Rng::new()),
            mem.clone(),
            Arc::new(RecordingLine::default()),
            state,
        )
    }

    #[test]
    fn a_valid_state_restores() {
        let (state, mem) = running_state();
        assert!(state.is_activated());
        assert_eq!(restore(&state, &mem).unwrap().save(), state);
    }

    #[test]
    fn malformed_states_are_rejected() {
        let (good, mem) = running_state();
        type Edit = fn(&mut VirtioMmioState);
        let cases: [(&str, Edit); 13] = [
            ("device type", |s| s.device_type = VIRTIO_ID_RNG + 1),
            ("queue count", |s| s.queues.push(QueueState::default())),
            ("unknown status bit", |s| s.status |= 0x10),
            ("status gap", |s| s.status &= !STATUS_FEATURES_OK),
            ("unoffered feature", |s| s.driver_features |= 1 << 5),
            ("no VERSION_1", |s| s.driver_features = 0),
            ("size not power of two", |s| s.queues[0].size = 12),
            ("size above max", |s| s.queues[0].size = 512),
            ("size zero", |s| s.queues[0].size = 0),
            ("ring outside memory", |s| {
                s.queues[0].used_ring = HIGH_REGION + REGION_SIZE - 8
            }),
            ("ring in the hole", |s| s.queues[0].desc_table = REGION_SIZE),
            ("driver ok without ready queue", |s| {
                s.queues[0].ready = false
            }),
            ("unknown interrupt bit", |s| s.interrupt_status = 4),
        ];
        for (what, edit) in cases {
            let mut state = good.clone();
            edit(&mut state);
            assert!(restore(&state, &mem).is_err(), "{what} was accepted");
        }
        let mut state = good.clone();
        state.device_state = vec![1, 2, 3];
        assert!(matches!(
            restore(&state, &mem),
            Err(PersistError::Device(_))
        ));
    }

    #[test]
    fn an_idle_queue_has_no_ring_positions() {
        let mem = memory();
        let d = Driver::new(Box::new(Rng::new()), &mem);
        let mut state = d.transport.save();
        restore(&state, &mem).unwrap();
        state.queues[0].next_avail = 3;
        assert!(matches!(
            restore(&state, &mem),
            Err(PersistError::PositionsWithoutQueue { index: 0 })
        ));
    }

    #[test]
    fn status_must_be_a_prefix_of_the_init_steps() {
        for ok in [
            0,
            1,
            3,
            11,
            15,
            15 | STATUS_FAILED,
            3 | STATUS_DEVICE_NEEDS_RESET,
        ] {
            validate_status(ok).unwrap();
        }
        for bad in [2, 4, 8, 5, 13, 7, 0x100, 0x10] {
            assert!(validate_status(bad).is_err(), "{bad:#x}");
        }
    }
}
