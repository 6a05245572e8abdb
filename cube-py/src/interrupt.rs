//! Waiting on an agent's answers without holding the GIL, while still letting Ctrl-C
//! (and any other Python signal handler) interrupt the wait.

use std::time::{Duration, Instant};

use cube_agent::client::{Call, ClientError};
use cube_agent::protocol::ResponseBody;
use pyo3::prelude::*;

use crate::errors::agent_error;

/// How long one wait lasts before signal handlers get a chance to run.
pub const TICK: Duration = Duration::from_millis(50);

/// What waiting for the next answer gave.
pub enum Next {
    /// An event or the final answer.
    Body(ResponseBody),
    /// The final answer had already come.
    End,
    /// `deadline` passed first.
    DeadlinePassed,
}

/// The next answer of `call`. The GIL is released while waiting; between waits Python
/// signal handlers run, and an exception they raise (KeyboardInterrupt) is returned.
pub fn next(py: Python<'_>, call: &mut Call, deadline: Option<Instant>) -> PyResult<Next> {
    loop {
        let tick = match deadline {
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => left.min(TICK),
                _ => return Ok(Next::DeadlinePassed),
            },
            None => TICK,
        };
        match py.detach(|| call.recv_timeout(tick)) {
            Ok(Some(body)) => return Ok(Next::Body(body)),
            Ok(None) => return Ok(Next::End),
            Err(ClientError::Timeout) => py.check_signals()?,
            Err(e) => return Err(agent_error(e)),
        }
    }
}

/// Seconds from Python as a duration; `None` and 0 mean no limit.
pub fn seconds(what: &str, value: Option<f64>) -> PyResult<Option<Duration>> {
    match value {
        None => Ok(None),
        Some(0.0) => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(crate::errors::raise(
            "InvalidArgument",
            format!("{what} must be a positive number of seconds (or None), not {s}"),
        )),
    }
}
