//! Snapshots that travel: [`crate::Runtime::export_snapshot`] writes one into a single
//! file (a [`cube_archive`] archive), [`crate::Runtime::import_snapshot`] puts such a
//! file into another store, on this host or another of the same kind, ready for
//! [`crate::Runtime::create_from_snapshot`].
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

use cube_storage::{SandboxDir, SnapshotDir, Store, TemplateDir};
use cube_supervisor::error_report::chain as error_chain;
use cube_supervisor::records::{
    Engine, SandboxMeta, SnapshotKind, SnapshotMeta, TemplateMeta, HOST_TEMPLATE,
};
use sha2::{Digest, Sha256};

use crate::error::SandboxError;
use crate::portable_error::PortableError;

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
/// Property: the directory its files lie over instead of a template's tree (see
/// [`SandboxMeta::rootfs`]), as a path on the host it was taken on.
const P_ROOTFS: &str = "cube.rootfs";
/// Property: the machine architecture it was taken on.
const P_ARCH: &str = "cube.arch";
/// Write buffer for the archive.
const IO_BUFFER: usize = 4 << 20;

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
    /// The directory the snapshot's files lie over instead of a template's tree (its
    /// sandbox was created on it, [`crate::CreateOptions::rootfs`]: a container's root
    /// filesystem), as a path on this host. The archive does not hold that tree: a
    /// create from the imported snapshot gives one like it.
    pub rootfs: Option<PathBuf>,
}

impl ExportReport {
    /// The template a store must hold to import the archive: the one it names, unless
    /// that is the built-in [`HOST_TEMPLATE`], which every store has (a jail's layer
    /// then lies over the importing host's own userland). None too for a snapshot
    /// over a directory ([`ExportReport::rootfs`]), which needs a tree, not a template.
    pub fn required_template(&self) -> Option<&str> {
        self.template.as_deref().filter(|t| *t != HOST_TEMPLATE)
    }

    /// What a host needs to create from the archive once imported, in words.
    pub fn requirement(&self) -> String {
        match (&self.rootfs, self.required_template(), &self.template) {
            (Some(tree), _, _) => format!(
                "lies over a root directory that is not in the archive ({}): create from it with a tree like it",
                tree.display()
            ),
            (None, Some(t), _) => format!("needs template {t} where it is imported"),
            (None, None, Some(_)) => "lies over the importing host's userland".to_string(),
            (None, None, None) => "needs no template".to_string(),
        }
    }
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
    /// The directory it lies over instead ([`ExportReport::rootfs`]), a path on the
    /// host it was taken on: a create from it gives a tree like it.
    pub rootfs: Option<PathBuf>,
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
fn template_fingerprint(dir: &TemplateDir) -> Result<String, PortableError> {
    let mut hash = Sha256::new();
    for (path, optional) in [(dir.record(), false), (dir.image().state(), true)] {
        match std::fs::read(&path) {
            Ok(bytes) => hash.update(&bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && optional => {}
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

/// For the file at `relative` inside VM snapshot `snapshot`, the template image's file
/// it travels as the difference from (its memory and disk), where the template has it.
fn diffed_base(snapshot: &SnapshotDir, relative: &str, template: &SnapshotDir) -> Option<PathBuf> {
    let file = snapshot.join(relative);
    [
        (snapshot.memory(), template.memory()),
        (snapshot.rootfs(), template.rootfs()),
    ]
    .into_iter()
    .find(|(ours, _)| *ours == file)
    .map(|(_, base)| base)
    .filter(|base| base.is_file())
}

/// The record of the sandbox that owns snapshot `meta`, where it is in `store`.
fn owner(store: &Store, meta: &SnapshotMeta) -> Option<SandboxMeta> {
    store
        .sandbox(&meta.sandbox)
        .ok()
        .and_then(|d| cube_storage::read_verified(&d.record(), SandboxDir::RECORD_KIND).ok())
}

/// The directory snapshot `meta`'s files lie over instead of a template's tree (its
/// sandbox was created on it): recorded in the snapshot (an imported one), else in
/// its sandbox's record.
pub(crate) fn snapshot_rootfs(store: &Store, meta: &SnapshotMeta) -> Option<PathBuf> {
    if meta.template.is_some() {
        return None;
    }
    meta.rootfs
        .clone()
        .or_else(|| owner(store, meta).and_then(|o| o.rootfs))
}

/// The template snapshot `meta`'s files lie over: recorded in the snapshot (an
/// imported one), else in its sandbox's record; [`HOST_TEMPLATE`] for a jail that
/// names none and was not created on a directory of its own (see
/// [`snapshot_rootfs`]).
pub(crate) fn snapshot_template(store: &Store, meta: &SnapshotMeta) -> Option<String> {
    if let Some(t) = &meta.template {
        return Some(t.clone());
    }
    if meta.rootfs.is_some() {
        return None;
    }
    let owner = owner(store, meta);
    if owner.as_ref().is_some_and(|o| o.rootfs.is_some()) {
        return None;
    }
    match meta.engine {
        Engine::Jail => Some(
            owner
                .and_then(|o| o.template)
                .unwrap_or_else(|| HOST_TEMPLATE.to_string()),
        ),
        // A VM sandbox's origin is the template (or snapshot) it was created from.
        Engine::Vm => owner
            .map(|o| o.origin)
            .filter(|origin| store.template(origin).is_ok_and(|d| d.record().is_file())),
    }
}

/// Writes snapshot `snapshot` of `store` into the archive file `dest` (replaced if it
/// exists, written beside it first so that a failed export leaves no half file).
pub(crate) fn export(
    store: &Store,
    snapshot: &str,
    dest: &Path,
) -> Result<ExportReport, SandboxError> {
    let dir = store.snapshot(snapshot)?;
    let meta: SnapshotMeta = cube_storage::read_verified(&dir.record(), SnapshotDir::RECORD_KIND)
        .map_err(|e| match e {
        cube_storage::MetadataError::Read { .. } => {
            SandboxError::UnknownSnapshot(snapshot.to_string())
        }
        other => other.into(),
    })?;
    let template = snapshot_template(store, &meta);
    let rootfs = snapshot_rootfs(store, &meta);
    let mut properties = BTreeMap::from([
        (P_LAYOUT.to_string(), LAYOUT.to_string()),
        (P_ID.to_string(), meta.id.clone()),
        (P_ENGINE.to_string(), meta.engine.to_string()),
        (P_KIND.to_string(), meta.kind.to_string()),
        (P_ARCH.to_string(), std::env::consts::ARCH.to_string()),
    ]);
    if let Some(tree) = &rootfs {
        properties.insert(P_ROOTFS.to_string(), tree.display().to_string());
    }
    let mut template_image = None;
    if let Some(name) = &template {
        properties.insert(P_TEMPLATE.to_string(), name.clone());
        if name != HOST_TEMPLATE {
            let tdir = store.template(name)?;
            properties.insert(P_FINGERPRINT.to_string(), template_fingerprint(&tdir)?);
            template_image = Some(tdir.image());
        }
    }
    let base = |path: &str| -> Option<(String, PathBuf)> {
        let image = template_image
            .as_ref()
            .filter(|_| meta.engine == Engine::Vm)?;
        diffed_base(&dir, path, image).map(|file| (path.to_string(), file))
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
        std::fs::rename(&partial, dest).map_err(fail(format!("creating {}", dest.display())))?;
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
        rootfs,
    })
}

/// Adds the snapshot in archive `source` to `store` under its own id, after checking
/// every byte of it; the store is unchanged when anything is wrong.
pub(crate) fn import(store: &Store, source: &Path) -> Result<ImportReport, SandboxError> {
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
    let dest = store.snapshot(&id)?;
    if dest.exists() {
        return Err(PortableError::Exists(id).into());
    }
    let template = manifest.properties.get(P_TEMPLATE).cloned();
    let mut template_image = None;
    if let Some(name) = template.as_deref().filter(|t| *t != HOST_TEMPLATE) {
        let dir = store.template(name)?;
        if !dir.record().is_file() {
            return Err(PortableError::MissingTemplate(name.to_string()).into());
        }
        let theirs = manifest.properties.get(P_FINGERPRINT);
        if theirs.map(String::as_str) != Some(template_fingerprint(&dir)?.as_str()) {
            return Err(PortableError::TemplateMismatch(name.to_string()).into());
        }
        let recorded: TemplateMeta =
            cube_storage::read_verified(&dir.record(), TemplateDir::RECORD_KIND)?;
        if recorded.engine != engine {
            return Err(PortableError::TemplateMismatch(name.to_string()).into());
        }
        template_image = Some(dir.image());
    }
    // Deleted when dropped, on every path but the commit.
    let staging = store.stage()?;
    let unpacked = SnapshotDir::new(staging.path());
    // The archive makes the directory itself (and refuses one that exists).
    std::fs::remove_dir(&unpacked)
        .map_err(|e| SandboxError::Io(format!("preparing {}", unpacked.display()), e))?;
    let base = |name: &str, at: &Path| -> std::io::Result<()> {
        let file = template_image
            .as_ref()
            .and_then(|image| diffed_base(&unpacked, name, image))
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))?;
        cube_storage::clone_file(&file, at)
            .map(|_| ())
            .map_err(std::io::Error::other)
    };
    let stats = cube_archive::unpack(reader, &manifest, &unpacked, &base)
        .map_err(|e| PortableError::Archive(source.to_path_buf(), e))?;
    let record = unpacked.record();
    let mut meta: SnapshotMeta = cube_storage::read_verified(&record, SnapshotDir::RECORD_KIND)
        .map_err(|e| PortableError::Record(error_chain(&e)))?;
    if meta.id != id || meta.engine != engine || meta.kind.to_string() != property(P_KIND)? {
        return Err(PortableError::Record(format!(
            "it describes {} ({} {}), the archive {id}",
            meta.id, meta.engine, meta.kind
        ))
        .into());
    }
    let rootfs = manifest.properties.get(P_ROOTFS).map(PathBuf::from);
    meta.template = template.clone();
    if engine == Engine::Jail && meta.boot_id.is_none() {
        // An archive of a build that did not flush jail snapshots: this import
        // flushes it, in this boot.
        meta.boot_id = Some(cube_storage::durable_marker::boot_id()?);
    }
    meta.rootfs = rootfs.clone();
    cube_storage::write_atomic(&record, SnapshotDir::RECORD_KIND, &meta)?;
    if let (Engine::Jail, Some(boot)) = (engine, &meta.boot_id) {
        // The marker repeats the boot the record names, as a restore checks.
        let _ = std::fs::remove_file(unpacked.durable_marker());
        cube_storage::durable_marker::make_durable(&unpacked, boot)?;
    }
    if engine == Engine::Vm {
        // The state is checked field by field when restored; here its envelope and the
        // boot it names, which the durability marker must repeat.
        let state_bytes = std::fs::read(unpacked.state())
            .map_err(|e| SandboxError::Io("reading the imported state".into(), e))?;
        let state = cube_vmm::persist::state::decode_file_bytes(&state_bytes)
            .map_err(|e| PortableError::Record(error_chain(&e)))?;
        let _ = std::fs::remove_file(unpacked.durable_marker());
        cube_storage::durable_marker::make_durable(&unpacked, &state.boot_id)?;
    }
    staging.commit(&dest)?;
    Ok(ImportReport {
        snapshot: id,
        engine,
        kind: meta.kind,
        template,
        rootfs,
        archive_bytes: stats.archive_bytes,
    })
}

/// Checks that archive `source` is whole and intact (every chunk and the file's
/// checksum) and returns its properties; writes nothing.
pub(crate) fn verify(source: &Path) -> Result<BTreeMap<String, String>, SandboxError> {
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
