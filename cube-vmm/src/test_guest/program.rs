//! The synthetic test guest: a few hundred bytes of x86-64 code, page tables and a GDT
//! that the VMM writes into fresh guest memory.
//!
//! The vCPUs start directly in 64-bit mode at CPL3. On PVM hosts guest CPL0 code is
//! emulated (slow) while CPL3 code runs natively, so everything the guest does after
//! entry, including its hot loop, runs at native speed. It never needs CPL0: it talks
//! to the host through the mailbox page and idles by writing to the control device,
//! which exits to the VMM as MMIO.

use iced_x86::code_asm::{
    dword_ptr, qword_ptr, r14, r15, r8, rax, rbx, rcx, rdi, rdx, rsi, CodeAssembler, IcedError,
};
use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::mailbox::{
    field, op, Mode, DIRTY_AREA_ADDR, MAILBOX_ADDR, MAILBOX_MAGIC, WORKING_SET_READ_ADDR,
    WORKING_SET_WRITE_ADDR,
};
use crate::arch::x86_64::layout::{RamRange, CONTROL_DEVICE_ADDR, MMIO_HOLE_START};
use crate::control_device::IDLE_REGISTER;
use crate::persist::state::{WorkingSet, WORKING_SET_MAX_BYTES};

/// Guest physical address of the GDT.
const GDT_ADDR: u64 = 0x1000;
/// Guest physical address of the (unused but architecturally required) 64-bit TSS.
const TSS_ADDR: u64 = 0x1800;
/// Guest physical address of the code.
pub const CODE_ADDR: u64 = 0x20000;
/// Largest program the layout leaves room for.
const CODE_MAX: usize = 0x4000;
/// Guest physical address of the top-level page table.
const PML4_ADDR: u64 = 0x10_0000;
/// Guest physical address of the page-directory-pointer table.
const PDPT_ADDR: u64 = 0x10_1000;
/// Guest physical address of the first page directory.
const PD_BASE_ADDR: u64 = 0x10_2000;

const GIB: u64 = 1 << 30;
/// Present, writable, user-accessible.
const PTE_USER_RW: u64 = 0x7;
/// ... and a 2 MiB page.
const PTE_USER_RW_2M: u64 = 0x87;

const SELECTOR_USER_CODE: u16 = 0x1b;
const SELECTOR_USER_DATA: u16 = 0x23;
const SELECTOR_TSS: u16 = 0x28;

/// Why the guest could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    /// The assembler refused the program (a bug in this file).
    #[error("Assembling the test guest failed")]
    Assemble(#[source] IcedError),
    /// The program outgrew its slot.
    #[error("Test guest code is {0} bytes, more than its {CODE_MAX} byte slot")]
    TooLarge(usize),
    /// Writing into guest memory failed.
    #[error("Writing the test guest into guest memory failed")]
    Memory(#[source] vm_memory::GuestMemoryError),
    /// The guest memory is too small for the working sets.
    #[error("Guest memory of {0} bytes is too small for the test guest")]
    MemoryTooSmall(u64),
}

/// Entry points of the assembled program.
struct Assembled {
    code: Vec<u8>,
    primary_entry: u64,
    secondary_entry: u64,
}

fn assemble() -> Result<Assembled, IcedError> {
    let mut a = CodeAssembler::new(64)?;
    let mut main = a.create_label();
    let mut idle = a.create_label();
    let mut mismatch = a.create_label();
    let mut new_generation = a.create_label();
    let mut read_loop = a.create_label();
    let mut read_done = a.create_label();
    let mut write_loop = a.create_label();
    let mut write_done = a.create_label();
    let mut command = a.create_label();
    let mut dirty_loop = a.create_label();
    let mut not_dirty = a.create_label();
    let mut command_done = a.create_label();
    let mut secondary = a.create_label();
    let mut secondary_loop = a.create_label();

    let mb = |off: u64| qword_ptr(rbx + off as i32);

    // vCPU 0. r15 mirrors the counter; rbx points at the mailbox.
    a.mov(rbx, MAILBOX_ADDR)?;
    a.mov(r15, mb(field::COUNTER))?;
    a.mov(r14, CONTROL_DEVICE_ADDR)?;
    a.set_label(&mut main)?;
    a.mov(rax, mb(field::HOST_GENERATION))?;
    a.cmp(rax, mb(field::ACK_GENERATION))?;
    a.jne(new_generation)?;
    a.mov(rax, mb(field::COMMAND_SEQ))?;
    a.cmp(rax, mb(field::DONE_SEQ))?;
    a.jne(command)?;
    a.cmp(mb(field::MODE), Mode::Spin as i32)?;
    a.jne(idle)?;
    a.mov(rax, mb(field::COUNTER))?;
    a.cmp(rax, r15)?;
    a.jne(mismatch)?;
    a.inc(r15)?;
    a.mov(mb(field::COUNTER), r15)?;
    a.jmp(main)?;

    // Idle: an MMIO write the VMM answers by parking this vCPU until the doorbell.
    a.set_label(&mut idle)?;
    a.mov(dword_ptr(r14 + IDLE_REGISTER as i32), 1)?;
    a.jmp(main)?;

    // Memory and registers disagree: a restore mixed two moments. Report and resync.
    a.set_label(&mut mismatch)?;
    a.mov(mb(field::ERROR_MEMORY), rax)?;
    a.mov(mb(field::ERROR_REGISTER), r15)?;
    a.mov(mb(field::ERROR), 1)?;
    a.mov(r15, rax)?;
    a.jmp(main)?;

    // Started or restored: say so, then touch the working set.
    a.set_label(&mut new_generation)?;
    a.mov(mb(field::ACK_GENERATION), rax)?;
    a.mov(rsi, WORKING_SET_READ_ADDR)?;
    a.mov(rcx, mb(field::WORKING_SET_READ_PAGES))?;
    a.set_label(&mut read_loop)?;
    a.test(rcx, rcx)?;
    a.jz(read_done)?;
    // A restore in mid-pass starts over at once: the guest answers in microseconds,
    // like a real guest would be running right after restore.
    a.cmp(rax, mb(field::HOST_GENERATION))?;
    a.jne(main)?;
    a.mov(rdx, qword_ptr(rsi))?;
    a.add(rsi, 4096)?;
    a.dec(rcx)?;
    a.jmp(read_loop)?;
    a.set_label(&mut read_done)?;
    a.mov(rdi, WORKING_SET_WRITE_ADDR)?;
    a.mov(rcx, mb(field::WORKING_SET_WRITE_PAGES))?;
    a.set_label(&mut write_loop)?;
    a.test(rcx, rcx)?;
    a.jz(write_done)?;
    a.cmp(rax, mb(field::HOST_GENERATION))?;
    a.jne(main)?;
    a.mov(qword_ptr(rdi), rax)?;
    a.add(rdi, 4096)?;
    a.dec(rcx)?;
    a.jmp(write_loop)?;
    a.set_label(&mut write_done)?;
    a.mov(mb(field::WORKING_SET_GENERATION), rax)?;
    a.jmp(main)?;

    // A command: rax holds its sequence number.
    a.set_label(&mut command)?;
    a.mov(rdx, mb(field::COMMAND_OP))?;
    a.cmp(rdx, op::DIRTY as i32)?;
    a.jne(not_dirty)?;
    a.mov(rdi, DIRTY_AREA_ADDR)?;
    a.mov(rcx, mb(field::COMMAND_ARG))?;
    a.mov(r8, mb(field::COMMAND_PATTERN))?;
    a.set_label(&mut dirty_loop)?;
    a.test(rcx, rcx)?;
    a.jz(command_done)?;
    a.mov(qword_ptr(rdi), r8)?;
    a.inc(r8)?;
    a.add(rdi, 4096)?;
    a.dec(rcx)?;
    a.jmp(dirty_loop)?;
    a.set_label(&mut not_dirty)?;
    a.cmp(rdx, op::SET_MODE as i32)?;
    a.jne(command_done)?;
    a.mov(rdx, mb(field::COMMAND_ARG))?;
    a.mov(mb(field::MODE), rdx)?;
    a.set_label(&mut command_done)?;
    a.mov(mb(field::DONE_SEQ), rax)?;
    a.jmp(main)?;

    // Every other vCPU idles for ever; they exist so the guest has the spec'd vCPUs.
    a.set_label(&mut secondary)?;
    a.mov(r14, CONTROL_DEVICE_ADDR)?;
    a.set_label(&mut secondary_loop)?;
    a.mov(dword_ptr(r14 + IDLE_REGISTER as i32), 1)?;
    a.jmp(secondary_loop)?;

    let result = a.assemble_options(
        CODE_ADDR,
        iced_x86::BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS,
    )?;
    let secondary_entry = result.label_ip(&secondary)?;
    Ok(Assembled {
        code: result.inner.code_buffer,
        primary_entry: CODE_ADDR,
        secondary_entry,
    })
}

/// Writes the test guest into zeroed guest memory and returns the initial registers
/// of each vCPU.
pub fn load(
    memory: &GuestMemoryMmap<AtomicBitmap>,
    ram: &[RamRange],
    vcpus: u8,
    working_set: WorkingSet,
) -> Result<Vec<(kvm_regs, kvm_sregs)>, ProgramError> {
    let total: u64 = ram.iter().map(|r| r.size).sum();
    let needed = DIRTY_AREA_ADDR + (2 << 20);
    let ws_max = WORKING_SET_MAX_BYTES;
    if total < needed || working_set.read_bytes > ws_max || working_set.write_bytes > ws_max {
        return Err(ProgramError::MemoryTooSmall(total));
    }
    let assembled = assemble().map_err(ProgramError::Assemble)?;
    if assembled.code.len() > CODE_MAX {
        return Err(ProgramError::TooLarge(assembled.code.len()));
    }
    let write = |addr: u64, bytes: &[u8]| {
        memory
            .write_slice(bytes, GuestAddress(addr))
            .map_err(ProgramError::Memory)
    };
    let write_u64 = |addr: u64, value: u64| write(addr, &value.to_le_bytes());

    write(CODE_ADDR, &assembled.code)?;

    // GDT: null, kernel code, kernel data, user code, user data, 16-byte TSS descriptor.
    let gdt: [u64; 5] = [
        0,
        0x00af_9b00_0000_ffff,
        0x00cf_9300_0000_ffff,
        0x00af_fb00_0000_ffff,
        0x00cf_f300_0000_ffff,
    ];
    for (i, entry) in gdt.iter().enumerate() {
        write_u64(GDT_ADDR + 8 * i as u64, *entry)?;
    }
    let tss_limit = 0x67u64;
    let tss_low = tss_limit
        | ((TSS_ADDR & 0xff_ffff) << 16)
        | (0x89u64 << 40)
        | (((TSS_ADDR >> 24) & 0xff) << 56);
    write_u64(GDT_ADDR + 40, tss_low)?;
    write_u64(GDT_ADDR + 48, TSS_ADDR >> 32)?;

    // Identity map every GiB that holds RAM or the control device with 2 MiB pages.
    let mut gibs: Vec<u64> = ram
        .iter()
        .flat_map(|r| (r.guest_addr / GIB)..(r.guest_addr + r.size).div_ceil(GIB))
        .collect();
    gibs.push(MMIO_HOLE_START / GIB);
    gibs.sort_unstable();
    gibs.dedup();
    write_u64(PML4_ADDR, PDPT_ADDR | PTE_USER_RW)?;
    for (n, gib) in gibs.iter().enumerate() {
        let pd = PD_BASE_ADDR + 4096 * n as u64;
        write_u64(PDPT_ADDR + 8 * gib, pd | PTE_USER_RW)?;
        let mut entries = [0u8; 4096];
        for (i, chunk) in entries.chunks_exact_mut(8).enumerate() {
            let phys = gib * GIB + ((i as u64) << 21);
            chunk.copy_from_slice(&(phys | PTE_USER_RW_2M).to_le_bytes());
        }
        write(pd, &entries)?;
    }

    write_u64(MAILBOX_ADDR + field::MAGIC, MAILBOX_MAGIC)?;
    write_u64(
        MAILBOX_ADDR + field::WORKING_SET_READ_PAGES,
        working_set.read_bytes / 4096,
    )?;
    write_u64(
        MAILBOX_ADDR + field::WORKING_SET_WRITE_PAGES,
        working_set.write_bytes / 4096,
    )?;

    Ok((0..vcpus)
        .map(|i| {
            let entry = if i == 0 {
                assembled.primary_entry
            } else {
                assembled.secondary_entry
            };
            initial_registers(entry)
        })
        .collect())
}

/// Largest number of pages a dirty command may cover in a guest of `total` bytes.
pub fn dirty_area_pages(ram: &[RamRange]) -> u64 {
    // The dirty area is only the part below the hole that lies past DIRTY_AREA_ADDR.
    ram.first()
        .map(|r| (r.guest_addr + r.size).saturating_sub(DIRTY_AREA_ADDR) / 4096)
        .unwrap_or(0)
}

fn segment(selector: u16, type_: u8, long: u8, db: u8) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 3,
        db,
        s: 1,
        l: long,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

fn initial_registers(entry: u64) -> (kvm_regs, kvm_sregs) {
    let regs = kvm_regs {
        rip: entry,
        // Bit 1 is reserved-one; IF stays clear: the guest has no IDT.
        rflags: 0x2,
        ..Default::default()
    };
    let data = segment(SELECTOR_USER_DATA, 0x3, 0, 1);
    let sregs = kvm_sregs {
        cs: segment(SELECTOR_USER_CODE, 0xb, 1, 0),
        ds: data,
        es: data,
        fs: data,
        gs: data,
        ss: data,
        tr: kvm_segment {
            base: TSS_ADDR,
            limit: 0x67,
            selector: SELECTOR_TSS,
            type_: 0xb,
            present: 1,
            ..Default::default()
        },
        ldt: kvm_segment {
            unusable: 1,
            ..Default::default()
        },
        gdt: kvm_bindings::kvm_dtable {
            base: GDT_ADDR,
            limit: 0x37,
            ..Default::default()
        },
        // PG | AM | WP | NE | ET | MP | PE
        cr0: 0x8005_0033,
        cr3: PML4_ADDR,
        // OSXMMEXCPT | OSFXSR | PAE
        cr4: 0x620,
        // LMA | LME | SCE
        efer: 0x501,
        ..Default::default()
    };
    (regs, sregs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn program_assembles_and_fits() {
        let a = assemble().unwrap();
        assert!(a.code.len() < CODE_MAX);
        assert!(a.secondary_entry > a.primary_entry);
    }
}
