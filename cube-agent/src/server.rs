//! Serves the protocol over one stream: reads requests in order, answers cheap ones at
//! once, runs the rest on their own threads, and writes every answer through one
//! mutex-guarded writer so frames never interleave.
//!
//! Streamed writes are applied on the reading thread, in order, so at most one chunk of
//! a file is in memory at a time. A request that cannot be decoded, or a frame that is
//! too large, is answered with an error and serving goes on.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufReader, Write};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::exec::{ExecTable, Input, ProcessDefaults};
use crate::files::{self, WriteSession};
use crate::frame::{self, FrameError, MAX_FRAME_LEN};
use crate::protocol::{
    decode_request, ErrorCode, ErrorReply, Request, RequestBody, Response, ResponseBody,
    AGENT_VERSION, PROTOCOL_VERSION,
};
use crate::reaper::Reaper;
use crate::run_code::Contexts;
use crate::transport::Transport;

/// Requests running on their own threads at once, across all connections.
const MAX_IN_FLIGHT: usize = 1024;

/// Streamed writes open at once on one connection.
const MAX_OPEN_WRITES: usize = 64;

/// Errors that end serving a stream.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The stream could not be split into reading and writing handles.
    #[error("cloning the transport failed")]
    Clone(#[source] std::io::Error),
    /// Reading from the stream failed.
    #[error("reading a request failed")]
    Read(#[source] FrameError),
}

/// How an agent is set up.
pub struct AgentConfig {
    /// Who waits for exec's children.
    pub reaper: Reaper,
    /// The sandbox-wide environment execs start from.
    pub env: Vec<(String, String)>,
    /// Who execs and code runs that name no user run as, and who owns what the file
    /// calls create (a VM image's User); the agent's own user when None.
    pub default_user: Option<crate::protocol::UserSpec>,
    /// Whether this agent is a VM's init, which owns the guest's NIC (a jail's
    /// network is the host's to set up).
    pub vm_init: bool,
}

/// The agent: state shared by all the streams it serves. Cheap to clone.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

struct Inner {
    connections: Arc<Mutex<Connections>>,
    next_connection: std::sync::atomic::AtomicU64,
    execs: ExecTable,
    contexts: Contexts,
    env: RwLock<BTreeMap<String, String>>,
    /// Who execs and code runs that name no user run as, and who owns what the file
    /// calls create (a VM image's user); the agent's own user when None.
    default_user: Option<crate::protocol::UserSpec>,
    vm_init: bool,
    started: Instant,
    in_flight: AtomicUsize,
}

/// The descriptors of every stream being served, so that they can be closed at once
/// ([`Agent::drop_connections`]).
#[derive(Default)]
struct Connections {
    next: u64,
    fds: HashMap<u64, RawFd>,
}

/// One descriptor's entry in [`Connections`], removed on drop. It must drop before the
/// descriptor closes (declared after its owner, or before it in a struct), so that
/// [`Agent::drop_connections`] never touches a number reused meanwhile.
struct Registration {
    connections: Arc<Mutex<Connections>>,
    key: Option<u64>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(key) = self.key {
            lock(&self.connections).fds.remove(&key);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The writing half of a stream, shared by every thread answering on it.
struct Replies {
    // Before `writer`: fields drop in order, and the entry must go first.
    _registration: Registration,
    writer: Mutex<Box<dyn Write + Send>>,
}

impl Replies {
    /// Sends one response; false when the stream is gone.
    fn send(&self, id: u64, body: ResponseBody) -> bool {
        let frame = match frame::encode_frame(&Response { id, body }) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(id, error = %e, "response could not be encoded");
                let fallback = Response {
                    id,
                    body: ResponseBody::Error(ErrorReply::new(
                        ErrorCode::Io,
                        format!("the response could not be encoded: {e}"),
                    )),
                };
                match frame::encode_frame(&fallback) {
                    Ok(f) => f,
                    Err(_) => return false,
                }
            }
        };
        let mut w = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        w.write_all(&frame).and_then(|_| w.flush()).is_ok()
    }

    fn error(&self, id: u64, code: ErrorCode, message: impl Into<String>) -> bool {
        self.send(id, ResponseBody::Error(ErrorReply::new(code, message)))
    }
}

/// A streamed write under way on one connection.
enum WriteState {
    Open(WriteSession),
    /// Failed and already answered; later chunks and the end are dropped silently.
    Failed,
}

/// Per-stream state kept by the reading thread.
struct Connection {
    /// This stream's number: exec ids are the client's, so execs are keyed by both.
    number: u64,
    replies: Arc<Replies>,
    handshaken: bool,
    writes: HashMap<u64, WriteState>,
    /// TCP connections into the sandbox carried on this stream, by request id.
    tunnels: HashMap<u64, crate::tunnel::Tunnel>,
}

impl Agent {
    /// An agent with no execs yet.
    pub fn new(config: AgentConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                connections: Arc::default(),
                next_connection: std::sync::atomic::AtomicU64::new(1),
                contexts: Contexts::new(config.reaper.clone()),
                execs: ExecTable::new(config.reaper),
                env: RwLock::new(config.env.into_iter().collect()),
                default_user: config.default_user,
                vm_init: config.vm_init,
                started: Instant::now(),
                in_flight: AtomicUsize::new(0),
            }),
        }
    }

    /// The execs of this agent.
    pub fn execs(&self) -> &ExecTable {
        &self.inner.execs
    }

    /// Stops every interpreter context, forwards `signal` to every running exec, waits up
    /// to `grace` for them to end, then kills what is left.
    pub fn stop_children(&self, signal: Signal, grace: Duration) {
        self.inner.contexts.clear();
        let execs = &self.inner.execs;
        execs.signal_all(signal);
        let deadline = Instant::now() + grace;
        while execs.running() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        execs.signal_all(Signal::SIGKILL);
    }

    fn register(&self, fd: Option<RawFd>) -> Registration {
        let connections = Arc::clone(&self.inner.connections);
        let key = fd.map(|fd| {
            let mut c = lock(&connections);
            c.next += 1;
            let key = c.next;
            c.fds.insert(key, fd);
            key
        });
        Registration { connections, key }
    }

    /// Closes every stream being served: each is shut down (so its reader sees the end
    /// and its peer a closed connection) and its descriptor replaced by `/dev/null`
    /// (answers still under way go nowhere). Afterwards this process holds no connected
    /// socket of the host, which is what a checkpoint of the sandbox needs: CRIU cannot
    /// save a stream whose other end is outside it. Clients reconnect. Returns how many
    /// descriptors were closed.
    pub fn drop_connections(&self) -> usize {
        let connections = lock(&self.inner.connections);
        if connections.fds.is_empty() {
            return 0;
        }
        // SAFETY: open(2) of a constant path; the descriptor is owned right away.
        let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if null < 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "cannot open /dev/null");
        }
        for fd in connections.fds.values() {
            // SAFETY: `fd` is registered, so its owner has not closed it (the entry goes
            // before the descriptor, under this lock); shutdown and dup3 only change
            // what the descriptor refers to.
            unsafe {
                libc::shutdown(*fd, libc::SHUT_RDWR);
                if null >= 0 {
                    libc::dup3(null, *fd, libc::O_CLOEXEC);
                }
            }
        }
        if null >= 0 {
            // SAFETY: closes the descriptor opened above, owned by nothing else.
            unsafe { libc::close(null) };
        }
        connections.fds.len()
    }

    /// Serves one stream until the peer closes it.
    pub fn serve<T: Transport>(&self, transport: T) -> Result<(), ServerError> {
        let write_half = transport
            .try_clone_transport()
            .map_err(ServerError::Clone)?;
        let mut conn = Connection {
            number: self.inner.next_connection.fetch_add(1, Ordering::Relaxed),
            replies: Arc::new(Replies {
                _registration: self.register(write_half.raw_fd()),
                writer: Mutex::new(Box::new(write_half)),
            }),
            handshaken: false,
            writes: HashMap::new(),
            tunnels: HashMap::new(),
        };
        let mut reader = BufReader::with_capacity(256 * 1024, transport);
        // Declared after `reader`, so it drops first.
        let _registration = self.register(reader.get_ref().raw_fd());
        let mut buf = Vec::new();
        loop {
            match frame::read_frame(&mut reader, &mut buf) {
                Ok(true) => match decode_request(&buf) {
                    Ok(req) => self.handle(&mut conn, req),
                    Err(e) => {
                        tracing::debug!(error = %e, "bad request");
                        conn.replies
                            .send(e.reply_id(), ResponseBody::Error(e.to_reply()));
                    }
                },
                Ok(false) | Err(FrameError::Truncated) => return Ok(()),
                // drop_connections put /dev/null in the socket's place (std reads
                // sockets with recv): the stream was ended on purpose.
                Err(FrameError::Io(e)) if e.raw_os_error() == Some(libc::ENOTSOCK) => return Ok(()),
                Err(FrameError::Oversized { len, id }) => {
                    conn.replies.error(
                        id.unwrap_or(0),
                        ErrorCode::TooLarge,
                        format!("frame of {len} bytes exceeds the {MAX_FRAME_LEN}-byte limit"),
                    );
                }
                Err(e) => return Err(ServerError::Read(e)),
            }
        }
    }

    fn env_snapshot(&self) -> Vec<(String, String)> {
        self.inner
            .env
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    fn handle(&self, conn: &mut Connection, req: Request) {
        let Request { id, body } = req;
        let replies = &conn.replies;
        if let RequestBody::Hello { protocol } = body {
            if protocol == PROTOCOL_VERSION {
                conn.handshaken = true;
                replies.send(
                    id,
                    ResponseBody::Hello {
                        protocol: PROTOCOL_VERSION,
                        agent: AGENT_VERSION.into(),
                    },
                );
            } else {
                replies.error(
                    id,
                    ErrorCode::VersionMismatch,
                    format!("agent speaks protocol {PROTOCOL_VERSION}, host {protocol}"),
                );
            }
            return;
        }
        if !conn.handshaken {
            replies.error(id, ErrorCode::HandshakeRequired, "send Hello first");
            return;
        }
        match body {
            RequestBody::Health => {
                replies.send(
                    id,
                    ResponseBody::Healthy {
                        uptime_ms: self.inner.started.elapsed().as_millis() as u64,
                        running_execs: self.inner.execs.running() as u32,
                    },
                );
            }
            RequestBody::Version => {
                replies.send(
                    id,
                    ResponseBody::Version {
                        protocol: PROTOCOL_VERSION,
                        agent: AGENT_VERSION.into(),
                    },
                );
            }
            RequestBody::SetEnv { set, unset } => {
                if set
                    .iter()
                    .any(|(k, v)| k.is_empty() || k.contains(['=', '\0']) || v.contains('\0'))
                {
                    replies.error(id, ErrorCode::InvalidArgument, "bad environment variable");
                    return;
                }
                let mut env = self
                    .inner
                    .env
                    .write()
                    .unwrap_or_else(PoisonError::into_inner);
                for k in unset {
                    env.remove(&k);
                }
                env.extend(set);
                replies.send(id, ResponseBody::Done);
            }
            RequestBody::ListContexts => {
                replies.send(id, ResponseBody::Contexts(self.inner.contexts.list()));
            }
            RequestBody::Reseed { entropy } => {
                if !(16..=512).contains(&entropy.len()) {
                    replies.error(
                        id,
                        ErrorCode::InvalidArgument,
                        "reseed takes 16 to 512 bytes",
                    );
                    return;
                }
                let _ = match crate::reseed::reseed_kernel_crng(&entropy) {
                    Ok(()) => replies.send(id, ResponseBody::Done),
                    Err(e) => {
                        replies.error(id, ErrorCode::PermissionDenied, crate::reseed::describe(&e))
                    }
                };
            }
            RequestBody::TcpConnect { port } => {
                if conn.tunnels.contains_key(&id) {
                    replies.error(
                        id,
                        ErrorCode::AlreadyExists,
                        "a connection is already open under this id",
                    );
                    return;
                }
                conn.tunnels.retain(|_, t| t.is_open());
                if conn.tunnels.len() >= crate::tunnel::MAX_TUNNELS {
                    replies.error(id, ErrorCode::Busy, "too many connections on this stream");
                    return;
                }
                let sink = Arc::clone(replies);
                match crate::tunnel::Tunnel::open(port, move |body| sink.send(id, body)) {
                    Ok(t) => {
                        conn.tunnels.insert(id, t);
                    }
                    Err(e) => {
                        replies.error(
                            id,
                            ErrorCode::Busy,
                            format!("no thread for the connection: {e}"),
                        );
                    }
                }
            }
            RequestBody::TcpSend { data } => match conn.tunnels.get(&id) {
                Some(t) => {
                    if data.is_empty() {
                        t.shutdown_write();
                    } else {
                        t.send(data);
                    }
                }
                None => {
                    replies.error(
                        id,
                        ErrorCode::InvalidArgument,
                        "no connection open under this id",
                    );
                }
            },
            RequestBody::Kill { exec_id, signal } => {
                let body = match self.inner.execs.kill((conn.number, exec_id), signal) {
                    Ok(()) => ResponseBody::Done,
                    Err(e) => ResponseBody::Error(e.to_reply()),
                };
                replies.send(id, body);
            }
            RequestBody::ResizeTerminal { exec_id, size } => {
                let body = match self.inner.execs.resize((conn.number, exec_id), size) {
                    Ok(()) => ResponseBody::Done,
                    Err(e) => ResponseBody::Error(e.to_reply()),
                };
                replies.send(id, body);
            }
            RequestBody::WriteStart {
                path,
                mode,
                append,
                create_parents,
            } => {
                if conn.writes.contains_key(&id) {
                    replies.error(
                        id,
                        ErrorCode::AlreadyExists,
                        "a write is already open under this id",
                    );
                } else if conn.writes.len() >= MAX_OPEN_WRITES {
                    replies.error(
                        id,
                        ErrorCode::Busy,
                        "too many writes open on this connection",
                    );
                    conn.writes.insert(id, WriteState::Failed);
                } else {
                    let state = match WriteSession::start(
                        &path,
                        mode,
                        append,
                        create_parents,
                        self.inner.default_user,
                    ) {
                        Ok(s) => WriteState::Open(s),
                        Err(e) => {
                            replies.send(id, ResponseBody::Error(e.to_reply()));
                            WriteState::Failed
                        }
                    };
                    conn.writes.insert(id, state);
                }
            }
            RequestBody::WriteChunk { data } => match conn.writes.get_mut(&id) {
                Some(WriteState::Open(session)) => {
                    if let Err(e) = session.write(&data) {
                        replies.send(id, ResponseBody::Error(e.to_reply()));
                        conn.writes.insert(id, WriteState::Failed);
                    }
                }
                Some(WriteState::Failed) => {}
                None => {
                    replies.error(
                        id,
                        ErrorCode::InvalidArgument,
                        "no write open under this id",
                    );
                }
            },
            RequestBody::WriteEnd { sync } => match conn.writes.remove(&id) {
                Some(WriteState::Open(session)) => {
                    let body = match session.finish(sync) {
                        Ok(size) => ResponseBody::Written { size },
                        Err(e) => ResponseBody::Error(e.to_reply()),
                    };
                    replies.send(id, body);
                }
                Some(WriteState::Failed) => {}
                None => {
                    replies.error(
                        id,
                        ErrorCode::InvalidArgument,
                        "no write open under this id",
                    );
                }
            },
            other => self.spawn_handler(Arc::clone(&conn.replies), conn.number, id, other),
        }
    }

    /// Runs a request that may block (processes, filesystem) on its own thread.
    fn spawn_handler(&self, replies: Arc<Replies>, connection: u64, id: u64, body: RequestBody) {
        if self.inner.in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
            self.inner.in_flight.fetch_sub(1, Ordering::SeqCst);
            replies.error(id, ErrorCode::Busy, "too many requests in flight");
            return;
        }
        let agent = self.clone();
        let thread_replies = Arc::clone(&replies);
        let spawned = std::thread::Builder::new()
            .name(format!("request-{id}"))
            .spawn(move || {
                let body = agent.run_blocking(&thread_replies, connection, id, body);
                thread_replies.send(id, body);
                agent.inner.in_flight.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            self.inner.in_flight.fetch_sub(1, Ordering::SeqCst);
            replies.error(
                id,
                ErrorCode::Busy,
                format!("no thread for the request: {e}"),
            );
        }
    }

    /// What the processes the agent starts begin from, with the sandbox-wide `env`.
    fn defaults<'a>(&self, env: &'a [(String, String)]) -> ProcessDefaults<'a> {
        ProcessDefaults {
            env,
            user: self.inner.default_user,
        }
    }

    /// Runs a process under `id` of `connection` to its end.
    fn exec(
        &self,
        connection: u64,
        id: u64,
        req: &crate::protocol::ExecRequest,
        root: Option<&str>,
        input: Input,
        emit: crate::exec::Emit<'_>,
    ) -> ResponseBody {
        let env = self.env_snapshot();
        match self.inner.execs.run_in(
            (connection, id),
            req,
            root,
            self.defaults(&env),
            input,
            emit,
        ) {
            Ok(exit) => ResponseBody::Exited(exit),
            Err(e) => ResponseBody::Error(e.to_reply()),
        }
    }

    /// Runs one blocking request, emitting its events, and returns its final answer.
    fn run_blocking(
        &self,
        replies: &Replies,
        connection: u64,
        id: u64,
        body: RequestBody,
    ) -> ResponseBody {
        let mut emit = |b: ResponseBody| replies.send(id, b);
        let done = |r: Result<(), files::FilesError>| match r {
            Ok(()) => ResponseBody::Done,
            Err(e) => ResponseBody::Error(e.to_reply()),
        };
        match body {
            RequestBody::Exec(req) => {
                self.exec(connection, id, &req, None, Input::Given, &mut emit)
            }
            RequestBody::ExecWithStdin(req) => {
                self.exec(connection, id, &req, None, Input::Open, &mut emit)
            }
            RequestBody::ExecInRoot {
                root,
                keep_stdin,
                exec,
            } => {
                let input = if keep_stdin {
                    Input::Open
                } else {
                    Input::Given
                };
                self.exec(connection, id, &exec, Some(&root), input, &mut emit)
            }
            RequestBody::ExecInTerminal { root, size, exec } => self.exec(
                connection,
                id,
                &exec,
                root.as_deref(),
                Input::Terminal(size),
                &mut emit,
            ),
            RequestBody::StdinWrite { exec_id, data } => {
                match self.inner.execs.write_stdin((connection, exec_id), &data) {
                    Ok(()) => ResponseBody::Done,
                    Err(e) => ResponseBody::Error(e.to_reply()),
                }
            }
            RequestBody::StdinClose { exec_id } => {
                match self.inner.execs.close_stdin((connection, exec_id)) {
                    Ok(()) => ResponseBody::Done,
                    Err(e) => ResponseBody::Error(e.to_reply()),
                }
            }
            RequestBody::Attach { pid } => match self.inner.execs.attach((connection, id), pid) {
                Ok(events) => {
                    emit(ResponseBody::Started { pid });
                    for body in events {
                        if matches!(body, ResponseBody::Exited(_)) {
                            return body;
                        }
                        emit(body);
                    }
                    // The exec's entry went without an end (it cannot: see finish).
                    ResponseBody::Error(ErrorReply::new(
                        ErrorCode::NotRunning,
                        format!("exec {pid} ended without a status"),
                    ))
                }
                Err(e) => ResponseBody::Error(e.to_reply()),
            },
            RequestBody::Wait { exec_id } => match self.inner.execs.wait((connection, exec_id)) {
                Ok(exit) => ResponseBody::Exited(exit),
                Err(e) => ResponseBody::Error(e.to_reply()),
            },
            RequestBody::ReadFile { path, offset, len } => {
                match files::read_file(&path, offset, len, &mut emit) {
                    Ok(size) => ResponseBody::FileEnd { size },
                    Err(e) => ResponseBody::Error(e.to_reply()),
                }
            }
            RequestBody::ListDir { path, depth } => {
                match files::list_dir(&path, depth, &mut emit) {
                    Ok(count) => ResponseBody::ListEnd { count },
                    Err(e) => ResponseBody::Error(e.to_reply()),
                }
            }
            RequestBody::Stat { path } => match files::stat(&path) {
                Ok(info) => ResponseBody::Stat(info),
                Err(e) => ResponseBody::Error(e.to_reply()),
            },
            RequestBody::Exists { path } => match files::exists(&path) {
                Ok(b) => ResponseBody::Exists(b),
                Err(e) => ResponseBody::Error(e.to_reply()),
            },
            RequestBody::MakeDir { path, parents } => {
                done(files::make_dir(&path, parents, self.inner.default_user))
            }
            RequestBody::Remove { path, recursive } => done(files::remove(&path, recursive)),
            RequestBody::InstallRoot { archive, root } => {
                match crate::container_root::install(&archive, &root) {
                    Ok(()) => ResponseBody::Done,
                    Err(e) => ResponseBody::Error(e.to_reply()),
                }
            }
            RequestBody::RemoveRoot { root } => match crate::container_root::remove(&root) {
                Ok(()) => ResponseBody::Done,
                Err(e) => ResponseBody::Error(e.to_reply()),
            },
            RequestBody::ConfigureNic(settings) => {
                if !self.inner.vm_init {
                    ResponseBody::Error(ErrorReply::new(
                        ErrorCode::InvalidArgument,
                        "only the agent of a VM configures its NIC",
                    ))
                } else {
                    match crate::vm_init::configure_nic(&settings) {
                        Ok(()) => ResponseBody::Done,
                        Err(e) => ResponseBody::Error(ErrorReply::new(
                            ErrorCode::Io,
                            crate::exec::error_chain(&e),
                        )),
                    }
                }
            }
            RequestBody::Rename { from, to } => done(files::rename(&from, &to)),
            RequestBody::CreateContext {
                name,
                language,
                cwd,
            } => {
                let env = self.env_snapshot();
                match self.inner.contexts.create(
                    &name,
                    language,
                    cwd.as_deref(),
                    self.defaults(&env),
                ) {
                    Ok(()) => ResponseBody::Done,
                    Err(e) => ResponseBody::Error(e.to_reply()),
                }
            }
            RequestBody::RunCode {
                context,
                code,
                timeout_ms,
            } => match self.inner.contexts.run(
                &context,
                &code,
                timeout_ms.map(Duration::from_millis),
            ) {
                Ok(result) => ResponseBody::CodeResult(result),
                Err(e) => ResponseBody::Error(e.to_reply()),
            },
            RequestBody::DeleteContext { name } => match self.inner.contexts.delete(&name) {
                Ok(()) => ResponseBody::Done,
                Err(e) => ResponseBody::Error(e.to_reply()),
            },
            // Answered on the reading thread; never dispatched here.
            RequestBody::Hello { .. }
            | RequestBody::Health
            | RequestBody::Version
            | RequestBody::SetEnv { .. }
            | RequestBody::Kill { .. }
            | RequestBody::ResizeTerminal { .. }
            | RequestBody::ListContexts
            | RequestBody::Reseed { .. }
            | RequestBody::WriteStart { .. }
            | RequestBody::WriteChunk { .. }
            | RequestBody::WriteEnd { .. }
            | RequestBody::TcpConnect { .. }
            | RequestBody::TcpSend { .. } => ResponseBody::Error(ErrorReply::new(
                ErrorCode::InvalidArgument,
                "request kind not handled here",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Client, ClientError};
    use crate::protocol::ExecRequest;
    use std::os::unix::net::UnixStream;

    fn pair() -> (
        Agent,
        Client,
        std::thread::JoinHandle<Result<(), ServerError>>,
    ) {
        let (a, b) = UnixStream::pair().unwrap();
        let agent = Agent::new(AgentConfig {
            reaper: Reaper::per_child(),
            env: vec![("SANDBOX".into(), "1".into())],
            default_user: None,
            vm_init: false,
        });
        let served = agent.clone();
        let handle = std::thread::spawn(move || served.serve(a));
        (agent, Client::new(b).unwrap(), handle)
    }

    #[test]
    fn reseed_reaches_the_kernel_and_bad_sizes_are_refused() {
        let (_agent, client, _h) = pair();
        for bad in [vec![0u8; 15], vec![0u8; 513]] {
            match client.reseed(bad) {
                Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::InvalidArgument),
                other => panic!("{other:?}"),
            }
        }
        let entropy = crate::reseed::fresh_entropy(std::path::Path::new("/nonexistent"), 9);
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } == 0 {
            client.reseed(entropy).unwrap();
        } else {
            // Without CAP_SYS_ADMIN the kernel refuses, and the host hears why.
            match client.reseed(entropy) {
                Err(ClientError::Agent(e)) => {
                    assert_eq!(e.code, ErrorCode::PermissionDenied);
                    assert!(e.message.contains("RNDADDENTROPY"), "{}", e.message);
                }
                other => panic!("{other:?}"),
            }
        }
        // The connection keeps serving.
        assert!(matches!(
            client.call(RequestBody::Health),
            Ok(ResponseBody::Healthy { .. })
        ));
    }

    #[test]
    fn handshake_is_required_first() {
        let (a, b) = UnixStream::pair().unwrap();
        let agent = Agent::new(AgentConfig {
            reaper: Reaper::per_child(),
            env: vec![],
            default_user: None,
            vm_init: false,
        });
        let served = agent.clone();
        std::thread::spawn(move || served.serve(a));
        let client = Client::without_handshake(b).unwrap();
        match client.call(RequestBody::Health) {
            Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::HandshakeRequired),
            other => panic!("{other:?}"),
        }
        match client.call(RequestBody::Hello { protocol: 999 }) {
            Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::VersionMismatch),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            client.call(RequestBody::Hello {
                protocol: PROTOCOL_VERSION
            }),
            Ok(ResponseBody::Hello { .. })
        ));
        assert!(matches!(
            client.call(RequestBody::Health),
            Ok(ResponseBody::Healthy { .. })
        ));
    }

    #[test]
    fn health_version_env_and_exec() {
        let (_agent, client, _h) = pair();
        assert!(matches!(
            client.call(RequestBody::Version),
            Ok(ResponseBody::Version {
                protocol: PROTOCOL_VERSION,
                ..
            })
        ));
        client
            .set_env(
                vec![("GREETING".into(), "hi".into())],
                vec!["SANDBOX".into()],
            )
            .unwrap();
        let out = client
            .exec(ExecRequest {
                argv: vec![
                    "sh".into(),
                    "-c".into(),
                    "echo $GREETING-${SANDBOX:-unset}".into(),
                ],
                ..Default::default()
            })
            .unwrap();
        assert_eq!(out.stdout, b"hi-unset\n");
        assert_eq!(out.exit.code, Some(0));
        match client.set_env(vec![("A=B".into(), "x".into())], vec![]) {
            Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::InvalidArgument),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_frames_are_answered_and_serving_goes_on() {
        let (_agent, client, _h) = pair();
        client.send_raw(&[3, 0, 0, 0, 0xff, 0xff, 0xff]).unwrap();
        let resp = client.next_unsolicited(Duration::from_secs(10)).unwrap();
        assert_eq!(resp.id, 0);
        assert!(matches!(
            resp.body,
            ResponseBody::Error(ErrorReply {
                code: ErrorCode::Malformed,
                ..
            })
        ));
        assert!(matches!(
            client.call(RequestBody::Health),
            Ok(ResponseBody::Healthy { .. })
        ));
    }

    #[test]
    fn streamed_write_errors_are_answered_once() {
        let (_agent, client, _h) = pair();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f").to_string_lossy().into_owned();
        let size = client.write_file(&path, &mut &b"hello"[..]).unwrap();
        assert_eq!(size, 5);
        let mut back = Vec::new();
        client.read_file(&path, &mut back).unwrap();
        assert_eq!(back, b"hello");
        // Writing below a regular file fails at WriteStart (creating its parent finds a
        // file there); the chunks and end that follow must not produce more answers.
        let bad = format!("{path}/below");
        match client.write_file(&bad, &mut &b"x"[..]) {
            Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::AlreadyExists),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            client.call(RequestBody::Health),
            Ok(ResponseBody::Healthy { .. })
        ));
        assert!(matches!(
            client.next_unsolicited(Duration::from_millis(100)),
            Err(ClientError::Timeout)
        ));
        // A chunk with no write open is an error under its id.
        match client
            .start(RequestBody::WriteChunk { data: vec![1] })
            .unwrap()
            .finish()
        {
            Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::InvalidArgument),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn drop_connections_closes_every_stream_and_serving_goes_on() {
        let (agent, first, handle) = pair();
        let (a, b) = UnixStream::pair().unwrap();
        let served = agent.clone();
        let second_handle = std::thread::spawn(move || served.serve(a));
        let second = Client::new(b).unwrap();
        // A background exec holds its connection's writer on another thread.
        let sleeper = first
            .start(RequestBody::Exec(ExecRequest {
                argv: vec!["sleep".into(), "0.3".into()],
                ..Default::default()
            }))
            .unwrap();
        assert_eq!(
            agent.drop_connections(),
            4,
            "two descriptors per connection"
        );
        handle.join().unwrap().unwrap();
        second_handle.join().unwrap().unwrap();
        for client in [&first, &second] {
            let err = client.call(RequestBody::Health).unwrap_err();
            assert!(
                matches!(err, ClientError::Disconnected | ClientError::Send(_)),
                "{err}"
            );
        }
        drop(sleeper);
        // The exec's thread answers into /dev/null and unregisters when it ends.
        std::thread::sleep(std::time::Duration::from_millis(500));
        assert_eq!(agent.drop_connections(), 0);
        let (_agent2, third, _h) = {
            let (a, b) = UnixStream::pair().unwrap();
            let served = agent.clone();
            let h = std::thread::spawn(move || served.serve(a));
            (agent.clone(), Client::new(b).unwrap(), h)
        };
        third.call(RequestBody::Health).unwrap();
    }

    #[test]
    fn two_connections_may_use_the_same_exec_id() {
        let (agent, first, _h) = pair();
        let (a, b) = UnixStream::pair().unwrap();
        let served = agent.clone();
        std::thread::spawn(move || served.serve(a));
        let second = Client::new(b).unwrap();
        let sleep = |client: &Client| {
            client
                .start_with_id(
                    7,
                    RequestBody::Exec(ExecRequest {
                        argv: vec!["sleep".into(), "30".into()],
                        ..Default::default()
                    }),
                )
                .unwrap()
        };
        let mut one = sleep(&first);
        let mut two = sleep(&second);
        for call in [&mut one, &mut two] {
            let started = call.recv().unwrap().unwrap();
            assert!(
                matches!(started, ResponseBody::Started { .. }),
                "{started:?}"
            );
        }
        // A kill of id 7 on the second connection reaches its own exec only.
        second
            .call(RequestBody::Kill {
                exec_id: 7,
                signal: libc::SIGKILL,
            })
            .unwrap();
        match two.finish().unwrap() {
            ResponseBody::Exited(exit) => assert_eq!(exit.signal, Some(libc::SIGKILL)),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            agent.execs().running(),
            1,
            "the first connection's exec went too"
        );
        first
            .call(RequestBody::Kill {
                exec_id: 7,
                signal: libc::SIGKILL,
            })
            .unwrap();
        assert!(matches!(one.finish().unwrap(), ResponseBody::Exited(_)));
    }
}
