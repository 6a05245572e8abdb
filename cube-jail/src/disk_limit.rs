//! A sandbox directory's disk limit: an XFS project quota (see
//! `cube_storage::project_quota`) on a project id leased for the sandbox.
//!
//! Project ids come from the same lease pool as sandbox uids ([`UidLease`]): unique
//! among live sandboxes, free again when the holder goes. A number whose project still
//! holds files (a hibernated layer, a stale sandbox directory) is passed over, so a new
//! sandbox never starts with another one's usage counted against it.

use std::path::{Path, PathBuf};

use cube_storage::project_quota::{self, ProjectQuotaError};

use crate::sandbox_uid::{SandboxUidError, UidLease};

/// How many leased numbers are tried for one with no files charged to it.
const ATTEMPTS: usize = 16;

/// Errors of a sandbox's disk limit.
#[derive(Debug, thiserror::Error)]
pub enum DiskLimitError {
    /// The sandbox directory's filesystem enforces no project quotas.
    #[error("disk limits need a store with project quotas (XFS mounted with prjquota; see `cube store setup`): {0}")]
    Unsupported(PathBuf),
    /// No project id could be leased.
    #[error(transparent)]
    Lease(#[from] SandboxUidError),
    /// Every project id tried still had files charged to it.
    #[error("no unused disk project after {ATTEMPTS} tries")]
    Exhausted,
    /// Reading or setting the quota failed.
    #[error(transparent)]
    Quota(#[from] ProjectQuotaError),
}

/// A project id leased for one sandbox directory, with its limit set; the limit is
/// lifted when it is dropped (after the directory went).
#[derive(Debug)]
pub struct DiskLimit {
    lease: UidLease,
    /// A directory of the filesystem that outlives the sandbox's (its parent).
    filesystem: PathBuf,
    /// The limit [`DiskLimit::apply`] sets.
    bytes: u64,
}

impl DiskLimit {
    /// Leases a project id with nothing charged to it, for the sandbox directory
    /// `state_dir` (whose parent must exist), to be limited to `bytes` once tagged.
    pub fn lease(state_dir: &Path, bytes: u64) -> Result<DiskLimit, DiskLimitError> {
        let parent = state_dir
            .parent()
            .filter(|p| project_quota::enforced(p))
            .ok_or_else(|| DiskLimitError::Unsupported(state_dir.to_path_buf()))?;
        for _ in 0..ATTEMPTS {
            let lease = UidLease::acquire()?;
            if project_quota::usage(parent, lease.uid())?.files == 0 {
                return Ok(DiskLimit {
                    lease,
                    filesystem: parent.to_path_buf(),
                    bytes,
                });
            }
        }
        Err(DiskLimitError::Exhausted)
    }

    /// Sets the limit it was leased for (the directory must be tagged by now).
    pub fn apply(&self) -> Result<(), DiskLimitError> {
        self.set(self.bytes)
    }

    /// The project id to tag the sandbox directory with.
    pub fn project(&self) -> u32 {
        self.lease.uid()
    }

    /// Sets the limit to `bytes` (the directory must be tagged).
    pub fn set(&self, bytes: u64) -> Result<(), DiskLimitError> {
        Ok(project_quota::set_limit(
            &self.filesystem,
            self.project(),
            bytes,
        )?)
    }

    /// Bytes the sandbox directory holds now.
    pub fn used_bytes(&self) -> Result<u64, DiskLimitError> {
        Ok(project_quota::usage(&self.filesystem, self.project())?.bytes)
    }
}

impl Drop for DiskLimit {
    fn drop(&mut self) {
        if let Err(e) = project_quota::set_limit(&self.filesystem, self.project(), 0) {
            tracing::warn!(project = self.project(), error = %e, "leaving a disk limit set");
        }
    }
}
