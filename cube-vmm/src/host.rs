//! Which KVM this host offers, found by opening `/dev/kvm` and asking it, never
//! assumed from the distribution or kernel version.

use std::fs;
use std::path::Path;

use kvm_bindings::{KVM_API_VERSION, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2};
use kvm_ioctls::{Cap, Kvm};
use serde::{Deserialize, Serialize};

/// Present when the PVM hypervisor module (kvm_pvm) is loaded.
const PVM_MODULE: &str = "/sys/module/kvm_pvm";

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
