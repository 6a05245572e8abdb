//! Snapshots of a microVM: the on-disk format.

pub mod durability;
pub mod format;

pub use format::{GuestKind, MachineConfig, MachineState};
