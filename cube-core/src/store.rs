//! The store on disk: its root, its entries' layout, and the filesystem under it
//! (reflinks, and a loop-mounted XFS image where the host's filesystem cannot).

pub use cube_storage::{
    filesystem_name, prepare_xfs_loop_store, supports_reflink, LoopStore, LoopStoreError,
    SandboxDir, SnapshotDir, Store, StoreError, TemplateDir,
};
