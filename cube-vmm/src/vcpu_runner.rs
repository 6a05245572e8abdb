//! vCPU threads that can be stopped and restarted at any instruction.
//!
//! Each vCPU runs `KVM_RUN` on its own thread. To stop it the controller sets the
//! request to `Pause` and sends the thread a signal whose handler sets the vCPU's
//! `immediate_exit` flag: whether the thread is inside `KVM_RUN` (it returns `EINTR`) or
//! about to enter it (it returns at once), it comes back to the control loop and parks.
//! While parked the thread runs jobs for the controller (saving or restoring state),
//! because it owns the vCPU file descriptor.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::thread::JoinHandle;
use std::time::Duration;

use cube_devices::thread_confinement::{confine_this_thread, ThreadKind};
use kvm_bindings::kvm_run;
use kvm_ioctls::VcpuExit;
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::GuestMemoryMmap;

use cube_devices::mmio_bus::MmioBus;
use cube_devices::port_io::PortIo;

use crate::control_device::{self, ControlAction};
use crate::vstate::emulation::{self, Assist};
use crate::vstate::vcpu::Vcpu;

/// Guest memory as the VMM maps it.
type Memory = GuestMemoryMmap<AtomicBitmap>;

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
    /// `int3` instructions finished by the VMM (see [`Assist`]).
    breakpoints: AtomicU64,
    /// `fwait` instructions finished by the VMM.
    fwaits: AtomicU64,
}

/// Instructions the VMM finished for a guest kernel that runs emulated (see
/// [`crate::vstate::emulation`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AssistCounts {
    /// `int3`: stepped over, #BP delivered.
    pub breakpoints: u64,
    /// `fwait`: stepped over.
    pub fwaits: u64,
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
        Self::spawn_with_memory(vcpu, ports, mmio, None)
    }

    /// Like [`VcpuHandle::spawn_with_buses`], with the guest's memory, from which the
    /// instruction KVM could not emulate is read (through the guest's page tables)
    /// when KVM does not report its bytes.
    ///
    /// Whatever the memory, the thread finishes `int3` and `fwait` itself when KVM's
    /// emulator gives up on them (a guest kernel that runs emulated on a PVM host,
    /// see [`crate::vstate::emulation`]); any other emulation failure stops the guest
    /// with the instruction's address and bytes.
    pub fn spawn_with_memory(
        vcpu: Vcpu,
        ports: Option<Arc<dyn PortIo>>,
        mmio: Option<Arc<MmioBus>>,
        memory: Option<Memory>,
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
            breakpoints: AtomicU64::new(0),
            fwaits: AtomicU64::new(0),
        });
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .stack_size(256 << 10)
            .spawn(move || {
                let buses = Buses {
                    ports: ports.as_deref(),
                    mmio: mmio.as_deref(),
                    memory: memory.as_ref(),
                };
                run_vcpu(vcpu, &thread_shared, &buses)
            })
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

    /// The instructions the VMM finished for the guest since the thread started.
    pub fn assists(&self) -> AssistCounts {
        AssistCounts {
            breakpoints: self.shared.breakpoints.load(Ordering::Relaxed),
            fwaits: self.shared.fwaits.load(Ordering::Relaxed),
        }
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

/// Where a vCPU thread sends its exits.
struct Buses<'a> {
    ports: Option<&'a dyn PortIo>,
    mmio: Option<&'a MmioBus>,
    memory: Option<&'a Memory>,
}

fn run_vcpu(mut vcpu: Vcpu, shared: &Shared, buses: &Buses<'_>) -> Vcpu {
    let Buses {
        ports,
        mmio,
        memory,
    } = *buses;
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
        let exit = vcpu.fd_mut().run();
        // Nothing the guest asked for is served before this thread is confined.
        let confined = confine_this_thread(ThreadKind::Vcpu);
        let outcome = match exit {
            _ if confined.is_err() => Outcome::Fatal(format!(
                "confining the vCPU thread: {}",
                confined.err().unwrap_or_default()
            )),
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
                if suberror == kvm_bindings::KVM_INTERNAL_ERROR_EMULATION {
                    // SAFETY: an emulation failure exit, read from this thread's live
                    // kvm_run mapping before the next KVM_RUN overwrites it.
                    let kvm_bytes = unsafe { emulation::kvm_instruction_bytes(run) };
                    assist_emulation(&vcpu, shared, kvm_bytes, memory)
                } else {
                    Outcome::Fatal(format!("KVM internal error (suberror {suberror})"))
                }
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

/// Finishes the instruction KVM's emulator gave up on, where the VMM can (see
/// [`Assist`]); otherwise the guest stops with the instruction's address and bytes.
fn assist_emulation(
    vcpu: &Vcpu,
    shared: &Shared,
    kvm_bytes: Option<Vec<u8>>,
    memory: Option<&Memory>,
) -> Outcome {
    let failed = emulation::failed_instruction(vcpu.fd(), kvm_bytes, memory);
    let Some(assist) = Assist::for_instruction(&failed.bytes) else {
        return Outcome::Fatal(format!(
            "KVM could not emulate a guest instruction ({failed}; on PVM hosts a guest \
             kernel that is not PVM-enabled runs emulated, and KVM's emulator lacks this \
             instruction)"
        ));
    };
    match assist.apply(vcpu.fd()) {
        Ok(()) => {
            let counter = match assist {
                Assist::Breakpoint => &shared.breakpoints,
                Assist::Fwait => &shared.fwaits,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            Outcome::Continue
        }
        Err(e) => Outcome::Fatal(format!("finishing {assist:?} at {failed}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use cube_mem::GuestMemory;
    use iced_x86::code_asm::{qword_ptr, rax, rbx, rsp, CodeAssembler};
    use kvm_bindings::{kvm_dtable, kvm_regs, kvm_segment, kvm_sregs};
    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::arch::x86_64::layout::{ram_ranges, CONTROL_DEVICE_ADDR, MMIO_HOLE_START};
    use crate::memory::{memory_layout, register_guest_memory};
    use crate::vstate::vm::{Vm, VmConfig};
    use crate::vstate::KvmContext;

    const GDT: u64 = 0x1000;
    const IDT: u64 = 0x2000;
    const TSS: u64 = 0x3000;
    /// What the guest reports: the #BP handler's return RIP, how often it ran, the
    /// vector of any other exception, and a done marker.
    const REPORT: u64 = 0x5000;
    const CODE: u64 = 0x2_0000;
    const STACK_TOP: u64 = 0x8_0000;
    const PML4: u64 = 0x10_0000;
    const DONE: u64 = 0xd0e;

    /// A guest that runs at CPL0 in 64-bit mode (emulated on PVM hosts): optionally
    /// `popcnt` (which KVM's emulator lacks), then `fwait`, then `int3`, whose #BP
    /// handler records its return address; #UD and #GP handlers record their vector.
    struct Cpl0Program {
        code: Vec<u8>,
        /// The IDT with gates for #BP, #UD and #GP.
        idt: Vec<u8>,
        /// The address right after the `int3`.
        after_int3: u64,
    }

    /// `popcnt rax, rbx`.
    const POPCNT: [u8; 5] = [0xf3, 0x48, 0x0f, 0xb8, 0xc3];
    /// Where `popcnt` is, when the program has it: right after `mov rsp, imm64`.
    const POPCNT_AT: u64 = CODE + 10;

    fn cpl0_program(with_popcnt: bool) -> Cpl0Program {
        let mut a = CodeAssembler::new(64).unwrap();
        let mut after_int3 = a.create_label();
        let mut idle = a.create_label();
        let mut bp = a.create_label();
        let mut ud = a.create_label();
        let mut gp = a.create_label();
        let mut stop = a.create_label();
        a.mov(rsp, STACK_TOP).unwrap();
        if with_popcnt {
            a.popcnt(rax, rbx).unwrap();
        }
        a.wait().unwrap();
        a.int3().unwrap();
        a.set_label(&mut after_int3).unwrap();
        a.mov(rax, DONE).unwrap();
        a.mov(qword_ptr(REPORT + 24), rax).unwrap();
        a.set_label(&mut idle).unwrap();
        a.mov(rax, CONTROL_DEVICE_ADDR + control_device::IDLE_REGISTER)
            .unwrap();
        a.mov(qword_ptr(rax), rax).unwrap();
        a.jmp(idle).unwrap();
        // #BP: the return RIP is on top of the interrupt frame.
        a.set_label(&mut bp).unwrap();
        a.mov(rax, qword_ptr(rsp)).unwrap();
        a.mov(qword_ptr(REPORT), rax).unwrap();
        a.add(qword_ptr(REPORT + 8), 1).unwrap();
        a.iretq().unwrap();
        a.set_label(&mut ud).unwrap();
        a.mov(rax, 6u64).unwrap();
        a.jmp(stop).unwrap();
        a.set_label(&mut gp).unwrap();
        a.mov(rax, 13u64).unwrap();
        a.set_label(&mut stop).unwrap();
        a.mov(qword_ptr(REPORT + 16), rax).unwrap();
        a.jmp(idle).unwrap();
        let result = a
            .assemble_options(
                CODE,
                iced_x86::BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS,
            )
            .unwrap();
        let at = |label| result.label_ip(&label).unwrap();
        let handlers = [(3u64, at(bp)), (6, at(ud)), (13, at(gp))];
        let mut idt = vec![0u8; 256 * 16];
        for (vector, handler) in handlers {
            let gate = &mut idt[vector as usize * 16..][..16];
            gate[0..2].copy_from_slice(&(handler as u16).to_le_bytes());
            gate[2..4].copy_from_slice(&0x8u16.to_le_bytes());
            // Present, DPL 0, 64-bit interrupt gate.
            gate[5] = 0x8e;
            gate[6..8].copy_from_slice(&((handler >> 16) as u16).to_le_bytes());
            gate[8..12].copy_from_slice(&((handler >> 32) as u32).to_le_bytes());
        }
        Cpl0Program {
            code: result.inner.code_buffer.clone(),
            idt,
            after_int3: at(after_int3),
        }
    }

    fn segment(selector: u16, type_: u8, long: u8, db: u8) -> kvm_segment {
        kvm_segment {
            base: 0,
            limit: 0xffff_ffff,
            selector,
            type_,
            present: 1,
            dpl: 0,
            db,
            s: 1,
            l: long,
            g: 1,
            avl: 0,
            unusable: 0,
            padding: 0,
        }
    }

    /// A CPL0 guest running `program` on its own vCPU thread. Field order is drop
    /// order: the thread stops and the VM goes before the memory they use.
    struct Cpl0Run {
        handle: VcpuHandle,
        _vm: Vm,
        memory: GuestMemory,
    }

    impl Cpl0Run {
        fn report(&self, offset: u64) -> u64 {
            self.memory
                .inner()
                .read_obj::<u64>(GuestAddress(REPORT + offset))
                .unwrap()
        }

        /// Waits until the guest is done or stopped (a bound on a hang, not a timing
        /// assertion: the program is a dozen instructions).
        fn wait(&self) {
            let deadline = Instant::now() + Duration::from_secs(30);
            while self.report(24) != DONE
                && self.handle.fatal().is_none()
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    fn start_cpl0(program: &Cpl0Program) -> Option<Cpl0Run> {
        if !std::path::Path::new("/dev/kvm").exists() {
            println!("skipped: /dev/kvm not present");
            return None;
        }
        let ctx = Arc::new(KvmContext::open().unwrap());
        let ram = ram_ranges(128 << 20).unwrap();
        let memory = GuestMemory::anonymous(memory_layout(&ram).unwrap()).unwrap();
        let mem = memory.inner();
        mem.write_slice(&program.code, GuestAddress(CODE)).unwrap();
        mem.write_slice(&program.idt, GuestAddress(IDT)).unwrap();
        // Null, 64-bit code (0x8), data (0x10), then the 16-byte TSS descriptor (0x18).
        let gdt: [u64; 3] = [0, 0x00af_9a00_0000_ffff, 0x00cf_9200_0000_ffff];
        for (i, e) in gdt.iter().enumerate() {
            mem.write_obj(*e, GuestAddress(GDT + 8 * i as u64)).unwrap();
        }
        let tss_low = 0x67 | ((TSS & 0xff_ffff) << 16) | (0x89u64 << 40);
        mem.write_obj(tss_low, GuestAddress(GDT + 24)).unwrap();
        // Identity map of the first GiB (RAM) and the GiB holding the control device,
        // 2 MiB supervisor pages.
        mem.write_obj((PML4 + 0x1000) | 3, GuestAddress(PML4))
            .unwrap();
        for (slot, gib) in [(0u64, 0u64), (1, MMIO_HOLE_START >> 30)] {
            let pd = PML4 + 0x2000 + slot * 0x1000;
            mem.write_obj(pd | 3, GuestAddress(PML4 + 0x1000 + gib * 8))
                .unwrap();
            for i in 0..512u64 {
                let phys = (gib << 30) + (i << 21);
                mem.write_obj(phys | 0x83, GuestAddress(pd + i * 8))
                    .unwrap();
            }
        }

        let vm = Vm::new(
            &ctx,
            &VmConfig {
                vcpus: 1,
                irqchip: false,
            },
        )
        .unwrap();
        // SAFETY: `memory` outlives `vm` and the vCPU thread: `Cpl0Run` holds all
        // three and drops the handle (stopping the thread) and the VM before it.
        unsafe { register_guest_memory(&vm, &memory, false).unwrap() };
        let vcpu = Vcpu::new(&vm, 0).unwrap();
        vcpu.configure_cpuid().unwrap();
        let data = segment(0x10, 0x3, 0, 1);
        let sregs = kvm_sregs {
            cs: segment(0x8, 0xb, 1, 0),
            ds: data,
            es: data,
            fs: data,
            gs: data,
            ss: data,
            tr: kvm_segment {
                base: TSS,
                limit: 0x67,
                selector: 0x18,
                type_: 0xb,
                present: 1,
                ..Default::default()
            },
            ldt: kvm_segment {
                unusable: 1,
                ..Default::default()
            },
            gdt: kvm_dtable {
                base: GDT,
                limit: 0x27,
                ..Default::default()
            },
            idt: kvm_dtable {
                base: IDT,
                limit: 0xfff,
                ..Default::default()
            },
            // PG | WP | NE | ET | MP | PE; OSXMMEXCPT | OSFXSR | PAE; LMA | LME.
            cr0: 0x8005_0033,
            cr3: PML4,
            cr4: 0x620,
            efer: 0x500,
            ..Default::default()
        };
        let regs = kvm_regs {
            rip: CODE,
            rflags: 0x2,
            ..Default::default()
        };
        vcpu.set_initial_registers(&regs, &sregs).unwrap();
        let handle = VcpuHandle::spawn_with_memory(vcpu, None, None, Some(mem.clone())).unwrap();
        handle.resume().unwrap();
        Some(Cpl0Run {
            handle,
            _vm: vm,
            memory,
        })
    }

    #[test]
    fn int3_and_fwait_at_cpl0_are_finished_and_the_guest_goes_on() {
        let program = cpl0_program(false);
        let Some(run) = start_cpl0(&program) else {
            return;
        };
        run.wait();
        assert_eq!(run.handle.fatal(), None);
        assert_eq!(run.report(24), DONE, "the guest did not get past int3");
        assert_eq!(
            run.report(16),
            0,
            "the guest took exception {}",
            run.report(16)
        );
        assert_eq!(run.report(8), 1, "the #BP handler ran once");
        assert_eq!(
            run.report(0),
            program.after_int3,
            "#BP returned right after the int3"
        );
        let assists = run.handle.assists();
        if emulation::KernelMode::of_this_host() == Some(emulation::KernelMode::Emulated) {
            // CPL0 code ran in KVM's emulator, which gave both instructions up.
            assert_eq!(
                assists,
                AssistCounts {
                    breakpoints: 1,
                    fwaits: 1
                }
            );
        } else {
            assert_eq!(assists, AssistCounts::default(), "the CPU ran them itself");
        }
    }

    #[test]
    fn an_instruction_the_emulator_lacks_stops_the_guest_naming_rip_and_bytes() {
        let program = cpl0_program(true);
        assert_eq!(&program.code[10..15], &POPCNT, "popcnt sits at POPCNT_AT");
        let Some(run) = start_cpl0(&program) else {
            return;
        };
        run.wait();
        if emulation::KernelMode::of_this_host() == Some(emulation::KernelMode::Emulated) {
            let why = run.handle.fatal().expect("the guest went on past popcnt");
            assert!(why.contains("could not emulate"), "{why}");
            let named = format!("RIP {POPCNT_AT:#x}, instruction bytes f3 48 0f b8 c3");
            assert!(why.contains(&named), "{why}");
            assert_ne!(run.report(24), DONE);
        } else {
            // On the CPU it is an ordinary instruction.
            assert_eq!(run.handle.fatal(), None);
            assert_eq!(run.report(24), DONE);
        }
    }
}
