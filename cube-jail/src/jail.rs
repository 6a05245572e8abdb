//! The jail: puts the pieces together into one sandboxed process tree, and tears it down.
//!
//! # How the child is made safely from a multi-threaded parent
//! Everything that allocates, reads files or can fail in a complicated way happens in
//! the parent before the `clone`: the cgroups are created and opened (the child is
//! born in the v2 one through `clone3`'s `CLONE_INTO_CGROUP` and writes itself into the
//! v1 ones' `tasks`, neither of which waits on the kernel's global migration lock), the sandbox directory and mount points are made, the mount plan, the
//! seccomp BPF, argv, envp and the exec candidates are built as C data. The child (a
//! fork-style `clone` that is already PID 1 of its new PID namespace, so no second fork
//! is needed) then only issues raw system calls over that memory: no allocation, no
//! locks, no panics. `std::process::Command::pre_exec` was not used because it cannot
//! create the PID namespace (a process cannot enter a new PID namespace itself, only
//! its children are born in one) and its fork is outside our control.
//!
//! Any failure in the child is written as a fixed 12-byte record (stage, step index,
//! errno) to a close-on-exec pipe and the child exits; a successful `execve` closes the
//! pipe, so the parent reading EOF knows the program runs. The parent turns the record
//! into a [`JailError::Setup`] naming the stage and, for mounts, the exact step.

use std::ffi::{CString, OsStr, OsString};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;

use crate::capabilities::{self, CapabilityError, Identity};
use crate::cgroup::{CgroupError, CgroupLayout, Limits, SandboxCgroup};
use crate::disk_limit::{DiskLimit, DiskLimitError};
use crate::namespaces::{self, Cloned, NamespaceError, NamespaceSet};
use crate::rootfs::{
    self, MountPlan, ReadOnlyBind, RootLimits, RootSpec, RootfsError, RootfsLayout,
};
use crate::sandbox_uid::{SandboxUidError, UidLease};
use crate::seccomp::{SeccompError, SeccompProgram};

/// The uid and gid sandbox processes run as where [`JailConfig::own_uid`] is off and
/// no other identity is given: the host's `nobody`/`nogroup`,
/// which owns no files and, in its own PID namespace, can signal nothing on the host.
pub const DEFAULT_IDENTITY: Identity = Identity {
    uid: 65534,
    gid: 65534,
};

/// The highest descriptor number [`Jail::spawn_with_fds`] installs a passed fd at.
pub const MAX_PASSED_FD: RawFd = 1023;

/// `PATH` inside the sandbox unless the configuration sets one.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Errors from spawning, controlling and destroying a jail.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// The sandbox name is empty, too long or has characters other than `[A-Za-z0-9_-]`.
    #[error("invalid sandbox name {0:?}")]
    InvalidName(String),
    /// argv is empty or holds a NUL byte.
    #[error("invalid argv: {0}")]
    InvalidArgv(&'static str),
    /// An environment variable's name is empty or holds `=` or NUL, or its value a NUL.
    #[error("invalid environment variable {0:?}")]
    InvalidEnv(String),
    /// The working directory is not absolute or holds a NUL byte.
    #[error("invalid working directory {0}")]
    InvalidCwd(PathBuf),
    /// A namespace the jail cannot work without was turned off.
    #[error("the {0} namespace cannot be turned off")]
    RequiredNamespace(&'static str),
    /// Cgroup set-up or control failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// Root filesystem preparation or removal failed.
    #[error(transparent)]
    Rootfs(#[from] RootfsError),
    /// The seccomp filter could not be built.
    #[error(transparent)]
    Seccomp(#[from] SeccompError),
    /// The privilege drop could not be prepared.
    #[error(transparent)]
    Capability(#[from] CapabilityError),
    /// The namespaces could not be created.
    #[error(transparent)]
    Namespace(#[from] NamespaceError),
    /// A pipe or file the parent needs could not be made.
    #[error("cannot {action}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The sandbox process failed while setting itself up, before running the program.
    #[error("sandbox set-up failed at {stage}: {detail}")]
    Setup {
        /// Which stage failed.
        stage: SetupStage,
        /// Which step of the stage, in words.
        detail: String,
        /// The system call's error.
        #[source]
        source: Errno,
    },
    /// The sandbox process neither ran the program nor reported a failure in time.
    #[error("sandbox set-up did not finish in time")]
    SetupTimeout,
    /// The set-up report from the child was not one this module writes.
    #[error("malformed set-up report from the sandbox process")]
    MalformedReport,
    /// Waiting for the sandbox's first process failed.
    #[error("cannot wait for the sandbox process")]
    Wait(#[source] Errno),
    /// A descriptor to pass in targets stdio (0-2), is above [`MAX_PASSED_FD`], or is
    /// named twice.
    #[error("cannot pass a descriptor as fd {0}")]
    InvalidPassedFd(RawFd),
    /// Signalling the sandbox's first process failed.
    #[error("cannot kill the sandbox process")]
    Kill(#[source] Errno),
    /// No uid of its own could be leased for the sandbox.
    #[error(transparent)]
    Uid(#[from] SandboxUidError),
    /// The disk limit could not be set.
    #[error(transparent)]
    Disk(#[from] DiskLimitError),
    /// The jail's tmpfs mounts could not be resized.
    #[error(transparent)]
    Tmpfs(#[from] crate::tmpfs_resize::TmpfsResizeError),
    /// A network namespace to join was given together with a new one to create.
    #[error("a jail joins a network namespace or creates one, not both")]
    NetnsConflict,
}

type Result<T> = std::result::Result<T, JailError>;

/// A stage of the child's set-up, as reported through the error pipe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum SetupStage {
    /// Writing to a `cgroup.procs` file to join the sandbox cgroups.
    JoinCgroup = 1,
    /// Creating the cgroup namespace.
    CgroupNamespace,
    /// A step of the mount plan.
    Mount,
    /// `pivot_root` into the sandbox root.
    PivotRoot,
    /// Setting the hostname.
    Hostname,
    /// Bringing up loopback.
    Loopback,
    /// Installing stdin/stdout/stderr.
    Stdio,
    /// Changing to the working directory.
    Chdir,
    /// Dropping the capability bounding and ambient sets.
    DropBounding,
    /// Switching to the unprivileged uid/gid.
    SwitchIdentity,
    /// Clearing the remaining capability sets.
    ClearCapabilities,
    /// Setting no_new_privs.
    NoNewPrivs,
    /// Asking for SIGKILL when the spawning thread ends.
    ParentDeath,
    /// Installing the seccomp filter.
    Seccomp,
    /// Installing a passed descriptor at its number.
    PassFd,
    /// Executing the program.
    Exec,
    /// Joining the network namespace named by [`JailConfig::netns`].
    JoinNetns,
    /// Keeping CAP_SYS_CHROOT for PID 1 ([`JailConfig::pid1_may_chroot`]).
    KeepChroot,
}

impl SetupStage {
    const ALL: [SetupStage; 17] = [
        SetupStage::JoinCgroup,
        SetupStage::CgroupNamespace,
        SetupStage::Mount,
        SetupStage::PivotRoot,
        SetupStage::Hostname,
        SetupStage::Loopback,
        SetupStage::Stdio,
        SetupStage::Chdir,
        SetupStage::DropBounding,
        SetupStage::SwitchIdentity,
        SetupStage::ClearCapabilities,
        SetupStage::NoNewPrivs,
        SetupStage::ParentDeath,
        SetupStage::Seccomp,
        SetupStage::PassFd,
        SetupStage::Exec,
        SetupStage::JoinNetns,
    ];

    fn from_wire(v: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|s| *s as u32 == v)
    }
}

impl fmt::Display for SetupStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            SetupStage::JoinCgroup => "joining the cgroups",
            SetupStage::CgroupNamespace => "creating the cgroup namespace",
            SetupStage::Mount => "mounting the root filesystem",
            SetupStage::PivotRoot => "pivot_root",
            SetupStage::Hostname => "setting the hostname",
            SetupStage::Loopback => "bringing up loopback",
            SetupStage::Stdio => "installing stdio",
            SetupStage::Chdir => "changing directory",
            SetupStage::DropBounding => "dropping the capability bounding set",
            SetupStage::SwitchIdentity => "switching uid/gid",
            SetupStage::ClearCapabilities => "clearing capabilities",
            SetupStage::NoNewPrivs => "setting no_new_privs",
            SetupStage::ParentDeath => "asking to die with the spawning thread",
            SetupStage::Seccomp => "installing the seccomp filter",
            SetupStage::PassFd => "installing a passed descriptor",
            SetupStage::Exec => "executing the program",
            SetupStage::JoinNetns => "joining the network namespace",
            SetupStage::KeepChroot => "keeping CAP_SYS_CHROOT for PID 1",
        };
        f.write_str(s)
    }
}

/// Where a standard stream of the sandbox's first process goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Stdio {
    /// The host's `/dev/null`.
    #[default]
    Null,
    /// The same stream as the calling process.
    Inherit,
    /// A pipe whose other end is taken with [`Jail::take_stdin`] and friends.
    Pipe,
    /// This descriptor of the caller (a terminal of the sandbox's own, say); the
    /// sandbox gets a duplicate. It must stay open until the spawn returns.
    Fd(RawFd),
}

/// Everything that defines a sandbox.
#[derive(Clone, Debug)]
pub struct JailConfig {
    /// Unique name; names the cgroup directories (`[A-Za-z0-9_-]`, at most 64).
    pub name: String,
    /// The sandbox's own directory, created by spawn (it must not exist) and removed by
    /// destroy; holds the writable layer.
    pub state_dir: PathBuf,
    /// What the root filesystem is made of.
    pub root: RootSpec,
    /// The unprivileged identity the program runs as when [`JailConfig::own_uid`] is
    /// off.
    pub identity: Identity,
    /// Run as a host uid (and gid) of the sandbox's own, leased for it (see
    /// [`crate::sandbox_uid`]), instead of `identity`: per-user kernel limits are then
    /// its own. A seeded layer is given to that uid. Default true.
    pub own_uid: bool,
    /// Resource limits.
    pub limits: Limits,
    /// Hostname in the sandbox's UTS namespace.
    pub hostname: String,
    /// Extra environment variables; they override the defaults (`PATH`, `HOME`, `LANG`).
    pub env: Vec<(String, String)>,
    /// Working directory inside the sandbox.
    pub cwd: PathBuf,
    /// Standard input.
    pub stdin: Stdio,
    /// Standard output.
    pub stdout: Stdio,
    /// Standard error.
    pub stderr: Stdio,
    /// Namespaces to create.
    pub namespaces: NamespaceSet,
    /// Host files and directories shown read-only inside the sandbox, mounted last.
    pub binds: Vec<ReadOnlyBind>,
    /// A writable layer an earlier sandbox left ([`Jail::layer_dir`], kept by
    /// [`Jail::destroy_keeping_layer`] or cloned from a snapshot): spawn moves it into
    /// place instead of starting empty, so the sandbox finds its files again. It must be
    /// on the filesystem of `state_dir` and is consumed; a spawn that fails moves it
    /// back.
    pub seed_layer: Option<PathBuf>,
    /// The sandbox can be paused and checkpointed (both freeze its cgroup) and its
    /// use read from its cgroups. A jail that is not pausable and has no limits gets
    /// no cgroup at all and runs in the caller's: nothing would use one, and its PID
    /// namespace already ends every process of it with its PID 1 (`cube run`).
    /// Default true.
    pub pausable: bool,
    /// PID 1, and with it the whole sandbox, is killed when the thread that spawned it
    /// ends, however it ends (`PR_SET_PDEATHSIG`): for a sandbox that must not
    /// outlive its runner (`cube run`). Spawn from a thread that lives as long as the
    /// sandbox should (the main thread). A checkpoint's restore does not carry it over.
    /// Default false.
    pub die_with_parent: bool,
    /// A network namespace to join (a file such as `/var/run/netns/NAME` or
    /// `/proc/PID/ns/net`) instead of creating one: how a pod's sandbox gets the
    /// network its CNI plugins set up. Needs [`NamespaceSet::net`] off; the namespace's
    /// devices are used as they are (loopback included). Default None.
    pub netns: Option<PathBuf>,
    /// PID 1 keeps CAP_SYS_CHROOT (as an ambient capability, so it survives the exec;
    /// every other capability is dropped as usual) and the filter lets `chroot`
    /// through: a pod sandbox's agent runs each container's processes in that
    /// container's own root. PID 1 must empty its ambient and inheritable sets at
    /// start so its children do not inherit the capability (Cube's agent does). Under
    /// no_new_privs a chroot grants nothing: no setuid or file-capability exec can
    /// make use of a planted root. Default false.
    pub pid1_may_chroot: bool,
}

impl JailConfig {
    /// A sandbox on the host userland, as a uid of its own, without limits, no network, stdio to
    /// `/dev/null`.
    pub fn new(name: impl Into<String>, state_dir: impl Into<PathBuf>) -> Self {
        JailConfig {
            name: name.into(),
            state_dir: state_dir.into(),
            root: RootSpec::default(),
            identity: DEFAULT_IDENTITY,
            own_uid: true,
            limits: Limits::default(),
            hostname: "sandbox".into(),
            env: Vec::new(),
            cwd: PathBuf::from(rootfs::HOME),
            stdin: Stdio::Null,
            stdout: Stdio::Null,
            stderr: Stdio::Null,
            namespaces: NamespaceSet::default(),
            binds: Vec::new(),
            seed_layer: None,
            pausable: true,
            die_with_parent: false,
            netns: None,
            pid1_may_chroot: false,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let n = &self.name;
        if n.is_empty()
            || n.len() > 64
            || !n
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(JailError::InvalidName(n.clone()));
        }
        for (k, v) in &self.env {
            if k.is_empty() || k.contains(['=', '\0']) || v.contains('\0') {
                return Err(JailError::InvalidEnv(k.clone()));
            }
        }
        if !self.cwd.is_absolute() || self.cwd.as_os_str().as_bytes().contains(&0) {
            return Err(JailError::InvalidCwd(self.cwd.clone()));
        }
        self.identity.validate()?;
        // The root is assembled with mounts and /proc must show only the sandbox: without
        // these two namespaces both would happen on the host.
        if !self.namespaces.mount {
            return Err(JailError::RequiredNamespace("mount"));
        }
        if !self.namespaces.pid {
            return Err(JailError::RequiredNamespace("pid"));
        }
        if self.netns.is_some() && self.namespaces.net {
            return Err(JailError::NetnsConflict);
        }
        Ok(())
    }

    fn environment(&self) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = vec![
            ("PATH".into(), DEFAULT_PATH.into()),
            ("HOME".into(), rootfs::HOME.into()),
            ("LANG".into(), "C.UTF-8".into()),
        ];
        for (k, v) in &self.env {
            env.retain(|(ek, _)| ek != k);
            env.push((k.clone(), v.clone()));
        }
        env
    }
}

/// How the sandbox's first process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JailExit {
    /// It exited with this code.
    Exited(i32),
    /// A signal killed it.
    Signaled(i32),
}

impl JailExit {
    /// Whether it exited with code 0.
    pub fn success(&self) -> bool {
        *self == JailExit::Exited(0)
    }
}

/// Everything the child needs, prepared by the parent; see the module docs.
struct ChildPlan<'a> {
    /// The v2 `cgroup.procs`, written only where `clone3` could not start the child in
    /// the v2 cgroup already.
    v2_procs: Option<RawFd>,
    /// The v1 `tasks` files (see [`SandboxCgroup::join_points`]).
    v1_tasks: Vec<RawFd>,
    new_cgroup_ns: bool,
    mounts: &'a MountPlan,
    hostname: Option<CString>,
    loopback: bool,
    /// A network namespace to join first.
    join_netns: Option<RawFd>,
    stdio: [Option<RawFd>; 3],
    cwd: CString,
    last_cap: u32,
    identity: Identity,
    /// Capabilities PID 1 keeps through its exec (bit N = capability N).
    pid1_keeps: u64,
    seccomp: &'a SeccompProgram,
    exec_candidates: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    report_fd: RawFd,
    /// (source, target): sources are close-on-exec and above every target.
    passed: Vec<(RawFd, RawFd)>,
    /// A pidfd of the spawning process, with [`JailConfig::die_with_parent`]: it
    /// reads as ready once that process is gone, which tells a parent that died
    /// before the death signal was asked for.
    parent_pidfd: Option<RawFd>,
}

type ChildFailure = (SetupStage, usize, Errno);

fn stage<T>(
    s: SetupStage,
    r: std::result::Result<T, Errno>,
) -> std::result::Result<T, ChildFailure> {
    r.map_err(|e| (s, 0, e))
}

/// Runs in the cloned child: set up, then exec; on failure report and exit.
fn child_main(p: &ChildPlan<'_>, in_v2_cgroup: bool) -> ! {
    let (s, index, errno) = match child_setup(p, in_v2_cgroup) {
        Ok(never) => match never {},
        Err(f) => f,
    };
    let mut record = [0u8; 12];
    record[0..4].copy_from_slice(&(s as u32).to_ne_bytes());
    record[4..8].copy_from_slice(&(index as u32).to_ne_bytes());
    record[8..12].copy_from_slice(&(errno as i32).to_ne_bytes());
    // SAFETY: writes a live stack buffer to the report pipe, then exits without running
    // any of the parent's atexit handlers or destructors.
    unsafe {
        libc::write(p.report_fd, record.as_ptr().cast(), record.len());
        libc::_exit(127)
    }
}

enum Never {}

fn child_setup(p: &ChildPlan<'_>, in_v2_cgroup: bool) -> std::result::Result<Never, ChildFailure> {
    // Modes of mount points and device nodes are exact; restored before exec.
    // SAFETY: umask has no failure mode and no memory effects.
    unsafe { libc::umask(0) };
    // A session of its own: no controlling terminal of the host's (whose TIOCSTI could
    // push keystrokes into it), and a process tree CRIU can checkpoint, which needs the
    // session leader inside the PID namespace. Cannot fail: a fresh child leads no
    // process group.
    // SAFETY: integer-only system call.
    unsafe { libc::setsid() };
    if let Some(fd) = p.join_netns {
        // SAFETY: setns on a descriptor the parent opened; no memory effects.
        if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
            return Err((SetupStage::JoinNetns, 0, Errno::last()));
        }
    }
    let v2 = if in_v2_cgroup { None } else { p.v2_procs };
    for (i, fd) in v2.iter().chain(&p.v1_tasks).enumerate() {
        // SAFETY: writes one byte from a static string to an open descriptor.
        let r = unsafe { libc::write(*fd, b"0".as_ptr().cast(), 1) };
        if r != 1 {
            return Err((SetupStage::JoinCgroup, i, Errno::last()));
        }
    }
    if p.new_cgroup_ns {
        stage(
            SetupStage::CgroupNamespace,
            namespaces::unshare_cgroup_in_child(),
        )?;
    }
    p.mounts.execute_in_child().map_err(|(i, e)| {
        if i == p.mounts.len() {
            (SetupStage::PivotRoot, i, e)
        } else {
            (SetupStage::Mount, i, e)
        }
    })?;
    if let Some(h) = &p.hostname {
        stage(SetupStage::Hostname, namespaces::set_hostname_in_child(h))?;
    }
    if p.loopback {
        stage(SetupStage::Loopback, namespaces::loopback_up_in_child())?;
    }
    for (target, fd) in p.stdio.iter().enumerate() {
        if let Some(fd) = fd {
            // SAFETY: dup2 between open descriptors; no memory effects.
            if unsafe { libc::dup2(*fd, target as libc::c_int) } < 0 {
                return Err((SetupStage::Stdio, target, Errno::last()));
            }
        }
    }
    // SAFETY: live NUL-terminated string.
    if unsafe { libc::chdir(p.cwd.as_ptr()) } != 0 {
        return Err((SetupStage::Chdir, 0, Errno::last()));
    }
    stage(
        SetupStage::DropBounding,
        capabilities::keep_bounding_and_clear_ambient(p.last_cap, p.pid1_keeps),
    )?;
    if p.pid1_keeps != 0 {
        stage(
            SetupStage::KeepChroot,
            capabilities::keep_permitted_through_uid_switch_in_child(),
        )?;
    }
    stage(
        SetupStage::SwitchIdentity,
        capabilities::switch_identity_in_child(p.identity),
    )?;
    if p.pid1_keeps != 0 {
        stage(
            SetupStage::KeepChroot,
            capabilities::keep_through_exec_in_child(p.pid1_keeps),
        )?;
    } else {
        stage(
            SetupStage::ClearCapabilities,
            capabilities::clear_sets_in_child(),
        )?;
    }
    stage(
        SetupStage::NoNewPrivs,
        capabilities::set_no_new_privs_in_child(),
    )?;
    if let Some(pidfd) = p.parent_pidfd {
        // After every credential change, which would clear it.
        stage(SetupStage::ParentDeath, die_with_parent_in_child(pidfd))?;
    }
    stage(SetupStage::Seccomp, p.seccomp.install_in_child())?;
    // SAFETY: as above.
    unsafe { libc::umask(0o022) };
    // Anything the parent opened without close-on-exec must not leak into the sandbox.
    // Errors (kernels before 5.11) leave Rust's default O_CLOEXEC as the only guard.
    // SAFETY: integer-only system call.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    // After close_range, so the targets are the only descriptors besides stdio that
    // survive exec: dup2 leaves close-on-exec clear on the new descriptor, and the
    // sources, above every target, stay close-on-exec.
    for &(source, target) in &p.passed {
        // SAFETY: dup2 between descriptors; no memory effects.
        if unsafe { libc::dup2(source, target) } < 0 {
            return Err((SetupStage::PassFd, target as usize, Errno::last()));
        }
    }
    let mut err = Errno::ENOENT;
    for path in &p.exec_candidates {
        // SAFETY: path is a live C string; argv and envp are NULL-terminated arrays of
        // pointers into C strings owned by the parent's (copied) frame.
        unsafe { libc::execve(path.as_ptr(), p.argv.as_ptr(), p.envp.as_ptr()) };
        let e = Errno::last();
        // Like execvp: a later directory may still have it; keep the most telling error.
        if e != Errno::ENOENT && e != Errno::ENOTDIR {
            err = e;
        }
    }
    Err((SetupStage::Exec, 0, err))
}

/// Asks for SIGKILL when the spawning thread ends, then checks that the spawning
/// process has not ended already (its death before the request sends nothing).
/// Async-signal-safe.
fn die_with_parent_in_child(parent_pidfd: RawFd) -> std::result::Result<(), Errno> {
    // SAFETY: PR_SET_PDEATHSIG takes one integer argument; no memory effects.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) } != 0 {
        return Err(Errno::last());
    }
    let mut pfd = libc::pollfd {
        fd: parent_pidfd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `pfd` is one live pollfd; a zero timeout does not block.
    let r = unsafe { libc::poll(&mut pfd, 1, 0) };
    if r != 0 {
        // SAFETY: ends the orphaned child at once, running nothing of the parent's.
        unsafe { libc::_exit(137) };
    }
    Ok(())
}

/// A running sandbox. Dropping it destroys the sandbox ([`Jail::destroy`]).
#[derive(Debug)]
pub struct Jail {
    name: String,
    pid: libc::pid_t,
    identity: Identity,
    /// The lease of `identity`'s uid, held while the sandbox's processes live.
    uid_lease: Option<UidLease>,
    exit: Option<JailExit>,
    cgroup: Option<SandboxCgroup>,
    rootfs: Option<RootfsLayout>,
    /// The sandbox directory's disk limit; lifted once the directory is gone.
    disk: Option<DiskLimit>,
    stdin: Option<File>,
    stdout: Option<File>,
    stderr: Option<File>,
}

impl Jail {
    /// Creates the sandbox described by `config` and runs `argv` as its PID 1. Returns
    /// once the program has been executed (or with the reason it could not be).
    pub fn spawn<S: AsRef<OsStr>>(config: &JailConfig, argv: &[S]) -> Result<Jail> {
        Self::spawn_with_fds(config, argv, &[])
    }

    /// Like [`Jail::spawn`], and the program also finds each `(fd, number)` of `fds`
    /// open at `number` (3 to [`MAX_PASSED_FD`]): how a connected socket reaches the
    /// sandbox's agent. Every other descriptor of the caller stays out of the sandbox.
    /// The caller keeps its descriptors; the sandbox gets duplicates.
    pub fn spawn_with_fds<S: AsRef<OsStr>>(
        config: &JailConfig,
        argv: &[S],
        fds: &[(BorrowedFd<'_>, RawFd)],
    ) -> Result<Jail> {
        config.validate()?;
        let mut targets: Vec<RawFd> = fds.iter().map(|(_, t)| *t).collect();
        targets.sort_unstable();
        for (i, t) in targets.iter().enumerate() {
            if !(3..=MAX_PASSED_FD).contains(t) || (i > 0 && targets[i - 1] == *t) {
                return Err(JailError::InvalidPassedFd(*t));
            }
        }
        // Sources (and the report pipe, which is written after the passed descriptors
        // are installed) sit above every target, so no dup2 overwrites one of them.
        let floor = targets.last().map_or(3, |t| t + 1);
        let passed_sources = fds
            .iter()
            .map(|(fd, _)| dup_at_least(fd.as_raw_fd(), floor))
            .collect::<Result<Vec<OwnedFd>>>()?;
        if argv.is_empty() {
            return Err(JailError::InvalidArgv("argv is empty"));
        }
        let argv_c = argv
            .iter()
            .map(|a| CString::new(a.as_ref().as_bytes()))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| JailError::InvalidArgv("argument holds a NUL byte"))?;
        if argv_c[0].as_bytes().is_empty() {
            return Err(JailError::InvalidArgv("program name is empty"));
        }
        let env = config.environment();
        let envp_c = env
            .iter()
            .map(|(k, v)| CString::new(format!("{k}={v}")))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| JailError::InvalidEnv("?".into()))?;
        let exec_candidates = exec_candidates(&argv_c[0], &env)?;
        let hostname = if config.namespaces.uts {
            Some(namespaces::hostname_bytes(&config.hostname)?)
        } else {
            None
        };
        let cwd = CString::new(config.cwd.as_os_str().as_bytes())
            .map_err(|_| JailError::InvalidCwd(config.cwd.clone()))?;
        let (seccomp, pid1_keeps) = if config.pid1_may_chroot {
            (
                SeccompProgram::build_allowing(&[libc::SYS_chroot])?,
                1u64 << capabilities::CAP_SYS_CHROOT,
            )
        } else {
            (SeccompProgram::build()?, 0)
        };
        let last_cap = capabilities::last_cap()?;
        let uid_lease = if config.own_uid {
            Some(UidLease::acquire()?)
        } else {
            None
        };
        let identity = uid_lease
            .as_ref()
            .map_or(config.identity, UidLease::identity);

        let cgroup = if config.pausable || config.limits.needs_cgroup() {
            let layout = CgroupLayout::detect()?;
            Some(SandboxCgroup::create(
                &layout,
                &config.name,
                &config.limits,
            )?)
        } else {
            None
        };
        let in_memory = config.root == RootSpec::HostUserlandInMemory;
        let disk = match config.limits.disk_bytes {
            // A root in memory is limited by its size instead.
            Some(bytes) if !in_memory => Some(DiskLimit::lease(&config.state_dir, bytes)?),
            _ => None,
        };
        let root_limits = RootLimits {
            tmpfs_bytes: config.limits.memory_bytes,
            root_bytes: match (config.limits.disk_bytes, config.limits.memory_bytes) {
                _ if !in_memory => None,
                (Some(d), Some(m)) => Some(d.min(m)),
                (d, m) => d.or(m),
            },
            project: disk.as_ref().map(DiskLimit::project),
        };
        let (rootfs, mounts) = rootfs::prepare_seeded(
            &config.state_dir,
            &config.root,
            identity,
            &config.hostname,
            &config.binds,
            config.seed_layer.as_deref(),
            root_limits,
        )?;
        if let Some(disk) = &disk {
            disk.apply()?;
        }

        let (v2_dir, v1_tasks) = cgroup
            .as_ref()
            .map_or((None, Vec::new()), SandboxCgroup::join_points);
        let io = |action| move |source| JailError::Io { action, source };
        let v2_files = v2_dir
            .map(|d| -> std::io::Result<(File, File)> {
                let dir = OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECTORY)
                    .open(d)?;
                let procs = OpenOptions::new()
                    .write(true)
                    .open(d.join("cgroup.procs"))?;
                Ok((dir, procs))
            })
            .transpose()
            .map_err(io("open the v2 cgroup"))?;
        let tasks_files = v1_tasks
            .iter()
            .map(|p| OpenOptions::new().write(true).open(p))
            .collect::<std::io::Result<Vec<File>>>()
            .map_err(io("open a v1 cgroup's tasks"))?;
        let mut child_ends: Vec<OwnedFd> = Vec::new();
        let mut parent_ends: [Option<File>; 3] = [None, None, None];
        let mut stdio_fds: [Option<RawFd>; 3] = [None; 3];
        for (i, spec) in [config.stdin, config.stdout, config.stderr]
            .into_iter()
            .enumerate()
        {
            match spec {
                Stdio::Inherit => {}
                Stdio::Null => {
                    let f = OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open("/dev/null")
                        .map_err(|source| JailError::Io {
                            action: "open /dev/null",
                            source,
                        })?;
                    stdio_fds[i] = Some(f.as_raw_fd());
                    child_ends.push(f.into());
                }
                Stdio::Pipe => {
                    let (r, w) = pipe()?;
                    let (child, parent) = if i == 0 { (r, w) } else { (w, r) };
                    stdio_fds[i] = Some(child.as_raw_fd());
                    child_ends.push(child);
                    parent_ends[i] = Some(File::from(parent));
                }
                Stdio::Fd(fd) => {
                    let dup = dup_at_least(fd, 3)?;
                    stdio_fds[i] = Some(dup.as_raw_fd());
                    child_ends.push(dup);
                }
            }
        }
        let parent_pidfd = if config.die_with_parent {
            // SAFETY: pidfd_open of this process; the descriptor is owned right away.
            let fd =
                unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0 as libc::c_uint) };
            if fd < 0 {
                return Err(JailError::Io {
                    action: "open a pidfd of this process",
                    source: std::io::Error::last_os_error(),
                });
            }
            // SAFETY: `fd` was just returned by pidfd_open and nothing else owns it.
            let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
            // Close-on-exec and above the passed targets, like every source.
            Some(dup_at_least(fd.as_raw_fd(), floor)?)
        } else {
            None
        };
        let netns_file = config
            .netns
            .as_ref()
            .map(File::open)
            .transpose()
            .map_err(io("open the network namespace to join"))?;
        let (report_read, report_write) = pipe()?;
        let report_write = if fds.is_empty() {
            report_write
        } else {
            // The original must close here: the parent reads until every write end is.
            let moved = dup_at_least(report_write.as_raw_fd(), floor)?;
            drop(report_write);
            moved
        };

        let mut argv_p: Vec<*const libc::c_char> = argv_c.iter().map(|c| c.as_ptr()).collect();
        argv_p.push(std::ptr::null());
        let mut envp_p: Vec<*const libc::c_char> = envp_c.iter().map(|c| c.as_ptr()).collect();
        envp_p.push(std::ptr::null());
        let plan = ChildPlan {
            v2_procs: v2_files.as_ref().map(|(_, procs)| procs.as_raw_fd()),
            v1_tasks: tasks_files.iter().map(AsRawFd::as_raw_fd).collect(),
            new_cgroup_ns: config.namespaces.cgroup,
            mounts: &mounts,
            hostname,
            loopback: config.namespaces.net,
            join_netns: netns_file.as_ref().map(AsRawFd::as_raw_fd),
            stdio: stdio_fds,
            cwd,
            last_cap,
            identity,
            pid1_keeps,
            seccomp: &seccomp,
            exec_candidates,
            argv: argv_p,
            envp: envp_p,
            report_fd: report_write.as_raw_fd(),
            passed: passed_sources
                .iter()
                .zip(fds)
                .map(|(s, (_, t))| (s.as_raw_fd(), *t))
                .collect(),
            parent_pidfd: parent_pidfd.as_ref().map(AsRawFd::as_raw_fd),
        };

        let v2_dir_fd = v2_files.as_ref().map(|(dir, _)| dir.as_raw_fd());
        // SAFETY: the child only runs `child_main`, which makes raw system calls over
        // memory prepared above and never returns (exec or _exit).
        let pid = match unsafe {
            namespaces::clone_into_namespaces(config.namespaces.clone_flags(), v2_dir_fd)
        }? {
            (Cloned::Child, in_v2_cgroup) => child_main(&plan, in_v2_cgroup),
            (Cloned::Parent(pid), _) => pid,
        };
        drop(report_write);
        drop(parent_pidfd);
        drop(passed_sources);
        drop(child_ends);
        drop(v2_files);
        drop(tasks_files);
        drop(netns_file);

        let mut jail = Jail {
            name: config.name.clone(),
            pid,
            identity,
            uid_lease,
            exit: None,
            cgroup,
            rootfs: Some(rootfs),
            disk,
            stdin: parent_ends[0].take(),
            stdout: parent_ends[1].take(),
            stderr: parent_ends[2].take(),
        };
        let mut record = Vec::with_capacity(12);
        // A set-up that hangs (or a broken pipe) must not hang the caller: on error the
        // dropped `jail` kills and reaps the child and removes everything.
        read_report(report_read, &mut record)?;
        if record.is_empty() {
            tracing::debug!(name = %jail.name, pid, "sandbox started");
            if let Some(fs) = jail.rootfs.as_mut() {
                fs.seed_consumed();
            }
            return Ok(jail);
        }
        // The child failed and exits; reap it before `jail` is dropped and cleans up.
        let _ = jail.wait();
        Err(decode_report(&record, &mounts))
    }

    /// A jail around a process tree that was made some other way than [`Jail::spawn`]:
    /// restored from a checkpoint (see [`crate::checkpoint::restore`]). `pid` must be an
    /// unreaped child of the calling process and PID 1 of the sandbox's PID namespace;
    /// `cgroup` and `rootfs` are the sandbox's, and are removed by [`Jail::destroy`] as
    /// for a spawned jail. `stdio` holds the parent ends of piped standard streams.
    /// `identity` is what its processes run as, `uid_lease` the lease of that uid if
    /// this process could take it.
    pub fn from_restored(
        name: String,
        pid: libc::pid_t,
        cgroup: SandboxCgroup,
        rootfs: RootfsLayout,
        stdio: [Option<File>; 3],
        identity: Identity,
        uid_lease: Option<UidLease>,
    ) -> Jail {
        let [stdin, stdout, stderr] = stdio;
        Jail {
            name,
            pid,
            identity,
            uid_lease,
            exit: None,
            cgroup: Some(cgroup),
            rootfs: Some(rootfs),
            disk: None,
            stdin,
            stdout,
            stderr,
        }
    }

    /// Host PID of the sandbox's PID 1.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The sandbox's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The uid and gid the sandbox's processes run as.
    pub fn identity(&self) -> Identity {
        self.identity
    }

    /// The sandbox's cgroups (None after destroy, or for a jail that needed none: see
    /// [`JailConfig::pausable`]).
    pub fn cgroup(&self) -> Option<&SandboxCgroup> {
        self.cgroup.as_ref()
    }

    /// The sandbox's directory (None after destroy).
    pub fn state_dir(&self) -> Option<&Path> {
        self.rootfs.as_ref().map(RootfsLayout::state_dir)
    }

    /// The host directory that is `/` inside the sandbox (None after destroy). With an
    /// overlay root it is only a mount point; the sandbox's writes land in `upper/`.
    pub fn root_dir(&self) -> Option<&Path> {
        self.rootfs.as_ref().map(RootfsLayout::root)
    }

    /// The host directory holding everything the sandbox wrote to its root (None after
    /// destroy); see [`RootfsLayout::layer`].
    pub fn layer_dir(&self) -> Option<&Path> {
        self.rootfs.as_ref().map(RootfsLayout::layer)
    }

    /// Moves the sandbox directory to `to` on the same filesystem while the sandbox
    /// runs (its mounts do not follow host names): how a sandbox started ahead of time
    /// moves into the directory of the sandbox it becomes.
    pub fn relocate(&mut self, to: &Path) -> Result<()> {
        match self.rootfs.as_mut() {
            Some(fs) => Ok(fs.relocate(to)?),
            None => Err(JailError::Io {
                action: "move a destroyed sandbox",
                source: std::io::ErrorKind::NotFound.into(),
            }),
        }
    }

    /// Changes the limits of the running sandbox: memory, pids and, for a sandbox
    /// spawned with one, CPU (which needs the cpu controller then); disk, for a sandbox
    /// spawned with a disk limit (its directory carries the project). A limit left
    /// unset is left as it is, except disk, which is lifted.
    pub fn set_limits(&self, limits: &Limits) -> Result<()> {
        limits.validate()?;
        if let Some(bytes) = limits.memory_bytes {
            // First: a tmpfs that holds more than the new limit refuses it, and then
            // nothing has changed.
            crate::tmpfs_resize::resize(self.pid, bytes)?;
        }
        if limits.needs_cgroup() {
            let layout = CgroupLayout::detect()?;
            self.live_cgroup()?.set_limits(&layout, limits)?;
        }
        match (limits.disk_bytes, &self.disk) {
            (Some(bytes), Some(disk)) => disk.set(bytes)?,
            (None, Some(disk)) => disk.set(0)?,
            (Some(_), None) => {
                let dir = self.state_dir().map(Path::to_path_buf).unwrap_or_default();
                return Err(DiskLimitError::Unsupported(dir).into());
            }
            (None, None) => {}
        }
        Ok(())
    }

    /// Bytes the sandbox's directory holds, where it has a disk limit.
    pub fn disk_used(&self) -> Option<u64> {
        self.disk.as_ref().and_then(|d| d.used_bytes().ok())
    }

    /// Gives a restored jail the disk limit its directory was tagged with.
    pub(crate) fn hold_disk_limit(&mut self, disk: DiskLimit) {
        self.disk = Some(disk);
    }

    /// Like [`Jail::destroy`], but moves the writable layer to `keep` (same filesystem,
    /// must not exist) before the sandbox directory goes: the processes, cgroups and
    /// mounts end, the files stay for a later [`JailConfig::seed_layer`].
    pub fn destroy_keeping_layer(mut self, keep: &Path) -> Result<()> {
        self.kill()?;
        self.wait()?;
        if let Some(cg) = self.cgroup.take() {
            cg.remove()?;
        }
        if let Some(fs) = self.rootfs.take() {
            fs.remove_keeping_layer(keep)?;
        }
        self.disk = None;
        Ok(())
    }

    /// The parent end of a [`Stdio::Pipe`] stdin.
    pub fn take_stdin(&mut self) -> Option<File> {
        self.stdin.take()
    }

    /// The parent end of a [`Stdio::Pipe`] stdout.
    pub fn take_stdout(&mut self) -> Option<File> {
        self.stdout.take()
    }

    /// The parent end of a [`Stdio::Pipe`] stderr.
    pub fn take_stderr(&mut self) -> Option<File> {
        self.stderr.take()
    }

    /// Freezes every process of the sandbox.
    pub fn pause(&self) -> Result<()> {
        Ok(self.live_cgroup()?.freeze()?)
    }

    /// Thaws the sandbox.
    pub fn resume(&self) -> Result<()> {
        Ok(self.live_cgroup()?.thaw()?)
    }

    fn live_cgroup(&self) -> Result<&SandboxCgroup> {
        self.cgroup
            .as_ref()
            .ok_or(JailError::Cgroup(CgroupError::NoFreezer))
    }

    /// Waits for the sandbox's PID 1 to end; when it does the kernel kills every other
    /// process of the sandbox's PID namespace.
    pub fn wait(&mut self) -> Result<JailExit> {
        self.wait_flags(0)?.ok_or(JailError::Wait(Errno::ECHILD))
    }

    /// Like [`Jail::wait`] without blocking: None while PID 1 runs.
    pub fn try_wait(&mut self) -> Result<Option<JailExit>> {
        self.wait_flags(libc::WNOHANG)
    }

    fn wait_flags(&mut self, flags: libc::c_int) -> Result<Option<JailExit>> {
        if let Some(e) = self.exit {
            return Ok(Some(e));
        }
        let mut status = 0;
        loop {
            // SAFETY: `status` is a live int; `pid` is our unreaped child, so the PID
            // cannot have been reused.
            let r = unsafe { libc::waitpid(self.pid, &mut status, flags) };
            if r == 0 {
                return Ok(None);
            }
            if r > 0 {
                break;
            }
            match Errno::last() {
                Errno::EINTR => continue,
                e => return Err(JailError::Wait(e)),
            }
        }
        let exit = if libc::WIFSIGNALED(status) {
            JailExit::Signaled(libc::WTERMSIG(status))
        } else {
            JailExit::Exited(libc::WEXITSTATUS(status))
        };
        self.exit = Some(exit);
        // PID 1 took every process of the sandbox with it: its uid runs nothing now
        // (its files stay its own until a later sandbox is given them).
        self.uid_lease = None;
        Ok(Some(exit))
    }

    /// SIGKILLs the sandbox's PID 1, which takes every process of the sandbox with it
    /// (thawing first, so a paused sandbox dies too). Does not reap: call [`Jail::wait`].
    pub fn kill(&mut self) -> Result<()> {
        if self.exit.is_some() {
            return Ok(());
        }
        // A thaw failure must not stop the kill: a v2-frozen task dies anyway.
        let thawed = match &self.cgroup {
            Some(cg) if cg.freezer().is_some() => cg.thaw().map_err(JailError::from),
            _ => Ok(()),
        };
        // SAFETY: signals our unreaped child; no memory effects.
        if unsafe { libc::kill(self.pid, libc::SIGKILL) } != 0 {
            return Err(JailError::Kill(Errno::last()));
        }
        thawed
    }

    /// Kills and reaps every process, removes the cgroups, detaches any mount left and
    /// deletes the sandbox directory. Afterwards nothing of the sandbox remains. Every
    /// step is tried even when an earlier one fails; the first error is returned.
    pub fn destroy(mut self) -> Result<()> {
        self.destroy_inner()
    }

    fn destroy_inner(&mut self) -> Result<()> {
        if self.cgroup.is_none() && self.rootfs.is_none() {
            return Ok(());
        }
        let mut first: Option<JailError> = None;
        let mut note = |r: Result<()>| {
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        };
        note(self.kill());
        note(self.wait().map(drop));
        if let Some(cg) = self.cgroup.take() {
            note(cg.remove().map_err(JailError::from));
        }
        if let Some(fs) = self.rootfs.take() {
            note(fs.remove().map_err(JailError::from));
        }
        // Once its files are gone, the directory's project is lifted and let go.
        self.disk = None;
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Jail {
    fn drop(&mut self) {
        if let Err(e) = self.destroy_inner() {
            tracing::warn!(name = %self.name, error = %e, "sandbox not fully destroyed");
        }
    }
}

/// Longest time the child's set-up may take before the spawn is abandoned.
const SETUP_TIMEOUT_MS: u16 = 30_000;

/// Reads the child's report until EOF (exec succeeded, or the record was written),
/// waiting at most [`SETUP_TIMEOUT_MS`] in total.
fn read_report(fd: OwnedFd, record: &mut Vec<u8>) -> Result<()> {
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_millis(SETUP_TIMEOUT_MS.into());
    let mut file = File::from(fd);
    let mut buf = [0u8; 64];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(JailError::SetupTimeout);
        }
        let mut pfd = libc::pollfd {
            fd: file.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one live pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if r < 0 {
            match Errno::last() {
                Errno::EINTR => continue,
                e => {
                    return Err(JailError::Io {
                        action: "wait for the set-up report",
                        source: e.into(),
                    })
                }
            }
        }
        if r == 0 {
            continue;
        }
        match file.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => record.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(JailError::Io {
                    action: "read the set-up report",
                    source,
                })
            }
        }
    }
}

/// A close-on-exec duplicate of `fd` numbered `floor` or higher.
fn dup_at_least(fd: RawFd, floor: RawFd) -> Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC only creates a new descriptor; no memory effects.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, floor) };
    if new < 0 {
        return Err(JailError::Io {
            action: "duplicate a descriptor for the sandbox",
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: `new` was just created by fcntl and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| JailError::Io {
        action: "create a pipe",
        source: e.into(),
    })
}

/// The paths `execve` tries, in order: argv\[0\] itself if it has a slash, else each
/// `PATH` directory of the sandbox's environment joined with it.
fn exec_candidates(program: &CString, env: &[(String, String)]) -> Result<Vec<CString>> {
    let bytes = program.as_bytes();
    if bytes.contains(&b'/') {
        return Ok(vec![program.clone()]);
    }
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str())
        .unwrap_or(DEFAULT_PATH);
    path.split(':')
        .filter(|d| !d.is_empty())
        .map(|d| {
            let mut full = OsString::from(d).into_vec();
            full.push(b'/');
            full.extend_from_slice(bytes);
            CString::new(full).map_err(|_| JailError::InvalidArgv("PATH holds a NUL byte"))
        })
        .collect()
}

fn decode_report(record: &[u8], mounts: &MountPlan) -> JailError {
    let Ok(record) = <[u8; 12]>::try_from(record) else {
        return JailError::MalformedReport;
    };
    let word = |i: usize| [record[i], record[i + 1], record[i + 2], record[i + 3]];
    let Some(stage) = SetupStage::from_wire(u32::from_ne_bytes(word(0))) else {
        return JailError::MalformedReport;
    };
    let index = u32::from_ne_bytes(word(4)) as usize;
    let source = Errno::from_raw(i32::from_ne_bytes(word(8)));
    let detail = match stage {
        SetupStage::Mount => mounts.describe(index).to_owned(),
        SetupStage::JoinCgroup => format!("cgroup hierarchy #{index}"),
        SetupStage::Stdio | SetupStage::PassFd => format!("fd {index}"),
        _ => String::from("-"),
    };
    JailError::Setup {
        stage,
        detail,
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_configs() {
        let mut c = JailConfig::new("ok", "/tmp/x");
        assert!(c.validate().is_ok());
        c.name = "bad/name".into();
        assert!(matches!(c.validate(), Err(JailError::InvalidName(_))));
        let mut c = JailConfig::new("ok", "/tmp/x");
        c.env.push(("A=B".into(), "c".into()));
        assert!(matches!(c.validate(), Err(JailError::InvalidEnv(_))));
        let mut c = JailConfig::new("ok", "/tmp/x");
        c.cwd = "rel".into();
        assert!(matches!(c.validate(), Err(JailError::InvalidCwd(_))));
        let mut c = JailConfig::new("ok", "/tmp/x");
        c.identity = Identity { uid: 0, gid: 0 };
        assert!(c.validate().is_err());
        let mut c = JailConfig::new("ok", "/tmp/x");
        c.namespaces.mount = false;
        assert!(matches!(
            c.validate(),
            Err(JailError::RequiredNamespace("mount"))
        ));
    }

    #[test]
    fn environment_overrides_defaults() {
        let mut c = JailConfig::new("ok", "/tmp/x");
        c.env.push(("PATH".into(), "/only".into()));
        let env = c.environment();
        assert_eq!(env.iter().filter(|(k, _)| k == "PATH").count(), 1);
        assert!(env.contains(&("PATH".into(), "/only".into())));
    }

    #[test]
    fn resolves_exec_candidates() {
        let env = vec![("PATH".to_owned(), "/a:/b".to_owned())];
        let c = exec_candidates(&CString::new("sh").unwrap(), &env).unwrap();
        assert_eq!(
            c,
            vec![
                CString::new("/a/sh").unwrap(),
                CString::new("/b/sh").unwrap()
            ]
        );
        let c = exec_candidates(&CString::new("/bin/sh").unwrap(), &env).unwrap();
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn decodes_reports() {
        let tmp = tempfile::tempdir().unwrap();
        let (_layout, plan) = rootfs::prepare(
            &tmp.path().join("sb"),
            &RootSpec::HostUserland,
            DEFAULT_IDENTITY,
            "h",
            &[],
        )
        .unwrap();
        let mut rec = [0u8; 12];
        rec[0..4].copy_from_slice(&(SetupStage::Mount as u32).to_ne_bytes());
        rec[4..8].copy_from_slice(&0u32.to_ne_bytes());
        rec[8..12].copy_from_slice(&libc::EPERM.to_ne_bytes());
        match decode_report(&rec, &plan) {
            JailError::Setup { stage, source, .. } => {
                assert_eq!(stage, SetupStage::Mount);
                assert_eq!(source, Errno::EPERM);
            }
            e => panic!("unexpected {e:?}"),
        }
        assert!(matches!(
            decode_report(&rec[..5], &plan),
            JailError::MalformedReport
        ));
        rec[0..4].copy_from_slice(&999u32.to_ne_bytes());
        assert!(matches!(
            decode_report(&rec, &plan),
            JailError::MalformedReport
        ));
    }
}
