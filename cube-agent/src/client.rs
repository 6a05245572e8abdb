//! A blocking client for the host side (and tests): sends requests over a [`Transport`]
//! and hands each request's responses to whoever asked, by id.

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::frame::{self, FrameError};
use crate::protocol::{
    CodeResult, ContextInfo, ErrorReply, ExecRequest, ExitInfo, FileInfo, Language, Request,
    RequestBody, Response, ResponseBody, TerminalSize, PROTOCOL_VERSION,
};
use crate::transport::Transport;

/// How long [`Client::connect_unix`] and [`Client::new`] wait for the agent's `Hello`:
/// a stopped or frozen agent accepts connections into its backlog but never answers.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Chunk size the client uses for streamed writes.
const WRITE_CHUNK: usize = 1024 * 1024;

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting or cloning the stream failed.
    #[error("connecting to the agent failed")]
    Connect(#[source] std::io::Error),
    /// Sending a frame failed.
    #[error("sending to the agent failed")]
    Send(#[source] FrameError),
    /// The stream closed before the answer came.
    #[error("the agent closed the connection")]
    Disconnected,
    /// No answer came in time.
    #[error("no answer from the agent in time")]
    Timeout,
    /// The agent answered with an error.
    #[error("agent error {:?}: {}", .0.code, .0.message)]
    Agent(ErrorReply),
    /// The agent answered something the request does not expect.
    #[error("unexpected answer from the agent: {0}")]
    Unexpected(String),
    /// Reading local data to send, or writing received data, failed.
    #[error("local i/o failed")]
    LocalIo(#[source] std::io::Error),
    /// The agent speaks another protocol version.
    #[error("agent speaks protocol {0}, this client {PROTOCOL_VERSION}")]
    Version(u32),
}

type Routes = Arc<Mutex<HashMap<u64, Sender<ResponseBody>>>>;

/// A connection to an agent.
pub struct Client {
    writer: Mutex<Box<dyn Write + Send>>,
    routes: Routes,
    unsolicited: Mutex<Receiver<Response>>,
    next_id: AtomicU64,
    shutdown: Box<dyn Fn() + Send + Sync>,
    reader: Option<JoinHandle<()>>,
}

/// The answers to one request, in order.
pub struct Call {
    /// The request id.
    pub id: u64,
    rx: Receiver<ResponseBody>,
    done: bool,
}

impl Call {
    /// The next response; after the final one, `Ok(None)`.
    pub fn recv(&mut self) -> Result<Option<ResponseBody>, ClientError> {
        if self.done {
            return Ok(None);
        }
        let body = self.rx.recv().map_err(|_| ClientError::Disconnected)?;
        self.done = body.is_final();
        Ok(Some(body))
    }

    /// Like [`Call::recv`], giving up after `timeout`.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<ResponseBody>, ClientError> {
        if self.done {
            return Ok(None);
        }
        let body = self.rx.recv_timeout(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => ClientError::Timeout,
            RecvTimeoutError::Disconnected => ClientError::Disconnected,
        })?;
        self.done = body.is_final();
        Ok(Some(body))
    }

    /// Skips events and returns the final response, turning an error reply into `Err`.
    pub fn finish(mut self) -> Result<ResponseBody, ClientError> {
        while let Some(body) = self.recv()? {
            if body.is_final() {
                return match body {
                    ResponseBody::Error(e) => Err(ClientError::Agent(e)),
                    other => Ok(other),
                };
            }
        }
        Err(ClientError::Disconnected)
    }
}

/// Everything an exec printed and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// Standard output.
    pub stdout: Vec<u8>,
    /// Standard error.
    pub stderr: Vec<u8>,
    /// How it ended.
    pub exit: ExitInfo,
}

impl Client {
    /// Connects to an agent listening on a unix socket and shakes hands, giving up
    /// after [`HANDSHAKE_TIMEOUT`].
    pub fn connect_unix(path: &Path) -> Result<Self, ClientError> {
        Self::connect_unix_timeout(path, HANDSHAKE_TIMEOUT)
    }

    /// Like [`Client::connect_unix`], waiting at most `timeout` for the handshake.
    pub fn connect_unix_timeout(path: &Path, timeout: Duration) -> Result<Self, ClientError> {
        let stream = UnixStream::connect(path).map_err(ClientError::Connect)?;
        Self::with_handshake_timeout(stream, timeout)
    }

    /// Takes over a connected stream and shakes hands, giving up after
    /// [`HANDSHAKE_TIMEOUT`].
    pub fn new<T: Transport>(transport: T) -> Result<Self, ClientError> {
        Self::with_handshake_timeout(transport, HANDSHAKE_TIMEOUT)
    }

    /// Like [`Client::new`], waiting at most `timeout` for the handshake.
    pub fn with_handshake_timeout<T: Transport>(
        transport: T,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        let client = Self::without_handshake(transport)?;
        let mut hello = client.start(RequestBody::Hello {
            protocol: PROTOCOL_VERSION,
        })?;
        let answer = match hello.recv_timeout(timeout)? {
            Some(ResponseBody::Error(e)) => return Err(ClientError::Agent(e)),
            Some(body) => body,
            None => return Err(ClientError::Disconnected),
        };
        match answer {
            ResponseBody::Hello { protocol, .. } if protocol == PROTOCOL_VERSION => Ok(client),
            ResponseBody::Hello { protocol, .. } => Err(ClientError::Version(protocol)),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Takes over a connected stream without sending `Hello` (for testing the agent).
    pub fn without_handshake<T: Transport>(transport: T) -> Result<Self, ClientError> {
        let read_half = transport
            .try_clone_transport()
            .map_err(ClientError::Connect)?;
        let closer = transport
            .try_clone_transport()
            .map_err(ClientError::Connect)?;
        let routes: Routes = Arc::default();
        let (unsolicited_tx, unsolicited_rx) = mpsc::channel();
        let reader_routes = Arc::clone(&routes);
        let reader = std::thread::Builder::new()
            .name("agent-client-reader".into())
            .spawn(move || read_loop(read_half, reader_routes, unsolicited_tx))
            .map_err(ClientError::Connect)?;
        Ok(Self {
            writer: Mutex::new(Box::new(transport)),
            routes,
            unsolicited: Mutex::new(unsolicited_rx),
            next_id: AtomicU64::new(1),
            shutdown: {
                let closer = Mutex::new(closer);
                Box::new(move || {
                    let _ = lock(&closer).shutdown_transport();
                })
            },
            reader: Some(reader),
        })
    }

    /// A fresh request id.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends a request under a new id and returns its answers.
    pub fn start(&self, body: RequestBody) -> Result<Call, ClientError> {
        let id = self.next_id();
        self.start_with_id(id, body)
    }

    /// Sends a request under a given id and returns its answers.
    pub fn start_with_id(&self, id: u64, body: RequestBody) -> Result<Call, ClientError> {
        let (tx, rx) = mpsc::channel();
        lock(&self.routes).insert(id, tx);
        if let Err(e) = self.send(id, body) {
            lock(&self.routes).remove(&id);
            return Err(e);
        }
        Ok(Call {
            id,
            rx,
            done: false,
        })
    }

    /// Sends a request whose answers are collected elsewhere (a `WriteChunk` of a write
    /// already started).
    pub fn send(&self, id: u64, body: RequestBody) -> Result<(), ClientError> {
        let mut w = lock(&self.writer);
        frame::write_frame(&mut *w, &Request { id, body }).map_err(ClientError::Send)
    }

    /// Sends raw bytes as they are (for testing how the agent treats bad input).
    pub fn send_raw(&self, bytes: &[u8]) -> Result<(), ClientError> {
        let mut w = lock(&self.writer);
        w.write_all(bytes)
            .and_then(|_| w.flush())
            .map_err(|e| ClientError::Send(FrameError::Io(e)))
    }

    /// Waits for a response whose id is no pending request (0 for unreadable requests).
    pub fn next_unsolicited(&self, timeout: Duration) -> Result<Response, ClientError> {
        lock(&self.unsolicited)
            .recv_timeout(timeout)
            .map_err(|e| match e {
                RecvTimeoutError::Timeout => ClientError::Timeout,
                RecvTimeoutError::Disconnected => ClientError::Disconnected,
            })
    }

    /// Sends a request and returns its final answer.
    pub fn call(&self, body: RequestBody) -> Result<ResponseBody, ClientError> {
        self.start(body)?.finish()
    }

    /// Sends a request that is answered by `Done`.
    fn call_done(&self, body: RequestBody) -> Result<(), ClientError> {
        match self.call(body)? {
            ResponseBody::Done => Ok(()),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Runs a process to its end and collects its output.
    pub fn exec(&self, req: ExecRequest) -> Result<ExecOutput, ClientError> {
        self.exec_to_end(RequestBody::Exec(req))
    }

    /// Runs a process to its end in the root `root` (a directory of the sandbox; see
    /// [`RequestBody::ExecInRoot`]) and collects its output.
    pub fn exec_in_root(&self, root: &str, req: ExecRequest) -> Result<ExecOutput, ClientError> {
        self.exec_to_end(RequestBody::ExecInRoot {
            root: root.to_string(),
            keep_stdin: false,
            exec: req,
        })
    }

    fn exec_to_end(&self, body: RequestBody) -> Result<ExecOutput, ClientError> {
        let mut call = self.start(body)?;
        let mut out = ExecOutput {
            stdout: Vec::new(),
            stderr: Vec::new(),
            exit: ExitInfo {
                code: None,
                signal: None,
                timed_out: false,
            },
        };
        while let Some(body) = call.recv()? {
            match body {
                ResponseBody::Started { .. } => {}
                ResponseBody::Stdout(b) => out.stdout.extend(b),
                ResponseBody::Stderr(b) => out.stderr.extend(b),
                ResponseBody::Exited(exit) => {
                    out.exit = exit;
                    return Ok(out);
                }
                ResponseBody::Error(e) => return Err(ClientError::Agent(e)),
                other => return Err(ClientError::Unexpected(format!("{other:?}"))),
            }
        }
        Err(ClientError::Disconnected)
    }

    /// Follows a running exec by its pid in the sandbox (one started on another
    /// connection, or restored with the sandbox): the call gets `Started`, the output
    /// from now on, then `Exited`; [`Client::kill`] with the call's id signals it.
    pub fn attach(&self, pid: u32) -> Result<Call, ClientError> {
        self.start(RequestBody::Attach { pid })
    }

    /// Sends a signal to a running exec's process group.
    pub fn kill(&self, exec_id: u64, signal: i32) -> Result<(), ClientError> {
        self.call_done(RequestBody::Kill { exec_id, signal })
    }

    /// Writes to the standard input of an exec started with
    /// [`RequestBody::ExecWithStdin`] on this connection.
    pub fn write_stdin(&self, exec_id: u64, data: Vec<u8>) -> Result<(), ClientError> {
        self.call_done(RequestBody::StdinWrite { exec_id, data })
    }

    /// Closes that standard input: the process reads end-of-file.
    pub fn close_stdin(&self, exec_id: u64) -> Result<(), ClientError> {
        self.call_done(RequestBody::StdinClose { exec_id })
    }

    /// Sets the size of the terminal of an exec started with
    /// [`RequestBody::ExecInTerminal`] (or followed) on this connection.
    pub fn resize_terminal(&self, exec_id: u64, size: TerminalSize) -> Result<(), ClientError> {
        self.call_done(RequestBody::ResizeTerminal { exec_id, size })
    }

    /// Waits for a background exec to end.
    pub fn wait(&self, exec_id: u64) -> Result<ExitInfo, ClientError> {
        match self.call(RequestBody::Wait { exec_id })? {
            ResponseBody::Exited(e) => Ok(e),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Sets and unsets sandbox-wide environment variables.
    pub fn set_env(
        &self,
        set: Vec<(String, String)>,
        unset: Vec<String>,
    ) -> Result<(), ClientError> {
        self.call_done(RequestBody::SetEnv { set, unset })
    }

    /// Has the agent mix `entropy` into the kernel's random pool and reseed its CRNG
    /// (after a VM was restored as a clone).
    pub fn reseed(&self, entropy: Vec<u8>) -> Result<(), ClientError> {
        self.call_done(RequestBody::Reseed { entropy })
    }

    /// Streams a file from the agent into `out`; returns its size.
    pub fn read_file(&self, path: &str, out: &mut dyn Write) -> Result<u64, ClientError> {
        let mut call = self.start(RequestBody::ReadFile {
            path: path.into(),
            offset: 0,
            len: None,
        })?;
        while let Some(body) = call.recv()? {
            match body {
                ResponseBody::FileChunk(b) => out.write_all(&b).map_err(ClientError::LocalIo)?,
                ResponseBody::FileEnd { size } => return Ok(size),
                ResponseBody::Error(e) => return Err(ClientError::Agent(e)),
                other => return Err(ClientError::Unexpected(format!("{other:?}"))),
            }
        }
        Err(ClientError::Disconnected)
    }

    /// Streams `data` into a file on the agent, one chunk in memory at a time; returns
    /// the size written.
    pub fn write_file(&self, path: &str, data: &mut dyn Read) -> Result<u64, ClientError> {
        let call = self.start(RequestBody::WriteStart {
            path: path.into(),
            mode: None,
            append: false,
            create_parents: true,
        })?;
        let mut buf = vec![0u8; WRITE_CHUNK];
        loop {
            let n = read_full(data, &mut buf).map_err(ClientError::LocalIo)?;
            if n == 0 {
                break;
            }
            self.send(
                call.id,
                RequestBody::WriteChunk {
                    data: buf[..n].to_vec(),
                },
            )?;
        }
        self.send(call.id, RequestBody::WriteEnd { sync: false })?;
        match call.finish()? {
            ResponseBody::Written { size } => Ok(size),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Lists a directory to `depth` levels.
    pub fn list_dir(&self, path: &str, depth: u32) -> Result<Vec<FileInfo>, ClientError> {
        let mut call = self.start(RequestBody::ListDir {
            path: path.into(),
            depth,
        })?;
        let mut entries = Vec::new();
        while let Some(body) = call.recv()? {
            match body {
                ResponseBody::DirEntries(batch) => entries.extend(batch),
                ResponseBody::ListEnd { .. } => return Ok(entries),
                ResponseBody::Error(e) => return Err(ClientError::Agent(e)),
                other => return Err(ClientError::Unexpected(format!("{other:?}"))),
            }
        }
        Err(ClientError::Disconnected)
    }

    /// Metadata of a path.
    pub fn stat(&self, path: &str) -> Result<FileInfo, ClientError> {
        match self.call(RequestBody::Stat { path: path.into() })? {
            ResponseBody::Stat(info) => Ok(info),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Whether a path exists.
    pub fn exists(&self, path: &str) -> Result<bool, ClientError> {
        match self.call(RequestBody::Exists { path: path.into() })? {
            ResponseBody::Exists(b) => Ok(b),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Creates a directory (with its parents when `parents`).
    pub fn make_dir(&self, path: &str, parents: bool) -> Result<(), ClientError> {
        self.call_done(RequestBody::MakeDir {
            path: path.into(),
            parents,
        })
    }

    /// Unpacks the tar archive at `archive` in the guest into the new container root
    /// `root` (see [`crate::container_root::install`]).
    pub fn install_root(&self, archive: &str, root: &str) -> Result<(), ClientError> {
        self.call_done(RequestBody::InstallRoot {
            archive: archive.into(),
            root: root.into(),
        })
    }

    /// Takes away a root [`Client::install_root`] made.
    pub fn remove_root(&self, root: &str) -> Result<(), ClientError> {
        self.call_done(RequestBody::RemoveRoot { root: root.into() })
    }

    /// Gives a VM's NIC the MAC, MTU, address and gateway of the network it was
    /// bridged into (see [`crate::vm_init::configure_nic`]).
    pub fn configure_nic(&self, settings: crate::protocol::NicSettings) -> Result<(), ClientError> {
        self.call_done(RequestBody::ConfigureNic(settings))
    }

    /// Removes a path.
    pub fn remove(&self, path: &str, recursive: bool) -> Result<(), ClientError> {
        self.call_done(RequestBody::Remove {
            path: path.into(),
            recursive,
        })
    }

    /// Starts a named interpreter context.
    pub fn create_context(
        &self,
        name: &str,
        language: Language,
        cwd: Option<&str>,
    ) -> Result<(), ClientError> {
        self.call_done(RequestBody::CreateContext {
            name: name.into(),
            language,
            cwd: cwd.map(Into::into),
        })
    }

    /// Runs a cell in a context.
    pub fn run_code(
        &self,
        context: &str,
        code: &str,
        timeout: Option<Duration>,
    ) -> Result<CodeResult, ClientError> {
        match self.call(RequestBody::RunCode {
            context: context.into(),
            code: code.into(),
            timeout_ms: timeout.map(|t| t.as_millis() as u64),
        })? {
            ResponseBody::CodeResult(r) => Ok(r),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Stops a context.
    pub fn delete_context(&self, name: &str) -> Result<(), ClientError> {
        self.call_done(RequestBody::DeleteContext { name: name.into() })
    }

    /// The contexts alive.
    pub fn list_contexts(&self) -> Result<Vec<ContextInfo>, ClientError> {
        match self.call(RequestBody::ListContexts)? {
            ResponseBody::Contexts(v) => Ok(v),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Renames a path.
    pub fn rename(&self, from: &str, to: &str) -> Result<(), ClientError> {
        self.call_done(RequestBody::Rename {
            from: from.into(),
            to: to.into(),
        })
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        (self.shutdown)();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Fills `buf` as far as the source allows; returns the bytes read (0 at the end).
fn read_full(src: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match src.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn read_loop<T: Read>(stream: T, routes: Routes, unsolicited: Sender<Response>) {
    let mut reader = BufReader::with_capacity(256 * 1024, stream);
    let mut buf = Vec::new();
    while let Ok(true) = frame::read_frame(&mut reader, &mut buf) {
        let Ok(resp) = postcard::from_bytes::<Response>(&buf) else {
            tracing::warn!("undecodable response from the agent");
            continue;
        };
        let final_ = resp.body.is_final();
        let mut routes = lock(&routes);
        match routes.get(&resp.id) {
            Some(tx) => {
                let _ = tx.send(resp.body);
                if final_ {
                    routes.remove(&resp.id);
                }
            }
            None => {
                let _ = unsolicited.send(resp);
            }
        }
    }
    // Dropping the senders wakes every waiting call with `Disconnected`.
    lock(&routes).clear();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn a_silent_agent_makes_the_handshake_time_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("silent.sock");
        // Accepts connections (as a frozen agent's backlog does) and never answers.
        let listener = UnixListener::bind(&path).unwrap();
        let err = Client::connect_unix_timeout(&path, Duration::from_millis(200))
            .err()
            .unwrap();
        assert!(matches!(err, ClientError::Timeout), "{err}");
        drop(listener);
    }
}
