//! What the store records about sandboxes, snapshots and templates.

use serde::{Deserialize, Serialize};

use crate::snapshot::MachineConfig;
use crate::vmm::machine::SnapshotStats;

/// File holding a sandbox's [`SandboxMeta`].
pub const SANDBOX_META: &str = "sandbox.meta";
/// Envelope kind of [`SANDBOX_META`].
pub const SANDBOX_META_KIND: &str = "sandbox";
/// File holding a snapshot's [`SnapshotMeta`].
pub const SNAPSHOT_META: &str = "snapshot.meta";
/// Envelope kind of [`SNAPSHOT_META`].
pub const SNAPSHOT_META_KIND: &str = "snapshot";
/// File holding a template's [`TemplateMeta`].
pub const TEMPLATE_META: &str = "template.meta";
/// Envelope kind of [`TEMPLATE_META`].
pub const TEMPLATE_META_KIND: &str = "template";

/// The isolation engine behind a sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// A KVM microVM.
    Vm,
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad` so that width and alignment flags apply in tables.
        f.pad(match self {
            Engine::Vm => "vm",
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
}

/// Seconds since the Unix epoch.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
