//! vCPU threads that can be stopped and restarted at any instruction.
//!
//! Each vCPU runs `KVM_RUN` on its own thread. To stop it the controller sets the
//! request to `Pause` and sends the thread a signal whose handler sets the vCPU's
//! `immediate_exit` flag: whether the thread is inside `KVM_RUN` (it returns `EINTR`) or
//! about to enter it (it returns at once), it comes back to the control loop and parks.
//! While parked the thread runs jobs for the controller (saving or restoring state),
//! because it owns the vCPU file descriptor.

use std::cell::Cell;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_bindings::kvm_run;
use kvm_ioctls::VcpuExit;

use cube_devices::mmio_bus::MmioBus;
use cube_devices::port_io::PortIo;

use crate::control_device::{self, ControlAction};
use crate::vstate::vcpu::Vcpu;

/// How long a controller waits for a vCPU thread to park before giving up.
const PARK_TIMEOUT: Duration = Duration::from_secs(5);

/// Why controlling a vCPU thread failed.
#[derive(Debug, thiserror::Error)]
pub enum VcpuRunnerError {
    /// The thread could not be started.
    #[error("Spawning vCPU thread {0} failed")]
    Spawn(u8, #[source] std::io::Error),
    /// The kick signal could not be delivered.
    #[error("Signalling vCPU thread {0} failed: {1}")]
    Kick(u8, i32),
    /// The thread did not park in time.
    #[error("vCPU {0} did not stop within {PARK_TIMEOUT:?}")]
    ParkTimeout(u8),
    /// The guest stopped for good.
    #[error("vCPU {0} stopped: {1}")]
    Stopped(u8, String),
    /// The thread is gone (it panicked or was already stopped).
    #[error("vCPU thread {0} is gone")]
    Gone(u8),
    /// A job must run on a parked vCPU.
    #[error("vCPU {0} must be paused first")]
    NotParked(u8),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Request {
    Run,
    Pause,
    Stop,
}

type Job = Box<dyn FnOnce(&mut Vcpu) + Send>;

struct Control {
    request: Request,
    parked: bool,
    doorbell: u64,
    /// Set once the guest hit an unrecoverable exit; the thread then stays parked.
    fatal: Option<String>,
    jobs: Vec<Job>,
}

struct Shared {
    control: Mutex<Control>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Control> {
        // A poisoned lock means a vCPU thread panicked; its state is still coherent
        // (every field is written whole), so keep going rather than cascade the panic.
        self.control.lock().unwrap_or_else(|e| e.into_inner())
    }
}

thread_local! {
    /// The `kvm_run` area of the vCPU this thread runs, for the kick signal handler.
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

fn kick_signal() -> i32 {
    libc::SIGRTMIN() + 2
}

extern "C" fn on_kick(_: libc::c_int) {
    let run = KVM_RUN.with(|r| r.get());
    if !run.is_null() {
        // SAFETY: the pointer is this thread's own mmap'ed kvm_run area, valid while the
        // thread owns its vCPU (it is cleared before the vCPU is dropped). A volatile
        // byte store is async-signal-safe.
        unsafe { std::ptr::write_volatile(&mut (*run).immediate_exit, 1) };
    }
}

fn install_kick_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid starting point; the handler only does a
        // volatile store (async-signal-safe). No SA_RESTART, so KVM_RUN returns EINTR.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_kick as *const () as usize;
            action.sa_flags = 0;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(kick_signal(), &action, std::ptr::null_mut());
        }
    });
}

/// The controller's end of one vCPU thread.
pub struct VcpuHandle {
    index: u8,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<Vcpu>>,
    pthread: libc::pthread_t,
}

impl VcpuHandle {
    /// Starts a thread for `vcpu`, parked until [`VcpuHandle::resume`].
    pub fn spawn(vcpu: Vcpu) -> Result<VcpuHandle, VcpuRunnerError> {
        Self::spawn_with_ports(vcpu, None)
    }

    /// Like [`VcpuHandle::spawn`], with port I/O going to `ports` (where `None`, reads
    /// return all ones and writes are dropped, as on an empty bus).
    pub fn spawn_with_ports(
        vcpu: Vcpu,
        ports: Option<Arc<dyn PortIo>>,
    ) -> Result<VcpuHandle, VcpuRunnerError> {
        Self::spawn_with_buses(vcpu, ports, None)
    }

    /// Like [`VcpuHandle::spawn_with_ports`], with MMIO accesses outside the control
    /// device going to `mmio` (where `None`, or where no device answers, reads return
    /// zeros and writes are dropped).
    pub fn spawn_with_buses(
        vcpu: Vcpu,
        ports: Option<Arc<dyn PortIo>>,
        mmio: Option<Arc<MmioBus>>,
    ) -> Result<VcpuHandle, VcpuRunnerError> {
        install_kick_handler();
        let index = vcpu.index();
        let shared = Arc::new(Shared {
            control: Mutex::new(Control {
                request: Request::Pause,
                parked: false,
                doorbell: 0,
                fatal: None,
                jobs: Vec::new(),
            }),
            changed: Condvar::new(),
        });
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .stack_size(256 << 10)
            .spawn(move || run_vcpu(vcpu, &thread_shared, ports.as_deref(), mmio.as_deref()))
            .map_err(|e| VcpuRunnerError::Spawn(index, e))?;
        let pthread = std::os::unix::thread::JoinHandleExt::as_pthread_t(&thread);
        let handle = VcpuHandle {
            index,
            shared,
            thread: Some(thread),
            pthread,
        };
        handle.wait_parked()?;
        Ok(handle)
    }

    /// This vCPU's index.
    pub fn index(&self) -> u8 {
        self.index
    }

    /// Lets the guest run.
    pub fn resume(&self) -> Result<(), VcpuRunnerError> {
        let mut c = self.shared.lock();
        if let Some(reason) = &c.fatal {
            return Err(VcpuRunnerError::Stopped(self.index, reason.clone()));
        }
        c.request = Request::Run;
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Asks the vCPU to stop without waiting: pair with [`VcpuHandle::wait_parked`] to
    /// stop many vCPUs in parallel.
    pub fn request_pause(&self) -> Result<(), VcpuRunnerError> {
        {
            let mut c = self.shared.lock();
            if c.request == Request::Stop {
                return Err(VcpuRunnerError::Gone(self.index));
            }
            c.request = Request::Pause;
            self.shared.changed.notify_all();
        }
        self.kick()
    }

    /// Waits until the vCPU thread is parked.
    pub fn wait_parked(&self) -> Result<(), VcpuRunnerError> {
        let c = self.shared.lock();
        let (c, timeout) = self
            .shared
            .changed
            .wait_timeout_while(c, PARK_TIMEOUT, |c| !c.parked)
            .unwrap_or_else(|e| e.into_inner());
        if timeout.timed_out() && !c.parked {
            return Err(VcpuRunnerError::ParkTimeout(self.index));
        }
        Ok(())
    }

    /// Stops the vCPU at its current instruction and waits until it is parked.
    pub fn pause(&self) -> Result<(), VcpuRunnerError> {
        self.request_pause()?;
        self.wait_parked()
    }

    /// Wakes the vCPU if the guest is idling in the control device.
    pub fn ring_doorbell(&self) {
        let mut c = self.shared.lock();
        c.doorbell = c.doorbell.wrapping_add(1);
        self.shared.changed.notify_all();
    }

    /// The reason the guest stopped for good, if it did.
    pub fn fatal(&self) -> Option<String> {
        self.shared.lock().fatal.clone()
    }

    /// Runs `job` on the parked vCPU thread (which owns the vCPU) and returns its result.
    pub fn with_vcpu<R: Send + 'static>(
        &self,
        job: impl FnOnce(&mut Vcpu) -> R + Send + 'static,
    ) -> Result<R, VcpuRunnerError> {
        let (tx, rx) = mpsc::sync_channel(1);
        {
            let mut c = self.shared.lock();
            if !c.parked || c.request != Request::Pause {
                return Err(VcpuRunnerError::NotParked(self.index));
            }
            c.jobs.push(Box::new(move |vcpu: &mut Vcpu| {
                // The receiver only goes away if the controller gave up waiting.
                let _ = tx.send(job(vcpu));
            }));
            self.shared.changed.notify_all();
        }
        rx.recv().map_err(|_| VcpuRunnerError::Gone(self.index))
    }

    fn kick(&self) -> Result<(), VcpuRunnerError> {
        // SAFETY: `pthread` belongs to a thread we spawned and have not joined (joining
        // happens only in `stop`, which consumes the handle).
        let rc = unsafe { libc::pthread_kill(self.pthread, kick_signal()) };
        if rc != 0 && rc != libc::ESRCH {
            return Err(VcpuRunnerError::Kick(self.index, rc));
        }
        Ok(())
    }

    /// Stops the thread and hands back the vCPU.
    pub fn stop(mut self) -> Result<Vcpu, VcpuRunnerError> {
        self.stop_thread()
    }

    fn stop_thread(&mut self) -> Result<Vcpu, VcpuRunnerError> {
        {
            let mut c = self.shared.lock();
            c.request = Request::Stop;
            self.shared.changed.notify_all();
        }
        self.kick()?;
        let thread = self
            .thread
            .take()
            .ok_or(VcpuRunnerError::Gone(self.index))?;
        thread.join().map_err(|_| VcpuRunnerError::Gone(self.index))
    }
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        if self.thread.is_some() {
            if let Err(e) = self.stop_thread() {
                tracing::warn!("stopping vCPU {}: {e}", self.index);
            }
        }
    }
}

fn set_immediate_exit(run: *mut kvm_run, value: u8) {
    // SAFETY: `run` is this thread's kvm_run mapping, alive while the vCPU is.
    unsafe { std::ptr::write_volatile(&mut (*run).immediate_exit, value) };
}

fn run_vcpu(
    mut vcpu: Vcpu,
    shared: &Shared,
    ports: Option<&dyn PortIo>,
    mmio: Option<&MmioBus>,
) -> Vcpu {
    let run: *mut kvm_run = vcpu.fd_mut().get_kvm_run();
    KVM_RUN.with(|r| r.set(run));
    // An MMIO or PIO exit is only complete once KVM_RUN is entered again; a vCPU saved
    // before that would replay or lose the access.
    let mut exit_pending = false;
    loop {
        let doorbell_at_entry;
        {
            let mut c = shared.lock();
            while c.request != Request::Run || c.fatal.is_some() {
                if c.request == Request::Stop {
                    c.parked = true;
                    shared.changed.notify_all();
                    drop(c);
                    KVM_RUN.with(|r| r.set(std::ptr::null_mut()));
                    return vcpu;
                }
                if exit_pending {
                    set_immediate_exit(run, 1);
                    // Completes the pending access and returns EINTR at once.
                    let _ = vcpu.fd_mut().run();
                    set_immediate_exit(run, 0);
                    exit_pending = false;
                }
                for job in std::mem::take(&mut c.jobs) {
                    job(&mut vcpu);
                }
                if !c.parked {
                    c.parked = true;
                    shared.changed.notify_all();
                }
                c = shared.changed.wait(c).unwrap_or_else(|e| e.into_inner());
            }
            c.parked = false;
            shared.changed.notify_all();
            doorbell_at_entry = c.doorbell;
        }
        let outcome = match vcpu.fd_mut().run() {
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                exit_pending = true;
                match control_device::decode_write(addr) {
                    Some(ControlAction::Idle) => Outcome::Idle,
                    Some(ControlAction::Continue) => Outcome::Continue,
                    None => {
                        if let Some(bus) = mmio {
                            bus.write(addr, data);
                        }
                        Outcome::Continue
                    }
                }
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                match mmio {
                    Some(bus) => {
                        bus.read(addr, data);
                    }
                    None => data.fill(0),
                }
                exit_pending = true;
                Outcome::Continue
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                match ports {
                    Some(p) => p.read(port, data),
                    None => data.fill(0xff),
                }
                exit_pending = true;
                Outcome::Continue
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                exit_pending = true;
                match ports {
                    Some(p) => {
                        p.write(port, data);
                        p.stop_requested().map_or(Outcome::Continue, Outcome::Fatal)
                    }
                    None => Outcome::Continue,
                }
            }
            Ok(VcpuExit::Shutdown) => {
                Outcome::Fatal("guest shut down (triple fault or reset)".into())
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => Outcome::Fatal(format!(
                "guest requested a system event ({kind}): reset or power-off"
            )),
            Ok(VcpuExit::Intr) => Outcome::Continue,
            Ok(VcpuExit::Hlt) => Outcome::Idle,
            Ok(VcpuExit::InternalError) => {
                // SAFETY: after KVM_EXIT_INTERNAL_ERROR KVM filled the `internal` member
                // of the kvm_run union; `run` is this thread's live mapping.
                let suberror = unsafe { (*run).__bindgen_anon_1.internal.suberror };
                Outcome::Fatal(if suberror == kvm_bindings::KVM_INTERNAL_ERROR_EMULATION {
                    "KVM could not emulate a guest instruction (on PVM hosts guest kernel \
                     code runs emulated: a stock kernel stops here, a PVM-enabled one does not)"
                        .to_string()
                } else {
                    format!("KVM internal error (suberror {suberror})")
                })
            }
            Ok(other) => Outcome::Fatal(format!("unexpected exit {other:?}")),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                set_immediate_exit(run, 0);
                Outcome::Continue
            }
            Err(e) => Outcome::Fatal(format!("KVM_RUN failed: {e}")),
        };
        match outcome {
            Outcome::Continue => {}
            Outcome::Idle => {
                let c = shared.lock();
                // A doorbell rung since the guest last ran may answer the very check
                // it made before idling: only sleep if none was.
                let _c = shared
                    .changed
                    .wait_while(c, |c| {
                        c.request == Request::Run && c.doorbell == doorbell_at_entry
                    })
                    .unwrap_or_else(|e| e.into_inner());
            }
            Outcome::Fatal(reason) => {
                tracing::error!("vCPU {}: {reason}", vcpu.index());
                let mut c = shared.lock();
                c.fatal = Some(reason);
                shared.changed.notify_all();
            }
        }
    }
}

enum Outcome {
    Continue,
    Idle,
    Fatal(String),
}
