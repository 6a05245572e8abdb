//! Which KVM this host offers, found by opening `/dev/kvm` and asking it, never
//! assumed from the distribution or kernel version.

use std::fs;
use std::path::Path;

use kvm_bindings::{kvm_msr_entry, Msrs, KVM_API_VERSION, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2};
use kvm_ioctls::{Cap, Kvm};
use serde::{Deserialize, Serialize};

/// Present when the PVM hypervisor module (kvm_pvm) is loaded.
const PVM_MODULE: &str = "/sys/module/kvm_pvm";
/// The first of the public virt-pvm ABI's MSRs (`MSR_PVM_LINEAR_ADDRESS_RANGE`): its
/// KVM lists it among the MSRs to save.
const VIRT_PVM_MSR: u32 = 0x4b56_4df0;
/// An MSR of the private PVM variant some hosts run: it reads as "PVM".
const PRIVATE_PVM_ID_MSR: u32 = 0x4b56_4d11;
/// What [`PRIVATE_PVM_ID_MSR`] reads on that variant: "PVM" in little-endian ASCII.
const PRIVATE_PVM_ID: u64 = 0x004d_5650;

/// Which kind of KVM the host offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvmKind {
    /// KVM on hardware virtualisation (VMX or SVM): stock guest kernels run natively.
    Hardware,
    /// KVM on PVM, a software hypervisor for hosts without VMX/SVM: guest code at CPL3
    /// runs natively, a guest kernel needs `CONFIG_PVM_GUEST` to run at speed.
    Pvm,
    /// No usable KVM: `/dev/kvm` is missing, inaccessible, or speaks another API.
    None,
}

/// Which PVM a PVM host runs: a guest kernel runs natively only if it speaks that
/// PVM's ABI (`CONFIG_PVM_GUEST` of the same flavour).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PvmFlavour {
    /// The public virt-pvm ABI (its MSRs from 0x4b564df0 in KVM's MSR list): its
    /// published guest kernels run natively.
    VirtPvm,
    /// A private variant (MSR 0x4b564d11 reads "PVM"): no public guest kernel speaks
    /// its ABI, so Linux guests run with their kernel emulated.
    Private,
    /// A PVM neither probe recognises.
    Unknown,
}

impl PvmFlavour {
    /// Tells the PVM flavours apart by their MSRs: virt-pvm's are in KVM's MSR index
    /// list; the private variant's identification MSR reads "PVM" (through
    /// `KVM_GET_MSRS` on a throwaway vCPU, as the guest's `rdmsr` would). Meaningful
    /// only where [`KvmProbe::run`] found [`KvmKind::Pvm`].
    pub fn probe() -> Self {
        let Ok(kvm) = Kvm::new() else {
            return PvmFlavour::Unknown;
        };
        let listed = kvm
            .get_msr_index_list()
            .is_ok_and(|list| list.as_slice().contains(&VIRT_PVM_MSR));
        if listed {
            return PvmFlavour::VirtPvm;
        }
        let id = kvm
            .create_vm()
            .and_then(|vm| vm.create_vcpu(0))
            .ok()
            .and_then(|vcpu| {
                let mut msrs = Msrs::from_entries(&[kvm_msr_entry {
                    index: PRIVATE_PVM_ID_MSR,
                    ..Default::default()
                }])
                .ok()?;
                (vcpu.get_msrs(&mut msrs).ok()? == 1).then(|| msrs.as_slice()[0].data)
            });
        Self::from_msrs(false, id)
    }

    /// The flavour from what the probes found: virt-pvm's MSR listed, the private
    /// identification MSR's value.
    fn from_msrs(virt_pvm_listed: bool, private_id: Option<u64>) -> Self {
        if virt_pvm_listed {
            PvmFlavour::VirtPvm
        } else if private_id == Some(PRIVATE_PVM_ID) {
            PvmFlavour::Private
        } else {
            PvmFlavour::Unknown
        }
    }
}

/// What opening `/dev/kvm` told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvmProbe {
    /// Which KVM the host has.
    pub kind: KvmKind,
    /// `KVM_GET_API_VERSION`, when `/dev/kvm` opens.
    pub api_version: Option<i32>,
    /// Whether KVM offers a dirty ring (`KVM_CAP_DIRTY_LOG_RING`).
    pub dirty_ring: bool,
    /// Whether KVM offers manual dirty-log protection
    /// (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`).
    pub manual_dirty_log_protect: bool,
}

impl KvmProbe {
    /// Opens `/dev/kvm` and classifies it; one that does not open, or speaks another
    /// API, is [`KvmKind::None`].
    pub fn run() -> Self {
        let none = |api_version| KvmProbe {
            kind: KvmKind::None,
            api_version,
            dirty_ring: false,
            manual_dirty_log_protect: false,
        };
        let Ok(kvm) = Kvm::new() else {
            return none(None);
        };
        let version = kvm.get_api_version();
        if version != KVM_API_VERSION as i32 {
            return none(Some(version));
        }
        let kind = kvm_kind(
            Path::new(PVM_MODULE).exists(),
            &fs::read_to_string("/proc/cpuinfo").unwrap_or_default(),
        );
        // Both are VM capabilities; KVM answers them on /dev/kvm as for a new VM.
        KvmProbe {
            kind,
            api_version: Some(version),
            dirty_ring: kvm.check_extension_int(Cap::DirtyLogRing) > 0,
            manual_dirty_log_protect: kvm
                .check_extension_raw(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.into())
                > 0,
        }
    }
}

/// Classifies a working `/dev/kvm`: PVM when its module is loaded, or when the CPU has
/// no VMX/SVM (KVM without them can only be a software hypervisor); hardware otherwise.
fn kvm_kind(pvm_module: bool, cpuinfo: &str) -> KvmKind {
    let hardware_virt = cpuinfo
        .lines()
        .filter(|line| line.starts_with("flags"))
        .filter_map(|line| line.split_once(':'))
        .any(|(_, flags)| flags.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    if pvm_module || !hardware_virt {
        KvmKind::Pvm
    } else {
        KvmKind::Hardware
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_serialise_lowercase() {
        let json =
            serde_json::to_string(&[KvmKind::Hardware, KvmKind::Pvm, KvmKind::None]).unwrap();
        assert_eq!(json, r#"["hardware","pvm","none"]"#);
    }

    #[test]
    fn pvm_flavours_are_told_apart_by_their_msrs() {
        assert_eq!(PvmFlavour::from_msrs(true, None), PvmFlavour::VirtPvm);
        assert_eq!(
            PvmFlavour::from_msrs(false, Some(0x004d_5650)),
            PvmFlavour::Private
        );
        assert_eq!(PvmFlavour::from_msrs(false, Some(0)), PvmFlavour::Unknown);
        assert_eq!(PvmFlavour::from_msrs(false, None), PvmFlavour::Unknown);
        let json = serde_json::to_string(&[PvmFlavour::VirtPvm, PvmFlavour::Private]).unwrap();
        assert_eq!(json, r#"["virt-pvm","private"]"#);
    }

    #[test]
    fn kvm_kind_reads_module_and_cpu_flags() {
        let vmx = "processor\t: 0\nflags\t\t: fpu vme vmx sse\n";
        let svm = "flags\t\t: fpu svm\n";
        let none = "flags\t\t: fpu vme sse hypervisor\n";
        assert_eq!(kvm_kind(false, vmx), KvmKind::Hardware);
        assert_eq!(kvm_kind(false, svm), KvmKind::Hardware);
        assert_eq!(kvm_kind(false, none), KvmKind::Pvm);
        assert_eq!(kvm_kind(true, vmx), KvmKind::Pvm);
        // "vmx" only counts as a whole flag.
        assert_eq!(kvm_kind(false, "flags\t: vmx_ept\n"), KvmKind::Pvm);
    }

    #[test]
    fn the_probe_matches_the_device() {
        let probe = KvmProbe::run();
        if Path::new("/dev/kvm").exists() {
            assert_ne!(probe.kind, KvmKind::None);
            assert_eq!(probe.api_version, Some(12));
        } else {
            assert_eq!(probe.kind, KvmKind::None);
        }
    }
}
