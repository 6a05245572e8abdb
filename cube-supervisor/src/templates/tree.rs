//! Building jail templates: a standalone root filesystem tree (from Debian packages or
//! a directory) stored with its [`TemplateMeta`] in the store's templates directory.
//!
//! Everything is made inside a store staging directory and moved into place with one
//! rename when it is complete, so a failed build leaves nothing, and one that was
//! killed leaves only a scratch entry the store's stale-scratch clean-up removes.
//! Sandboxes created from the template see its tree read-only under an overlay
//! (cube-jail's `RootSpec::Overlay`), with their writes in their own layer.

use std::path::{Path, PathBuf};

use cube_storage::TemplateDir;
use cube_vmm::persist::MachineConfig;

use super::debian::{DebianRootfs, RootfsBuildError};
use super::mounts::unmount_all_under;
use crate::jail_spec::locate_agent;
use crate::records::{now_unix, Engine, ProcessDefaults, TemplateMeta, HOST_TEMPLATE};

/// Why a template could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TemplateBuildError {
    /// A template of this name exists (or the name is the built-in one).
    #[error("Template {0} already exists")]
    Exists(String),
    /// The Debian tree could not be built.
    #[error("Building the Debian tree")]
    Debian(#[from] RootfsBuildError),
    /// The source directory is not a directory.
    #[error("{0} is not a directory")]
    NotADirectory(PathBuf),
    /// The container image could not be unpacked.
    #[error("Unpacking the image {0}")]
    Image(PathBuf, #[source] Box<super::oci::OciError>),
    /// The source directory could not be copied.
    #[error("Copying {0}")]
    Copy(PathBuf, #[source] cube_storage::CloneError),
    /// The store failed.
    #[error("Store")]
    Store(#[from] cube_storage::StoreError),
    /// The template record could not be written.
    #[error("Writing the template record")]
    Metadata(#[from] cube_storage::MetadataError),
    /// The tree lacks the program loader the agent needs, so no sandbox could start.
    #[error("The tree has no {0}: the agent (dynamically linked) cannot start in it; include the C library (a Debian tree has it)")]
    NoLoader(String),
    /// Something is still mounted inside the staging tree and could not be unmounted;
    /// the tree is left in place rather than deleted through the mount.
    #[error("{0} is still mounted; not removing the staging tree")]
    Mounted(PathBuf),
}

/// Where a jail template's tree comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TreeSource {
    /// A Debian release with packages, installed by `debootstrap`.
    Debian(DebianRootfs),
    /// A copy of an existing directory (reflinked where the store's filesystem can).
    Directory(PathBuf),
    /// A container image: an OCI image layout (directory or tar) or a `docker save`
    /// archive, its layers applied in order.
    Oci(PathBuf),
}

impl TreeSource {
    /// For people: what the template was built from.
    pub fn describe(&self) -> String {
        match self {
            TreeSource::Debian(d) => format!("debian {} +{}", d.suite, d.packages.join(",")),
            TreeSource::Directory(p) => format!("directory {}", p.display()),
            TreeSource::Oci(p) => format!("image {}", p.display()),
        }
    }
}

/// Builds jail template `name` in `store` from `source`, calling `progress` with each
/// line the build prints. On any failure nothing named `name` is left in the store.
pub fn build(
    store: &cube_storage::Store,
    name: &str,
    source: &TreeSource,
    progress: &mut dyn FnMut(&str),
) -> Result<TemplateMeta, TemplateBuildError> {
    let dest = store.template_dir(name)?;
    if name == HOST_TEMPLATE || dest.exists() {
        return Err(TemplateBuildError::Exists(name.to_string()));
    }
    if let TreeSource::Debian(d) = source {
        // Before anything is created: a bad name is the caller's mistake.
        d.validate()?;
    }
    // What killed builds left (their owner is gone) goes before a new one starts.
    if let Err(e) = store.clean_stale_staging() {
        tracing::warn!(
            "removing stale scratch entries: {}",
            crate::error_report::chain(&e)
        );
    }
    let staging = store.stage()?;
    let result = fill(staging.path(), name, source, progress);
    // debootstrap mounts /proc and /sys inside the tree while it runs; a killed one
    // may leave them there, and deleting through a mount would reach the host's.
    if let Err(still) = unmount_all_under(staging.path()) {
        std::mem::forget(staging);
        return Err(TemplateBuildError::Mounted(still.0));
    }
    let meta = result?;
    staging.commit(&dest)?;
    Ok(meta)
}

fn fill(
    staging: &Path,
    name: &str,
    source: &TreeSource,
    progress: &mut dyn FnMut(&str),
) -> Result<TemplateMeta, TemplateBuildError> {
    let template = TemplateDir::new(staging);
    let tree = template.tree();
    let process = make_tree(&tree, source, progress)?;
    check_agent_can_start(&tree)?;
    let meta = TemplateMeta {
        name: name.to_string(),
        engine: Engine::Jail,
        machine: MachineConfig::default(),
        rootfs_bytes: 0,
        created_unix: now_unix(),
        tree: Some(TemplateDir::TREE.to_string()),
        built_from: Some(source.describe()),
        process,
    };
    cube_storage::write_atomic(&template.record(), TemplateDir::RECORD_KIND, &meta)?;
    Ok(meta)
}

/// Makes the tree `tree` (which must not exist) from `source`, calling `progress` with
/// each line the build prints; returns an image's process defaults. On failure the
/// caller removes what is left (the tree lies in its staging directory).
pub fn make_tree(
    tree: &Path,
    source: &TreeSource,
    progress: &mut dyn FnMut(&str),
) -> Result<Option<ProcessDefaults>, TemplateBuildError> {
    let tree = tree.to_path_buf();
    match source {
        TreeSource::Debian(d) => d.build(&tree, progress)?,
        TreeSource::Directory(dir) => {
            if !std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
                return Err(TemplateBuildError::NotADirectory(dir.clone()));
            }
            progress(&format!("copying {}", dir.display()));
            let stats = cube_storage::clone_tree(dir, &tree)
                .map_err(|e| TemplateBuildError::Copy(dir.clone(), e))?;
            progress(&format!(
                "copied ({} files copied, the rest reflinked)",
                stats.copied_files
            ));
        }
        TreeSource::Oci(image) => {
            // The image's own files, where it is a tar, go next to the tree.
            let scratch = tree.with_file_name("image-files");
            let unpacked = super::oci::unpack(image, &tree, &scratch, progress)
                .map_err(|e| TemplateBuildError::Image(image.clone(), Box::new(e)))?;
            progress(&format!(
                "{} layers applied ({} device nodes left out)",
                unpacked.layers, unpacked.skipped_devices
            ));
            return Ok(Some(unpacked.defaults));
        }
    }
    Ok(None)
}

/// Refuses a tree the agent cannot start in: the agent binary is the host's, bound
/// into the sandbox, and its ELF interpreter must exist inside the tree. Where the
/// agent cannot be found or is static there is nothing to check.
fn check_agent_can_start(tree: &Path) -> Result<(), TemplateBuildError> {
    let Ok(agent) = locate_agent() else {
        return Ok(());
    };
    let Some(interp) = std::fs::read(&agent).ok().and_then(|b| elf_interpreter(&b)) else {
        return Ok(());
    };
    if resolve_in_tree(tree, Path::new(&interp)).is_some_and(|p| p.is_file()) {
        Ok(())
    } else {
        Err(TemplateBuildError::NoLoader(interp))
    }
}

/// The PT_INTERP path of a 64-bit little-endian ELF file, if it has one.
fn elf_interpreter(elf: &[u8]) -> Option<String> {
    const PT_INTERP: u32 = 3;
    if elf.get(..5)? != b"\x7fELF\x02" || *elf.get(5)? != 1 {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    for i in 0..phnum {
        let ph = phoff.checked_add(i.checked_mul(phentsize)?)?;
        if u32_at(ph)? != PT_INTERP {
            continue;
        }
        let offset = usize::try_from(u64_at(ph + 0x08)?).ok()?;
        let size = usize::try_from(u64_at(ph + 0x20)?).ok()?;
        let bytes = elf.get(offset..offset.checked_add(size)?)?;
        let text = bytes.split(|b| *b == 0).next()?;
        return String::from_utf8(text.to_vec()).ok();
    }
    None
}

/// Where absolute `path` leads inside `tree`, following symlinks as the sandbox would
/// see them (absolute targets start again at the tree's root); None on a loop.
fn resolve_in_tree(tree: &Path, path: &Path) -> Option<PathBuf> {
    let mut pending: Vec<std::ffi::OsString> = path
        .components()
        .rev()
        .filter_map(|c| match c {
            std::path::Component::Normal(n) => Some(n.to_os_string()),
            _ => None,
        })
        .collect();
    let mut current = tree.to_path_buf();
    let mut hops = 0;
    while let Some(part) = pending.pop() {
        if part == ".." {
            if current != tree {
                current.pop();
            }
            continue;
        }
        let next = current.join(&part);
        match std::fs::read_link(&next) {
            Ok(target) => {
                hops += 1;
                if hops > 40 {
                    return None;
                }
                if target.is_absolute() {
                    current = tree.to_path_buf();
                }
                for c in target.components().rev() {
                    match c {
                        std::path::Component::Normal(n) => pending.push(n.to_os_string()),
                        std::path::Component::ParentDir => pending.push("..".into()),
                        _ => {}
                    }
                }
            }
            Err(_) => current = next,
        }
    }
    Some(current)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_inside_the_tree_and_elf_interpreters_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path();
        std::fs::create_dir_all(tree.join("usr/lib64")).unwrap();
        std::fs::write(tree.join("usr/lib64/ld.so"), b"x").unwrap();
        // Merged /usr with an absolute link, as Debian has it.
        std::os::unix::fs::symlink("/usr/lib64", tree.join("lib64")).unwrap();
        assert_eq!(
            resolve_in_tree(tree, Path::new("/lib64/ld.so")).unwrap(),
            tree.join("usr/lib64/ld.so")
        );
        std::os::unix::fs::symlink("loop", tree.join("loop")).unwrap();
        assert!(resolve_in_tree(tree, Path::new("/loop/x")).is_none());
        // An escape by `..` stays at the tree's root.
        assert_eq!(
            resolve_in_tree(tree, Path::new("/../../usr")).unwrap(),
            tree.join("usr")
        );
        let own = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let interp = elf_interpreter(&own);
        assert!(
            interp.as_deref().is_some_and(|i| i.starts_with('/')),
            "{interp:?}"
        );
        assert_eq!(elf_interpreter(b"not an elf"), None);
        assert_eq!(elf_interpreter(b"\x7fELF\x02\x01"), None);
    }

    #[test]
    fn a_directory_template_is_built_whole_or_not_at_all() {
        let root = tempfile::tempdir().unwrap();
        let store = cube_storage::Store::open(root.path().join("store")).unwrap();
        let src = root.path().join("src");
        std::fs::create_dir_all(src.join("usr/bin")).unwrap();
        std::fs::write(src.join("usr/bin/tool"), b"#!/bin/sh\n").unwrap();
        std::os::unix::fs::symlink("usr/bin", src.join("bin")).unwrap();
        // The agent's program loader, where the agent (found next to the test binary)
        // is dynamically linked: without it the build is refused.
        let interp = locate_agent()
            .ok()
            .and_then(|a| elf_interpreter(&std::fs::read(a).unwrap()));
        if let Some(interp) = &interp {
            assert!(matches!(
                build(&store, "noloader", &TreeSource::Directory(src.clone()), &mut |_| {}),
                Err(TemplateBuildError::NoLoader(i)) if i == *interp
            ));
            assert!(!store.template_dir("noloader").unwrap().exists());
            let loader = src.join(interp.trim_start_matches('/'));
            std::fs::create_dir_all(loader.parent().unwrap()).unwrap();
            std::fs::write(&loader, b"loader").unwrap();
        }

        let mut lines = Vec::new();
        let meta = build(
            &store,
            "tree",
            &TreeSource::Directory(src.clone()),
            &mut |l| lines.push(l.to_string()),
        )
        .unwrap();
        assert_eq!(meta.engine, Engine::Jail);
        assert!(!lines.is_empty());
        let dir = store.template_dir("tree").unwrap();
        let tree = meta.tree_dir(&dir).unwrap().unwrap();
        assert_eq!(
            std::fs::read(tree.join("usr/bin/tool")).unwrap(),
            b"#!/bin/sh\n"
        );
        assert_eq!(
            std::fs::read_link(tree.join("bin")).unwrap(),
            Path::new("usr/bin")
        );
        let back: TemplateMeta =
            cube_storage::read_verified(&TemplateDir::new(&dir).record(), TemplateDir::RECORD_KIND)
                .unwrap();
        assert_eq!(back.tree.as_deref(), Some(TemplateDir::TREE));

        // The same name again, the built-in name, and a missing source all fail and
        // leave the store as it was (no staging debris either).
        assert!(matches!(
            build(
                &store,
                "tree",
                &TreeSource::Directory(src.clone()),
                &mut |_| {}
            ),
            Err(TemplateBuildError::Exists(_))
        ));
        assert!(matches!(
            build(
                &store,
                HOST_TEMPLATE,
                &TreeSource::Directory(src),
                &mut |_| {}
            ),
            Err(TemplateBuildError::Exists(_))
        ));
        let missing = root.path().join("missing");
        assert!(matches!(
            build(
                &store,
                "other",
                &TreeSource::Directory(missing),
                &mut |_| {}
            ),
            Err(TemplateBuildError::NotADirectory(_))
        ));
        assert!(!store.template_dir("other").unwrap().exists());
        assert_eq!(
            std::fs::read_dir(store.root().join("tmp")).unwrap().count(),
            0
        );
    }

    #[test]
    fn a_record_cannot_point_the_tree_outside_its_template() {
        let mut meta = TemplateMeta {
            name: "t".into(),
            engine: Engine::Jail,
            machine: MachineConfig::default(),
            rootfs_bytes: 0,
            created_unix: 0,
            tree: Some("../../etc".into()),
            built_from: None,
            process: None,
        };
        assert!(meta.tree_dir(Path::new("/store/templates/t")).is_err());
        meta.tree = Some("/etc".into());
        assert!(meta.tree_dir(Path::new("/store/templates/t")).is_err());
        meta.tree = Some("rootfs".into());
        assert_eq!(
            meta.tree_dir(Path::new("/store/templates/t")).unwrap(),
            Some(PathBuf::from("/store/templates/t/rootfs"))
        );
    }
}
