//! KVM VM and vCPU state: creating VMs and vCPUs, and saving and restoring the state
//! KVM keeps for them (registers, MSRs, interrupt controllers, clocks).
//!
//! [`KvmContext`] is opened once per process and shared by `Arc`: it holds `/dev/kvm`
//! and what every VM would otherwise re-query (supported CPUID, which MSRs can be saved,
//! the XSAVE area size).

pub mod context;
pub mod emulation;
pub(crate) mod kvm_bytes;
mod msrs;
pub mod vcpu;
pub mod vm;

pub use crate::arch::x86_64::cpuid::CpuidEntry;
#[cfg(test)]
pub(crate) use context::test_context;
pub use context::{KvmContext, VstateError};
pub use vcpu::{FpuState, MsrEntry, Vcpu, VcpuError, VcpuState};
pub use vm::{IrqChip, IrqchipState, Vm, VmConfig, VmError, VmState};
