//! One process of a container (its main process or an exec), run inside the Cube
//! sandbox by the sandbox's agent. Its output is relayed from the agent's stream to the
//! FIFOs containerd handed over; its exit is recorded once and wakes every waiter.
//!
//! Standard input is relayed the other way, from containerd's FIFO to the agent, until
//! the FIFO ends or containerd closes it (`CloseIO`). A process that asked for a
//! terminal runs on one of its own in the sandbox (`kubectl exec -it`, `ctr run -t`):
//! its output is the terminal's, input is typed into it, `ResizePty` sets its size.
//!
//! A snapshot of the sandbox (a checkpoint) has the agent drop every host connection;
//! the process runs on, so the relay connects again and follows it by its pid
//! ([`AgentLink`]). A container restored from a checkpoint takes its main process
//! back the same way ([`Process::adopt`]) instead of starting its command again.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use cube_agent::client::{Call, Client, ClientError};
use cube_agent::protocol::{ExecRequest, RequestBody, ResponseBody, TerminalSize};

use crate::spec::ProcessSpec;

/// How long a relay whose connection was lost tries to reach the agent again (a
/// snapshot of a large sandbox holds it frozen for a while).
const REFOLLOW_TIMEOUT: Duration = Duration::from_secs(60);
/// Between those tries.
const REFOLLOW_STEP: Duration = Duration::from_millis(100);
/// How often a quiet standard input relay looks whether it was closed or its
/// process ended.
const STDIN_POLL_MS: i32 = 100;
/// Bytes read from the standard input FIFO at a time.
const STDIN_CHUNK: usize = 32 * 1024;

/// How a process reaches its sandbox's agent, again after its connection was lost.
pub trait AgentLink: Send + Sync {
    /// The connection processes are started on.
    fn current(&self) -> Result<Arc<Client>, ProcessError>;
    /// A connection to use instead of `lost`, which ended: a new one, or one another
    /// process made already. `Ok(None)` when the sandbox is gone.
    fn reconnect(&self, lost: &Arc<Client>) -> Result<Option<Arc<Client>>, ProcessError>;
}

/// Why a process could not be started or signalled.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// A FIFO containerd named could not be opened.
    #[error("Opening {0}")]
    Fifo(String, #[source] std::io::Error),
    /// The agent refused or lost the request.
    #[error("The sandbox's agent")]
    Agent(#[from] ClientError),
    /// The sandbox's agent could not be reached.
    #[error("Connecting to the sandbox's agent")]
    Connect(#[source] cube_core::SandboxError),
    /// The container's sandbox is gone.
    #[error("The container's sandbox was deleted")]
    SandboxGone,
    /// The agent answered something else than a started process.
    #[error("The agent did not start the process: {0}")]
    NotStarted(String),
    /// The agent has no running process of this pid to follow.
    #[error("The sandbox has no process {pid} to take back: {message}")]
    NotAdopted {
        /// The process's pid in the sandbox.
        pid: u32,
        /// The agent's answer.
        message: String,
    },
    /// The process was started already.
    #[error("The process was started already")]
    AlreadyStarted,
}

/// Where a process is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Made, not started.
    Created,
    /// Running.
    Running,
    /// Ended.
    Stopped,
}

/// How a process ended, as containerd reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exit {
    /// The exit code, or 128 + the signal that killed it.
    pub status: u32,
    /// When.
    pub at: SystemTime,
}

/// The FIFO paths containerd hands over (empty: none).
#[derive(Clone, Debug, Default)]
pub struct StdioPaths {
    /// Standard input.
    pub stdin: String,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
    /// Whether a terminal was asked for.
    pub terminal: bool,
}

impl State {
    fn new(pid: u32) -> State {
        State {
            phase: Phase::Created,
            pid,
            inner: 0,
            exit: None,
            agent: None,
            size: TerminalSize::default(),
            stdin_closed: false,
        }
    }
}

struct State {
    phase: Phase,
    /// The host pid (0 until started).
    pid: u32,
    /// The pid in the sandbox (0 until started).
    inner: u32,
    exit: Option<Exit>,
    /// The agent connection and the exec's request id on it (for signals, input and
    /// the terminal's size).
    agent: Option<(Arc<Client>, u64)>,
    /// The size of its terminal (the last one asked for).
    size: TerminalSize,
    /// containerd closed its standard input (`CloseIO`): the relay ends once the FIFO
    /// holds nothing more.
    stdin_closed: bool,
}

/// One process.
pub struct Process {
    /// The exec id ("" for a container's main process).
    pub exec_id: String,
    /// Its stdio.
    pub stdio: StdioPaths,
    spec: ProcessSpec,
    state: Mutex<State>,
    ended: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Opens where a stream goes: a `file://` log URI (`ctr run --log-uri`) appended to,
/// or a FIFO opened for writing without waiting for a reader (read-write never blocks
/// on a FIFO; closing it is what tells the reader the stream ended).
fn open_output(path: &str) -> Result<Option<File>, ProcessError> {
    if path.is_empty() {
        return Ok(None);
    }
    if let Some(file) = path.strip_prefix("file://") {
        return OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
            .map(Some)
            .map_err(|e| ProcessError::Fifo(path.to_string(), e));
    }
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(Path::new(path))
        .map(Some)
        .map_err(|e| ProcessError::Fifo(path.to_string(), e))
}

/// Opens containerd's standard input FIFO for reading without waiting for its
/// writer (which may come later, or never).
fn open_input(path: &str) -> Result<Option<File>, ProcessError> {
    if path.is_empty() {
        return Ok(None);
    }
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(Path::new(path))
        .map(Some)
        .map_err(|e| ProcessError::Fifo(path.to_string(), e))
}

impl Process {
    /// A process to start later.
    pub fn new(
        exec_id: &str,
        stdio: StdioPaths,
        spec: ProcessSpec,
    ) -> Result<Process, ProcessError> {
        Ok(Process {
            exec_id: exec_id.to_string(),
            stdio,
            spec,
            state: Mutex::new(State::new(0)),
            ended: Condvar::new(),
        })
    }

    /// Whether it runs on a terminal of its own.
    pub fn has_terminal(&self) -> bool {
        self.stdio.terminal || self.spec.terminal
    }

    /// A process that is no process: a pod's pause container, absorbed by Cube. It
    /// runs as `pid` (the pod sandbox's PID 1) from the start and ends when it is
    /// killed.
    pub fn placeholder(pid: u32) -> Process {
        Process {
            exec_id: String::new(),
            stdio: StdioPaths::default(),
            spec: ProcessSpec::default(),
            state: Mutex::new(State::new(pid)),
            ended: Condvar::new(),
        }
    }

    /// Marks a placeholder started.
    pub fn start_placeholder(&self) -> u32 {
        let mut s = lock(&self.state);
        if s.phase == Phase::Created {
            s.phase = Phase::Running;
        }
        s.pid
    }

    /// Its phase, host pid and exit.
    pub fn status(&self) -> (Phase, u32, Option<Exit>) {
        let s = lock(&self.state);
        (s.phase, s.pid, s.exit)
    }

    /// Its pid in the sandbox while it runs (0 before it starts and after it ends).
    pub fn sandbox_pid(&self) -> u32 {
        let s = lock(&self.state);
        if s.exit.is_some() {
            0
        } else {
            s.inner
        }
    }

    /// Starts the process through `link`'s agent, chrooted into `root` (a directory
    /// of the sandbox) where one is given, as the spec's user where `as_spec_user`
    /// (a VM's guest; a jail's processes all run as its own uid); `host_pid` turns the
    /// sandbox's pid into the host's; `on_exit` runs once when it ends. Returns the
    /// host pid.
    pub fn start(
        self: &Arc<Self>,
        link: Arc<dyn AgentLink>,
        root: Option<String>,
        as_spec_user: bool,
        host_pid: impl FnOnce(u32) -> u32,
        on_exit: impl FnOnce(&Process, Exit) + Send + 'static,
    ) -> Result<u32, ProcessError> {
        let exec =
            ExecRequest {
                argv: self.spec.args.clone(),
                env: self.spec.env_pairs(),
                cwd: (!self.spec.cwd.is_empty()).then(|| self.spec.cwd.clone()),
                user: self.spec.user.filter(|_| as_spec_user).map(|u| {
                    cube_agent::protocol::UserSpec {
                        uid: u.uid,
                        gid: u.gid,
                    }
                }),
                ..ExecRequest::default()
            };
        let keep_stdin = !self.stdio.stdin.is_empty();
        let request = if self.has_terminal() {
            RequestBody::ExecInTerminal {
                root,
                size: lock(&self.state).size,
                exec,
            }
        } else {
            match root {
                Some(root) => RequestBody::ExecInRoot {
                    root,
                    keep_stdin,
                    exec,
                },
                None if keep_stdin => RequestBody::ExecWithStdin(exec),
                None => RequestBody::Exec(exec),
            }
        };
        self.begin(link, request, host_pid, on_exit)
    }

    /// Takes back process `pid` of the sandbox, which runs already (restored with the
    /// sandbox from a checkpoint), instead of starting the command: its output from
    /// now on, its signals and its exit are this process's. Returns the host pid.
    pub fn adopt(
        self: &Arc<Self>,
        link: Arc<dyn AgentLink>,
        pid: u32,
        host_pid: impl FnOnce(u32) -> u32,
        on_exit: impl FnOnce(&Process, Exit) + Send + 'static,
    ) -> Result<u32, ProcessError> {
        self.begin(link, RequestBody::Attach { pid }, host_pid, on_exit)
    }

    fn begin(
        self: &Arc<Self>,
        link: Arc<dyn AgentLink>,
        request: RequestBody,
        host_pid: impl FnOnce(u32) -> u32,
        on_exit: impl FnOnce(&Process, Exit) + Send + 'static,
    ) -> Result<u32, ProcessError> {
        if lock(&self.state).phase != Phase::Created {
            return Err(ProcessError::AlreadyStarted);
        }
        let stdout = open_output(&self.stdio.stdout)?;
        let stderr = open_output(&self.stdio.stderr)?;
        let stdin = open_input(&self.stdio.stdin)?;
        let adopting = match &request {
            RequestBody::Attach { pid } => Some(*pid),
            _ => None,
        };
        let asked_size = match &request {
            RequestBody::ExecInTerminal { size, .. } => Some(*size),
            _ => None,
        };
        let mut agent = link.current()?;
        let mut call = match agent.start(request.clone()) {
            Ok(call) => call,
            // Nothing was sent: the connection had ended (a snapshot drops them all).
            // Once more on a new one.
            Err(_) => {
                agent = link.reconnect(&agent)?.ok_or(ProcessError::SandboxGone)?;
                agent.start(request)?
            }
        };
        let inner = match (call.recv()?, adopting) {
            (Some(ResponseBody::Started { pid }), _) => pid,
            (Some(ResponseBody::Error(e)), Some(pid)) => {
                return Err(ProcessError::NotAdopted {
                    pid,
                    message: e.message,
                })
            }
            (Some(ResponseBody::Error(e)), None) => {
                return Err(ProcessError::NotStarted(e.message))
            }
            (other, _) => return Err(ProcessError::NotStarted(format!("{other:?}"))),
        };
        let pid = host_pid(inner);
        let resized = {
            let mut s = lock(&self.state);
            s.phase = Phase::Running;
            s.pid = pid;
            s.inner = inner;
            s.agent = Some((Arc::clone(&agent), call.id));
            s.size
        };
        // A ResizePty that came while the process was being started.
        if asked_size.is_some_and(|asked| asked != resized) {
            let _ = agent.resize_terminal(call.id, resized);
        }
        if let Some(fifo) = stdin {
            let me = Arc::clone(self);
            std::thread::Builder::new()
                .name(format!("stdin-{}", self.exec_id))
                .spawn(move || me.relay_input(fifo))
                .map_err(|e| ProcessError::Fifo("a standard input thread".into(), e))?;
        }
        let me = Arc::clone(self);
        std::thread::Builder::new()
            .name(format!("relay-{}", self.exec_id))
            .spawn(move || {
                let mut output = Output { stdout, stderr };
                let mut agent = agent;
                let status = loop {
                    match output.relay(&mut call) {
                        Relayed::Exited(status) => break status,
                        Relayed::Lost => match me.follow_again(&*link, &agent, inner) {
                            Some((again, follow)) => {
                                agent = again;
                                call = follow;
                            }
                            // The sandbox is gone, or the process ended unseen.
                            None => break 128 + libc::SIGKILL as u32,
                        },
                    }
                };
                let exit = Exit {
                    status,
                    at: SystemTime::now(),
                };
                me.finish(exit);
                on_exit(&me, exit);
            })
            .map_err(|e| ProcessError::Fifo("a relay thread".into(), e))?;
        Ok(pid)
    }

    /// After the connection to the agent was lost (`lost`), connects again and
    /// follows the process (sandbox pid `inner`) on the new connection. None when the
    /// sandbox is gone or the process is no longer there to follow.
    fn follow_again(
        &self,
        link: &dyn AgentLink,
        lost: &Arc<Client>,
        inner: u32,
    ) -> Option<(Arc<Client>, Call)> {
        let deadline = Instant::now() + REFOLLOW_TIMEOUT;
        let mut lost = Arc::clone(lost);
        loop {
            match link.reconnect(&lost) {
                Ok(Some(agent)) => match agent.attach(inner) {
                    Ok(mut call) => match call.recv() {
                        Ok(Some(ResponseBody::Started { .. })) => {
                            lock(&self.state).agent = Some((Arc::clone(&agent), call.id));
                            log::info!(
                                "process {inner} followed again after its connection was lost"
                            );
                            return Some((agent, call));
                        }
                        Ok(Some(ResponseBody::Error(e))) => {
                            log::warn!("process {inner} cannot be followed again: {}", e.message);
                            return None;
                        }
                        _ => lost = agent,
                    },
                    Err(_) => lost = agent,
                },
                Ok(None) => return None,
                Err(e) => log::debug!("reconnecting to follow process {inner}: {e}"),
            }
            if Instant::now() >= deadline {
                log::warn!("process {inner}: the sandbox's agent did not answer again");
                return None;
            }
            std::thread::sleep(REFOLLOW_STEP);
        }
    }

    /// Copies standard input from containerd's FIFO to the process until the FIFO
    /// ends (every writer closed it), containerd closed it and it holds nothing more,
    /// or the process ended. The process then reads end-of-file (on a terminal, input
    /// stops).
    fn relay_input(&self, mut fifo: File) {
        let mut buf = vec![0u8; STDIN_CHUNK];
        loop {
            let closed = lock(&self.state).stdin_closed;
            let Reach::Agent(client, id) = self.reach() else {
                return;
            };
            let mut pfd = libc::pollfd {
                fd: fifo.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd whose descriptor `fifo` keeps open for the call.
            let rc = unsafe { libc::poll(&mut pfd, 1, STDIN_POLL_MS) };
            if rc < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                break;
            }
            // A FIFO opened before any writer came reports neither until one has:
            // nothing to read yet is not its end.
            if pfd.revents == 0 {
                if closed {
                    break;
                }
                continue;
            }
            match fifo.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let chunk = &buf[..n];
                    match self
                        .call_following(&client, id, |c, id| c.write_stdin(id, chunk.to_vec()))
                    {
                        Refollowed::Done(Ok(())) => {}
                        Refollowed::Ended => return,
                        Refollowed::Done(Err(e)) | Refollowed::TimedOut(e) => {
                            log::info!("standard input of {:?} ends: {e}", self.exec_id);
                            return;
                        }
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock
                    ) => {}
                Err(_) => break,
            }
        }
        if let Reach::Agent(client, id) = self.reach() {
            let _ = client.close_stdin(id);
        }
    }

    /// containerd closed the process's standard input (`CloseIO`): what its FIFO still
    /// holds is passed on, then the process reads end-of-file.
    pub fn close_input(&self) {
        lock(&self.state).stdin_closed = true;
    }

    /// Sets the size of the process's terminal (kept for its start when it has not
    /// started yet). Nothing to do for a process without one, or one that ended.
    pub fn resize(&self, size: TerminalSize) -> Result<(), ProcessError> {
        if !self.has_terminal() {
            return Ok(());
        }
        let agent = {
            let mut s = lock(&self.state);
            s.size = size;
            if s.exit.is_some() {
                return Ok(());
            }
            s.agent.clone()
        };
        match agent {
            Some((client, id)) => Ok(client.resize_terminal(id, size)?),
            None => Ok(()),
        }
    }

    /// Records the end and wakes the waiters (the first end counts).
    pub fn finish(&self, exit: Exit) {
        let mut s = lock(&self.state);
        if s.exit.is_none() {
            s.exit = Some(exit);
            s.phase = Phase::Stopped;
            s.agent = None;
        }
        self.ended.notify_all();
    }

    /// Blocks until the process ended.
    pub fn wait(&self) -> Exit {
        let mut s = lock(&self.state);
        loop {
            if let Some(exit) = s.exit {
                return exit;
            }
            s = self.ended.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Waits at most `limit` for the process to end; its exit, if it did.
    pub fn wait_timeout(&self, limit: std::time::Duration) -> Option<Exit> {
        let s = lock(&self.state);
        let (s, _) = self
            .ended
            .wait_timeout_while(s, limit, |s| s.exit.is_none())
            .unwrap_or_else(PoisonError::into_inner);
        s.exit
    }

    /// Sends `signal` to the process's group. Nothing to do once it ended; a
    /// placeholder ends on any signal.
    pub fn kill(&self, signal: u32) -> Result<(), ProcessError> {
        match self.reach() {
            Reach::Ended => Ok(()),
            Reach::Agent(client, id) => {
                match self.call_following(&client, id, |c, id| c.kill(id, signal as i32)) {
                    Refollowed::Done(result) => Ok(result?),
                    Refollowed::Ended => Ok(()),
                    Refollowed::TimedOut(e) => Err(e.into()),
                }
            }
            Reach::NoAgent => {
                self.finish(Exit {
                    status: 128 + signal,
                    at: SystemTime::now(),
                });
                Ok(())
            }
        }
    }

    /// Runs `f` on `client` with the process's request id `id` there; where the
    /// connection has ended (a checkpoint drops them all, the agent's own refusals are
    /// answers), again on the one the relay follows the process on next.
    fn call_following<T>(
        &self,
        client: &Arc<Client>,
        id: u64,
        f: impl Fn(&Client, u64) -> Result<T, ClientError>,
    ) -> Refollowed<T> {
        match f(client, id) {
            Err(ClientError::Agent(e)) => Refollowed::Done(Err(ClientError::Agent(e))),
            Err(_) => self.on_new_connection(client, f),
            done => Refollowed::Done(done),
        }
    }

    /// Runs `f` on the connection the relay follows the process on once it replaced
    /// `lost` (which ended: a checkpoint drops every connection), with the process's
    /// request id there.
    fn on_new_connection<T>(
        &self,
        lost: &Arc<Client>,
        f: impl FnOnce(&Client, u64) -> Result<T, ClientError>,
    ) -> Refollowed<T> {
        let deadline = Instant::now() + REFOLLOW_TIMEOUT;
        while Instant::now() < deadline {
            match self.reach() {
                Reach::Agent(client, id) if !Arc::ptr_eq(&client, lost) => {
                    return Refollowed::Done(f(&client, id))
                }
                // Ended meanwhile (the state drops its connection at the end).
                Reach::Ended | Reach::NoAgent => return Refollowed::Ended,
                Reach::Agent(..) => std::thread::sleep(REFOLLOW_STEP / 2),
            }
        }
        Refollowed::TimedOut(ClientError::Unexpected(format!(
            "no new connection to the agent within {REFOLLOW_TIMEOUT:?}"
        )))
    }

    /// How the process is reached now.
    fn reach(&self) -> Reach {
        let s = lock(&self.state);
        match (&s.exit, &s.agent) {
            (Some(_), _) => Reach::Ended,
            (None, Some((client, id))) => Reach::Agent(Arc::clone(client), *id),
            (None, None) => Reach::NoAgent,
        }
    }
}

/// What came of a call waiting for a new connection ([`Process::on_new_connection`]).
enum Refollowed<T> {
    /// It was made on the new connection.
    Done(Result<T, ClientError>),
    /// The process ended first.
    Ended,
    /// No new connection came in time.
    TimedOut(ClientError),
}

/// How a process is reached (see [`Process::reach`]).
enum Reach {
    /// It ended.
    Ended,
    /// Through this connection, under this request id.
    Agent(Arc<Client>, u64),
    /// Through no agent: not started, or a placeholder.
    NoAgent,
}

/// Where a process's output goes.
struct Output {
    stdout: Option<File>,
    stderr: Option<File>,
}

/// How relaying a call ended.
enum Relayed {
    /// The process ended with this status.
    Exited(u32),
    /// The connection ended first (a checkpoint drops it; so does the sandbox's end).
    Lost,
}

impl Output {
    /// Copies the process's output to the FIFOs until it ends or the call is lost.
    fn relay(&mut self, call: &mut Call) -> Relayed {
        let write = |f: &mut Option<File>, bytes: &[u8]| {
            // A reader that went away (`ctr` killed) must not stop the process.
            if let Some(file) = f {
                if file.write_all(bytes).is_err() {
                    *f = None;
                }
            }
        };
        loop {
            match call.recv() {
                Ok(Some(ResponseBody::Stdout(b))) => write(&mut self.stdout, &b),
                Ok(Some(ResponseBody::Stderr(b))) => write(&mut self.stderr, &b),
                Ok(Some(ResponseBody::Exited(exit))) => {
                    return Relayed::Exited(match (exit.code, exit.signal) {
                        (Some(code), _) => code as u32,
                        (None, Some(signal)) => 128 + signal as u32,
                        (None, None) => 255,
                    });
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return Relayed::Lost,
            }
        }
    }
}
