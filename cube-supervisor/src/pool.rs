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
use crate::priority::REFILL_NICE;

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
    spawn(exe, scratch, warm_for, network, false)
}

fn spawn(
    exe: &Path,
    scratch: Option<&Path>,
    warm_for: WarmFor,
    network: bool,
    background: bool,
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
        WarmFor::JailFromImage => {
            command.arg("--warm").arg("jail-from-image");
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
    // SAFETY: between fork and exec the closure only calls dup2, fcntl and
    // setpriority, which are async-signal-safe; dup2 clears FD_CLOEXEC on the new
    // descriptor 3.
    unsafe {
        command.pre_exec(move || {
            // The child is single-threaded here: the whole process starts behind.
            if background {
                libc::setpriority(libc::PRIO_PROCESS, 0, REFILL_NICE);
            }
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
    match launcher.wait() {
        Ok(status) if !status.success() => return Err(PoolError::Launcher(status)),
        Ok(_) => {}
        // A caller that reaps every child of its own (a containerd shim does, on
        // SIGCHLD) took the launcher's status first: the greeting below still says
        // whether the supervisor started.
        Err(e) if e.raw_os_error() == Some(libc::ECHILD) => {}
        Err(e) => return Err(PoolError::Spawn(exe.display().to_string(), e)),
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

/// Longest a create waits for the supervisor the refill is starting before it starts
/// its own (a refill that hangs must not hold creates up).
const REFILL_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

struct PoolState {
    idle: VecDeque<IdleSupervisor>,
    /// Refill threads running.
    workers: usize,
    /// Supervisors those threads are starting now.
    starting: usize,
    /// What the refills prepare for: the engine the last create asked for (both,
    /// until one has). A supervisor warmed for the other engine too would do work
    /// that is thrown away, on a host where that work competes with the creates.
    warm_for: WarmFor,
    /// Creates waiting for a supervisor being started (each waits for its own).
    awaited: usize,
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
                    workers: 0,
                    starting: 0,
                    warm_for: WarmFor::Any,
                    awaited: 0,
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
    /// for `engine` (a jail's needs no KVM warm-up), and so do the refills from now
    /// on (unless `engine` is [`WarmFor::Any`]).
    ///
    /// When the pool is empty while refills are starting supervisors, as many creates
    /// wait for those as are being started: each is part way through its start, and a
    /// second start on the create path would only compete with it for the CPU.
    /// Further creates start their own.
    pub fn take_for(&self, engine: WarmFor) -> Result<IdleSupervisor, PoolError> {
        let (lock, cond) = &*self.state;
        let taken = {
            let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
            if engine != WarmFor::Any && self.network_warm_for() != WarmFor::Jail {
                state.warm_for = engine;
            }
            match state.idle.pop_front() {
                Some(s) => Some(s),
                None if state.starting > state.awaited => {
                    state.awaited += 1;
                    let (mut state, _) = cond
                        .wait_timeout_while(state, REFILL_WAIT, |s| {
                            s.idle.is_empty() && s.starting > 0
                        })
                        .unwrap_or_else(|e| e.into_inner());
                    state.awaited -= 1;
                    state.idle.pop_front()
                }
                None => None,
            }
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

    /// What a networked pool's supervisors are always warmed for.
    fn network_warm_for(&self) -> WarmFor {
        if self.network {
            WarmFor::Jail
        } else {
            WarmFor::Any
        }
    }

    /// Waits until the pool holds its target number of supervisors.
    pub fn wait_full(&self) {
        let (lock, cond) = &*self.state;
        let state = lock.lock().unwrap_or_else(|e| e.into_inner());
        let _state = cond
            .wait_while(state, |s| s.idle.len() < self.target && s.workers > 0)
            .unwrap_or_else(|e| e.into_inner());
    }

    /// Starts refill threads, up to [`refill_parallelism`], while the pool and what
    /// is being started fall short of the target: supervisors start in parallel, so
    /// a run of creates empties the pool less often on a host with cores to spare.
    fn refill(&self) {
        if self.target == 0 {
            return;
        }
        let mut state = self.state.0.lock().unwrap_or_else(|e| e.into_inner());
        // Each worker starts one supervisor at a time: what is wanted beyond the idle
        // ones and one per worker is what another worker would start.
        while state.workers < refill_parallelism() && state.idle.len() + state.workers < self.target
        {
            let worker = RefillWorker {
                state: Arc::clone(&self.state),
                exe: self.exe.clone(),
                scratch: self.scratch.clone(),
                network: self.network,
                target: self.target,
                network_warm: self.network_warm_for(),
            };
            let spawned = std::thread::Builder::new()
                .name("supervisor-pool".into())
                .spawn(move || worker.run());
            match spawned {
                Ok(_) => state.workers += 1,
                Err(e) => {
                    tracing::warn!("starting a pool refill thread: {e}");
                    break;
                }
            }
        }
    }
}

/// How many supervisors the pool starts at once: one per core, at most four.
fn refill_parallelism() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 4)
}

/// One refill thread's share of the pool.
struct RefillWorker {
    state: Arc<(Mutex<PoolState>, Condvar)>,
    exe: PathBuf,
    scratch: Option<PathBuf>,
    network: bool,
    target: usize,
    network_warm: WarmFor,
}

impl RefillWorker {
    /// Starts supervisors while the pool needs more than are being started.
    fn run(self) {
        let (lock, cond) = &*self.state;
        loop {
            let warm_for = {
                let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
                if state.idle.len() + state.starting >= self.target {
                    state.workers -= 1;
                    cond.notify_all();
                    return;
                }
                state.starting += 1;
                // A networked supervisor serves jails only: no KVM warm-up.
                match self.network_warm {
                    WarmFor::Jail => WarmFor::Jail,
                    _ => state.warm_for,
                }
            };
            let start = std::time::Instant::now();
            let spawned = spawn(
                &self.exe,
                self.scratch.as_deref(),
                warm_for,
                self.network,
                true,
            );
            tracing::debug!(elapsed = ?start.elapsed(), ?warm_for, "pool: supervisor started");
            let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
            state.starting -= 1;
            match spawned {
                Ok(s) => state.idle.push_back(s),
                Err(e) => {
                    tracing::warn!("pre-starting a supervisor: {e}");
                    state.workers -= 1;
                    cond.notify_all();
                    return;
                }
            }
            cond.notify_all();
        }
    }
}
