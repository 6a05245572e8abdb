//! Snapshots that travel: [`Runtime::export_snapshot`] writes one into a single file
//! (a [`cube_archive`] archive), [`Runtime::import_snapshot`] puts such a file into
//! another store, on this host or another of the same kind, ready for
//! [`Runtime::create_from_snapshot`].
//!
//! The archive holds the snapshot directory whole: a jail's writable layer (already the
//! difference from its template's tree) and CRIU images, a VM's state, memory and disk.
//! A VM's memory and disk travel as their difference from the template the sandbox was
//! created from, which the importing store must hold, built identically (its
//! fingerprint is checked). Memory files go as sparse, compressed chunks.
//!
//! Import trusts nothing before it has checked everything: the archive is unpacked into
//! a staging directory under the store's scratch space, every chunk and the whole
//! file's checksum verified, the snapshot's own records re-read and checked, and only
//! then is the directory renamed into the store. On any failure the staging directory
//! goes and the store is as it was.

use std::collections::BTreeMap;
use std::io::{BufReader, BufWriter};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::metadata::{
    Engine, SandboxMeta, SnapshotKind, SnapshotMeta, TemplateMeta, SANDBOX_META, SANDBOX_META_KIND,
    SNAPSHOT_META, SNAPSHOT_META_KIND, TEMPLATE_META, TEMPLATE_META_KIND,
};
use super::{Runtime, SandboxError, HOST_TEMPLATE};
use crate::snapshot::durability::DURABLE_FILE;
use crate::snapshot::format::{MEMORY_FILE, ROOTFS_FILE, STATE_FILE};

/// Property: archive layout of Cube's snapshot (bumped when what the tree holds
/// changes meaning).
const P_LAYOUT: &str = "cube.layout";
/// The layout this build writes and reads.
const LAYOUT: &str = "1";
/// Property: the snapshot's id.
const P_ID: &str = "cube.snapshot";
/// Property: its engine.
const P_ENGINE: &str = "cube.engine";
/// Property: its kind.
const P_KIND: &str = "cube.kind";
/// Property: the template its files lie over, or whose files a VM's differ from.
const P_TEMPLATE: &str = "cube.template";
/// Property: that template's fingerprint (see [`template_fingerprint`]).
const P_FINGERPRINT: &str = "cube.template.fingerprint";
/// Property: the machine architecture it was taken on.
const P_ARCH: &str = "cube.arch";
/// VM snapshot files that travel as their difference from the template's.
const DIFFED_FILES: &[&str] = &[MEMORY_FILE, ROOTFS_FILE];
/// Write buffer for the archive.
const IO_BUFFER: usize = 4 << 20;

/// Why a snapshot could not be exported or imported.
#[derive(Debug, thiserror::Error)]
pub enum PortableError {
    /// The archive file could not be written.
    #[error("Writing {0}")]
    Write(PathBuf, #[source] cube_archive::PackError),
    /// The archive file could not be opened or finished.
    #[error("{0}")]
    File(String, #[source] std::io::Error),
    /// The archive was refused: damaged, truncated, tampered with, or not an archive.
    #[error("{0} is not a usable snapshot archive")]
    Archive(PathBuf, #[source] cube_archive::UnpackError),
    /// The archive's header could not be read.
    #[error("{0} is not a usable snapshot archive")]
    Header(PathBuf, #[source] cube_archive::ReadError),
    /// The archive does not describe a Cube snapshot this build can import.
    #[error("{path} is not a Cube snapshot this build can import: {why}")]
    NotASnapshot {
        /// The archive.
        path: PathBuf,
        /// What is missing or wrong.
        why: String,
    },
    /// The snapshot was taken on another machine architecture.
    #[error("The snapshot was taken on {theirs}; this host is {ours}")]
    Arch {
        /// Where it was taken.
        theirs: String,
        /// This host.
        ours: String,
    },
    /// The template the snapshot lies over is not in this store.
    #[error("The snapshot needs template {0}, which this store does not have (build or import it first)")]
    MissingTemplate(String),
    /// The template of that name here is not the one the snapshot was taken over.
    #[error(
        "Template {0} here is not the one the snapshot was taken over (it was built differently)"
    )]
    TemplateMismatch(String),
    /// A snapshot of this id is already in the store.
    #[error("Snapshot {0} is already in this store")]
    Exists(String),
    /// The unpacked snapshot's own records are damaged or disagree with the archive.
    #[error("The archive's snapshot record is unusable: {0}")]
    Record(String),
}

/// What an export wrote.
#[derive(Clone, Debug)]
pub struct ExportReport {
    /// The snapshot.
    pub snapshot: String,
    /// The archive's length, bytes.
    pub archive_bytes: u64,
    /// Sum of the snapshot's file lengths, bytes (holes included).
    pub file_bytes: u64,
    /// Bytes that travelled as data (holes, zero ranges and template ranges left out).
    pub data_bytes: u64,
    /// The template named in the archive.
    pub template: Option<String>,
}

/// What an import added.
#[derive(Clone, Debug)]
pub struct ImportReport {
    /// The snapshot now in the store.
    pub snapshot: String,
    /// Its engine.
    pub engine: Engine,
    /// Its kind.
    pub kind: SnapshotKind,
    /// The template it lies over.
    pub template: Option<String>,
    /// The archive's length, bytes.
    pub archive_bytes: u64,
}

fn fail(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> PortableError {
    let what = what.to_string();
    move |e| PortableError::File(what, e)
}

/// A fingerprint of template `dir` that differs between two builds of a template of the
/// same name: the hash of its record (which holds its build time) and, for a VM
/// template, of its state file (which holds its boot).
fn template_fingerprint(dir: &Path) -> Result<String, PortableError> {
    let mut hash = Sha256::new();
    for name in [TEMPLATE_META, STATE_FILE] {
        let path = dir.join(name);
        match std::fs::read(&path) {
            Ok(bytes) => hash.update(&bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && name == STATE_FILE => {}
            Err(e) => {
                return Err(PortableError::File(
                    format!("reading {}", path.display()),
                    e,
                ))
            }
        }
    }
    Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

impl Runtime {
    /// The template snapshot `meta`'s files lie over: recorded in the snapshot (an
    /// imported one), else in its sandbox's record; [`HOST_TEMPLATE`] for a jail that
    /// names none.
    pub(crate) fn snapshot_template(&self, meta: &SnapshotMeta) -> Option<String> {
        if let Some(t) = &meta.template {
            return Some(t.clone());
        }
        let owner: Option<SandboxMeta> =
            self.store().sandbox_dir(&meta.sandbox).ok().and_then(|d| {
                cube_storage::read_verified(&d.join(SANDBOX_META), SANDBOX_META_KIND).ok()
            });
        match meta.engine {
            Engine::Jail => Some(
                owner
                    .and_then(|o| o.template)
                    .unwrap_or_else(|| HOST_TEMPLATE.to_string()),
            ),
            // A VM sandbox's origin is the template (or snapshot) it was created from.
            Engine::Vm => owner.map(|o| o.origin).filter(|origin| {
                self.store()
                    .template_dir(origin)
                    .is_ok_and(|d| d.join(TEMPLATE_META).is_file())
            }),
        }
    }

    /// Writes snapshot `snapshot` into the archive file `dest` (replaced if it exists,
    /// written beside it first so that a failed export leaves no half file).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let rt = cube_core::Runtime::open(cube_core::RuntimeConfig::new()?)?;
    /// let report = rt.export_snapshot("snap-0123456789abcdef", "/tmp/snap.cube".as_ref())?;
    /// println!("{} bytes", report.archive_bytes);
    /// # Ok(())
    /// # }
    /// ```
    pub fn export_snapshot(
        &self,
        snapshot: &str,
        dest: &Path,
    ) -> Result<ExportReport, SandboxError> {
        let dir = self.store().snapshot_dir(snapshot)?;
        let meta: SnapshotMeta =
            cube_storage::read_verified(&dir.join(SNAPSHOT_META), SNAPSHOT_META_KIND).map_err(
                |e| match e {
                    cube_storage::MetadataError::Read { .. } => {
                        SandboxError::UnknownSnapshot(snapshot.to_string())
                    }
                    other => other.into(),
                },
            )?;
        let template = self.snapshot_template(&meta);
        let mut properties = BTreeMap::from([
            (P_LAYOUT.to_string(), LAYOUT.to_string()),
            (P_ID.to_string(), meta.id.clone()),
            (P_ENGINE.to_string(), meta.engine.to_string()),
            (P_KIND.to_string(), meta.kind.to_string()),
            (P_ARCH.to_string(), std::env::consts::ARCH.to_string()),
        ]);
        let mut template_dir = None;
        if let Some(name) = &template {
            properties.insert(P_TEMPLATE.to_string(), name.clone());
            if name != HOST_TEMPLATE {
                let tdir = self.store().template_dir(name)?;
                properties.insert(P_FINGERPRINT.to_string(), template_fingerprint(&tdir)?);
                template_dir = Some(tdir);
            }
        }
        let base = |path: &str| -> Option<(String, PathBuf)> {
            let tdir = template_dir
                .as_ref()
                .filter(|_| meta.engine == Engine::Vm)?;
            let file = tdir.join(path);
            (DIFFED_FILES.contains(&path) && file.is_file()).then(|| (path.to_string(), file))
        };
        let partial = dest.with_file_name(format!(
            ".{}.partial",
            dest.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        ));
        let result = (|| -> Result<cube_archive::PackStats, PortableError> {
            let file = std::fs::File::create(&partial)
                .map_err(fail(format!("creating {}", partial.display())))?;
            let mut out = BufWriter::with_capacity(IO_BUFFER, file);
            let stats = cube_archive::pack(
                &dir,
                &mut out,
                &cube_archive::PackOptions {
                    properties,
                    base: &base,
                },
            )
            .map_err(|e| PortableError::Write(dest.to_path_buf(), e))?;
            let file = out.into_inner().map_err(|e| {
                PortableError::File(format!("writing {}", dest.display()), e.into_error())
            })?;
            file.sync_all()
                .map_err(fail(format!("flushing {}", dest.display())))?;
            std::fs::rename(&partial, dest)
                .map_err(fail(format!("creating {}", dest.display())))?;
            Ok(stats)
        })();
        let stats = match result {
            Ok(stats) => stats,
            Err(e) => {
                let _ = std::fs::remove_file(&partial);
                return Err(e.into());
            }
        };
        Ok(ExportReport {
            snapshot: meta.id,
            archive_bytes: stats.archive_bytes,
            file_bytes: stats.file_bytes,
            data_bytes: stats.data_bytes,
            template,
        })
    }

    /// Adds the snapshot in archive `source` to this store under its own id, after
    /// checking every byte of it; the store is unchanged when anything is wrong.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let rt = cube_core::Runtime::open(cube_core::RuntimeConfig::new()?)?;
    /// let imported = rt.import_snapshot("/tmp/snap.cube".as_ref())?;
    /// let sb = rt.create_from_snapshot(&imported.snapshot, cube_core::CreateOptions::new(false))?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn import_snapshot(&self, source: &Path) -> Result<ImportReport, SandboxError> {
        let file =
            std::fs::File::open(source).map_err(fail(format!("opening {}", source.display())))?;
        let (reader, manifest) =
            cube_archive::ArchiveReader::open(BufReader::with_capacity(IO_BUFFER, file))
                .map_err(|e| PortableError::Header(source.to_path_buf(), e))?;
        let property = |key: &str| -> Result<&str, PortableError> {
            manifest
                .properties
                .get(key)
                .map(String::as_str)
                .ok_or_else(|| PortableError::NotASnapshot {
                    path: source.to_path_buf(),
                    why: format!("it has no {key}"),
                })
        };
        let layout = property(P_LAYOUT)?;
        if layout != LAYOUT {
            return Err(PortableError::NotASnapshot {
                path: source.to_path_buf(),
                why: format!("its layout is {layout}; this build reads {LAYOUT}"),
            }
            .into());
        }
        let arch = property(P_ARCH)?;
        if arch != std::env::consts::ARCH {
            return Err(PortableError::Arch {
                theirs: arch.to_string(),
                ours: std::env::consts::ARCH.to_string(),
            }
            .into());
        }
        let id = property(P_ID)?.to_string();
        let engine = match property(P_ENGINE)? {
            "jail" => Engine::Jail,
            "vm" => Engine::Vm,
            other => {
                return Err(PortableError::NotASnapshot {
                    path: source.to_path_buf(),
                    why: format!("unknown engine {other:?}"),
                }
                .into())
            }
        };
        // Checks the id is a plain name before it becomes a path.
        let dest = self.store().snapshot_dir(&id)?;
        if dest.exists() {
            return Err(PortableError::Exists(id).into());
        }
        let template = manifest.properties.get(P_TEMPLATE).cloned();
        let mut template_dir = None;
        if let Some(name) = template.as_deref().filter(|t| *t != HOST_TEMPLATE) {
            let dir = self.store().template_dir(name)?;
            if !dir.join(TEMPLATE_META).is_file() {
                return Err(PortableError::MissingTemplate(name.to_string()).into());
            }
            let theirs = manifest.properties.get(P_FINGERPRINT);
            if theirs.map(String::as_str) != Some(template_fingerprint(&dir)?.as_str()) {
                return Err(PortableError::TemplateMismatch(name.to_string()).into());
            }
            let recorded: TemplateMeta =
                cube_storage::read_verified(&dir.join(TEMPLATE_META), TEMPLATE_META_KIND)?;
            if recorded.engine != engine {
                return Err(PortableError::TemplateMismatch(name.to_string()).into());
            }
            template_dir = Some(dir);
        }
        let base = |name: &str, at: &Path| -> std::io::Result<()> {
            let dir = template_dir
                .as_ref()
                .filter(|_| DIFFED_FILES.contains(&name))
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))?;
            cube_storage::clone_file(&dir.join(name), at)
                .map(|_| ())
                .map_err(std::io::Error::other)
        };
        let staging = self
            .store()
            .root()
            .join("tmp")
            .join(cube_storage::scratch_entry_name("import").map_err(SandboxError::Store)?);
        let stats = cube_archive::unpack(reader, &manifest, &staging, &base)
            .map_err(|e| PortableError::Archive(source.to_path_buf(), e))?;
        let committed = (|| -> Result<ImportReport, SandboxError> {
            let record = staging.join(SNAPSHOT_META);
            let mut meta: SnapshotMeta =
                cube_storage::read_verified(&record, SNAPSHOT_META_KIND)
                    .map_err(|e| PortableError::Record(crate::error_report::chain(&e)))?;
            if meta.id != id || meta.engine != engine || meta.kind.to_string() != property(P_KIND)?
            {
                return Err(PortableError::Record(format!(
                    "it describes {} ({} {}), the archive {id}",
                    meta.id, meta.engine, meta.kind
                ))
                .into());
            }
            meta.template = template.clone();
            let bytes = serde_json::to_vec(&meta)
                .map_err(|e| SandboxError::Io("encoding the snapshot record".into(), e.into()))?;
            cube_storage::write_atomic_bytes(&record, SNAPSHOT_META_KIND, &bytes)?;
            if engine == Engine::Vm {
                // The state is checked field by field when restored; here its envelope
                // and the boot it names, which the durability marker must repeat.
                let state_bytes = std::fs::read(staging.join(STATE_FILE))
                    .map_err(|e| SandboxError::Io("reading the imported state".into(), e))?;
                let state = crate::snapshot::format::decode_file_bytes(&state_bytes)
                    .map_err(|e| PortableError::Record(crate::error_report::chain(&e)))?;
                let _ = std::fs::remove_file(staging.join(DURABLE_FILE));
                crate::snapshot::durability::make_durable(&staging, &state.boot_id)?;
            }
            std::fs::rename(&staging, &dest)
                .map_err(|e| SandboxError::Io(format!("adding {}", dest.display()), e))?;
            Ok(ImportReport {
                snapshot: id.clone(),
                engine,
                kind: meta.kind,
                template: template.clone(),
                archive_bytes: stats.archive_bytes,
            })
        })();
        if committed.is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        committed
    }

    /// Removes snapshot `snapshot` from the store (an imported one, or one no longer
    /// wanted); sandboxes created from it keep running on their own copies.
    pub fn remove_snapshot(&self, snapshot: &str) -> Result<(), SandboxError> {
        let dir = self.store().snapshot_dir(snapshot)?;
        if !dir.join(SNAPSHOT_META).is_file() {
            return Err(SandboxError::UnknownSnapshot(snapshot.to_string()));
        }
        self.store().remove_snapshot(snapshot)?;
        Ok(())
    }

    /// Writes nothing; checks that archive `source` is whole and intact (every chunk
    /// and the file's checksum) and returns its properties.
    pub fn verify_snapshot_archive(
        &self,
        source: &Path,
    ) -> Result<BTreeMap<String, String>, SandboxError> {
        let file =
            std::fs::File::open(source).map_err(fail(format!("opening {}", source.display())))?;
        let (mut reader, manifest) =
            cube_archive::ArchiveReader::open(BufReader::with_capacity(IO_BUFFER, file))
                .map_err(|e| PortableError::Header(source.to_path_buf(), e))?;
        reader
            .verify_rest()
            .map_err(|e| PortableError::Header(source.to_path_buf(), e))?;
        Ok(manifest.properties)
    }
}
