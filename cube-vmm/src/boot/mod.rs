//! Loading a Linux kernel into guest memory and preparing the boot vCPU's registers:
//! an ELF `vmlinux` through its PVH entry point ([`pvh`]), a bzImage through the
//! 64-bit boot protocol ([`bzimage`]). The file's contents decide which. Both put the
//! command line and initrd where this module says, and fail with one error type.

pub mod bzimage;
pub mod pvh;

use std::path::{Path, PathBuf};

use linux_loader::cmdline::Cmdline;
use linux_loader::loader::elf::start_info::hvm_modlist_entry;
use vm_memory::{Bytes, GuestAddress};

use cube_mem::GuestMemory;

/// Where the kernel may load itself (1 MiB and up).
pub const HIMEM_START: u64 = 0x10_0000;
/// The kernel command line.
pub const CMDLINE_ADDR: u64 = 0x2_0000;
/// Longest command line accepted.
const CMDLINE_MAX: usize = 4096;
/// End of conventional memory below 1 MiB (start of the EBDA).
pub const EBDA_START: u64 = 0x9_fc00;
/// E820 type of usable RAM.
pub const E820_RAM: u32 = 1;

/// Why a kernel, its initrd or its boot information could not be put into guest
/// memory.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The kernel file cannot be opened.
    #[error("Opening kernel {0}")]
    OpenKernel(PathBuf, #[source] std::io::Error),
    /// The kernel is not an image linux-loader accepts.
    #[error("Loading kernel {0}: {1:?}")]
    LoadKernel(PathBuf, linux_loader::loader::Error),
    /// The kernel has no PVH entry point.
    #[error("Kernel {0} has no PVH entry point (an ELF vmlinux built with CONFIG_PVH is needed)")]
    NoPvhEntry(PathBuf),
    /// The initrd cannot be read or does not fit.
    #[error("Initrd {0}: {1}")]
    Initrd(PathBuf, String),
    /// The command line is invalid.
    #[error("Kernel command line: {0}")]
    Cmdline(String),
    /// Writing boot structures into guest memory failed.
    #[error("Writing boot information: {0}")]
    BootParams(String),
}

/// Puts the initrd at the top of low RAM, page aligned, and returns its module entry.
pub fn load_initrd(
    memory: &GuestMemory,
    path: &Path,
    low_ram: u64,
) -> Result<hvm_modlist_entry, LoadError> {
    let err = |m: String| LoadError::Initrd(path.to_path_buf(), m);
    let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    let size = bytes.len() as u64;
    let addr = low_ram
        .checked_sub(size)
        .map(|a| a & !0xfff)
        .filter(|a| *a >= HIMEM_START + (64 << 20))
        .ok_or_else(|| err(format!("{size} bytes do not fit in guest memory")))?;
    memory
        .inner()
        .write_slice(&bytes, GuestAddress(addr))
        .map_err(|e| err(e.to_string()))?;
    Ok(hvm_modlist_entry {
        paddr: addr,
        size,
        ..Default::default()
    })
}

/// Writes the command line at [`CMDLINE_ADDR`]; returns its length.
pub fn write_cmdline(memory: &GuestMemory, cmdline: &str) -> Result<u32, LoadError> {
    let mut line = Cmdline::new(CMDLINE_MAX).map_err(|e| LoadError::Cmdline(e.to_string()))?;
    line.insert_str(cmdline)
        .map_err(|e| LoadError::Cmdline(e.to_string()))?;
    linux_loader::loader::load_cmdline(memory.inner(), GuestAddress(CMDLINE_ADDR), &line)
        .map_err(|e| LoadError::Cmdline(e.to_string()))?;
    // Bounded by CMDLINE_MAX.
    Ok(cmdline.len() as u32)
}
