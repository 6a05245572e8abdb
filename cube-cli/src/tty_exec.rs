//! `cube sandbox exec --tty`: a command on a terminal of its own in the sandbox (the
//! agent's pseudo-terminal, never the host's), driven from the host terminal as with
//! `docker exec -it` or `ssh -t`.
//!
//! The host terminal goes raw while the command runs (keys, Ctrl-C included, are the
//! sandbox terminal's business), what is typed is sent to the command's terminal, its
//! output is written here, and a change of the host window's size (SIGWINCH) resizes
//! the sandbox's terminal. SIGINT, SIGTERM and SIGHUP from outside hang the command up
//! (SIGHUP to its session, as a terminal that goes away does). The host terminal's
//! settings come back on every way out.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use cube_agent::client::{Client, ClientError};
use cube_agent::protocol::{ErrorCode, ExecRequest, RequestBody, ResponseBody, TerminalSize};
use nix::sys::signal::{SigSet, Signal};

use crate::cli_error::CliError;
use crate::run_cmd::{agent_error, exit_code, not_started};
use crate::terminal::{is_terminal, window_size, RawMode};

/// Runs `argv` on a terminal in the sandbox whose agent `connect` reaches; returns its
/// exit code.
pub fn run(
    connect: impl FnOnce() -> Result<Client, CliError>,
    argv: &[String],
    timeout: Option<Duration>,
) -> Result<u8, CliError> {
    if !is_terminal(0) {
        return Err(CliError::usage(
            "--tty needs a terminal on standard input (leave it out to pipe input in)",
        ));
    }
    // Before any thread starts (the agent client's reader is one), so that only the
    // watcher receives them.
    let mut signals = SigSet::empty();
    for signal in [
        Signal::SIGWINCH,
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
    ] {
        signals.add(signal);
    }
    signals
        .thread_block()
        .map_err(|e| CliError::failed(format!("blocking signals: {e}")))?;
    let size = terminal_size();
    let client = Arc::new(connect()?);
    let mut call = client
        .start(RequestBody::ExecInTerminal {
            root: None,
            size,
            exec: ExecRequest {
                argv: argv.to_vec(),
                timeout_ms: timeout.map(|t| t.as_millis().clamp(1, u64::MAX.into()) as u64),
                ..ExecRequest::default()
            },
        })
        .map_err(agent_error)?;
    match call.recv() {
        Ok(Some(ResponseBody::Started { .. })) => {}
        Ok(Some(ResponseBody::Error(e))) => return Ok(not_started(&argv[0], &e)),
        Ok(other) => {
            return Err(CliError::failed(format!(
                "unexpected answer from the agent: {other:?}"
            )))
        }
        Err(e) => return Err(agent_error(e)),
    }
    let id = call.id;
    // Raw from here on; back to its settings on every way out of this function.
    let _raw = RawMode::enter();
    spawn_named("tty-input", {
        let client = Arc::clone(&client);
        move || forward_input(&client, id)
    })?;
    spawn_named("tty-signals", {
        let client = Arc::clone(&client);
        move || watch_signals(&client, id, signals)
    })?;
    let mut stdout = std::io::stdout();
    loop {
        match call.recv() {
            Ok(Some(ResponseBody::Stdout(b))) | Ok(Some(ResponseBody::Stderr(b))) => {
                // A host terminal that went away: the command is hung up below.
                if stdout.write_all(&b).and_then(|()| stdout.flush()).is_err() {
                    let _ = client.kill(id, libc::SIGHUP);
                }
            }
            Ok(Some(ResponseBody::Exited(exit))) => return Ok(exit_code(&exit)),
            Ok(Some(ResponseBody::Error(e))) => {
                return Err(CliError::failed(format!(
                    "the command's terminal: {}",
                    e.message
                )))
            }
            Ok(Some(_)) => {}
            Ok(None) => return Err(CliError::failed("the agent gave no exit status")),
            Err(e) => return Err(agent_error(e)),
        }
    }
}

/// The host terminal's size (its stdout's, else stdin's); 24 x 80 when neither says.
fn terminal_size() -> TerminalSize {
    match window_size(1).or_else(|| window_size(0)) {
        Some((rows, cols)) if rows > 0 && cols > 0 => TerminalSize { rows, cols },
        _ => TerminalSize::default(),
    }
}

fn spawn_named(name: &str, f: impl FnOnce() + Send + 'static) -> Result<(), CliError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(drop)
        .map_err(|e| CliError::failed(format!("starting {name}: {e}")))
}

/// Sends what is typed to the command's terminal until the host's input ends (the
/// command's input then stops) or the command is gone. A read of the host terminal
/// cannot be called off: the thread ends with this process.
fn forward_input(client: &Client, id: u64) {
    let mut stdin = std::io::stdin().lock();
    let mut buf = [0u8; 4096];
    loop {
        match stdin.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if client.write_stdin(id, buf[..n].to_vec()).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = client.close_stdin(id);
}

/// Takes the blocked signals: a window size change resizes the command's terminal;
/// an interrupt, a termination or a hang-up hangs the command up.
fn watch_signals(client: &Client, id: u64, signals: SigSet) {
    loop {
        match signals.wait() {
            Ok(Signal::SIGWINCH) => {
                if let Err(ClientError::Agent(e)) = client.resize_terminal(id, terminal_size()) {
                    if e.code != ErrorCode::NotRunning && e.code != ErrorCode::NoSuchExec {
                        tracing::debug!("resizing the command's terminal: {}", e.message);
                    }
                }
            }
            Ok(_) => {
                let _ = client.kill(id, libc::SIGHUP);
            }
            Err(_) => return,
        }
    }
}
