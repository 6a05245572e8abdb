//! What is inside a store entry: every file and directory name of a sandbox's, a
//! snapshot's and a template's directory, in one place.
//!
//! ```text
//! sandboxes/<id>/    sandbox.meta  supervisor.sock  agent.sock  console.log
//!                    rootfs.img    vsock.sock       network.device
//!                    hibernate/    (a snapshot directory: the VM's hibernation image)
//!                    jail/  layer/  layer.hibernated  layer.seed  hibernated/
//! snapshots/<id>/    memory.bin  state.bin  rootfs.img  snapshot.meta  durable  layer/
//!                    files.manifest (a jail's)
//! templates/<name>/  template.meta  rootfs/ (a jail template's tree)
//!                    memory.bin  state.bin  rootfs.img  durable (a VM template)
//! ```
//!
//! A VM template's directory and a sandbox's hibernation image are snapshot
//! directories too ([`TemplateDir::image`], [`SandboxDir::hibernation`]). The engines
//! decide what to put where; only this module spells the names, so that two parts of
//! Cube can never disagree about them. Each type derefs to its [`Path`] for the many
//! operations (open, rename, bind) that take the directory itself.

use std::ops::Deref;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The memory file of a VM image.
const MEMORY_FILE: &str = "memory.bin";
/// The checksummed vCPU/VM/device state of a VM image.
const STATE_FILE: &str = "state.bin";
/// A VM's root filesystem image.
const ROOTFS_FILE: &str = "rootfs.img";
/// A rollback's copy of a snapshot's disk, renamed over the sandbox's once the
/// machine is restored.
const ROOTFS_ROLLBACK: &str = "rootfs.img.rollback";
/// A snapshot's record.
const SNAPSHOT_RECORD: &str = "snapshot.meta";
/// A sandbox's record.
const SANDBOX_RECORD: &str = "sandbox.meta";
/// A template's record.
const TEMPLATE_RECORD: &str = "template.meta";
/// The marker a completed background flush leaves (see [`crate::durable_marker`]).
const DURABLE_MARKER: &str = "durable";
/// What a jail snapshot's trees held (see [`crate::tree_manifest`]).
const FILE_MANIFEST: &str = "files.manifest";
/// The socket a sandbox's supervisor listens on.
const SUPERVISOR_SOCKET: &str = "supervisor.sock";
/// The link to a jail sandbox's agent socket.
const AGENT_SOCKET: &str = "agent.sock";
/// A VM sandbox's serial console log.
const CONSOLE_LOG: &str = "console.log";
/// The host end of a VM's vsock device.
const VSOCK_SOCKET: &str = "vsock.sock";
/// The socket a networked VM's network keeper serves the library on.
const NETWORK_KEEPER_SOCKET: &str = "keeper.sock";
/// A VM's previous vsock socket, kept aside while a rollback or wake replaces it.
const VSOCK_ASIDE: &str = "vsock.sock.previous";
/// A VM sandbox's hibernation image (a snapshot directory).
const HIBERNATION: &str = "hibernate";
/// A snapshot lent to a VM sandbox's supervisor for a rollback.
const ROLLBACK_SOURCE: &str = "rollback.source";
/// A hibernation image being written.
const HIBERNATION_STAGING: &str = "hibernate.staging";
/// The previous hibernation image while a new one replaces it.
const HIBERNATION_OLD: &str = "hibernate.old";
/// The network device a sandbox holds from the host's pool, recorded so that a
/// stale sandbox's device can be released.
const NETWORK_RECORD: &str = "network.device";
/// A jail's state directory (mounts, cgroup names).
const JAIL_DIR: &str = "jail";
/// A jail's writable layer (also inside a jail snapshot).
pub const LAYER_DIR: &str = "layer";
/// A hibernated jail's layer, when it hibernated without a checkpoint.
const HIBERNATED_LAYER: &str = "layer.hibernated";
/// A layer copied in from a snapshot, which the next jail starts on.
const SEED_LAYER: &str = "layer.seed";
/// A hibernated jail's CRIU checkpoint.
const HIBERNATED_CHECKPOINT: &str = "hibernated";
/// A built jail template's root filesystem tree.
const TEMPLATE_TREE: &str = "rootfs";
/// The tree a VM template's image is made from, while it is built.
const IMAGE_TREE: &str = "tree";

macro_rules! directory_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct $name(PathBuf);

        impl $name {
            /// The directory at `path` (which need not exist).
            pub fn new(path: impl Into<PathBuf>) -> Self {
                $name(path.into())
            }

            /// The directory itself.
            pub fn path(&self) -> &Path {
                &self.0
            }

            /// The directory, as an owned path.
            pub fn into_path(self) -> PathBuf {
                self.0
            }
        }

        impl Deref for $name {
            type Target = Path;

            fn deref(&self) -> &Path {
                &self.0
            }
        }

        impl AsRef<Path> for $name {
            fn as_ref(&self) -> &Path {
                &self.0
            }
        }
    };
}

directory_type!(
    /// A snapshot's directory: a VM's memory, state and disk, or a jail's layer and
    /// checkpoint, with the snapshot's record and durability marker. A VM template's
    /// directory and a sandbox's hibernation image have the same layout.
    SnapshotDir
);

directory_type!(
    /// A sandbox's directory: its record, its supervisor's socket, its agent's socket,
    /// and whatever its engine keeps (a VM's disk and console, a jail's layer).
    SandboxDir
);

directory_type!(
    /// A template's directory: its record and a jail template's tree, or a VM
    /// template's image (see [`TemplateDir::image`]).
    TemplateDir
);

impl SnapshotDir {
    /// Envelope kind of [`SnapshotDir::record`].
    pub const RECORD_KIND: &'static str = "snapshot";

    /// The name of [`SnapshotDir::memory`] in the snapshot's directory.
    pub const MEMORY_NAME: &'static str = MEMORY_FILE;

    /// The guest memory file.
    pub fn memory(&self) -> PathBuf {
        self.0.join(MEMORY_FILE)
    }

    /// The VM state file (checksummed envelope).
    pub fn state(&self) -> PathBuf {
        self.0.join(STATE_FILE)
    }

    /// The root filesystem image, when the VM has a disk.
    pub fn rootfs(&self) -> PathBuf {
        self.0.join(ROOTFS_FILE)
    }

    /// The snapshot's record.
    pub fn record(&self) -> PathBuf {
        self.0.join(SNAPSHOT_RECORD)
    }

    /// The marker a completed background flush leaves.
    pub fn durable_marker(&self) -> PathBuf {
        self.0.join(DURABLE_MARKER)
    }

    /// What a jail snapshot's trees (its layer, its tmpfs contents) held when written.
    pub fn file_manifest(&self) -> PathBuf {
        self.0.join(FILE_MANIFEST)
    }

    /// A jail snapshot's writable layer (a checkpoint's layer, for a full one).
    pub fn layer(&self) -> PathBuf {
        self.0.join(LAYER_DIR)
    }

    /// The first entry of the snapshot's directory that is neither a regular file
    /// nor a directory (a symlink, a device, a FIFO, a socket), or the directory
    /// itself if it is not one; `None` when there is none. A snapshot a supervisor
    /// staged is checked once it is where the supervisor can no longer add to it: a
    /// symlink there (to another sandbox's disk or memory image) would otherwise be
    /// followed by whoever restores or clones it, as root.
    pub fn foreign_entry(&self) -> std::io::Result<Option<PathBuf>> {
        if !std::fs::symlink_metadata(&self.0)?.is_dir() {
            return Ok(Some(self.0.clone()));
        }
        for entry in std::fs::read_dir(&self.0)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if !kind.is_file() && !kind.is_dir() {
                return Ok(Some(entry.path()));
            }
        }
        Ok(None)
    }

    /// The sandbox that owns the snapshot, as its record names it; None when the
    /// record is missing or damaged. (Only the owner is read: the record's other
    /// fields belong to whoever writes it.)
    pub fn owner(&self) -> Option<String> {
        #[derive(Deserialize)]
        struct Owner {
            sandbox: String,
        }
        crate::read_verified::<Owner>(&self.record(), Self::RECORD_KIND)
            .ok()
            .map(|o| o.sandbox)
    }
}

impl SandboxDir {
    /// Envelope kind of [`SandboxDir::record`].
    pub const RECORD_KIND: &'static str = "sandbox";

    /// The sandbox's record.
    pub fn record(&self) -> PathBuf {
        self.0.join(SANDBOX_RECORD)
    }

    /// The socket its supervisor listens on.
    pub fn supervisor_socket(&self) -> PathBuf {
        self.0.join(SUPERVISOR_SOCKET)
    }

    /// The link to a jail sandbox's agent socket.
    pub fn agent_socket(&self) -> PathBuf {
        self.0.join(AGENT_SOCKET)
    }

    /// Where a new agent link is made before it is renamed over
    /// [`SandboxDir::agent_socket`].
    pub fn agent_socket_staging(&self) -> PathBuf {
        self.0.join(format!("{AGENT_SOCKET}.new"))
    }

    /// A VM sandbox's root filesystem image.
    pub fn rootfs(&self) -> PathBuf {
        self.0.join(ROOTFS_FILE)
    }

    /// A snapshot's disk, cloned in by a rollback before it replaces
    /// [`SandboxDir::rootfs`].
    pub fn rootfs_rollback(&self) -> PathBuf {
        self.0.join(ROOTFS_ROLLBACK)
    }

    /// A VM sandbox's serial console log.
    pub fn console_log(&self) -> PathBuf {
        self.0.join(CONSOLE_LOG)
    }

    /// The longest path of a socket bound in the sandbox's directory (the supervisor's,
    /// the agent link's, the vsock device's, the network keeper's), for the check that
    /// they all fit.
    pub fn longest_socket(&self) -> PathBuf {
        [
            self.supervisor_socket(),
            self.agent_socket(),
            self.vsock_socket(),
            self.network_keeper_socket(),
        ]
        .into_iter()
        .max_by_key(|p| p.as_os_str().len())
        .unwrap_or_else(|| self.supervisor_socket())
    }

    /// The host end of a VM sandbox's vsock device.
    pub fn vsock_socket(&self) -> PathBuf {
        self.0.join(VSOCK_SOCKET)
    }

    /// Where the previous vsock socket waits while a restore replaces it.
    pub fn vsock_socket_aside(&self) -> PathBuf {
        self.0.join(VSOCK_ASIDE)
    }

    /// Where its supervisor writes snapshot `id` before the library moves it among
    /// the store's snapshots (which a confined VM supervisor may not write).
    pub fn snapshot_staging(&self, id: &str) -> PathBuf {
        self.0.join(format!("{id}.staging"))
    }

    /// Where the library lends a VM sandbox's supervisor the snapshot it rolls back
    /// to (see [`crate::lent_snapshot`]): a confined supervisor reads no snapshot
    /// where it lies.
    pub fn rollback_source(&self) -> SnapshotDir {
        SnapshotDir(self.0.join(ROLLBACK_SOURCE))
    }

    /// A VM sandbox's hibernation image.
    pub fn hibernation(&self) -> SnapshotDir {
        SnapshotDir(self.0.join(HIBERNATION))
    }

    /// A hibernation image being written.
    pub fn hibernation_staging(&self) -> SnapshotDir {
        SnapshotDir(self.0.join(HIBERNATION_STAGING))
    }

    /// The previous hibernation image while a new one takes its place.
    pub fn hibernation_old(&self) -> SnapshotDir {
        SnapshotDir(self.0.join(HIBERNATION_OLD))
    }

    /// The network device the sandbox holds from the host's pool.
    pub fn network_record(&self) -> PathBuf {
        self.0.join(NETWORK_RECORD)
    }

    /// Where a networked VM's network keeper serves the library's network requests.
    pub fn network_keeper_socket(&self) -> PathBuf {
        self.0.join(NETWORK_KEEPER_SOCKET)
    }

    /// A jail sandbox's jail state directory.
    pub fn jail(&self) -> PathBuf {
        self.0.join(JAIL_DIR)
    }

    /// Where a replaced jail's state directory goes while it is torn down.
    pub fn retired_jail(&self, generation: u64) -> PathBuf {
        self.0.join(format!("{JAIL_DIR}.retired-{generation}"))
    }

    /// Where a woken jail's checkpoint goes while it is removed off the request path.
    pub fn removed_checkpoint(&self, generation: u64) -> PathBuf {
        self.0.join(format!("{JAIL_DIR}.removed-{generation}"))
    }

    /// A jail sandbox's writable layer.
    pub fn layer(&self) -> PathBuf {
        self.0.join(LAYER_DIR)
    }

    /// A hibernated jail's layer (hibernated without a checkpoint).
    pub fn hibernated_layer(&self) -> PathBuf {
        self.0.join(HIBERNATED_LAYER)
    }

    /// A layer copied in from a snapshot for the next jail to start on.
    pub fn seed_layer(&self) -> PathBuf {
        self.0.join(SEED_LAYER)
    }

    /// A hibernated jail's checkpoint.
    pub fn hibernated_checkpoint(&self) -> PathBuf {
        self.0.join(HIBERNATED_CHECKPOINT)
    }

    /// The files a hibernated jail leaves to start from; removed by destroy.
    pub fn jail_leftovers(&self) -> [PathBuf; 3] {
        [
            self.hibernated_layer(),
            self.hibernated_checkpoint(),
            self.seed_layer(),
        ]
    }

    /// Whether a jail sandbox is hibernated: its processes stopped, its state on disk.
    pub fn is_hibernated_jail(&self) -> bool {
        self.hibernated_layer().exists() || self.hibernated_checkpoint().exists()
    }
}

impl TemplateDir {
    /// Envelope kind of [`TemplateDir::record`].
    pub const RECORD_KIND: &'static str = "template";
    /// The directory name a built jail template keeps its tree under (its record
    /// names it).
    pub const TREE: &'static str = TEMPLATE_TREE;

    /// The template's record.
    pub fn record(&self) -> PathBuf {
        self.0.join(TEMPLATE_RECORD)
    }

    /// Where a jail template's tree is built ([`TemplateDir::TREE`]; a template's
    /// record names its tree, so read that for an existing one).
    pub fn tree(&self) -> PathBuf {
        self.0.join(TEMPLATE_TREE)
    }

    /// A VM template's image: memory, state and disk.
    pub fn image(&self) -> SnapshotDir {
        SnapshotDir(self.0.clone())
    }

    /// The tree a VM template's disk image is made from, while it is built.
    pub fn image_tree(&self) -> PathBuf {
        self.0.join(IMAGE_TREE)
    }

    /// The host end of the vsock device of the VM that builds a VM template; removed
    /// before the template is committed.
    pub fn build_vsock_socket(&self) -> PathBuf {
        self.0.join(VSOCK_SOCKET)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_holding_a_symlink_or_a_fifo_or_being_one_is_found_out() {
        let tmp = tempfile::tempdir().unwrap();
        let snapshot = SnapshotDir::new(tmp.path().join("snap"));
        std::fs::create_dir(&snapshot).unwrap();
        std::fs::write(snapshot.memory(), b"m").unwrap();
        std::fs::create_dir(snapshot.layer()).unwrap();
        std::os::unix::fs::symlink("/etc/shadow", snapshot.layer().join("deep")).unwrap();
        // Files and directories only at its top: the layer's own links are the jail's.
        assert_eq!(snapshot.foreign_entry().unwrap(), None);
        std::os::unix::fs::symlink(tmp.path().join("other-disk"), snapshot.rootfs()).unwrap();
        assert_eq!(snapshot.foreign_entry().unwrap(), Some(snapshot.rootfs()));
        std::fs::remove_file(snapshot.rootfs()).unwrap();
        nix::unistd::mkfifo(&snapshot.state(), nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert_eq!(snapshot.foreign_entry().unwrap(), Some(snapshot.state()));
        let linked = SnapshotDir::new(tmp.path().join("linked"));
        std::os::unix::fs::symlink(tmp.path(), &linked).unwrap();
        assert_eq!(
            linked.foreign_entry().unwrap(),
            Some(linked.path().to_path_buf())
        );
        assert!(SnapshotDir::new(tmp.path().join("missing"))
            .foreign_entry()
            .is_err());
    }

    #[test]
    fn a_snapshot_names_its_owner_in_its_record() {
        let dir = tempfile::tempdir().unwrap();
        let snap = SnapshotDir::new(dir.path());
        assert_eq!(snap.owner(), None);
        #[derive(serde::Serialize)]
        struct Record {
            id: &'static str,
            sandbox: &'static str,
            created_unix: u64,
        }
        let record = Record {
            id: "snap-1",
            sandbox: "sb-1",
            created_unix: 7,
        };
        crate::write_atomic(&snap.record(), SnapshotDir::RECORD_KIND, &record).unwrap();
        assert_eq!(snap.owner().as_deref(), Some("sb-1"));
        // A record of another kind is not a snapshot's.
        crate::write_atomic(&snap.record(), SandboxDir::RECORD_KIND, &record).unwrap();
        assert_eq!(snap.owner(), None);
    }

    #[test]
    fn images_share_the_snapshot_layout() {
        let sandbox = SandboxDir::new("/store/sandboxes/sb-1");
        assert_eq!(
            sandbox.hibernation().memory(),
            Path::new("/store/sandboxes/sb-1/hibernate/memory.bin")
        );
        let template = TemplateDir::new("/store/templates/t");
        assert_eq!(
            template.image().state(),
            Path::new("/store/templates/t/state.bin")
        );
        assert_eq!(
            sandbox.retired_jail(3),
            Path::new("/store/sandboxes/sb-1/jail.retired-3")
        );
        assert_eq!(
            sandbox.removed_checkpoint(3),
            Path::new("/store/sandboxes/sb-1/jail.removed-3")
        );
    }
}
