//! Unpacking an archive into a new directory, checking every byte on the way; the
//! directory is removed again unless the whole archive checked out.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::manifest::{EntryKind, Manifest};
use crate::reader::{ArchiveReader, ReadError};

/// Why an archive could not be unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// The archive was refused.
    #[error("Invalid archive")]
    Read(#[from] ReadError),
    /// The destination exists already.
    #[error("{0} already exists")]
    Exists(PathBuf),
    /// Writing the tree failed.
    #[error("Writing {0}")]
    Io(PathBuf, #[source] std::io::Error),
    /// A file names a base the caller could not provide.
    #[error("Base file {0} is not available here")]
    Base(String, #[source] std::io::Error),
}

/// What unpacking wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnpackStats {
    /// Entries made.
    pub entries: u64,
    /// Raw bytes written from chunks.
    pub data_bytes: u64,
    /// The archive's length.
    pub archive_bytes: u64,
}

/// Removes a half-unpacked tree unless disarmed.
struct Partial<'a>(Option<&'a Path>);

impl Drop for Partial<'_> {
    fn drop(&mut self) {
        if let Some(dir) = self.0 {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Unpacks the rest of `reader` (whose manifest is `manifest`) into `dest`, a new
/// directory. A file that names a base starts as what `base(name, path)` puts at
/// `path` (a copy or reflink of the caller's file of that name). On any error `dest`
/// is removed; on success every chunk and the archive's checksum were verified.
pub fn unpack<R: Read>(
    mut reader: ArchiveReader<R>,
    manifest: &Manifest,
    dest: &Path,
    base: &dyn Fn(&str, &Path) -> std::io::Result<()>,
) -> Result<UnpackStats, UnpackError> {
    match std::fs::create_dir(dest) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(UnpackError::Exists(dest.to_path_buf()))
        }
        Err(e) => return Err(UnpackError::Io(dest.to_path_buf(), e)),
    }
    let mut partial = Partial(Some(dest));
    let mut stats = UnpackStats::default();
    // The manifest was validated: every parent is a directory entry made here before
    // its children, so joining paths never passes through a link.
    for entry in &manifest.entries {
        let path = dest.join(&entry.path);
        let io = |e| UnpackError::Io(path.clone(), e);
        match &entry.kind {
            EntryKind::Dir => std::fs::create_dir(&path).map_err(io)?,
            EntryKind::File { size, base: None } => {
                let file = create_file(&path).map_err(io)?;
                file.set_len(*size).map_err(io)?;
            }
            EntryKind::File {
                size,
                base: Some(name),
            } => {
                base(name, &path).map_err(|e| UnpackError::Base(name.clone(), e))?;
                let file = OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&path)
                    .map_err(io)?;
                file.set_len(*size).map_err(io)?;
            }
            EntryKind::Symlink { target } => {
                std::os::unix::fs::symlink(target, &path).map_err(io)?
            }
            EntryKind::Whiteout => nix::sys::stat::mknod(
                &path,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::empty(),
                0,
            )
            .map_err(|e| io(e.into()))?,
            EntryKind::CharDevice { major, minor } => nix::sys::stat::mknod(
                &path,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::empty(),
                libc::makedev(*major, *minor),
            )
            .map_err(|e| io(e.into()))?,
        }
        stats.entries += 1;
    }
    let mut open: Option<(u32, File)> = None;
    while let Some(chunk) = reader.next_chunk()? {
        let entry = chunk.entry;
        let path = dest.join(&manifest.entries[entry as usize].path);
        if open.as_ref().map(|(i, _)| *i) != Some(entry) {
            let file = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
                .map_err(|e| UnpackError::Io(path.clone(), e))?;
            open = Some((entry, file));
        }
        if let Some((_, file)) = &open {
            file.write_all_at(chunk.data, chunk.offset)
                .map_err(|e| UnpackError::Io(path.clone(), e))?;
        }
        stats.data_bytes += chunk.data.len() as u64;
    }
    drop(open);
    stats.archive_bytes = reader.bytes_read();
    // Owners before modes (chown clears set-id bits), children before parents (a
    // directory's time changes as entries appear in it).
    for entry in manifest.entries.iter().rev() {
        let path = dest.join(&entry.path);
        apply_metadata(&path, entry).map_err(|e| UnpackError::Io(path.clone(), e))?;
    }
    partial.0 = None;
    Ok(stats)
}

fn create_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o600)
        .open(path)
}

fn apply_metadata(path: &Path, entry: &crate::manifest::Entry) -> std::io::Result<()> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: a live C string; lchown does not follow a final symlink.
    if unsafe { libc::lchown(c_path.as_ptr(), entry.uid, entry.gid) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let is_link = matches!(entry.kind, EntryKind::Symlink { .. });
    for x in &entry.xattrs {
        let name = CString::new(x.name.as_bytes())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: live C strings and a value buffer valid for its length.
        let r = unsafe {
            libc::lsetxattr(
                c_path.as_ptr(),
                name.as_ptr(),
                x.value.as_ptr().cast(),
                x.value.len(),
                0,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    if !is_link {
        // SAFETY: a live C string; the entry is not a symlink (made here as what the
        // manifest says), so chmod acts on it.
        if unsafe { libc::chmod(c_path.as_ptr(), entry.mode as libc::mode_t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    let time = libc::timespec {
        tv_sec: entry.mtime as libc::time_t,
        tv_nsec: libc::c_long::from(entry.mtime_nsec.min(999_999_999) as i32),
    };
    let times = [time, time];
    // SAFETY: a live C string and a two-element timespec array.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c_path.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;
    use crate::pack::{pack, PackOptions};

    fn no_base(_: &str) -> Option<(String, PathBuf)> {
        None
    }

    #[test]
    fn a_tree_round_trips_sparse() {
        let src = tempfile::tempdir().unwrap();
        let root = src.path();
        std::fs::create_dir(root.join("d")).unwrap();
        std::fs::write(root.join("d/small"), b"hello").unwrap();
        std::fs::set_permissions(root.join("d/small"), std::fs::Permissions::from_mode(0o640))
            .unwrap();
        // 8 MiB with 4 KiB of data in the middle: a sparse memory image.
        let big = File::create(root.join("big")).unwrap();
        big.set_len(8 << 20).unwrap();
        big.write_all_at(&[0xab; 4096], 5 << 20).unwrap();
        std::os::unix::fs::symlink("/nowhere", root.join("link")).unwrap();
        let mut bytes = Vec::new();
        let stats = pack(
            root,
            &mut bytes,
            &PackOptions {
                properties: BTreeMap::from([("k".into(), "v".into())]),
                base: &no_base,
            },
        )
        .unwrap();
        assert_eq!(stats.entries, 4);
        assert_eq!(stats.data_bytes, 4096 + 5);
        assert!(bytes.len() < 16 << 10);

        let out = tempfile::tempdir().unwrap();
        let dest = out.path().join("tree");
        let (reader, manifest) = ArchiveReader::open(bytes.as_slice()).unwrap();
        assert_eq!(manifest.properties["k"], "v");
        unpack(reader, &manifest, &dest, &|_, _| {
            Err(std::io::ErrorKind::NotFound.into())
        })
        .unwrap();
        assert_eq!(std::fs::read(dest.join("d/small")).unwrap(), b"hello");
        let meta = std::fs::metadata(dest.join("d/small")).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o640);
        let big = std::fs::read(dest.join("big")).unwrap();
        assert_eq!(big.len(), 8 << 20);
        assert!(big[5 << 20..(5 << 20) + 4096].iter().all(|b| *b == 0xab));
        assert_eq!(big.iter().filter(|b| **b != 0).count(), 4096);
        // Still sparse: a few blocks, not 8 MiB.
        assert!(std::fs::metadata(dest.join("big")).unwrap().blocks() < 1024);
        assert_eq!(
            std::fs::read_link(dest.join("link")).unwrap(),
            PathBuf::from("/nowhere")
        );
    }

    #[test]
    fn a_saved_dev_keeps_its_device_nodes_and_others_are_left_out() {
        if !nix::unistd::geteuid().is_root() {
            println!("skipped: making device nodes needs root");
            return;
        }
        let src = tempfile::tempdir().unwrap();
        let root = src.path();
        let node = |name: &str, major, minor| {
            nix::sys::stat::mknod(
                &root.join(name),
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                libc::makedev(major, minor),
            )
            .unwrap();
            // mknod's mode passes through the umask.
            std::fs::set_permissions(root.join(name), std::fs::Permissions::from_mode(0o666))
                .unwrap();
        };
        node("null", 1, 3);
        node("urandom", 1, 9);
        node("mem", 1, 1);
        let mut bytes = Vec::new();
        let stats = pack(
            root,
            &mut bytes,
            &PackOptions {
                properties: BTreeMap::new(),
                base: &no_base,
            },
        )
        .unwrap();
        assert_eq!(stats.entries, 2);
        assert_eq!(stats.skipped, vec!["mem".to_string()]);

        let out = tempfile::tempdir().unwrap();
        let dest = out.path().join("dev");
        let (reader, manifest) = ArchiveReader::open(bytes.as_slice()).unwrap();
        unpack(reader, &manifest, &dest, &|_, _| {
            Err(std::io::ErrorKind::NotFound.into())
        })
        .unwrap();
        let null = std::fs::metadata(dest.join("null")).unwrap();
        assert!(std::os::unix::fs::FileTypeExt::is_char_device(
            &null.file_type()
        ));
        assert_eq!(null.rdev(), libc::makedev(1, 3));
        assert_eq!(null.mode() & 0o7777, 0o666);
        assert!(!dest.join("mem").exists());
    }

    #[test]
    fn a_file_travels_as_its_difference_from_a_base() {
        let src = tempfile::tempdir().unwrap();
        let base_dir = tempfile::tempdir().unwrap();
        let base_file = base_dir.path().join("memory.bin");
        let base_bytes: Vec<u8> = (0..(3u32 << 20)).map(|i| (i % 251) as u8).collect();
        std::fs::write(&base_file, &base_bytes).unwrap();
        let mut ours = base_bytes.clone();
        ours[(1 << 20) + 7] = 0;
        // A range the base has data in and ours zeroed must travel too.
        ours[2 << 20..(2 << 20) + 100].fill(0);
        std::fs::write(src.path().join("memory.bin"), &ours).unwrap();
        let base_for =
            |p: &str| (p == "memory.bin").then(|| ("memory.bin".to_string(), base_file.clone()));
        let mut bytes = Vec::new();
        let stats = pack(
            src.path(),
            &mut bytes,
            &PackOptions {
                properties: BTreeMap::new(),
                base: &base_for,
            },
        )
        .unwrap();
        assert_eq!(stats.data_bytes, 2 << 20, "two differing chunks");
        let out = tempfile::tempdir().unwrap();
        let dest = out.path().join("t");
        let (reader, manifest) = ArchiveReader::open(bytes.as_slice()).unwrap();
        let copy_base = |name: &str, at: &Path| {
            assert_eq!(name, "memory.bin");
            std::fs::copy(&base_file, at).map(|_| ())
        };
        unpack(reader, &manifest, &dest, &copy_base).unwrap();
        assert!(std::fs::read(dest.join("memory.bin")).unwrap() == ours);
    }

    #[test]
    fn a_bad_archive_leaves_nothing() {
        let src = tempfile::tempdir().unwrap();
        std::fs::write(src.path().join("f"), vec![1u8; 100_000]).unwrap();
        let mut bytes = Vec::new();
        pack(
            src.path(),
            &mut bytes,
            &PackOptions {
                properties: BTreeMap::new(),
                base: &no_base,
            },
        )
        .unwrap();
        let out = tempfile::tempdir().unwrap();
        for bad in [bytes[..bytes.len() - 1].to_vec(), {
            let mut b = bytes.clone();
            let n = b.len();
            b[n - 10] ^= 1;
            b
        }] {
            let dest = out.path().join("t");
            let (reader, manifest) = ArchiveReader::open(bad.as_slice()).unwrap();
            assert!(unpack(reader, &manifest, &dest, &|_, _| Ok(())).is_err());
            assert!(!dest.exists());
        }
    }
}
