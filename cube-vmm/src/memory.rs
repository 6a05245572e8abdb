//! A machine's guest memory as KVM sees it: the regions of its RAM layout, and their
//! registration as memslots.

use cube_mem::{GuestMemory, MemoryLayout};
use vm_memory::GuestAddress;

use crate::arch::x86_64::layout::RamRange;
use crate::vstate::vm::{Vm, VmError};

/// The memory layout of `ram`, regions in memory-file order.
pub fn memory_layout(ram: &[RamRange]) -> Result<MemoryLayout, cube_mem::MemoryError> {
    let regions: Vec<(GuestAddress, usize)> = ram
        .iter()
        .map(|r| (GuestAddress(r.guest_addr), r.size as usize))
        .collect();
    MemoryLayout::new(&regions)
}

/// Registers every region of `memory` as a KVM memslot of `vm` (slot = region index).
///
/// # Safety
/// `memory` must stay mapped until `vm` is closed or the slots are removed: KVM keeps
/// the host addresses and the guest would otherwise reach whatever is mapped there next.
pub(crate) unsafe fn register_guest_memory(
    vm: &Vm,
    memory: &GuestMemory,
    log_dirty: bool,
) -> Result<(), VmError> {
    for region in memory.regions() {
        // SAFETY: the caller keeps the mapping alive as long as the VM uses it.
        unsafe {
            vm.register_memory_slot(
                region.slot,
                region.guest_addr.0,
                region.host_addr,
                region.size as u64,
                log_dirty,
            )?;
        }
    }
    Ok(())
}
