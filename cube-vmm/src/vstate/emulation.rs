//! Guest kernels that run emulated.
//!
//! On a PVM host (KVM without VMX/SVM) a guest kernel that is not PVM-enabled runs its
//! CPL0 code in KVM's instruction emulator, one instruction at a time (0.25-1.6 µs
//! each here). The emulator lacks a few instructions an ordinary x86-64 kernel
//! executes; [`KernelMode::Emulated`] gets a kernel past them:
//!
//! - CPUID hides what the kernel would otherwise use and the emulator cannot run
//!   (`cmpxchg16b`, `popcnt`, `xsave`/`xrstor`, SMAP's `stac`/`clac`), and the
//!   byte-granular string copies it runs slowly (ERMS, FSRM): see [`mask_cpuid`];
//! - the command line clears the same features again, since KVM's CPUID table is not
//!   honoured for all of them on such hosts, and skips boot-time work a VM does not
//!   need: see [`EMULATED_KERNEL_CMDLINE`];
//! - the VMM finishes two instructions itself when the emulator gives up on them
//!   ([`Assist`]): `int3` (the kernel's self-test and any live patching) and `fwait`
//!   (every thread exit runs one).
//!
//! Every other emulation failure is reported with the instruction's address and bytes
//! ([`FailedInstruction`]).
//!
//! One more gap is the guest kernel's to close: this host's PVM turns a `syscall`
//! from guest user mode into a jump to `MSR_LSTAR` without leaving CPL3, which a stock
//! kernel takes as a segmentation fault of every process. Cube's guest kernel carries
//! a patch for it (`guest-kernel/patches`).

use std::fmt;

use kvm_bindings::{kvm_run, CpuId, KVM_INTERNAL_ERROR_EMULATION_FLAG_INSTRUCTION_BYTES};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress, GuestMemory};

use crate::host::{KvmKind, KvmProbe};

/// Leaf 1: feature flags.
const LEAF_FEATURES: u32 = 0x1;
/// Leaf 1 ECX bit 13: `cmpxchg16b` (SLUB's lockless freelists).
const ECX_CX16: u32 = 1 << 13;
/// Leaf 1 ECX bit 23: `popcnt` (hweight).
const ECX_POPCNT: u32 = 1 << 23;
/// Leaf 1 ECX bit 26: XSAVE (`xsave`/`xrstor` for the FPU state; `fxsave` remains).
const ECX_XSAVE: u32 = 1 << 26;
/// Leaf 1 ECX bit 27: OSXSAVE, meaningless without XSAVE.
const ECX_OSXSAVE: u32 = 1 << 27;
/// Leaf 1 ECX bits an emulated kernel must not see: instructions KVM's emulator lacks.
const LEAF1_ECX_HIDDEN: u32 = ECX_CX16 | ECX_POPCNT | ECX_XSAVE | ECX_OSXSAVE;
/// Leaf 7: structured extended feature flags.
const LEAF_EXTENDED_FEATURES: u32 = 0x7;
/// Leaf 7 EBX bit 20: SMAP, whose `stac`/`clac` around every user access KVM's
/// emulator lacks.
const EBX_SMAP: u32 = 1 << 20;
/// Leaf 7 EBX bit 9: enhanced `rep movsb`/`stosb`. KVM's emulator runs a `rep`
/// string instruction one iteration at a time, so a kernel that copies and clears
/// memory a byte per iteration (as it does with ERMS) pays eight times the
/// iterations of `rep movsq`/`stosq`.
const EBX_ERMS: u32 = 1 << 9;
/// Leaf 7 EDX bit 4: fast short `rep movsb`, the same for short copies.
const EDX_FSRM: u32 = 1 << 4;
/// Leaf 0xD: the XSAVE state components, hidden with XSAVE.
const LEAF_XSAVE: u32 = 0xd;

/// Switches on the kernel command line of a kernel that runs emulated.
/// `clearcpuid=xsave,popcnt,smap,erms,fsrm`: the features [`mask_cpuid`] hides,
/// again, because KVM's CPUID table is not honoured for all of them on PVM hosts (a
/// kernel still ran `xrstor` with XSAVE hidden). Not `noxsave`: the kernel parses it
/// early, then hands it to init as an argument it does not know. The rest skips work
/// a kernel need not do in a VM and that costs emulated seconds: `tsc=reliable` and
/// `no_timer_check` the clock and timer cross-checks, `mitigations=off` the
/// speculation workarounds on every entry, `noreplace-smp` rewriting every `lock`
/// prefix of a one-vCPU guest, `cryptomgr.notests` the crypto self-tests of kernels
/// built with them.
pub const EMULATED_KERNEL_CMDLINE: &str = "clearcpuid=xsave,popcnt,smap,erms,fsrm tsc=reliable \
     no_timer_check mitigations=off noreplace-smp cryptomgr.notests";

/// How a guest kernel's own code runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelMode {
    /// On the CPU (VMX/SVM, or a PVM-enabled kernel on a PVM host).
    Native,
    /// In KVM's instruction emulator (a kernel that is not PVM-enabled on a PVM host):
    /// correct but slow, with the CPUID masks, command-line switches and VMM assists
    /// of this module.
    Emulated,
}

impl KernelMode {
    /// How a Linux guest kernel that is not PVM-enabled (Cube's own, Debian's) runs on
    /// a host with `kvm`: natively with VMX/SVM, emulated on PVM; `None` without KVM.
    pub fn for_kvm(kvm: KvmKind) -> Option<KernelMode> {
        match kvm {
            KvmKind::Hardware => Some(KernelMode::Native),
            KvmKind::Pvm => Some(KernelMode::Emulated),
            KvmKind::None => None,
        }
    }

    /// How such a kernel runs on this host (see [`KernelMode::for_kvm`]): opens
    /// `/dev/kvm` and reads the CPU flags, nothing more.
    pub fn of_this_host() -> Option<KernelMode> {
        Self::for_kvm(KvmProbe::run().kind)
    }

    /// The switches this mode adds to the kernel command line (none natively).
    pub fn cmdline_switches(self) -> &'static str {
        match self {
            KernelMode::Native => "",
            KernelMode::Emulated => EMULATED_KERNEL_CMDLINE,
        }
    }
}

/// Hides from `cpuid` the features an emulated kernel must not use (see the module
/// documentation).
pub fn mask_cpuid(cpuid: &mut CpuId) {
    for entry in cpuid.as_mut_slice() {
        match (entry.function, entry.index) {
            (LEAF_FEATURES, _) => entry.ecx &= !LEAF1_ECX_HIDDEN,
            (LEAF_EXTENDED_FEATURES, 0) => {
                entry.ebx &= !(EBX_SMAP | EBX_ERMS);
                entry.edx &= !EDX_FSRM;
            }
            (LEAF_XSAVE, _) => {
                entry.eax = 0;
                entry.ebx = 0;
                entry.ecx = 0;
                entry.edx = 0;
            }
            _ => {}
        }
    }
}

/// What the VMM does for an instruction KVM's emulator gave up on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Assist {
    /// `int3` (0xcc): step over it and deliver the breakpoint exception (#BP) it
    /// raises, with RIP after it, as the CPU would.
    Breakpoint,
    /// `fwait` (0x9b): step over it. It only delivers pending x87 exceptions, and a
    /// kernel keeps x87 exceptions masked.
    Fwait,
}

/// The `int3` opcode.
const INT3: u8 = 0xcc;
/// The `fwait` opcode.
const FWAIT: u8 = 0x9b;
/// Vector of the breakpoint exception.
const BP_VECTOR: u8 = 3;
/// Longest x86 instruction.
const MAX_INSTRUCTION: usize = 15;

impl Assist {
    /// The assist for the instruction that starts with `bytes`, if the VMM has one.
    pub fn for_instruction(bytes: &[u8]) -> Option<Assist> {
        match bytes.first() {
            Some(&INT3) => Some(Assist::Breakpoint),
            Some(&FWAIT) => Some(Assist::Fwait),
            _ => None,
        }
    }

    /// Finishes the instruction at the vCPU's RIP: RIP moves past it and, for `int3`,
    /// #BP is injected. KVM queued #UD for the instruction it could not emulate: that
    /// is dropped here, or the guest would take it on the next entry.
    pub fn apply(self, fd: &VcpuFd) -> Result<(), kvm_ioctls::Error> {
        let mut regs = fd.get_regs()?;
        regs.rip = regs.rip.wrapping_add(1);
        fd.set_regs(&regs)?;
        let mut events = fd.get_vcpu_events()?;
        events.exception.injected = 0;
        events.exception.pending = 0;
        events.exception.nr = 0;
        events.exception.has_error_code = 0;
        events.exception.error_code = 0;
        if self == Assist::Breakpoint {
            events.exception.injected = 1;
            events.exception.nr = BP_VECTOR;
        }
        fd.set_vcpu_events(&events)
    }
}

/// The instruction KVM could not emulate, for the report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedInstruction {
    /// Its linear address (CS base + RIP).
    pub address: u64,
    /// Its first bytes (up to 15), empty where they could not be read.
    pub bytes: Vec<u8>,
    /// Where the bytes came from.
    pub source: BytesSource,
}

/// Where [`FailedInstruction::bytes`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BytesSource {
    /// KVM's exit information (`KVM_INTERNAL_ERROR_EMULATION_FLAG_INSTRUCTION_BYTES`).
    Kvm,
    /// Guest memory, through the guest's page tables.
    GuestMemory,
    /// Neither had them.
    Unavailable,
}

impl fmt::Display for FailedInstruction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RIP {:#x}", self.address)?;
        if self.bytes.is_empty() {
            return write!(f, ", instruction bytes unreadable");
        }
        write!(f, ", instruction bytes")?;
        for b in &self.bytes {
            write!(f, " {b:02x}")?;
        }
        Ok(())
    }
}

/// The instruction bytes KVM put into `run` with its emulation failure, if it did
/// (kernels from 5.16 on include what the emulator fetched).
///
/// # Safety
/// `run` must be the vCPU's `kvm_run` mapping after an `KVM_EXIT_INTERNAL_ERROR` exit
/// with suberror `KVM_INTERNAL_ERROR_EMULATION`.
pub unsafe fn kvm_instruction_bytes(run: *const kvm_run) -> Option<Vec<u8>> {
    // SAFETY: per the caller's contract, the `emulation_failure` member of the union
    // is the one KVM filled.
    let failure = unsafe { (*run).__bindgen_anon_1.emulation_failure };
    if failure.ndata < 3
        || failure.flags & u64::from(KVM_INTERNAL_ERROR_EMULATION_FLAG_INSTRUCTION_BYTES) == 0
    {
        return None;
    }
    // SAFETY: the flag says KVM wrote the instruction-bytes member of the inner union.
    let insn = unsafe { failure.__bindgen_anon_1.__bindgen_anon_1 };
    let len = usize::from(insn.insn_size).min(insn.insn_bytes.len());
    (len > 0).then(|| insn.insn_bytes[..len].to_vec())
}

/// The instruction at the vCPU's RIP after an emulation failure: its bytes from
/// `kvm_bytes` (what KVM reported) when there are some, else read from `memory`
/// through the guest's page tables.
pub fn failed_instruction<M: GuestMemory>(
    fd: &VcpuFd,
    kvm_bytes: Option<Vec<u8>>,
    memory: Option<&M>,
) -> FailedInstruction {
    let (Ok(regs), Ok(sregs)) = (fd.get_regs(), fd.get_sregs()) else {
        return FailedInstruction {
            address: 0,
            bytes: Vec::new(),
            source: BytesSource::Unavailable,
        };
    };
    // CS's base is 0 in long mode; in protected mode it counts.
    let address = sregs.cs.base.wrapping_add(regs.rip);
    if let Some(bytes) = kvm_bytes {
        return FailedInstruction {
            address,
            bytes,
            source: BytesSource::Kvm,
        };
    }
    let paging = Paging {
        cr0: sregs.cr0,
        cr3: sregs.cr3,
        cr4: sregs.cr4,
        efer: sregs.efer,
    };
    let bytes = memory
        .map(|m| read_instruction(m, paging, address))
        .unwrap_or_default();
    let source = if bytes.is_empty() {
        BytesSource::Unavailable
    } else {
        BytesSource::GuestMemory
    };
    FailedInstruction {
        address,
        bytes,
        source,
    }
}

/// Page-table entry bits of x86-64 paging.
const PTE_PRESENT: u64 = 1;
const PTE_LARGE: u64 = 1 << 7;
/// Bits 51:12 of an entry: the next table's (or the page's) physical address.
const PTE_ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
/// CR0.PG: paging on.
const CR0_PG: u64 = 1 << 31;
/// CR4.PAE.
const CR4_PAE: u64 = 1 << 5;
/// CR4.LA57: five-level paging.
const CR4_LA57: u64 = 1 << 12;
/// EFER.LMA: long mode active.
const EFER_LMA: u64 = 1 << 10;

/// Why a guest address could not be translated.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum TranslateError {
    /// The guest uses a paging mode other than 4-level long-mode paging (or none).
    #[error("Unsupported guest paging mode")]
    PagingMode,
    /// A page-table entry on the way is not present.
    #[error("Address {0:#x} is not mapped")]
    NotMapped(u64),
    /// A page table lies outside guest memory.
    #[error("Page table at {0:#x} is outside guest memory")]
    TableOutsideMemory(u64),
}

/// The control registers that decide how the guest translates addresses.
#[derive(Clone, Copy, Debug)]
pub struct Paging {
    /// CR0.
    pub cr0: u64,
    /// CR3: the top-level table.
    pub cr3: u64,
    /// CR4.
    pub cr4: u64,
    /// EFER.
    pub efer: u64,
}

/// Translates linear address `addr` to a guest physical address by walking the
/// guest's page tables in `memory`: identity without paging, 4-level paging in long
/// mode (4 KiB, 2 MiB and 1 GiB pages). Used where KVM did not report the
/// instruction bytes, so the VMM reads them itself.
pub fn translate<M: GuestMemory>(
    memory: &M,
    paging: Paging,
    addr: u64,
) -> Result<u64, TranslateError> {
    if paging.cr0 & CR0_PG == 0 {
        return Ok(addr);
    }
    if paging.efer & EFER_LMA == 0 || paging.cr4 & CR4_PAE == 0 || paging.cr4 & CR4_LA57 != 0 {
        return Err(TranslateError::PagingMode);
    }
    let mut table = paging.cr3 & PTE_ADDR_MASK;
    // Levels from the PML4 (bits 47:39) down to the page table (bits 20:12).
    for level in (0..4u32).rev() {
        let shift = 12 + 9 * level;
        let index = (addr >> shift) & 0x1ff;
        let entry_addr = table + index * 8;
        let entry: u64 = memory
            .read_obj(GuestAddress(entry_addr))
            .map_err(|_| TranslateError::TableOutsideMemory(entry_addr))?;
        if entry & PTE_PRESENT == 0 {
            return Err(TranslateError::NotMapped(addr));
        }
        // A large page at the PDPT (1 GiB) or page-directory (2 MiB) level.
        if level == 0 || ((level == 1 || level == 2) && entry & PTE_LARGE != 0) {
            let page_mask = (1u64 << shift) - 1;
            return Ok((entry & PTE_ADDR_MASK & !page_mask) | (addr & page_mask));
        }
        table = entry & PTE_ADDR_MASK;
    }
    unreachable!("the walk returns at level 0")
}

/// Reads up to 15 bytes of the instruction at linear address `addr` from guest memory
/// through the guest's page tables, stopping early at an unmapped page.
pub fn read_instruction<M: GuestMemory>(memory: &M, paging: Paging, addr: u64) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(MAX_INSTRUCTION);
    while bytes.len() < MAX_INSTRUCTION {
        let at = addr.wrapping_add(bytes.len() as u64);
        let Ok(physical) = translate(memory, paging, at) else {
            break;
        };
        // Up to the end of this page: the next may map elsewhere.
        let in_page = (0x1000 - (at & 0xfff)) as usize;
        let mut chunk = vec![0u8; in_page.min(MAX_INSTRUCTION - bytes.len())];
        if memory
            .read_slice(&mut chunk, GuestAddress(physical))
            .is_err()
        {
            break;
        }
        bytes.extend_from_slice(&chunk);
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;
    use vm_memory::GuestMemoryMmap;

    #[test]
    fn kernels_run_emulated_on_pvm_only() {
        assert_eq!(
            KernelMode::for_kvm(KvmKind::Pvm),
            Some(KernelMode::Emulated)
        );
        assert_eq!(
            KernelMode::for_kvm(KvmKind::Hardware),
            Some(KernelMode::Native)
        );
        assert_eq!(KernelMode::for_kvm(KvmKind::None), None);
    }

    #[test]
    fn only_int3_and_fwait_get_an_assist() {
        assert_eq!(Assist::for_instruction(&[0xcc]), Some(Assist::Breakpoint));
        assert_eq!(Assist::for_instruction(&[0x9b, 0x90]), Some(Assist::Fwait));
        // lock cmpxchg16b, rdrand, an empty fetch.
        assert_eq!(
            Assist::for_instruction(&[0xf0, 0x48, 0x0f, 0xc7, 0x0e]),
            None
        );
        assert_eq!(Assist::for_instruction(&[0x0f, 0xc7, 0xf0]), None);
        assert_eq!(Assist::for_instruction(&[]), None);
    }

    #[test]
    fn what_the_emulator_lacks_is_hidden_and_nothing_else() {
        let leaf = |function, index| kvm_cpuid_entry2 {
            function,
            index,
            eax: 0xffff_ffff,
            ebx: 0xffff_ffff,
            ecx: 0xffff_ffff,
            edx: 0xffff_ffff,
            ..Default::default()
        };
        let untouched = [leaf(0, 0), leaf(7, 1), leaf(0x8000_0001, 0)];
        let mut entries = vec![leaf(1, 0), leaf(7, 0), leaf(0xd, 0), leaf(0xd, 1)];
        entries.extend_from_slice(&untouched);
        let mut cpuid = CpuId::from_entries(&entries).unwrap();
        mask_cpuid(&mut cpuid);
        let out = cpuid.as_slice();
        assert_eq!(
            out[0].ecx,
            !(ECX_CX16 | ECX_POPCNT | ECX_XSAVE | ECX_OSXSAVE)
        );
        assert_eq!((out[0].eax, out[0].ebx, out[0].edx), (!0, !0, !0));
        assert_eq!(out[1].ebx, !(EBX_SMAP | EBX_ERMS));
        assert_eq!((out[1].ecx, out[1].edx), (!0, !EDX_FSRM));
        for xsave in &out[2..4] {
            assert_eq!((xsave.eax, xsave.ebx, xsave.ecx, xsave.edx), (0, 0, 0, 0));
        }
        assert_eq!(&out[4..], &untouched);
    }

    #[test]
    fn a_failed_instruction_shows_address_and_bytes() {
        let failed = FailedInstruction {
            address: 0xffff_ffff_8100_0000,
            bytes: vec![0x0f, 0xc7, 0xf0],
            source: BytesSource::Kvm,
        };
        assert_eq!(
            failed.to_string(),
            "RIP 0xffffffff81000000, instruction bytes 0f c7 f0"
        );
        let unread = FailedInstruction {
            bytes: Vec::new(),
            source: BytesSource::Unavailable,
            ..failed
        };
        assert!(unread.to_string().ends_with("unreadable"), "{unread}");
    }

    /// 4-level tables mapping kernel-style addresses: a 4 KiB page, a 2 MiB page and a
    /// 1 GiB page, built in real guest memory.
    #[test]
    fn the_walk_follows_four_level_tables_and_large_pages() {
        let mem: GuestMemoryMmap =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 8 << 20)]).expect("guest memory");
        let (pml4, pdpt, pd, pt) = (0x1000u64, 0x2000u64, 0x3000u64, 0x4000u64);
        let entry = |table: u64, index: u64, value: u64| {
            mem.write_obj(value, GuestAddress(table + index * 8))
                .unwrap();
        };
        let base = 0xffff_ffff_8000_0000u64;
        let idx = |addr: u64, level: u32| (addr >> (12 + 9 * level)) & 0x1ff;
        entry(pml4, idx(base, 3), pdpt | 3);
        entry(pdpt, idx(base, 2), pd | 3);
        // 4 KiB page: base + 0x1000 -> 0x50_0000.
        entry(pd, idx(base, 1), pt | 3);
        entry(pt, 1, 0x50_0000 | 3);
        // 2 MiB page: base + 2 MiB -> 0x60_0000 (2 MiB aligned).
        entry(pd, 1, 0x60_0000 | 3 | PTE_LARGE);
        // 1 GiB page at the next PDPT slot -> 0x4000_0000.
        entry(pdpt, idx(base, 2) + 1, 0x4000_0000 | 3 | PTE_LARGE);
        let paging = Paging {
            cr0: CR0_PG | 1,
            cr3: pml4,
            cr4: CR4_PAE,
            efer: EFER_LMA | (1 << 8),
        };
        assert_eq!(translate(&mem, paging, base + 0x1234), Ok(0x50_0234));
        assert_eq!(translate(&mem, paging, base + (2 << 20) + 5), Ok(0x60_0005));
        assert_eq!(
            translate(&mem, paging, base + (1 << 30) + 0x12_3456),
            Ok(0x4012_3456)
        );
        assert_eq!(
            translate(&mem, paging, base + 0x2000),
            Err(TranslateError::NotMapped(base + 0x2000))
        );
        assert_eq!(translate(&mem, Paging { cr0: 1, ..paging }, 0x77), Ok(0x77));
        assert_eq!(
            translate(&mem, Paging { cr4: 0, ..paging }, base),
            Err(TranslateError::PagingMode)
        );

        // An instruction straddling the end of the mapped 4 KiB page: the bytes up to
        // the page end are read, then the walk stops at the unmapped next page.
        mem.write_slice(&[0xf0, 0x48, 0x0f, 0xc7], GuestAddress(0x50_0ffc))
            .unwrap();
        assert_eq!(
            read_instruction(&mem, paging, base + 0x1ffc),
            vec![0xf0, 0x48, 0x0f, 0xc7]
        );
        mem.write_slice(&[0xcc; 15], GuestAddress(0x60_0010))
            .unwrap();
        assert_eq!(
            read_instruction(&mem, paging, base + (2 << 20) + 0x10),
            vec![0xcc; 15]
        );
    }
}
