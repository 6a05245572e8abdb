//! Booting a Linux bzImage through the 64-bit boot protocol
//! (Documentation/arch/x86/boot.rst): linux-loader loads the protected-mode kernel and
//! returns its setup header; Cube fills the zero page (boot_params: e820 map, command
//! line, initrd), builds identity-mapped page tables for the first 1 GiB and a flat
//! GDT, and starts the boot vCPU in long mode at the kernel's 64-bit entry.

use std::path::Path;

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::bzimage::BzImage;
use linux_loader::loader::KernelLoader;
use vm_memory::{Bytes, GuestAddress};

use cube_devices::virtio::VirtioMemory;

use super::{LoadError, E820_RAM, EBDA_START};
use crate::arch::x86_64::layout::RamRange;

/// Where the protected-mode kernel is loaded (1 MiB).
const KERNEL_START: u64 = 0x10_0000;
/// The GDT.
const GDT_ADDR: u64 = 0x500;
/// The (empty) IDT.
const IDT_ADDR: u64 = 0x520;
/// The zero page (boot_params).
const ZERO_PAGE_ADDR: u64 = 0x7000;
/// Page-map level 4, page-directory-pointer table and page directory.
const PML4_ADDR: u64 = 0x9000;
const PDPTE_ADDR: u64 = 0xa000;
const PDE_ADDR: u64 = 0xb000;
/// Bootloader id "undefined" (0xff): Cube has no assigned id.
const LOADER_TYPE: u8 = 0xff;
/// `boot_flag` and `header` magic values of a valid setup header.
const BOOT_FLAG: u16 = 0xaa55;
const HDRS_MAGIC: u32 = 0x5372_6448;
/// loadflags bit: the kernel may use the heap up to heap_end_ptr.
const CAN_USE_HEAP: u8 = 0x80;
/// The 64-bit entry point's distance from the protected-mode kernel's start.
const ENTRY_64_OFFSET: u64 = 0x200;
const E820_RESERVED: u32 = 2;

/// Whether the file at `path` is a bzImage (the setup header's `HdrS` magic).
pub fn is_bzimage(path: &Path) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path)?;
    let mut magic = [0u8; 4];
    if file.seek(SeekFrom::Start(0x202)).is_err() || file.read_exact(&mut magic).is_err() {
        return Ok(false);
    }
    Ok(u32::from_le_bytes(magic) == HDRS_MAGIC)
}

/// What the loaded kernel needs to start: its 64-bit entry and its setup header.
pub struct LoadedBzImage {
    entry: GuestAddress,
    header: linux_loader::loader::bootparam::setup_header,
}

/// Loads the bzImage at `path` into `memory`.
pub fn load(memory: &VirtioMemory, path: &Path) -> Result<LoadedBzImage, LoadError> {
    let mut file =
        std::fs::File::open(path).map_err(|e| LoadError::OpenKernel(path.to_path_buf(), e))?;
    let loaded = BzImage::load(
        memory,
        Some(GuestAddress(KERNEL_START)),
        &mut file,
        Some(GuestAddress(KERNEL_START)),
    )
    .map_err(|e| LoadError::LoadKernel(path.to_path_buf(), e))?;
    let header = loaded
        .setup_header
        .ok_or_else(|| LoadError::BootParams("bzImage has no setup header".into()))?;
    let version = header.version;
    if version < 0x0206 {
        return Err(LoadError::BootParams(format!(
            "bzImage boot protocol {version:#x} is older than 2.06 (no 64-bit entry)"
        )));
    }
    Ok(LoadedBzImage {
        entry: GuestAddress(loaded.kernel_load.0 + ENTRY_64_OFFSET),
        header,
    })
}

/// Where the command line and initrd went.
pub struct BootInputs {
    /// Guest address of the NUL-terminated command line.
    pub cmdline_addr: u64,
    /// Its length without the NUL.
    pub cmdline_len: u32,
    /// Guest address and size of the initrd, if any.
    pub initrd: Option<(u64, u64)>,
    /// Guest address of the ACPI RSDP.
    pub rsdp: u64,
}

/// Writes the zero page, page tables and GDT, and returns the boot vCPU's registers.
pub fn configure(
    memory: &VirtioMemory,
    kernel: &LoadedBzImage,
    ram: &[RamRange],
    inputs: &BootInputs,
) -> Result<(kvm_regs, kvm_sregs), LoadError> {
    let write_err = |what: &str, e: vm_memory::GuestMemoryError| {
        LoadError::BootParams(format!("writing the {what}: {e}"))
    };
    let mut params = boot_params {
        hdr: kernel.header,
        ..Default::default()
    };
    params.hdr.type_of_loader = LOADER_TYPE;
    params.hdr.boot_flag = BOOT_FLAG;
    params.hdr.header = HDRS_MAGIC;
    params.hdr.loadflags |= CAN_USE_HEAP;
    params.hdr.heap_end_ptr = 0xfe00;
    params.hdr.cmd_line_ptr = u32::try_from(inputs.cmdline_addr)
        .map_err(|_| LoadError::BootParams("command line above 4 GiB".into()))?;
    params.hdr.cmdline_size = inputs.cmdline_len;
    params.acpi_rsdp_addr = inputs.rsdp;
    if let Some((addr, size)) = inputs.initrd {
        params.hdr.ramdisk_image =
            u32::try_from(addr).map_err(|_| LoadError::BootParams("initrd above 4 GiB".into()))?;
        params.hdr.ramdisk_size = u32::try_from(size)
            .map_err(|_| LoadError::BootParams("initrd of 4 GiB or more".into()))?;
    }
    let mut e820 = vec![
        (0, EBDA_START, E820_RAM),
        (EBDA_START, 0x10_0000 - EBDA_START, E820_RESERVED),
    ];
    for r in ram {
        let start = r.guest_addr.max(0x10_0000);
        let end = r.guest_addr + r.size;
        if end > start {
            e820.push((start, end - start, E820_RAM));
        }
    }
    if e820.len() > params.e820_table.len() {
        return Err(LoadError::BootParams("too many e820 entries".into()));
    }
    for (slot, (addr, size, type_)) in params.e820_table.iter_mut().zip(&e820) {
        *slot = boot_e820_entry {
            addr: *addr,
            size: *size,
            r#type: *type_,
        };
    }
    params.e820_entries = e820.len() as u8;
    memory
        .write_obj(params, GuestAddress(ZERO_PAGE_ADDR))
        .map_err(|e| write_err("zero page", e))?;

    // Identity map of the first 1 GiB with 2 MiB pages: enough for the kernel's own
    // early page tables to take over.
    memory
        .write_obj(PDPTE_ADDR | 0x03, GuestAddress(PML4_ADDR))
        .map_err(|e| write_err("PML4", e))?;
    memory
        .write_obj(PDE_ADDR | 0x03, GuestAddress(PDPTE_ADDR))
        .map_err(|e| write_err("PDPTE", e))?;
    for i in 0..512u64 {
        // Present, writable, 2 MiB page.
        memory
            .write_obj((i << 21) | 0x83, GuestAddress(PDE_ADDR + i * 8))
            .map_err(|e| write_err("page directory", e))?;
    }

    let code = segment(1, 0xa09b);
    let data = segment(2, 0xc093);
    let tss = segment(3, 0x808b);
    let gdt: [u64; 4] = [0, gdt_entry(0xa09b), gdt_entry(0xc093), gdt_entry(0x808b)];
    for (i, entry) in gdt.iter().enumerate() {
        memory
            .write_obj(*entry, GuestAddress(GDT_ADDR + 8 * i as u64))
            .map_err(|e| write_err("GDT", e))?;
    }
    memory
        .write_obj(0u64, GuestAddress(IDT_ADDR))
        .map_err(|e| write_err("IDT", e))?;

    let mut sregs = kvm_sregs {
        cs: code,
        ds: data,
        es: data,
        fs: data,
        gs: data,
        ss: data,
        tr: tss,
        ..Default::default()
    };
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.idt.base = IDT_ADDR;
    sregs.idt.limit = 7;
    sregs.ldt.unusable = 1;
    // PE | ET | PG; PAE; LME | LMA.
    sregs.cr0 = 0x8000_0011;
    sregs.cr3 = PML4_ADDR;
    sregs.cr4 = 0x20;
    sregs.efer = 0x500;
    let regs = kvm_regs {
        rip: kernel.entry.0,
        rsi: ZERO_PAGE_ADDR,
        rflags: 0x2,
        // A stack below the zero page for the kernel's first calls.
        rsp: 0x8ff0,
        rbp: 0x8ff0,
        ..Default::default()
    };
    Ok((regs, sregs))
}

/// A flat GDT descriptor with access/flag bits `flags` (base 0, limit 4 GiB).
fn gdt_entry(flags: u16) -> u64 {
    let (base, limit) = (0u64, 0xfffffu64);
    ((base & 0xff00_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0x0000_ffff)
        | ((limit & 0x000f_0000) << 32)
        | (u64::from(flags & 0xf0ff) << 40)
}

/// The KVM segment for GDT entry `index` with `flags`, matching [`gdt_entry`].
fn segment(index: u16, flags: u16) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: index * 8,
        type_: (flags & 0xf) as u8,
        present: ((flags >> 7) & 1) as u8,
        dpl: ((flags >> 5) & 3) as u8,
        db: ((flags >> 14) & 1) as u8,
        s: ((flags >> 4) & 1) as u8,
        l: ((flags >> 13) & 1) as u8,
        g: ((flags >> 15) & 1) as u8,
        avl: ((flags >> 12) & 1) as u8,
        unusable: if (flags >> 7) & 1 == 0 { 1 } else { 0 },
        padding: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_encode_flat_long_mode_segments() {
        // The values Firecracker and the kernel's own boot GDT use.
        assert_eq!(gdt_entry(0xa09b), 0x00af_9b00_0000_ffff);
        assert_eq!(gdt_entry(0xc093), 0x00cf_9300_0000_ffff);
        let cs = segment(1, 0xa09b);
        assert_eq!(
            (cs.selector, cs.l, cs.db, cs.type_, cs.present),
            (8, 1, 0, 0xb, 1)
        );
        let ds = segment(2, 0xc093);
        assert_eq!((ds.selector, ds.l, ds.db, ds.type_), (16, 0, 1, 3));
    }

    #[test]
    fn files_without_a_setup_header_are_not_bzimages() {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), b"\x7fELF").unwrap();
        assert!(!is_bzimage(f.path()).unwrap());
        let mut image = vec![0u8; 0x400];
        image[0x202..0x206].copy_from_slice(b"HdrS");
        std::fs::write(f.path(), &image).unwrap();
        assert!(is_bzimage(f.path()).unwrap());
    }
}
