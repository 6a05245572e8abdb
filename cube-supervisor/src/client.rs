//! The library's end of a supervisor connection.

use std::io::{BufReader, BufWriter, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use super::protocol::{
    read_frame, write_frame, ErrorKind, Failure, ProtocolError, Request, Response,
};

/// Why a call to a supervisor failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The supervisor cannot be reached.
    #[error("Cannot reach the sandbox supervisor at {0}")]
    Connect(String, #[source] std::io::Error),
    /// The exchange failed.
    #[error("Talking to the sandbox supervisor")]
    Protocol(#[from] ProtocolError),
    /// The supervisor carried out the request and it failed.
    #[error("{0}")]
    Remote(Failure),
    /// The supervisor answered with something the request does not produce.
    #[error("Unexpected answer from the supervisor: {0}")]
    Unexpected(String),
}

impl ClientError {
    /// What kind of failure this is: the supervisor's own for a failed request; a
    /// supervisor that cannot be reached is a sandbox that no longer runs.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ClientError::Connect(..) => ErrorKind::NotFound,
            ClientError::Remote(failure) => failure.kind,
            ClientError::Protocol(_) | ClientError::Unexpected(_) => ErrorKind::Internal,
        }
    }
}

/// One connection to a supervisor.
pub struct SupervisorClient {
    reader: BufReader<UnixStream>,
    writer: BufWriter<UnixStream>,
}

impl SupervisorClient {
    /// Wraps an established stream.
    pub fn from_stream(stream: UnixStream) -> Result<Self, ClientError> {
        let read_half = stream.try_clone().map_err(ProtocolError::Io)?;
        Ok(SupervisorClient {
            reader: BufReader::new(read_half),
            writer: BufWriter::new(stream),
        })
    }

    /// Connects to the supervisor socket at `path` (`<sandboxes>/<id>/supervisor.sock`),
    /// following no symbolic link in its last two components: a confined VM supervisor
    /// owns its sandbox's directory, and one taken over could put a link to another
    /// sandbox's supervisor there (see [`cube_storage::no_follow`]).
    pub fn connect(path: &Path) -> Result<Self, ClientError> {
        let stream = cube_storage::no_follow::connect(path, 2)
            .map_err(|e| ClientError::Connect(path.display().to_string(), e))?;
        Self::from_stream(stream)
    }

    /// Sends `request` and returns the answer; a remote error becomes `Err(Remote)`.
    pub fn call(&mut self, request: &Request) -> Result<Response, ClientError> {
        write_frame(&mut self.writer, request)?;
        self.writer.flush().map_err(ProtocolError::Io)?;
        match read_frame(&mut self.reader)? {
            Response::Error(failure) => Err(ClientError::Remote(failure)),
            other => Ok(other),
        }
    }

    /// Sends `request`, expecting a plain `Ok`.
    pub fn call_ok(&mut self, request: &Request) -> Result<(), ClientError> {
        match self.call(request)? {
            Response::Ok => Ok(()),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }
}
