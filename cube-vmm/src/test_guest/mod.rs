//! The synthetic test guest the project builds itself.
//!
//! It proves the VMM's mechanics on hosts where no Linux guest can run (PVM hosts with a
//! stock kernel): it keeps a counter, touches a configurable working set after every
//! start or restore, and dirties N MiB on request. Its machine ([`Machine`], the one
//! [`crate::microvm::MicroVm`] with the test guest's parts) boots it, restores it and
//! snapshots it, as [`crate::linux_vm::LinuxVm`] does a Linux guest.

pub mod machine;
pub mod mailbox;
pub mod program;

pub use crate::persist::WorkingSet;
pub use machine::{Machine, MachineError, TestGuest};
pub use mailbox::{Mailbox, MailboxError, Mode};
pub use program::ProgramError;
