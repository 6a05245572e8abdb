//! The rule both sides of the format keep: a chunk belongs to a file entry, is 1 to
//! [`MAX_CHUNK`] bytes, ends inside its file, and starts after the previous chunk.

use crate::format::MAX_CHUNK;
use crate::manifest::{EntryKind, Manifest};

/// Admits chunks in archive order.
pub(crate) struct ChunkOrder {
    /// Each entry's file size; None for entries that are not files.
    sizes: Vec<Option<u64>>,
    /// (entry, end) of the last chunk admitted.
    last: Option<(u32, u64)>,
    /// Chunks admitted.
    pub(crate) count: u64,
}

impl ChunkOrder {
    pub(crate) fn new(manifest: &Manifest) -> ChunkOrder {
        ChunkOrder {
            sizes: manifest
                .entries
                .iter()
                .map(|e| match e.kind {
                    EntryKind::File { size, .. } => Some(size),
                    _ => None,
                })
                .collect(),
            last: None,
            count: 0,
        }
    }

    /// Whether a chunk of `len` bytes at `offset` of entry `entry` may come next; if
    /// so, it is counted.
    pub(crate) fn admit(&mut self, entry: u32, offset: u64, len: u32) -> bool {
        let Some(size) = self.sizes.get(entry as usize).copied().flatten() else {
            return false;
        };
        let end = match offset.checked_add(u64::from(len)) {
            Some(end) if len > 0 && len <= MAX_CHUNK && end <= size => end,
            _ => return false,
        };
        if let Some((last_entry, last_end)) = self.last {
            if entry < last_entry || (entry == last_entry && offset < last_end) {
                return false;
            }
        }
        self.last = Some((entry, end));
        self.count += 1;
        true
    }
}
