//! Memory files: guest RAM on disk, regions at consecutive offsets (the layout of
//! [`GuestMemory::restore_private`](crate::GuestMemory::restore_private)).
//!
//! - [`write_full`] writes a complete file, leaving never-written pages of fresh memory
//!   as holes.
//! - [`write_diff`] clones the parent memory file (a reflink where the filesystem can)
//!   and writes only the dirty pages over it: the result is a complete, independent
//!   memory file that shares unchanged blocks with its parent.
//!
//! - [`prepare_diff`] is its first half (the clone), which needs no stopped guest; its
//!   [`PreparedDiff::live`] then lets the guest run on while the dirty pages are
//!   copied ([`LiveDiff::finish`], through [`crate::live_copy`]).
//!
//! Each file ends with the snapshot's seal (see [`crate::memory_seal`]), one page after
//! guest memory.
//!
//! Otherwise they read guest memory while writing it out: stop the vCPUs (and device
//! emulation) first, or the file is a blend of before and after.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use cube_storage::{clone_open, CloneError, CloneMethod, Durability};
use nix::unistd::{lseek, Whence};

use crate::dirty::DirtyBitmap;
use crate::guest_memory::{GuestMemory, PAGE_SIZE};
use crate::live_copy::{LiveCopy, LiveCopyError};
use crate::memory_seal::{Seal, SEAL_BYTES};
use crate::pwrite::pwrite_all;

/// Errors from writing memory files.
#[derive(Debug, thiserror::Error)]
pub enum MemoryFileError {
    /// Copying pages while the guest runs on failed.
    #[error("Live copy")]
    Live(#[from] LiveCopyError),
    /// The dirty bitmap was made for a different memory layout.
    #[error("Dirty bitmap does not match the guest memory layout")]
    DirtyShape,
    /// The destination could not be created (it must not exist).
    #[error("Failed to create memory file {}", path.display())]
    Create {
        /// The destination.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// Sizing the destination failed.
    #[error("Failed to size memory file {}", path.display())]
    SetLen {
        /// The destination.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// Finding the data extents of the memfd failed.
    #[error("Failed to find the written extents of guest memory")]
    SeekData(#[source] nix::Error),
    /// Writing pages failed.
    #[error("Failed to write {len} bytes at offset {offset:#x} of {}", path.display())]
    Write {
        /// The destination.
        path: PathBuf,
        /// File offset of the write.
        offset: u64,
        /// Bytes in the write.
        len: usize,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// `fdatasync` failed.
    #[error("Failed to sync memory file {}", path.display())]
    Sync {
        /// The destination.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// Cloning the parent memory file failed.
    #[error("Failed to clone parent memory file {} to {}", parent.display(), dest.display())]
    Clone {
        /// The parent memory file.
        parent: PathBuf,
        /// The destination.
        dest: PathBuf,
        /// What cube-storage said.
        #[source]
        source: CloneError,
    },
    /// The parent memory file's size differs from the guest memory size.
    #[error("Parent memory file {} is {actual} bytes, guest memory is {expected}", path.display())]
    ParentSize {
        /// The parent memory file.
        path: PathBuf,
        /// Guest memory size.
        expected: u64,
        /// Size of the parent.
        actual: u64,
    },
    /// Writing the seal page failed.
    #[error("Failed to seal memory file {}", path.display())]
    Seal {
        /// The destination.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// The clone of the parent could not be opened for writing.
    #[error("Failed to open memory file {} for writing", path.display())]
    OpenClone {
        /// The destination.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
}

/// What [`write_full`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WriteStats {
    /// Pages written (the rest are holes).
    pub pages_written: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Contiguous ranges written, one `pwrite` (or more for huge ranges) each.
    pub runs: u64,
}

/// What [`write_diff`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiffStats {
    /// Dirty pages written over the clone.
    pub pages_written: u64,
    /// Bytes written over the clone.
    pub bytes_written: u64,
    /// Contiguous dirty ranges written.
    pub runs: u64,
    /// How the parent was copied.
    pub clone_method: CloneMethod,
}

/// A contiguous byte range of one region.
#[derive(Debug, Clone, Copy)]
struct Extent {
    region: usize,
    offset: usize,
    len: usize,
}

/// Removes a file on drop unless disarmed, so a failed write leaves nothing behind.
struct RemoveOnError<'a> {
    path: &'a Path,
    armed: bool,
}

impl<'a> RemoveOnError<'a> {
    fn new(path: &'a Path) -> Self {
        Self { path, armed: true }
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for RemoveOnError<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = std::fs::remove_file(self.path) {
                tracing::warn!(path = %self.path.display(), error = %e, "failed to remove partial memory file");
            }
        }
    }
}

/// Writes all of `mem` to a new memory file `dest` (which must not exist) with `seal`
/// after it, then `fdatasync`s it when `durability` asks. The file is
/// [`GuestMemory::total_size`] bytes and the seal page ([`SEAL_BYTES`]).
///
/// For fresh memory ([`GuestMemory::anonymous`]) only written pages are copied and the
/// rest left as holes: the pages in `dirty` when given (it must cover every write since
/// the memory was created), otherwise the memfd's data extents. For restored memory
/// every page is copied and `dirty` is ignored; use [`write_diff`] to write only the
/// changes against the file it was restored from. On error `dest` is removed.
pub fn write_full(
    dest: &Path,
    mem: &GuestMemory,
    dirty: Option<&DirtyBitmap>,
    seal: &Seal,
    durability: Durability,
) -> Result<WriteStats, MemoryFileError> {
    if let Some(dirty) = dirty {
        check_shape(mem, dirty)?;
    }
    let extents = if !mem.is_zero_based() {
        if dirty.is_some() {
            tracing::debug!("memory is restored from a file: writing every page");
        }
        whole_regions(mem)
    } else if let Some(dirty) = dirty {
        dirty_extents(dirty)
    } else {
        memfd_data_extents(mem)?
    };

    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dest)
        .map_err(|source| MemoryFileError::Create {
            path: dest.to_path_buf(),
            source,
        })?;
    let guard = RemoveOnError::new(dest);
    file.set_len(mem.total_size() + SEAL_BYTES)
        .map_err(|source| MemoryFileError::SetLen {
            path: dest.to_path_buf(),
            source,
        })?;
    let stats = write_extents(&file, dest, mem, &extents)?;
    write_seal(&file, dest, mem, seal)?;
    if durability == Durability::Synced {
        sync(&file, dest)?;
    }
    guard.disarm();
    Ok(stats)
}

/// Writes a new memory file `dest` (which must not exist) as a clone of `parent` (a
/// reflink where the filesystem can, else a sparse copy) with the `dirty` pages of
/// `mem` and `seal` written over it, then `fdatasync`s it when `durability` asks.
/// `dirty` must hold every page that differs from `parent`; `parent` is sealed or (as
/// older builds wrote it) guest memory alone. The parent is never modified. On error
/// `dest` is removed.
pub fn write_diff(
    parent: &Path,
    dest: &Path,
    mem: &GuestMemory,
    dirty: &DirtyBitmap,
    seal: &Seal,
    durability: Durability,
) -> Result<DiffStats, MemoryFileError> {
    check_shape(mem, dirty)?;
    let parent_file = File::open(parent).map_err(|source| MemoryFileError::Clone {
        parent: parent.to_path_buf(),
        dest: dest.to_path_buf(),
        source: CloneError::OpenSource {
            path: parent.to_path_buf(),
            source,
        },
    })?;
    prepare_diff(&parent_file, parent, dest, mem)?.write(mem, dirty, seal, durability)
}

/// Clones the memory file `parent_file` (named `parent`) into the new memory file
/// `dest` (which must not exist) for a diff of `mem`'s pages over it: the half of
/// [`write_diff`] that needs no stopped guest. The parent comes open: a confined VM
/// supervisor may not open it where it lies. Until the diff is written, dropping the
/// result removes `dest`.
pub fn prepare_diff(
    parent_file: &File,
    parent: &Path,
    dest: &Path,
    mem: &GuestMemory,
) -> Result<PreparedDiff, MemoryFileError> {
    let start = std::time::Instant::now();
    let clone_method =
        clone_open(parent_file, parent, dest).map_err(|source| MemoryFileError::Clone {
            parent: parent.to_path_buf(),
            dest: dest.to_path_buf(),
            source,
        })?;
    let guard = RemoveOnError::new(dest);
    let file = OpenOptions::new()
        .write(true)
        .open(dest)
        .map_err(|source| MemoryFileError::OpenClone {
            path: dest.to_path_buf(),
            source,
        })?;
    let actual = file
        .metadata()
        .map_err(|source| MemoryFileError::OpenClone {
            path: dest.to_path_buf(),
            source,
        })?
        .len();
    if actual != mem.total_size() && actual != mem.total_size() + SEAL_BYTES {
        return Err(MemoryFileError::ParentSize {
            path: parent.to_path_buf(),
            expected: mem.total_size(),
            actual,
        });
    }
    guard.disarm();
    tracing::debug!(cloned = ?start.elapsed(), "prepare_diff");
    // From here the PreparedDiff removes the clone unless it is finished.
    Ok(PreparedDiff {
        file: Some(file),
        dest: dest.to_path_buf(),
        clone_method,
    })
}

/// A memory file cloned from its parent, waiting for the pages that differ (see
/// [`prepare_diff`]). Dropped unfinished, it removes the file.
#[derive(Debug)]
pub struct PreparedDiff {
    /// None once finished.
    file: Option<File>,
    dest: PathBuf,
    clone_method: CloneMethod,
}

impl PreparedDiff {
    /// Writes the `dirty` pages of `mem` over the clone: the guest must be stopped (or
    /// not write those pages) meanwhile.
    pub fn write(
        mut self,
        mem: &GuestMemory,
        dirty: &DirtyBitmap,
        seal: &Seal,
        durability: Durability,
    ) -> Result<DiffStats, MemoryFileError> {
        // The last round of a pre-copy, or the only one.
        let stats = self.precopy(mem, dirty)?;
        self.seal_and_keep(mem, seal, durability, stats)
    }

    /// Copies the `dirty` pages of `mem` over the clone while the guest may still be
    /// writing them: a pre-copy round. A page the guest writes during or after it is
    /// in a later dirty set, and must be written again before the diff is finished
    /// (with [`PreparedDiff::write`]).
    pub fn precopy(
        &mut self,
        mem: &GuestMemory,
        dirty: &DirtyBitmap,
    ) -> Result<WriteStats, MemoryFileError> {
        check_shape(mem, dirty)?;
        let file = self.file.as_ref().ok_or(MemoryFileError::DirtyShape)?;
        write_extents(file, &self.dest, mem, &dirty_extents(dirty))
    }

    /// Seals the file once its pages are written (over the parent's seal, or after an
    /// unsealed parent's last page), syncs it where asked, and keeps it.
    fn seal_and_keep(
        &mut self,
        mem: &GuestMemory,
        seal: &Seal,
        durability: Durability,
        stats: WriteStats,
    ) -> Result<DiffStats, MemoryFileError> {
        let file = self.file.as_ref().ok_or(MemoryFileError::DirtyShape)?;
        write_seal(file, &self.dest, mem, seal)?;
        if durability == Durability::Synced {
            sync(file, &self.dest)?;
        }
        self.file = None;
        Ok(DiffStats {
            pages_written: stats.pages_written,
            bytes_written: stats.bytes_written,
            runs: stats.runs,
            clone_method: self.clone_method,
        })
    }

    /// Turns into a diff whose pages `copy` (made with the vCPUs stopped, over the
    /// same `dirty` pages) write-protected: the guest may run on while they are
    /// copied over the clone ([`LiveDiff::finish`]).
    pub fn live(self, copy: LiveCopy, dirty: &DirtyBitmap) -> LiveDiff {
        LiveDiff {
            prepared: self,
            copy,
            pages: dirty.count() as u64,
            runs: dirty.runs().count() as u64,
        }
    }
}

impl Drop for PreparedDiff {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            if let Err(e) = std::fs::remove_file(&self.dest) {
                tracing::warn!(path = %self.dest.display(), error = %e, "failed to remove partial memory file");
            }
        }
    }
}

/// A diff whose pages are write-protected in guest memory, copied while the guest
/// runs on (see [`crate::live_copy`]).
#[derive(Debug)]
pub struct LiveDiff {
    prepared: PreparedDiff,
    copy: LiveCopy,
    pages: u64,
    runs: u64,
}

impl LiveDiff {
    /// Copies the protected pages over the clone, the ones the guest writes first.
    pub fn finish(
        mut self,
        mem: &GuestMemory,
        seal: &Seal,
        durability: Durability,
    ) -> Result<DiffStats, MemoryFileError> {
        let file = self
            .prepared
            .file
            .as_ref()
            .ok_or(MemoryFileError::DirtyShape)?;
        let bytes_written = self.copy.copy_into(file)?;
        let stats = WriteStats {
            pages_written: self.pages,
            bytes_written,
            runs: self.runs,
        };
        self.prepared.seal_and_keep(mem, seal, durability, stats)
    }
}

fn write_seal(
    file: &File,
    path: &Path,
    mem: &GuestMemory,
    seal: &Seal,
) -> Result<(), MemoryFileError> {
    seal.write(file, mem.total_size())
        .map_err(|source| MemoryFileError::Seal {
            path: path.to_path_buf(),
            source,
        })
}

fn check_shape(mem: &GuestMemory, dirty: &DirtyBitmap) -> Result<(), MemoryFileError> {
    let regions = mem.regions();
    if dirty.region_count() != regions.len()
        || regions
            .iter()
            .enumerate()
            .any(|(i, r)| dirty.region_pages(i) != Some(r.pages()))
    {
        return Err(MemoryFileError::DirtyShape);
    }
    Ok(())
}

fn whole_regions(mem: &GuestMemory) -> Vec<Extent> {
    mem.regions()
        .iter()
        .enumerate()
        .map(|(region, r)| Extent {
            region,
            offset: 0,
            len: r.size,
        })
        .collect()
}

fn dirty_extents(dirty: &DirtyBitmap) -> Vec<Extent> {
    dirty
        .runs()
        .map(|run| Extent {
            region: run.region,
            offset: run.offset(),
            len: run.len(),
        })
        .collect()
}

/// The memfd's data extents (pages ever written), split at region boundaries and
/// rounded out to whole pages.
fn memfd_data_extents(mem: &GuestMemory) -> Result<Vec<Extent>, MemoryFileError> {
    let fd = mem.backing().file().as_ref();
    let total = i64::try_from(mem.total_size())
        .map_err(|_| MemoryFileError::SeekData(nix::Error::EOVERFLOW))?;
    let mut file_extents = Vec::new();
    let mut pos: i64 = 0;
    while pos < total {
        // Moves the memfd's file position, which nothing uses (all I/O is positional).
        let data = match lseek(fd, pos, Whence::SeekData) {
            Ok(d) => d,
            Err(nix::Error::ENXIO) => break,
            Err(e) => return Err(MemoryFileError::SeekData(e)),
        };
        let hole = lseek(fd, data, Whence::SeekHole).map_err(MemoryFileError::SeekData)?;
        let start = data - data % PAGE_SIZE as i64;
        let end = (hole + PAGE_SIZE as i64 - 1) / PAGE_SIZE as i64 * PAGE_SIZE as i64;
        file_extents.push((start as u64, end.min(total) as u64));
        pos = hole.max(data + 1);
    }
    let mut out = Vec::new();
    for (start, end) in file_extents {
        for (region, r) in mem.regions().iter().enumerate() {
            let r_end = r.file_offset + r.size as u64;
            let s = start.max(r.file_offset);
            let e = end.min(r_end);
            if s < e {
                out.push(Extent {
                    region,
                    offset: (s - r.file_offset) as usize,
                    len: (e - s) as usize,
                });
            }
        }
    }
    Ok(out)
}

fn write_extents(
    file: &File,
    path: &Path,
    mem: &GuestMemory,
    extents: &[Extent],
) -> Result<WriteStats, MemoryFileError> {
    let mut stats = WriteStats::default();
    for extent in extents {
        let (Some(info), Some(host)) = (
            mem.regions().get(extent.region),
            mem.host_ptr(extent.region),
        ) else {
            return Err(MemoryFileError::DirtyShape);
        };
        if extent.offset + extent.len > info.size {
            return Err(MemoryFileError::DirtyShape);
        }
        let file_offset = info.file_offset + extent.offset as u64;
        // SAFETY: `extent.offset + extent.len <= info.size` was checked above, so the
        // range lies inside the region's live mapping.
        let src = unsafe { host.add(extent.offset) };
        pwrite_all(file, src, extent.len, file_offset).map_err(|(offset, source)| {
            MemoryFileError::Write {
                path: path.to_path_buf(),
                offset,
                len: extent.len,
                source,
            }
        })?;
        stats.runs += 1;
        stats.bytes_written += extent.len as u64;
        stats.pages_written += (extent.len / PAGE_SIZE) as u64;
    }
    Ok(stats)
}

fn sync(file: &File, path: &Path) -> Result<(), MemoryFileError> {
    file.sync_data().map_err(|source| MemoryFileError::Sync {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::dirty::{DirtyTracker, UffdWriteProtect, VmmWriteLog};
    use crate::guest_memory::MemoryLayout;

    fn layout() -> MemoryLayout {
        MemoryLayout::new(&[
            (GuestAddress(0), 2 << 20),
            (GuestAddress(1 << 32), 512 << 10),
        ])
        .unwrap()
    }

    /// Every byte of guest memory, region after region (the memory file's layout).
    fn contents(mem: &GuestMemory) -> Vec<u8> {
        let mut out = Vec::new();
        for i in 0..mem.regions().len() {
            // SAFETY: nothing writes the memory while the slice is alive.
            out.extend_from_slice(unsafe { mem.as_slice(i) }.unwrap());
        }
        out
    }

    /// Writes a recognisable pattern into some pages through vm-memory.
    fn scribble(mem: &GuestMemory, seed: u8, pages: &[(usize, usize)]) {
        for &(region, page) in pages {
            let base = mem.regions()[region].guest_addr.0 + (page * PAGE_SIZE) as u64;
            let data: Vec<u8> = (0..PAGE_SIZE)
                .map(|i| seed ^ (i as u8) ^ (page as u8))
                .collect();
            mem.inner().write_slice(&data, GuestAddress(base)).unwrap();
        }
    }

    /// The seal of every file these tests write: files of the same contents compare
    /// equal.
    const SEAL: Seal = Seal([0x5e; 16]);

    const FIRST: [(usize, usize); 6] = [(0, 0), (0, 1), (0, 2), (0, 300), (0, 511), (1, 17)];

    #[test]
    fn full_write_restores_byte_for_byte_and_leaves_holes() {
        let dir = tempfile::tempdir().unwrap();
        let mem = GuestMemory::anonymous(layout()).unwrap();
        scribble(&mem, 1, &FIRST);

        let path = dir.path().join("full");
        let stats = write_full(&path, &mem, None, &SEAL, Durability::Synced).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            mem.total_size() + SEAL_BYTES
        );
        SEAL.check(&path, mem.total_size()).unwrap();
        assert!(stats.pages_written >= FIRST.len() as u64);
        assert!(stats.bytes_written < mem.total_size() / 2, "{stats:?}");
        let allocated = std::fs::metadata(&path).unwrap().blocks() * 512;
        assert!(allocated < mem.total_size() / 2, "allocated {allocated}");

        let restored = GuestMemory::restore_private(layout(), &path).unwrap();
        assert!(contents(&restored) == contents(&mem));

        // With a dirty bitmap covering every write since creation: exactly those pages.
        let mem2 = GuestMemory::anonymous(layout()).unwrap();
        let mut log = VmmWriteLog::new(&mem2);
        scribble(&mem2, 1, &FIRST);
        let dirty = log.collect().unwrap();
        let path2 = dir.path().join("full2");
        let stats = write_full(&path2, &mem2, Some(&dirty), &SEAL, Durability::Synced).unwrap();
        assert_eq!(
            stats,
            WriteStats {
                pages_written: 6,
                bytes_written: 6 * PAGE_SIZE as u64,
                runs: 4
            }
        );
        assert_eq!(
            std::fs::read(&path2).unwrap(),
            std::fs::read(&path).unwrap()
        );

        // A restored memory written in full is the same file again.
        let path3 = dir.path().join("full3");
        let stats = write_full(&path3, &restored, Some(&dirty), &SEAL, Durability::Synced).unwrap();
        assert_eq!(stats.bytes_written, mem.total_size());
        assert_eq!(
            std::fs::read(&path3).unwrap(),
            std::fs::read(&path).unwrap()
        );
    }

    #[test]
    fn full_write_refuses_existing_destination_and_bad_bitmap() {
        let dir = tempfile::tempdir().unwrap();
        let mem = GuestMemory::anonymous(layout()).unwrap();
        let path = dir.path().join("exists");
        std::fs::write(&path, b"keep").unwrap();
        assert!(matches!(
            write_full(&path, &mem, None, &SEAL, Durability::Synced),
            Err(MemoryFileError::Create { .. })
        ));
        assert_eq!(std::fs::read(&path).unwrap(), b"keep");
        let wrong = DirtyBitmap::new(&[1]);
        let other = dir.path().join("other");
        assert!(matches!(
            write_full(&other, &mem, Some(&wrong), &SEAL, Durability::Synced),
            Err(MemoryFileError::DirtyShape)
        ));
        assert!(!other.exists());
    }

    #[test]
    fn diff_write_is_a_complete_independent_file() {
        let dir = tempfile::tempdir().unwrap();
        let parent = dir.path().join("parent");
        let original = GuestMemory::anonymous(layout()).unwrap();
        scribble(&original, 1, &FIRST);
        write_full(&parent, &original, None, &SEAL, Durability::Synced).unwrap();
        let parent_bytes = std::fs::read(&parent).unwrap();

        let mem = GuestMemory::restore_private(layout(), &parent).unwrap();
        let mut log = VmmWriteLog::new(&mem);
        log.start().unwrap();
        let second = [(0, 1), (0, 2), (0, 3), (0, 400), (1, 0), (1, 127)];
        scribble(&mem, 2, &second);
        let dirty = log.collect().unwrap();
        assert!(dirty.iter().eq(second));

        let child = dir.path().join("child");
        let stats = write_diff(&parent, &child, &mem, &dirty, &SEAL, Durability::Synced).unwrap();
        println!("diff: {stats:?}");
        assert_eq!(stats.pages_written, 6);
        assert_eq!(stats.bytes_written, 6 * PAGE_SIZE as u64);
        assert_eq!(stats.runs, 4);

        let restored = GuestMemory::restore_private(layout(), &child).unwrap();
        let expected = contents(&mem);
        assert!(contents(&restored) == expected);
        let total = mem.total_size() as usize;
        assert!(std::fs::read(&child).unwrap()[..total] == expected);
        assert!(std::fs::read(&parent).unwrap() == parent_bytes);
        // The child really differs from the parent where the pages changed.
        assert!(expected != parent_bytes[..total]);

        // Each file carries its own seal: the child's over the parent's.
        let grandchild = dir.path().join("grandchild");
        let own = Seal([0x6f; 16]);
        let empty = DirtyBitmap::for_memory(&mem);
        write_diff(
            &child,
            &grandchild,
            &mem,
            &empty,
            &own,
            Durability::Deferred,
        )
        .unwrap();
        own.check(&grandchild, mem.total_size()).unwrap();
        assert!(SEAL.check(&grandchild, mem.total_size()).is_err());
        SEAL.check(&child, mem.total_size()).unwrap();

        // A parent of an older build (guest memory alone) gets a sealed child.
        let unsealed = dir.path().join("unsealed");
        std::fs::write(&unsealed, &expected).unwrap();
        let sealed = dir.path().join("sealed");
        write_diff(&unsealed, &sealed, &mem, &empty, &own, Durability::Deferred).unwrap();
        own.check(&sealed, mem.total_size()).unwrap();
        assert!(contents(&GuestMemory::restore_private(layout(), &sealed).unwrap()) == expected);
    }

    #[test]
    fn diff_write_with_userfaultfd_tracking() {
        if !UffdWriteProtect::probe() {
            println!("skipped: kernel lacks userfaultfd async write-protect + PAGEMAP_SCAN");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let parent = dir.path().join("parent");
        let original = GuestMemory::anonymous(layout()).unwrap();
        scribble(&original, 3, &FIRST);
        write_full(&parent, &original, None, &SEAL, Durability::Synced).unwrap();

        let mem = GuestMemory::restore_private(layout(), &parent).unwrap();
        let mut tracker = UffdWriteProtect::new(&mem).unwrap();
        tracker.start().unwrap();
        // Raw host writes, invisible to the VMM write log.
        for (region, offset) in [
            (0usize, 5 * PAGE_SIZE),
            (0, 6 * PAGE_SIZE + 9),
            (1, 64 * PAGE_SIZE),
        ] {
            let host = mem.regions()[region].host_addr as *mut u8;
            // SAFETY: every offset is inside its region's live mapping.
            unsafe { host.add(offset).write_volatile(0x77) };
        }
        let dirty = tracker.collect().unwrap();
        assert!(dirty.iter().eq([(0, 5), (0, 6), (1, 64)]));
        let child = dir.path().join("child");
        let stats = write_diff(&parent, &child, &mem, &dirty, &SEAL, Durability::Synced).unwrap();
        assert_eq!((stats.pages_written, stats.runs), (3, 2));
        let restored = GuestMemory::restore_private(layout(), &child).unwrap();
        assert!(contents(&restored) == contents(&mem));
    }

    #[test]
    fn diff_write_errors_leave_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let mem = GuestMemory::anonymous(layout()).unwrap();
        let dirty = DirtyBitmap::for_memory(&mem);

        // Parent of the wrong size: the clone is removed.
        let small = dir.path().join("small");
        std::fs::write(&small, vec![0u8; PAGE_SIZE]).unwrap();
        let dest = dir.path().join("dest");
        assert!(matches!(
            write_diff(&small, &dest, &mem, &dirty, &SEAL, Durability::Synced),
            Err(MemoryFileError::ParentSize { actual: 4096, .. })
        ));
        assert!(!dest.exists());

        // Missing parent.
        assert!(matches!(
            write_diff(
                &dir.path().join("missing"),
                &dest,
                &mem,
                &dirty,
                &SEAL,
                Durability::Synced
            ),
            Err(MemoryFileError::Clone { .. })
        ));
        assert!(!dest.exists());

        // Existing destination: refused and left alone.
        let parent = dir.path().join("parent");
        write_full(&parent, &mem, None, &SEAL, Durability::Synced).unwrap();
        std::fs::write(&dest, b"keep").unwrap();
        assert!(matches!(
            write_diff(&parent, &dest, &mem, &dirty, &SEAL, Durability::Synced),
            Err(MemoryFileError::Clone { .. })
        ));
        assert_eq!(std::fs::read(&dest).unwrap(), b"keep");
    }

    #[test]
    fn two_restores_of_one_file_are_independent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mem");
        let original = GuestMemory::anonymous(layout()).unwrap();
        scribble(&original, 4, &FIRST);
        write_full(&path, &original, None, &SEAL, Durability::Synced).unwrap();

        let a = GuestMemory::restore_private(layout(), &path).unwrap();
        let b = GuestMemory::restore_private(layout(), &path).unwrap();
        let before = contents(&b);
        scribble(&a, 9, &[(0, 0), (0, 100), (1, 17)]);
        assert!(contents(&b) == before);
        assert!(contents(&a) != before);
        assert!(contents(&GuestMemory::restore_private(layout(), &path).unwrap()) == before);
    }
}
