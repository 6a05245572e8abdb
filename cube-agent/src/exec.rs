//! Running processes for the host: argv, env, cwd, user, stdin, timeout; output streamed
//! as it is produced; kill and wait by id.
//!
//! Every exec leads a new process group (its pid is the group id), so a kill reaches the
//! children it started too. One thread per exec multiplexes its stdout and stderr pipes
//! with `poll` and watches for the exit and the timeout.
//!
//! An exec outlives the connection that started it. Another connection can follow it
//! by its pid ([`ExecTable::attach`]): what a host does after its connections were
//! dropped for a checkpoint, or in a sandbox restored from one, whose execs came back
//! with the agent.

use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use crate::protocol::{ErrorCode, ErrorReply, ExecRequest, ExitInfo, ResponseBody, TerminalSize};
use crate::reaper::{ChildStatus, Reaper, ReaperError};
use crate::terminal::{Pty, TerminalError};

/// Bytes read from a pipe at a time (and so the largest output event).
const OUTPUT_CHUNK: usize = 64 * 1024;

/// How long output is still collected after the process ended, for descendants that
/// hold its pipes open.
const OUTPUT_GRACE: Duration = Duration::from_millis(500);

/// How often a quiet exec checks for its exit and timeout.
const POLL_STEP_MS: i32 = 20;

/// Output an exec wrote while nobody heard it (the connection that started it gone,
/// no follower yet) kept for the next follower, at most this many bytes (the oldest
/// go first): a host that follows an exec again after a checkpoint dropped its
/// connections gets what was written in between.
const UNHEARD_MAX_BYTES: usize = 256 * 1024;

/// `PATH` for execs whose environment has none.
pub(crate) const DEFAULT_PATH: &str =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Errors of running processes.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The request is unusable.
    #[error("invalid exec request: {0}")]
    Invalid(&'static str),
    /// Another exec already has this id.
    #[error("exec id {0} is already in use")]
    IdInUse(u64),
    /// No exec has this id.
    #[error("no exec with id {0}")]
    NoSuchExec(u64),
    /// No running exec has this pid.
    #[error("no running exec has pid {0}")]
    NoSuchProcess(u32),
    /// The exec has already ended.
    #[error("exec {0} has already ended")]
    NotRunning(u64),
    /// The exec's standard input is closed, or was never kept open.
    #[error("exec {0} has no open standard input")]
    StdinClosed(u64),
    /// Writing to the exec's standard input failed.
    #[error("writing to the standard input of exec {id} failed")]
    StdinWrite {
        /// The exec.
        id: u64,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Switching user needs root.
    #[error("running as uid {uid} needs the agent to run as root")]
    NeedsRoot {
        /// The user asked for.
        uid: u32,
    },
    /// The signal number is not a signal.
    #[error("{0} is not a signal number")]
    BadSignal(i32),
    /// A root of its own was asked for and the agent may not change roots.
    #[error(
        "this sandbox cannot run a process in a root of its own (only a pod sandbox's agent may chroot)"
    )]
    NoChroot,
    /// The process could not be started or waited for.
    #[error("running {program} failed")]
    Spawn {
        /// argv[0].
        program: String,
        /// Why.
        #[source]
        source: ReaperError,
    },
    /// Sending the signal failed.
    #[error("signalling exec {id} failed")]
    Kill {
        /// The exec.
        id: u64,
        /// The errno.
        #[source]
        source: nix::errno::Errno,
    },
    /// Waiting for the pipes failed.
    #[error("polling the output pipes failed")]
    Poll(#[source] std::io::Error),
    /// The exec's terminal could not be made or resized.
    #[error("the terminal of exec {id}")]
    Terminal {
        /// The exec.
        id: u64,
        /// Why.
        #[source]
        source: TerminalError,
    },
    /// A terminal's size was to change and the exec has none.
    #[error("exec {0} has no terminal")]
    NoTerminal(u64),
}

impl ExecError {
    /// The error reply for the host.
    pub fn to_reply(&self) -> ErrorReply {
        let message = error_chain(self);
        match self {
            ExecError::Invalid(_) | ExecError::BadSignal(_) => {
                ErrorReply::new(ErrorCode::InvalidArgument, message)
            }
            ExecError::IdInUse(_) => ErrorReply::new(ErrorCode::AlreadyExists, message),
            ExecError::NoSuchExec(_) | ExecError::NoSuchProcess(_) => {
                ErrorReply::new(ErrorCode::NoSuchExec, message)
            }
            ExecError::NotRunning(_) | ExecError::StdinClosed(_) | ExecError::NoTerminal(_) => {
                ErrorReply::new(ErrorCode::NotRunning, message)
            }
            ExecError::StdinWrite { source, .. } => ErrorReply::from_io(source, message),
            ExecError::NeedsRoot { .. } | ExecError::NoChroot => {
                ErrorReply::new(ErrorCode::PermissionDenied, message)
            }
            ExecError::Spawn {
                source: ReaperError::Spawn(io),
                ..
            } => ErrorReply::from_io(io, message),
            ExecError::Kill { source, .. } => {
                ErrorReply::from_io(&std::io::Error::from_raw_os_error(*source as i32), message)
            }
            ExecError::Spawn { .. } | ExecError::Poll(_) | ExecError::Terminal { .. } => {
                ErrorReply::new(ErrorCode::Io, message)
            }
        }
    }
}

/// An error's message followed by those of its sources.
pub(crate) fn error_chain(err: &dyn std::error::Error) -> String {
    let mut msg = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// One exec known to the table.
struct Entry {
    pgid: Pid,
    background: bool,
    /// The standard input of an exec started with it kept open (a pipe, or its
    /// terminal's master); None once closed.
    stdin: Mutex<Option<File>>,
    /// The master of the exec's terminal, for its size; None without one.
    terminal: Option<File>,
    exit: Mutex<Option<ExitInfo>>,
    ended: Condvar,
    /// Connections following the exec ([`ExecTable::attach`]), and what nobody heard.
    followers: Mutex<Followers>,
}

/// The connections following an exec: its output from then on, and `Exited` at the
/// end; and the output written while nobody listened, for the next one.
#[derive(Default)]
struct Followers {
    /// Each follower, with the number of the first output event it follows from.
    senders: Vec<(Sender<ResponseBody>, u64)>,
    unheard: VecDeque<ResponseBody>,
    unheard_bytes: usize,
    /// The number the next output event takes (see [`Entry::next_event`]).
    next_event: u64,
}

impl Followers {
    /// Keeps `body` for the next follower, within [`UNHEARD_MAX_BYTES`].
    fn keep_unheard(&mut self, body: ResponseBody) {
        self.unheard_bytes += output_len(&body);
        self.unheard.push_back(body);
        while self.unheard_bytes > UNHEARD_MAX_BYTES {
            match self.unheard.pop_front() {
                Some(old) => self.unheard_bytes -= output_len(&old),
                None => break,
            }
        }
    }

    /// Hands what nobody heard to `follower`.
    fn replay_to(&mut self, follower: &Sender<ResponseBody>) {
        for body in self.unheard.drain(..) {
            let _ = follower.send(body);
        }
        self.unheard_bytes = 0;
    }

    /// A new follower: it gets what nobody heard first, then the output events
    /// numbered from now on.
    fn add(&mut self, follower: Sender<ResponseBody>) {
        self.replay_to(&follower);
        self.senders.push((follower, self.next_event));
    }
}

/// The bytes of an output event (other events count as none).
fn output_len(body: &ResponseBody) -> usize {
    match body {
        ResponseBody::Stdout(b) | ResponseBody::Stderr(b) => b.len(),
        _ => 0,
    }
}

impl Entry {
    /// Numbers an output event before the starting connection is given it: a
    /// follower that attaches while that write is under way follows from the next
    /// event, so it is not handed one the starting connection already took.
    fn next_event(&self) -> u64 {
        let mut followers = lock(&self.followers);
        let number = followers.next_event;
        followers.next_event += 1;
        number
    }

    /// Passes output event `number` to the followers that follow from it, forgetting
    /// those that went away. One the starting connection did not take (`heard`
    /// false) goes to every follower, or, when none is left, is kept for the next.
    fn forward(&self, body: ResponseBody, number: u64, heard: bool) {
        let mut followers = lock(&self.followers);
        let mut delivered = false;
        followers.senders.retain(|(follower, from)| {
            if heard && *from > number {
                return true;
            }
            let sent = follower.send(body.clone()).is_ok();
            delivered |= sent;
            sent
        });
        if !heard && !delivered {
            followers.keep_unheard(body);
        }
    }
}

/// What an exec is known by: the connection that started it (a number the server
/// gives each stream) and its request id there. Ids are the clients' own, so two
/// clients numbering from 1 must not meet in one table.
pub type ExecKey = (u64, u64);

/// The execs of one agent, by connection and id.
pub struct ExecTable {
    reaper: Reaper,
    entries: Mutex<HashMap<ExecKey, Arc<Entry>>>,
}

/// What a process the agent starts (an exec, a code-run interpreter) begins from
/// where its request says nothing else.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessDefaults<'a> {
    /// The sandbox-wide environment; a request's own variables win.
    pub env: &'a [(String, String)],
    /// Who a process whose request names no user runs as (a VM built from a container
    /// image runs its processes as the image's User); the agent's own user when None.
    pub user: Option<crate::protocol::UserSpec>,
}

/// Where an exec's standard input comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// The request's `stdin` bytes, then end-of-file (none: `/dev/null`).
    Given,
    /// A pipe kept open for [`ExecTable::write_stdin`] until [`ExecTable::close_stdin`].
    Open,
    /// A terminal of its own of this size, which is also its standard output and
    /// error and its controlling terminal; typed into by [`ExecTable::write_stdin`],
    /// resized by [`ExecTable::resize`].
    Terminal(TerminalSize),
}

/// Receives the events of a running exec; returns false once nobody listens any more
/// (the exec still runs to its end).
pub type Emit<'a> = &'a mut dyn FnMut(ResponseBody) -> bool;

impl ExecTable {
    /// An empty table whose children are waited for by `reaper`.
    pub fn new(reaper: Reaper) -> Self {
        Self {
            reaper,
            entries: Mutex::default(),
        }
    }

    fn entries(&self) -> MutexGuard<'_, HashMap<ExecKey, Arc<Entry>>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn entry(&self, key: ExecKey) -> Result<Arc<Entry>, ExecError> {
        self.entries()
            .get(&key)
            .cloned()
            .ok_or(ExecError::NoSuchExec(key.1))
    }

    /// How many execs have not ended.
    pub fn running(&self) -> usize {
        self.entries()
            .values()
            .filter(|e| lock(&e.exit).is_none())
            .count()
    }

    /// The reaper children are spawned through.
    pub fn reaper(&self) -> &Reaper {
        &self.reaper
    }

    /// Runs `req` under `key` to its end, emitting `Started` and output events; returns
    /// how it ended (the caller sends `Exited`). It starts from `defaults` where the
    /// request names no user or variable. With `keep_stdin`, the process's standard input stays open after
    /// `req.stdin` for [`ExecTable::write_stdin`] until [`ExecTable::close_stdin`].
    pub fn run(
        &self,
        key: ExecKey,
        req: &ExecRequest,
        defaults: ProcessDefaults<'_>,
        keep_stdin: bool,
        emit: Emit<'_>,
    ) -> Result<ExitInfo, ExecError> {
        let input = if keep_stdin {
            Input::Open
        } else {
            Input::Given
        };
        self.run_in(key, req, None, defaults, input, emit)
    }

    /// [`ExecTable::run`], the process's root changed to `root` (a directory of the
    /// sandbox) first where one is given: its program, `PATH` and working directory
    /// are then looked up in that tree, and the default user does not apply (the
    /// container there names its own). Its standard input is `input`.
    pub fn run_in(
        &self,
        key: ExecKey,
        req: &ExecRequest,
        root: Option<&str>,
        defaults: ProcessDefaults<'_>,
        input: Input,
        emit: Emit<'_>,
    ) -> Result<ExitInfo, ExecError> {
        let id = key.1;
        let program = req
            .argv
            .first()
            .ok_or(ExecError::Invalid("argv is empty"))?;
        if req.argv.iter().any(|a| a.contains('\0')) {
            return Err(ExecError::Invalid("argv contains a NUL byte"));
        }
        if input != Input::Given && !req.stdin.is_empty() {
            return Err(ExecError::Invalid(
                "an exec with its standard input kept open takes its input by StdinWrite",
            ));
        }
        let mut cmd = Command::new(program);
        cmd.args(&req.argv[1..]).env_clear();
        // The terminal's master, kept by the agent.
        let mut master = None;
        match input {
            Input::Given | Input::Open => {
                cmd.stdin(if input == Input::Given && req.stdin.is_empty() {
                    Stdio::null()
                } else {
                    Stdio::piped()
                })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0);
            }
            Input::Terminal(size) => {
                let terminal = |source| ExecError::Terminal { id, source };
                let pty = Pty::open(size).map_err(terminal)?;
                let [stdin, stdout, stderr] = pty.peer_streams().map_err(terminal)?;
                // No process group of its own here: the session the child leads
                // (see below) is one, and setsid refuses a group leader.
                cmd.stdin(stdin).stdout(stdout).stderr(stderr);
                master = Some(pty.master);
            }
        }
        let mut has_path = false;
        let mut has_term = false;
        for (k, v) in defaults.env.iter().chain(&req.env) {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(ExecError::Invalid("bad environment variable"));
            }
            has_path |= k == "PATH";
            has_term |= k == "TERM";
            cmd.env(k, v);
        }
        if !has_path {
            cmd.env("PATH", DEFAULT_PATH);
        }
        if master.is_some() && !has_term {
            // What programs on a terminal read to know how to drive it.
            cmd.env("TERM", "xterm");
        }
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe calls (sigprocmask, signal) on values it owns.
        unsafe {
            cmd.pre_exec(reset_signals);
        }
        // The user to switch to (only root may), or None to stay the agent's.
        let mut switch = None;
        let user = match root {
            Some(_) => req.user,
            None => req.user.or(defaults.user),
        };
        if let Some(user) = user {
            let me = (
                nix::unistd::geteuid().as_raw(),
                nix::unistd::getegid().as_raw(),
            );
            if me.0 == 0 {
                switch = Some(user);
            } else if (user.uid, user.gid) != me {
                return Err(ExecError::NeedsRoot { uid: user.uid });
            }
        }
        match root {
            Some(root) => {
                // The switch comes after the chroot, which needs the privilege.
                let enter = EnterRoot::new(root, req.cwd.as_deref(), switch)?;
                // SAFETY: the closure runs in the forked child before exec and only
                // makes async-signal-safe system calls on values it owns.
                unsafe {
                    cmd.pre_exec(move || enter.apply());
                }
            }
            None => {
                if let Some(cwd) = &req.cwd {
                    cmd.current_dir(cwd);
                }
                if let Some(user) = switch {
                    cmd.uid(user.uid).gid(user.gid);
                }
            }
        }
        if master.is_some() {
            // SAFETY: runs in the forked child before exec, after the root change;
            // setsid and ioctl are async-signal-safe system calls.
            unsafe {
                cmd.pre_exec(crate::terminal::take_as_controlling_terminal);
            }
        }
        // The agent's own copies of the master: input and size.
        let (terminal_input, terminal) = match &master {
            Some(m) => {
                let dup = || {
                    m.try_clone().map_err(|e| ExecError::Terminal {
                        id,
                        source: TerminalError::Duplicate(e),
                    })
                };
                (Some(dup()?), Some(dup()?))
            }
            None => (None, None),
        };

        // Holding the table lock across spawn keeps the id check and insert atomic.
        let (mut child, status, entry) = {
            let mut entries = self.entries();
            if entries.contains_key(&key) {
                return Err(ExecError::IdInUse(id));
            }
            let (mut child, status) =
                self.reaper
                    .spawn(&mut cmd)
                    .map_err(|source| ExecError::Spawn {
                        program: program.clone(),
                        source,
                    })?;
            let stdin = match input {
                Input::Given => None,
                Input::Open => child.stdin.take().map(|p| File::from(OwnedFd::from(p))),
                Input::Terminal(_) => terminal_input,
            };
            let entry = Arc::new(Entry {
                pgid: Pid::from_raw(child.id() as i32),
                background: req.background,
                // In place before `Started` goes out, so a write right after finds it.
                stdin: Mutex::new(stdin),
                terminal,
                exit: Mutex::new(None),
                ended: Condvar::new(),
                followers: Mutex::default(),
            });
            entries.insert(key, Arc::clone(&entry));
            (child, status, entry)
        };
        // The command holds the agent's copies of the terminal's other end: closed
        // now, so the master reads end-of-file (EIO) once the process's side is gone.
        drop(cmd);
        let mut listening = emit(ResponseBody::Started { pid: child.id() });

        if let Some(mut stdin) = child.stdin.take() {
            let data = req.stdin.clone();
            // A child that never reads its input must not block the exec thread.
            let spawned = std::thread::Builder::new()
                .name(format!("exec-{id}-stdin"))
                .spawn(move || {
                    let _ = stdin.write_all(&data);
                });
            if spawned.is_err() {
                tracing::warn!(id, "no thread for stdin; closing it");
            }
        }
        let pipes = match master {
            // The terminal carries both streams.
            Some(master) => [Some(master), None],
            None => [
                child.stdout.take().map(|p| File::from(OwnedFd::from(p))),
                child.stderr.take().map(|p| File::from(OwnedFd::from(p))),
            ],
        };
        let result = pump(
            &status,
            &entry,
            pipes,
            req.timeout_ms.map(Duration::from_millis),
            &mut |body| {
                // The starting connection first: a write that fails there (it has just
                // gone) leaves the event to the followers, or to the next one.
                let number = entry.next_event();
                if listening {
                    listening = emit(body.clone());
                }
                entry.forward(body, number, listening);
            },
        );
        let exit = match result {
            Ok(exit) => exit,
            Err(e) => {
                // Never leave a process running that nobody can see any more.
                let _ = killpg(entry.pgid, Signal::SIGKILL);
                let _ = status.wait_timeout(Duration::from_secs(5));
                self.finish(&entry, None);
                return Err(e);
            }
        };
        self.finish(&entry, Some(exit));
        Ok(exit)
    }

    /// Records how an exec ended and forgets it unless it is a background exec.
    fn finish(&self, entry: &Arc<Entry>, exit: Option<ExitInfo>) {
        let info = exit.unwrap_or(ExitInfo {
            code: None,
            signal: None,
            timed_out: false,
        });
        *lock(&entry.exit) = Some(info);
        entry.ended.notify_all();
        lock(&entry.stdin).take();
        if !entry.background || exit.is_none() {
            // The exec's own key and those it was attached under. Before the followers
            // hear of the exit: once one has read `Exited`, the exec is forgotten, and
            // an attach by its pid is refused rather than answered with the exit again.
            self.entries().retain(|_, e| !Arc::ptr_eq(e, entry));
        }
        // After the exit is recorded: a follower attaching from now on reads it there.
        for (follower, _) in lock(&entry.followers).senders.drain(..) {
            let _ = follower.send(ResponseBody::Exited(info));
        }
    }

    /// Follows the running exec whose pid is `pid`, started on any connection, under
    /// `key` from now on (`kill` and `wait` reach it by `key` too). The receiver gets
    /// the output nobody heard since its starting connection went (up to
    /// [`UNHEARD_MAX_BYTES`]), its output from now on, then `Exited` (at once when it
    /// has ended already and is still known).
    pub fn attach(&self, key: ExecKey, pid: u32) -> Result<Receiver<ResponseBody>, ExecError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut entries = self.entries();
        if entries.contains_key(&key) {
            return Err(ExecError::IdInUse(key.1));
        }
        let entry = entries
            .values()
            .find(|e| e.pgid.as_raw() as u32 == pid)
            .cloned()
            .ok_or(ExecError::NoSuchProcess(pid))?;
        // Under the exit's lock: `finish` records the exit before it takes the
        // followers, so the follower either sees the exit here or gets `Exited`.
        let exit = lock(&entry.exit);
        match *exit {
            Some(info) => {
                // An ended background exec: what nobody heard, then its exit.
                lock(&entry.followers).replay_to(&tx);
                let _ = tx.send(ResponseBody::Exited(info));
            }
            None => {
                lock(&entry.followers).add(tx);
                entries.insert(key, Arc::clone(&entry));
            }
        }
        Ok(rx)
    }

    /// Sends `signal` to the process group of a running exec.
    pub fn kill(&self, key: ExecKey, signal: i32) -> Result<(), ExecError> {
        let id = key.1;
        let sig = Signal::try_from(signal).map_err(|_| ExecError::BadSignal(signal))?;
        let entry = self.entry(key)?;
        // The exit is recorded within one poll step of the leader being reaped, and
        // holding its lock orders this check before that record, so a group id is not
        // signalled once its exec is known to have ended.
        let exit = lock(&entry.exit);
        if exit.is_some() {
            return Err(ExecError::NotRunning(id));
        }
        killpg(entry.pgid, sig).map_err(|source| ExecError::Kill { id, source })
    }

    /// Writes `data` to the open standard input of a running exec (see
    /// [`ExecTable::run`]'s `keep_stdin`); blocks while the process does not read.
    pub fn write_stdin(&self, key: ExecKey, data: &[u8]) -> Result<(), ExecError> {
        let id = key.1;
        let entry = self.entry(key)?;
        let mut stdin = lock(&entry.stdin);
        let pipe = stdin.as_mut().ok_or(ExecError::StdinClosed(id))?;
        pipe.write_all(data)
            .and_then(|_| pipe.flush())
            .map_err(|source| ExecError::StdinWrite { id, source })
    }

    /// Sets the size of a running exec's terminal.
    pub fn resize(&self, key: ExecKey, size: TerminalSize) -> Result<(), ExecError> {
        let id = key.1;
        let entry = self.entry(key)?;
        let terminal = entry.terminal.as_ref().ok_or(ExecError::NoTerminal(id))?;
        if lock(&entry.exit).is_some() {
            return Err(ExecError::NotRunning(id));
        }
        crate::terminal::set_size(terminal, size)
            .map_err(|source| ExecError::Terminal { id, source })
    }

    /// Closes the open standard input of a running exec: the process reads end-of-file
    /// (on a terminal, input stops; the terminal stays).
    pub fn close_stdin(&self, key: ExecKey) -> Result<(), ExecError> {
        let id = key.1;
        let entry = self.entry(key)?;
        let pipe = lock(&entry.stdin).take();
        pipe.map(drop).ok_or(ExecError::StdinClosed(id))
    }

    /// Waits for an exec to end and returns how it ended; a background exec is
    /// forgotten once waited for.
    pub fn wait(&self, key: ExecKey) -> Result<ExitInfo, ExecError> {
        let entry = self.entry(key)?;
        let mut exit = lock(&entry.exit);
        let info = loop {
            if let Some(info) = *exit {
                break info;
            }
            exit = entry
                .ended
                .wait(exit)
                .unwrap_or_else(PoisonError::into_inner);
        };
        drop(exit);
        self.entries().remove(&key);
        Ok(info)
    }

    /// Sends `signal` to every running exec's process group (shutdown).
    pub fn signal_all(&self, signal: Signal) {
        let entries: Vec<Arc<Entry>> = self.entries().values().cloned().collect();
        for entry in entries {
            let exit = lock(&entry.exit);
            if exit.is_none() {
                let _ = killpg(entry.pgid, signal);
            }
        }
    }
}

/// A process's own root: changed to in the child, between fork and exec, after
/// std's own set-up (so the working directory is taken inside it).
struct EnterRoot {
    root: CString,
    cwd: CString,
    user: Option<crate::protocol::UserSpec>,
}

impl EnterRoot {
    /// Checks the paths, and that the agent may change roots at all (root, or
    /// CAP_SYS_CHROOT kept for a pod sandbox's agent).
    fn new(
        root: &str,
        cwd: Option<&str>,
        user: Option<crate::protocol::UserSpec>,
    ) -> Result<EnterRoot, ExecError> {
        if !root.starts_with('/') {
            return Err(ExecError::Invalid("the root is not an absolute path"));
        }
        let cwd = cwd.unwrap_or("/");
        if !cwd.starts_with('/') {
            return Err(ExecError::Invalid(
                "the working directory in a root of its own is not an absolute path",
            ));
        }
        if !may_chroot() {
            return Err(ExecError::NoChroot);
        }
        let c =
            |s: &str| CString::new(s).map_err(|_| ExecError::Invalid("a path contains a NUL byte"));
        Ok(EnterRoot {
            root: c(root)?,
            cwd: c(cwd)?,
            user,
        })
    }

    fn apply(&self) -> std::io::Result<()> {
        // SAFETY: both are live NUL-terminated strings; chroot and chdir are
        // async-signal-safe system calls.
        unsafe {
            if libc::chroot(self.root.as_ptr()) != 0 || libc::chdir(self.cwd.as_ptr()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(u) = self.user {
                let groups = [u.gid];
                if libc::setgroups(1, groups.as_ptr()) != 0
                    || libc::setgid(u.gid) != 0
                    || libc::setuid(u.uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
        }
        Ok(())
    }
}

/// Whether the agent holds CAP_SYS_CHROOT in its effective set.
fn may_chroot() -> bool {
    const CAP_SYS_CHROOT: u32 = 18;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        })
        .is_some_and(|eff| eff & (1 << CAP_SYS_CHROOT) != 0)
}

/// Gives a child a clean signal state: the agent blocks its termination signals (they
/// are taken by a signal thread) and may have inherited ignored ones, and both would
/// otherwise pass on to the child through exec.
pub(crate) fn reset_signals() -> std::io::Result<()> {
    // SAFETY: sigemptyset initialises the set before sigprocmask reads it; signal() with
    // SIG_DFL installs no handler. All three are async-signal-safe, as a pre_exec hook
    // (running between fork and exec) requires.
    unsafe {
        let mut set = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigemptyset(set.as_mut_ptr());
        if libc::sigprocmask(libc::SIG_SETMASK, set.as_ptr(), std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        for sig in 1..32 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Moves output to `emit` until the process has ended and its pipes are closed (or the
/// grace after its end has passed); kills the group when the timeout passes.
fn pump(
    status: &ChildStatus,
    entry: &Entry,
    mut pipes: [Option<File>; 2],
    timeout: Option<Duration>,
    emit: &mut dyn FnMut(ResponseBody),
) -> Result<ExitInfo, ExecError> {
    let pgid = entry.pgid;
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut timed_out = false;
    // Recorded at once (not after the output is drained) so Kill stops signalling the
    // group id as soon as its leader is reaped, and Wait returns promptly.
    let record = |mut info: ExitInfo, timed_out: bool| {
        info.timed_out = timed_out;
        *lock(&entry.exit) = Some(info);
        entry.ended.notify_all();
        Some((info, Instant::now()))
    };
    let mut exit: Option<(ExitInfo, Instant)> = None;
    let mut buf = vec![0u8; OUTPUT_CHUNK];
    let spawn_err = |source| ExecError::Spawn {
        program: format!("pid {pgid}"),
        source,
    };
    loop {
        if exit.is_none() {
            if let Some(info) = status.try_wait().map_err(spawn_err)? {
                exit = record(info, timed_out);
            }
        }
        match exit {
            Some((_, _)) if pipes.iter().all(Option::is_none) => break,
            Some((_, at)) if at.elapsed() >= OUTPUT_GRACE => break,
            _ => {}
        }
        if exit.is_none() && !timed_out && deadline.is_some_and(|d| Instant::now() >= d) {
            timed_out = true;
            let _ = killpg(pgid, Signal::SIGKILL);
        }
        if pipes.iter().all(Option::is_none) {
            if let Some(info) = status
                .wait_timeout(Duration::from_millis(POLL_STEP_MS as u64))
                .map_err(spawn_err)?
            {
                exit = record(info, timed_out);
            }
            continue;
        }
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(2);
        let mut which = Vec::with_capacity(2);
        for (i, pipe) in pipes.iter().enumerate() {
            if let Some(fd) = pipe {
                fds.push(libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
                which.push(i);
            }
        }
        // SAFETY: `fds` is a valid, initialised array of `fds.len()` pollfd structs whose
        // descriptors stay open (owned by `pipes`) for the duration of the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, POLL_STEP_MS) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(ExecError::Poll(err));
        }
        for (pfd, &i) in fds.iter().zip(&which) {
            if pfd.revents == 0 {
                continue;
            }
            let Some(file) = &mut pipes[i] else { continue };
            match file.read(&mut buf) {
                Ok(0) => pipes[i] = None,
                Ok(n) => {
                    let chunk = buf[..n].to_vec();
                    emit(if i == 0 {
                        ResponseBody::Stdout(chunk)
                    } else {
                        ResponseBody::Stderr(chunk)
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => pipes[i] = None,
            }
        }
    }
    let (info, _) = exit.ok_or(ExecError::Invalid("exec ended without a status"))?;
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Entry {
        Entry {
            pgid: Pid::from_raw(1),
            background: false,
            stdin: Mutex::new(None),
            terminal: None,
            exit: Mutex::new(None),
            ended: Condvar::new(),
            followers: Mutex::default(),
        }
    }

    fn stdout(text: &str) -> ResponseBody {
        ResponseBody::Stdout(text.as_bytes().to_vec())
    }

    /// The interleaving CI met once: a follower attaches while the starting
    /// connection is being written an event it then reads. The follower must not get
    /// that event again (it got `before\nafter\n` where `after\n` was due).
    #[test]
    fn a_follower_attaching_during_a_heard_write_does_not_get_it_again() {
        let e = entry();
        let number = e.next_event();
        // The write to the starting connection is under way; a follower attaches.
        let (tx, rx) = std::sync::mpsc::channel();
        lock(&e.followers).add(tx);
        e.forward(stdout("before\n"), number, true);
        let after = e.next_event();
        e.forward(stdout("after\n"), after, false);
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), [stdout("after\n")]);
    }

    #[test]
    fn an_event_nobody_heard_reaches_every_follower_or_waits_for_the_next() {
        let e = entry();
        // Nobody: kept for the next follower.
        let first = e.next_event();
        e.forward(stdout("a"), first, false);
        // A follower attaching during an unheard write gets that event too.
        let second = e.next_event();
        let (tx, rx) = std::sync::mpsc::channel();
        lock(&e.followers).add(tx);
        e.forward(stdout("b"), second, false);
        // Attached before: it gets what the starting connection heard as well.
        let third = e.next_event();
        e.forward(stdout("c"), third, true);
        assert_eq!(
            rx.try_iter().collect::<Vec<_>>(),
            [stdout("a"), stdout("b"), stdout("c")]
        );
    }

    fn req(argv: &[&str]) -> ExecRequest {
        ExecRequest {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn run(table: &ExecTable, id: u64, r: &ExecRequest) -> (Vec<u8>, Vec<u8>, ExitInfo) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let exit = table
            .run(
                (0, id),
                r,
                ProcessDefaults {
                    env: &[("BASE".into(), "b".into())],
                    user: None,
                },
                false,
                &mut |body| {
                    match body {
                        ResponseBody::Stdout(b) => out.extend(b),
                        ResponseBody::Stderr(b) => err.extend(b),
                        _ => {}
                    }
                    true
                },
            )
            .unwrap();
        (out, err, exit)
    }

    #[test]
    fn runs_with_env_cwd_stdin_and_exit_code() {
        let table = ExecTable::new(Reaper::per_child());
        let dir = tempfile::tempdir().unwrap();
        let mut r = req(&["sh", "-c", "echo $BASE $X; pwd; cat; echo oops >&2; exit 3"]);
        r.env = vec![("X".into(), "x".into())];
        r.cwd = Some(dir.path().to_string_lossy().into_owned());
        r.stdin = b"input".to_vec();
        let (out, err, exit) = run(&table, 1, &r);
        let expected = format!(
            "b x\n{}\ninput",
            dir.path().canonicalize().unwrap().display()
        );
        assert_eq!(String::from_utf8(out).unwrap(), expected);
        assert_eq!(err, b"oops\n");
        assert_eq!(exit.code, Some(3));
        assert_eq!(table.running(), 0);
    }

    #[test]
    fn children_start_with_no_blocked_or_ignored_signals() {
        let table = ExecTable::new(Reaper::per_child());
        let r = req(&["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"]);
        // Block SIGTERM in a thread, as the agent does in all of its threads.
        let out = std::thread::spawn(move || {
            let mut set = nix::sys::signal::SigSet::empty();
            set.add(Signal::SIGTERM);
            set.thread_block().unwrap();
            run(&table, 7, &r).0
        })
        .join()
        .unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(out.contains("SigBlk:\t0000000000000000"), "{out}");
        // Standard signals (1-31) are back to their defaults; glibc's real-time
        // signals above them are not the agent's business.
        let ign = out
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:\t"))
            .map(|h| u64::from_str_radix(h, 16).unwrap())
            .unwrap();
        assert_eq!(ign & 0x7fff_ffff, 0, "{out}");
    }

    #[test]
    fn timeout_kills_the_whole_group() {
        let table = ExecTable::new(Reaper::per_child());
        let mut r = req(&["sh", "-c", "sleep 30 & sleep 30; echo never"]);
        r.timeout_ms = Some(100);
        let (out, _, exit) = run(&table, 2, &r);
        assert!(exit.timed_out);
        assert_eq!(exit.signal, Some(libc::SIGKILL));
        assert!(out.is_empty());
    }

    #[test]
    fn kill_and_wait_a_background_exec() {
        let table = Arc::new(ExecTable::new(Reaper::per_child()));
        let mut r = req(&["sleep", "30"]);
        r.background = true;
        let (tx, rx) = std::sync::mpsc::channel();
        let t = Arc::clone(&table);
        let runner = std::thread::spawn(move || {
            t.run((0, 3), &r, ProcessDefaults::default(), false, &mut |body| {
                let _ = tx.send(body);
                true
            })
        });
        assert!(matches!(rx.recv().unwrap(), ResponseBody::Started { .. }));
        table.kill((0, 3), libc::SIGTERM).unwrap();
        let exit = table.wait((0, 3)).unwrap();
        assert_eq!(exit.signal, Some(libc::SIGTERM));
        runner.join().unwrap().unwrap();
        assert!(matches!(table.wait((0, 3)), Err(ExecError::NoSuchExec(3))));
        assert!(matches!(
            table.kill((0, 3), 9),
            Err(ExecError::NoSuchExec(3))
        ));
        assert!(matches!(
            table.kill((0, 3), 999),
            Err(ExecError::BadSignal(999))
        ));
    }

    #[test]
    fn bad_requests_are_refused() {
        let table = ExecTable::new(Reaper::per_child());
        let err = table
            .run(
                (0, 4),
                &req(&[]),
                ProcessDefaults::default(),
                false,
                &mut |_| true,
            )
            .unwrap_err();
        assert_eq!(err.to_reply().code, ErrorCode::InvalidArgument);
        let err = table
            .run(
                (0, 5),
                &req(&["/no/such/program"]),
                ProcessDefaults::default(),
                false,
                &mut |_| true,
            )
            .unwrap_err();
        assert_eq!(err.to_reply().code, ErrorCode::NotFound);
        let mut r = req(&["true"]);
        r.cwd = Some("/no/such/dir".into());
        let err = table
            .run((0, 6), &r, ProcessDefaults::default(), false, &mut |_| true)
            .unwrap_err();
        assert_eq!(err.to_reply().code, ErrorCode::NotFound);
    }
}
