//! Cube's microVM monitor on KVM and the rust-vmm crates.
//!
//! - [`vstate`]: KVM VMs and vCPUs and the state KVM keeps for them;
//!   [`vstate::KvmContext`] is opened once per process.
//! - [`arch`]: the x86_64 guest: physical layout, ACPI tables, CPUID.
//! - [`boot`]: loading a Linux kernel (PVH for an ELF vmlinux, the 64-bit boot
//!   protocol for a bzImage).
//! - [`vcpu_runner`]: one thread per vCPU, stopped and resumed by signal.
//! - [`device_manager`]: the virtio-mmio devices of a machine, their windows,
//!   interrupts and event loop.
//! - [`microvm`]: THE microVM (VM, vCPU threads, memory, dirty tracking, pause,
//!   diff base) with its builder; a guest's own parts are its type parameter.
//! - [`linux_vm`]: a Linux guest's parts (COM1, virtio devices), its boot and restore.
//! - [`persist`]: the snapshot state file (format, validation), the one snapshot
//!   writer every microVM uses, and what writing a snapshot cost.
//! - [`host`]: which KVM this host offers.
//! - `test_guest` (feature `test-guest`): the synthetic guest that proves the VMM's
//!   mechanics where no Linux guest runs, and its machine. Production paths do not
//!   use it.
//!
//! This crate knows nothing of sandboxes or supervisors: it builds, runs, snapshots and
//! restores machines from the files it is given.

pub mod arch;
pub mod boot;
pub mod control_device;
pub mod device_manager;
pub mod dirty_tracking;
pub mod host;
pub mod linux_vm;
pub mod memory;
pub mod microvm;
pub mod persist;
#[cfg(feature = "test-guest")]
pub mod test_guest;
#[doc(hidden)]
pub mod testing;
pub mod vcpu_ioctls;
pub mod vcpu_runner;
pub mod vstate;
