//! [`KvmContext`]: opened once per process and shared by `Arc`, it holds `/dev/kvm`
//! and what every VM would otherwise re-query (supported CPUID, which MSRs can be saved,
//! the XSAVE area size).

use kvm_bindings::{
    kvm_msr_entry, kvm_xsave, CpuId, KVM_API_VERSION, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
    KVM_CLOCK_REALTIME, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Cap, Kvm};
use tracing::debug;

/// Errors opening the per-process KVM context.
#[derive(Debug, thiserror::Error)]
pub enum VstateError {
    /// `/dev/kvm` could not be opened (missing, no permission, module not loaded).
    #[error("Cannot open /dev/kvm")]
    Open(#[source] kvm_ioctls::Error),
    /// The kernel speaks a KVM API other than the stable version 12.
    #[error("Unsupported KVM API version {0}")]
    ApiVersion(i32),
    /// A KVM ioctl needed to learn the host's capabilities failed.
    #[error("{ioctl} failed")]
    Ioctl {
        /// The ioctl that failed.
        ioctl: &'static str,
        /// The error KVM returned.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// The process-wide KVM handle and the host facts every VM needs.
///
/// Open it once ([`KvmContext::open`] costs a probe VM, a few ms) and share it by `Arc`.
#[derive(Debug)]
pub struct KvmContext {
    kvm: Kvm,
    api_version: i32,
    supported_cpuid: CpuId,
    /// MSRs from `KVM_GET_MSR_INDEX_LIST` that a vCPU can read and write back, in the
    /// order KVM lists them.
    msrs_to_save: Vec<u32>,
    xsave_size: usize,
    clock_flags: u32,
    tsc_control: bool,
    dirty_ring_bytes: u32,
    manual_dirty_log_protect: bool,
}

impl KvmContext {
    /// Opens `/dev/kvm` and learns the host's KVM facts.
    ///
    /// Which MSRs can be saved is found by experiment on a throwaway VM with an
    /// in-kernel irqchip: `KVM_GET_MSR_INDEX_LIST` also names MSRs that `KVM_GET_MSRS`
    /// or `KVM_SET_MSRS` refuse (PMU and MCE MSRs, depending on host and CPUID), and
    /// finding out per save would cost an ioctl per refusal.
    pub fn open() -> Result<Self, VstateError> {
        let kvm = Kvm::new().map_err(VstateError::Open)?;
        let api_version = kvm.get_api_version();
        if api_version != KVM_API_VERSION as i32 {
            return Err(VstateError::ApiVersion(api_version));
        }
        let ioctl = |ioctl| move |source| VstateError::Ioctl { ioctl, source };
        let supported_cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(ioctl("KVM_GET_SUPPORTED_CPUID"))?;
        let index_list = kvm
            .get_msr_index_list()
            .map_err(ioctl("KVM_GET_MSR_INDEX_LIST"))?;

        let probe_vm = kvm.create_vm().map_err(ioctl("KVM_CREATE_VM"))?;
        // KVM_CAP_XSAVE2 is per VM (it depends on the XSAVE features this process may
        // use) and answers 0 on kernels before 5.17, whose XSAVE area is the fixed
        // 4096-byte `kvm_xsave`.
        let xsave_size = usize::try_from(probe_vm.check_extension_int(Cap::Xsave2))
            .unwrap_or(0)
            .max(std::mem::size_of::<kvm_xsave>());
        // Some MSRs (MSR_KVM_ASYNC_PF_INT) can only be written with an in-kernel LAPIC;
        // probing with one finds the full set, and `Vcpu` leaves those out without it.
        if let Err(err) = probe_vm.create_irq_chip() {
            debug!(%err, "probe VM has no in-kernel irqchip");
        }
        let probe_vcpu = probe_vm.create_vcpu(0).map_err(ioctl("KVM_CREATE_VCPU"))?;
        // MSRs tied to CPUID features are only accessible once CPUID advertises them.
        probe_vcpu
            .set_cpuid2(&crate::arch::x86_64::cpuid::vcpu_cpuid(
                &supported_cpuid,
                0,
                1,
            ))
            .map_err(ioctl("KVM_SET_CPUID2"))?;
        let msrs_to_save = probe_msrs(&probe_vcpu, index_list.as_slice())?;

        let clock_flags =
            u32::try_from(kvm.check_extension_int(Cap::AdjustClock)).unwrap_or_default();
        Ok(Self {
            api_version,
            supported_cpuid,
            msrs_to_save,
            xsave_size,
            clock_flags,
            tsc_control: kvm.check_extension(Cap::TscControl),
            dirty_ring_bytes: u32::try_from(probe_vm.check_extension_int(Cap::DirtyLogRing))
                .unwrap_or_default(),
            manual_dirty_log_protect: probe_vm
                .check_extension_raw(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.into())
                > 0,
            kvm,
        })
    }

    /// The `/dev/kvm` handle.
    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    /// `KVM_GET_API_VERSION` (always 12 once opened).
    pub fn api_version(&self) -> i32 {
        self.api_version
    }

    /// `KVM_GET_SUPPORTED_CPUID`: what the host can offer a guest.
    pub fn supported_cpuid(&self) -> &CpuId {
        &self.supported_cpuid
    }

    /// The MSRs a vCPU state includes: those in `KVM_GET_MSR_INDEX_LIST` that a vCPU
    /// can both read and write back, in KVM's order.
    pub fn msrs_to_save(&self) -> &[u32] {
        &self.msrs_to_save
    }

    /// Size in bytes of a vCPU's XSAVE area (`KVM_CAP_XSAVE2`, at least 4096).
    pub fn xsave_size(&self) -> usize {
        self.xsave_size
    }

    /// Whether `KVM_SET_CLOCK` honours `KVM_CLOCK_REALTIME` (advance the guest clock
    /// by the wall-clock time between save and restore).
    pub fn clock_realtime(&self) -> bool {
        self.clock_flags & KVM_CLOCK_REALTIME != 0
    }

    /// Whether `KVM_SET_TSC_KHZ` can scale a vCPU's TSC (`KVM_CAP_TSC_CONTROL`).
    pub fn tsc_control(&self) -> bool {
        self.tsc_control
    }

    /// Largest dirty ring in bytes (`KVM_CAP_DIRTY_LOG_RING`); 0 when unsupported.
    pub fn dirty_ring_bytes(&self) -> u32 {
        self.dirty_ring_bytes
    }

    /// Whether `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` is available.
    pub fn manual_dirty_log_protect(&self) -> bool {
        self.manual_dirty_log_protect
    }
}

/// Returns the MSRs of `candidates` that `vcpu` can read and write back unchanged.
///
/// `KVM_GET_MSRS`/`KVM_SET_MSRS` stop at the first MSR they refuse and return how many
/// they handled, so each refusal costs one more ioctl, not one per MSR.
fn probe_msrs(vcpu: &kvm_ioctls::VcpuFd, candidates: &[u32]) -> Result<Vec<u32>, VstateError> {
    let mut entries: Vec<kvm_msr_entry> = candidates
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    let readable = keep_accepted(&mut entries, |rest| {
        super::msrs::get_msrs_prefix(vcpu, rest).map_err(|source| VstateError::Ioctl {
            ioctl: "KVM_GET_MSRS",
            source,
        })
    })?;
    let mut entries = readable;
    let writable = keep_accepted(&mut entries, |rest| {
        super::msrs::set_msrs_prefix(vcpu, rest).map_err(|source| VstateError::Ioctl {
            ioctl: "KVM_SET_MSRS",
            source,
        })
    })?;
    Ok(writable.iter().map(|e| e.index).collect())
}

/// Runs `op` (which handles a prefix of its slice and says how long) over `entries`,
/// skipping each entry it refuses; returns the accepted entries.
fn keep_accepted(
    entries: &mut [kvm_msr_entry],
    mut op: impl FnMut(&mut [kvm_msr_entry]) -> Result<usize, VstateError>,
) -> Result<Vec<kvm_msr_entry>, VstateError> {
    let mut accepted = Vec::with_capacity(entries.len());
    let mut start = 0;
    while start < entries.len() {
        let done = op(&mut entries[start..])?;
        accepted.extend_from_slice(&entries[start..start + done]);
        if let Some(refused) = entries.get(start + done) {
            debug!(
                msr = format_args!("{:#x}", refused.index),
                "MSR left out of vCPU state"
            );
        }
        start += done + 1;
    }
    Ok(accepted)
}

/// A process-wide context for tests, or `None` (after printing why) when this host
/// has no usable KVM.
#[cfg(test)]
pub(crate) fn test_context() -> Option<std::sync::Arc<KvmContext>> {
    use std::sync::{Arc, OnceLock};
    static CTX: OnceLock<Result<Arc<KvmContext>, String>> = OnceLock::new();
    if !std::path::Path::new("/dev/kvm").exists() {
        println!("skipped: /dev/kvm not present");
        return None;
    }
    let ctx = CTX.get_or_init(|| {
        KvmContext::open().map(Arc::new).map_err(|e| {
            format!(
                "{e}: {}",
                std::error::Error::source(&e).map_or(String::new(), |s| s.to_string())
            )
        })
    });
    match ctx {
        Ok(ctx) => Some(Arc::clone(ctx)),
        Err(why) => {
            println!("skipped: /dev/kvm unusable ({why})");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_learns_host_facts() {
        let Some(ctx) = test_context() else { return };
        assert_eq!(ctx.api_version(), 12);
        assert!(ctx.xsave_size() >= 4096);
        assert!(!ctx.supported_cpuid().as_slice().is_empty());
        let listed = ctx.kvm().get_msr_index_list().unwrap();
        // Every saved MSR comes from KVM's list, in KVM's order.
        let mut pos = listed.as_slice().iter();
        for msr in ctx.msrs_to_save() {
            assert!(
                pos.any(|m| m == msr),
                "MSR {msr:#x} not in KVM's list order"
            );
        }
        // MSR_IA32_TSC is always readable and writable.
        assert!(ctx.msrs_to_save().contains(&0x10));
    }
}
