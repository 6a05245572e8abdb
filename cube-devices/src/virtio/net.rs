//! virtio-net (virtio spec 5.1) over a TAP device: no offloads (the host kernel
//! checksums and segments), one receive and one transmit queue, a fixed MAC.
//!
//! Frames from the TAP are taken only while the guest has receive buffers: the TAP
//! sits in the device's own edge-triggered epoll set, and a TAP left with frames
//! (no buffers) is drained again when the guest adds buffers.
//!
//! A device may also have no TAP ([`Net::disconnected`]): a VM template's guest always
//! has its NIC, and a sandbox created from it without a network keeps the NIC with
//! nothing behind it (frames the guest sends are consumed and dropped, none arrive),
//! since a guest cannot be given a device after it booted.

use std::os::fd::{AsRawFd, RawFd};

use serde::{Deserialize, Serialize};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::chain_io::Segments;
use super::device::{copy_config, ActiveQueues, DeviceError, VirtioDevice};
use super::device_state::{DeviceKind, DeviceStateError, Persist};
use super::queue::{ChainError, Queue};
use super::tap::{Tap, VNET_HDR_LEN};
use super::VIRTIO_F_VERSION_1;

/// Virtio device type of a network device.
pub const VIRTIO_ID_NET: u32 = 1;
/// Feature: the device has a MAC address in its configuration space.
pub const VIRTIO_NET_F_MAC: u32 = 5;
/// Largest frame (header included) either way: a 64 KiB IP packet plus headers.
const MAX_FRAME: usize = VNET_HDR_LEN + 65_550;
const RX: u16 = 0;
const TX: u16 = 1;
const QUEUE_SIZES: [u16; 2] = [256, 256];

/// Why a network device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The device's epoll set could not be made.
    #[error("Creating the virtio-net event set failed")]
    Epoll(#[source] std::io::Error),
}

/// Device state in a snapshot: the MAC the guest knows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    /// The device's MAC address.
    pub mac: [u8; 6],
}

/// The virtio network device.
pub struct Net {
    /// None: nothing behind the NIC.
    tap: Option<Tap>,
    mac: [u8; 6],
    epoll: Epoll,
    /// The TAP may hold frames nobody read yet (edge-triggered: no new event comes
    /// for them).
    tap_readable: bool,
    frame: Vec<u8>,
    active: Option<ActiveQueues>,
}

impl Net {
    /// A device sending and receiving through `tap`, with MAC address `mac`.
    pub fn new(tap: Tap, mac: [u8; 6]) -> Result<Self, NetError> {
        Self::with_backend(Some(tap), mac)
    }

    /// A device with MAC address `mac` and no TAP behind it: the guest's frames are
    /// dropped and none arrive.
    pub fn disconnected(mac: [u8; 6]) -> Result<Self, NetError> {
        Self::with_backend(None, mac)
    }

    fn with_backend(tap: Option<Tap>, mac: [u8; 6]) -> Result<Self, NetError> {
        let epoll = Epoll::new().map_err(NetError::Epoll)?;
        if let Some(tap) = &tap {
            epoll
                .ctl(
                    ControlOperation::Add,
                    tap.as_raw_fd(),
                    EpollEvent::new(EventSet::IN | EventSet::EDGE_TRIGGERED, 0),
                )
                .map_err(NetError::Epoll)?;
        }
        Ok(Net {
            // Frames may have arrived before the set was made.
            tap_readable: tap.is_some(),
            tap,
            mac,
            epoll,
            frame: vec![0; MAX_FRAME],
            active: None,
        })
    }

    /// The TAP behind the device, if any.
    pub fn tap_name(&self) -> Option<&str> {
        self.tap.as_ref().map(Tap::name)
    }

    /// Sends every frame the guest queued for transmission.
    fn transmit(&mut self, active: &mut ActiveQueues) -> Result<bool, DeviceError> {
        let queue_err = |source| DeviceError::Queue { index: TX, source };
        let mem = active.memory.clone();
        let mut used_any = false;
        loop {
            let queue = &mut active.queues[usize::from(TX)];
            let Some(head) = queue.pop_avail(&mem).map_err(queue_err)? else {
                break;
            };
            match queue.parse_chain(&mem, head) {
                Ok(chain) => {
                    let readable = Segments::readable(&chain);
                    let len = readable.len() as usize;
                    if len <= VNET_HDR_LEN || len > MAX_FRAME {
                        tracing::warn!(len, "virtio-net: frame of impossible length dropped");
                    } else if let Some(tap) = self.tap.as_mut() {
                        if readable.read_at(&mem, 0, &mut self.frame[..len]).is_ok() {
                            // A full TAP queue drops the frame, as a busy wire would.
                            if let Err(e) = tap.write_frame(&self.frame[..len]) {
                                tracing::debug!("virtio-net: TAP write failed: {e}");
                            }
                        }
                    }
                }
                Err(ChainError::HeadOutOfRange { .. }) => {
                    tracing::warn!(head, "virtio-net: available ring names no descriptor");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "virtio-net: malformed descriptor chain refused")
                }
            }
            active.queues[usize::from(TX)]
                .add_used(&mem, head, 0)
                .map_err(queue_err)?;
            used_any = true;
        }
        Ok(used_any)
    }

    /// Moves frames from the TAP into receive buffers while both last.
    fn receive(&mut self, active: &mut ActiveQueues) -> Result<bool, DeviceError> {
        let queue_err = |source| DeviceError::Queue { index: RX, source };
        let mem = active.memory.clone();
        let mut used_any = false;
        while self.tap_readable {
            let queue = &mut active.queues[usize::from(RX)];
            let Some(head) = queue.pop_avail(&mem).map_err(queue_err)? else {
                // No buffer: the frames wait in the TAP until the guest adds some.
                break;
            };
            let chain = match queue.parse_chain(&mem, head) {
                Ok(chain) => chain,
                Err(ChainError::HeadOutOfRange { .. }) => {
                    tracing::warn!(head, "virtio-net: available ring names no descriptor");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "virtio-net: malformed descriptor chain refused");
                    queue.add_used(&mem, head, 0).map_err(queue_err)?;
                    used_any = true;
                    continue;
                }
            };
            let read = match self.tap.as_mut() {
                Some(tap) => tap.read_frame(&mut self.frame),
                None => Err(std::io::ErrorKind::WouldBlock.into()),
            };
            let len = match read {
                Ok(n) => n,
                Err(e) => {
                    if e.kind() != std::io::ErrorKind::WouldBlock {
                        tracing::warn!("virtio-net: TAP read failed: {e}");
                    }
                    self.tap_readable = false;
                    // Nothing to put in this buffer: hand it back untouched by
                    // making it the next one taken.
                    queue.unpop_avail();
                    break;
                }
            };
            let writable = Segments::writable(&chain);
            let mut used_len = 0;
            if len < VNET_HDR_LEN || writable.len() < len as u64 {
                tracing::debug!(len, room = writable.len(), "virtio-net: frame dropped");
            } else {
                // num_buffers is 1: mergeable buffers are not offered.
                self.frame[10..12].copy_from_slice(&1u16.to_le_bytes());
                if writable.write_at(&mem, 0, &self.frame[..len]).is_ok() {
                    used_len = len as u32;
                }
            }
            active.queues[usize::from(RX)]
                .add_used(&mem, head, used_len)
                .map_err(queue_err)?;
            used_any = true;
        }
        Ok(used_any)
    }

    fn run(&mut self, tx: bool) -> Result<(), DeviceError> {
        let mut active = self.active.take().ok_or(DeviceError::NotActivated)?;
        let result = self.run_active(&mut active, tx);
        self.active = Some(active);
        result
    }

    fn run_active(&mut self, active: &mut ActiveQueues, tx: bool) -> Result<(), DeviceError> {
        let mut interrupt = false;
        if tx && self.transmit(active)? {
            interrupt |= active.queues[usize::from(TX)]
                .wants_interrupt(&active.memory)
                .map_err(|source| DeviceError::Queue { index: TX, source })?;
        }
        if self.receive(active)? {
            interrupt |= active.queues[usize::from(RX)]
                .wants_interrupt(&active.memory)
                .map_err(|source| DeviceError::Queue { index: RX, source })?;
        }
        if interrupt {
            active
                .interrupt
                .signal_used_buffer()
                .map_err(DeviceError::Interrupt)?;
        }
        Ok(())
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_NET_F_MAC
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        copy_config(&self.mac, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // The MAC is read-only once VIRTIO_F_VERSION_1 is negotiated.
    }

    fn active_queues(&mut self) -> &mut Option<ActiveQueues> {
        &mut self.active
    }

    fn process_queue(&mut self, index: u16) -> Result<(), DeviceError> {
        if usize::from(index) >= QUEUE_SIZES.len() {
            return Err(DeviceError::NoSuchQueue(index));
        }
        self.run(index == TX)
    }

    fn queues(&self) -> &[Queue] {
        self.active.as_ref().map_or(&[], |a| a.queues.as_slice())
    }

    fn backend_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn process_backend(&mut self) -> Result<(), DeviceError> {
        let mut events = [EpollEvent::default(); 1];
        // Consumes the edge so the loop's level-triggered watch on the set settles.
        let n = self
            .epoll
            .wait(0, &mut events)
            .map_err(|source| DeviceError::Backend {
                what: "waiting on the TAP".into(),
                source,
            })?;
        if n > 0 {
            self.tap_readable = true;
        }
        if self.active.is_some() {
            self.run(false)?;
        }
        Ok(())
    }
}

impl Persist for Net {
    type State = NetState;
    const KIND: DeviceKind = DeviceKind::Net;
    const VERSION: u16 = 1;

    fn save(&self) -> Result<NetState, DeviceStateError> {
        Ok(NetState { mac: self.mac })
    }

    fn restore(&mut self, saved: NetState) -> Result<(), DeviceStateError> {
        if saved.mac != self.mac {
            return Err(DeviceStateError::mismatch(
                Self::KIND,
                "MAC",
                format_mac(&saved.mac),
                format_mac(&self.mac),
            ));
        }
        Ok(())
    }
}

/// `mac` as the usual colon-separated hex.
fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
#[path = "net_tests.rs"]
mod tests;
