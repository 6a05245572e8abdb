//! A virtio-mmio transport as it sits in a running VM: on the MMIO bus for the vCPU
//! threads' register accesses, and on the device event loop for queue notifications
//! (ioeventfds) and the device's host side.

use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, MutexGuard};

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::mmio::MmioTransport;
use crate::mmio_bus::MmioDevice;

/// Event data tag of the device's backend fd (queue notifications use the queue index).
const BACKEND: u32 = u32::MAX;

/// A shared transport; the vCPU threads and the event loop take turns on it.
#[derive(Clone)]
pub struct VirtioSlot {
    transport: Arc<Mutex<MmioTransport>>,
}

impl VirtioSlot {
    /// Wraps `transport`.
    pub fn new(transport: MmioTransport) -> Self {
        VirtioSlot {
            transport: Arc::new(Mutex::new(transport)),
        }
    }

    /// The transport, locked.
    pub fn lock(&self) -> MutexGuard<'_, MmioTransport> {
        // A panic while holding the lock leaves register state whole (each field is
        // written at once): keep serving rather than cascade it.
        self.transport.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl MmioDevice for VirtioSlot {
    fn read(&self, offset: u64, data: &mut [u8]) {
        self.lock().read(offset, data);
    }

    fn write(&self, offset: u64, data: &[u8]) {
        self.lock().write(offset, data);
    }
}

/// The event-loop side of a slot: its queue-notify eventfds and backend fd.
pub struct SlotEvents {
    slot: VirtioSlot,
    notify: Vec<EventFd>,
    backend: Option<RawFd>,
}

impl SlotEvents {
    /// Serves `slot`: `notify[i]` is signalled when the guest notifies queue `i`.
    pub fn new(slot: VirtioSlot, notify: Vec<EventFd>) -> Self {
        let backend = slot.lock().device().backend_fd();
        SlotEvents {
            slot,
            notify,
            backend,
        }
    }
}

impl MutEventSubscriber for SlotEvents {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let data = events.data();
        if data == BACKEND {
            self.slot.lock().process_backend();
            return;
        }
        let Some(event) = self.notify.get(data as usize) else {
            return;
        };
        // The count is irrelevant: one pass serves everything available.
        let _ = event.read();
        if let Ok(index) = u16::try_from(data) {
            self.slot.lock().notify_queue(index);
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        for (index, event) in self.notify.iter().enumerate() {
            if let Err(e) = ops.add(Events::with_data(event, index as u32, EventSet::IN)) {
                tracing::error!(
                    queue = index,
                    "virtio: watching queue notifications failed: {e:?}"
                );
            }
        }
        if let Some(fd) = self.backend {
            if let Err(e) = ops.add(Events::with_data_raw(fd, BACKEND, EventSet::IN)) {
                tracing::error!("virtio: watching the device backend failed: {e:?}");
            }
        }
    }
}
