//! What the agent does first when it is PID 1 of a microVM (started from an
//! initramfs): mount the kernel filesystems and load the kernel modules the VM's
//! devices need (virtio transport, disk, vsock, network, entropy), in the order a
//! file lists them, so the agent can then listen on vsock.

use std::ffi::CString;
use std::path::{Path, PathBuf};

/// Why the VM could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum VmInitError {
    /// A kernel filesystem could not be mounted.
    #[error("Mounting {target} ({fstype}) failed")]
    Mount {
        /// Where.
        target: String,
        /// Which filesystem.
        fstype: String,
        /// The error.
        #[source]
        source: nix::Error,
    },
    /// The module list could not be read.
    #[error("Reading the module list {0}")]
    List(PathBuf, #[source] std::io::Error),
    /// A module file could not be opened.
    #[error("Opening module {0}")]
    Open(PathBuf, #[source] std::io::Error),
    /// The kernel refused a module.
    #[error("Loading module {0}")]
    Load(PathBuf, #[source] std::io::Error),
}

/// Mounts /proc, /sys and /dev (devtmpfs) where they are not mounted yet.
pub fn mount_kernel_filesystems() -> Result<(), VmInitError> {
    use nix::mount::{mount, MsFlags};
    for (fstype, target) in [("proc", "/proc"), ("sysfs", "/sys"), ("devtmpfs", "/dev")] {
        let _ = std::fs::create_dir_all(target);
        match mount(
            Some(fstype),
            target,
            Some(fstype),
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            None::<&str>,
        ) {
            Ok(()) | Err(nix::Error::EBUSY) => {}
            Err(source) => {
                return Err(VmInitError::Mount {
                    target: target.into(),
                    fstype: fstype.into(),
                    source,
                })
            }
        }
    }
    Ok(())
}

/// Loads every module `list` names (one path a line, relative to the list's
/// directory, dependencies first); modules the kernel already has are skipped.
/// Returns how many were loaded.
pub fn load_modules(list: &Path) -> Result<usize, VmInitError> {
    let text =
        std::fs::read_to_string(list).map_err(|e| VmInitError::List(list.to_path_buf(), e))?;
    let base = list.parent().unwrap_or(Path::new("/"));
    let mut loaded = 0;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let path = base.join(line);
        let file = std::fs::File::open(&path).map_err(|e| VmInitError::Open(path.clone(), e))?;
        let params = CString::default();
        // SAFETY: finit_module reads the module from an fd this function owns and a
        // NUL-terminated (empty) parameter string; it touches no other memory.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_finit_module,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                params.as_ptr(),
                0,
            )
        };
        if rc == 0 {
            loaded += 1;
            continue;
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EEXIST) {
            return Err(VmInitError::Load(path, err));
        }
    }
    Ok(loaded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_list_or_module_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let list = dir.path().join("modules.order");
        assert!(matches!(load_modules(&list), Err(VmInitError::List(..))));
        std::fs::write(&list, "missing.ko\n").unwrap();
        match load_modules(&list) {
            Err(VmInitError::Open(path, _)) => assert!(path.ends_with("missing.ko")),
            other => panic!("{other:?}"),
        }
        // A file that is no module is refused by the kernel (or by the permission
        // check where the test does not run as root), never loaded.
        std::fs::write(dir.path().join("junk.ko"), b"not an ELF module").unwrap();
        std::fs::write(&list, "\njunk.ko\n").unwrap();
        assert!(matches!(load_modules(&list), Err(VmInitError::Load(..))));
        std::fs::write(&list, "\n\n").unwrap();
        assert_eq!(load_modules(&list).unwrap(), 0);
    }
}
