//! The KVM ioctls a vCPU thread makes, by request number, for its allow list (see
//! `cube_devices::thread_confinement`, where vCPU threads apply it).

/// The KVM ioctls a vCPU thread makes, by name and request number: `KVM_RUN`, and the
/// state it reads and writes while parked (snapshots, restores, emulation assists).
/// For an allow list of the thread's calls.
pub fn requests() -> Vec<(&'static str, u64)> {
    use kvm_numbers::*;
    vec![
        ("KVM_RUN", KVM_RUN()),
        ("KVM_GET_REGS", KVM_GET_REGS()),
        ("KVM_SET_REGS", KVM_SET_REGS()),
        ("KVM_GET_SREGS", KVM_GET_SREGS()),
        ("KVM_SET_SREGS", KVM_SET_SREGS()),
        ("KVM_TRANSLATE", KVM_TRANSLATE()),
        ("KVM_GET_MSRS", KVM_GET_MSRS()),
        ("KVM_SET_MSRS", KVM_SET_MSRS()),
        ("KVM_GET_FPU", KVM_GET_FPU()),
        ("KVM_SET_FPU", KVM_SET_FPU()),
        ("KVM_GET_LAPIC", KVM_GET_LAPIC()),
        ("KVM_SET_LAPIC", KVM_SET_LAPIC()),
        ("KVM_SET_CPUID2", KVM_SET_CPUID2()),
        ("KVM_GET_CPUID2", KVM_GET_CPUID2()),
        ("KVM_GET_MP_STATE", KVM_GET_MP_STATE()),
        ("KVM_SET_MP_STATE", KVM_SET_MP_STATE()),
        ("KVM_SET_GUEST_DEBUG", KVM_SET_GUEST_DEBUG()),
        ("KVM_GET_VCPU_EVENTS", KVM_GET_VCPU_EVENTS()),
        ("KVM_SET_VCPU_EVENTS", KVM_SET_VCPU_EVENTS()),
        ("KVM_GET_DEBUGREGS", KVM_GET_DEBUGREGS()),
        ("KVM_SET_DEBUGREGS", KVM_SET_DEBUGREGS()),
        ("KVM_SET_TSC_KHZ", KVM_SET_TSC_KHZ()),
        ("KVM_GET_TSC_KHZ", KVM_GET_TSC_KHZ()),
        ("KVM_GET_XSAVE", KVM_GET_XSAVE()),
        ("KVM_GET_XSAVE2", KVM_GET_XSAVE2()),
        ("KVM_SET_XSAVE", KVM_SET_XSAVE()),
        ("KVM_GET_XCRS", KVM_GET_XCRS()),
        ("KVM_SET_XCRS", KVM_SET_XCRS()),
        ("KVM_KVMCLOCK_CTRL", KVM_KVMCLOCK_CTRL()),
    ]
}

/// Request numbers from the kernel's `kvm.h`, sized by kvm-bindings' structures.
mod kvm_numbers {
    use kvm_bindings::{
        kvm_cpuid2, kvm_debugregs, kvm_fpu, kvm_guest_debug, kvm_lapic_state, kvm_mp_state,
        kvm_msrs, kvm_regs, kvm_sregs, kvm_translation, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
    };
    use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr, ioctl_iowr_nr};

    const KVMIO: std::os::raw::c_uint = 0xAE;

    ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
    ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
    ioctl_iow_nr!(KVM_SET_REGS, KVMIO, 0x82, kvm_regs);
    ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
    ioctl_iow_nr!(KVM_SET_SREGS, KVMIO, 0x84, kvm_sregs);
    ioctl_iowr_nr!(KVM_TRANSLATE, KVMIO, 0x85, kvm_translation);
    ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_msrs);
    ioctl_iow_nr!(KVM_SET_MSRS, KVMIO, 0x89, kvm_msrs);
    ioctl_ior_nr!(KVM_GET_FPU, KVMIO, 0x8c, kvm_fpu);
    ioctl_iow_nr!(KVM_SET_FPU, KVMIO, 0x8d, kvm_fpu);
    ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
    ioctl_iow_nr!(KVM_SET_LAPIC, KVMIO, 0x8f, kvm_lapic_state);
    ioctl_iow_nr!(KVM_SET_CPUID2, KVMIO, 0x90, kvm_cpuid2);
    ioctl_iowr_nr!(KVM_GET_CPUID2, KVMIO, 0x91, kvm_cpuid2);
    ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
    ioctl_iow_nr!(KVM_SET_MP_STATE, KVMIO, 0x99, kvm_mp_state);
    ioctl_iow_nr!(KVM_SET_GUEST_DEBUG, KVMIO, 0x9b, kvm_guest_debug);
    ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
    ioctl_iow_nr!(KVM_SET_VCPU_EVENTS, KVMIO, 0xa0, kvm_vcpu_events);
    ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
    ioctl_iow_nr!(KVM_SET_DEBUGREGS, KVMIO, 0xa2, kvm_debugregs);
    ioctl_io_nr!(KVM_SET_TSC_KHZ, KVMIO, 0xa2);
    ioctl_io_nr!(KVM_GET_TSC_KHZ, KVMIO, 0xa3);
    ioctl_ior_nr!(KVM_GET_XSAVE, KVMIO, 0xa4, kvm_xsave);
    ioctl_iow_nr!(KVM_SET_XSAVE, KVMIO, 0xa5, kvm_xsave);
    ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_xcrs);
    ioctl_iow_nr!(KVM_SET_XCRS, KVMIO, 0xa7, kvm_xcrs);
    ioctl_io_nr!(KVM_KVMCLOCK_CTRL, KVMIO, 0xad);
    ioctl_ior_nr!(KVM_GET_XSAVE2, KVMIO, 0xcf, kvm_xsave);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ioctl_numbers_are_the_kernels() {
        // Values from the kernel's uapi headers (x86-64), spelled out.
        let named = |name: &str| {
            requests()
                .into_iter()
                .find(|(n, _)| *n == name)
                .map(|(_, r)| r)
        };
        assert_eq!(named("KVM_RUN"), Some(0xae80));
        assert_eq!(named("KVM_GET_REGS"), Some(0x8090_ae81));
        assert_eq!(named("KVM_GET_MSRS"), Some(0xc008_ae88));
        assert_eq!(named("KVM_GET_XSAVE"), Some(0x9000_aea4));
        assert_eq!(named("KVM_SET_XCRS"), Some(0x4188_aea7));
        let mut numbers: Vec<u64> = requests().into_iter().map(|(_, r)| r).collect();
        let n = numbers.len();
        numbers.sort_unstable();
        numbers.dedup();
        assert_eq!(numbers.len(), n, "an ioctl named twice");
    }
}
