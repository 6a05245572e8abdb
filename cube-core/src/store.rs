//! The store on disk: its root, its entries' layout, and the filesystem under it
//! (reflinks, and a loop-mounted XFS image where the host's filesystem cannot).

pub use cube_storage::project_quota;
pub use cube_storage::{
    filesystem_name, prepare_xfs_loop_store, supports_reflink, LoopStore, LoopStoreError,
    SandboxDir, SnapshotDir, Store, StoreError, TemplateDir,
};

/// Whether the snapshot (or hibernation image) in `dir` was flushed to disk in this
/// boot: its background flush has finished and written its durability marker.
pub fn flushed_in_this_boot(dir: &std::path::Path) -> bool {
    cube_storage::durable_marker::boot_id()
        .is_ok_and(|boot| cube_storage::durable_marker::marked_durable(dir, &boot))
}
