//! Copy-on-write storage for Cube sandboxes.
//!
//! - [`reflink`]: clone files and directory trees with `FICLONE`, falling back to a
//!   hole-preserving copy on filesystems that cannot share extents.
//! - [`metadata`]: small state files in a checksummed envelope, replaced atomically.
//! - [`store`]: the on-disk layout of templates, snapshots and sandboxes, with
//!   staging directories that appear in place atomically or not at all.
//! - [`loop_store`]: a reflink-capable XFS filesystem on a loop device, for hosts
//!   whose root filesystem (ext4) cannot reflink.
//! - [`project_quota`]: XFS project quotas, the disk limits of directories.
//!
//! This crate knows nothing about KVM or sandboxes' contents: it moves bytes and
//! directories safely and cheaply.

pub mod durability;
pub mod loop_store;
pub mod metadata;
pub mod project_quota;
pub mod reflink;
pub mod store;

mod random_id;
mod removal_guard;

pub use durability::Durability;
pub use loop_store::{is_mountpoint, prepare_xfs_loop_store, LoopStore, LoopStoreError};
pub use metadata::{
    decode_envelope, encode_envelope, read_verified, read_verified_bytes, write_atomic,
    write_atomic_bytes, write_atomic_bytes_with, MetadataError,
};
pub use reflink::{
    clone_file, clone_tree, filesystem_name, supports_reflink, CloneError, CloneMethod,
    TreeCloneStats,
};
pub use store::{
    is_valid_name, remove_dead_scratch, scratch_entry_name, StagingDir, Store, StoreError,
};
