//! Snapshots of a microVM on disk: the checksummed state file beside the memory file
//! ([`state`]), and what writing a snapshot cost ([`stats`]).

pub mod state;
pub mod stats;

pub use state::{GuestKind, MachineConfig, MachineState, WorkingSet};
pub use stats::SnapshotStats;
