//! Turns Cube's Rust errors into the Python exceptions of `cubesandbox.exceptions`.
//!
//! The exception classes are defined in Python (so they can also derive from the
//! matching built-ins, `FileNotFoundError`, `TimeoutError`, ...) and looked up by name
//! when raised.

use cube_agent::client::ClientError;
use cube_agent::protocol::ErrorCode;
use cube_core::error_report::chain;
use cube_core::{ErrorKind, PortableError, SandboxError};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyString;

/// The Python module holding the exception classes.
const EXCEPTIONS_MODULE: &str = "cubesandbox.exceptions";

/// The class raised when the connection to a sandbox's agent broke.
pub const CONNECTION_LOST: &str = "ConnectionLost";

/// An exception of class `class` (a name in `cubesandbox.exceptions`) with `message`,
/// and `attributes` set on it.
pub fn raise(class: &str, message: impl Into<String>) -> PyErr {
    raise_with(class, message.into(), &[])
}

/// Like [`raise`], setting `attributes` on the exception.
pub fn raise_with(class: &str, message: String, attributes: &[(&str, Py<PyAny>)]) -> PyErr {
    Python::attach(|py| {
        let built = (|| -> PyResult<PyErr> {
            let cls = py.import(EXCEPTIONS_MODULE)?.getattr(class)?;
            let exc = cls.call1((message.clone(),))?;
            for (name, value) in attributes {
                exc.setattr(*name, value.bind(py))?;
            }
            Ok(PyErr::from_value(exc))
        })();
        // Without the Python half of the package the class is missing: still say what
        // went wrong.
        built.unwrap_or_else(|_| PyRuntimeError::new_err(message))
    })
}

/// The exception for a failed sandbox operation: its class follows the failure's kind
/// (the same whether it failed here or in the sandbox's supervisor), never its message;
/// the kind is also on the exception as `kind`.
pub fn sandbox_error(err: SandboxError) -> PyErr {
    let message = chain(&err);
    let kind = err.kind();
    let class = match kind {
        ErrorKind::NotFound => match &err {
            SandboxError::UnknownTemplate(_)
            | SandboxError::Portable(PortableError::MissingTemplate(_)) => "TemplateNotFound",
            SandboxError::UnknownSnapshot(_) => "SnapshotNotFound",
            // An unknown id, or a sandbox whose supervisor no longer answers.
            SandboxError::UnknownSandbox(_) | SandboxError::Supervisor { .. } => "SandboxNotFound",
            _ => "NotFound",
        },
        ErrorKind::AlreadyExists => "AlreadyExists",
        ErrorKind::Busy => "InUse",
        ErrorKind::BadState => "InvalidState",
        ErrorKind::InvalidArgument => match &err {
            // The archive itself was refused: damaged, truncated, tampered with.
            SandboxError::Portable(
                PortableError::Archive(..)
                | PortableError::Header(..)
                | PortableError::NotASnapshot { .. }
                | PortableError::Record(_),
            ) => "ArchiveError",
            _ => "InvalidArgument",
        },
        ErrorKind::Unsupported | ErrorKind::HostCannot => "EngineUnavailable",
        ErrorKind::SnapshotFailed => "SnapshotError",
        ErrorKind::Timeout => "TimeoutError",
        ErrorKind::Internal => "SandboxError",
    };
    raise_of_kind(class, message, kind)
}

/// An exception of class `class` with `message`, carrying `kind` as its `kind`.
pub fn raise_of_kind(class: &str, message: String, kind: ErrorKind) -> PyErr {
    let kind = Python::attach(|py| PyString::new(py, &kind_name(kind)).into_any().unbind());
    raise_with(class, message, &[("kind", kind)])
}

/// The kind as Python sees it: `not_found`, `bad_state`, `host_cannot`...
fn kind_name(kind: ErrorKind) -> String {
    kind.to_string().replace(' ', "_")
}

/// The exception for a failed request to a sandbox's agent.
pub fn agent_error(err: ClientError) -> PyErr {
    match &err {
        ClientError::Agent(reply) => {
            let class = match reply.code {
                ErrorCode::NotFound => "FileNotFound",
                ErrorCode::AlreadyExists => "FileExists",
                ErrorCode::PermissionDenied => "PermissionDenied",
                ErrorCode::NotADirectory => "NotADirectory",
                ErrorCode::IsADirectory => "IsADirectory",
                ErrorCode::NotEmpty => "DirectoryNotEmpty",
                ErrorCode::InvalidArgument => "InvalidArgument",
                ErrorCode::NoSuchContext | ErrorCode::ContextLost => "ContextError",
                _ => "AgentError",
            };
            let code = Python::attach(|py| {
                PyString::new(py, &format!("{:?}", reply.code))
                    .into_any()
                    .unbind()
            });
            raise_with(class, reply.message.clone(), &[("code", code)])
        }
        ClientError::Timeout => raise("TimeoutError", "the sandbox's agent did not answer in time"),
        ClientError::Disconnected | ClientError::Connect(_) | ClientError::Send(_) => raise(
            CONNECTION_LOST,
            format!(
                "lost the connection to the sandbox's agent ({}); is the sandbox still running?",
                chain(&err)
            ),
        ),
        _ => raise("AgentError", chain(&err)),
    }
}
