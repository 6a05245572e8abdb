//! The CPUID a vCPU sees: KVM's supported CPUID with the per-vCPU fields filled in.
//!
//! `KVM_GET_SUPPORTED_CPUID` describes what the host can offer, not one particular CPU:
//! fields that name a CPU (its APIC id) or the machine around it (how many logical
//! processors share a package) are left for the VMM to fill in before `KVM_SET_CPUID2`.

use kvm_bindings::{kvm_cpuid_entry2, CpuId};
use serde::{Deserialize, Serialize};

/// Leaf 1: family/model, feature flags, initial APIC id.
const LEAF_FEATURES: u32 = 0x1;
/// Leaf 0xB: extended topology enumeration (x2APIC id in EDX).
const LEAF_TOPOLOGY: u32 = 0xb;
/// Leaf 0x1F: V2 extended topology enumeration (x2APIC id in EDX).
const LEAF_TOPOLOGY_V2: u32 = 0x1f;

/// Leaf 1 EBX bits 31:24: the initial APIC id of this logical processor.
const EBX_APIC_ID_SHIFT: u32 = 24;
/// Leaf 1 EBX bits 23:16: the number of addressable logical processors in the package.
const EBX_LOGICAL_COUNT_SHIFT: u32 = 16;
/// Leaf 1 ECX bit 31: "running under a hypervisor", which guests use to pick
/// paravirtual clocks and skip work that only makes sense on bare metal.
const ECX_HYPERVISOR_BIT: u32 = 1 << 31;
/// Leaf 1 EDX bit 28: the logical processor count in EBX[23:16] is valid.
const EDX_HTT_BIT: u32 = 1 << 28;

/// Returns the CPUID for vCPU `apic_id` of a VM with `vcpu_count` vCPUs, derived from
/// the host's supported CPUID.
///
/// The APIC id is written to leaf 1 EBX[31:24] and to EDX of every leaf 0xB/0x1F
/// sub-leaf (the x2APIC id), because the guest kernel matches these against the
/// LAPIC ids KVM gives the vCPUs (vCPU index == APIC id); the hypervisor bit is set.
pub fn vcpu_cpuid(supported: &CpuId, apic_id: u8, vcpu_count: u8) -> CpuId {
    let mut cpuid = supported.clone();
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            LEAF_FEATURES => {
                entry.ebx &= !(0xff << EBX_APIC_ID_SHIFT | 0xff << EBX_LOGICAL_COUNT_SHIFT);
                entry.ebx |= u32::from(apic_id) << EBX_APIC_ID_SHIFT;
                entry.ebx |= u32::from(vcpu_count) << EBX_LOGICAL_COUNT_SHIFT;
                entry.ecx |= ECX_HYPERVISOR_BIT;
                // Without HTT the guest ignores the logical processor count above.
                if vcpu_count > 1 {
                    entry.edx |= EDX_HTT_BIT;
                } else {
                    entry.edx &= !EDX_HTT_BIT;
                }
            }
            LEAF_TOPOLOGY | LEAF_TOPOLOGY_V2 => entry.edx = u32::from(apic_id),
            _ => {}
        }
    }
    cpuid
}

/// One CPUID entry as saved in a vCPU state: `kvm_cpuid_entry2` without its padding,
/// so a state file carries only fields KVM defines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuidEntry {
    /// The leaf (EAX input).
    pub function: u32,
    /// The sub-leaf (ECX input), meaningful when `flags` says the index is significant.
    pub index: u32,
    /// `KVM_CPUID_FLAG_*` bits.
    pub flags: u32,
    /// EAX output.
    pub eax: u32,
    /// EBX output.
    pub ebx: u32,
    /// ECX output.
    pub ecx: u32,
    /// EDX output.
    pub edx: u32,
}

impl From<&kvm_cpuid_entry2> for CpuidEntry {
    fn from(e: &kvm_cpuid_entry2) -> Self {
        Self {
            function: e.function,
            index: e.index,
            flags: e.flags,
            eax: e.eax,
            ebx: e.ebx,
            ecx: e.ecx,
            edx: e.edx,
        }
    }
}

impl From<&CpuidEntry> for kvm_cpuid_entry2 {
    fn from(e: &CpuidEntry) -> Self {
        Self {
            function: e.function,
            index: e.index,
            flags: e.flags,
            eax: e.eax,
            ebx: e.ebx,
            ecx: e.ecx,
            edx: e.edx,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::KVM_CPUID_FLAG_SIGNIFCANT_INDEX;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            ebx: 0xdead_beef,
            edx: 0x1234_5678,
            flags: if function == LEAF_TOPOLOGY {
                KVM_CPUID_FLAG_SIGNIFCANT_INDEX
            } else {
                0
            },
            ..Default::default()
        }
    }

    #[test]
    fn per_vcpu_fields_are_filled_in() {
        let supported = CpuId::from_entries(&[
            entry(0, 0),
            entry(LEAF_FEATURES, 0),
            entry(LEAF_TOPOLOGY, 0),
            entry(LEAF_TOPOLOGY, 1),
        ])
        .unwrap();

        let cpuid = vcpu_cpuid(&supported, 3, 4);
        let leaf1 = cpuid.as_slice()[1];
        assert_eq!(leaf1.ebx >> 24, 3, "APIC id");
        assert_eq!((leaf1.ebx >> 16) & 0xff, 4, "logical processor count");
        assert_eq!(leaf1.ebx & 0xffff, 0xbeef, "other EBX bits kept");
        assert_ne!(leaf1.ecx & ECX_HYPERVISOR_BIT, 0);
        assert_ne!(leaf1.edx & EDX_HTT_BIT, 0);
        for topo in &cpuid.as_slice()[2..] {
            assert_eq!(topo.edx, 3, "x2APIC id in leaf 0xB sub-leaf {}", topo.index);
        }
        // Leaves without per-vCPU fields pass through unchanged.
        assert_eq!(cpuid.as_slice()[0], supported.as_slice()[0]);

        let single = vcpu_cpuid(&supported, 0, 1);
        assert_eq!(single.as_slice()[1].edx & EDX_HTT_BIT, 0);
    }

    #[test]
    fn entry_conversion_round_trips_and_drops_padding() {
        let mut raw = entry(7, 0);
        raw.eax = 1;
        raw.ecx = 2;
        raw.padding = [9, 9, 9];
        let back = kvm_cpuid_entry2::from(&CpuidEntry::from(&raw));
        assert_eq!(back.padding, [0, 0, 0]);
        raw.padding = [0; 3];
        assert_eq!(back, raw);
    }
}
