//! The wire format's fixed numbers: the magic, the version, the size limits, the
//! record tags, and how a chunk's bytes are stored (see the crate's documentation for
//! the layout).

/// The first bytes of every archive.
pub const MAGIC: &[u8; 8] = b"CUBESNAP";
/// The format version this crate writes and reads.
pub const VERSION: u32 = 1;
/// The most raw bytes one chunk holds.
pub const MAX_CHUNK: u32 = 1 << 20;
/// The largest manifest accepted, bytes.
pub const MAX_MANIFEST: u32 = 64 << 20;
/// Tag of a chunk record.
pub(crate) const TAG_CHUNK: u8 = b'C';
/// Tag of the end record.
pub(crate) const TAG_END: u8 = b'E';

/// How a chunk's bytes are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Codec {
    /// As they are.
    Raw = 0,
    /// An LZ4 block.
    Lz4 = 1,
}

impl Codec {
    pub(crate) fn from_wire(v: u8) -> Option<Codec> {
        match v {
            0 => Some(Codec::Raw),
            1 => Some(Codec::Lz4),
            _ => None,
        }
    }
}
