//! One criu process, started the way a checkpoint needs it.
//!
//! - In a private copy of the caller's mount namespace, so that nothing criu mounts
//!   (the restored sandbox's root, the tmpfs mounts handed to it) reaches the host's
//!   mount table; with CRIU's kernel-feature cache bound on `/run` where the host's
//!   `/run` cannot keep it (see `kdat_cache.rs`).
//! - For a restore, born in the new sandbox's cgroups (`clone3` with
//!   `CLONE_INTO_CGROUP` for the v2 hierarchy, the v1 `tasks` files for the others,
//!   neither of which takes the write side of the kernel's global cgroup migration
//!   lock) and in a cgroup namespace rooted there: the restored processes, which criu
//!   forks, inherit both. CRIU then manages no cgroups at all (`--manage-cgroups
//!   ignore`): it neither walks the host's cgroup trees at dump nor mounts a cgroup
//!   yard and moves tasks at restore, which on the measured hosts cost 20-40 ms per
//!   operation and grew with the number of sandboxes on the host.
//! - With given descriptors installed at given numbers, stdin and stdout on
//!   `/dev/null`, and stderr collected.
//!
//! The child between `clone` and `execve` makes raw system calls only, on memory
//! prepared beforehand (the caller is multi-threaded); a failing step is reported on a
//! close-on-exec pipe as the step's number and the errno.

use std::ffi::{CString, OsString};
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::OpenOptionsExt;

use nix::errno::Errno;

use crate::cgroup::SandboxCgroup;
use crate::criu::Criu;
use crate::kdat_cache::{self, KdatCache};
use crate::namespaces::{self, Cloned};

/// Why criu could not be run (not why it failed: see [`Finished`]).
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A pipe, descriptor or argument for the process could not be prepared.
    #[error("cannot prepare the criu process")]
    Prepare(#[source] io::Error),
    /// The process could not be created.
    #[error("cannot start criu")]
    Start(#[source] namespaces::NamespaceError),
    /// The new process failed to set itself up before exec.
    #[error("setting up the criu process failed: {step}")]
    Setup {
        /// What the process was doing.
        step: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Waiting for the process failed.
    #[error("cannot wait for criu")]
    Wait(#[source] io::Error),
}

/// What a criu run left.
#[derive(Debug)]
pub(crate) struct Finished {
    /// Whether it exited with status 0.
    pub success: bool,
    /// Its standard error (criu logs to its log file; this holds what it printed
    /// before the log was open).
    pub stderr: String,
}

/// How the restored sandbox's root directory is made a mount point for `--root`.
#[derive(Clone)]
pub(crate) enum RootMount {
    /// Bound onto itself (a host-userland root, whose layer is the directory).
    Bind,
    /// An overlay with these mount options.
    Overlay(CString),
}

/// A criu command and what its process gets besides the arguments.
pub(crate) struct CriuLaunch<'a> {
    criu: &'a Criu,
    args: Vec<OsString>,
    /// Descriptors to install: (source in this process, number in criu). Every source
    /// must lie above every target (see [`crate::checkpoint`]'s `INHERIT_BASE`).
    fds: Vec<(RawFd, RawFd)>,
    /// The directory to make a mount point for `--root`, and how.
    root: Option<(CString, RootMount)>,
    /// The cgroups criu, and so what it restores, starts in.
    cgroup: Option<&'a SandboxCgroup>,
    /// Detached mounts (from `fsmount`) to attach at these paths in criu's mount
    /// namespace.
    attach: Vec<(RawFd, CString)>,
}

/// Steps of the child's set-up, by the number it reports.
const STEPS: &[&str] = &[
    "making its mount namespace private",
    "binding the kernel-feature cache on /run",
    "mounting the sandbox root",
    "attaching a tmpfs",
    "joining the v2 cgroup",
    "joining a v1 cgroup",
    "creating the cgroup namespace",
    "installing descriptors",
    "executing criu",
];

/// Everything the child reads, prepared before the clone.
struct ChildPlan<'a> {
    kdat: &'a KdatCache,
    root: Option<&'a (CString, RootMount)>,
    attach: &'a [(RawFd, CString)],
    v2_procs: Option<RawFd>,
    v1_tasks: Vec<RawFd>,
    new_cgroup_ns: bool,
    /// (source, target) pairs: stdin, stdout, stderr first, then the inherited ones.
    dups: Vec<(RawFd, RawFd)>,
    path: &'a CString,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    report: RawFd,
}

impl<'a> CriuLaunch<'a> {
    /// `criu <args>`, run as is otherwise.
    pub(crate) fn new(criu: &'a Criu, args: Vec<OsString>) -> CriuLaunch<'a> {
        CriuLaunch {
            criu,
            args,
            fds: Vec::new(),
            root: None,
            cgroup: None,
            attach: Vec::new(),
        }
    }

    /// Installs `source` (a descriptor of this process) as `target` in criu.
    pub(crate) fn inherit(&mut self, source: RawFd, target: RawFd) {
        self.fds.push((source, target));
    }

    /// Makes `dir` a mount point, bound onto itself or an overlay, before criu runs.
    pub(crate) fn root(&mut self, dir: CString, mount: RootMount) {
        self.root = Some((dir, mount));
    }

    /// Starts criu in `cgroup` and in a cgroup namespace rooted there.
    pub(crate) fn in_cgroup(&mut self, cgroup: &'a SandboxCgroup) {
        self.cgroup = Some(cgroup);
    }

    /// Attaches the detached mount `mount` at the directory `at` before criu runs.
    pub(crate) fn attach(&mut self, mount: RawFd, at: CString) {
        self.attach.push((mount, at));
    }

    /// Runs criu to the end.
    pub(crate) fn run(self) -> Result<Finished, LaunchError> {
        let prepare = LaunchError::Prepare;
        let cstring = |s: OsString| CString::new(s.into_vec()).map_err(|e| prepare(e.into()));
        let path = cstring(self.criu.path().as_os_str().to_owned())?;
        let mut argv_c = vec![path.clone()];
        for a in self.args {
            argv_c.push(cstring(a)?);
        }
        let mut envp_c = Vec::new();
        for (k, v) in std::env::vars_os() {
            let mut kv = k.into_vec();
            kv.push(b'=');
            kv.extend(v.into_vec());
            envp_c.push(CString::new(kv).map_err(|e| prepare(e.into()))?);
        }
        let null = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/null")
            .map_err(prepare)?;
        let (stderr_read, stderr_write) = pipe().map_err(prepare)?;
        let (report_read, report_write) = pipe().map_err(prepare)?;
        // The child's dup2 calls must not overwrite a source: stdio and the report
        // move above every target too.
        let floor = self.fds.iter().map(|(_, t)| t + 1).max().unwrap_or(3);
        // The originals close here: the parent reads each pipe until every write end
        // is closed.
        let above = |fd: OwnedFd| dup_at_least(fd.as_raw_fd(), floor).map_err(prepare);
        let null = above(null.into())?;
        let stderr_write = above(stderr_write)?;
        let report_write = above(report_write)?;

        let (v2_dir, v1_paths) = self
            .cgroup
            .map_or((None, Vec::new()), SandboxCgroup::join_points);
        let v2_files = v2_dir
            .map(|d| -> io::Result<(File, File)> {
                let dir = OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
                    .open(d)?;
                let procs = OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_CLOEXEC)
                    .open(d.join("cgroup.procs"))?;
                Ok((dir, procs))
            })
            .transpose()
            .map_err(prepare)?;
        let v1_files = v1_paths
            .iter()
            .map(|p| {
                OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_CLOEXEC)
                    .open(p)
            })
            .collect::<io::Result<Vec<File>>>()
            .map_err(prepare)?;

        let mut dups = vec![
            (null.as_raw_fd(), 0),
            (null.as_raw_fd(), 1),
            (stderr_write.as_raw_fd(), 2),
        ];
        dups.extend(self.fds.iter().copied());
        let mut argv: Vec<*const libc::c_char> = argv_c.iter().map(|c| c.as_ptr()).collect();
        argv.push(std::ptr::null());
        let mut envp: Vec<*const libc::c_char> = envp_c.iter().map(|c| c.as_ptr()).collect();
        envp.push(std::ptr::null());
        let plan = ChildPlan {
            kdat: kdat_cache::get(),
            root: self.root.as_ref(),
            attach: &self.attach,
            v2_procs: v2_files.as_ref().map(|(_, p)| p.as_raw_fd()),
            v1_tasks: v1_files.iter().map(AsRawFd::as_raw_fd).collect(),
            new_cgroup_ns: self.cgroup.is_some(),
            dups,
            path: &path,
            argv,
            envp,
            report: report_write.as_raw_fd(),
        };
        let v2_dir_fd = v2_files.as_ref().map(|(dir, _)| dir.as_raw_fd());
        let cpu_before = children_cpu();
        // SAFETY: the child only runs `child_main`, which makes raw system calls on
        // memory prepared above and never returns (exec or _exit).
        let pid = match unsafe {
            namespaces::clone_into_namespaces(libc::CLONE_NEWNS as libc::c_ulong, v2_dir_fd)
        }
        .map_err(LaunchError::Start)?
        {
            (Cloned::Child, in_v2_cgroup) => child_main(&plan, in_v2_cgroup),
            (Cloned::Parent(pid), _) => pid,
        };
        drop(report_write);
        drop(stderr_write);
        drop(null);

        // The report ends at exec (close-on-exec) or holds the failed step.
        let mut record = Vec::with_capacity(8);
        let report = File::from(report_read).read_to_end(&mut record);
        let mut stderr = Vec::new();
        let read = File::from(stderr_read).read_to_end(&mut stderr);
        let status = wait(pid)?;
        // CPU time, unlike wall time, says what criu costs on a host busy with other
        // work (criu and the helpers it reaped; not the restored processes).
        tracing::debug!(
            cpu_ms = (children_cpu() - cpu_before).as_secs_f64() * 1e3,
            "criu finished"
        );
        report.map_err(LaunchError::Wait)?;
        read.map_err(LaunchError::Wait)?;
        if record.len() >= 8 {
            let step = u32::from_ne_bytes([record[0], record[1], record[2], record[3]]);
            let errno = i32::from_ne_bytes([record[4], record[5], record[6], record[7]]);
            return Err(LaunchError::Setup {
                step: STEPS
                    .get(step as usize)
                    .copied()
                    .unwrap_or("an unknown step"),
                source: io::Error::from_raw_os_error(errno),
            });
        }
        Ok(Finished {
            success: libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
        })
    }
}

/// User and system CPU time of this process's waited-for children so far.
fn children_cpu() -> std::time::Duration {
    // SAFETY: getrusage fills the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a live rusage.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    let tv = |t: libc::timeval| {
        std::time::Duration::from_secs(t.tv_sec as u64)
            + std::time::Duration::from_micros(t.tv_usec as u64)
    };
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Waits for child `pid`, retrying on EINTR; returns its wait status.
fn wait(pid: libc::pid_t) -> Result<libc::c_int, LaunchError> {
    let mut status = 0;
    loop {
        // SAFETY: `status` is a live int; `pid` is our unreaped child.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            return Ok(status);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(LaunchError::Wait(e));
        }
    }
}

/// The child: sets itself up and executes criu, or reports the failed step and exits.
fn child_main(p: &ChildPlan<'_>, in_v2_cgroup: bool) -> ! {
    let (step, errno) = match child_setup(p, in_v2_cgroup) {
        Err((step, errno)) => (step, errno),
    };
    let mut record = [0u8; 8];
    record[..4].copy_from_slice(&step.to_ne_bytes());
    record[4..].copy_from_slice(&(errno as i32).to_ne_bytes());
    // SAFETY: write(2) of a stack buffer, then _exit: both async-signal-safe.
    unsafe {
        libc::write(p.report, record.as_ptr().cast(), record.len());
        libc::_exit(127)
    }
}

enum Never {}

fn check(step: u32, r: libc::c_int) -> Result<(), (u32, Errno)> {
    if r < 0 {
        return Err((step, Errno::last()));
    }
    Ok(())
}

fn child_setup(p: &ChildPlan<'_>, in_v2_cgroup: bool) -> Result<Never, (u32, Errno)> {
    let none = std::ptr::null();
    // SAFETY: every call below is a raw system call on NUL-terminated strings and
    // descriptors prepared before the clone, or on null pointers where the call
    // allows them; nothing allocates or takes a lock.
    unsafe {
        // clone gave a new mount namespace; its mounts must propagate nowhere.
        check(
            0,
            libc::mount(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                none.cast(),
            ),
        )?;
        p.kdat
            .bind_in_child()
            .map_err(|e| (1, Errno::from_raw(e.raw_os_error().unwrap_or(0))))?;
        if let Some((dir, mount)) = p.root {
            // pivot_root, which CRIU does into --root, needs a mount point.
            let r = match mount {
                // As the jail made it: a bind, then nosuid and nodev on it (a bind
                // takes no flags of its own).
                RootMount::Bind => match libc::mount(
                    dir.as_ptr(),
                    dir.as_ptr(),
                    none,
                    libc::MS_BIND | libc::MS_REC,
                    none.cast(),
                ) {
                    0 => libc::mount(
                        none,
                        dir.as_ptr(),
                        none,
                        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_NOSUID | libc::MS_NODEV,
                        none.cast(),
                    ),
                    failed => failed,
                },
                RootMount::Overlay(data) => libc::mount(
                    c"overlay".as_ptr(),
                    dir.as_ptr(),
                    c"overlay".as_ptr(),
                    libc::MS_NOSUID | libc::MS_NODEV,
                    data.as_ptr().cast(),
                ),
            };
            check(2, r)?;
        }
        for (fd, at) in p.attach {
            let r = libc::syscall(
                libc::SYS_move_mount,
                *fd,
                c"".as_ptr(),
                libc::AT_FDCWD,
                at.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH,
            );
            check(3, r as libc::c_int)?;
        }
        if let Some(procs) = p.v2_procs.filter(|_| !in_v2_cgroup) {
            check(
                4,
                libc::write(procs, b"0".as_ptr().cast(), 1) as libc::c_int,
            )?;
        }
        for tasks in &p.v1_tasks {
            // The process is single-threaded here: moving the thread moves it all.
            check(
                5,
                libc::write(*tasks, b"0".as_ptr().cast(), 1) as libc::c_int,
            )?;
        }
        if p.new_cgroup_ns {
            namespaces::unshare_cgroup_in_child().map_err(|e| (6, e))?;
        }
        for (source, target) in &p.dups {
            check(7, libc::dup2(*source, *target))?;
        }
        libc::execve(p.path.as_ptr(), p.argv.as_ptr(), p.envp.as_ptr());
    }
    Err((8, Errno::last()))
}

/// `move_mount` flag: the source is the descriptor itself.
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x0000_0004;

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(io::Error::from)
}

/// A close-on-exec duplicate of `fd` numbered `floor` or higher.
fn dup_at_least(fd: RawFd, floor: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC only creates a new descriptor.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, floor) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` was just created and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}
