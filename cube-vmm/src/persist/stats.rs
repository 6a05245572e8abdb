//! What writing a snapshot cost.

/// Statistics of one snapshot.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct SnapshotStats {
    /// Pages the guest or the VMM wrote since the parent image.
    pub dirty_pages: u64,
    /// Bytes written into the new memory file. A page the pre-copy of a running
    /// machine took and the guest wrote again before the stop counts twice.
    pub bytes_written: u64,
    /// Whether the parent memory file was reflinked (false: copied, or no parent).
    pub reflinked: bool,
    /// How long the sandbox was stopped for this snapshot, in microseconds: the vCPUs
    /// of a VM (the whole snapshot, today), the frozen processes of a jail. 0 where it
    /// was stopped already, and in records written before this was measured.
    #[serde(default)]
    pub paused_us: u64,
}
