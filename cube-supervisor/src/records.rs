//! What the store records about sandboxes, snapshots and templates, in the files
//! [`cube_storage::layout`] names (`sandbox.meta`, `snapshot.meta`, `template.meta`).

use serde::{Deserialize, Serialize};

use cube_vmm::persist::MachineConfig;
use cube_vmm::persist::SnapshotStats;

/// The built-in jail template: the host's own userland (with its python3), read-only,
/// under a per-sandbox writable layer. Always listed, nothing to build.
pub const HOST_TEMPLATE: &str = "host";

/// The isolation engine behind a sandbox.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// A KVM microVM. Records written before the jail engine existed are all VMs.
    #[default]
    Vm,
    /// Linux namespaces, cgroups and seccomp around a copy-on-write root: weaker
    /// isolation than a VM (one shared kernel), for hosts where no guest kernel runs.
    Jail,
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad` so that width and alignment flags apply in tables.
        f.pad(match self {
            Engine::Vm => "vm",
            Engine::Jail => "jail",
        })
    }
}

/// What a snapshot holds. Never silently one for the other: callers see which.
///
/// ```
/// use cube_supervisor::records::SnapshotKind;
/// assert_eq!(SnapshotKind::Filesystem.to_string(), "filesystem");
/// assert_eq!(SnapshotKind::Full.to_string(), "full");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotKind {
    /// The whole state: memory, CPU or process state, devices and the root filesystem.
    /// A rollback continues exactly where the snapshot was taken.
    #[default]
    Full,
    /// The sandbox's writable filesystem layer only. A rollback puts the files back
    /// and restarts the sandbox's processes (its agent included): running processes,
    /// interpreter contexts and their variables, /tmp and /dev/shm are lost.
    Filesystem,
}

impl std::fmt::Display for SnapshotKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            SnapshotKind::Full => "full",
            SnapshotKind::Filesystem => "filesystem",
        })
    }
}

/// A sandbox's record in the store.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SandboxMeta {
    /// Sandbox id.
    pub id: String,
    /// Its engine.
    pub engine: Engine,
    /// The template or snapshot it was created from.
    pub origin: String,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix: u64,
    /// Whether it dies with the connection that created it.
    pub ephemeral: bool,
    /// The caller's labels (`cube_core::CreateOptions::metadata`).
    #[serde(default)]
    pub metadata: std::collections::BTreeMap<String, String>,
    /// The built jail template whose tree lies under the sandbox's root (directly, or
    /// through the snapshot it was cloned from); such a template cannot be removed
    /// while the sandbox exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// The directory given as the jail's root tree (`cube_core::CreateOptions::rootfs`,
    /// a container's root filesystem) instead of a template's: its snapshots' files
    /// lie over that tree, which no template holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<std::path::PathBuf>,
}

/// A snapshot's record in the store.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SnapshotMeta {
    /// Snapshot id.
    pub id: String,
    /// The sandbox that owns it.
    pub sandbox: String,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix: u64,
    /// What writing it cost.
    pub stats: SnapshotStats,
    /// What it holds.
    #[serde(default)]
    pub kind: SnapshotKind,
    /// The engine of the sandbox it was taken from (clones run on the same one).
    #[serde(default)]
    pub engine: Engine,
    /// Why the snapshot holds files only where a full one was tried (a jail without a
    /// working CRIU, or a failed dump).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
    /// The template the snapshot's files lie over, where its sandbox's record cannot
    /// say (an imported snapshot, whose sandbox lived on another host). None: ask the
    /// sandbox's record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// The host boot during which the snapshot was written (see
    /// [`cube_storage::durable_marker`]): a jail snapshot from another boot is
    /// restored only with the durability marker that repeats it. None in records of
    /// builds that did not flush jail snapshots; such a jail snapshot is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// The directory the snapshot's files lie over where its sandbox's record cannot
    /// say (an imported snapshot of a sandbox created on a directory of its own,
    /// [`SandboxMeta::rootfs`]): a path on the host it was taken on, which a create
    /// from it replaces with a tree of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<std::path::PathBuf>,
}

/// A template's record in the store.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TemplateMeta {
    /// Template name.
    pub name: String,
    /// Engine it runs on.
    pub engine: Engine,
    /// The VM's shape.
    pub machine: MachineConfig,
    /// Bytes of the writable root filesystem image each sandbox gets (0: none).
    pub rootfs_bytes: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix: u64,
    /// A jail template's root filesystem tree: a directory name inside the template's
    /// directory (see [`TemplateMeta::tree_dir`]). None for VM templates and for the
    /// built-in host template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree: Option<String>,
    /// What the template was built from, for people (`debian bookworm +python3,...`,
    /// `directory /srv/tree`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub built_from: Option<String>,
    /// What a container image's config asks of the processes of the template's
    /// sandboxes (a VM's image holds it too, for its agent); None for templates not
    /// built from an image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessDefaults>,
}

/// A container image's defaults for its processes: its config's Env, WorkingDir and
/// User.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessDefaults {
    /// Environment variables, in order.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// The working directory, absolute inside the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// The user as the image names it (`name`, `uid`, `uid:gid`). A VM's processes
    /// run as it (resolved against the image's account files when the template is
    /// built) unless an exec names a user; a jail sandbox's processes all run as the
    /// sandbox's own host uid, so there it is kept for people only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

impl TemplateMeta {
    /// The jail template's tree inside `template_dir`, or None when the template has
    /// none. A record naming anything but a plain directory name is refused: it could
    /// point the sandbox's root outside the template.
    pub fn tree_dir(
        &self,
        template_dir: &std::path::Path,
    ) -> Result<Option<std::path::PathBuf>, String> {
        let Some(tree) = &self.tree else {
            return Ok(None);
        };
        let mut parts = std::path::Path::new(tree).components();
        match (parts.next(), parts.next()) {
            (Some(std::path::Component::Normal(name)), None) => Ok(Some(template_dir.join(name))),
            _ => Err(format!(
                "template {} names {tree:?} as its tree, which is not a directory name",
                self.name
            )),
        }
    }
}

/// Seconds since the Unix epoch.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
