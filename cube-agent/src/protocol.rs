//! The host<->agent protocol: the messages carried in [`crate::frame`] frames.
//!
//! Every [`Request`] carries a `u64` id chosen by the host; every [`Response`] carries the
//! id of the request it answers, so many requests run at once over one stream. A request
//! is answered by zero or more events (see [`ResponseBody::is_final`]) followed by exactly
//! one final response. A streamed file write uses one id for its `WriteStart`, its
//! `WriteChunk`s and its `WriteEnd`, and only `WriteEnd` (or a failure) is answered.
//!
//! The first request on a stream must be [`RequestBody::Hello`]. New variants are only
//! ever appended, so an older agent answers a newer request with
//! [`ErrorCode::UnknownMessage`] instead of misreading it.

use serde::{Deserialize, Serialize};

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// The agent's own version.
pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// How many [`RequestBody`] variants this version knows; a larger variant index is an
/// unknown message rather than a malformed one.
pub const REQUEST_KINDS: u32 = 34;

/// One request from the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Chosen by the host; echoed in every response to this request.
    pub id: u64,
    /// What is asked.
    pub body: RequestBody,
}

/// What a request asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RequestBody {
    /// Handshake; must come first. Answered by [`ResponseBody::Hello`].
    Hello {
        /// The protocol version the host speaks.
        protocol: u32,
    },
    /// Liveness probe. Answered by [`ResponseBody::Healthy`].
    Health,
    /// Answered by [`ResponseBody::Version`].
    Version,
    /// Changes the sandbox-wide environment every later exec starts from.
    SetEnv {
        /// Variables to set (or replace).
        set: Vec<(String, String)>,
        /// Variables to remove.
        unset: Vec<String>,
    },
    /// Runs a process; its id is the request id, on this connection (another
    /// connection's exec of the same id is a different one, and `Kill`/`Wait` reach only
    /// the execs of the connection they come on). Answered by `Started`, then `Stdout`
    /// and `Stderr` chunks as they are produced, then `Exited`.
    Exec(ExecRequest),
    /// Sends a signal to the process group of a running exec. Answered by `Done`.
    Kill {
        /// The id of the `Exec` request on this connection.
        exec_id: u64,
        /// The signal number, e.g. 9 or 15.
        signal: i32,
    },
    /// Waits for a background exec to end. Answered by `Exited`.
    Wait {
        /// The id of the `Exec` request on this connection.
        exec_id: u64,
    },
    /// Streams a file: `FileChunk`s, then `FileEnd`.
    ReadFile {
        /// The file to read.
        path: String,
        /// Where to start, in bytes.
        offset: u64,
        /// How many bytes at most; all to the end when absent.
        len: Option<u64>,
    },
    /// Opens a file for a streamed write; no answer unless it fails.
    WriteStart {
        /// The file to write.
        path: String,
        /// Permission bits for a newly created file (default 0o644).
        mode: Option<u32>,
        /// Appends instead of truncating.
        append: bool,
        /// Creates missing parent directories.
        create_parents: bool,
    },
    /// Appends bytes to the write opened under the same id; no answer unless it fails.
    WriteChunk {
        /// The bytes.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// Finishes the write opened under the same id. Answered by `Written`.
    WriteEnd {
        /// Flushes the file to disk before answering.
        sync: bool,
    },
    /// Lists a directory: `DirEntries` batches, then `ListEnd`.
    ListDir {
        /// The directory.
        path: String,
        /// 1 lists the directory's own entries, 2 also their children, and so on.
        depth: u32,
    },
    /// Answered by `Stat`; symbolic links are not followed.
    Stat {
        /// The path.
        path: String,
    },
    /// Creates a directory. Answered by `Done`.
    MakeDir {
        /// The directory.
        path: String,
        /// Creates missing parents too and accepts an existing directory (`mkdir -p`).
        parents: bool,
    },
    /// Removes a file, link or directory. Answered by `Done`.
    Remove {
        /// The path.
        path: String,
        /// Removes a non-empty directory with its contents.
        recursive: bool,
    },
    /// Renames (moves) a path. Answered by `Done`.
    Rename {
        /// The current path.
        from: String,
        /// The new path.
        to: String,
    },
    /// Answered by `Exists`; a dangling symbolic link exists.
    Exists {
        /// The path.
        path: String,
    },
    /// Starts a named, stateful interpreter context. Answered by `Done`.
    CreateContext {
        /// The context's name, unique in the sandbox.
        name: String,
        /// Its language.
        language: Language,
        /// Its working directory; the agent's own when absent.
        cwd: Option<String>,
    },
    /// Runs a cell in a context; variables persist between cells. Answered by
    /// `CodeResult`.
    RunCode {
        /// The context's name.
        context: String,
        /// The cell's source.
        code: String,
        /// Interrupts the cell (the context survives) after this many milliseconds.
        timeout_ms: Option<u64>,
    },
    /// Stops a context and forgets its state. Answered by `Done`.
    DeleteContext {
        /// The context's name.
        name: String,
    },
    /// Answered by `Contexts`.
    ListContexts,
    /// Mix `entropy` (fresh bytes from the host) into the kernel's random pool and
    /// reseed its CRNG now: sent by the host after it restored a VM as a clone, so
    /// clones of one snapshot never share random state. Answered by
    /// [`ResponseBody::Done`]; refused where the agent may not (a jail, which shares
    /// the host's kernel and needs no reseed).
    Reseed {
        /// 16 to 512 bytes.
        #[serde(with = "serde_bytes")]
        entropy: Vec<u8>,
    },
    /// Like [`RequestBody::Exec`], but the process's standard input stays open after
    /// `stdin` was written: [`RequestBody::StdinWrite`] feeds it and
    /// [`RequestBody::StdinClose`] ends it (an interactive command, E2B's `stdin=True`).
    ExecWithStdin(ExecRequest),
    /// Writes bytes to the standard input of a running [`RequestBody::ExecWithStdin`]
    /// exec of this connection. Answered by `Done` once written.
    StdinWrite {
        /// The id of the exec on this connection.
        exec_id: u64,
        /// The bytes.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// Closes that standard input (the process reads end-of-file). Answered by `Done`.
    StdinClose {
        /// The id of the exec on this connection.
        exec_id: u64,
    },
    /// Opens a TCP connection to `port` on the sandbox's loopback (what a server in
    /// the sandbox listens on), carried over this stream: answered by `Started` (pid 0)
    /// once connected, then `Stdout` events with the bytes the sandbox side sends, then
    /// `Done` when it closes (or an error). The host sends [`RequestBody::TcpSend`]
    /// under the same id; it is answered only when it fails.
    TcpConnect {
        /// The port inside the sandbox.
        port: u16,
    },
    /// Bytes for the connection opened under the same id; an empty chunk shuts down
    /// the writing side (the sandbox side reads end-of-file). Answered only on failure.
    TcpSend {
        /// The bytes.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// Follows a running exec started on any connection, known by its pid: one whose
    /// connection was dropped for a checkpoint, or that came back with a sandbox
    /// restored from one. Answered like [`RequestBody::Exec`] from then on: `Started`,
    /// the output it writes from now on, then `Exited`; `Kill` and `Wait` with this
    /// request's id reach it.
    Attach {
        /// The exec's pid in the sandbox (its `Started` pid).
        pid: u32,
    },
    /// [`RequestBody::Exec`] (or, with `keep_stdin`, [`RequestBody::ExecWithStdin`])
    /// with the process's root changed to `root`, a directory of the sandbox: its
    /// program, `PATH` and working directory are looked up in that tree. How a pod
    /// sandbox runs each container's processes in that container's root filesystem;
    /// refused (`PermissionDenied`) where the agent may not change roots.
    ExecInRoot {
        /// The root, an absolute path in the sandbox.
        root: String,
        /// Keep standard input open for `StdinWrite`.
        keep_stdin: bool,
        /// What to run.
        exec: ExecRequest,
    },
    /// [`RequestBody::ExecWithStdin`] on a terminal of its own: the process leads a
    /// new session whose controlling terminal is a pseudo-terminal the agent opens, of
    /// `size`; its standard input, output and error are that terminal. Its output
    /// comes as `Stdout` events (the terminal merges both streams); `StdinWrite` types
    /// into it; [`RequestBody::ResizeTerminal`] changes its size. What `kubectl exec
    /// -it`, `ctr run -t` and E2B's PTY sessions ask for.
    ExecInTerminal {
        /// A root of its own, as [`RequestBody::ExecInRoot`]'s; the agent's when absent.
        root: Option<String>,
        /// The terminal's size at start.
        size: TerminalSize,
        /// What to run (`stdin` must be empty: input goes by `StdinWrite`).
        exec: ExecRequest,
    },
    /// Changes the size of a running [`RequestBody::ExecInTerminal`] exec's terminal
    /// (its foreground processes get `SIGWINCH`). Answered by `Done`.
    ResizeTerminal {
        /// The id of the exec on this connection.
        exec_id: u64,
        /// The new size.
        size: TerminalSize,
    },
    /// Sets up a container's root in a VM pod's guest (see
    /// [`crate::container_root`]): unpacks the tar archive (gzipped or not) at
    /// `archive` (a file the host wrote in the guest; removed after) into the new
    /// directory `root`, with a `/proc` and the guest's `/dev` mounted in it, for
    /// `ExecInRoot`. Answered by `Done`; refused where the agent may not mount (a
    /// jail).
    InstallRoot {
        /// The archive, an absolute path in the guest.
        archive: String,
        /// The root to make, an absolute path in the guest.
        root: String,
    },
    /// Unmounts what `InstallRoot` mounted in `root` and removes it (`Done` where it
    /// is gone already).
    RemoveRoot {
        /// The root, as `InstallRoot` named it.
        root: String,
    },
    /// Gives the VM's NIC the identity of the network it was bridged into (a
    /// Kubernetes pod's, as its CNI plugins set it up; see
    /// [`crate::vm_init::configure_nic`]), in place of the address every Cube VM
    /// starts with. Answered by `Done`; refused where the agent is not a VM's init.
    ConfigureNic(NicSettings),
}

/// The network identity a VM's NIC takes (see [`RequestBody::ConfigureNic`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicSettings {
    /// The Ethernet address.
    pub mac: [u8; 6],
    /// The MTU.
    pub mtu: u32,
    /// The IPv4 address.
    pub address: [u8; 4],
    /// Its prefix length (0 to 32).
    pub prefix_len: u8,
    /// The default route's gateway, if any.
    pub gateway: Option<[u8; 4]>,
}

/// The size of a terminal, in characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TerminalSize {
    /// Lines.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

impl Default for TerminalSize {
    /// 24 lines of 80 columns, a terminal's size when nobody said otherwise.
    fn default() -> Self {
        TerminalSize { rows: 24, cols: 80 }
    }
}

/// The language of an interpreter context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Language {
    /// `python3`.
    Python,
    /// `bash`.
    Bash,
}

/// The outcome of one cell.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodeResult {
    /// What the cell printed to standard output (and, for Python, what its
    /// subprocesses wrote to the inherited descriptors).
    pub stdout: String,
    /// What the cell printed to standard error.
    pub stderr: String,
    /// `repr` of the value of the last expression, when there is one and it is not
    /// `None` (Python).
    pub value: Option<String>,
    /// Rich forms of the value and figures left open (`image/png`, `text/html`, ...).
    pub rich: Vec<RichOutput>,
    /// The exception the cell raised (Python).
    pub error: Option<CodeError>,
    /// The status of the cell's last command (bash).
    pub exit_status: Option<i32>,
    /// The cell was interrupted because its timeout passed.
    pub timed_out: bool,
}

/// One rich output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RichOutput {
    /// Its MIME type.
    pub mime: String,
    /// Its bytes.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

/// An exception raised by a cell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodeError {
    /// The exception's type name, e.g. `ZeroDivisionError`.
    pub name: String,
    /// Its message.
    pub value: String,
    /// The formatted traceback, from the cell's first frame.
    pub traceback: String,
}

/// A context as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextInfo {
    /// Its name.
    pub name: String,
    /// Its language.
    pub language: Language,
}

/// A process to run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// Program and arguments; the program is looked up in `PATH` when it has no `/`.
    pub argv: Vec<String>,
    /// Variables added on top of the sandbox-wide environment.
    pub env: Vec<(String, String)>,
    /// Working directory; the agent's own when absent.
    pub cwd: Option<String>,
    /// The user to run as; needs the agent to run as root unless it is the agent's own.
    pub user: Option<UserSpec>,
    /// Bytes fed to standard input, which is then closed.
    #[serde(with = "serde_bytes")]
    pub stdin: Vec<u8>,
    /// Kills the process group with SIGKILL after this many milliseconds.
    pub timeout_ms: Option<u64>,
    /// Keeps the exit status after the process ends until a `Wait` collects it.
    pub background: bool,
}

/// A numeric user and group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserSpec {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

/// One response or event from the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    /// The id of the request answered; 0 when the request's id could not be read.
    pub id: u64,
    /// The answer.
    pub body: ResponseBody,
}

/// What the agent answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResponseBody {
    /// Handshake accepted.
    Hello {
        /// The protocol version the agent speaks.
        protocol: u32,
        /// The agent's version.
        agent: String,
    },
    /// The agent is serving.
    Healthy {
        /// Milliseconds since the agent started.
        uptime_ms: u64,
        /// Processes started by exec that have not ended.
        running_execs: u32,
    },
    /// Versions.
    Version {
        /// The protocol version the agent speaks.
        protocol: u32,
        /// The agent's version.
        agent: String,
    },
    /// The request succeeded and has nothing else to say.
    Done,
    /// Event: the exec's process started.
    Started {
        /// Its pid (also its process group id), as seen inside the sandbox.
        pid: u32,
    },
    /// Event: bytes the process wrote to standard output.
    Stdout(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Event: bytes the process wrote to standard error.
    Stderr(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The process ended.
    Exited(ExitInfo),
    /// Event: the next bytes of a file being read.
    FileChunk(#[serde(with = "serde_bytes")] Vec<u8>),
    /// A file read finished.
    FileEnd {
        /// Bytes sent in all.
        size: u64,
    },
    /// A streamed write finished.
    Written {
        /// Bytes written in all.
        size: u64,
    },
    /// Event: the next entries of a listing.
    DirEntries(Vec<FileInfo>),
    /// A listing finished.
    ListEnd {
        /// Entries sent in all.
        count: u64,
    },
    /// Metadata of one path.
    Stat(FileInfo),
    /// Whether a path exists.
    Exists(bool),
    /// The request failed.
    Error(ErrorReply),
    /// The outcome of a cell.
    CodeResult(CodeResult),
    /// The contexts of the sandbox.
    Contexts(Vec<ContextInfo>),
}

impl ResponseBody {
    /// Whether this ends the answer to its request (events do not).
    pub fn is_final(&self) -> bool {
        !matches!(
            self,
            ResponseBody::Started { .. }
                | ResponseBody::Stdout(_)
                | ResponseBody::Stderr(_)
                | ResponseBody::FileChunk(_)
                | ResponseBody::DirEntries(_)
        )
    }
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitInfo {
    /// The exit code when it exited.
    pub code: Option<i32>,
    /// The signal number when a signal ended it.
    pub signal: Option<i32>,
    /// The agent killed it because its timeout passed.
    pub timed_out: bool,
}

/// The kind of a filesystem entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
    /// Anything else (device, fifo, socket).
    Other,
}

/// Metadata of one path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    /// The path, as asked or joined below the listed directory.
    pub path: String,
    /// What it is.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Owner user id.
    pub uid: u32,
    /// Owner group id.
    pub gid: u32,
    /// Last modification, nanoseconds since the Unix epoch.
    pub modified_ns: i64,
    /// Where a symbolic link points.
    pub symlink_target: Option<String>,
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// The class of failure, for programs.
    pub code: ErrorCode,
    /// What happened, for people.
    pub message: String,
}

/// Classes of failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// The frame could not be decoded as a request.
    Malformed,
    /// The frame exceeded the size limit and was skipped.
    TooLarge,
    /// The request kind is newer than this agent.
    UnknownMessage,
    /// A request came before the `Hello` handshake.
    HandshakeRequired,
    /// The host speaks a protocol version the agent does not.
    VersionMismatch,
    /// An argument was invalid.
    InvalidArgument,
    /// A path or program does not exist.
    NotFound,
    /// The operation is not permitted.
    PermissionDenied,
    /// The path already exists (or the id is already in use).
    AlreadyExists,
    /// A path component is not a directory.
    NotADirectory,
    /// A directory was given where a file is needed.
    IsADirectory,
    /// The directory is not empty.
    NotEmpty,
    /// No exec has that id.
    NoSuchExec,
    /// The exec has already ended.
    NotRunning,
    /// The agent is at a limit (threads, open writes).
    Busy,
    /// Any other i/o failure.
    Io,
    /// No interpreter context has that name.
    NoSuchContext,
    /// The interpreter died or would not stop; its context was discarded.
    ContextLost,
}

impl ErrorReply {
    /// Builds a reply.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// Classifies an i/o error by its errno.
    pub fn from_io(err: &std::io::Error, message: impl Into<String>) -> Self {
        let code = match err.raw_os_error() {
            Some(libc::ENOENT) => ErrorCode::NotFound,
            Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => {
                ErrorCode::PermissionDenied
            }
            Some(libc::EEXIST) => ErrorCode::AlreadyExists,
            Some(libc::ENOTDIR) => ErrorCode::NotADirectory,
            Some(libc::EISDIR) => ErrorCode::IsADirectory,
            Some(libc::ENOTEMPTY) => ErrorCode::NotEmpty,
            Some(libc::EINVAL) | Some(libc::ENAMETOOLONG) => ErrorCode::InvalidArgument,
            _ => match err.kind() {
                std::io::ErrorKind::NotFound => ErrorCode::NotFound,
                std::io::ErrorKind::PermissionDenied => ErrorCode::PermissionDenied,
                std::io::ErrorKind::InvalidInput => ErrorCode::InvalidArgument,
                _ => ErrorCode::Io,
            },
        };
        Self::new(code, message)
    }
}

/// Why a frame body is not a request.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The body does not decode as a request.
    #[error("malformed request")]
    Malformed {
        /// The request id, when at least that could be read.
        id: Option<u64>,
        /// What postcard reported.
        #[source]
        source: postcard::Error,
    },
    /// The body names a request kind this agent does not know.
    #[error("unknown request kind {kind}")]
    Unknown {
        /// The request id.
        id: u64,
        /// The variant index sent.
        kind: u32,
    },
}

impl DecodeError {
    /// The id to answer under (0 when none could be read).
    pub fn reply_id(&self) -> u64 {
        match self {
            DecodeError::Malformed { id, .. } => id.unwrap_or(0),
            DecodeError::Unknown { id, .. } => *id,
        }
    }

    /// The error reply to send.
    pub fn to_reply(&self) -> ErrorReply {
        match self {
            DecodeError::Malformed { source, .. } => {
                ErrorReply::new(ErrorCode::Malformed, format!("malformed request: {source}"))
            }
            DecodeError::Unknown { kind, .. } => ErrorReply::new(
                ErrorCode::UnknownMessage,
                format!(
                    "unknown request kind {kind} (protocol {PROTOCOL_VERSION} knows {REQUEST_KINDS})"
                ),
            ),
        }
    }
}

/// Decodes a request body, telling an unknown request kind from garbage and recovering
/// the id where possible so the error can be answered under it.
pub fn decode_request(body: &[u8]) -> Result<Request, DecodeError> {
    match postcard::from_bytes::<Request>(body) {
        Ok(req) => Ok(req),
        Err(source) => {
            let Ok((id, rest)) = postcard::take_from_bytes::<u64>(body) else {
                return Err(DecodeError::Malformed { id: None, source });
            };
            match postcard::take_from_bytes::<u32>(rest) {
                Ok((kind, _)) if kind >= REQUEST_KINDS => Err(DecodeError::Unknown { id, kind }),
                _ => Err(DecodeError::Malformed {
                    id: Some(id),
                    source,
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        let req = Request {
            id: 42,
            body: RequestBody::Exec(ExecRequest {
                argv: vec!["echo".into(), "hi".into()],
                env: vec![("A".into(), "B".into())],
                cwd: Some("/tmp".into()),
                user: Some(UserSpec { uid: 1, gid: 2 }),
                stdin: b"in".to_vec(),
                timeout_ms: Some(5),
                background: true,
            }),
        };
        let bytes = postcard::to_allocvec(&req).unwrap();
        assert_eq!(decode_request(&bytes).unwrap(), req);
    }

    #[test]
    fn request_kinds_matches_the_last_variant() {
        let last = Request {
            id: 1,
            body: RequestBody::ConfigureNic(NicSettings {
                mac: [2, 0, 0, 0, 0, 1],
                mtu: 1500,
                address: [10, 0, 0, 2],
                prefix_len: 24,
                gateway: Some([10, 0, 0, 1]),
            }),
        };
        let bytes = postcard::to_allocvec(&last).unwrap();
        // id 1 is one varint byte; the variant index follows.
        assert_eq!(u32::from(bytes[1]), REQUEST_KINDS - 1);
    }

    #[test]
    fn unknown_kind_keeps_the_id() {
        let mut bytes = postcard::to_allocvec(&500u64).unwrap();
        bytes.extend(postcard::to_allocvec(&(REQUEST_KINDS + 3)).unwrap());
        let err = decode_request(&bytes).unwrap_err();
        assert!(matches!(err, DecodeError::Unknown { id: 500, .. }));
        assert_eq!(err.to_reply().code, ErrorCode::UnknownMessage);
    }

    #[test]
    fn garbage_is_malformed_with_or_without_id() {
        let err = decode_request(&[0xff; 11]).unwrap_err();
        assert_eq!(err.reply_id(), 0);
        assert_eq!(err.to_reply().code, ErrorCode::Malformed);
        // A valid id and kind (Hello) with its field missing.
        let err = decode_request(&[9, 0]).unwrap_err();
        assert!(matches!(err, DecodeError::Malformed { id: Some(9), .. }));
    }

    #[test]
    fn events_are_not_final() {
        assert!(!ResponseBody::Stdout(vec![]).is_final());
        assert!(!ResponseBody::Started { pid: 1 }.is_final());
        assert!(ResponseBody::Done.is_final());
        assert!(ResponseBody::Error(ErrorReply::new(ErrorCode::Io, "x")).is_final());
    }

    #[test]
    fn io_errors_are_classified() {
        let e = std::io::Error::from_raw_os_error(libc::ENOTDIR);
        assert_eq!(ErrorReply::from_io(&e, "x").code, ErrorCode::NotADirectory);
    }
}
