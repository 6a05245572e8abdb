//! The x86_64 guest: its physical memory layout, the ACPI tables that describe its
//! CPUs and devices, and the CPUID its vCPUs see.

pub mod acpi;
pub mod cpuid;
pub mod layout;
