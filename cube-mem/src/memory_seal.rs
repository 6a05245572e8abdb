//! The seal that binds a memory file to the snapshot state written with it.
//!
//! Guest memory is too large to checksum on every snapshot and restore (a restore maps
//! the file and reads nothing up front). What can be checked cheaply is that the file
//! is the one written with the state beside it: each snapshot draws a random
//! [`Seal`], stores it in its state, and [`write_full`](crate::write_full) and
//! [`write_diff`](crate::write_diff) write it into one page after guest memory. A
//! restore reads that page ([`Seal::check`]) before it maps anything, so a memory file
//! of another snapshot (of the same sandbox: same size, same layout) is refused
//! instead of restored as this one.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Bytes the seal adds after guest memory: one page, so that the file stays a whole
/// number of pages (guest_memory.rs checks that this is its page size).
pub const SEAL_BYTES: u64 = 4096;
/// What the seal page starts with.
const MAGIC: &[u8; 16] = b"cube-memory-seal";

/// Why a memory file's seal is not the expected one.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// The kernel gave no random bytes.
    #[error("Drawing a memory seal failed")]
    Random(#[source] std::io::Error),
    /// The memory file cannot be read.
    #[error("Memory file {} is unreadable", path.display())]
    Read {
        /// The memory file.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// The memory file has the wrong size for a sealed file of this guest.
    #[error("Memory file {} is {found} bytes, expected {expected}", path.display())]
    Size {
        /// The memory file.
        path: PathBuf,
        /// Its size on disk.
        found: u64,
        /// Guest memory and the seal page.
        expected: u64,
    },
    /// The page after guest memory is no seal.
    #[error("Memory file {} has no seal after guest memory (damaged)", path.display())]
    Missing {
        /// The memory file.
        path: PathBuf,
    },
    /// The file is sealed, but for another snapshot.
    #[error("Memory file {} belongs to another snapshot (its seal is not the state's)", path.display())]
    Mismatch {
        /// The memory file.
        path: PathBuf,
    },
}

/// A snapshot's random seal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seal(pub [u8; 16]);

impl Seal {
    /// A fresh seal from the kernel's CSPRNG.
    pub fn random() -> Result<Seal, SealError> {
        let mut bytes = [0u8; 16];
        cube_storage::fill_random(&mut bytes).map_err(SealError::Random)?;
        Ok(Seal(bytes))
    }

    /// The seal page.
    fn page(&self) -> Vec<u8> {
        let mut page = vec![0u8; SEAL_BYTES as usize];
        page[..MAGIC.len()].copy_from_slice(MAGIC);
        page[MAGIC.len()..MAGIC.len() + self.0.len()].copy_from_slice(&self.0);
        page
    }

    /// Writes the seal page into `file` after `memory_bytes` of guest memory.
    pub(crate) fn write(&self, file: &File, memory_bytes: u64) -> std::io::Result<()> {
        file.write_all_at(&self.page(), memory_bytes)
    }

    /// Checks that the memory file `path`, of a guest of `memory_bytes`, carries this
    /// seal: the file is the one written with the state that holds it.
    pub fn check(&self, path: &Path, memory_bytes: u64) -> Result<(), SealError> {
        let read = |source| SealError::Read {
            path: path.to_path_buf(),
            source,
        };
        // No link followed, as for the mapping (see `guest_memory::open_memory_file`).
        let file = cube_storage::no_follow::open_file(path).map_err(read)?;
        let found = file.metadata().map_err(read)?.len();
        let expected = memory_bytes.saturating_add(SEAL_BYTES);
        if found != expected {
            return Err(SealError::Size {
                path: path.to_path_buf(),
                found,
                expected,
            });
        }
        let mut head = [0u8; MAGIC.len() + 16];
        file.read_exact_at(&mut head, memory_bytes).map_err(read)?;
        if &head[..MAGIC.len()] != MAGIC {
            return Err(SealError::Missing {
                path: path.to_path_buf(),
            });
        }
        if head[MAGIC.len()..] != self.0 {
            return Err(SealError::Mismatch {
                path: path.to_path_buf(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_passes_only_with_its_own_seal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory.bin");
        let memory = 3 * SEAL_BYTES;
        let file = File::create(&path).unwrap();
        file.set_len(memory).unwrap();
        let (a, b) = (Seal::random().unwrap(), Seal::random().unwrap());
        assert_ne!(a, b);
        // Unsealed (a file of guest memory only): the size says so.
        assert!(matches!(
            a.check(&path, memory),
            Err(SealError::Size { .. })
        ));
        a.write(&file, memory).unwrap();
        a.check(&path, memory).unwrap();
        let err = b.check(&path, memory).unwrap_err();
        assert!(err.to_string().contains("another snapshot"), "{err}");
        // The right size, but no seal in the last page.
        file.write_all_at(&[0u8; 16], memory).unwrap();
        assert!(matches!(
            a.check(&path, memory),
            Err(SealError::Missing { .. })
        ));
        assert!(matches!(
            a.check(&dir.path().join("absent"), memory),
            Err(SealError::Read { .. })
        ));
    }
}
