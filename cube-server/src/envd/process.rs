//! envd's `process.Process` service on Cube's agent: each command is an agent exec on
//! the sandbox's shared connection, pumped by a thread into the streams that watch it
//! (the `Start` call's, and any `Connect` calls'). Commands outlive the streams: a
//! client that disconnects can connect again by pid, list, signal and feed them.
//!
//! A command started with a PTY runs on a terminal of its own in the sandbox (the
//! agent's `ExecInTerminal`): its output comes as envd's `pty` data, its input is
//! `pty` input, and `Update` resizes the terminal.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cube_agent::client::{Call, Client, ClientError};
use cube_agent::protocol::{
    ErrorCode, ExecRequest, ExitInfo, RequestBody, ResponseBody, TerminalSize,
};
use futures_util::Stream;
use tokio::sync::{mpsc, oneshot};

use super::connect::{Code, RpcError};
use super::proto::{
    DataEvent, Empty, EndEvent, Event, EventResponse, Output, ProcessConfig, ProcessEvent,
    ProcessInfo, Selector, StartEvent, StartRequest,
};
use crate::lock::lock;

/// What a command's watchers receive.
type Watch = Result<Event, RpcError>;

/// One running command.
pub struct Proc {
    /// Its pid inside the sandbox.
    pub pid: u32,
    exec_id: u64,
    client: Arc<Client>,
    /// Whether it runs on a terminal (started with a PTY).
    pub pty: bool,
    config: ProcessConfig,
    tag: Option<String>,
    watchers: Mutex<Vec<mpsc::UnboundedSender<Watch>>>,
}

impl Proc {
    fn broadcast(&self, item: &Watch) {
        lock(&self.watchers).retain(|w| w.send(item.clone()).is_ok());
    }

    /// A new stream of this command's events from now on.
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<Watch> {
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.watchers).push(tx);
        rx
    }
}

/// The commands of one sandbox, by pid.
#[derive(Default)]
pub struct ProcessTable {
    procs: Mutex<HashMap<u32, Arc<Proc>>>,
}

impl ProcessTable {
    /// The command a selector names.
    pub fn find(&self, selector: Option<&Selector>) -> Result<Arc<Proc>, RpcError> {
        let procs = lock(&self.procs);
        let found = match selector {
            Some(Selector::Pid(pid)) => procs.get(pid).cloned(),
            Some(Selector::Tag(tag)) => procs
                .values()
                .find(|p| p.tag.as_deref() == Some(tag.as_str()))
                .cloned(),
            None => {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    "No process selector (pid or tag)",
                ))
            }
        };
        found.ok_or_else(|| RpcError::new(Code::NotFound, "Process not found"))
    }

    /// What `List` answers.
    pub fn list(&self) -> Vec<ProcessInfo> {
        let mut v: Vec<ProcessInfo> = lock(&self.procs)
            .values()
            .map(|p| ProcessInfo {
                config: Some(p.config.clone()),
                pid: p.pid,
                tag: p.tag.clone(),
            })
            .collect();
        v.sort_by_key(|p| p.pid);
        v
    }

    /// Ends every watcher's stream with `why` and forgets the commands (their agent
    /// connection is gone).
    pub fn end_all(&self, why: &str) {
        let procs: Vec<Arc<Proc>> = lock(&self.procs).drain().map(|(_, p)| p).collect();
        for p in procs {
            p.broadcast(&Err(RpcError::new(Code::Unavailable, why)));
        }
    }

    /// Forgets `proc`, unless its pid already names a newer command.
    fn remove(&self, proc: &Arc<Proc>) {
        let mut procs = lock(&self.procs);
        if procs.get(&proc.pid).is_some_and(|p| Arc::ptr_eq(p, proc)) {
            procs.remove(&proc.pid);
        }
    }
}

/// Go's names for the signals a command may end by (envd reports `signal: killed`).
fn signal_name(sig: i32) -> String {
    match sig {
        1 => "hangup".into(),
        2 => "interrupt".into(),
        3 => "quit".into(),
        6 => "aborted".into(),
        9 => "killed".into(),
        11 => "segmentation fault".into(),
        13 => "broken pipe".into(),
        14 => "alarm clock".into(),
        15 => "terminated".into(),
        n => format!("signal {n}"),
    }
}

/// envd's end event for how an exec ended.
pub fn end_event(exit: &ExitInfo) -> EndEvent {
    match (exit.code, exit.signal) {
        (Some(code), _) => EndEvent {
            exit_code: code,
            exited: true,
            status: format!("exit status {code}"),
            error: (code != 0).then(|| format!("exit status {code}")),
        },
        (None, Some(sig)) => {
            let status = format!("signal: {}", signal_name(sig));
            EndEvent {
                exit_code: -1,
                exited: false,
                status: status.clone(),
                error: Some(status),
            }
        }
        (None, None) => EndEvent {
            exit_code: -1,
            exited: false,
            status: "unknown".into(),
            error: Some("the process's end could not be read".into()),
        },
    }
}

fn agent_rpc_error(e: &ClientError) -> RpcError {
    match e {
        ClientError::Agent(reply) => {
            let code = match reply.code {
                ErrorCode::NotFound | ErrorCode::NoSuchExec => Code::NotFound,
                ErrorCode::InvalidArgument
                | ErrorCode::NotADirectory
                | ErrorCode::IsADirectory
                | ErrorCode::Malformed => Code::InvalidArgument,
                ErrorCode::PermissionDenied => Code::PermissionDenied,
                ErrorCode::AlreadyExists => Code::AlreadyExists,
                ErrorCode::NotRunning => Code::FailedPrecondition,
                ErrorCode::Busy | ErrorCode::TooLarge => Code::ResourceExhausted,
                _ => Code::Internal,
            };
            RpcError::new(code, reply.message.clone())
        }
        ClientError::Disconnected | ClientError::Connect(_) | ClientError::Timeout => {
            RpcError::new(Code::Unavailable, crate::error::error_chain(e))
        }
        other => RpcError::new(Code::Internal, crate::error::error_chain(other)),
    }
}

/// The same mapping for callers outside this module.
pub fn rpc_from_agent(e: &ClientError) -> RpcError {
    agent_rpc_error(e)
}

/// The same mapping for API errors (a sandbox that cannot be reached, paused, ...).
pub fn rpc_from_api(e: &crate::error::ApiError) -> RpcError {
    let code = match e.status.as_u16() {
        400 => Code::InvalidArgument,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::NotFound,
        409 => Code::FailedPrecondition,
        429 => Code::ResourceExhausted,
        501 => Code::Unimplemented,
        502 | 503 => Code::Unavailable,
        _ => Code::Internal,
    };
    RpcError::new(code, e.message.clone())
}

/// Starts a command on `client` and registers it in `table`; returns its pid and the
/// stream of its events (for the `Start` call).
pub async fn start(
    table: &Arc<ProcessTable>,
    client: Arc<Client>,
    req: StartRequest,
) -> Result<(u32, mpsc::UnboundedReceiver<Watch>), RpcError> {
    let terminal = req
        .pty
        .as_ref()
        .map(|pty| terminal_size(pty.size.as_ref()))
        .transpose()?;
    let config = req
        .process
        .ok_or_else(|| RpcError::new(Code::InvalidArgument, "No process config"))?;
    if config.cmd.is_empty() {
        return Err(RpcError::new(Code::InvalidArgument, "Empty command"));
    }
    let mut argv = vec![config.cmd.clone()];
    argv.extend(config.args.iter().cloned());
    let mut env: Vec<(String, String)> = config
        .envs
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    env.sort();
    let exec = ExecRequest {
        argv,
        env,
        cwd: Some(
            config
                .cwd
                .clone()
                .filter(|c| !c.is_empty())
                .unwrap_or_else(|| super::filesystem::HOME.to_string()),
        ),
        ..ExecRequest::default()
    };
    // envd's default keeps stdin open (older SDKs rely on it); new SDKs say false.
    // A terminal always takes input.
    let body = match terminal {
        Some(size) => RequestBody::ExecInTerminal {
            root: None,
            size,
            exec,
        },
        None if req.stdin.unwrap_or(true) => RequestBody::ExecWithStdin(exec),
        None => RequestBody::Exec(exec),
    };
    let pty = terminal.is_some();
    let (started_tx, started_rx) = oneshot::channel();
    let (first_tx, first_rx) = mpsc::unbounded_channel();
    let table = Arc::clone(table);
    let tag = req.tag.clone();
    std::thread::Builder::new()
        .name("envd-process".into())
        .spawn(move || {
            let call = match client.start(body) {
                Ok(call) => call,
                Err(e) => {
                    let _ = started_tx.send(Err(agent_rpc_error(&e)));
                    return;
                }
            };
            let command = Command {
                client,
                pty,
                config,
                tag,
            };
            pump(call, command, table, started_tx, first_tx);
        })
        .map_err(|e| RpcError::new(Code::ResourceExhausted, format!("No thread: {e}")))?;
    let pid = started_rx
        .await
        .map_err(|_| RpcError::new(Code::Internal, "The command's pump ended early"))??;
    Ok((pid, first_rx))
}

/// The size a `PTY` message asks for; envd's terminals need one.
fn terminal_size(size: Option<&super::proto::PtySize>) -> Result<TerminalSize, RpcError> {
    let size = size.ok_or_else(|| RpcError::new(Code::InvalidArgument, "PTY without a size"))?;
    let dimension = |n: u32, what: &str| {
        u16::try_from(n).ok().filter(|n| *n > 0).ok_or_else(|| {
            RpcError::new(
                Code::InvalidArgument,
                format!("PTY {what} must be 1 to 65535, not {n}"),
            )
        })
    };
    Ok(TerminalSize {
        rows: dimension(size.rows, "rows")?,
        cols: dimension(size.cols, "cols")?,
    })
}

/// A command as started, before the agent gave its pid.
struct Command {
    client: Arc<Client>,
    pty: bool,
    config: ProcessConfig,
    tag: Option<String>,
}

/// Moves one exec's events to its watchers until it ends.
fn pump(
    mut call: Call,
    command: Command,
    table: Arc<ProcessTable>,
    started: oneshot::Sender<Result<u32, RpcError>>,
    first: mpsc::UnboundedSender<Watch>,
) {
    let pty = command.pty;
    let proc = match call.recv() {
        Ok(Some(ResponseBody::Started { pid })) => {
            let proc = Arc::new(Proc {
                pid,
                exec_id: call.id,
                client: command.client,
                pty,
                config: command.config,
                tag: command.tag,
                watchers: Mutex::new(vec![first]),
            });
            lock(&table.procs).insert(pid, Arc::clone(&proc));
            let _ = started.send(Ok(pid));
            proc
        }
        Ok(Some(ResponseBody::Error(e))) => {
            let _ = started.send(Err(agent_rpc_error(&ClientError::Agent(e))));
            return;
        }
        Ok(other) => {
            let _ = started.send(Err(RpcError::new(
                Code::Internal,
                format!("Unexpected first answer from the agent: {other:?}"),
            )));
            return;
        }
        Err(e) => {
            let _ = started.send(Err(agent_rpc_error(&e)));
            return;
        }
    };
    loop {
        let item = match call.recv() {
            // A terminal's output is envd's `pty` data.
            Ok(Some(ResponseBody::Stdout(b))) if pty => Ok(Event::Data(DataEvent {
                output: Some(Output::Pty(b)),
            })),
            Ok(Some(ResponseBody::Stdout(b))) => Ok(Event::Data(DataEvent {
                output: Some(Output::Stdout(b)),
            })),
            Ok(Some(ResponseBody::Stderr(b))) => Ok(Event::Data(DataEvent {
                output: Some(Output::Stderr(b)),
            })),
            Ok(Some(ResponseBody::Exited(exit))) => Ok(Event::End(end_event(&exit))),
            Ok(Some(ResponseBody::Error(e))) => Err(agent_rpc_error(&ClientError::Agent(e))),
            Ok(Some(_)) => continue,
            Ok(None) => Err(RpcError::new(
                Code::Unavailable,
                "The command's stream ended",
            )),
            Err(e) => Err(agent_rpc_error(&e)),
        };
        let last = !matches!(item, Ok(Event::Data(_)));
        if last {
            // Forgotten before its watchers hear the end: a client that lists right
            // after its wait returned must not see the command (the E2B SDK does).
            table.remove(&proc);
        }
        proc.broadcast(&item);
        if last {
            break;
        }
    }
}

/// Runs a blocking agent call for a command.
async fn on_agent<T, F>(proc: Arc<Proc>, f: F) -> Result<T, RpcError>
where
    T: Send + 'static,
    F: FnOnce(&Client, u64) -> Result<T, ClientError> + Send + 'static,
{
    tokio::task::spawn_blocking(move || f(&proc.client, proc.exec_id))
        .await
        .map_err(|e| RpcError::new(Code::Internal, format!("A worker failed: {e}")))?
        .map_err(|e| agent_rpc_error(&e))
}

/// Sends a signal (envd's SIGTERM or SIGKILL) to a command's process group.
pub async fn signal(proc: Arc<Proc>, signal: i32) -> Result<(), RpcError> {
    let sig = match signal {
        9 => 9,
        15 => 15,
        other => {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!("Unsupported signal {other} (SIGTERM, SIGKILL)"),
            ))
        }
    };
    on_agent(proc, move |c, id| c.kill(id, sig))
        .await
        .map_err(|e| match e.code {
            // It ended between the lookup and the signal.
            Code::FailedPrecondition => RpcError::new(Code::NotFound, "Process not found"),
            _ => e,
        })
}

/// Writes to a command's standard input, or types into its terminal (`pty` says
/// which the client meant: each goes to its own kind of command, as in envd).
pub async fn write_input(proc: Arc<Proc>, data: Vec<u8>, pty: bool) -> Result<(), RpcError> {
    match (pty, proc.pty) {
        (true, false) => {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                "The process has no terminal: send its input as stdin",
            ))
        }
        (false, true) => {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                "The process runs on a terminal: send its input as pty",
            ))
        }
        _ => {}
    }
    on_agent(proc, move |c, id| c.write_stdin(id, data))
        .await
        .map_err(stdin_error)
}

/// Sets the size of a command's terminal (envd's `Update`).
pub async fn resize(proc: Arc<Proc>, size: Option<&super::proto::Pty>) -> Result<(), RpcError> {
    if !proc.pty {
        return Err(RpcError::new(
            Code::FailedPrecondition,
            "The process has no terminal to resize",
        ));
    }
    let pty = size.ok_or_else(|| RpcError::new(Code::InvalidArgument, "Update without a PTY"))?;
    let size = terminal_size(pty.size.as_ref())?;
    on_agent(proc, move |c, id| c.resize_terminal(id, size))
        .await
        .map_err(|e| match e.code {
            // It ended between the lookup and the resize.
            Code::FailedPrecondition => RpcError::new(Code::NotFound, "Process not found"),
            _ => e,
        })
}

/// Closes a command's standard input.
pub async fn close_stdin(proc: Arc<Proc>) -> Result<(), RpcError> {
    on_agent(proc, move |c, id| c.close_stdin(id))
        .await
        .map_err(stdin_error)
}

fn stdin_error(e: RpcError) -> RpcError {
    match e.code {
        Code::FailedPrecondition => RpcError::new(
            Code::FailedPrecondition,
            "The process has no open standard input (start it with stdin enabled)",
        ),
        _ => e,
    }
}

/// A command's event stream as `StartResponse`/`ConnectResponse` messages: the start
/// event, then output and the end, with keepalives every `keepalive` while quiet and
/// a `deadline_exceeded` error at `deadline` (the command keeps running).
pub fn event_stream(
    pid: u32,
    rx: mpsc::UnboundedReceiver<Watch>,
    keepalive: Option<Duration>,
    deadline: Option<Duration>,
) -> impl Stream<Item = Result<EventResponse, RpcError>> + Send + 'static {
    struct St {
        rx: mpsc::UnboundedReceiver<Watch>,
        started: bool,
        done: bool,
        deadline: Option<tokio::time::Instant>,
        keepalive: Option<Duration>,
    }
    let wrap = |event: Event| EventResponse {
        event: Some(ProcessEvent { event: Some(event) }),
    };
    let st = St {
        rx,
        started: false,
        done: false,
        deadline: deadline.map(|d| tokio::time::Instant::now() + d),
        keepalive,
    };
    futures_util::stream::unfold(st, move |mut st| async move {
        if st.done {
            return None;
        }
        if !st.started {
            st.started = true;
            return Some((Ok(wrap(Event::Start(StartEvent { pid }))), st));
        }
        let far = tokio::time::Instant::now() + Duration::from_secs(365 * 24 * 3600);
        let deadline = st.deadline.unwrap_or(far);
        let tick = st
            .keepalive
            .map(|k| tokio::time::Instant::now() + k)
            .unwrap_or(far);
        tokio::select! {
            item = st.rx.recv() => match item {
                Some(Ok(event)) => {
                    st.done = matches!(event, Event::End(_));
                    Some((Ok(wrap(event)), st))
                }
                Some(Err(e)) => {
                    st.done = true;
                    Some((Err(e), st))
                }
                None => {
                    st.done = true;
                    Some((Err(RpcError::new(Code::Unavailable, "The command's stream ended")), st))
                }
            },
            _ = tokio::time::sleep_until(deadline) => {
                st.done = true;
                Some((Err(RpcError::new(Code::DeadlineExceeded, "Deadline exceeded (the command goes on)")), st))
            }
            _ = tokio::time::sleep_until(tick) => {
                Some((Ok(wrap(Event::Keepalive(Empty {}))), st))
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_read_like_envd() {
        let e = end_event(&ExitInfo {
            code: Some(0),
            signal: None,
            timed_out: false,
        });
        assert_eq!((e.exit_code, e.exited, e.error), (0, true, None));
        let e = end_event(&ExitInfo {
            code: Some(3),
            signal: None,
            timed_out: false,
        });
        assert_eq!(e.error.as_deref(), Some("exit status 3"));
        let e = end_event(&ExitInfo {
            code: None,
            signal: Some(9),
            timed_out: false,
        });
        assert_eq!((e.exit_code, e.status.as_str()), (-1, "signal: killed"));
    }
}
