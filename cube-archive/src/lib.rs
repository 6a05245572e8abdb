//! Cube's portable snapshot archive: one file that carries a snapshot (or any directory
//! tree) from one host's store to another's.
//!
//! # Format (version 1)
//!
//! ```text
//! "CUBESNAP"  u32 version  u32 manifest length  manifest (JSON, see [`Manifest`])
//! chunk*      'C' u32 entry  u64 offset  u32 raw length  u32 stored length  u8 codec
//!             [32] SHA-256 of the raw bytes  stored bytes
//! end         'E' u64 chunk count  [32] SHA-256 of every byte before this record
//! ```
//!
//! All integers are little-endian. The manifest lists every entry of the tree (path,
//! kind, mode, owner, times, the extended attributes overlayfs needs); the chunks carry
//! the regular files' bytes, at most [`MAX_CHUNK`] each, LZ4-compressed where that is
//! smaller. A file is sparse: ranges no chunk covers are holes (or, for a file that
//! names a *base*, the base file's bytes: how a snapshot travels as its difference
//! against a template both hosts hold).
//!
//! # Trust
//!
//! Everything read is untrusted. [`ArchiveReader`] refuses, before allocating by any
//! declared length, a bad magic or version, an oversized manifest or chunk, a path that
//! is absolute, has `..` or sits under anything but a directory entry, chunks out of
//! order, overlapping or past their file's end, a chunk whose bytes do not hash to what
//! it declares, and an archive whose end record is missing, has the wrong checksum or is
//! followed by anything. [`unpack`] writes into a directory of its own making and
//! removes it again unless every byte checked out, so a caller that moves the result
//! into place only afterwards never trusts an unchecked byte.

mod chunk_order;
pub mod format;
pub mod manifest;
pub mod pack;
pub mod reader;
pub mod unpack;
pub mod writer;

pub use format::{Codec, MAGIC, MAX_CHUNK, MAX_MANIFEST, VERSION};
pub use manifest::{Entry, EntryKind, Manifest, ManifestError, Xattr, SANDBOX_DEVICES};
pub use pack::{pack, PackError, PackOptions, PackStats};
pub use reader::{ArchiveReader, Chunk, ReadError};
pub use unpack::{unpack, UnpackError, UnpackStats};
pub use writer::{ArchiveWriter, WriteError};
