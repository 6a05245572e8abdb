//! A KVM vCPU: its CPUID, and saving and restoring everything KVM keeps for it.

use std::collections::HashSet;
use std::sync::Arc;

use kvm_bindings::{
    kvm_debugregs, kvm_fpu, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_sregs,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Xsave, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::VcpuFd;
use serde::{Deserialize, Serialize};

use super::context::KvmContext;
use super::emulation::{self, KernelMode};
use super::kvm_bytes;
use super::msrs::{get_msrs_prefix, set_msrs_prefix};
use super::vm::Vm;
use crate::arch::x86_64::cpuid::{vcpu_cpuid, CpuidEntry};

/// MSR_IA32_TSC: the time-stamp counter.
const MSR_IA32_TSC: u32 = 0x10;
/// MSR_IA32_TSC_DEADLINE: the LAPIC timer's deadline in TSC-deadline mode.
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;
/// MSR_KVM_ASYNC_PF_INT: the vector for async page-fault "page ready" interrupts.
/// KVM refuses every write to it (even 0) without an in-kernel LAPIC.
const MSR_KVM_ASYNC_PF_INT: u32 = 0x4b56_4d06;
/// MSRs restored after all others. Writing the TSC deadline makes KVM compare it with
/// the guest TSC to decide whether to arm the timer, so the TSC must already be right
/// or the timer interrupt can be lost (Firecracker's `DEFERRED_MSRS`).
const DEFERRED_MSRS: [u32; 1] = [MSR_IA32_TSC_DEADLINE];

/// Most MSRs a state may carry. KVM lists a few dozen; this bounds what a tampered
/// state file can make us allocate and hand to KVM.
pub const MAX_STATE_MSRS: usize = 1024;
/// Largest XSAVE area a state may carry, in bytes (today's largest, with AMX tiles,
/// is about 11 KiB).
pub const MAX_XSAVE_BYTES: usize = 64 * 1024;

/// Word of the XSAVE legacy area that holds MXCSR (byte offset 24).
const XSAVE_MXCSR_WORD: usize = 6;
/// 32-bit words in the fixed part of `kvm_xsave`.
const XSAVE_REGION_WORDS: usize = std::mem::size_of::<kvm_xsave>() / 4;

/// Errors creating a vCPU or moving its state.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// The vCPU index is not below the VM's vCPU count.
    #[error("vCPU index {index} out of range for a VM with {vcpus} vCPUs")]
    IndexOutOfRange {
        /// The index asked for.
        index: u8,
        /// The VM's vCPU count.
        vcpus: u8,
    },
    /// A KVM ioctl on the vCPU failed.
    #[error("{ioctl} failed")]
    Ioctl {
        /// The ioctl that failed.
        ioctl: &'static str,
        /// The error KVM returned.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// A buffer for KVM (MSR list, XSAVE area) exceeds what kvm-bindings can hold.
    #[error("KVM buffer too large")]
    Buffer(#[source] vmm_sys_util::fam::Error),
    /// `KVM_GET_MSRS` refused an MSR that the context found readable.
    #[error("KVM_GET_MSRS refused MSR {0:#x}")]
    MsrNotRead(u32),
    /// `KVM_SET_MSRS` set fewer MSRs than asked: this is the first it refused.
    #[error("KVM_SET_MSRS refused MSR {0:#x}")]
    MsrNotSet(u32),
    /// The state has LAPIC state exactly when this vCPU's VM has no in-kernel irqchip,
    /// or the other way round.
    #[error("State {} LAPIC state but VM has {} irqchip", if *.state { "has" } else { "lacks" }, if *.vm { "an" } else { "no" })]
    IrqchipMismatch {
        /// Whether the state carries LAPIC state.
        state: bool,
        /// Whether the VM has an in-kernel irqchip.
        vm: bool,
    },
    /// The state has more CPUID entries than KVM accepts.
    #[error("State has {0} CPUID entries (at most {KVM_MAX_CPUID_ENTRIES})")]
    TooManyCpuidEntries(usize),
    /// The state's XSAVE area is smaller than `kvm_xsave` or absurdly large.
    #[error("State XSAVE area is {0} bytes (must be 4096..={MAX_XSAVE_BYTES})")]
    XsaveSize(usize),
    /// The state's XSAVE area is larger than this host's: it holds features this host
    /// cannot restore.
    #[error("State XSAVE area is {state} bytes, this host's is {host}")]
    XsaveTooLarge {
        /// The state's XSAVE size in bytes.
        state: usize,
        /// This host's XSAVE size in bytes.
        host: usize,
    },
    /// The state has more MSRs than any host would save.
    #[error("State has {0} MSRs (at most {MAX_STATE_MSRS})")]
    TooManyMsrs(usize),
    /// The state lists an MSR twice.
    #[error("State lists MSR {0:#x} twice")]
    DuplicateMsr(u32),
}

fn ioctl(ioctl: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuError {
    move |source| VcpuError::Ioctl { ioctl, source }
}

/// A KVM vCPU.
#[derive(Debug)]
pub struct Vcpu {
    fd: VcpuFd,
    index: u8,
    vcpu_count: u8,
    irqchip: bool,
    ctx: Arc<KvmContext>,
    /// The context's MSR list, less those this VM cannot restore.
    msrs_to_save: Vec<u32>,
}

impl Vcpu {
    /// Creates vCPU `index` (also its APIC id) of `vm`.
    pub fn new(vm: &Vm, index: u8) -> Result<Self, VcpuError> {
        let config = vm.config();
        if index >= config.vcpus {
            return Err(VcpuError::IndexOutOfRange {
                index,
                vcpus: config.vcpus,
            });
        }
        let fd = vm
            .fd()
            .create_vcpu(index.into())
            .map_err(ioctl("KVM_CREATE_VCPU"))?;
        let ctx = Arc::clone(vm.context());
        let msrs_to_save = ctx
            .msrs_to_save()
            .iter()
            .copied()
            .filter(|&msr| config.irqchip || msr != MSR_KVM_ASYNC_PF_INT)
            .collect();
        Ok(Self {
            fd,
            index,
            vcpu_count: config.vcpus,
            irqchip: config.irqchip,
            ctx,
            msrs_to_save,
        })
    }

    /// The KVM vCPU file descriptor.
    pub fn fd(&self) -> &VcpuFd {
        &self.fd
    }

    /// The KVM vCPU file descriptor, mutably (`KVM_RUN` needs it).
    pub fn fd_mut(&mut self) -> &mut VcpuFd {
        &mut self.fd
    }

    /// This vCPU's index, which is also its APIC id.
    pub fn index(&self) -> u8 {
        self.index
    }

    /// The MSRs [`Vcpu::save_state`] saves.
    pub fn msrs_to_save(&self) -> &[u32] {
        &self.msrs_to_save
    }

    /// Gives the vCPU the host's supported CPUID with its own APIC id and the VM's
    /// logical processor count filled in (see [`vcpu_cpuid`]).
    pub fn configure_cpuid(&self) -> Result<(), VcpuError> {
        self.configure_cpuid_for(KernelMode::Native)
    }

    /// Like [`Vcpu::configure_cpuid`], less what a guest kernel running in `mode`
    /// must not see (see [`emulation::mask_cpuid`]).
    pub fn configure_cpuid_for(&self, mode: KernelMode) -> Result<(), VcpuError> {
        let mut cpuid = vcpu_cpuid(self.ctx.supported_cpuid(), self.index, self.vcpu_count);
        if mode == KernelMode::Emulated {
            emulation::mask_cpuid(&mut cpuid);
        }
        self.fd.set_cpuid2(&cpuid).map_err(ioctl("KVM_SET_CPUID2"))
    }

    /// Sets the registers a freshly loaded guest starts with (boot state, not a
    /// restore: [`Vcpu::restore_state`] sets these itself).
    pub fn set_initial_registers(
        &self,
        regs: &kvm_regs,
        sregs: &kvm_sregs,
    ) -> Result<(), VcpuError> {
        // SREGS first: it switches the CPU mode that RIP/RSP are interpreted in.
        self.fd.set_sregs(sregs).map_err(ioctl("KVM_SET_SREGS"))?;
        self.fd.set_regs(regs).map_err(ioctl("KVM_SET_REGS"))
    }

    /// Saves everything KVM keeps for this vCPU. The vCPU must not be running.
    pub fn save_state(&self) -> Result<VcpuState, VcpuError> {
        // Order as in Firecracker's `KvmVcpu::save_state`: KVM_GET_MP_STATE first, as it
        // may deliver pending INIT/SIPI events into the LAPIC and registers;
        // KVM_GET_LAPIC may update the LAPIC before returning it; vCPU events last, as
        // the other GETs may change what is pending.
        let mp_state = self.fd.get_mp_state().map_err(ioctl("KVM_GET_MP_STATE"))?;
        let regs = self.fd.get_regs().map_err(ioctl("KVM_GET_REGS"))?;
        let sregs = self.fd.get_sregs().map_err(ioctl("KVM_GET_SREGS"))?;
        let mut fpu = FpuState::from(&self.fd.get_fpu().map_err(ioctl("KVM_GET_FPU"))?);
        let xsave = self.get_xsave()?;
        // KVM_GET_FPU leaves MXCSR out (it reads as 0) while KVM_SET_FPU writes it: take
        // it from the XSAVE legacy area, or restoring the FPU state would zero MXCSR
        // (unmasking every SSE exception) wherever XSAVE does not overwrite it.
        fpu.mxcsr = xsave[XSAVE_MXCSR_WORD];
        let xcrs = self.fd.get_xcrs().map_err(ioctl("KVM_GET_XCRS"))?;
        let debug_regs = self
            .fd
            .get_debug_regs()
            .map_err(ioctl("KVM_GET_DEBUGREGS"))?;
        let lapic = if self.irqchip {
            Some(self.fd.get_lapic().map_err(ioctl("KVM_GET_LAPIC"))?)
        } else {
            None
        };
        // Fails only on hosts whose TSC is unstable; the state then cannot ask for TSC
        // scaling on restore, which matters only on a host of another frequency.
        let tsc_khz = self.fd.get_tsc_khz().ok();
        let cpuid = self
            .fd
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(ioctl("KVM_GET_CPUID2"))?
            .as_slice()
            .iter()
            .map(CpuidEntry::from)
            .collect();
        let msrs = self.get_msrs()?;
        let vcpu_events = self
            .fd
            .get_vcpu_events()
            .map_err(ioctl("KVM_GET_VCPU_EVENTS"))?;
        Ok(VcpuState {
            cpuid,
            tsc_khz,
            mp_state,
            regs,
            sregs,
            fpu,
            xsave,
            xcrs,
            debug_regs,
            lapic,
            msrs,
            vcpu_events,
        })
    }

    fn get_xsave(&self) -> Result<Vec<u32>, VcpuError> {
        let size = self.ctx.xsave_size();
        if size <= std::mem::size_of::<kvm_xsave>() {
            let xsave = self.fd.get_xsave().map_err(ioctl("KVM_GET_XSAVE"))?;
            return Ok(xsave.region.to_vec());
        }
        let mut xsave =
            Xsave::new(size.div_ceil(4) - XSAVE_REGION_WORDS).map_err(VcpuError::Buffer)?;
        // SAFETY: `xsave` holds `size` bytes, the size KVM_CAP_XSAVE2 reported for this
        // process, which does not enable further XSAVE features after start-up.
        unsafe { self.fd.get_xsave2(&mut xsave) }.map_err(ioctl("KVM_GET_XSAVE2"))?;
        let mut words = xsave.as_fam_struct_ref().xsave.region.to_vec();
        words.extend_from_slice(xsave.as_slice());
        Ok(words)
    }

    fn get_msrs(&self) -> Result<Vec<MsrEntry>, VcpuError> {
        let mut entries: Vec<kvm_msr_entry> = self
            .msrs_to_save
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let read = get_msrs_prefix(&self.fd, &mut entries).map_err(ioctl("KVM_GET_MSRS"))?;
        if let Some(refused) = entries.get(read) {
            return Err(VcpuError::MsrNotRead(refused.index));
        }
        Ok(entries.iter().map(MsrEntry::from).collect())
    }

    /// Restores a state saved by [`Vcpu::save_state`] into this vCPU, which must belong
    /// to a VM with the same `irqchip` setting. The state's own CPUID is installed, so
    /// [`Vcpu::configure_cpuid`] is not needed first. Other vCPUs must not be running.
    pub fn restore_state(&self, state: &VcpuState) -> Result<(), VcpuError> {
        state.validate()?;
        if state.lapic.is_some() != self.irqchip {
            return Err(VcpuError::IrqchipMismatch {
                state: state.lapic.is_some(),
                vm: self.irqchip,
            });
        }
        let host_xsave = self.ctx.xsave_size();
        if state.xsave.len() * 4 > host_xsave {
            return Err(VcpuError::XsaveTooLarge {
                state: state.xsave.len() * 4,
                host: host_xsave,
            });
        }

        // Order as in Firecracker's `KvmVcpu::restore_state`:
        // - CPUID first: other SETs (XSAVE, XCRS, MSRs) are checked against it.
        // - the TSC frequency before the TSC MSR, whose value is in guest TSC ticks.
        // - SET_REGS clears pending exceptions, so it precedes SET_VCPU_EVENTS, which
        //   restores them; events go last.
        // - SET_SREGS restores the APIC base MSR, so it precedes SET_LAPIC.
        // - SET_LAPIC precedes SET_MSRS: the TSC deadline MSR only takes effect with
        //   the LAPIC (timer mode) in place; within the MSRs the TSC deadline follows
        //   the TSC (see `DEFERRED_MSRS`).
        // FPU and XSAVE overlap (x87/SSE); XSAVE, the superset, is set after the FPU.
        self.set_cpuid_unless_equal(&state.cpuid)?;
        if let Some(khz) = state.tsc_khz {
            if self.tsc_scaling_needed(khz) {
                self.fd.set_tsc_khz(khz).map_err(ioctl("KVM_SET_TSC_KHZ"))?;
            }
        }
        self.fd
            .set_mp_state(state.mp_state)
            .map_err(ioctl("KVM_SET_MP_STATE"))?;
        self.fd
            .set_regs(&state.regs)
            .map_err(ioctl("KVM_SET_REGS"))?;
        self.fd
            .set_sregs(&state.sregs)
            .map_err(ioctl("KVM_SET_SREGS"))?;
        self.fd
            .set_fpu(&kvm_fpu::from(&state.fpu))
            .map_err(ioctl("KVM_SET_FPU"))?;
        self.set_xsave(&state.xsave)?;
        self.fd
            .set_xcrs(&state.xcrs)
            .map_err(ioctl("KVM_SET_XCRS"))?;
        self.fd
            .set_debug_regs(&state.debug_regs)
            .map_err(ioctl("KVM_SET_DEBUGREGS"))?;
        if let Some(lapic) = &state.lapic {
            self.fd.set_lapic(lapic).map_err(ioctl("KVM_SET_LAPIC"))?;
        }
        self.set_msrs(&state.msrs)?;
        self.fd
            .set_vcpu_events(&state.vcpu_events)
            .map_err(ioctl("KVM_SET_VCPU_EVENTS"))?;
        Ok(())
    }

    /// Installs `entries` as the vCPU's CPUID unless it already has exactly them.
    /// KVM_SET_CPUID2 costs ~150 µs on PVM hosts against ~7 µs for KVM_GET_CPUID2, and
    /// a rollback restores into a vCPU that already has its CPUID (which KVM would
    /// anyway refuse to change once the vCPU has run).
    fn set_cpuid_unless_equal(&self, entries: &[CpuidEntry]) -> Result<(), VcpuError> {
        if let Ok(current) = self.fd.get_cpuid2(KVM_MAX_CPUID_ENTRIES) {
            if current
                .as_slice()
                .iter()
                .map(CpuidEntry::from)
                .eq(entries.iter().copied())
            {
                return Ok(());
            }
        }
        let raw: Vec<_> = entries.iter().map(Into::into).collect();
        let cpuid = CpuId::from_entries(&raw).map_err(VcpuError::Buffer)?;
        self.fd.set_cpuid2(&cpuid).map_err(ioctl("KVM_SET_CPUID2"))
    }

    /// Whether this host's vCPU TSC runs at a rate other than `khz`, beyond the 250 ppm
    /// by which calibrations of one frequency differ (Firecracker's and QEMU's bound).
    fn tsc_scaling_needed(&self, khz: u32) -> bool {
        match self.fd.get_tsc_khz() {
            Ok(current) => {
                let diff = (i64::from(current) - i64::from(khz)).abs();
                diff * 1_000_000 > i64::from(khz) * 250
            }
            Err(_) => true,
        }
    }

    fn set_xsave(&self, words: &[u32]) -> Result<(), VcpuError> {
        // KVM reads the host's full XSAVE size whatever the buffer: pad a smaller saved
        // area (from a host with fewer XSAVE features) with zeroes, which its header's
        // XSTATE_BV marks as components in their initial state.
        let host_words = self.ctx.xsave_size().div_ceil(4);
        let mut xsave = Xsave::new(host_words - XSAVE_REGION_WORDS).map_err(VcpuError::Buffer)?;
        let (region, extra) = words.split_at(XSAVE_REGION_WORDS.min(words.len()));
        // SAFETY: only the fixed `region` array is written; the FAM length is untouched.
        unsafe { xsave.as_mut_fam_struct() }.xsave.region[..region.len()].copy_from_slice(region);
        xsave.as_mut_slice()[..extra.len()].copy_from_slice(extra);
        // SAFETY: `xsave` holds this host's full XSAVE size (KVM_CAP_XSAVE2), so KVM
        // reads no further than the buffer.
        unsafe { self.fd.set_xsave2(&xsave) }.map_err(ioctl("KVM_SET_XSAVE"))
    }

    fn set_msrs(&self, msrs: &[MsrEntry]) -> Result<(), VcpuError> {
        let tsc = msrs
            .iter()
            .find(|m| m.index == MSR_IA32_TSC)
            .map(|m| m.data);
        let (deferred, mut first): (Vec<kvm_msr_entry>, Vec<kvm_msr_entry>) = msrs
            .iter()
            .map(kvm_msr_entry::from)
            .partition(|m| DEFERRED_MSRS.contains(&m.index));
        let mut deferred = deferred;
        for msr in &mut deferred {
            // A zero deadline can mean the timer fired just before the save, its
            // interrupt still pending inside KVM where no state captures it. As
            // Firecracker does, re-arm it at the saved TSC so it fires at once rather
            // than never; KVM ignores the write unless the timer is in TSC-deadline mode.
            if let (MSR_IA32_TSC_DEADLINE, 0, Some(tsc)) = (msr.index, msr.data, tsc) {
                msr.data = tsc;
            }
        }
        first.extend(deferred);
        let set = set_msrs_prefix(&self.fd, &first).map_err(ioctl("KVM_SET_MSRS"))?;
        match first.get(set) {
            Some(refused) => Err(VcpuError::MsrNotSet(refused.index)),
            None => Ok(()),
        }
    }
}

/// Everything KVM keeps for one vCPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VcpuState {
    /// The CPUID the guest sees (`KVM_GET_CPUID2`).
    pub cpuid: Vec<CpuidEntry>,
    /// The vCPU's TSC frequency at save (`KVM_GET_TSC_KHZ`); `None` where KVM could
    /// not tell (unstable host TSC).
    pub tsc_khz: Option<u32>,
    /// Runnable, halted, waiting for INIT/SIPI (`KVM_GET_MP_STATE`).
    #[serde(with = "kvm_bytes")]
    pub mp_state: kvm_mp_state,
    /// General-purpose registers, RIP, RFLAGS.
    #[serde(with = "kvm_bytes")]
    pub regs: kvm_regs,
    /// Segment, control and descriptor-table registers, EFER, APIC base.
    #[serde(with = "kvm_bytes")]
    pub sregs: kvm_sregs,
    /// x87 and SSE state (`KVM_GET_FPU`), also contained in `xsave`.
    pub fpu: FpuState,
    /// The XSAVE area as 32-bit words (`KVM_GET_XSAVE2`, or `KVM_GET_XSAVE`'s 4096
    /// bytes where the kernel predates it).
    pub xsave: Vec<u32>,
    /// Extended control registers (XCR0).
    #[serde(with = "kvm_bytes")]
    pub xcrs: kvm_xcrs,
    /// Debug registers DR0-3, DR6, DR7.
    #[serde(with = "kvm_bytes")]
    pub debug_regs: kvm_debugregs,
    /// The in-kernel LAPIC's registers; `None` for a VM without irqchip.
    #[serde(with = "kvm_bytes::option")]
    pub lapic: Option<kvm_lapic_state>,
    /// MSR values, in KVM's MSR-list order.
    pub msrs: Vec<MsrEntry>,
    /// Pending exceptions, interrupts, NMIs, SMIs and interrupt shadow.
    #[serde(with = "kvm_bytes")]
    pub vcpu_events: kvm_vcpu_events,
}

impl VcpuState {
    /// Checks the bounds KVM cannot be trusted to check before it reads our buffers: at
    /// most `KVM_MAX_CPUID_ENTRIES` CPUID entries, an XSAVE area of
    /// 4096..=[`MAX_XSAVE_BYTES`] bytes, at most [`MAX_STATE_MSRS`] distinct MSRs.
    /// Restoring calls this; a state read from a file can be checked before that.
    pub fn validate(&self) -> Result<(), VcpuError> {
        if self.cpuid.len() > KVM_MAX_CPUID_ENTRIES {
            return Err(VcpuError::TooManyCpuidEntries(self.cpuid.len()));
        }
        let xsave_bytes = self.xsave.len() * 4;
        if !(std::mem::size_of::<kvm_xsave>()..=MAX_XSAVE_BYTES).contains(&xsave_bytes) {
            return Err(VcpuError::XsaveSize(xsave_bytes));
        }
        if self.msrs.len() > MAX_STATE_MSRS {
            return Err(VcpuError::TooManyMsrs(self.msrs.len()));
        }
        let mut seen = HashSet::with_capacity(self.msrs.len());
        for msr in &self.msrs {
            if !seen.insert(msr.index) {
                return Err(VcpuError::DuplicateMsr(msr.index));
            }
        }
        Ok(())
    }

    /// The saved value of MSR `index`, if the state has it.
    pub fn msr(&self, index: u32) -> Option<u64> {
        self.msrs.iter().find(|m| m.index == index).map(|m| m.data)
    }
}

/// One saved MSR.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsrEntry {
    /// The MSR number.
    pub index: u32,
    /// Its value.
    pub data: u64,
}

impl From<&kvm_msr_entry> for MsrEntry {
    fn from(e: &kvm_msr_entry) -> Self {
        Self {
            index: e.index,
            data: e.data,
        }
    }
}

impl From<&MsrEntry> for kvm_msr_entry {
    fn from(e: &MsrEntry) -> Self {
        Self {
            index: e.index,
            data: e.data,
            ..Default::default()
        }
    }
}

/// x87 and SSE state: `kvm_fpu`, which kvm-bindings gives no serde support.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FpuState {
    /// x87 registers ST0-ST7 (80 bits used of each 16 bytes).
    pub fpr: [[u8; 16]; 8],
    /// x87 control word.
    pub fcw: u16,
    /// x87 status word.
    pub fsw: u16,
    /// Abridged x87 tag word.
    pub ftwx: u8,
    /// Last x87 opcode.
    pub last_opcode: u16,
    /// Last x87 instruction pointer.
    pub last_ip: u64,
    /// Last x87 data pointer.
    pub last_dp: u64,
    /// XMM0-XMM15.
    pub xmm: [[u8; 16]; 16],
    /// SSE control and status register.
    pub mxcsr: u32,
}

impl From<&kvm_fpu> for FpuState {
    fn from(f: &kvm_fpu) -> Self {
        Self {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
        }
    }
}

impl From<&FpuState> for kvm_fpu {
    fn from(f: &FpuState) -> Self {
        Self {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::test_context;
    use crate::vstate::vm::VmConfig;
    use kvm_bindings::kvm_segment;

    const MSR_IA32_SYSENTER_CS: u32 = 0x174;
    const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
    const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
    const MSR_IA32_CR_PAT: u32 = 0x277;
    const MSR_STAR: u32 = 0xc000_0081;
    const MSR_LSTAR: u32 = 0xc000_0082;
    const MSR_CSTAR: u32 = 0xc000_0083;
    const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
    const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
    const MSR_TSC_AUX: u32 = 0xc000_0103;

    /// Distinctive values for MSRs a guest kernel sets up; only those this host saves
    /// are written.
    const MSR_VALUES: [(u32, u64); 10] = [
        (MSR_IA32_SYSENTER_CS, 0x10),
        (MSR_IA32_SYSENTER_ESP, 0x1234_5000),
        (MSR_IA32_SYSENTER_EIP, 0xffff_ffff_8100_0000),
        (MSR_IA32_CR_PAT, 0x0007_0106_0007_0406),
        (MSR_STAR, 0x0023_0010_0000_0000),
        (MSR_LSTAR, 0xffff_ffff_8180_0000),
        (MSR_CSTAR, 0xffff_ffff_8180_1000),
        (MSR_SYSCALL_MASK, 0x4_7700),
        (MSR_KERNEL_GS_BASE, 0xffff_8880_0000_0000),
        (MSR_TSC_AUX, 7),
    ];

    fn segment(selector: u16, type_: u8, long: bool) -> kvm_segment {
        kvm_segment {
            base: 0,
            limit: 0xffff_ffff,
            selector,
            type_,
            present: 1,
            dpl: 0,
            db: u8::from(!long),
            s: 1,
            l: u8::from(long),
            g: 1,
            ..Default::default()
        }
    }

    fn lapic_reg(lapic: &mut kvm_lapic_state, offset: usize, value: u32) {
        for (i, byte) in value.to_le_bytes().into_iter().enumerate() {
            lapic.regs[offset + i] = byte as std::os::raw::c_char;
        }
    }

    /// Puts vCPU 0 into a 64-bit kernel-like state with distinctive values everywhere.
    fn make_distinctive(vcpu: &Vcpu, irqchip: bool) {
        let fd = vcpu.fd();
        let regs = kvm_regs {
            rax: 0x1111_1111_1111_1111,
            rbx: 0x2222_2222_2222_2222,
            rcx: 0x3333,
            rdx: 0x4444,
            rsi: 0x5555,
            rdi: 0x6666,
            rsp: 0x8000,
            rbp: 0x7777,
            r8: 8,
            r9: 9,
            r10: 10,
            r11: 11,
            r12: 12,
            r13: 13,
            r14: 14,
            r15: 0xf00d,
            rip: 0x10_0000,
            rflags: 0x246,
        };
        fd.set_regs(&regs).unwrap();

        let mut sregs = fd.get_sregs().unwrap();
        sregs.cs = segment(0x8, 0xb, true);
        sregs.ds = segment(0x10, 0x3, false);
        sregs.es = sregs.ds;
        sregs.fs = segment(0x10, 0x3, false);
        sregs.fs.base = 0x7f00_0000_0000;
        sregs.gs = sregs.ds;
        sregs.ss = sregs.ds;
        sregs.gdt.base = 0x500;
        sregs.gdt.limit = 0x1f;
        sregs.idt.base = 0x1000;
        sregs.idt.limit = 0xfff;
        sregs.cr0 = 0x8005_0033;
        sregs.cr3 = 0x9000;
        sregs.cr4 = 0x20 | 0x200 | 0x400 | 0x4_0000; // PAE, OSFXSR, OSXMMEXCPT, OSXSAVE
        sregs.efer = 0x501; // SCE, LME, LMA
        fd.set_sregs(&sregs).unwrap();

        // x87/SSE/AVX state goes in through XSAVE with its XSTATE_BV bits set, as a
        // running guest's would be: KVM_SET_FPU writes the legacy area without marking
        // it in use, and KVM_GET_XSAVE then reports those components as initial.
        let supported = vcpu.ctx.supported_cpuid().as_slice();
        let leaf_d = |index| {
            supported
                .iter()
                .find(|e| e.function == 0xd && e.index == index)
        };
        let xcr0 = u64::from(leaf_d(0).map_or(0x3, |e| e.eax) & 0x7); // x87, SSE, AVX
        let mut xsave = vcpu.get_xsave().unwrap();
        let put = |xsave: &mut Vec<u32>, offset: usize, bytes: &[u8]| {
            for (i, chunk) in bytes.chunks(4).enumerate() {
                let mut word = xsave[offset / 4 + i].to_le_bytes();
                word[..chunk.len()].copy_from_slice(chunk);
                xsave[offset / 4 + i] = u32::from_le_bytes(word);
            }
        };
        put(&mut xsave, 0, &0x027f_u16.to_le_bytes()); // FCW: 53-bit precision
        put(&mut xsave, 24, &0x1fa0_u32.to_le_bytes()); // MXCSR: precision flag raised
        put(&mut xsave, 48, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 0x40]); // ST1
        put(&mut xsave, 160, b"cube-xmm0-values"); // XMM0
        put(&mut xsave, 400, &[0xa5; 16]); // XMM15
        let mut xstate_bv = 0x3; // x87, SSE
        if xcr0 & 0x4 != 0 {
            let ymm_offset = leaf_d(2).unwrap().ebx as usize;
            put(&mut xsave, ymm_offset, b"cube-ymm0-upper!"); // YMM0[255:128]
            xstate_bv |= 0x4;
        }
        put(&mut xsave, 512, &u64::to_le_bytes(xstate_bv));
        vcpu.set_xsave(&xsave).unwrap();

        let mut xcrs = fd.get_xcrs().unwrap();
        xcrs.xcrs[0].value = xcr0;
        fd.set_xcrs(&xcrs).unwrap();

        let debug = kvm_debugregs {
            db: [0x1000, 0x2000, 0x3000, 0x4000],
            dr6: 0xffff_0ff0,
            dr7: 0x403,
            ..Default::default()
        };
        fd.set_debug_regs(&debug).unwrap();

        if irqchip {
            let mut lapic = fd.get_lapic().unwrap();
            lapic_reg(&mut lapic, 0x80, 0x20); // TPR
            lapic_reg(&mut lapic, 0xf0, 0x1ff); // spurious vector, APIC enabled
            lapic_reg(&mut lapic, 0x350, 0x700); // LINT0: ExtINT
            lapic_reg(&mut lapic, 0x360, 0x400); // LINT1: NMI
            fd.set_lapic(&lapic).unwrap();
        }

        let msrs: Vec<kvm_msr_entry> = MSR_VALUES
            .iter()
            .filter(|(index, _)| vcpu.msrs_to_save().contains(index))
            .map(|&(index, data)| kvm_msr_entry {
                index,
                data,
                ..Default::default()
            })
            .collect();
        assert!(msrs.len() >= 5, "host saves too few of the test MSRs");
        assert_eq!(set_msrs_prefix(fd, &msrs).unwrap(), msrs.len());

        let mut events = fd.get_vcpu_events().unwrap();
        events.nmi.masked = 1;
        fd.set_vcpu_events(&events).unwrap();
    }

    /// The state less what legitimately moves between two saves: the TSC MSR counts on
    /// (KVM keeps the guest TSC running from the written value).
    fn without_tsc(mut state: VcpuState) -> VcpuState {
        state.msrs.retain(|m| m.index != MSR_IA32_TSC);
        state
    }

    fn round_trip(irqchip: bool) {
        let Some(ctx) = test_context() else { return };
        let config = VmConfig { vcpus: 2, irqchip };
        let vm = Vm::new(&ctx, &config).unwrap();
        let vcpus: Vec<_> = (0..2).map(|i| Vcpu::new(&vm, i).unwrap()).collect();
        for vcpu in &vcpus {
            vcpu.configure_cpuid().unwrap();
        }
        make_distinctive(&vcpus[0], irqchip);
        let saved: Vec<_> = vcpus.iter().map(|v| v.save_state().unwrap()).collect();

        let s = &saved[0];
        assert_eq!(s.regs.r15, 0xf00d);
        assert_eq!(s.sregs.efer & 0x500, 0x500);
        assert_eq!(s.fpu.xmm[0], *b"cube-xmm0-values");
        assert_eq!((s.fpu.fcw, s.fpu.mxcsr), (0x27f, 0x1fa0));
        assert_eq!(s.debug_regs.db[2], 0x3000);
        assert_eq!(s.msr(MSR_IA32_SYSENTER_EIP), Some(0xffff_ffff_8100_0000));
        assert_eq!(s.lapic.is_some(), irqchip);
        assert_eq!(
            s.cpuid.iter().find(|e| e.function == 1).unwrap().ebx >> 24,
            0
        );
        assert_eq!(
            saved[1].cpuid.iter().find(|e| e.function == 1).unwrap().ebx >> 24,
            1
        );
        assert_eq!(s.xsave.len() * 4, ctx.xsave_size());
        // XMM0 lives at byte 160 of the legacy XSAVE region.
        let xmm0: Vec<u8> = s.xsave[40..44]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        assert_eq!(xmm0, b"cube-xmm0-values");

        // A fresh VM; restore without configuring CPUID first: the state carries it.
        let fresh = Vm::new(&ctx, &config).unwrap();
        let fresh_vcpus: Vec<_> = (0..2).map(|i| Vcpu::new(&fresh, i).unwrap()).collect();
        for (vcpu, state) in fresh_vcpus.iter().zip(&saved) {
            vcpu.restore_state(state).unwrap();
        }
        for (vcpu, state) in fresh_vcpus.iter().zip(&saved) {
            let again = vcpu.save_state().unwrap();
            let (before, after) = (
                state.msr(MSR_IA32_TSC).unwrap(),
                again.msr(MSR_IA32_TSC).unwrap(),
            );
            assert!(after >= before, "TSC went back: {before} -> {after}");
            assert_eq!(without_tsc(again), without_tsc(state.clone()));
        }

        // Rolling back in place: the original vCPU already has the state's CPUID.
        vcpus[0].restore_state(&saved[0]).unwrap();
        assert_eq!(
            without_tsc(vcpus[0].save_state().unwrap()),
            without_tsc(saved[0].clone())
        );
    }

    #[test]
    fn state_round_trips_into_fresh_vm_with_irqchip() {
        round_trip(true);
    }

    #[test]
    fn state_round_trips_into_fresh_vm_without_irqchip() {
        round_trip(false);
    }

    #[test]
    fn async_pf_int_is_saved_only_with_irqchip() {
        let Some(ctx) = test_context() else { return };
        if !ctx.msrs_to_save().contains(&MSR_KVM_ASYNC_PF_INT) {
            println!("skipped: host does not list MSR_KVM_ASYNC_PF_INT");
            return;
        }
        for irqchip in [true, false] {
            let vm = Vm::new(&ctx, &VmConfig { vcpus: 1, irqchip }).unwrap();
            let vcpu = Vcpu::new(&vm, 0).unwrap();
            assert_eq!(vcpu.msrs_to_save().contains(&MSR_KVM_ASYNC_PF_INT), irqchip);
        }
    }

    #[test]
    fn state_survives_postcard() {
        let Some(ctx) = test_context() else { return };
        for irqchip in [true, false] {
            let vm = Vm::new(&ctx, &VmConfig { vcpus: 1, irqchip }).unwrap();
            let vcpu = Vcpu::new(&vm, 0).unwrap();
            vcpu.configure_cpuid().unwrap();
            make_distinctive(&vcpu, irqchip);
            let state = vcpu.save_state().unwrap();
            let bytes = postcard::to_allocvec(&state).unwrap();
            let back: VcpuState = postcard::from_bytes(&bytes).unwrap();
            assert_eq!(back, state);
            let json = serde_json::to_vec(&state).unwrap();
            assert_eq!(serde_json::from_slice::<VcpuState>(&json).unwrap(), state);
        }
    }

    #[test]
    fn tampered_state_is_rejected() {
        let Some(ctx) = test_context() else { return };
        let vm = Vm::new(
            &ctx,
            &VmConfig {
                vcpus: 1,
                irqchip: true,
            },
        )
        .unwrap();
        let vcpu = Vcpu::new(&vm, 0).unwrap();
        vcpu.configure_cpuid().unwrap();
        let good = vcpu.save_state().unwrap();
        good.validate().unwrap();

        let mut short_xsave = good.clone();
        short_xsave.xsave.truncate(1000);
        assert!(matches!(
            short_xsave.validate(),
            Err(VcpuError::XsaveSize(4000))
        ));
        assert!(matches!(
            vcpu.restore_state(&short_xsave),
            Err(VcpuError::XsaveSize(_))
        ));

        let mut huge_xsave = good.clone();
        huge_xsave.xsave.resize(100_000, 0);
        assert!(matches!(
            huge_xsave.validate(),
            Err(VcpuError::XsaveSize(400_000))
        ));

        let mut beyond_host = good.clone();
        beyond_host.xsave.resize(ctx.xsave_size() / 4 + 16, 0);
        beyond_host.validate().unwrap();
        assert!(matches!(
            vcpu.restore_state(&beyond_host),
            Err(VcpuError::XsaveTooLarge { .. })
        ));

        let mut many_msrs = good.clone();
        many_msrs.msrs = (0..5000).map(|index| MsrEntry { index, data: 0 }).collect();
        assert!(matches!(
            many_msrs.validate(),
            Err(VcpuError::TooManyMsrs(5000))
        ));

        let mut twice = good.clone();
        twice.msrs.push(twice.msrs[0]);
        assert!(matches!(twice.validate(), Err(VcpuError::DuplicateMsr(_))));

        let mut cpuid = good.clone();
        cpuid.cpuid = vec![CpuidEntry::default(); 300];
        assert!(matches!(
            cpuid.validate(),
            Err(VcpuError::TooManyCpuidEntries(300))
        ));

        // An MSR KVM does not know: KVM_SET_MSRS stops there and we name it.
        let mut unknown = good.clone();
        unknown.msrs.insert(
            1,
            MsrEntry {
                index: 0xdead_0000,
                data: 1,
            },
        );
        assert!(matches!(
            vcpu.restore_state(&unknown),
            Err(VcpuError::MsrNotSet(0xdead_0000))
        ));

        // LAPIC state into a VM without irqchip.
        let plain = Vm::new(
            &ctx,
            &VmConfig {
                vcpus: 1,
                irqchip: false,
            },
        )
        .unwrap();
        let plain_vcpu = Vcpu::new(&plain, 0).unwrap();
        assert!(matches!(
            plain_vcpu.restore_state(&good),
            Err(VcpuError::IrqchipMismatch {
                state: true,
                vm: false
            })
        ));

        // A LAPIC record one byte short in an otherwise well-formed file.
        let mut forged = serde_json::to_value(&good).unwrap();
        forged["lapic"].as_array_mut().unwrap().pop();
        assert!(serde_json::from_value::<VcpuState>(forged).is_err());
    }

    #[test]
    fn index_beyond_vcpu_count_is_rejected() {
        let Some(ctx) = test_context() else { return };
        let vm = Vm::new(
            &ctx,
            &VmConfig {
                vcpus: 1,
                irqchip: false,
            },
        )
        .unwrap();
        assert!(matches!(
            Vcpu::new(&vm, 1),
            Err(VcpuError::IndexOutOfRange { index: 1, vcpus: 1 })
        ));
    }
}
