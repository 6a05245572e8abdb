//! What writing a snapshot cost.

/// Statistics of one snapshot.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct SnapshotStats {
    /// Pages the guest or the VMM wrote since the parent image.
    pub dirty_pages: u64,
    /// Bytes written into the new memory file.
    pub bytes_written: u64,
    /// Whether the parent memory file was reflinked (false: copied, or no parent).
    pub reflinked: bool,
}
