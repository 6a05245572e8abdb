//! Cube's `Sandbox` API: lifecycle, the KVM microVM engine, snapshots and templates.

pub mod devices;
pub mod error_report;
pub mod host_caps;
pub mod sandbox;
pub mod snapshot;
pub mod supervisor;
pub mod template_build;
pub mod template_rootfs;
pub mod test_guest;
pub mod vm_agent;
pub mod vm_template;
pub mod vmm;
pub mod vstate;

pub use sandbox::{
    CreateOptions, Engine, EngineChoice, NetnsChoice, Runtime, RuntimeConfig, Sandbox,
    SandboxError, Snapshot, SnapshotKind, DEFAULT_PIDS_MAX, HOST_TEMPLATE,
};
