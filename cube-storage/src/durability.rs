//! When a write must reach the disk.

/// Whether a write is flushed to stable storage before it returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// `fsync`/`fdatasync` before returning: the data survives a host crash.
    Synced,
    /// Left in the page cache: every process on this host sees it at once (renames
    /// stay atomic), but a host crash may lose it. The caller makes it durable later
    /// and records that it did.
    Deferred,
}
