//! The floors every Cube figure is compared with, measured in the same run with no
//! Cube code on the path: a bare KVM VM, and a plain sequential write. (For `cube
//! bench` and the criterion benches.)

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::Kvm;

/// Most of the memory file a floor VM maps: one region even when the guest has two
/// (no Cube layout logic on the floor's path).
const FLOOR_MAP_MAX: usize = 0xC000_0000;

/// A private, copy-on-write mapping of a memory file, unmapped on drop.
struct PrivateMapping {
    addr: *mut libc::c_void,
    len: usize,
}

impl PrivateMapping {
    fn of(file: &File, len: usize) -> std::io::Result<PrivateMapping> {
        // SAFETY: asks the kernel for a new mapping; no existing memory is touched.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(PrivateMapping { addr, len })
    }
}

impl Drop for PrivateMapping {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` are exactly the mapping made in `of`, which nothing
        // else unmaps; every VM using it was closed before this guard drops.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// The floor of a create: what KVM itself charges for a VM of Cube's shape (a VM, an
/// irqchip, the template's memory file mapped as one dirty-logged memslot, the
/// vCPUs), with no Cube code on the path. `/dev/kvm` stays open across cycles, as in
/// a pre-started supervisor.
pub struct BareVm {
    kvm: Kvm,
    memory: File,
    len: usize,
    vcpus: u8,
    irqchip: bool,
}

impl BareVm {
    /// Opens `/dev/kvm` and the memory file.
    pub fn open(memory_file: &Path, vcpus: u8, irqchip: bool) -> Result<BareVm, String> {
        let kvm = Kvm::new().map_err(|e| format!("opening /dev/kvm: {e}"))?;
        let memory = File::open(memory_file)
            .map_err(|e| format!("opening {}: {e}", memory_file.display()))?;
        let len = memory.metadata().map_err(|e| e.to_string())?.len();
        let len = usize::try_from(len)
            .map_err(|e| e.to_string())?
            .min(FLOOR_MAP_MAX);
        Ok(BareVm {
            kvm,
            memory,
            len,
            vcpus,
            irqchip,
        })
    }

    /// Creates the VM, maps the memory file MAP_PRIVATE as one dirty-logged memslot,
    /// creates the vCPUs, and closes everything.
    pub fn cycle(&self) -> Result<(), String> {
        let mapping =
            PrivateMapping::of(&self.memory, self.len).map_err(|e| format!("mmap: {e}"))?;
        let vm = self
            .kvm
            .create_vm()
            .map_err(|e| format!("KVM_CREATE_VM: {e}"))?;
        if self.irqchip {
            vm.create_irq_chip()
                .map_err(|e| format!("KVM_CREATE_IRQCHIP: {e}"))?;
        }
        let region = kvm_userspace_memory_region {
            slot: 0,
            flags: KVM_MEM_LOG_DIRTY_PAGES,
            guest_phys_addr: 0,
            memory_size: self.len as u64,
            userspace_addr: mapping.addr as u64,
        };
        // SAFETY: the mapping outlives the VM: `vm` is dropped (closed) below, before
        // `mapping`, which was declared earlier.
        unsafe { vm.set_user_memory_region(region) }
            .map_err(|e| format!("KVM_SET_USER_MEMORY_REGION: {e}"))?;
        let vcpus = (0..self.vcpus)
            .map(|i| vm.create_vcpu(u64::from(i)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("KVM_CREATE_VCPU: {e}"))?;
        drop(std::hint::black_box(vcpus));
        drop(vm);
        drop(mapping);
        Ok(())
    }
}

/// One bare VM from opening `/dev/kvm` to closing it ([`BareVm`]); how long it took.
pub fn bare_vm(memory_file: &Path, vcpus: u8, irqchip: bool) -> Result<Duration, String> {
    let start = Instant::now();
    BareVm::open(memory_file, vcpus, irqchip)?.cycle()?;
    Ok(start.elapsed())
}

/// Flushes every dirty page of the filesystem holding `dir`, so that the next timed
/// write does not pay for earlier ones.
pub fn settle_filesystem(dir: &Path) -> Result<(), String> {
    let f = File::open(dir).map_err(|e| format!("opening {}: {e}", dir.display()))?;
    // SAFETY: syncfs on a descriptor we own; no memory is passed.
    if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
        return Err(format!(
            "syncfs {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// A buffer of `mib` MiB (at least 1) to write a floor from, every page touched: a
/// snapshot copies guest memory that no CPU cache holds, so the floor writes from
/// memory of the same size (from one cache-resident 1 MiB buffer it ran ~1.24x faster
/// than from 1 GiB on this host), and the touch keeps the first-touch cost of fresh
/// memory out of the timing.
pub fn write_source(mib: usize) -> Vec<u8> {
    vec![0x5au8; mib.max(1) << 20]
}

/// Writes `source` sequentially, 1 MiB per call, into a new file in `dir` from a
/// settled filesystem, through the page cache without a sync (as a snapshot writes its
/// memory file; see `cube_storage::durable_marker`), removes it, and returns MiB/s.
pub fn sequential_write(dir: &Path, source: &[u8]) -> Result<f64, String> {
    let path = dir.join(format!("floor-write-{}.tmp", std::process::id()));
    settle_filesystem(dir)?;
    let start = Instant::now();
    let result = (|| {
        let mut f = File::create(&path).map_err(|e| format!("creating {}: {e}", path.display()))?;
        for chunk in source.chunks(1 << 20) {
            f.write_all(chunk).map_err(|e| e.to_string())?;
        }
        Ok::<_, String>(start.elapsed())
    })();
    let _ = std::fs::remove_file(&path);
    let elapsed = result?;
    Ok(source.len() as f64 / f64::from(1u32 << 20) / elapsed.as_secs_f64())
}
