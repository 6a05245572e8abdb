//! ACPI tables for a Linux guest: how it finds its CPUs (MADT) and its virtio-mmio
//! devices (DSDT, one `LNRO0005` device each) without a BIOS.
//!
//! Stock distribution kernels need this: Debian's cloud kernel is built without
//! `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES` (so `virtio_mmio.device=` does nothing) and
//! without `CONFIG_X86_MPPARSE` (so an MP table is ignored). The tables describe a
//! hardware-reduced ACPI platform, as Firecracker's do, and live in the BIOS area
//! (0xE0000..0xFFFFF), which the e820 map keeps out of RAM; the RSDP is also passed
//! to the kernel directly (PVH start info or the zero page).

use acpi_tables::aml;
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;
use vm_memory::{Bytes, GuestAddress};

use cube_devices::serial::{
    COM1_BASE, COM1_IRQ, COM1_PORTS, S5_SLEEP_TYPE, SLEEP_CONTROL_PORT, SLEEP_STATUS_PORT,
};
use cube_devices::virtio::VirtioMemory;

/// Where the RSDP goes (the kernel also finds it by scanning this area).
pub const RSDP_ADDR: u64 = 0xe_0000;
/// End of the area the tables may use.
const TABLES_END: u64 = 0x10_0000;
const OEM_ID: [u8; 6] = *b"CUBEVM";
const OEM_TABLE_ID: [u8; 8] = *b"CUBEVMM ";
const LOCAL_APIC_ADDR: u32 = 0xfee0_0000;
const IO_APIC_ADDR: u32 = 0xfec0_0000;
/// IAPC_BOOT_ARCH: no VGA, no CMOS RTC, no legacy 8042 to probe (Cube's i8042 only
/// takes the reset command).
const IAPC_BOOT_ARCH: u16 = (1 << 2) | (1 << 5);

/// Why the tables could not be written.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    /// The tables do not fit in the BIOS area.
    #[error("ACPI tables need {0} bytes, more than the BIOS area holds")]
    TooLarge(u64),
    /// Writing guest memory failed.
    #[error("Writing ACPI tables into guest memory failed")]
    Memory(#[source] vm_memory::GuestMemoryError),
    /// More vCPUs than an 8-bit APIC id can number.
    #[error("{0} vCPUs do not fit in xAPIC ids")]
    TooManyVcpus(usize),
}

/// One virtio-mmio device as the guest should see it.
#[derive(Clone, Copy, Debug)]
pub struct MmioDeviceInfo {
    /// Base of its 4 KiB window.
    pub base: u64,
    /// Its interrupt line (GSI).
    pub irq: u32,
}

fn bytes_of(table: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    table.to_aml_bytes(&mut v);
    v
}

/// COM1 as an ACPI device (`PNP0501`, its ports and IRQ 4). Hardware-reduced ACPI
/// means no legacy PIC to Linux, hence no ISA interrupts: the 8250 driver gets COM1's
/// interrupt only through this node (PnP). Without it the console's tty fails every
/// write from user space (printk's console path polls and still works).
fn com1_device(sink: &mut Vec<u8>) {
    let ports = aml::IO::new(COM1_BASE, COM1_BASE, 1, COM1_PORTS as u8);
    let irq = aml::Interrupt::new(true, true, false, false, COM1_IRQ);
    let crs = aml::ResourceTemplate::new(vec![&ports, &irq]);
    let hid = aml::EISAName::new("PNP0501");
    let uid = 0u32;
    let hid = aml::Name::new("_HID".into(), &hid);
    let uid = aml::Name::new("_UID".into(), &uid);
    let crs = aml::Name::new("_CRS".into(), &crs);
    aml::Device::new("COM1".into(), vec![&hid, &uid, &crs]).to_aml_bytes(sink);
}

/// The DSDT: COM1, then one virtio-mmio device node per device.
fn dsdt(devices: &[MmioDeviceInfo]) -> Vec<u8> {
    let mut body = Vec::new();
    com1_device(&mut body);
    for (i, d) in devices.iter().enumerate() {
        let name = format!("V{i:03X}");
        let window = aml::Memory32Fixed::new(true, d.base as u32, 0x1000);
        let irq = aml::Interrupt::new(true, true, false, false, d.irq);
        let crs = aml::ResourceTemplate::new(vec![&window, &irq]);
        let hid: aml::AmlString = "LNRO0005".to_string();
        let uid = i as u32;
        let hid = aml::Name::new("_HID".into(), &hid);
        let uid = aml::Name::new("_UID".into(), &uid);
        let cca = aml::Name::new("_CCA".into(), &aml::ONE);
        let crs = aml::Name::new("_CRS".into(), &crs);
        aml::Device::new(name.as_str().into(), vec![&hid, &uid, &cca, &crs])
            .to_aml_bytes(&mut body);
    }
    let mut scope = Vec::new();
    RawScope { body: &body }.to_aml_bytes(&mut scope);
    // \_S5: the sleep type of soft-off, which Linux writes to the sleep control
    // register on poweroff.
    let s5_type = S5_SLEEP_TYPE;
    aml::Name::new("_S5_".into(), &aml::Package::new(vec![&s5_type])).to_aml_bytes(&mut scope);
    let mut table = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE_ID, 1);
    for b in scope {
        table.append(b);
    }
    table.update_checksum();
    bytes_of(&table)
}

/// `Scope (\_SB) { <body> }` around already encoded device objects.
struct RawScope<'a> {
    body: &'a [u8],
}

impl Aml for RawScope<'_> {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        const SCOPEOP: u8 = 0x10;
        let mut inner = Vec::new();
        aml::Path::new("\\_SB_").to_aml_bytes(&mut inner);
        inner.extend_from_slice(self.body);
        sink.byte(SCOPEOP);
        encode_pkg_length(inner.len(), sink);
        sink.vec(&inner);
    }
}

/// An AML PkgLength covering `len` bytes of content plus the length field itself.
fn encode_pkg_length(len: usize, sink: &mut dyn acpi_tables::AmlSink) {
    let total = |n: usize| len + n;
    if total(1) < 1 << 6 {
        sink.byte(total(1) as u8);
    } else if total(2) < 1 << 12 {
        let t = total(2);
        sink.byte((1 << 6) | (t & 0xf) as u8);
        sink.byte((t >> 4) as u8);
    } else if total(3) < 1 << 20 {
        let t = total(3);
        sink.byte((2 << 6) | (t & 0xf) as u8);
        sink.byte((t >> 4) as u8);
        sink.byte((t >> 12) as u8);
    } else {
        let t = total(4);
        sink.byte((3 << 6) | (t & 0xf) as u8);
        sink.byte((t >> 4) as u8);
        sink.byte((t >> 12) as u8);
        sink.byte((t >> 20) as u8);
    }
}

fn madt(vcpus: u8) -> Vec<u8> {
    let mut madt = MADT::new(
        OEM_ID,
        OEM_TABLE_ID,
        1,
        LocalInterruptController::Address(LOCAL_APIC_ADDR),
    );
    for id in 0..vcpus {
        madt.add_structure(ProcessorLocalApic::new(id, id, EnabledStatus::Enabled));
    }
    madt.add_structure(IoApic::new(0, IO_APIC_ADDR, 0));
    bytes_of(&madt)
}

fn fadt(dsdt_addr: u64) -> Vec<u8> {
    let mut builder = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, 1)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton)
        .dsdt_64(dsdt_addr);
    builder.iapc_boot_arch = IAPC_BOOT_ARCH.into();
    let port = |p: u16| {
        GAS::new(
            AddressSpace::SystemIo,
            8,
            0,
            AccessSize::ByteAccess,
            p.into(),
        )
    };
    builder.sleep_control_reg = port(SLEEP_CONTROL_PORT);
    builder.sleep_status_reg = port(SLEEP_STATUS_PORT);
    bytes_of(&builder.finalize())
}

fn rsdp(xsdt_addr: u64) -> [u8; 36] {
    let mut r = [0u8; 36];
    r[..8].copy_from_slice(b"RSD PTR ");
    r[9..15].copy_from_slice(&OEM_ID);
    r[15] = 2;
    r[20..24].copy_from_slice(&36u32.to_le_bytes());
    r[24..32].copy_from_slice(&xsdt_addr.to_le_bytes());
    r[8] = checksum(&r[..20]);
    r[32] = checksum(&r);
    r
}

/// The byte that makes `data` sum to zero.
fn checksum(data: &[u8]) -> u8 {
    0u8.wrapping_sub(data.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// Writes RSDP, XSDT, FADT, MADT and DSDT for `vcpus` vCPUs and `devices`; returns
/// the RSDP's address.
pub fn write_tables(
    memory: &VirtioMemory,
    vcpus: u8,
    devices: &[MmioDeviceInfo],
) -> Result<u64, AcpiError> {
    let align = |a: u64| (a + 15) & !15;
    let dsdt_addr = align(RSDP_ADDR + 36);
    let dsdt = dsdt(devices);
    let fadt_addr = align(dsdt_addr + dsdt.len() as u64);
    let fadt = fadt(dsdt_addr);
    let madt_addr = align(fadt_addr + fadt.len() as u64);
    let madt = madt(vcpus);
    let xsdt_addr = align(madt_addr + madt.len() as u64);
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, 1);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let xsdt = bytes_of(&xsdt);
    let end = xsdt_addr + xsdt.len() as u64;
    if end > TABLES_END {
        return Err(AcpiError::TooLarge(end - RSDP_ADDR));
    }
    for (addr, bytes) in [
        (RSDP_ADDR, &rsdp(xsdt_addr)[..]),
        (dsdt_addr, &dsdt),
        (fadt_addr, &fadt),
        (madt_addr, &madt),
        (xsdt_addr, &xsdt),
    ] {
        memory
            .write_slice(bytes, GuestAddress(addr))
            .map_err(AcpiError::Memory)?;
    }
    Ok(RSDP_ADDR)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cube_devices::virtio::test_driver::memory;

    fn read(mem: &VirtioMemory, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    /// A table at `addr`: checks its signature and checksum, returns its bytes.
    fn table(mem: &VirtioMemory, addr: u64, signature: &[u8; 4]) -> Vec<u8> {
        let header = read(mem, addr, 8);
        assert_eq!(&header[..4], signature);
        let len = u32::from_le_bytes(header[4..8].try_into().unwrap()) as usize;
        let bytes = read(mem, addr, len);
        assert_eq!(
            checksum(&bytes),
            0,
            "{} checksum",
            String::from_utf8_lossy(signature)
        );
        bytes
    }

    #[test]
    fn the_tables_chain_from_the_rsdp_and_describe_cpus_and_devices() {
        let mem = memory();
        let devices = [
            MmioDeviceInfo {
                base: 0xd000_1000,
                irq: 5,
            },
            MmioDeviceInfo {
                base: 0xd000_2000,
                irq: 6,
            },
        ];
        assert_eq!(write_tables(&mem, 3, &devices).unwrap(), RSDP_ADDR);
        let rsdp = read(&mem, RSDP_ADDR, 36);
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert_eq!(checksum(&rsdp[..20]), 0);
        assert_eq!(checksum(&rsdp), 0);
        let xsdt_addr = u64::from_le_bytes(rsdp[24..32].try_into().unwrap());
        let xsdt = table(&mem, xsdt_addr, b"XSDT");
        let entries: Vec<u64> = xsdt[36..]
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(entries.len(), 2);
        let fadt = table(&mem, entries[0], b"FACP");
        let flags = u32::from_le_bytes(fadt[112..116].try_into().unwrap());
        assert_ne!(flags & (1 << 20), 0, "hardware-reduced");
        let x_dsdt = u64::from_le_bytes(fadt[140..148].try_into().unwrap());
        let dsdt = table(&mem, x_dsdt, b"DSDT");
        let text = String::from_utf8_lossy(&dsdt);
        assert_eq!(text.matches("LNRO0005").count(), 2);
        // COM1, with its ports (an I/O port descriptor, 0x47, from 0x3f8) and IRQ 4.
        assert!(text.contains("COM1"), "{text}");
        let io_descriptor = [0x47, 0x01, 0xf8, 0x03, 0xf8, 0x03, 0x01, 0x08];
        assert!(dsdt.windows(8).any(|w| w == io_descriptor), "COM1 ports");
        assert!(text.contains("_S5_"), "soft-off sleep type");
        // The sleep control register is port 0x3c0 (GAS at FADT offset 244).
        assert_eq!(fadt[244], 1, "system I/O");
        assert_eq!(
            u64::from_le_bytes(fadt[248..256].try_into().unwrap()),
            0x3c0
        );
        // Each device's window base and interrupt are in its resources.
        for d in devices {
            let base = (d.base as u32).to_le_bytes();
            assert!(dsdt.windows(4).any(|w| w == base));
        }
        let madt = table(&mem, entries[1], b"APIC");
        // Local APIC entries (type 0, length 8), then the IO-APIC (type 1).
        let mut at = 44;
        let mut cpus = 0;
        let mut ioapics = 0;
        while at < madt.len() {
            match madt[at] {
                0 => cpus += 1,
                1 => ioapics += 1,
                other => panic!("unexpected MADT entry {other}"),
            }
            at += madt[at + 1] as usize;
        }
        assert_eq!((cpus, ioapics), (3, 1));
    }

    /// Where `iasl` is installed (acpica-tools), the DSDT and FADT disassemble without
    /// errors: the AML is what ACPICA, Linux's interpreter, expects.
    #[test]
    fn iasl_accepts_the_tables() {
        let Ok(status) = std::process::Command::new("iasl").arg("-v").output() else {
            eprintln!("skipping: iasl (acpica-tools) is not installed");
            return;
        };
        assert!(status.status.success());
        let dir = tempfile::tempdir().unwrap();
        let devices = [MmioDeviceInfo {
            base: 0xd000_1000,
            irq: 5,
        }];
        for (name, bytes) in [
            ("dsdt", dsdt(&devices)),
            ("fadt", fadt(0xe0030)),
            ("apic", madt(2)),
        ] {
            let path = dir.path().join(format!("{name}.dat"));
            std::fs::write(&path, bytes).unwrap();
            let out = std::process::Command::new("iasl")
                .arg("-d")
                .arg(&path)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{name}: {text}");
            assert!(!text.contains("Error"), "{name}: {text}");
            let dsl = std::fs::read_to_string(dir.path().join(format!("{name}.dsl"))).unwrap();
            if name == "dsdt" {
                assert!(dsl.contains("LNRO0005"), "{dsl}");
                assert!(dsl.contains("PNP0501"), "{dsl}");
                assert!(dsl.contains("Memory32Fixed (ReadWrite,"), "{dsl}");
                assert!(dsl.contains("_S5_"), "{dsl}");
            }
        }
    }

    #[test]
    fn pkg_lengths_use_the_smallest_encoding() {
        let enc = |len| {
            let mut v = Vec::new();
            encode_pkg_length(len, &mut v);
            v
        };
        assert_eq!(enc(10), vec![11]);
        assert_eq!(enc(62), vec![63]);
        assert_eq!(enc(63), vec![0x40 | 1, 4]);
        assert_eq!(enc(5000).len(), 3);
    }
}
