//! Pre-started supervisors, so process start-up and KVM warm-up stay off the create path.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};

use super::protocol::{read_frame, Response};
use super::server::WarmFor;

/// Environment variable naming the supervisor binary.
pub const SUPERVISOR_ENV: &str = "CUBE_SUPERVISOR";
/// File name of the supervisor binary.
pub const SUPERVISOR_BIN: &str = "cube-supervisor";
/// Environment variable naming a file supervisors append their logs to.
pub const SUPERVISOR_LOG_ENV: &str = "CUBE_SUPERVISOR_LOG";

/// Why a supervisor could not be started.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// No supervisor binary was found.
    #[error("Cannot find the `cube-supervisor` binary (set {SUPERVISOR_ENV} or install it next to `cube`)")]
    NotFound,
    /// The socket pair could not be created.
    #[error("Creating the supervisor socket pair")]
    SocketPair(#[source] std::io::Error),
    /// The process could not be started.
    #[error("Starting {0}")]
    Spawn(String, #[source] std::io::Error),
    /// The supervisor could not get ready.
    #[error("Sandbox supervisor failed to start: {0}")]
    NotReady(String),
    /// The launcher process failed.
    #[error("Supervisor launcher exited with {0}")]
    Launcher(std::process::ExitStatus),
}

/// Finds the supervisor binary: `$CUBE_SUPERVISOR`, else next to the running
/// executable or one directory up (where cargo puts binaries for test executables).
pub fn locate_supervisor() -> Result<PathBuf, PoolError> {
    if let Some(path) = std::env::var_os(SUPERVISOR_ENV) {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe().map_err(|_| PoolError::NotFound)?;
    let dir = exe.parent().ok_or(PoolError::NotFound)?;
    for candidate in [
        dir.join(SUPERVISOR_BIN),
        dir.join("..").join(SUPERVISOR_BIN),
    ] {
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(PoolError::NotFound)
}

/// A started supervisor waiting for its first request.
pub struct IdleSupervisor {
    /// The connection to it.
    pub stream: UnixStream,
}

/// Starts one supervisor. It detaches (double fork, new session), so it is never this
/// process's child and can outlive it.
pub fn spawn_supervisor(exe: &Path) -> Result<IdleSupervisor, PoolError> {
    spawn_supervisor_with_scratch(exe, None, WarmFor::Any)
}

/// Like [`spawn_supervisor`]; with `scratch` (a directory on the store's filesystem)
/// the supervisor also starts a jail there ahead of time; it prepares for `warm_for`.
pub fn spawn_supervisor_with_scratch(
    exe: &Path,
    scratch: Option<&Path>,
    warm_for: WarmFor,
) -> Result<IdleSupervisor, PoolError> {
    spawn_supervisor_warm(exe, scratch, warm_for, false)
}

/// Like [`spawn_supervisor_with_scratch`]; with `network`, the jail started ahead
/// also gets a network device ahead (for networked creates).
pub fn spawn_supervisor_warm(
    exe: &Path,
    scratch: Option<&Path>,
    warm_for: WarmFor,
    network: bool,
) -> Result<IdleSupervisor, PoolError> {
    let (ours, theirs) = UnixStream::pair().map_err(PoolError::SocketPair)?;
    let theirs: OwnedFd = theirs.into();
    let fd = theirs.as_raw_fd();
    let mut command = Command::new(exe);
    command
        .arg("--control-fd")
        .arg("3")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    if let Some(dir) = scratch {
        command.arg("--scratch").arg(dir);
    }
    match warm_for {
        WarmFor::Any => {}
        WarmFor::Vm => {
            command.arg("--warm").arg("vm");
        }
        WarmFor::Jail => {
            command.arg("--warm").arg("jail");
        }
    }
    if network {
        command.arg("--network");
    }
    match std::env::var_os(SUPERVISOR_LOG_ENV).and_then(|p| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .ok()
    }) {
        Some(log) => command.stderr(log),
        None => command.stderr(Stdio::null()),
    };
    // SAFETY: between fork and exec the closure only calls dup2, which is
    // async-signal-safe; dup2 clears FD_CLOEXEC on the new descriptor 3.
    unsafe {
        command.pre_exec(move || {
            // dup2 onto itself would keep FD_CLOEXEC: clear it explicitly then.
            let r = if fd == 3 {
                libc::fcntl(3, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, 3)
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut launcher = command
        .spawn()
        .map_err(|e| PoolError::Spawn(exe.display().to_string(), e))?;
    drop(theirs);
    // The launcher forks the real supervisor and exits at once; reaping it here leaves
    // no zombie, and the supervisor is re-parented away from us.
    let status = launcher
        .wait()
        .map_err(|e| PoolError::Spawn(exe.display().to_string(), e))?;
    if !status.success() {
        return Err(PoolError::Launcher(status));
    }
    // The supervisor says when it is warm (KVM open, a VM pre-built) or why it cannot be.
    match read_frame::<Response>(&mut &ours) {
        Ok(Response::Ok) => Ok(IdleSupervisor { stream: ours }),
        Ok(Response::Error(failure)) => Err(PoolError::NotReady(failure.message)),
        Ok(other) => Err(PoolError::NotReady(format!(
            "unexpected greeting {other:?}"
        ))),
        Err(e) => Err(PoolError::NotReady(crate::error_report::chain(&e))),
    }
}

struct PoolState {
    idle: VecDeque<IdleSupervisor>,
    refilling: bool,
}

/// A pool of idle supervisors, refilled in the background.
pub struct SupervisorPool {
    exe: PathBuf,
    scratch: Option<PathBuf>,
    /// Whether its supervisors attach a network device to their jail ahead.
    network: bool,
    target: usize,
    state: Arc<(Mutex<PoolState>, Condvar)>,
}

impl SupervisorPool {
    /// A pool that keeps `target` supervisors of `exe` ready (0 disables pooling).
    pub fn new(exe: PathBuf, target: usize) -> Self {
        Self::with_scratch(exe, target, None)
    }

    /// Like [`SupervisorPool::new`]; each supervisor also starts a jail ahead of time
    /// in `scratch` (a directory on the store's filesystem).
    pub fn with_scratch(exe: PathBuf, target: usize, scratch: Option<PathBuf>) -> Self {
        Self::start(exe, target, scratch, false)
    }

    /// A pool for networked jail sandboxes: each supervisor starts a jail ahead of
    /// time in `scratch` and attaches a network device into it (deny-everything until
    /// a create puts its own policy in force), so a networked create only writes maps.
    pub fn networked(exe: PathBuf, target: usize, scratch: PathBuf) -> Self {
        Self::start(exe, target, Some(scratch), true)
    }

    fn start(exe: PathBuf, target: usize, scratch: Option<PathBuf>, network: bool) -> Self {
        let pool = SupervisorPool {
            exe,
            scratch,
            network,
            target,
            state: Arc::new((
                Mutex::new(PoolState {
                    idle: VecDeque::new(),
                    refilling: false,
                }),
                Condvar::new(),
            )),
        };
        pool.refill();
        pool
    }

    /// The supervisor binary.
    pub fn exe(&self) -> &Path {
        &self.exe
    }

    /// Takes a ready supervisor, or starts one if none is ready.
    pub fn take(&self) -> Result<IdleSupervisor, PoolError> {
        self.take_for(WarmFor::Any)
    }

    /// Like [`SupervisorPool::take`]; a supervisor started on the spot prepares only
    /// for `engine` (a jail's needs no KVM warm-up).
    pub fn take_for(&self, engine: WarmFor) -> Result<IdleSupervisor, PoolError> {
        let taken = {
            let mut state = self.state.0.lock().unwrap_or_else(|e| e.into_inner());
            state.idle.pop_front()
        };
        self.refill();
        match taken {
            Some(s) => Ok(s),
            None => {
                tracing::debug!("supervisor pool empty: starting one on the create path");
                spawn_supervisor_with_scratch(&self.exe, None, engine)
            }
        }
    }

    /// Waits until the pool holds its target number of supervisors.
    pub fn wait_full(&self) {
        let (lock, cond) = &*self.state;
        let state = lock.lock().unwrap_or_else(|e| e.into_inner());
        let _state = cond
            .wait_while(state, |s| s.idle.len() < self.target && s.refilling)
            .unwrap_or_else(|e| e.into_inner());
    }

    fn refill(&self) {
        if self.target == 0 {
            return;
        }
        {
            let mut state = self.state.0.lock().unwrap_or_else(|e| e.into_inner());
            if state.refilling || state.idle.len() >= self.target {
                return;
            }
            state.refilling = true;
        }
        let state = Arc::clone(&self.state);
        let exe = self.exe.clone();
        let scratch = self.scratch.clone();
        let network = self.network;
        let target = self.target;
        let spawned = std::thread::Builder::new()
            .name("supervisor-pool".into())
            .spawn(move || loop {
                let (lock, cond) = &*state;
                let have = lock.lock().unwrap_or_else(|e| e.into_inner()).idle.len();
                if have >= target {
                    lock.lock().unwrap_or_else(|e| e.into_inner()).refilling = false;
                    cond.notify_all();
                    return;
                }
                // A networked supervisor serves jails only: no KVM warm-up.
                let warm_for = if network { WarmFor::Jail } else { WarmFor::Any };
                match spawn_supervisor_warm(&exe, scratch.as_deref(), warm_for, network) {
                    Ok(s) => lock
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .idle
                        .push_back(s),
                    Err(e) => {
                        tracing::warn!("pre-starting a supervisor: {e}");
                        lock.lock().unwrap_or_else(|e| e.into_inner()).refilling = false;
                        cond.notify_all();
                        return;
                    }
                }
                cond.notify_all();
            });
        if spawned.is_err() {
            self.state
                .0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .refilling = false;
        }
    }
}
