//! Code cells: stateful interpreter contexts in the sandbox (`run_code`).

use std::time::{Duration, Instant};

use cube_agent::client::{Client, ClientError};
use cube_agent::protocol::{CodeResult, ErrorCode, Language, RequestBody, ResponseBody};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::errors::{agent_error, raise};
use crate::interrupt::{next, Next};

/// How long past a cell's own timeout the host waits for the agent's report of it.
const TIMEOUT_GRACE: Duration = Duration::from_secs(5);

/// Parses a language name.
pub fn language(name: &str) -> PyResult<Language> {
    match name {
        "python" | "python3" | "py" => Ok(Language::Python),
        "bash" | "sh" | "shell" => Ok(Language::Bash),
        other => Err(raise(
            "InvalidArgument",
            format!("unknown language {other:?} (use \"python\" or \"bash\")"),
        )),
    }
}

/// The name of the context `run_code` uses when the caller names none.
pub fn default_context(language: Language) -> &'static str {
    match language {
        Language::Python => "default-python",
        Language::Bash => "default-bash",
    }
}

/// One cell to run.
pub struct Cell<'a> {
    /// The context's name.
    pub context: &'a str,
    /// Its language, for creating the context when it does not exist yet.
    pub language: Language,
    /// Create the context when it is missing (the default contexts).
    pub create_missing: bool,
    /// The source.
    pub code: &'a str,
    /// The agent interrupts the cell after this long.
    pub timeout: Option<Duration>,
}

/// Runs `cell` and returns its outcome as a dict for the Python layer.
pub fn run(py: Python<'_>, client: &Client, cell: &Cell<'_>) -> PyResult<Py<PyDict>> {
    let result = match run_once(py, client, cell)? {
        Err(ClientError::Agent(reply))
            if reply.code == ErrorCode::NoSuchContext && cell.create_missing =>
        {
            // First cell of a default context (or the context was lost with the
            // sandbox's processes after a file-system rollback): start it, run again.
            py.detach(|| client.create_context(cell.context, cell.language, None))
                .map_err(agent_error)?;
            run_once(py, client, cell)?
        }
        other => other,
    };
    let result = result.map_err(agent_error)?;
    to_dict(py, result)
}

/// Sends the cell and waits for its result; an agent error comes back as `Ok(Err)` so
/// the caller can react to a missing context.
fn run_once(
    py: Python<'_>,
    client: &Client,
    cell: &Cell<'_>,
) -> PyResult<Result<CodeResult, ClientError>> {
    let mut call = py
        .detach(|| {
            client.start(RequestBody::RunCode {
                context: cell.context.into(),
                code: cell.code.into(),
                timeout_ms: cell.timeout.map(|t| t.as_millis() as u64),
            })
        })
        .map_err(agent_error)?;
    let deadline = cell.timeout.map(|t| Instant::now() + t + TIMEOUT_GRACE);
    loop {
        match next(py, &mut call, deadline)? {
            Next::Body(ResponseBody::CodeResult(r)) => return Ok(Ok(r)),
            Next::Body(ResponseBody::Error(e)) => return Ok(Err(ClientError::Agent(e))),
            Next::Body(other) if other.is_final() => {
                return Ok(Err(ClientError::Unexpected(format!("{other:?}"))))
            }
            Next::Body(_) => {}
            Next::End => return Ok(Err(ClientError::Disconnected)),
            Next::DeadlinePassed => {
                return Err(raise(
                    "TimeoutError",
                    "the cell did not finish in time and the agent did not report it",
                ))
            }
        }
    }
}

fn to_dict(py: Python<'_>, r: CodeResult) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("stdout", r.stdout)?;
    d.set_item("stderr", r.stderr)?;
    d.set_item("value", r.value)?;
    let rich = PyList::empty(py);
    for out in r.rich {
        rich.append((out.mime, PyBytes::new(py, &out.data)))?;
    }
    d.set_item("rich", rich)?;
    match r.error {
        Some(e) => d.set_item("error", (e.name, e.value, e.traceback))?,
        None => d.set_item("error", py.None())?,
    }
    d.set_item("exit_status", r.exit_status)?;
    d.set_item("timed_out", r.timed_out)?;
    Ok(d.unbind())
}
