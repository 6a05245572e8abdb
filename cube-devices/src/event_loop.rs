//! The device event loop: one thread, apart from the vCPU threads, that waits on every
//! device's queue notifications (ioeventfds) and host-side file descriptors and serves
//! them (rust-vmm's event-manager over epoll). Before it hands any event to a device
//! it applies the process's confinement for device threads, where one is set
//! ([`crate::thread_confinement`]); a thread that cannot stops serving.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};

use crate::thread_confinement::{confine_this_thread, ThreadKind};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

/// What the loop serves: anything event-manager can dispatch to.
pub type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;

/// How long one wait may last before the loop checks whether it should stop.
const WAIT_MS: i32 = 1000;

/// Why the event loop could not start.
#[derive(Debug, thiserror::Error)]
pub enum EventLoopError {
    /// The epoll set could not be created.
    #[error("Creating the device event loop failed: {0:?}")]
    Create(event_manager::Error),
    /// The stop eventfd could not be created.
    #[error("Creating the event loop's stop event failed")]
    StopEvent(#[source] std::io::Error),
    /// The thread could not be started.
    #[error("Spawning the device event loop thread failed")]
    Spawn(#[source] std::io::Error),
}

/// A device as the loop holds it: every event goes through the thread's confinement
/// first.
struct Confined {
    device: Subscriber,
    stop: Arc<AtomicBool>,
}

impl MutEventSubscriber for Confined {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        if let Err(why) = confine_this_thread(ThreadKind::DeviceLoop) {
            tracing::error!("device event loop: confining the thread failed, stopping: {why}");
            self.stop.store(true, Ordering::SeqCst);
            return;
        }
        self.device.process(events, ops);
    }

    fn init(&mut self, ops: &mut EventOps) {
        self.device.init(ops);
    }
}

/// Ends the loop when its eventfd is written.
struct Stopper {
    event: EventFd,
    stop: Arc<AtomicBool>,
}

impl MutEventSubscriber for Stopper {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.event.read();
        self.stop.store(true, Ordering::SeqCst);
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.event, EventSet::IN)) {
            tracing::error!("device event loop: registering the stop event failed: {e:?}");
        }
    }
}

/// The running device event loop; dropping it stops and joins the thread.
pub struct DeviceEventLoop {
    stop_event: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl DeviceEventLoop {
    /// Starts a thread serving `subscribers` until the loop is dropped.
    pub fn start(subscribers: Vec<Subscriber>) -> Result<Self, EventLoopError> {
        let mut manager = EventManager::<Subscriber>::new().map_err(EventLoopError::Create)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop_event = EventFd::new(libc::EFD_NONBLOCK).map_err(EventLoopError::StopEvent)?;
        let stopper: Subscriber = Arc::new(Mutex::new(Stopper {
            event: stop_event.try_clone().map_err(EventLoopError::StopEvent)?,
            stop: Arc::clone(&stop),
        }));
        manager.add_subscriber(stopper);
        for device in subscribers {
            manager.add_subscriber(Arc::new(Mutex::new(Confined {
                device,
                stop: Arc::clone(&stop),
            })) as Subscriber);
        }
        let thread = std::thread::Builder::new()
            .name("cube-devices".into())
            .spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    // Also when no event comes: at most one wait after the process set
                    // it, the thread runs confined (each event is checked besides).
                    if let Err(why) = confine_this_thread(ThreadKind::DeviceLoop) {
                        tracing::error!("device event loop: confining the thread failed: {why}");
                        break;
                    }
                    if let Err(e) = manager.run_with_timeout(WAIT_MS) {
                        tracing::error!("device event loop: waiting failed: {e:?}");
                        break;
                    }
                }
            })
            .map_err(EventLoopError::Spawn)?;
        Ok(DeviceEventLoop {
            stop_event,
            thread: Some(thread),
        })
    }
}

impl Drop for DeviceEventLoop {
    fn drop(&mut self) {
        if let Err(e) = self.stop_event.write(1) {
            tracing::warn!("device event loop: signalling stop failed: {e}");
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::warn!("device event loop: the thread panicked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    struct Echo {
        event: EventFd,
        seen: mpsc::Sender<u64>,
    }

    impl MutEventSubscriber for Echo {
        fn process(&mut self, _events: Events, _ops: &mut EventOps) {
            if let Ok(n) = self.event.read() {
                let _ = self.seen.send(n);
            }
        }
        fn init(&mut self, ops: &mut EventOps) {
            ops.add(Events::new(&self.event, EventSet::IN)).unwrap();
        }
    }

    #[test]
    fn events_are_served_on_the_loop_thread_and_drop_stops_it() {
        let event = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let (tx, rx) = mpsc::channel();
        let echo: Subscriber = Arc::new(Mutex::new(Echo {
            event: event.try_clone().unwrap(),
            seen: tx,
        }));
        let event_loop = DeviceEventLoop::start(vec![echo]).unwrap();
        event.write(3).unwrap();
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap(),
            3
        );
        drop(event_loop);
        // The subscriber went away with the loop: its sender is dropped.
        assert!(rx.recv_timeout(std::time::Duration::from_secs(10)).is_err());
    }
}
