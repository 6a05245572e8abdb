//! One supervisor process per sandbox: it holds the VM, outlives the process that
//! created it, and serves the library over a unix socket.

pub mod client;
pub mod jail_network;
pub mod jail_sandbox;
pub mod linux_sandbox;
pub mod pool;
pub mod protocol;
pub mod server;

pub use client::{ClientError, SupervisorClient};
pub use pool::{locate_supervisor, PoolError, SupervisorPool};
pub use protocol::{JailStatus, MachineStatus, Request, Response, Settings, Source, StatusReport};
