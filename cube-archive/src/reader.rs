//! Reading an untrusted archive, checking as it goes.

use std::io::Read;

use sha2::{Digest, Sha256};

use crate::chunk_order::ChunkOrder;
use crate::format::{Codec, MAGIC, MAX_MANIFEST, TAG_CHUNK, TAG_END, VERSION};
use crate::manifest::{Manifest, ManifestError};

/// Why an archive was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Reading the source failed.
    #[error("Reading the archive")]
    Io(#[source] std::io::Error),
    /// The source ended early: the archive is truncated.
    #[error("The archive is truncated")]
    Truncated,
    /// The first bytes are not [`crate::format::MAGIC`].
    #[error("Not a Cube snapshot archive")]
    Magic,
    /// The archive is of a format version this build does not read.
    #[error("Archive format version {0} is not supported (this build reads {VERSION})")]
    Version(u32),
    /// The declared manifest length is larger than [`MAX_MANIFEST`].
    #[error("Manifest of {0} bytes is larger than allowed")]
    ManifestTooLarge(u32),
    /// The manifest is malformed or breaks a rule.
    #[error("Invalid manifest")]
    Manifest(#[from] ManifestError),
    /// A record starts with an unknown tag.
    #[error("Unknown record tag {0:#04x}")]
    Tag(u8),
    /// A chunk names no file entry, is empty or too long, runs past its file, comes
    /// before the previous chunk, or names an unknown codec.
    #[error("Chunk of entry {entry} at offset {offset} does not fit the manifest")]
    BadChunk {
        /// The entry index.
        entry: u32,
        /// The offset.
        offset: u64,
    },
    /// A chunk's bytes do not decompress to its declared length or do not match its
    /// checksum.
    #[error("Chunk of entry {entry} at offset {offset} is corrupt")]
    Corrupt {
        /// The entry index.
        entry: u32,
        /// The offset.
        offset: u64,
    },
    /// The end record's checksum does not match the archive's bytes, or its chunk count
    /// does not match the chunks read.
    #[error("The archive's checksum does not match its contents")]
    Checksum,
    /// Bytes follow the end record.
    #[error("Data follows the end of the archive")]
    TrailingData,
}

/// One checked chunk: bytes `offset..offset + data.len()` of file entry `entry`.
#[derive(Debug)]
pub struct Chunk<'a> {
    /// Index of the file entry in [`Manifest::entries`].
    pub entry: u32,
    /// Where the bytes go in the file.
    pub offset: u64,
    /// The raw bytes, checksum verified.
    pub data: &'a [u8],
}

/// Reads an archive: the manifest first ([`ArchiveReader::open`]), then the chunks in
/// order ([`ArchiveReader::next_chunk`]), each checked before it is returned. The
/// archive as a whole is proven intact only when `next_chunk` has returned `None`: the
/// end record's checksum covers every byte.
pub struct ArchiveReader<R: Read> {
    source: R,
    hash: Sha256,
    order: ChunkOrder,
    finished: bool,
    stored: Vec<u8>,
    raw: Vec<u8>,
    bytes_read: u64,
}

impl<R: Read> ArchiveReader<R> {
    /// Reads and checks the header and manifest.
    pub fn open(source: R) -> Result<(ArchiveReader<R>, Manifest), ReadError> {
        let mut reader = ArchiveReader {
            source,
            hash: Sha256::new(),
            order: ChunkOrder::new(&Manifest::default()),
            finished: false,
            stored: Vec::new(),
            raw: Vec::new(),
            bytes_read: 0,
        };
        let mut head = [0u8; 16];
        reader.take(&mut head)?;
        if &head[..8] != MAGIC {
            return Err(ReadError::Magic);
        }
        let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        if version != VERSION {
            return Err(ReadError::Version(version));
        }
        let len = u32::from_le_bytes([head[12], head[13], head[14], head[15]]);
        if len > MAX_MANIFEST {
            return Err(ReadError::ManifestTooLarge(len));
        }
        // Read in steps rather than allocating the declared length up front: a
        // truncated archive that declares a large manifest costs only what it holds.
        let mut json = Vec::new();
        (&mut reader.source)
            .take(u64::from(len))
            .read_to_end(&mut json)
            .map_err(ReadError::Io)?;
        if json.len() != len as usize {
            return Err(ReadError::Truncated);
        }
        reader.hash.update(&json);
        reader.bytes_read += u64::from(len);
        let manifest = Manifest::from_json(&json)?;
        reader.order = ChunkOrder::new(&manifest);
        Ok((reader, manifest))
    }

    /// Bytes consumed so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    fn take(&mut self, buf: &mut [u8]) -> Result<(), ReadError> {
        self.source.read_exact(buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                ReadError::Truncated
            } else {
                ReadError::Io(e)
            }
        })?;
        self.hash.update(&*buf);
        self.bytes_read += buf.len() as u64;
        Ok(())
    }

    /// The next chunk, checked; `None` once the end record has been read and the whole
    /// archive's checksum verified.
    pub fn next_chunk(&mut self) -> Result<Option<Chunk<'_>>, ReadError> {
        if self.finished {
            return Ok(None);
        }
        // The end record's checksum covers the bytes before it, the tag excluded.
        let before = self.hash.clone();
        let mut tag = [0u8; 1];
        self.take(&mut tag)?;
        match tag[0] {
            TAG_END => {
                let mut rest = [0u8; 40];
                self.take(&mut rest)?;
                let count =
                    u64::from_le_bytes(rest[..8].try_into().map_err(|_| ReadError::Checksum)?);
                let digest: [u8; 32] = before.finalize().into();
                if count != self.order.count || digest[..] != rest[8..] {
                    return Err(ReadError::Checksum);
                }
                let mut extra = [0u8; 1];
                match self.source.read(&mut extra) {
                    Ok(0) => {}
                    Ok(_) => return Err(ReadError::TrailingData),
                    Err(e) => return Err(ReadError::Io(e)),
                }
                self.finished = true;
                Ok(None)
            }
            TAG_CHUNK => self.chunk().map(Some),
            other => Err(ReadError::Tag(other)),
        }
    }

    fn chunk(&mut self) -> Result<Chunk<'_>, ReadError> {
        let mut head = [0u8; 4 + 8 + 4 + 4 + 1 + 32];
        self.take(&mut head)?;
        let entry = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        let mut offset_bytes = [0u8; 8];
        offset_bytes.copy_from_slice(&head[4..12]);
        let offset = u64::from_le_bytes(offset_bytes);
        let raw_len = u32::from_le_bytes([head[12], head[13], head[14], head[15]]);
        let stored_len = u32::from_le_bytes([head[16], head[17], head[18], head[19]]);
        let codec = Codec::from_wire(head[20]);
        let bad = ReadError::BadChunk { entry, offset };
        let stored_ok = match codec {
            Some(Codec::Raw) => stored_len == raw_len,
            Some(Codec::Lz4) => {
                stored_len > 0
                    && (stored_len as usize)
                        <= lz4_flex::block::get_maximum_output_size(raw_len as usize)
            }
            None => false,
        };
        if !stored_ok || !self.order.admit(entry, offset, raw_len) {
            return Err(bad);
        }
        let mut stored = std::mem::take(&mut self.stored);
        stored.resize(stored_len as usize, 0);
        let r = self.take(&mut stored);
        self.stored = stored;
        r?;
        let corrupt = ReadError::Corrupt { entry, offset };
        let data: &[u8] = match codec {
            Some(Codec::Lz4) => {
                self.raw.resize(raw_len as usize, 0);
                match lz4_flex::block::decompress_into(&self.stored, &mut self.raw) {
                    Ok(n) if n == raw_len as usize => &self.raw,
                    _ => return Err(corrupt),
                }
            }
            _ => &self.stored,
        };
        let digest: [u8; 32] = Sha256::digest(data).into();
        if digest[..] != head[21..] {
            return Err(corrupt);
        }
        Ok(Chunk {
            entry,
            offset,
            data,
        })
    }

    /// Reads every remaining chunk, checking each, through the end record.
    pub fn verify_rest(&mut self) -> Result<(), ReadError> {
        while self.next_chunk()?.is_some() {}
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::manifest::{Entry, EntryKind};
    use crate::writer::ArchiveWriter;

    fn sample() -> Vec<u8> {
        let manifest = Manifest {
            properties: BTreeMap::from([("id".into(), "snap-1".into())]),
            entries: vec![
                Entry {
                    path: "d".into(),
                    kind: EntryKind::Dir,
                    mode: 0o755,
                    uid: 0,
                    gid: 0,
                    mtime: 1,
                    mtime_nsec: 0,
                    xattrs: Vec::new(),
                },
                Entry {
                    path: "d/f".into(),
                    kind: EntryKind::File {
                        size: 3 << 20,
                        base: None,
                    },
                    mode: 0o644,
                    uid: 0,
                    gid: 0,
                    mtime: 1,
                    mtime_nsec: 0,
                    xattrs: Vec::new(),
                },
            ],
        };
        let mut w = ArchiveWriter::new(Vec::new(), &manifest).unwrap();
        w.chunk(1, 0, &vec![7u8; 64 << 10]).unwrap();
        let noise: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761u32) >> 24) as u8)
            .collect();
        w.chunk(1, 2 << 20, &noise).unwrap();
        w.finish().unwrap().0
    }

    fn read_all(bytes: &[u8]) -> Result<Vec<(u32, u64, usize)>, ReadError> {
        let (mut r, _) = ArchiveReader::open(bytes)?;
        let mut seen = Vec::new();
        while let Some(c) = r.next_chunk()? {
            seen.push((c.entry, c.offset, c.data.len()));
        }
        Ok(seen)
    }

    #[test]
    fn round_trip() {
        let bytes = sample();
        assert_eq!(
            read_all(&bytes).unwrap(),
            vec![(1, 0, 64 << 10), (1, 2 << 20, 4096)]
        );
        // The repeated 64 KiB were compressed.
        assert!(bytes.len() < 16 << 10, "{} bytes", bytes.len());
    }

    #[test]
    fn every_truncation_is_refused() {
        let bytes = sample();
        for cut in 0..bytes.len() {
            assert!(read_all(&bytes[..cut]).is_err(), "cut at {cut} accepted");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(matches!(read_all(&longer), Err(ReadError::TrailingData)));
    }

    #[test]
    fn every_flipped_byte_is_refused() {
        let bytes = sample();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(read_all(&bad).is_err(), "flip at {i} accepted");
        }
    }

    #[test]
    fn writer_refuses_chunks_out_of_order() {
        let mut w = ArchiveWriter::new(Vec::new(), &Manifest::default()).unwrap();
        assert!(w.chunk(0, 0, b"x").is_err());
        let bytes = w.finish().unwrap().0;
        assert_eq!(read_all(&bytes).unwrap(), vec![]);
    }
}
