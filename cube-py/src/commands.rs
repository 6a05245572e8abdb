//! Processes in the sandbox: foreground runs with streamed output, and background
//! processes followed by a thread of their own.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cube_agent::client::{Call, Client, ClientError};
use cube_agent::protocol::{ExecRequest, ExitInfo, RequestBody, ResponseBody};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{agent_error, raise};
use crate::interrupt::{next, Next, TICK};
use crate::text_stream::TextStream;

/// How long past a command's own timeout the host waits for the agent's report of it.
const TIMEOUT_GRACE: Duration = Duration::from_secs(5);

/// SIGKILL, sent to a command the caller interrupted.
const SIGKILL: i32 = 9;

/// How a command ended, with everything it printed; handed to Python as
/// `(stdout, stderr, exit_code, signal, timed_out)`.
pub type Outcome = (Py<PyBytes>, Py<PyBytes>, Option<i32>, Option<i32>, bool);

/// Output callbacks of a command.
pub struct Callbacks {
    /// Gets each piece of standard output as text.
    pub on_stdout: Option<Py<PyAny>>,
    /// Gets each piece of standard error as text.
    pub on_stderr: Option<Py<PyAny>>,
}

/// Output collected so far, and the decoders feeding the callbacks.
#[derive(Default)]
struct Collected {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    stdout_text: TextStream,
    stderr_text: TextStream,
}

impl Collected {
    /// Records an output event; returns the text to hand to a callback and whether it
    /// came from standard error.
    fn take(&mut self, body: &ResponseBody) -> Option<(String, bool)> {
        match body {
            ResponseBody::Stdout(b) => {
                self.stdout.extend_from_slice(b);
                Some((self.stdout_text.push(b), false))
            }
            ResponseBody::Stderr(b) => {
                self.stderr.extend_from_slice(b);
                Some((self.stderr_text.push(b), true))
            }
            _ => None,
        }
    }

    /// Text left in the decoders at the end: (stdout, stderr).
    fn finish(&mut self) -> (String, String) {
        (self.stdout_text.finish(), self.stderr_text.finish())
    }

    fn outcome(&self, py: Python<'_>, exit: ExitInfo) -> Outcome {
        (
            PyBytes::new(py, &self.stdout).unbind(),
            PyBytes::new(py, &self.stderr).unbind(),
            exit.code,
            exit.signal,
            exit.timed_out,
        )
    }
}

fn deliver(py: Python<'_>, callbacks: &Callbacks, text: String, stderr: bool) -> PyResult<()> {
    if text.is_empty() {
        return Ok(());
    }
    let cb = if stderr {
        &callbacks.on_stderr
    } else {
        &callbacks.on_stdout
    };
    if let Some(cb) = cb {
        cb.call1(py, (text,))?;
    }
    Ok(())
}

/// Runs `req` to its end, handing output to the callbacks as it arrives. Ctrl-C, an
/// exception from a callback, or the host-side deadline kill the process.
pub fn run(
    py: Python<'_>,
    client: &Client,
    req: ExecRequest,
    callbacks: &Callbacks,
) -> PyResult<Outcome> {
    let timeout = req.timeout_ms.map(Duration::from_millis);
    let mut call = py
        .detach(|| client.start_with_id(crate::exec_id::next(), RequestBody::Exec(req)))
        .map_err(agent_error)?;
    let deadline = timeout.map(|t| Instant::now() + t + TIMEOUT_GRACE);
    let mut collected = Collected::default();
    let result = (|| loop {
        match next(py, &mut call, deadline)? {
            Next::Body(ResponseBody::Exited(exit)) => {
                let (out, err) = collected.finish();
                deliver(py, callbacks, out, false)?;
                deliver(py, callbacks, err, true)?;
                return Ok(collected.outcome(py, exit));
            }
            Next::Body(ResponseBody::Error(e)) => return Err(agent_error(ClientError::Agent(e))),
            Next::Body(body) => {
                if let Some((text, stderr)) = collected.take(&body) {
                    deliver(py, callbacks, text, stderr)?;
                }
                py.check_signals()?;
            }
            Next::End => return Err(agent_error(ClientError::Disconnected)),
            Next::DeadlinePassed => {
                return Err(raise(
                    "TimeoutError",
                    "the command did not end in time and the agent did not report it",
                ))
            }
        }
    })();
    if result.is_err() {
        // Interrupted or failed on this side: the process must not run on unseen.
        let id = call.id;
        let _ = py.detach(|| client.kill(id, SIGKILL));
    }
    result
}

/// What a background process's follower thread has seen.
#[derive(Default)]
struct BackgroundState {
    collected: Collected,
    exit: Option<ExitInfo>,
    /// Why following stopped early: the exception class and message.
    failure: Option<(&'static str, String)>,
}

/// A process started with `background=True`.
#[pyclass(module = "cubesandbox._native", name = "NativeProcess", frozen)]
pub struct Background {
    exec_id: u64,
    pid: u32,
    client: Arc<Client>,
    state: Arc<(Mutex<BackgroundState>, Condvar)>,
}

/// Starts `req` in the background: returns once the process runs; a thread follows
/// its output (calling the callbacks) until it ends.
pub fn start(
    py: Python<'_>,
    client: Arc<Client>,
    mut req: ExecRequest,
    callbacks: Callbacks,
) -> PyResult<Background> {
    req.background = true;
    let mut call = py
        .detach(|| client.start_with_id(crate::exec_id::next(), RequestBody::Exec(req)))
        .map_err(agent_error)?;
    let pid = match next(py, &mut call, None)? {
        Next::Body(ResponseBody::Started { pid }) => pid,
        Next::Body(ResponseBody::Error(e)) => return Err(agent_error(ClientError::Agent(e))),
        Next::Body(other) => {
            return Err(agent_error(ClientError::Unexpected(format!("{other:?}"))))
        }
        Next::End | Next::DeadlinePassed => return Err(agent_error(ClientError::Disconnected)),
    };
    let state = Arc::new((Mutex::new(BackgroundState::default()), Condvar::new()));
    let exec_id = call.id;
    let follower_state = Arc::clone(&state);
    std::thread::Builder::new()
        .name(format!("cube-exec-{exec_id}"))
        .spawn(move || follow(call, callbacks, &follower_state))
        .map_err(|e| raise("SandboxError", format!("starting a thread: {e}")))?;
    Ok(Background {
        exec_id,
        pid,
        client,
        state,
    })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The follower thread: collects output, calls the callbacks (taking the GIL for each
/// call), records the exit.
fn follow(mut call: Call, callbacks: Callbacks, state: &(Mutex<BackgroundState>, Condvar)) {
    let (lock_, ended) = state;
    loop {
        let body = match call.recv() {
            Ok(Some(body)) => body,
            Ok(None) | Err(_) => {
                lock(lock_).failure = Some((
                    crate::errors::CONNECTION_LOST,
                    "lost the connection to the sandbox's agent".into(),
                ));
                break;
            }
        };
        match body {
            ResponseBody::Exited(exit) => {
                let (out, err) = {
                    let mut s = lock(lock_);
                    s.collected.finish()
                };
                call_back(&callbacks, out, false);
                call_back(&callbacks, err, true);
                lock(lock_).exit = Some(exit);
                break;
            }
            ResponseBody::Error(e) => {
                lock(lock_).failure = Some(("AgentError", e.message));
                break;
            }
            body => {
                let text = lock(lock_).collected.take(&body);
                if let Some((text, stderr)) = text {
                    call_back(&callbacks, text, stderr);
                }
            }
        }
    }
    ended.notify_all();
}

/// Calls a callback from the follower thread; an exception it raises is reported as
/// unraisable (there is no caller to raise it to).
fn call_back(callbacks: &Callbacks, text: String, stderr: bool) {
    if text.is_empty() {
        return;
    }
    let cb = if stderr {
        &callbacks.on_stderr
    } else {
        &callbacks.on_stdout
    };
    let Some(cb) = cb else { return };
    // The interpreter may be shutting down; then there is nobody to tell.
    let _ = Python::try_attach(|py| {
        if let Err(e) = cb.call1(py, (text,)) {
            e.write_unraisable(py, Some(cb.bind(py)));
        }
    });
}

#[pymethods]
impl Background {
    /// The process id inside the sandbox.
    #[getter]
    fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process has ended.
    fn finished(&self) -> bool {
        let s = lock(&self.state.0);
        s.exit.is_some() || s.failure.is_some()
    }

    /// Waits for the end (at most `timeout` seconds) and returns the outcome.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Outcome> {
        let limit = crate::interrupt::seconds("timeout", timeout)?;
        let deadline = limit.map(|l| Instant::now() + l);
        let (lock_, ended) = &*self.state;
        loop {
            let done = py.detach(|| {
                let s = lock(lock_);
                let (s, _) = ended
                    .wait_timeout_while(s, TICK, |s| s.exit.is_none() && s.failure.is_none())
                    .unwrap_or_else(PoisonError::into_inner);
                if let Some(f) = &s.failure {
                    return Some(Err(f.clone()));
                }
                s.exit.map(Ok)
            });
            match done {
                Some(Ok(exit)) => return Ok(lock(lock_).collected.outcome(py, exit)),
                Some(Err((class, message))) => return Err(raise(class, message)),
                None => {}
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(raise(
                    "TimeoutError",
                    format!("process {} still runs after the wait's timeout", self.pid),
                ));
            }
            py.check_signals()?;
        }
    }

    /// Sends `signal` (default SIGKILL) to the process group; false when it had
    /// already ended.
    #[pyo3(signature = (signal=SIGKILL))]
    fn kill(&self, py: Python<'_>, signal: i32) -> PyResult<bool> {
        if self.finished() {
            return Ok(false);
        }
        let client = Arc::clone(&self.client);
        let id = self.exec_id;
        match py.detach(|| client.kill(id, signal)) {
            Ok(()) => Ok(true),
            Err(ClientError::Agent(e))
                if matches!(
                    e.code,
                    cube_agent::protocol::ErrorCode::NotRunning
                        | cube_agent::protocol::ErrorCode::NoSuchExec
                ) =>
            {
                Ok(false)
            }
            Err(e) => Err(agent_error(e)),
        }
    }

    /// Standard output so far.
    #[getter]
    fn stdout<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &lock(&self.state.0).collected.stdout)
    }

    /// Standard error so far.
    #[getter]
    fn stderr<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &lock(&self.state.0).collected.stderr)
    }
}
