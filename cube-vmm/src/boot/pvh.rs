//! Booting an ELF `vmlinux` through its PVH entry point: linux-loader loads it, the
//! boot information (memory map, command line, initrd) goes into an `hvm_start_info`,
//! and the boot vCPU starts in 32-bit protected mode at the entry the kernel's Xen ELF
//! note names.

use std::path::Path;

use cube_mem::GuestMemory;
use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::KernelLoader;
use vm_memory::GuestAddress;

use super::{write_cmdline, LoadError, CMDLINE_ADDR, E820_RAM, EBDA_START, HIMEM_START};
use crate::arch::x86_64::layout::RamRange;

/// The `hvm_start_info` structure.
const START_INFO_ADDR: u64 = 0x6000;
/// The module list (the initrd).
const MODLIST_ADDR: u64 = 0x6800;
/// The memory map.
const MEMMAP_ADDR: u64 = 0x7000;
/// `XEN_HVM_START_MAGIC_VALUE`.
const PVH_MAGIC: u32 = 0x336e_c578;

/// Loads the ELF kernel at `path`; returns its PVH entry point.
pub fn load_kernel(memory: &GuestMemory, path: &Path) -> Result<GuestAddress, LoadError> {
    let mut file =
        std::fs::File::open(path).map_err(|e| LoadError::OpenKernel(path.to_path_buf(), e))?;
    let loaded = Elf::load(
        memory.inner(),
        None,
        &mut file,
        Some(GuestAddress(HIMEM_START)),
    )
    .map_err(|e| LoadError::LoadKernel(path.to_path_buf(), e))?;
    match loaded.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(entry) => Ok(entry),
        _ => Err(LoadError::NoPvhEntry(path.to_path_buf())),
    }
}

/// Writes the command line, the memory map and the module list (the initrd) into an
/// `hvm_start_info` that points the kernel at `rsdp`.
pub fn write_start_info(
    memory: &GuestMemory,
    ram: &[RamRange],
    cmdline: &str,
    modules: &[hvm_modlist_entry],
    rsdp: u64,
) -> Result<(), LoadError> {
    write_cmdline(memory, cmdline)?;

    // Conventional memory below the EBDA, then every RAM range from 1 MiB up.
    let mut memmap = vec![hvm_memmap_table_entry {
        addr: 0,
        size: EBDA_START,
        type_: E820_RAM,
        ..Default::default()
    }];
    for r in ram {
        let start = r.guest_addr.max(HIMEM_START);
        let end = r.guest_addr + r.size;
        if end > start {
            memmap.push(hvm_memmap_table_entry {
                addr: start,
                size: end - start,
                type_: E820_RAM,
                ..Default::default()
            });
        }
    }
    let start_info = hvm_start_info {
        magic: PVH_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_ADDR,
        memmap_paddr: MEMMAP_ADDR,
        memmap_entries: memmap.len() as u32,
        nr_modules: modules.len() as u32,
        modlist_paddr: if modules.is_empty() { 0 } else { MODLIST_ADDR },
        rsdp_paddr: rsdp,
        ..Default::default()
    };
    let mut params = BootParams::new(&start_info, GuestAddress(START_INFO_ADDR));
    params.set_sections(&memmap, GuestAddress(MEMMAP_ADDR));
    if !modules.is_empty() {
        params.set_modules(modules, GuestAddress(MODLIST_ADDR));
    }
    PvhBootConfigurator::write_bootparams(&params, memory.inner())
        .map_err(|e| LoadError::BootParams(format!("{e:?}")))
}

/// The PVH boot ABI: 32-bit protected mode, flat segments, paging off, `ebx` pointing
/// at the start info.
pub fn pvh_registers(entry: GuestAddress) -> (kvm_regs, kvm_sregs) {
    let flat = |selector: u16, type_: u8| kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 0,
        db: 1,
        s: 1,
        l: 0,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    };
    let data = flat(0x18, 0x3);
    let sregs = kvm_sregs {
        cs: flat(0x10, 0xb),
        ds: data,
        es: data,
        fs: data,
        gs: data,
        ss: data,
        tr: kvm_segment {
            limit: 0x67,
            type_: 0xb,
            present: 1,
            ..Default::default()
        },
        ldt: kvm_segment {
            unusable: 1,
            ..Default::default()
        },
        // PE | ET
        cr0: 0x11,
        ..Default::default()
    };
    let regs = kvm_regs {
        rip: entry.0,
        rbx: START_INFO_ADDR,
        rflags: 0x2,
        ..Default::default()
    };
    (regs, sregs)
}
