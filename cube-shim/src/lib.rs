//! `containerd-shim-cubesandbox-v2`: a containerd shim v2 (runtime type
//! `io.containerd.cubesandbox.v2`) that runs containers as Cube sandboxes, so that
//! containerd, `ctr` and the kubelet's CRI drive Cube like any other runtime.
//!
//! - One shim process per pod (containers of a pod share it: `start` groups them by
//!   the CRI's sandbox id), and **one Cube sandbox per pod** (a jail by default): the pause
//!   container's create makes it, on the pause image's root filesystem, in the pod's
//!   network namespace (joined by path; the host's for `hostNetwork` pods); the pause
//!   process is the sandbox's PID 1 (Cube's agent): nothing of the pause image runs.
//!   Each container of the pod is processes in that sandbox, chrooted into the
//!   container's root filesystem as containerd's snapshotter mounts it, which the shim
//!   shows inside the sandbox (`pod_mount`), with the sandbox's /proc and /dev.
//! - A pod annotated `io.cubesandbox.engine: vm` is one VM instead: its guest is
//!   started from a template of the pause image's root (`vm_container`), and each
//!   container's root is copied into the guest (`guest_root`), where its processes
//!   run chrooted, as the spec's user. Its guest stands on the pod's network: the VM's
//!   NIC is spliced to the pod's interface and takes the pod's address.
//! - A container outside any pod (`ctr run`) is a sandbox of its own whose root is its
//!   root filesystem, read-only under the sandbox's own writable layer, in its own
//!   network namespace.
//! - Every process (a main one and each exec) runs through the sandbox's agent, its
//!   output relayed to the FIFOs containerd hands over.
//! - Task events (create, start, exit, delete, exec added/started, paused, resumed,
//!   checkpointed) go to containerd; Stats reads the sandbox's cgroups.
//! - A checkpoint is a Cube snapshot exported as a portable archive into containerd's
//!   checkpoint directory; a restore imports it and creates the sandbox from it.
//!
//! Configuration comes from the environment containerd passes on: `CUBE_HOME` (the
//! store), `CUBE_SUPERVISOR` and `CUBE_AGENT` (binaries, else next to the shim). The
//! engine is chosen by the `io.cubesandbox.engine` annotation (`auto` by default), the
//! snapshot a container starts from by `io.cubesandbox.snapshot`.

pub mod binds;
pub mod calls_in_flight;
pub mod container;
pub mod detached_tree;
pub mod guest_root;
pub mod mount_helper;
pub mod pod_mount;
pub mod process;
pub mod resources;
pub mod service;
pub mod shim;
pub mod spec;
pub mod stats;
pub mod vm_container;

/// The runtime type containerd names this shim by.
pub const RUNTIME_ID: &str = "io.containerd.cubesandbox.v2";
