//! Packing a directory tree into an archive: the entries first, then each regular
//! file's data ranges as chunks, holes and all-zero ranges left out (or, for a file
//! with a base, the ranges that differ from the base).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::format::MAX_CHUNK;
use crate::manifest::{
    Entry, EntryKind, Manifest, Xattr, SANDBOX_DEVICES, XATTR_ALLOWED, XATTR_USER_PREFIX,
};
use crate::writer::{ArchiveWriter, WriteError};

/// Why a tree could not be packed.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// Reading the tree failed.
    #[error("Reading {0}")]
    Io(PathBuf, #[source] std::io::Error),
    /// A file name is not UTF-8.
    #[error("File name {0} is not UTF-8")]
    Name(PathBuf),
    /// A file changed size while it was being packed.
    #[error("{0} changed while it was being archived")]
    Changed(PathBuf),
    /// Writing the archive failed.
    #[error("Writing the archive")]
    Write(#[from] WriteError),
}

/// What to pack besides the tree.
pub struct PackOptions<'a> {
    /// Put into [`Manifest::properties`].
    pub properties: BTreeMap<String, String>,
    /// For a file of the tree (its relative path), the base the importer will hold:
    /// the name to record and the same file on this host to compare against. Only
    /// ranges that differ from it are written.
    pub base: &'a dyn Fn(&str) -> Option<(String, PathBuf)>,
}

/// What packing wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PackStats {
    /// Entries in the manifest.
    pub entries: u64,
    /// Sum of the regular files' lengths.
    pub file_bytes: u64,
    /// Raw bytes written as chunks (holes, zeros and base ranges left out).
    pub data_bytes: u64,
    /// The archive's length.
    pub archive_bytes: u64,
    /// Entries left out: sockets, FIFOs and device nodes other than whiteouts.
    pub skipped: Vec<String>,
}

/// Packs the tree under `root` (not `root` itself) into `out`.
pub fn pack(
    root: &Path,
    out: impl Write,
    options: &PackOptions<'_>,
) -> Result<PackStats, PackError> {
    let mut stats = PackStats::default();
    let mut entries = Vec::new();
    walk(root, "", &mut entries, &mut stats)?;
    entries.sort_by(|a: &Entry, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    let mut bases: Vec<Option<PathBuf>> = Vec::with_capacity(entries.len());
    for entry in &mut entries {
        let mut base_path = None;
        if let EntryKind::File { size, base } = &mut entry.kind {
            stats.file_bytes += *size;
            if let Some((name, path)) = (options.base)(&entry.path) {
                *base = Some(name);
                base_path = Some(path);
            }
        }
        bases.push(base_path);
    }
    stats.entries = entries.len() as u64;
    let manifest = Manifest {
        properties: options.properties.clone(),
        entries,
    };
    let mut writer = ArchiveWriter::new(out, &manifest)?;
    let mut ours = vec![0u8; MAX_CHUNK as usize];
    let mut theirs = vec![0u8; MAX_CHUNK as usize];
    for (index, entry) in manifest.entries.iter().enumerate() {
        let EntryKind::File { size, .. } = entry.kind else {
            continue;
        };
        let path = root.join(&entry.path);
        let io = |e| PackError::Io(path.clone(), e);
        // Not through a link that replaced the file since it was listed (a sandbox's
        // side may own the directory packed), nor blocked by a FIFO put there.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() || meta.len() != size {
            return Err(PackError::Changed(path));
        }
        let base = match &bases[index] {
            Some(p) => Some(File::open(p).map_err(|e| PackError::Io(p.clone(), e))?),
            None => None,
        };
        let mut ranges = data_ranges(&file, size).map_err(io)?;
        if let Some(base) = &base {
            let base_len = base.metadata().map_err(io)?.len().min(size);
            ranges.extend(data_ranges(base, base_len).map_err(io)?);
        }
        for (start, end) in chunk_ranges(ranges) {
            let len = (end - start) as usize;
            let data = &mut ours[..len];
            file.read_exact_at(data, start).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    PackError::Changed(path.clone())
                } else {
                    PackError::Io(path.clone(), e)
                }
            })?;
            let skip = match &base {
                None => data.iter().all(|b| *b == 0),
                Some(base) => {
                    let other = &mut theirs[..len];
                    let n = read_at_most(base, other, start).map_err(io)?;
                    other[n..].fill(0);
                    *data == *other
                }
            };
            if skip {
                continue;
            }
            writer.chunk(index as u32, start, data)?;
            stats.data_bytes += len as u64;
        }
    }
    let (_, length) = writer.finish()?;
    stats.archive_bytes = length;
    Ok(stats)
}

/// Reads up to `buf.len()` bytes at `offset`, fewer at the end of the file.
fn read_at_most(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The ranges of `file` (of length `size`) that hold data, by `SEEK_DATA`/`SEEK_HOLE`;
/// the whole file where the filesystem cannot say.
fn data_ranges(file: &File, size: u64) -> std::io::Result<Vec<(u64, u64)>> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let mut ranges = Vec::new();
    let mut pos: u64 = 0;
    while pos < size {
        let Ok(at) = libc::off_t::try_from(pos) else {
            break;
        };
        // SAFETY: lseek on an open descriptor; no memory is passed.
        let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENXIO) => break,
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => return Ok(vec![(0, size)]),
                _ => return Err(e),
            }
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let (start, end) = (data as u64, (hole as u64).min(size));
        if start >= size {
            break;
        }
        if end > start {
            ranges.push((start, end));
        }
        pos = end.max(start + 1);
    }
    Ok(ranges)
}

/// Splits `ranges` (in any order, possibly overlapping) into chunk-aligned pieces of at
/// most [`MAX_CHUNK`] bytes, in order, each once.
fn chunk_ranges(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let chunk = u64::from(MAX_CHUNK);
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (start, end) in ranges {
        let mut at = start / chunk * chunk;
        while at < end {
            let piece_end = (at + chunk).min(end);
            let piece_start = at.max(start);
            match out.last_mut() {
                // Same chunk as the last piece: widen it.
                Some(last) if last.0 / chunk == piece_start / chunk => {
                    last.0 = last.0.min(piece_start);
                    last.1 = last.1.max(piece_end);
                }
                Some(last) if last.1 > piece_start => {
                    // Overlaps a piece already emitted in a later chunk: keep the rest.
                    if piece_end > last.1 {
                        let from = last.1;
                        out.push((from, piece_end));
                    }
                }
                _ => out.push((piece_start, piece_end)),
            }
            at += chunk;
        }
    }
    out
}

fn walk(
    root: &Path,
    prefix: &str,
    entries: &mut Vec<Entry>,
    stats: &mut PackStats,
) -> Result<(), PackError> {
    let dir = if prefix.is_empty() {
        root.to_path_buf()
    } else {
        root.join(prefix)
    };
    let listing = std::fs::read_dir(&dir).map_err(|e| PackError::Io(dir.clone(), e))?;
    for item in listing {
        let item = item.map_err(|e| PackError::Io(dir.clone(), e))?;
        let host_path = item.path();
        let name = item
            .file_name()
            .into_string()
            .map_err(|_| PackError::Name(host_path.clone()))?;
        let path = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        let meta = std::fs::symlink_metadata(&host_path)
            .map_err(|e| PackError::Io(host_path.clone(), e))?;
        let ft = meta.file_type();
        let kind = if ft.is_dir() {
            EntryKind::Dir
        } else if ft.is_file() {
            EntryKind::File {
                size: meta.len(),
                base: None,
            }
        } else if ft.is_symlink() {
            let target =
                std::fs::read_link(&host_path).map_err(|e| PackError::Io(host_path.clone(), e))?;
            let target = target
                .into_os_string()
                .into_string()
                .map_err(|_| PackError::Name(host_path.clone()))?;
            EntryKind::Symlink { target }
        } else if ft.is_char_device() && meta.rdev() == 0 {
            EntryKind::Whiteout
        } else if ft.is_char_device()
            && SANDBOX_DEVICES.contains(&(libc::major(meta.rdev()), libc::minor(meta.rdev())))
        {
            EntryKind::CharDevice {
                major: libc::major(meta.rdev()),
                minor: libc::minor(meta.rdev()),
            }
        } else {
            stats.skipped.push(path);
            continue;
        };
        let is_dir = matches!(kind, EntryKind::Dir);
        entries.push(Entry {
            xattrs: xattrs(&host_path).map_err(|e| PackError::Io(host_path.clone(), e))?,
            path: path.clone(),
            kind,
            mode: meta.mode() & 0o7777,
            uid: meta.uid(),
            gid: meta.gid(),
            mtime: meta.mtime(),
            mtime_nsec: u32::try_from(meta.mtime_nsec()).unwrap_or(0),
        });
        if is_dir {
            walk(root, &path, entries, stats)?;
        }
    }
    Ok(())
}

/// The extended attributes of `path` an archive may carry (not following a symlink).
fn xattrs(path: &Path) -> std::io::Result<Vec<Xattr>> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let mut names = vec![0u8; 4096];
    let len = loop {
        // SAFETY: the path is a live C string and the buffer is writable for its length.
        let n =
            unsafe { libc::llistxattr(c_path.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ERANGE) if names.len() < (1 << 20) => names.resize(names.len() * 4, 0),
            Some(libc::ENOTSUP) => return Ok(Vec::new()),
            _ => return Err(e),
        }
    };
    let mut out = Vec::new();
    for name in names[..len].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Ok(text) = std::str::from_utf8(name) else {
            continue;
        };
        if !(XATTR_ALLOWED.contains(&text) || text.starts_with(XATTR_USER_PREFIX)) {
            continue;
        }
        let c_name = CString::new(name)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        let mut value = vec![0u8; crate::manifest::MAX_XATTR_VALUE];
        // SAFETY: both strings are live C strings; the buffer is writable for its length.
        let n = unsafe {
            libc::lgetxattr(
                c_path.as_ptr(),
                c_name.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        value.truncate(n as usize);
        out.push(Xattr {
            name: text.to_string(),
            value,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_ranges_are_aligned_ordered_and_unique() {
        let c = u64::from(MAX_CHUNK);
        assert_eq!(chunk_ranges(vec![(10, 20)]), vec![(10, 20)]);
        assert_eq!(
            chunk_ranges(vec![(c - 5, c + 5)]),
            vec![(c - 5, c), (c, c + 5)]
        );
        // Overlapping ranges of a file and its base become one piece per chunk.
        assert_eq!(
            chunk_ranges(vec![(0, 100), (50, 3 * c), (10, 20)]),
            vec![(0, c), (c, 2 * c), (2 * c, 3 * c)]
        );
        assert_eq!(chunk_ranges(vec![(0, 10), (20, 30)]), vec![(0, 30)]);
    }
}
