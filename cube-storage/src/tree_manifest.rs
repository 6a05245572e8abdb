//! What a snapshot's directory trees held when it was written (a jail's writable
//! layer, its tmpfs contents), and the check that they still hold it.
//!
//! A jail snapshot is its files: nothing else would notice a file of its layer that
//! was truncated, bit-flipped, swapped with another snapshot's, removed or added, and
//! a restore would take the damage in. The manifest lists every entry under the
//! snapshot's trees with its kind, and for a regular file its length and a CRC32; it
//! names the snapshot it belongs to and sits in a checksummed envelope. A restore
//! checks the trees against it before it applies anything ([`verify`]).
//!
//! What the CRC32 covers is bounded, as it is computed at every snapshot and checked
//! at every restore: a file of up to [`WHOLE_FILE_BYTES`] is covered whole; of a larger
//! one, its first and last [`SAMPLE_BYTES`] (and its length). Reading whole files cost
//! too much where it matters: on the reference host's loop-mounted XFS store, with
//! 10 MiB of data in the layer a clone took 1.8 times as long, and with 100 MiB a
//! snapshot 1.4 times (`cube bench --engine jail`). So damage inside a large file,
//! away from its ends and keeping its length, is not noticed; a truncated or replaced
//! file, and any change to a small one (an agent's working files, most files of a
//! layer), is. Directory metadata (modes, owners, times) is not covered.

use std::collections::BTreeMap;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::layout::SnapshotDir;
use crate::metadata::MetadataError;
use crate::Durability;

/// Files up to this length are covered whole by their CRC32.
pub const WHOLE_FILE_BYTES: u64 = 2 * SAMPLE_BYTES;
/// Of a larger file, the CRC32 covers this many bytes at its start and at its end.
pub const SAMPLE_BYTES: u64 = 64 << 10;

/// Envelope kind of the manifest file.
const MANIFEST_KIND: &str = "cube-tree-manifest";
/// Largest manifest accepted (a few hundred thousand files).
const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// Why a manifest could not be written, or trees do not match theirs.
#[derive(Debug, thiserror::Error)]
pub enum TreeManifestError {
    /// Listing or reading the trees failed.
    #[error("Reading {0}")]
    Read(String, #[source] std::io::Error),
    /// The manifest file is missing, damaged or unreadable.
    #[error("Snapshot file manifest is unreadable")]
    Envelope(#[source] MetadataError),
    /// The manifest does not decode or encode.
    #[error("Snapshot file manifest does not decode")]
    Decode(#[source] serde_json::Error),
    /// The manifest is another snapshot's.
    #[error("Snapshot file manifest belongs to snapshot {found}, not {expected}")]
    WrongSnapshot {
        /// The snapshot it names.
        found: String,
        /// The snapshot checked.
        expected: String,
    },
    /// An entry the snapshot held is gone.
    #[error("Snapshot file {0} is missing")]
    Missing(String),
    /// An entry appeared that the snapshot did not hold.
    #[error("Snapshot file {0} was not in the snapshot")]
    Added(String),
    /// An entry changed kind (a file became a directory, a link, ...).
    #[error("Snapshot file {0} is no longer a {1}")]
    Kind(String, &'static str),
    /// A regular file has another length.
    #[error("Snapshot file {path} is {found} bytes, {expected} were written")]
    Size {
        /// The file, relative to the snapshot.
        path: String,
        /// Its length now.
        found: u64,
        /// Its length when written.
        expected: u64,
    },
    /// A regular file's contents changed.
    #[error("Snapshot file {0} is damaged (its CRC32 differs from the one written)")]
    Content(String),
    /// A symlink points elsewhere.
    #[error("Snapshot symlink {0} points elsewhere than when written")]
    Link(String),
    /// A device node or FIFO changed.
    #[error("Snapshot special file {0} changed")]
    Special(String),
}

/// One entry of a tree.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Entry {
    /// A directory.
    Dir,
    /// A regular file: its length and the CRC32 of its contents (of its ends only,
    /// beyond [`WHOLE_FILE_BYTES`]).
    File { len: u64, crc32: u32 },
    /// A symbolic link and its target (escaped as names are).
    Symlink { target: String },
    /// A FIFO or device node: its file type bits and device number.
    Special { kind: u32, rdev: u64 },
}

impl Entry {
    fn kind(&self) -> &'static str {
        match self {
            Entry::Dir => "directory",
            Entry::File { .. } => "regular file",
            Entry::Symlink { .. } => "symlink",
            Entry::Special { .. } => "special file",
        }
    }
}

/// The manifest file's contents.
#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    /// The snapshot it belongs to.
    snapshot: String,
    /// Every entry under the covered trees, by path relative to the snapshot.
    entries: BTreeMap<String, Entry>,
}

/// A path's bytes as a string, losslessly: bytes outside printable ASCII, and `%`,
/// as `%XX`.
fn escape(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            // Writing into a String cannot fail.
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The length of the regular file `path` and the CRC32 of its contents: all of them up
/// to [`WHOLE_FILE_BYTES`], else its first and last [`SAMPLE_BYTES`].
fn crc32_of(path: &Path) -> Result<(u64, u32), TreeManifestError> {
    use std::os::unix::fs::FileExt;
    let read = |e| TreeManifestError::Read(path.display().to_string(), e);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(read)?;
    // The length of the open file, which is what is read.
    let len = file.metadata().map_err(read)?.len();
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; SAMPLE_BYTES as usize];
    let ranges = if len <= WHOLE_FILE_BYTES {
        [(0, len), (len, 0)]
    } else {
        [(0, SAMPLE_BYTES), (len - SAMPLE_BYTES, SAMPLE_BYTES)]
    };
    for (start, count) in ranges {
        let mut done = 0;
        while done < count {
            let chunk = (count - done).min(SAMPLE_BYTES) as usize;
            let n = file
                .read_at(&mut buf[..chunk], start + done)
                .map_err(read)?;
            if n == 0 {
                // Shorter than its length said: changed while read.
                return Err(read(std::io::ErrorKind::UnexpectedEof.into()));
            }
            hasher.update(&buf[..n]);
            done += n as u64;
        }
    }
    Ok((len, hasher.finalize()))
}

/// Adds every entry under `dir` (named `rel` relative to the snapshot) to `out`.
fn walk(dir: &Path, rel: &str, out: &mut BTreeMap<String, Entry>) -> Result<(), TreeManifestError> {
    let read = |e| TreeManifestError::Read(dir.display().to_string(), e);
    for entry in std::fs::read_dir(dir).map_err(read)? {
        let entry = entry.map_err(read)?;
        let path = entry.path();
        let name = format!("{rel}/{}", escape(entry.file_name().as_bytes()));
        let meta = std::fs::symlink_metadata(&path)
            .map_err(|e| TreeManifestError::Read(path.display().to_string(), e))?;
        let kind = meta.file_type();
        let found = if kind.is_dir() {
            walk(&path, &name, out)?;
            Entry::Dir
        } else if kind.is_file() {
            let (len, crc32) = crc32_of(&path)?;
            Entry::File { len, crc32 }
        } else if kind.is_symlink() {
            let target = std::fs::read_link(&path)
                .map_err(|e| TreeManifestError::Read(path.display().to_string(), e))?;
            Entry::Symlink {
                target: escape(target.as_os_str().as_bytes()),
            }
        } else if kind.is_fifo() || kind.is_char_device() || kind.is_block_device() {
            Entry::Special {
                kind: meta.mode() & libc::S_IFMT,
                rdev: meta.rdev(),
            }
        } else {
            // Sockets: a name only, left out of copies (see `clone_tree`).
            continue;
        };
        out.insert(name, found);
    }
    Ok(())
}

/// The entries of the trees `trees` (directory names inside `dir`; absent ones are
/// left out).
fn entries_of(dir: &Path, trees: &[&str]) -> Result<BTreeMap<String, Entry>, TreeManifestError> {
    let mut out = BTreeMap::new();
    for tree in trees {
        let root = dir.join(tree);
        match std::fs::symlink_metadata(&root) {
            Ok(m) if m.is_dir() => {
                out.insert((*tree).to_string(), Entry::Dir);
                walk(&root, tree, &mut out)?;
            }
            Ok(_) => return Err(TreeManifestError::Kind((*tree).to_string(), "directory")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(TreeManifestError::Read(root.display().to_string(), e)),
        }
    }
    Ok(out)
}

/// Writes the manifest of the trees `trees` of snapshot `snapshot` in `dir`, to the
/// page cache (the snapshot's flush syncs it).
pub fn write(dir: &Path, snapshot: &str, trees: &[&str]) -> Result<(), TreeManifestError> {
    let manifest = Manifest {
        snapshot: snapshot.to_string(),
        entries: entries_of(dir, trees)?,
    };
    let bytes = serde_json::to_vec(&manifest).map_err(TreeManifestError::Decode)?;
    crate::metadata::write_atomic_bytes_with(
        &SnapshotDir::new(dir).file_manifest(),
        MANIFEST_KIND,
        &bytes,
        Durability::Deferred,
    )
    .map_err(TreeManifestError::Envelope)
}

/// Checks that the trees `trees` of snapshot `snapshot` in `dir` hold exactly what its
/// manifest says; the error names the first entry that differs.
pub fn verify(dir: &Path, snapshot: &str, trees: &[&str]) -> Result<(), TreeManifestError> {
    let bytes = crate::metadata::read_verified_bytes(
        &SnapshotDir::new(dir).file_manifest(),
        MANIFEST_KIND,
        MAX_MANIFEST_BYTES,
    )
    .map_err(TreeManifestError::Envelope)?;
    let manifest: Manifest = serde_json::from_slice(&bytes).map_err(TreeManifestError::Decode)?;
    if manifest.snapshot != snapshot {
        return Err(TreeManifestError::WrongSnapshot {
            found: manifest.snapshot,
            expected: snapshot.to_string(),
        });
    }
    let found = entries_of(dir, trees)?;
    for (path, want) in &manifest.entries {
        let Some(got) = found.get(path) else {
            return Err(TreeManifestError::Missing(path.clone()));
        };
        match (want, got) {
            (Entry::Dir, Entry::Dir) => {}
            (
                Entry::File { len, crc32 },
                Entry::File {
                    len: found_len,
                    crc32: found_crc,
                },
            ) => {
                if len != found_len {
                    return Err(TreeManifestError::Size {
                        path: path.clone(),
                        found: *found_len,
                        expected: *len,
                    });
                }
                if crc32 != found_crc {
                    return Err(TreeManifestError::Content(path.clone()));
                }
            }
            (Entry::Symlink { target }, Entry::Symlink { target: now }) => {
                if target != now {
                    return Err(TreeManifestError::Link(path.clone()));
                }
            }
            (Entry::Special { .. }, Entry::Special { .. }) => {
                if want != got {
                    return Err(TreeManifestError::Special(path.clone()));
                }
            }
            _ => return Err(TreeManifestError::Kind(path.clone(), want.kind())),
        }
    }
    if let Some(extra) = found.keys().find(|p| !manifest.entries.contains_key(*p)) {
        return Err(TreeManifestError::Added(extra.clone()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TREES: &[&str] = &["layer", "tmpfs"];

    fn snapshot() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("layer/home/user");
        std::fs::create_dir_all(&home).unwrap();
        std::fs::write(home.join("a.txt"), b"state-0").unwrap();
        std::fs::write(home.join("b.txt"), b"state-1").unwrap();
        std::fs::write(home.join("empty"), b"").unwrap();
        std::fs::write(
            home.join(std::ffi::OsStr::from_bytes(b"odd\xff%name")),
            b"x",
        )
        .unwrap();
        std::os::unix::fs::symlink("a.txt", home.join("link")).unwrap();
        nix::unistd::mkfifo(&home.join("pipe"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        write(dir.path(), "snap-1", TREES).unwrap();
        dir
    }

    fn refused(dir: &Path, what: &str) {
        let err = verify(dir, "snap-1", TREES).unwrap_err();
        assert!(err.to_string().contains(what), "{err} lacks {what:?}");
    }

    #[test]
    fn intact_trees_pass() {
        let dir = snapshot();
        verify(dir.path(), "snap-1", TREES).unwrap();
        // Names that are not UTF-8 are kept apart from their lossy look-alikes.
        assert!(escape(b"odd\xff%name") == "odd%FF%25name");
    }

    #[test]
    fn a_large_file_is_covered_at_its_ends() {
        let dir = snapshot();
        let big = dir.path().join("layer/big");
        let len = 3 * SAMPLE_BYTES + 5;
        std::fs::write(&big, vec![7u8; len as usize]).unwrap();
        write(dir.path(), "snap-1", TREES).unwrap();
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&big).unwrap();
        for (at, covered) in [(0, true), (len - 1, true), (SAMPLE_BYTES + 9, false)] {
            f.write_all_at(&[8], at).unwrap();
            assert_eq!(
                verify(dir.path(), "snap-1", TREES).is_err(),
                covered,
                "a change at {at}"
            );
            f.write_all_at(&[7], at).unwrap();
        }
        verify(dir.path(), "snap-1", TREES).unwrap();
    }

    #[test]
    fn every_kind_of_damage_is_named() {
        let home = |d: &tempfile::TempDir| d.path().join("layer/home/user");

        let dir = snapshot();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(home(&dir).join("a.txt"))
            .unwrap();
        f.set_len(3).unwrap();
        refused(
            dir.path(),
            "layer/home/user/a.txt is 3 bytes, 7 were written",
        );

        // Same length, other contents: a swap with another snapshot's file, a flip.
        let dir = snapshot();
        std::fs::write(home(&dir).join("a.txt"), b"state-1").unwrap();
        refused(dir.path(), "a.txt is damaged");

        let dir = snapshot();
        std::fs::remove_file(home(&dir).join("b.txt")).unwrap();
        refused(dir.path(), "b.txt is missing");

        let dir = snapshot();
        std::fs::write(home(&dir).join("new"), b"").unwrap();
        refused(dir.path(), "new was not in the snapshot");

        let dir = snapshot();
        std::fs::remove_file(home(&dir).join("link")).unwrap();
        std::os::unix::fs::symlink("b.txt", home(&dir).join("link")).unwrap();
        refused(dir.path(), "link points elsewhere");

        let dir = snapshot();
        std::fs::remove_file(home(&dir).join("empty")).unwrap();
        std::fs::create_dir(home(&dir).join("empty")).unwrap();
        refused(dir.path(), "empty is no longer a regular file");

        // Another snapshot's manifest, or a damaged one.
        let dir = snapshot();
        let other = snapshot();
        std::fs::copy(
            SnapshotDir::new(other.path()).file_manifest(),
            SnapshotDir::new(dir.path()).file_manifest(),
        )
        .unwrap();
        assert!(matches!(
            verify(dir.path(), "snap-2", TREES),
            Err(TreeManifestError::WrongSnapshot { .. })
        ));
        std::fs::write(SnapshotDir::new(dir.path()).file_manifest(), b"junk").unwrap();
        assert!(matches!(
            verify(dir.path(), "snap-1", TREES),
            Err(TreeManifestError::Envelope(_))
        ));
        std::fs::remove_file(SnapshotDir::new(dir.path()).file_manifest()).unwrap();
        assert!(matches!(
            verify(dir.path(), "snap-1", TREES),
            Err(TreeManifestError::Envelope(_))
        ));
    }
}
