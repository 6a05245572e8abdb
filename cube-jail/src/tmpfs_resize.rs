//! A running jail's own tmpfs mounts (`/tmp`, `/dev/shm`) resized to a new memory
//! limit. They are sized by the memory limit when the jail starts (their pages are
//! the sandbox's memory); a limit changed later (a live change, or a pooled jail
//! taking a create's limits) changes them too, else a raised limit would leave
//! `/tmp` as small as before.
//!
//! A forked child joins the jail's mount namespace (the caller has threads and cannot
//! join it itself) and remounts each that is a tmpfs with the new size, keeping its
//! flags; it makes raw system calls only, over memory prepared before the fork.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

/// The jail's own tmpfs mounts and the flags they are mounted with (see rootfs.rs).
const TARGETS: [(&std::ffi::CStr, libc::c_ulong); 2] = [
    (c"/tmp", libc::MS_NOSUID | libc::MS_NODEV),
    (
        c"/dev/shm",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
    ),
];

/// Why a jail's tmpfs mounts could not be resized.
#[derive(Debug, thiserror::Error)]
pub enum TmpfsResizeError {
    /// The jail's mount namespace could not be opened (the jail ended).
    #[error("opening the mount namespace of the sandbox (pid {0})")]
    Namespace(i32, #[source] std::io::Error),
    /// The helper process could not be forked.
    #[error("forking the tmpfs helper")]
    Fork(#[source] Errno),
    /// Joining the namespace failed.
    #[error("joining the sandbox's mount namespace")]
    Join(#[source] Errno),
    /// A remount failed (EINVAL: it holds more than the new size).
    #[error("resizing the sandbox's {path} to {bytes} bytes (a tmpfs cannot shrink below what it holds)")]
    Remount {
        /// The mount point inside the sandbox.
        path: &'static str,
        /// The size asked for.
        bytes: u64,
        /// Why.
        #[source]
        errno: Errno,
    },
    /// The helper ended without saying how it went.
    #[error("the tmpfs helper ended without a word")]
    Silent,
}

/// Resizes the tmpfs mounts of the jail whose PID 1 is `pid` to `bytes` each.
pub fn resize(pid: i32, bytes: u64) -> Result<(), TmpfsResizeError> {
    let ns = File::open(format!("/proc/{pid}/ns/mnt"))
        .map_err(|e| TmpfsResizeError::Namespace(pid, e))?;
    let data = CString::new(format!("size={bytes}")).map_err(|_| TmpfsResizeError::Silent)?;
    let mut pipe = [0 as RawFd; 2];
    // SAFETY: `pipe` has room for the two descriptors.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(TmpfsResizeError::Fork(Errno::last()));
    }
    // SAFETY: both descriptors are new and owned here.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
    // SAFETY: the child only makes raw system calls over memory prepared before the
    // fork and ends with _exit; it neither allocates nor takes locks.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(TmpfsResizeError::Fork(Errno::last()));
    }
    if child == 0 {
        let record = in_child(ns.as_raw_fd(), &data);
        // SAFETY: writes the 8 bytes of `record` to the pipe.
        unsafe { libc::write(write.as_raw_fd(), record.as_ptr().cast(), 8) };
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(0) };
    }
    drop(write);
    let mut record = [0i32; 2];
    let n = loop {
        // SAFETY: reads at most 8 bytes into `record`; returns once the child wrote
        // its record or ended (the pipe's only write end closes with it).
        let n = unsafe { libc::read(read.as_raw_fd(), record.as_mut_ptr().cast(), 8) };
        if n >= 0 || Errno::last() != Errno::EINTR {
            break n;
        }
    };
    let mut status = 0;
    // SAFETY: reaps the child forked above unless a reaper of the caller's did
    // (ECHILD then): the record carries the outcome either way.
    while unsafe { libc::waitpid(child, &mut status, 0) } < 0 && Errno::last() == Errno::EINTR {}
    match (n, record) {
        (8, [-1, _]) => Ok(()),
        (8, [-2, errno]) => Err(TmpfsResizeError::Join(Errno::from_raw(errno))),
        (8, [index, errno]) => Err(TmpfsResizeError::Remount {
            path: match index {
                0 => "/tmp",
                _ => "/dev/shm",
            },
            bytes,
            errno: Errno::from_raw(errno),
        }),
        _ => Err(TmpfsResizeError::Silent),
    }
}

/// In the forked child: `[-1, 0]` when done, `[-2, errno]` when the namespace could
/// not be joined, `[index, errno]` when remounting `TARGETS[index]` failed.
fn in_child(ns: RawFd, data: &CString) -> [i32; 2] {
    // SAFETY: integer arguments; after this the child's root is the sandbox's.
    if unsafe { libc::setns(ns, libc::CLONE_NEWNS) } != 0 {
        return [-2, Errno::last() as i32];
    }
    for (index, (path, flags)) in TARGETS.iter().enumerate() {
        // SAFETY: statfs is plain data, valid all-zero; statfs fills it through a
        // live pointer and `path` is NUL-terminated.
        let is_tmpfs = unsafe {
            let mut fs: libc::statfs = std::mem::zeroed();
            libc::statfs(path.as_ptr(), &mut fs) == 0 && fs.f_type == libc::TMPFS_MAGIC
        };
        if !is_tmpfs {
            // Not the jail's own tmpfs (a root without one): nothing to resize.
            continue;
        }
        // SAFETY: live NUL-terminated strings; MS_REMOUNT with the mount's own flags
        // changes only the size the data names.
        let rc = unsafe {
            libc::mount(
                std::ptr::null(),
                path.as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT | flags,
                data.as_ptr().cast(),
            )
        };
        if rc != 0 {
            return [index as i32, Errno::last() as i32];
        }
    }
    [-1, 0]
}
