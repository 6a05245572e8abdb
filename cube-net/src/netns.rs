//! Network namespaces of sandboxes: opened by a jail's PID or a namespace path, and
//! entered by a short-lived thread so the caller's own namespace never changes.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::sched::{setns, CloneFlags};

/// Errors of opening or entering a network namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace file could not be opened.
    #[error("open network namespace {0}")]
    Open(PathBuf, #[source] io::Error),
    /// The path is not a network namespace.
    #[error("{0} is not a network namespace")]
    NotNetns(PathBuf),
    /// setns(2) into the namespace failed.
    #[error("enter network namespace")]
    Enter(#[source] nix::Error),
    /// A namespace could not be created, pinned or unpinned.
    #[error("create or pin network namespace")]
    Create(#[source] nix::Error),
    /// The thread that entered the namespace panicked.
    #[error("network namespace worker panicked")]
    Worker,
}

/// Where a sandbox's network namespace is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetnsRef {
    /// The namespace of a process (a jail's init): `/proc/PID/ns/net`.
    Pid(i32),
    /// A namespace file, such as `/proc/PID/ns/net` or `/run/netns/NAME`.
    Path(PathBuf),
}

impl NetnsRef {
    /// The namespace file this refers to.
    pub fn path(&self) -> PathBuf {
        match self {
            Self::Pid(pid) => PathBuf::from(format!("/proc/{pid}/ns/net")),
            Self::Path(path) => path.clone(),
        }
    }

    /// Opens the namespace; the handle keeps it alive while held.
    pub fn open(&self) -> Result<Netns, NetnsError> {
        let path = self.path();
        let file = File::open(&path).map_err(|error| NetnsError::Open(path.clone(), error))?;
        // A namespace file answers NS_GET_NSTYPE; anything else is refused so a wrong
        // path cannot make us configure some other namespace.
        const NS_GET_NSTYPE: libc::c_ulong = 0xb703;
        // SAFETY: NS_GET_NSTYPE takes no argument and only reads the fd's inode.
        let kind = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_NSTYPE as _) };
        if kind != libc::CLONE_NEWNET {
            return Err(NetnsError::NotNetns(path));
        }
        Ok(Netns { fd: file.into() })
    }
}

/// An open network namespace.
#[derive(Debug)]
pub struct Netns {
    fd: OwnedFd,
}

impl Netns {
    /// The namespace of the calling thread.
    pub fn current() -> Result<Self, NetnsError> {
        NetnsRef::Path(PathBuf::from("/proc/thread-self/ns/net")).open()
    }

    /// Creates a new, empty network namespace with lo up, kept alive by a bind
    /// mount at `pin` (an empty file this creates) so another process can find it.
    pub fn create_pinned(pin: &Path) -> Result<Self, NetnsError> {
        std::fs::File::create(pin).map_err(|error| NetnsError::Open(pin.to_path_buf(), error))?;
        let made = std::thread::scope(|scope| {
            scope
                .spawn(|| -> Result<(), NetnsError> {
                    nix::sched::unshare(CloneFlags::CLONE_NEWNET).map_err(NetnsError::Create)?;
                    nix::mount::mount(
                        Some("/proc/thread-self/ns/net"),
                        pin,
                        None::<&str>,
                        nix::mount::MsFlags::MS_BIND,
                        None::<&str>,
                    )
                    .map_err(NetnsError::Create)
                })
                .join()
                .map_err(|_| NetnsError::Worker)?
        });
        if let Err(error) = made {
            let _ = std::fs::remove_file(pin);
            return Err(error);
        }
        NetnsRef::Path(pin.to_path_buf()).open()
    }

    /// Removes a namespace pin made by [`Netns::create_pinned`]; the namespace
    /// itself goes when nothing else holds it.
    pub fn remove_pin(pin: &Path) -> Result<(), NetnsError> {
        match nix::mount::umount2(pin, nix::mount::MntFlags::MNT_DETACH) {
            Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => {}
            Err(error) => return Err(NetnsError::Create(error)),
        }
        match std::fs::remove_file(pin) {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(error) => Err(NetnsError::Open(pin.to_path_buf(), error)),
        }
    }

    /// The namespace's file descriptor.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Whether the calling thread is in this namespace.
    pub fn is_current(&self) -> bool {
        let Ok(current) = nix::sys::stat::stat("/proc/thread-self/ns/net") else {
            return false;
        };
        match nix::sys::stat::fstat(&self.fd) {
            Ok(own) => own.st_dev == current.st_dev && own.st_ino == current.st_ino,
            Err(_) => false,
        }
    }

    /// Runs `work` in this namespace: right here when the calling thread is in it
    /// already, else on a thread that enters it.
    pub fn enter<T: Send, F: FnOnce() -> T + Send>(&self, work: F) -> Result<T, NetnsError> {
        if self.is_current() {
            return Ok(work());
        }
        self.run(work)
    }

    /// Runs `work` on a thread inside this namespace and returns its result.
    pub fn run<T: Send, F: FnOnce() -> T + Send>(&self, work: F) -> Result<T, NetnsError> {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    setns(self.fd.as_fd(), CloneFlags::CLONE_NEWNET).map_err(NetnsError::Enter)?;
                    Ok(work())
                })
                .join()
                .map_err(|_| NetnsError::Worker)?
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_a_file_that_is_no_namespace() {
        let error = NetnsRef::Path(PathBuf::from("/proc/self/status"))
            .open()
            .unwrap_err();
        assert!(matches!(error, NetnsError::NotNetns(_)), "{error}");
    }

    #[test]
    fn opens_its_own_namespace() {
        let netns = NetnsRef::Pid(std::process::id() as i32).open().unwrap();
        let inside = netns.run(|| 7).unwrap();
        assert_eq!(inside, 7);
    }
}
