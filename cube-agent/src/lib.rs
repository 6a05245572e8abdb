//! The Cube agent: the process that runs inside every sandbox (as its init), and the
//! host<->agent protocol it speaks.
//!
//! The host side uses [`frame`], [`protocol`], [`transport`] and [`client`]; the agent
//! side adds [`server`], [`exec`] (with [`terminal`]), [`files`], [`container_root`], [`reaper`] and [`init`], and
//! [`one_command`] for a sandbox that runs one command and ends.

pub mod client;
pub mod container_root;
pub mod exec;
pub mod files;
pub mod frame;
pub mod image_defaults;
pub mod init;
pub mod one_command;
pub mod protocol;
pub mod reaper;
pub mod reseed;
pub mod run_code;
pub mod server;
pub mod terminal;
pub mod transport;
pub mod tunnel;
pub mod vm_init;
