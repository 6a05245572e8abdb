//! Cube's jail engine: sandboxes made of Linux namespaces, an overlay or read-only
//! host-userland root, cgroup limits, a seccomp deny list and dropped capabilities, for
//! hosts where no guest kernel can run.
//!
//! [`Jail::spawn`] creates one sandbox and runs a program as its PID 1;
//! [`Jail::pause`]/[`Jail::resume`] freeze it; [`Jail::destroy`] (also on drop) leaves
//! nothing behind: no process, mount, cgroup or file.
//!
//! # Design decisions
//! - **Namespaces**: mount, PID, network, IPC and UTS come from one fork-style `clone`,
//!   so the program is PID 1 of its PID namespace without a double fork; the cgroup
//!   namespace is created after the cgroup join so its root is the sandbox cgroup.
//!   Killing PID 1 kills the whole namespace, which is what [`Jail::kill`] relies on.
//! - **No user namespace; an unprivileged host uid of the sandbox's own** (leased per
//!   sandbox from a range no account uses, see [`sandbox_uid`], so per-user kernel
//!   limits are not shared; or a configured one, never 0). Cube runs as root, so it
//!   can set everything up in the init user namespace and then give root up for good:
//!   bounding, ambient, effective, permitted and inheritable capability sets empty,
//!   no_new_privs. A user namespace
//!   would give the sandbox "root" with capabilities over its own namespaces, which is
//!   the largest source of kernel privilege escalations, and would complicate overlay
//!   ownership; seccomp refuses creating one.
//! - **Root filesystem**: by default the host's userland (/usr, the merged-/usr links,
//!   selected /etc files) bound read-only into a per-sandbox directory whose remaining
//!   contents (/, /home/user) are the writable layer; or template trees under overlayfs
//!   with upper/work in the sandbox directory. Fresh /proc (with /proc/sys read-only),
//!   a tmpfs /dev with null, zero, full, random, urandom, tty, a private devpts and
//!   /dev/shm, a private /tmp tmpfs; then `pivot_root` and detach of the old root. All
//!   mounts happen inside the sandbox's mount namespace after making propagation
//!   private, so they disappear with its last process.
//! - **cgroups**: v2 where it has the controller, v1 otherwise; the v2 hierarchy is
//!   joined whenever mounted for `cgroup.freeze`/`cgroup.kill`.
//! - **Hosting an agent**: [`JailConfig::binds`] shows host files (such as the agent
//!   binary) read-only at chosen paths, their mount points made in the writable layer;
//!   [`Jail::spawn_with_fds`] installs caller descriptors (a connected socket) at fixed
//!   numbers of PID 1, right before exec and after everything else was made
//!   close-on-exec, so nothing else of the caller leaks in.
//! - **Checkpoints**: [`checkpoint::dump`]/[`checkpoint::restore`] carry a sandbox's
//!   full process state through CRIU ≥ 4 ([`Criu::probe`] finds one and says why not
//!   when it cannot), with its writable layer copied alongside; a restore under another
//!   name and directory is a clone. PID 1 leads its own session for this (and so holds
//!   no controlling terminal of the host's).
//! - **seccomp**: a deny list (see [`seccomp::DENIED`]) returning EPERM, plus namespace
//!   flags in `clone`, ENOSYS for `clone3` and the x32 ABI.

pub mod capabilities;
pub mod cgroup;
pub mod checkpoint;
pub mod criu;
mod criu_launch;
mod criu_version;
pub mod disk_limit;
pub mod jail;
mod kdat_cache;
pub mod namespaces;
pub mod rootfs;
pub mod sandbox_uid;
pub mod seccomp;
pub mod tmpfs_image;
pub mod tmpfs_resize;

pub use capabilities::Identity;
pub use cgroup::{
    CgroupLayout, Limits, SandboxCgroup, DEFAULT_CPU_QUOTA, DEFAULT_DISK_BYTES,
    DEFAULT_MEMORY_BYTES, DEFAULT_PIDS_MAX,
};
pub use checkpoint::{Checkpoint, CheckpointError, DumpOptions};
pub use criu::{Criu, CriuError};
pub use disk_limit::{DiskLimit, DiskLimitError};
pub use jail::{Jail, JailConfig, JailError, JailExit, SetupStage, Stdio, MAX_PASSED_FD};
pub use namespaces::NamespaceSet;
pub use rootfs::{ReadOnlyBind, RootLimits, RootSpec};
pub use sandbox_uid::UidLease;
