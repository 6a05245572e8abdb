//! Copy-on-write storage for Cube sandboxes.
//!
//! - [`reflink`]: clone files and directory trees with `FICLONE`, falling back to a
//!   hole-preserving copy on filesystems that cannot share extents.
//! - [`metadata`]: small state files in a checksummed envelope, replaced atomically.
//! - [`store`]: the on-disk layout of templates, snapshots and sandboxes, with
//!   staging directories that appear in place atomically or not at all.
//! - [`layout`]: every file and directory name inside a sandbox, snapshot and
//!   template directory ([`SandboxDir`], [`SnapshotDir`], [`TemplateDir`]).
//! - [`durable_marker`]: the boot-id marker that says a snapshot written to the page
//!   cache reached the disk, and the check that refuses one from an earlier boot
//!   without it.
//! - [`lent_snapshot`]: a snapshot lent to a confined VM supervisor for a rollback,
//!   as read-only links in its sandbox's directory.
//! - [`no_follow`]: reaching an entry of a directory a sandbox's side owns (a
//!   socket, a link) without following a symbolic link it put there.
//! - [`loop_store`]: a reflink-capable XFS filesystem on a loop device, for hosts
//!   whose root filesystem (ext4) cannot reflink.
//! - [`project_quota`]: XFS project quotas, the disk limits of directories.
//! - [`tree_manifest`]: what a jail snapshot's trees held, and the check before a
//!   restore that they still hold it.
//!
//! This crate knows nothing about KVM or engines: it moves bytes and directories
//! safely and cheaply, and names the files the engines keep in them.

pub mod durability;
pub mod durable_marker;
pub mod layout;
pub mod lent_snapshot;
pub mod loop_store;
pub mod metadata;
pub mod no_follow;
pub mod project_quota;
pub mod reflink;
pub mod store;
pub mod supervisor_group;
pub mod tree_manifest;
pub mod writeback;

mod random_id;
mod removal_guard;

pub use durability::Durability;
pub use durable_marker::DurabilityError;
pub use layout::{SandboxDir, SnapshotDir, TemplateDir};
pub use loop_store::{is_mountpoint, prepare_xfs_loop_store, LoopStore, LoopStoreError};
pub use metadata::{
    decode_envelope, encode_envelope, read_verified, read_verified_bytes,
    read_verified_bytes_no_follow, write_atomic, write_atomic_bytes, write_atomic_bytes_with,
    MetadataError,
};
pub use random_id::fill_random;
pub use reflink::{
    clone_file, clone_open, clone_tree, clone_tree_into, clone_tree_with, filesystem_name,
    supports_reflink, CloneError, CloneMethod, TreeCloneStats, TreeOptions,
};
pub use store::{
    is_valid_name, remove_dead_scratch, scratch_entry_name, StagingDir, Store, StoreAreas,
    StoreError,
};
