//! The confinement a VMM thread that serves the guest applies to itself, in the manner
//! of Firecracker's per-thread seccomp filters: once the process says how for a kind
//! of thread ([`confine_threads`]), every thread of that kind applies it before it
//! serves the guest again, and a thread started later before it serves it at all. A
//! vCPU thread checks after every return from `KVM_RUN` (the guest's MMIO, port I/O
//! and emulation assists reach host code only there); the device event loop before it
//! hands any event to a device ([`crate::event_loop`]). So none of the host code the
//! guest drives runs unconfined once the process has asked.
//!
//! Applied on the thread itself because a seccomp filter for one thread only must be
//! installed by that thread; and after the process's own filters (which it installs on
//! all threads at once, and which the kernel refuses while any thread has a filter of
//! its own). The process sets each kind once; later calls are refused.

use std::cell::Cell;
use std::sync::OnceLock;

/// Applies the confinement to the calling thread; the error says why it could not.
pub type ThreadConfinement = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

/// The kinds of thread that serve the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadKind {
    /// A vCPU thread (`vcpuN`).
    Vcpu,
    /// The device event loop (`cube-devices`): virtio queues and host-side streams.
    DeviceLoop,
}

impl ThreadKind {
    fn slot(self) -> &'static OnceLock<ThreadConfinement> {
        static VCPU: OnceLock<ThreadConfinement> = OnceLock::new();
        static DEVICE_LOOP: OnceLock<ThreadConfinement> = OnceLock::new();
        match self {
            ThreadKind::Vcpu => &VCPU,
            ThreadKind::DeviceLoop => &DEVICE_LOOP,
        }
    }
}

thread_local! {
    static APPLIED: Cell<bool> = const { Cell::new(false) };
}

/// Why a confinement could not be set.
#[derive(Debug, thiserror::Error)]
#[error("the {0:?} threads' confinement is set already")]
pub struct AlreadySet(pub ThreadKind);

/// Has every thread of `kind` in this process apply `confine` to itself before it
/// serves the guest again. Once per kind and process.
pub fn confine_threads(kind: ThreadKind, confine: ThreadConfinement) -> Result<(), AlreadySet> {
    kind.slot().set(confine).map_err(|_| AlreadySet(kind))
}

/// Applies the process's confinement for `kind` to this thread (a thread of that
/// kind) if it is set and this thread has not applied it yet. A failure leaves the
/// thread unconfined: its caller must not serve the guest on it.
pub fn confine_this_thread(kind: ThreadKind) -> Result<(), String> {
    if APPLIED.with(Cell::get) {
        return Ok(());
    }
    let Some(confine) = kind.slot().get() else {
        return Ok(());
    };
    confine()?;
    APPLIED.with(|a| a.set(true));
    Ok(())
}
