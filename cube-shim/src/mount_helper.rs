//! A forked helper that mounts inside a sandbox's mount namespace: a mount can only be
//! attached in the caller's own namespace, and the shim, which has threads, cannot
//! join another one itself. The child joins the namespace of the sandbox's PID 1,
//! whose root is the sandbox's root, so every path it resolves there stays inside the
//! sandbox whatever links the sandbox planted; it makes raw system calls only, over
//! memory prepared before the fork, and reports which step failed and why.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

/// Why the helper could not do its work.
#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    /// The sandbox's mount namespace could not be opened (the sandbox ended).
    #[error("opening the mount namespace of the sandbox (pid {0})")]
    Namespace(u32, #[source] std::io::Error),
    /// The helper process could not be forked or waited for.
    #[error("forking the mount helper")]
    Fork(#[source] Errno),
    /// A step inside the sandbox failed.
    #[error("{step} in the sandbox")]
    InSandbox {
        /// What was being done.
        step: &'static str,
        /// Why.
        #[source]
        errno: Errno,
    },
}

/// The mount namespace of the sandbox whose PID 1 is `jail_pid`.
pub fn open_namespace(jail_pid: u32) -> Result<File, HelperError> {
    File::open(format!("/proc/{jail_pid}/ns/mnt")).map_err(|e| HelperError::Namespace(jail_pid, e))
}

/// Forks a child that runs `step` (raw system calls only: the shim has threads) and
/// reports which step failed and why: the index `step` returns names one of `steps`.
pub fn run(
    steps: &'static [&'static str],
    step: impl Fn() -> Result<(), (usize, Errno)>,
) -> Result<(), HelperError> {
    let mut pipe = [0 as RawFd; 2];
    // SAFETY: `pipe` has room for the two descriptors.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(HelperError::Fork(Errno::last()));
    }
    // SAFETY: both descriptors are new and owned here.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
    // SAFETY: the child only makes raw system calls over memory prepared before the
    // fork and ends with _exit; it neither allocates nor takes locks.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(HelperError::Fork(Errno::last()));
    }
    if pid == 0 {
        // The record says how it went, success included: the shim reaps its children
        // on SIGCHLD (containerd-shim does), so the exit status may never reach us.
        let (record, code) = match step() {
            Ok(()) => ([-1i32, 0], 0),
            Err((index, errno)) => ([index as i32, errno as i32], 1),
        };
        // SAFETY: writes the 8 bytes of `record` to the pipe.
        unsafe { libc::write(write.as_raw_fd(), record.as_ptr().cast(), 8) };
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
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
    // SAFETY: reaps the child forked above if nobody else did; `status` is live.
    // ECHILD (reaped elsewhere) is fine: the record carries the outcome.
    while unsafe { libc::waitpid(pid, &mut status, 0) } < 0 && Errno::last() == Errno::EINTR {}
    match (n, record) {
        (8, [-1, _]) => Ok(()),
        (8, [index, errno]) => Err(HelperError::InSandbox {
            step: steps.get(index as usize).copied().unwrap_or("a step"),
            errno: Errno::from_raw(errno),
        }),
        _ => Err(HelperError::InSandbox {
            step: "the mount helper, which ended without a word",
            errno: Errno::ECHILD,
        }),
    }
}

/// Step `index`'s outcome from a system call's return value.
pub fn check(index: usize, rc: libc::c_int) -> Result<(), (usize, Errno)> {
    if rc == 0 {
        Ok(())
    } else {
        Err((index, Errno::last()))
    }
}

/// In the child: joins the mount namespace `ns` (step `index`).
pub fn join(index: usize, ns: RawFd) -> Result<(), (usize, Errno)> {
    // SAFETY: integer arguments; after this the child's root is the sandbox's.
    check(index, unsafe { libc::setns(ns, libc::CLONE_NEWNS) })
}
