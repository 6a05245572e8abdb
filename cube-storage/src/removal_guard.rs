//! A guard that deletes a half-made file or directory unless the work completes.
//!
//! Every operation here that creates something on disk (a clone, a temp metadata
//! file, a disk image) arms one of these first, so an early `?` return or a panic
//! never leaves a partial result behind.

use std::fs;
use std::io;
use std::path::PathBuf;

/// What the guard removes.
#[derive(Debug, Clone, Copy)]
enum Target {
    File,
    Tree,
}

/// Removes `path` on drop unless [`RemovalGuard::disarm`] was called.
#[derive(Debug)]
pub(crate) struct RemovalGuard {
    path: PathBuf,
    target: Target,
    armed: bool,
}

impl RemovalGuard {
    /// Guards a file (or symlink, or device node) at `path`.
    pub(crate) fn file(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            target: Target::File,
            armed: true,
        }
    }

    /// Guards a directory at `path`, removed with everything under it.
    pub(crate) fn tree(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            target: Target::Tree,
            armed: true,
        }
    }

    /// Keeps the path: the work that created it has completed.
    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for RemovalGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let result = match self.target {
            Target::File => fs::remove_file(&self.path),
            Target::Tree => fs::remove_dir_all(&self.path),
        };
        match result {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(
                path = %self.path.display(),
                error = %e,
                "Cannot remove partial result"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn armed_guard_removes_and_disarmed_guard_keeps() {
        let dir = tempfile::tempdir().unwrap();
        let removed = dir.path().join("removed");
        let kept = dir.path().join("kept");
        let tree = dir.path().join("tree");
        fs::write(&removed, b"x").unwrap();
        fs::write(&kept, b"x").unwrap();
        fs::create_dir_all(tree.join("a/b")).unwrap();
        fs::write(tree.join("a/b/c"), b"x").unwrap();

        drop(RemovalGuard::file(&removed));
        RemovalGuard::file(&kept).disarm();
        drop(RemovalGuard::tree(&tree));

        assert!(!removed.exists());
        assert!(kept.exists());
        assert!(!tree.exists());
    }
}
