//! The floors every Cube figure is compared with, measured in the same run with no
//! Cube code on the path: a bare KVM VM, and a plain sequential write.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::Kvm;

/// Creates a VM (with an in-kernel irqchip if `irqchip`), maps `memory_file`
/// MAP_PRIVATE as one dirty-logged memslot, creates `vcpus` vCPUs, and closes it all.
pub fn bare_vm(memory_file: &Path, vcpus: u8, irqchip: bool) -> Result<Duration, String> {
    let start = Instant::now();
    let kvm = Kvm::new().map_err(|e| format!("opening /dev/kvm: {e}"))?;
    let vm = kvm.create_vm().map_err(|e| format!("KVM_CREATE_VM: {e}"))?;
    if irqchip {
        vm.create_irq_chip()
            .map_err(|e| format!("KVM_CREATE_IRQCHIP: {e}"))?;
    }
    let file =
        File::open(memory_file).map_err(|e| format!("opening {}: {e}", memory_file.display()))?;
    let len = file.metadata().map_err(|e| e.to_string())?.len() as usize;
    // The floor maps one region even when the guest has two: no Cube layout logic.
    let map_len = len.min(0xC000_0000);
    // SAFETY: a fresh private mapping of an open file; unmapped below before return.
    let host = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_NORESERVE,
            file.as_raw_fd(),
            0,
        )
    };
    if host == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    let region = kvm_userspace_memory_region {
        slot: 0,
        flags: KVM_MEM_LOG_DIRTY_PAGES,
        guest_phys_addr: 0,
        memory_size: map_len as u64,
        userspace_addr: host as u64,
    };
    // SAFETY: the mapping stays valid until after the VM is dropped below.
    let set = unsafe { vm.set_user_memory_region(region) };
    let mut fds = Vec::new();
    let result = set
        .map_err(|e| format!("KVM_SET_USER_MEMORY_REGION: {e}"))
        .and_then(|()| {
            for i in 0..vcpus {
                fds.push(
                    vm.create_vcpu(i as u64)
                        .map_err(|e| format!("KVM_CREATE_VCPU: {e}"))?,
                );
            }
            Ok(())
        });
    drop(fds);
    drop(vm);
    // SAFETY: `host` is the mapping made above, no longer referenced by any VM.
    unsafe { libc::munmap(host, map_len) };
    result.map(|()| start.elapsed())
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

/// Writes `mib` MiB sequentially into a new file in `dir` from a settled filesystem,
/// through the page cache without a sync (as a snapshot writes its memory file; see
/// `snapshot::durability`), removes it, and returns MiB/s.
pub fn sequential_write(dir: &Path, mib: usize) -> Result<f64, String> {
    let path = dir.join(format!("floor-write-{}.tmp", std::process::id()));
    let chunk = vec![0x5au8; 1 << 20];
    settle_filesystem(dir)?;
    let start = Instant::now();
    let result = (|| {
        let mut f = File::create(&path).map_err(|e| format!("creating {}: {e}", path.display()))?;
        for _ in 0..mib {
            f.write_all(&chunk).map_err(|e| e.to_string())?;
        }
        Ok::<_, String>(start.elapsed())
    })();
    let _ = std::fs::remove_file(&path);
    let elapsed = result?;
    Ok(mib as f64 / elapsed.as_secs_f64())
}
