//! A container's root filesystem inside a VM pod's guest: the host cannot mount
//! anything in a guest, so it sends the container's root as a tar archive (a file it
//! writes in the guest first), and the agent, the guest's init and root there, unpacks
//! it into a directory of its own, with the guest's `/proc` and `/dev` in it, for
//! [`crate::protocol::RequestBody::ExecInRoot`] to run the container's processes in.
//! A jail's agent may not mount: there the host shows the root itself, and these
//! requests are refused.
//!
//! The archive comes from the host, which has it from containerd's snapshot; what
//! it holds is the guest's own business (the guest is the sandbox), but its entries
//! still cannot land outside the root: it is unpacked by a thread whose root
//! directory is the container's root (`unshare(CLONE_FS)` and `chroot`), where an
//! absolute name or a link the archive made leads into the container's root as it
//! will for its processes, and entries with `..` are refused.

use std::fs;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::protocol::{ErrorCode, ErrorReply};

/// Why a container's root could not be set up or taken away.
#[derive(Debug, thiserror::Error)]
pub enum ContainerRootError {
    /// The request names an unusable path.
    #[error("invalid container root {0:?}: {1}")]
    Invalid(String, &'static str),
    /// The root exists already.
    #[error("container root {0} exists already")]
    Exists(PathBuf),
    /// The archive could not be read or unpacked.
    #[error("unpacking {archive} into {root}")]
    Unpack {
        /// The archive.
        archive: PathBuf,
        /// The root.
        root: PathBuf,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// A filesystem call failed.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which path.
        path: PathBuf,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// A mount or unmount failed.
    #[error("{op} {path}")]
    Mount {
        /// What was being done.
        op: &'static str,
        /// On which path.
        path: PathBuf,
        /// The failure.
        #[source]
        source: nix::Error,
    },
    /// Something stays mounted beneath the root, which is therefore not removed.
    #[error("{0} is still mounted: the container root is kept")]
    StillMounted(PathBuf),
}

impl ContainerRootError {
    /// The error reply for the host.
    pub fn to_reply(&self) -> ErrorReply {
        let message = crate::exec::error_chain(self);
        match self {
            ContainerRootError::Invalid(..) => ErrorReply::new(ErrorCode::InvalidArgument, message),
            ContainerRootError::Exists(_) => ErrorReply::new(ErrorCode::AlreadyExists, message),
            ContainerRootError::Unpack { source, .. } | ContainerRootError::Io { source, .. } => {
                ErrorReply::from_io(source, message)
            }
            ContainerRootError::Mount { source, .. } => {
                ErrorReply::from_io(&std::io::Error::from(*source), message)
            }
            ContainerRootError::StillMounted(_) => ErrorReply::new(ErrorCode::Busy, message),
        }
    }
}

/// An absolute path without `..`, `.` or empty components, and not `/` itself.
fn checked(root: &str) -> Result<PathBuf, ContainerRootError> {
    let invalid = |why| ContainerRootError::Invalid(root.to_string(), why);
    if root.contains('\0') {
        return Err(invalid("it contains a NUL byte"));
    }
    let path = Path::new(root);
    if !path.is_absolute() {
        return Err(invalid("it is not absolute"));
    }
    let mut parts = 0;
    for c in path.components() {
        match c {
            std::path::Component::RootDir => {}
            std::path::Component::Normal(_) => parts += 1,
            _ => return Err(invalid("it has . or .. in it")),
        }
    }
    if parts == 0 {
        return Err(invalid("it is the guest's root"));
    }
    Ok(path.to_path_buf())
}

/// Unpacks the tar archive at `archive` into the new directory `root` (its parents
/// made), removes the archive, and mounts a `/proc` and the guest's `/dev` in it.
/// Owners, modes and times are the archive's; a later entry replaces an earlier one of
/// the same name. Whatever fails, the archive is
/// removed and no half-made root is left.
pub fn install(archive: &str, root: &str) -> Result<(), ContainerRootError> {
    let archive = checked(archive)?;
    let root = checked(root)?;
    let result = make_root(&root).and_then(|()| {
        let filled = unpack_and_mount(&archive, &root);
        if filled.is_err() {
            let _ = remove_tree(&root);
        }
        filled
    });
    let _ = fs::remove_file(&archive);
    result
}

/// Makes `root` (and its parents); refused where it exists.
fn make_root(root: &Path) -> Result<(), ContainerRootError> {
    if fs::symlink_metadata(root).is_ok() {
        return Err(ContainerRootError::Exists(root.to_path_buf()));
    }
    if let Some(parent) = root.parent() {
        fs::create_dir_all(parent).map_err(|source| ContainerRootError::Io {
            op: "creating",
            path: parent.to_path_buf(),
            source,
        })?;
    }
    fs::create_dir(root).map_err(|source| ContainerRootError::Io {
        op: "creating",
        path: root.to_path_buf(),
        source,
    })
}

fn unpack_and_mount(archive: &Path, root: &Path) -> Result<(), ContainerRootError> {
    let unpack_error = |source| ContainerRootError::Unpack {
        archive: archive.to_path_buf(),
        root: root.to_path_buf(),
        source,
    };
    let file = fs::File::open(archive).map_err(unpack_error)?;
    unpack_confined(file, root).map_err(unpack_error)?;
    for (dir, source, fs_type, flags) in [
        (
            "proc",
            "proc",
            Some("proc"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        ),
        ("dev", "/dev", None, MsFlags::MS_BIND | MsFlags::MS_REC),
    ] {
        let target = mount_point(root, dir)?;
        mount(Some(source), &target, fs_type, flags, None::<&str>).map_err(|source| {
            ContainerRootError::Mount {
                op: "mounting",
                path: target.clone(),
                source,
            }
        })?;
    }
    Ok(())
}

/// Unpacks `archive` into `root` from a thread whose root directory is `root`
/// (`unshare(CLONE_FS)`, then `chroot`; the agent's other threads keep the guest's):
/// no name in the archive and no link it made can lead a write out of `root`, with no
/// per-entry check of where a path leads. (The tar reader's own unpacking
/// canonicalizes every entry's parent twice: most of its system calls, each slow where
/// the guest kernel is emulated.)
fn unpack_confined(archive: fs::File, root: &Path) -> std::io::Result<()> {
    let root = root.to_path_buf();
    std::thread::Builder::new()
        .name("unpack-root".into())
        .spawn(move || -> std::io::Result<()> {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_FS)?;
            nix::unistd::chroot(&root)?;
            std::env::set_current_dir("/")?;
            unpack_entries(archive)
        })?
        .join()
        .map_err(|_| std::io::Error::other("the unpacking thread panicked"))?
}

/// `name` (an entry's) as an absolute path in the (chrooted) root; `None` for the
/// root itself. A `..` is refused.
fn in_root(name: &Path) -> std::io::Result<Option<PathBuf>> {
    let mut path = PathBuf::from("/");
    for part in name.components() {
        match part {
            std::path::Component::Normal(part) => path.push(part),
            std::path::Component::RootDir | std::path::Component::CurDir => {}
            _ => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("entry {} leads out of the root", name.display()),
                ))
            }
        }
    }
    Ok((path != Path::new("/")).then_some(path))
}

/// Unpacks every entry of the tar archive (gzipped or not) at its name under `/` (the
/// thread's root): owners, modes and times the archive's, a later entry replacing an
/// earlier one of the same name (the spec's binds come after the image's files).
/// Directories get their modes last, as a read-only one must still take its entries;
/// a parent missing from the archive is made.
fn unpack_entries(archive: fs::File) -> std::io::Result<()> {
    // Large reads: each system call is slow where the guest kernel is emulated.
    let mut reader = std::io::BufReader::with_capacity(1 << 20, archive);
    let gzipped = std::io::BufRead::fill_buf(&mut reader)?.starts_with(&[0x1f, 0x8b]);
    let reader: Box<dyn std::io::Read> = if gzipped {
        Box::new(flate2::read::GzDecoder::new(reader))
    } else {
        Box::new(reader)
    };
    let mut tar = tar::Archive::new(reader);
    tar.set_preserve_permissions(true);
    tar.set_preserve_ownerships(true);
    tar.set_preserve_mtime(true);
    tar.set_overwrite(true);
    let mut made: std::collections::HashSet<PathBuf> = [PathBuf::from("/")].into();
    let mut directories = Vec::new();
    for entry in tar.entries()? {
        let mut entry = entry?;
        let Some(path) = in_root(&entry.path()?)? else {
            continue;
        };
        if let Some(parent) = path.parent() {
            if !made.contains(parent) {
                fs::create_dir_all(parent).map_err(at(&path))?;
                made.insert(parent.to_path_buf());
            }
        }
        if entry.header().entry_type() == tar::EntryType::Directory {
            match fs::create_dir(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                    return Err(at(&path)(e))
                }
                _ => {}
            }
            made.insert(path.clone());
            directories.push((path, entry));
        } else {
            entry.unpack(&path).map_err(at(&path))?;
        }
    }
    directories.sort_by(|a, b| b.0.cmp(&a.0));
    for (path, mut entry) in directories {
        entry.unpack(&path).map_err(at(&path))?;
    }
    Ok(())
}

/// An error of unpacking the entry at `path`, saying which.
fn at(path: &Path) -> impl Fn(std::io::Error) -> std::io::Error + '_ {
    move |e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// `root/name` as a directory to mount on: made where missing; refused where the
/// image put something else there (a link could lead the mount out of the root).
fn mount_point(root: &Path, name: &str) -> Result<PathBuf, ContainerRootError> {
    let target = root.join(name);
    match fs::symlink_metadata(&target) {
        Ok(m) if m.is_dir() => Ok(target),
        Ok(_) => Err(ContainerRootError::Invalid(
            target.display().to_string(),
            "the image has something else than a directory there",
        )),
        Err(_) => fs::create_dir(&target)
            .map(|()| target.clone())
            .map_err(|source| ContainerRootError::Io {
                op: "creating",
                path: target,
                source,
            }),
    }
}

/// Unmounts what [`install`] mounted in `root` and removes the tree. A root that is
/// not there is removed already.
pub fn remove(root: &str) -> Result<(), ContainerRootError> {
    let root = checked(root)?;
    if fs::symlink_metadata(&root).is_err() {
        return Ok(());
    }
    remove_tree(&root)
}

fn remove_tree(root: &Path) -> Result<(), ContainerRootError> {
    for dir in ["proc", "dev"] {
        let target = root.join(dir);
        // Detaching takes the mounts beneath (the recursive bind of /dev) along.
        match umount2(&target, MntFlags::MNT_DETACH) {
            Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => {}
            Err(source) => {
                return Err(ContainerRootError::Mount {
                    op: "unmounting",
                    path: target,
                    source,
                })
            }
        }
    }
    // Never remove through a mount: the guest's /dev or /proc would go with it.
    if let Some(mounted) = mounted_in(root) {
        return Err(ContainerRootError::StillMounted(mounted));
    }
    fs::remove_dir_all(root).map_err(|source| ContainerRootError::Io {
        op: "removing",
        path: root.to_path_buf(),
        source,
    })
}

/// The first of `root`'s `proc` and `dev` that is on another filesystem than `root`
/// (a mount the unmount left), if any.
fn mounted_in(root: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let device = fs::symlink_metadata(root).ok()?.dev();
    ["proc", "dev"]
        .iter()
        .map(|dir| root.join(dir))
        .find(|path| fs::symlink_metadata(path).is_ok_and(|m| m.dev() != device))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roots_must_be_absolute_plain_paths() {
        for bad in ["", "rel/x", "/", "/a/../b", "/a\0b"] {
            assert!(
                matches!(checked(bad), Err(ContainerRootError::Invalid(..))),
                "{bad:?}"
            );
        }
        assert_eq!(
            checked("/.cube-containers/c1").unwrap(),
            Path::new("/.cube-containers/c1")
        );
    }

    fn archive_of(dir: &Path, build: impl FnOnce(&mut tar::Builder<fs::File>)) -> PathBuf {
        let path = dir.join("root.tar");
        let mut builder = tar::Builder::new(fs::File::create(&path).unwrap());
        build(&mut builder);
        builder.finish().unwrap();
        path
    }

    fn entry(
        builder: &mut tar::Builder<fs::File>,
        kind: tar::EntryType,
        name: &str,
        link: Option<&str>,
        data: &[u8],
    ) {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_size(data.len() as u64);
        header.set_mode(0o755);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        if let Some(link) = link {
            header.set_link_name(link).unwrap();
        }
        builder.append_data(&mut header, name, data).unwrap();
    }

    /// Unpacking (the mounts need root in a guest, so the test stops before them: a
    /// file stands where `/proc` goes, which is refused, and the half-made root goes).
    #[test]
    fn an_archive_unpacks_inside_the_root_only() {
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: unpacking chroots, which needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        let archive = archive_of(dir.path(), |b| {
            entry(b, tar::EntryType::Directory, "bin", None, b"");
            entry(b, tar::EntryType::Regular, "bin/tool", None, b"#!/bin/sh\n");
            entry(
                b,
                tar::EntryType::Symlink,
                "escape",
                Some(outside.to_str().unwrap()),
                b"",
            );
            entry(b, tar::EntryType::Regular, "escape/planted", None, b"x");
        });
        let root = dir.path().join("roots/c1");
        // The link leads to the test's directory as the container sees it: a path in
        // its root, missing there, so the write through it fails.
        let err = install(archive.to_str().unwrap(), root.to_str().unwrap()).unwrap_err();
        let chain = crate::exec::error_chain(&err);
        assert!(
            matches!(err, ContainerRootError::Unpack { .. }) && chain.contains("escape/planted"),
            "{chain}"
        );
        assert!(!outside.join("planted").exists(), "written through a link");
        assert!(!root.exists(), "half-made root left");
        assert!(!archive.exists(), "archive left");

        // An absolute name and a link's target are the container root's: written
        // there, nowhere else.
        let archive = archive_of(dir.path(), |b| {
            entry(b, tar::EntryType::Symlink, "etc", Some("/data"), b"");
            entry(b, tar::EntryType::Directory, "data", None, b"");
            entry(b, tar::EntryType::Regular, "etc/conf", None, b"in the root");
            entry(
                b,
                tar::EntryType::Symlink,
                "escape",
                Some(outside.to_str().unwrap()),
                b"",
            );
            entry(
                b,
                tar::EntryType::Regular,
                "deep/er/file",
                None,
                b"parents made",
            );
        });
        let plain = dir.path().join("plain");
        fs::create_dir(&plain).unwrap();
        unpack_confined(fs::File::open(&archive).unwrap(), &plain).unwrap();
        assert_eq!(fs::read(plain.join("data/conf")).unwrap(), b"in the root");
        assert_eq!(
            fs::read(plain.join("deep/er/file")).unwrap(),
            b"parents made"
        );
        assert!(
            fs::read_dir(&outside).unwrap().next().is_none(),
            "written outside"
        );

        // A gzipped archive (what the shim sends) unpacks the same.
        let gzipped = dir.path().join("root.tar.gz");
        let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
            fs::File::create(&gzipped).unwrap(),
            flate2::Compression::fast(),
        ));
        let mut header = tar::Header::new_gnu();
        header.set_size(7);
        header.set_mode(0o640);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        builder
            .append_data(&mut header, "etc/zipped", &b"inflated"[..7])
            .unwrap();
        builder.into_inner().unwrap().finish().unwrap();
        unpack_confined(fs::File::open(&gzipped).unwrap(), &plain).unwrap();
        assert_eq!(fs::read(plain.join("data/zipped")).unwrap(), b"inflate");

        // `..` is refused (the tar writer takes no `..` in a name: the header is
        // written by hand).
        let archive = archive_of(dir.path(), |b| {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(tar::EntryType::Regular);
            header.set_size(1);
            header.set_mode(0o644);
            header.as_gnu_mut().unwrap().name[..9].copy_from_slice(b"../uplift");
            header.set_cksum();
            b.append(&header, &b"x"[..]).unwrap();
        });
        let err = unpack_confined(fs::File::open(&archive).unwrap(), &plain).unwrap_err();
        assert!(
            err.to_string().contains("../uplift leads out of the root"),
            "{err}"
        );
        assert!(!dir.path().join("uplift").exists());

        let archive = archive_of(dir.path(), |b| {
            entry(b, tar::EntryType::Regular, "bin-tool", None, b"#!/bin/sh\n");
            entry(b, tar::EntryType::Regular, "proc", None, b"not a directory");
        });
        let err = install(archive.to_str().unwrap(), root.to_str().unwrap()).unwrap_err();
        let chain = crate::exec::error_chain(&err);
        assert!(chain.contains("something else than a directory"), "{chain}");
        assert!(!root.exists());

        fs::create_dir_all(&root).unwrap();
        let archive = archive_of(dir.path(), |_| {});
        let err = install(archive.to_str().unwrap(), root.to_str().unwrap()).unwrap_err();
        assert!(matches!(err, ContainerRootError::Exists(_)), "{err}");
        assert!(root.exists(), "someone else's directory was removed");
        remove(root.to_str().unwrap()).unwrap();
        assert!(!root.exists());
        remove(root.to_str().unwrap()).unwrap();
    }
}
