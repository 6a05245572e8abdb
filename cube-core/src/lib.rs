//! Cube's `Sandbox` API: the [`Runtime`] and its sandboxes, engine-neutral.
//!
//! A [`Runtime`] owns the store and a pool of pre-started supervisors; a [`Sandbox`] is a
//! handle on one sandbox's supervisor. Sandboxes outlive the handle (and the process)
//! unless created ephemeral: [`Sandbox::destroy`] ends them.
//!
//! Two engines sit behind it ([`Engine`]): KVM microVMs, and jails (namespaces,
//! cgroups, seccomp, a copy-on-write writable layer over the host's read-only
//! userland; weaker isolation, one shared kernel). A template records its engine;
//! [`HOST_TEMPLATE`] is the built-in jail template. A jail's snapshots are of kind
//! [`SnapshotKind::Full`] where a working CRIU exists: processes (interpreter contexts
//! included) and files come back at rollback, clone and wake. Elsewhere they are of
//! kind [`SnapshotKind::Filesystem`], with the reason in [`Snapshot::fallback`]:
//! rollback, clone and wake restore the files and restart the processes.
//!
//! # Example
//!
//! The whole life of a sandbox: create, run a cell, snapshot, break something, roll
//! back, clone, destroy. (`no_run`: the jail engine needs root for namespaces, mounts
//! and cgroups. `cube-core/examples/agent_loop.rs` is the same as a program to run.)
//!
//! ```no_run
//! use cube_agent::protocol::Language;
//! use cube_core::{CreateOptions, Runtime, RuntimeConfig, HOST_TEMPLATE};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let rt = Runtime::open(RuntimeConfig {
//!     store_root: "/var/lib/cube".into(),
//!     pool_size: 0,
//!     network_pool_size: 0,
//!     supervisor: None,
//! })?;
//! let mut sb = rt.create(HOST_TEMPLATE, CreateOptions::new(true))?;
//!
//! let agent = sb.agent()?;
//! agent.create_context("main", Language::Python, Some("/home/user"))?;
//! let r = agent.run_code("main", "open('notes', 'w').write('v1')\n6 * 7", None)?;
//! assert_eq!(r.value.as_deref(), Some("42"));
//!
//! drop(agent);
//! let snap = sb.snapshot()?; // full with CRIU (connections end), else filesystem
//! let agent = sb.agent()?;
//! agent.run_code("main", "import os; os.remove('notes')", None)?;
//! drop(agent);
//! sb.rollback(&snap.id)?; // the file is back (and the interpreter's state, if full)
//!
//! let clones = rt.clone_sandbox(&mut sb, 2, 2, CreateOptions::new(true))?;
//! for clone in clones {
//!     clone.destroy()?;
//! }
//! sb.destroy()?;
//! # Ok(())
//! # }
//! ```
//!
//! # Errors
//!
//! Every failure is a [`SandboxError`] with a kind ([`SandboxError::kind`],
//! [`ErrorKind`]) that crosses the process boundary intact: a sandbox's supervisor
//! reports what kind of failure it met (not found, bad state, snapshot failed, host
//! cannot, timeout...), and callers tell failures apart by it, never by the message.
//!
//! # Modules
//!
//! - [`network`]: a sandbox's network options, policy and reports.
//! - [`templates`]: what templates are built from (trees, Debian, VM specs).
//! - [`host`]: what this host can do (`cube doctor`).
//! - [`store`]: the store on disk and its filesystem.
//! - [`portable`]: snapshots as archive files that travel between stores and hosts.
//! - [`oneshot`]: one command in a fresh jail in this process, no supervisor (`cube
//!   run`, `cube code`).
//! - [`debug`]: booting a kernel in Cube's VMM by hand (`cube debug boot`).
//! - `testing` (hidden): the test guest's controls and the benchmarks' floors.

mod engine_choice;
mod error;
mod portable_error;
mod runtime;
mod sandbox;
mod usage;

pub mod debug;
pub mod host;
pub mod network;
pub mod oneshot;
pub mod portable;
pub mod store;
pub mod templates;
#[doc(hidden)]
pub mod testing;

pub use cube_supervisor::error_report;
/// Connects to a jail sandbox's agent socket ([`Sandbox::agent_socket`]) without the
/// agent's handshake, resolving it inside the sandbox's root so that the sandbox
/// cannot point the connection at a host socket.
pub use cube_supervisor::jail_sandbox::connect_agent as connect_jail_agent;
pub use cube_supervisor::jail_spec::{
    DEFAULT_CPU_MILLIS, DEFAULT_DISK_MIB, DEFAULT_MEMORY_MIB, DEFAULT_PIDS_MAX,
};
pub use cube_supervisor::protocol::{
    ErrorKind, JailStatus, LimitChange, MachineStatus, StatusReport,
};
pub use cube_supervisor::records::{
    Engine, ProcessDefaults, SandboxMeta, SnapshotKind, SnapshotMeta, TemplateMeta, HOST_TEMPLATE,
};
pub use cube_vmm::persist::SnapshotStats;
pub use engine_choice::EngineChoice;
pub use error::SandboxError;
pub use portable::{ExportReport, ImportReport};
pub use portable_error::PortableError;
pub use runtime::{CreateOptions, Runtime, RuntimeConfig};
pub use sandbox::{Sandbox, Snapshot};
pub use usage::ResourceUsage;
