//! Writing an archive: header and manifest, chunks, end record.

use std::io::Write;

use sha2::{Digest, Sha256};

use crate::chunk_order::ChunkOrder;
use crate::format::{Codec, MAGIC, MAX_MANIFEST, TAG_CHUNK, TAG_END, VERSION};
use crate::manifest::{Manifest, ManifestError};

/// Why an archive could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// Writing to the destination failed.
    #[error("Writing the archive")]
    Io(#[from] std::io::Error),
    /// The manifest breaks a rule of the format.
    #[error("Invalid manifest")]
    Manifest(#[from] ManifestError),
    /// The manifest is larger than [`MAX_MANIFEST`].
    #[error("Manifest of {0} bytes is larger than allowed")]
    ManifestTooLarge(usize),
    /// A chunk names no file entry, is empty or too long, runs past its file, or comes
    /// before the previous chunk.
    #[error("Chunk of entry {entry} at offset {offset} does not fit the manifest")]
    BadChunk {
        /// The entry index.
        entry: u32,
        /// The offset.
        offset: u64,
    },
}

/// Writes one archive: [`ArchiveWriter::new`] writes the header and manifest,
/// [`ArchiveWriter::chunk`] each file range, [`ArchiveWriter::finish`] the end record.
pub struct ArchiveWriter<W: Write> {
    out: W,
    hash: Sha256,
    order: ChunkOrder,
    written: u64,
    scratch: Vec<u8>,
}

impl<W: Write> ArchiveWriter<W> {
    /// Checks `manifest` and writes the header.
    pub fn new(out: W, manifest: &Manifest) -> Result<ArchiveWriter<W>, WriteError> {
        manifest.validate()?;
        let json = serde_json::to_vec(manifest).map_err(ManifestError::Json)?;
        let len = u32::try_from(json.len())
            .ok()
            .filter(|l| *l <= MAX_MANIFEST)
            .ok_or(WriteError::ManifestTooLarge(json.len()))?;
        let mut writer = ArchiveWriter {
            out,
            hash: Sha256::new(),
            order: ChunkOrder::new(manifest),
            written: 0,
            scratch: Vec::new(),
        };
        writer.put(MAGIC)?;
        writer.put(&VERSION.to_le_bytes())?;
        writer.put(&len.to_le_bytes())?;
        writer.put(&json)?;
        Ok(writer)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), WriteError> {
        self.out.write_all(bytes)?;
        self.hash.update(bytes);
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Writes `data` as bytes `offset..` of file entry `entry`. Chunks come in order:
    /// by entry, then by offset, none overlapping; at most [`MAX_CHUNK`] bytes each.
    pub fn chunk(&mut self, entry: u32, offset: u64, data: &[u8]) -> Result<(), WriteError> {
        let raw_len = u32::try_from(data.len()).unwrap_or(u32::MAX);
        if !self.order.admit(entry, offset, raw_len) {
            return Err(WriteError::BadChunk { entry, offset });
        }
        let digest: [u8; 32] = Sha256::digest(data).into();
        self.scratch.clear();
        self.scratch
            .resize(lz4_flex::block::get_maximum_output_size(data.len()), 0);
        let compressed = lz4_flex::block::compress_into(data, &mut self.scratch)
            .ok()
            .filter(|n| *n < data.len());
        let (codec, stored_len) = match compressed {
            Some(n) => (Codec::Lz4, n),
            None => (Codec::Raw, data.len()),
        };
        let mut head = Vec::with_capacity(1 + 4 + 8 + 4 + 4 + 1 + 32);
        head.push(TAG_CHUNK);
        head.extend_from_slice(&entry.to_le_bytes());
        head.extend_from_slice(&offset.to_le_bytes());
        head.extend_from_slice(&raw_len.to_le_bytes());
        head.extend_from_slice(&(stored_len as u32).to_le_bytes());
        head.push(codec as u8);
        head.extend_from_slice(&digest);
        self.put(&head)?;
        match codec {
            Codec::Lz4 => {
                let body = std::mem::take(&mut self.scratch);
                let r = self.put(&body[..stored_len]);
                self.scratch = body;
                r?;
            }
            Codec::Raw => self.put(data)?,
        }
        Ok(())
    }

    /// Writes the end record and returns the destination and the archive's length.
    pub fn finish(mut self) -> Result<(W, u64), WriteError> {
        let mut end = Vec::with_capacity(1 + 8 + 32);
        end.push(TAG_END);
        end.extend_from_slice(&self.order.count.to_le_bytes());
        let digest: [u8; 32] = self.hash.clone().finalize().into();
        end.extend_from_slice(&digest);
        self.out.write_all(&end)?;
        self.out.flush()?;
        Ok((self.out, self.written + end.len() as u64))
    }
}
