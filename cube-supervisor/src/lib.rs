//! Cube's supervisor layer: one process per sandbox holds its VM or jail, outlives
//! the process that created it, and serves the library over a unix socket.
//!
//! - [`protocol`]: the messages (with typed failures, [`protocol::ErrorKind`]), and
//!   [`client`], the library's end of a connection.
//! - [`pool`]: starting supervisors, and keeping some started ahead (at the lower
//!   [`priority`] they warm at).
//! - [`server`]: the supervisor process; it holds one of three sandboxes, each a
//!   [`backend::SandboxBackend`] that [`backend::dispatch`] routes requests to:
//!   [`test_guest_sandbox`] (Cube's test guest in a VM), [`linux_sandbox`] (a Linux
//!   guest) or [`jail_sandbox`] (a jail, see [`jail_spec`]), with
//!   [`jail_network`] for a sandbox's network. Once its sandbox is set up, a supervisor
//!   gives up what its engine no longer needs ([`confinement`]). Every one writes its snapshots through
//!   [`snapshot_transaction`] and has them [`flush`]ed; [`jail_snapshot`] checks a jail
//!   snapshot before it is restored.
//! - [`templates`]: building jail trees, Debian root filesystems and VM templates.
//! - [`records`]: what the store records about sandboxes, snapshots and templates.
//! - [`host`]: what this host can do, for `cube doctor` and the engines' checks.
//!
//! It knows nothing of the public API above it: `cube-core` is its client.

pub mod backend;
pub mod client;
pub mod confinement;
pub mod error_report;
pub mod flush;
pub mod host;
pub mod jail_network;
pub mod jail_sandbox;
pub mod jail_snapshot;
pub mod jail_spec;
pub mod linux_sandbox;
pub mod network;
pub mod network_keeper;
pub mod overlay_tree;
pub mod pod_network;
pub mod pool;
pub mod priority;
pub mod protocol;
pub mod records;
pub mod resident_memory;
pub mod server;
pub mod snapshot_transaction;
pub mod templates;
pub mod test_guest_sandbox;
pub mod vm_agent;
pub mod vm_devices;
