//! Snapshots of a microVM on disk: the checksummed state file beside the memory file
//! ([`state`]), the writer every microVM's snapshot goes through
//! ([`snapshot_writer`]), and what writing a snapshot cost ([`stats`]).

pub(crate) mod snapshot_writer;
pub mod state;
pub mod stats;

pub use snapshot_writer::AfterSnapshot;
pub use state::{GuestKind, MachineConfig, MachineState, WorkingSet};
pub use stats::SnapshotStats;
