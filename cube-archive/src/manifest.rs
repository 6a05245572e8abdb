//! The manifest: what the archive holds, entry by entry, and the checks that make an
//! untrusted one safe to act on.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

/// Most entries one archive may list.
pub const MAX_ENTRIES: usize = 4_000_000;
/// Longest path or symlink target accepted, bytes.
pub const MAX_PATH: usize = 4096;
/// Largest file accepted, bytes (a sparse file of this size costs nothing to create).
pub const MAX_FILE_SIZE: u64 = 1 << 40;
/// Largest extended attribute value accepted, bytes.
pub const MAX_XATTR_VALUE: usize = 64 << 10;
/// Extended attributes an archive may carry: overlayfs's opaque-directory marker (a
/// writable layer needs it) and the user namespace. Anything else (security labels,
/// capabilities, ACLs) would grant or change privileges on the importing host.
pub const XATTR_ALLOWED: &[&str] = &["trusted.overlay.opaque"];
/// Prefix of the other extended attributes an archive may carry.
pub const XATTR_USER_PREFIX: &str = "user.";

/// Why a manifest was refused.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The manifest is not the JSON this format defines.
    #[error("Malformed manifest")]
    Json(#[from] serde_json::Error),
    /// More entries than [`MAX_ENTRIES`].
    #[error("Manifest lists {0} entries, more than the {MAX_ENTRIES} allowed")]
    TooManyEntries(usize),
    /// A path is empty, absolute, has `.`, `..` or empty components, a NUL, or is too
    /// long.
    #[error("Entry path {0:?} is not a plain relative path")]
    BadPath(String),
    /// Entries are not sorted by path, or one is listed twice.
    #[error("Entry {0:?} is out of order or listed twice")]
    Order(String),
    /// An entry's parent is not a directory entry listed before it.
    #[error("Entry {0:?} has no directory entry for its parent")]
    Orphan(String),
    /// A mode has bits beyond the permission and set-id bits.
    #[error("Entry {path:?} has mode {mode:#o}")]
    BadMode {
        /// The entry.
        path: String,
        /// Its mode.
        mode: u32,
    },
    /// A file is larger than [`MAX_FILE_SIZE`].
    #[error("File {0:?} is larger than allowed")]
    TooLarge(String),
    /// A symlink target is empty, has a NUL or is too long.
    #[error("Symlink {0:?} has an unusable target")]
    BadTarget(String),
    /// A device node is not one a sandbox's `/dev` holds.
    #[error("Entry {0:?} is a device node no sandbox's /dev holds")]
    BadDevice(String),
    /// An extended attribute is not one an archive may carry, or its value is too long.
    #[error("Entry {path:?} carries extended attribute {name:?}, which is not allowed")]
    BadXattr {
        /// The entry.
        path: String,
        /// The attribute.
        name: String,
    },
}

/// Everything an archive holds besides the file bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// What the archive is, for whoever reads it (Cube: the snapshot's id, engine,
    /// kind and template). Free-form; validated by its user.
    pub properties: BTreeMap<String, String>,
    /// The tree, sorted by path bytes, every parent before its children.
    pub entries: Vec<Entry>,
}

/// One entry of the tree.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// Relative path, `/`-separated.
    pub path: String,
    /// What it is.
    pub kind: EntryKind,
    /// Permission and set-id bits (`0o7777` at most).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time, seconds since the Unix epoch.
    pub mtime: i64,
    /// Nanoseconds of the modification time.
    #[serde(default)]
    pub mtime_nsec: u32,
    /// Extended attributes (see [`XATTR_ALLOWED`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub xattrs: Vec<Xattr>,
}

/// An extended attribute.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Xattr {
    /// Its name.
    pub name: String,
    /// Its value.
    pub value: Vec<u8>,
}

/// The kind of an entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum EntryKind {
    /// A directory.
    Dir,
    /// A regular file of `size` bytes: the chunks that name it, holes elsewhere, or
    /// the bytes of file `base` of the importer's choosing where `base` is set.
    File {
        /// Its length.
        size: u64,
        /// A file the importer starts from (a template's file, relative to it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        base: Option<String>,
    },
    /// A symbolic link; never followed by the importer.
    Symlink {
        /// What it points at.
        target: String,
    },
    /// An overlayfs whiteout (a character device 0:0): a file of the layer below that
    /// the layer deletes.
    Whiteout,
    /// A character device node, one of [`SANDBOX_DEVICES`]: a jail checkpoint saves its
    /// sandbox's `/dev` (a tmpfs) with the nodes in it. No other device is carried, so
    /// an archive cannot put a node such as `/dev/mem` into a sandbox.
    CharDevice {
        /// Its major number.
        major: u32,
        /// Its minor number.
        minor: u32,
    },
}

/// The character devices a sandbox's `/dev` holds (major, minor): null, zero, full,
/// random, urandom and tty, as cube-jail makes them.
pub const SANDBOX_DEVICES: &[(u32, u32)] = &[(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0)];

impl Manifest {
    /// Parses and validates a manifest.
    pub fn from_json(bytes: &[u8]) -> Result<Manifest, ManifestError> {
        let manifest: Manifest = serde_json::from_slice(bytes)?;
        manifest.validate()?;
        Ok(manifest)
    }

    /// Checks every rule of the module docs; an archive's manifest is acted on only
    /// after this passed.
    pub fn validate(&self) -> Result<(), ManifestError> {
        if self.entries.len() > MAX_ENTRIES {
            return Err(ManifestError::TooManyEntries(self.entries.len()));
        }
        let mut dirs: HashSet<&str> = HashSet::new();
        let mut previous: Option<&str> = None;
        for entry in &self.entries {
            let path = entry.path.as_str();
            if !is_plain_path(path) {
                return Err(ManifestError::BadPath(path.to_string()));
            }
            if previous.is_some_and(|p| p.as_bytes() >= path.as_bytes()) {
                return Err(ManifestError::Order(path.to_string()));
            }
            previous = Some(path);
            if let Some((parent, _)) = path.rsplit_once('/') {
                if !dirs.contains(parent) {
                    return Err(ManifestError::Orphan(path.to_string()));
                }
            }
            if entry.mode & !0o7777 != 0 {
                return Err(ManifestError::BadMode {
                    path: path.to_string(),
                    mode: entry.mode,
                });
            }
            for x in &entry.xattrs {
                let allowed = XATTR_ALLOWED.contains(&x.name.as_str())
                    || (x.name.starts_with(XATTR_USER_PREFIX)
                        && x.name.len() > XATTR_USER_PREFIX.len()
                        && x.name.len() <= 255
                        && !x.name.contains('\0'));
                if !allowed || x.value.len() > MAX_XATTR_VALUE {
                    return Err(ManifestError::BadXattr {
                        path: path.to_string(),
                        name: x.name.clone(),
                    });
                }
            }
            match &entry.kind {
                EntryKind::Dir => {
                    dirs.insert(path);
                }
                EntryKind::File { size, base } => {
                    if *size > MAX_FILE_SIZE {
                        return Err(ManifestError::TooLarge(path.to_string()));
                    }
                    if let Some(base) = base {
                        if !is_plain_path(base) {
                            return Err(ManifestError::BadPath(base.clone()));
                        }
                    }
                }
                EntryKind::Symlink { target } => {
                    if target.is_empty() || target.len() > MAX_PATH || target.contains('\0') {
                        return Err(ManifestError::BadTarget(path.to_string()));
                    }
                }
                EntryKind::Whiteout => {}
                EntryKind::CharDevice { major, minor } => {
                    if !SANDBOX_DEVICES.contains(&(*major, *minor)) {
                        return Err(ManifestError::BadDevice(path.to_string()));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Whether `path` is relative and made of plain components: no empty, `.` or `..`
/// component, no NUL, not too long.
pub fn is_plain_path(path: &str) -> bool {
    !path.is_empty()
        && path.len() <= MAX_PATH
        && !path.contains('\0')
        && path
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != ".." && part.len() <= 255)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str, kind: EntryKind) -> Entry {
        Entry {
            path: path.into(),
            kind,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime: 0,
            mtime_nsec: 0,
            xattrs: Vec::new(),
        }
    }

    fn file(path: &str) -> Entry {
        entry(
            path,
            EntryKind::File {
                size: 3,
                base: None,
            },
        )
    }

    #[test]
    fn a_sorted_tree_passes() {
        let m = Manifest {
            properties: BTreeMap::new(),
            entries: vec![
                entry("a", EntryKind::Dir),
                file("a-b"),
                file("a/b"),
                entry(
                    "l",
                    EntryKind::Symlink {
                        target: "/etc/passwd".into(),
                    },
                ),
            ],
        };
        m.validate().unwrap();
        let json = serde_json::to_vec(&m).unwrap();
        assert_eq!(Manifest::from_json(&json).unwrap(), m);
    }

    #[test]
    fn escaping_and_unordered_paths_are_refused() {
        for bad in ["", "/etc/passwd", "a/../b", "./a", "a//b", "a/", "a\0b"] {
            let m = Manifest {
                properties: BTreeMap::new(),
                entries: vec![file(bad)],
            };
            assert!(
                matches!(m.validate(), Err(ManifestError::BadPath(_))),
                "{bad:?}"
            );
        }
        let twice = Manifest {
            properties: BTreeMap::new(),
            entries: vec![file("a"), file("a")],
        };
        assert!(matches!(twice.validate(), Err(ManifestError::Order(_))));
        let orphan = Manifest {
            properties: BTreeMap::new(),
            entries: vec![file("a/b")],
        };
        assert!(matches!(orphan.validate(), Err(ManifestError::Orphan(_))));
        // A file under a symlink would be written through it.
        let through_link = Manifest {
            properties: BTreeMap::new(),
            entries: vec![
                entry(
                    "a",
                    EntryKind::Symlink {
                        target: "/etc".into(),
                    },
                ),
                file("a/passwd"),
            ],
        };
        assert!(matches!(
            through_link.validate(),
            Err(ManifestError::Orphan(_))
        ));
    }

    #[test]
    fn only_the_devices_of_a_sandboxs_dev_pass() {
        let device = |major, minor| Manifest {
            properties: BTreeMap::new(),
            entries: vec![entry("null", EntryKind::CharDevice { major, minor })],
        };
        device(1, 3).validate().unwrap();
        device(5, 0).validate().unwrap();
        // /dev/mem, /dev/kmsg, a disk.
        for (major, minor) in [(1, 1), (1, 11), (8, 0)] {
            assert!(
                matches!(
                    device(major, minor).validate(),
                    Err(ManifestError::BadDevice(_))
                ),
                "{major}:{minor}"
            );
        }
    }

    #[test]
    fn privileges_are_refused() {
        let mut e = file("a");
        e.mode = 0o100644;
        let m = Manifest {
            properties: BTreeMap::new(),
            entries: vec![e],
        };
        assert!(matches!(m.validate(), Err(ManifestError::BadMode { .. })));
        let mut e = file("a");
        e.xattrs.push(Xattr {
            name: "security.capability".into(),
            value: vec![1],
        });
        let m = Manifest {
            properties: BTreeMap::new(),
            entries: vec![e],
        };
        assert!(matches!(m.validate(), Err(ManifestError::BadXattr { .. })));
    }
}
