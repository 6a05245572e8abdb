//! Opening a connection to a sandbox's agent without letting a dead or restarting
//! agent hang the caller: the connection is made on a helper thread while the calling
//! thread waits without the GIL, runs signal handlers (Ctrl-C) and gives up at a
//! deadline. (`Client::connect_unix` shakes hands with no timeout; an agent whose
//! socket accepts but never answers would otherwise block forever.)

use std::path::PathBuf;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use cube_agent::client::{Client, ClientError};
use pyo3::prelude::*;

use crate::errors::{agent_error, raise};
use crate::interrupt::TICK;

/// How long connecting is retried while nothing listens (the agent restarts with the
/// sandbox's processes after a file-system rollback).
const RESTART_WAIT: Duration = Duration::from_secs(3);

/// Pause between two connection attempts.
const RETRY_INTERVAL: Duration = Duration::from_millis(50);

/// How long the agent may take to answer the handshake.
const ANSWER_WAIT: Duration = Duration::from_secs(15);

/// Connects to the agent listening on `socket`.
pub fn connect(py: Python<'_>, socket: PathBuf) -> PyResult<Client> {
    let (tx, mut rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("cube-agent-connect".into())
        .spawn(move || {
            let deadline = Instant::now() + RESTART_WAIT;
            loop {
                // Resolved inside the sandbox's root: its code can replace the socket.
                let connected = cube_core::connect_jail_agent(&socket)
                    .map_err(ClientError::Connect)
                    .and_then(Client::new);
                match connected {
                    Err(ClientError::Connect(_)) if Instant::now() < deadline => {
                        std::thread::sleep(RETRY_INTERVAL)
                    }
                    // The receiver may have given up; then the client is dropped here.
                    other => {
                        let _ = tx.send(other);
                        return;
                    }
                }
            }
        })
        .map_err(|e| raise("SandboxError", format!("starting a thread: {e}")))?;
    let deadline = Instant::now() + RESTART_WAIT + ANSWER_WAIT;
    loop {
        // A `&mut` moves into the closure: the receiver is Send but not Sync.
        let receiver = &mut rx;
        match py.detach(move || receiver.recv_timeout(TICK)) {
            Ok(result) => return result.map_err(agent_error),
            Err(RecvTimeoutError::Timeout) => {
                py.check_signals()?;
                if Instant::now() >= deadline {
                    return Err(raise(
                        "TimeoutError",
                        "the sandbox's agent accepts connections but does not answer",
                    ));
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(raise(
                    crate::errors::CONNECTION_LOST,
                    "connecting to the sandbox's agent failed",
                ))
            }
        }
    }
}
