//! Filesystem requests: streamed reads and writes (a file never sits whole in memory),
//! listings to a depth, stat, mkdir, remove, rename, exists.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::protocol::{ErrorCode, ErrorReply, FileInfo, FileKind, ResponseBody, UserSpec};

/// Bytes per `FileChunk` event.
pub const READ_CHUNK: usize = 256 * 1024;

/// Entries per `DirEntries` event (kept well below the frame limit).
const LIST_BATCH: usize = 256;

/// Errors of filesystem requests.
#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    /// A filesystem call failed.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which path.
        path: String,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// The request is unusable.
    #[error("invalid request: {0}")]
    Invalid(&'static str),
    /// The receiver went away part way through a stream.
    #[error("the connection closed during the transfer")]
    Disconnected,
}

impl FilesError {
    /// The error reply for the host.
    pub fn to_reply(&self) -> ErrorReply {
        let message = crate::exec::error_chain(self);
        match self {
            FilesError::Io { source, .. } => ErrorReply::from_io(source, message),
            FilesError::Invalid(_) => ErrorReply::new(ErrorCode::InvalidArgument, message),
            FilesError::Disconnected => ErrorReply::new(ErrorCode::Io, message),
        }
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> FilesError + 'a {
    move |source| FilesError::Io {
        op,
        path: path.display().to_string(),
        source,
    }
}

fn checked(path: &str) -> Result<&Path, FilesError> {
    if path.is_empty() {
        return Err(FilesError::Invalid("empty path"));
    }
    if path.contains('\0') {
        return Err(FilesError::Invalid("path contains a NUL byte"));
    }
    Ok(Path::new(path))
}

/// Streams `len` bytes (all when `None`) of a file from `offset` to `emit` as
/// `FileChunk`s; returns the bytes sent. `emit` returns false when nobody listens.
pub fn read_file(
    path: &str,
    offset: u64,
    len: Option<u64>,
    emit: &mut dyn FnMut(ResponseBody) -> bool,
) -> Result<u64, FilesError> {
    let p = checked(path)?;
    let mut file = File::open(p).map_err(io_err("open", p))?;
    if file.metadata().map_err(io_err("stat", p))?.is_dir() {
        return Err(FilesError::Io {
            op: "read",
            path: path.into(),
            source: std::io::Error::from_raw_os_error(libc::EISDIR),
        });
    }
    if offset > 0 {
        file.seek(SeekFrom::Start(offset))
            .map_err(io_err("seek", p))?;
    }
    let mut remaining = len.unwrap_or(u64::MAX);
    let mut sent = 0u64;
    let mut buf = vec![0u8; READ_CHUNK];
    while remaining > 0 {
        let want = usize::try_from(remaining).map_or(READ_CHUNK, |r| r.min(READ_CHUNK));
        let n = match file.read(&mut buf[..want]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err("read", p)(e)),
        };
        if !emit(ResponseBody::FileChunk(buf[..n].to_vec())) {
            return Err(FilesError::Disconnected);
        }
        sent += n as u64;
        remaining -= n as u64;
    }
    Ok(sent)
}

/// A file being written chunk by chunk.
#[derive(Debug)]
pub struct WriteSession {
    file: File,
    path: PathBuf,
    written: u64,
}

impl WriteSession {
    /// Opens `path` for writing (truncating unless `append`). A file or parent it
    /// creates is given to `owner` when there is one (see [`create_dirs`]); an existing
    /// file keeps its owner.
    pub fn start(
        path: &str,
        mode: Option<u32>,
        append: bool,
        create_parents: bool,
        owner: Option<UserSpec>,
    ) -> Result<Self, FilesError> {
        let p = checked(path)?;
        if create_parents {
            if let Some(parent) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                create_dirs(parent, owner).map_err(io_err("create parents of", p))?;
            }
        }
        let mut opts = OpenOptions::new();
        opts.write(true).mode(mode.unwrap_or(0o644) & 0o7777);
        if append {
            opts.append(true);
        } else {
            opts.truncate(true);
        }
        let file = match opts.clone().create_new(true).open(p) {
            Ok(file) => {
                if let Some(owner) = owner {
                    // On the descriptor: the name may already lead elsewhere.
                    std::os::unix::fs::fchown(&file, Some(owner.uid), Some(owner.gid))
                        .map_err(io_err("give to the image's user", p))?;
                }
                file
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                opts.open(p).map_err(io_err("open for writing", p))?
            }
            Err(e) => return Err(io_err("open for writing", p)(e)),
        };
        Ok(Self {
            file,
            path: p.to_path_buf(),
            written: 0,
        })
    }

    /// Appends `data`.
    pub fn write(&mut self, data: &[u8]) -> Result<(), FilesError> {
        self.file
            .write_all(data)
            .map_err(io_err("write", &self.path))?;
        self.written += data.len() as u64;
        Ok(())
    }

    /// Closes the file (syncing it first when `sync`); returns the bytes written.
    pub fn finish(self, sync: bool) -> Result<u64, FilesError> {
        if sync {
            self.file.sync_all().map_err(io_err("sync", &self.path))?;
        }
        Ok(self.written)
    }
}

/// Metadata of `path` without following a final symbolic link.
pub fn stat(path: &str) -> Result<FileInfo, FilesError> {
    let p = checked(path)?;
    info_of(p)
}

fn info_of(p: &Path) -> Result<FileInfo, FilesError> {
    let md = fs::symlink_metadata(p).map_err(io_err("stat", p))?;
    let ft = md.file_type();
    let kind = if ft.is_file() {
        FileKind::File
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_symlink() {
        FileKind::Symlink
    } else {
        FileKind::Other
    };
    let symlink_target = if ft.is_symlink() {
        Some(
            fs::read_link(p)
                .map_err(io_err("read link", p))?
                .to_string_lossy()
                .into_owned(),
        )
    } else {
        None
    };
    Ok(FileInfo {
        path: p.to_string_lossy().into_owned(),
        kind,
        size: md.len(),
        mode: md.mode() & 0o7777,
        uid: md.uid(),
        gid: md.gid(),
        modified_ns: md
            .mtime()
            .saturating_mul(1_000_000_000)
            .saturating_add(md.mtime_nsec()),
        symlink_target,
    })
}

/// Lists `path` to `depth` levels (1: its own entries), emitting `DirEntries` batches;
/// returns how many entries were sent. Symbolic links are listed, never followed.
pub fn list_dir(
    path: &str,
    depth: u32,
    emit: &mut dyn FnMut(ResponseBody) -> bool,
) -> Result<u64, FilesError> {
    let root = checked(path)?;
    if depth == 0 {
        return Err(FilesError::Invalid("depth must be at least 1"));
    }
    // Fail early (and precisely: not found, not a directory) for the root itself.
    fs::read_dir(root).map_err(io_err("list", root))?;
    let mut stack = vec![(root.to_path_buf(), 1u32)];
    let mut batch = Vec::with_capacity(LIST_BATCH);
    let mut count = 0u64;
    while let Some((dir, level)) = stack.pop() {
        let mut names: Vec<PathBuf> = match fs::read_dir(&dir) {
            Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
            // A subdirectory that vanished or is unreadable is skipped, not fatal.
            Err(e) if dir != root => {
                tracing::debug!(dir = %dir.display(), error = %e, "skipping directory");
                continue;
            }
            Err(e) => return Err(io_err("list", root)(e)),
        };
        names.sort();
        for child in names.into_iter().rev() {
            let Ok(info) = info_of(&child) else { continue };
            if info.kind == FileKind::Dir && level < depth {
                stack.push((child, level + 1));
            }
            batch.push(info);
            if batch.len() == LIST_BATCH {
                count += batch.len() as u64;
                if !emit(ResponseBody::DirEntries(std::mem::take(&mut batch))) {
                    return Err(FilesError::Disconnected);
                }
            }
        }
    }
    if !batch.is_empty() {
        count += batch.len() as u64;
        if !emit(ResponseBody::DirEntries(batch)) {
            return Err(FilesError::Disconnected);
        }
    }
    Ok(count)
}

/// Creates a directory; with `parents`, also its parents, accepting one that exists.
/// What it creates is given to `owner` when there is one (see [`create_dirs`]).
pub fn make_dir(path: &str, parents: bool, owner: Option<UserSpec>) -> Result<(), FilesError> {
    let p = checked(path)?;
    if parents {
        create_dirs(p, owner).map_err(io_err("create directory", p))
    } else {
        fs::create_dir(p)
            .and_then(|()| give(p, owner))
            .map_err(io_err("create directory", p))
    }
}

/// Makes `dir` and whichever of its parents are missing, each new one given to
/// `owner`: in a VM built from a container image the agent runs as root, and what the
/// host's file calls create belongs to the image's user, as the processes that use
/// it run as that user.
fn create_dirs(dir: &Path, owner: Option<UserSpec>) -> std::io::Result<()> {
    if owner.is_none() {
        return fs::create_dir_all(dir);
    }
    let mut missing = Vec::new();
    let mut next = Some(dir);
    while let Some(d) = next.filter(|d| !d.as_os_str().is_empty() && fs::metadata(d).is_err()) {
        missing.push(d);
        next = d.parent();
    }
    for d in missing.into_iter().rev() {
        match fs::create_dir(d) {
            Ok(()) => give(d, owner)?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Gives `path`, just made, to `owner`; a symlink swapped in for it meanwhile is
/// changed itself, never what it points at.
fn give(path: &Path, owner: Option<UserSpec>) -> std::io::Result<()> {
    match owner {
        Some(o) => std::os::unix::fs::lchown(path, Some(o.uid), Some(o.gid)),
        None => Ok(()),
    }
}

/// Removes a file, symbolic link or directory (non-empty only with `recursive`).
pub fn remove(path: &str, recursive: bool) -> Result<(), FilesError> {
    let p = checked(path)?;
    let md = fs::symlink_metadata(p).map_err(io_err("remove", p))?;
    if md.is_dir() {
        if recursive {
            fs::remove_dir_all(p).map_err(io_err("remove", p))
        } else {
            fs::remove_dir(p).map_err(io_err("remove", p))
        }
    } else {
        fs::remove_file(p).map_err(io_err("remove", p))
    }
}

/// Renames `from` to `to`.
pub fn rename(from: &str, to: &str) -> Result<(), FilesError> {
    let f = checked(from)?;
    let t = checked(to)?;
    fs::rename(f, t).map_err(io_err("rename", f))
}

/// Whether `path` exists (a dangling symbolic link does).
pub fn exists(path: &str) -> Result<bool, FilesError> {
    let p = checked(path)?;
    match fs::symlink_metadata(p) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => Ok(false),
        Err(e) => Err(io_err("stat", p)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(p: &Path) -> String {
        p.to_string_lossy().into_owned()
    }

    #[test]
    fn write_then_read_in_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let path = s(&dir.path().join("a/b/file"));
        let mut w = WriteSession::start(&path, Some(0o600), false, true, None).unwrap();
        let data: Vec<u8> = (0..READ_CHUNK * 2 + 10).map(|i| (i % 251) as u8).collect();
        for part in data.chunks(1000) {
            w.write(part).unwrap();
        }
        assert_eq!(w.finish(true).unwrap(), data.len() as u64);
        assert_eq!(stat(&path).unwrap().mode, 0o600);

        let mut chunks = Vec::new();
        let sent = read_file(&path, 0, None, &mut |b| {
            chunks.push(b);
            true
        })
        .unwrap();
        assert_eq!(sent, data.len() as u64);
        assert_eq!(chunks.len(), 3);
        let back: Vec<u8> = chunks
            .into_iter()
            .flat_map(|c| match c {
                ResponseBody::FileChunk(b) => b,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(back, data);

        let mut part = Vec::new();
        read_file(&path, 5, Some(3), &mut |b| {
            if let ResponseBody::FileChunk(b) = b {
                part.extend(b)
            }
            true
        })
        .unwrap();
        assert_eq!(part, &data[5..8]);
    }

    #[test]
    fn append_adds_to_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = s(&dir.path().join("f"));
        let mut w = WriteSession::start(&path, None, false, false, None).unwrap();
        w.write(b"ab").unwrap();
        w.finish(false).unwrap();
        let mut w = WriteSession::start(&path, None, true, false, None).unwrap();
        w.write(b"cd").unwrap();
        w.finish(false).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"abcd");
    }

    #[test]
    fn list_respects_depth() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("d1/d2/d3")).unwrap();
        fs::write(root.join("top"), b"x").unwrap();
        fs::write(root.join("d1/d2/deep"), b"x").unwrap();
        std::os::unix::fs::symlink("/", root.join("link")).unwrap();
        let list = |depth| {
            let mut all = Vec::new();
            list_dir(&s(root), depth, &mut |b| {
                if let ResponseBody::DirEntries(e) = b {
                    all.extend(
                        e.into_iter()
                            .map(|i| i.path.strip_prefix(&s(root)).unwrap().to_string()),
                    )
                }
                true
            })
            .unwrap();
            all.sort();
            all
        };
        assert_eq!(list(1), ["/d1", "/link", "/top"]);
        assert_eq!(list(2), ["/d1", "/d1/d2", "/link", "/top"]);
        assert_eq!(
            list(9),
            ["/d1", "/d1/d2", "/d1/d2/d3", "/d1/d2/deep", "/link", "/top"]
        );
        let link = stat(&s(&root.join("link"))).unwrap();
        assert_eq!(link.kind, FileKind::Symlink);
        assert_eq!(link.symlink_target.as_deref(), Some("/"));
    }

    #[test]
    fn errors_are_specific() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::write(root.join("file"), b"x").unwrap();
        fs::create_dir(root.join("full")).unwrap();
        fs::write(root.join("full/x"), b"x").unwrap();
        let code = |e: FilesError| e.to_reply().code;
        let mut sink = |_| true;
        assert_eq!(
            code(stat(&s(&root.join("missing"))).unwrap_err()),
            ErrorCode::NotFound
        );
        assert_eq!(
            code(list_dir(&s(&root.join("file")), 1, &mut sink).unwrap_err()),
            ErrorCode::NotADirectory
        );
        assert_eq!(
            code(read_file(&s(root), 0, None, &mut sink).unwrap_err()),
            ErrorCode::IsADirectory
        );
        assert_eq!(
            code(remove(&s(&root.join("full")), false).unwrap_err()),
            ErrorCode::NotEmpty
        );
        assert_eq!(
            code(make_dir(&s(&root.join("a/b")), false, None).unwrap_err()),
            ErrorCode::NotFound
        );
        assert_eq!(
            code(make_dir(&s(&root.join("file")), false, None).unwrap_err()),
            ErrorCode::AlreadyExists
        );
        assert_eq!(code(stat("").unwrap_err()), ErrorCode::InvalidArgument);
        assert!(!exists(&s(&root.join("file/below"))).unwrap());
    }

    #[test]
    fn mkdir_remove_rename_exists() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let deep = s(&root.join("x/y/z"));
        make_dir(&deep, true, None).unwrap();
        make_dir(&deep, true, None).unwrap();
        assert!(exists(&deep).unwrap());
        rename(&s(&root.join("x")), &s(&root.join("w"))).unwrap();
        assert!(!exists(&deep).unwrap());
        assert!(exists(&s(&root.join("w/y/z"))).unwrap());
        remove(&s(&root.join("w")), true).unwrap();
        assert!(!exists(&s(&root.join("w"))).unwrap());
    }
    #[test]
    fn what_is_created_for_an_owner_is_theirs_and_existing_files_keep_theirs() {
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } != 0 {
            println!("skipped: giving files to another user needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let owner = Some(UserSpec {
            uid: 4242,
            gid: 4343,
        });
        let owned = |p: &Path| {
            let md = fs::symlink_metadata(p).unwrap();
            (md.uid(), md.gid())
        };
        let file = dir.path().join("new/deeper/file");
        let mut w = WriteSession::start(&s(&file), None, false, true, owner).unwrap();
        w.write(b"x").unwrap();
        w.finish(false).unwrap();
        for made in [
            &file,
            &dir.path().join("new/deeper"),
            &dir.path().join("new"),
        ] {
            assert_eq!(owned(made), (4242, 4343), "{}", made.display());
        }
        // The directory that was there stays root's.
        assert_eq!(owned(dir.path()), (0, 0));

        let existing = dir.path().join("existing");
        fs::write(&existing, b"root's").unwrap();
        let mut w = WriteSession::start(&s(&existing), None, false, false, owner).unwrap();
        w.write(b"new content").unwrap();
        w.finish(false).unwrap();
        assert_eq!(owned(&existing), (0, 0));
        assert_eq!(fs::read(&existing).unwrap(), b"new content");

        let made = dir.path().join("m/n");
        make_dir(&s(&made), true, owner).unwrap();
        assert_eq!(owned(&made), (4242, 4343));
        assert_eq!(owned(&dir.path().join("m")), (4242, 4343));
        let single = dir.path().join("single");
        make_dir(&s(&single), false, owner).unwrap();
        assert_eq!(owned(&single), (4242, 4343));
    }
}
