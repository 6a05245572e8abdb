//! Reading and writing a vCPU's MSRs in batches, stopping where KVM refuses one.

use kvm_bindings::{kvm_msr_entry, Msrs, KVM_MAX_MSR_ENTRIES};
use kvm_ioctls::VcpuFd;

/// Runs `KVM_GET_MSRS` over `entries` in batches of `KVM_MAX_MSR_ENTRIES`, filling in
/// their data; returns how many leading entries were read (KVM stops at the first MSR
/// it refuses).
pub(crate) fn get_msrs_prefix(
    fd: &VcpuFd,
    entries: &mut [kvm_msr_entry],
) -> Result<usize, kvm_ioctls::Error> {
    let mut done = 0;
    for chunk in entries.chunks_mut(KVM_MAX_MSR_ENTRIES) {
        let mut msrs =
            Msrs::from_entries(chunk).map_err(|_| kvm_ioctls::Error::new(libc::E2BIG))?;
        let read = fd.get_msrs(&mut msrs)?;
        chunk[..read].copy_from_slice(&msrs.as_slice()[..read]);
        done += read;
        if read < chunk.len() {
            break;
        }
    }
    Ok(done)
}

/// Runs `KVM_SET_MSRS` over `entries` in order, in batches of `KVM_MAX_MSR_ENTRIES`;
/// returns how many leading entries were set (KVM stops at the first MSR it refuses).
pub(crate) fn set_msrs_prefix(
    fd: &VcpuFd,
    entries: &[kvm_msr_entry],
) -> Result<usize, kvm_ioctls::Error> {
    let mut done = 0;
    for chunk in entries.chunks(KVM_MAX_MSR_ENTRIES) {
        let msrs = Msrs::from_entries(chunk).map_err(|_| kvm_ioctls::Error::new(libc::E2BIG))?;
        let set = fd.set_msrs(&msrs)?;
        done += set;
        if set < chunk.len() {
            break;
        }
    }
    Ok(done)
}
