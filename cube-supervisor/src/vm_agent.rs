//! Reaching the agent inside a microVM: through the vsock device's host socket (a
//! sandbox's `vsock.sock`, see [`cube_storage::SandboxDir::vsock_socket`]) and its
//! `CONNECT <port>` handshake, then the agent's own `Hello`.
//!
//! The device answers `OK` only once the guest accepted the connection; a guest whose
//! agent is not listening yet (still booting, or stopped) never does, so the
//! handshake waits a bounded time and then says the agent is not ready, instead of
//! hanging the caller.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The vsock port the agent serves in a microVM.
pub const AGENT_VSOCK_PORT: u32 = 1024;
/// How long the CONNECT handshake waits for the guest by default. A running agent
/// answers in microseconds; the wait is for a guest whose kernel runs slowly (one
/// emulated on a PVM host, under load): 2 s was too short there (CI saw the agent of a
/// running Linux guest miss it while the host built beside it).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the agent in a VM could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum VmAgentError {
    /// Nothing listens on the VM's vsock host socket.
    #[error("Cannot reach the vsock device at {0}")]
    NoSocket(PathBuf, #[source] std::io::Error),
    /// The guest did not accept the connection in time: its agent is not listening.
    #[error("The guest's agent is not ready: no answer on vsock port {port} within {waited:?}")]
    NotReady {
        /// The port.
        port: u32,
        /// How long it waited.
        waited: Duration,
    },
    /// The device refused or closed the connection.
    #[error("The vsock device refused the connection: {0}")]
    Refused(String),
    /// Reading or writing the socket failed.
    #[error("vsock handshake")]
    Io(#[source] std::io::Error),
    /// The agent's own handshake failed.
    #[error("Agent handshake")]
    Client(#[source] cube_agent::client::ClientError),
}

/// Connects to `port` in the guest behind the vsock device whose host side listens on
/// `socket`, waiting at most `timeout` for the guest to accept; returns the stream
/// ready to carry the connection. No symbolic link in the socket's last two
/// components (`<sandbox>/vsock.sock`) is followed: the VM supervisor owns its
/// sandbox's directory, and one taken over could put a link to another sandbox's
/// socket there, which the library, connecting as root for this sandbox's caller,
/// would otherwise follow (see [`cube_storage::no_follow`]).
pub fn connect(socket: &Path, port: u32, timeout: Duration) -> Result<UnixStream, VmAgentError> {
    let stream = cube_storage::no_follow::connect(socket, 2)
        .map_err(|e| VmAgentError::NoSocket(socket.to_path_buf(), e))?;
    stream
        .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
        .map_err(VmAgentError::Io)?;
    (&stream)
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .map_err(VmAgentError::Io)?;
    // Byte by byte: what follows the OK line belongs to the connection.
    let mut line = Vec::new();
    let mut reader = BufReader::with_capacity(1, &stream);
    match reader.read_until(b'\n', &mut line) {
        Ok(_) => {}
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return Err(VmAgentError::NotReady {
                port,
                waited: timeout,
            })
        }
        Err(e) => return Err(VmAgentError::Io(e)),
    }
    if !line.starts_with(b"OK ") {
        let said = String::from_utf8_lossy(&line).trim().to_string();
        return Err(VmAgentError::Refused(if said.is_empty() {
            "connection closed".into()
        } else {
            said
        }));
    }
    stream.set_read_timeout(None).map_err(VmAgentError::Io)?;
    Ok(stream)
}

/// A client of the agent in the VM whose vsock device listens on `socket` (handshake
/// done).
pub fn agent_client(
    socket: &Path,
    timeout: Duration,
) -> Result<cube_agent::client::Client, VmAgentError> {
    let stream = connect(socket, AGENT_VSOCK_PORT, timeout)?;
    cube_agent::client::Client::new(stream).map_err(VmAgentError::Client)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cube_devices::virtio::vsock::Vsock;

    #[test]
    fn no_device_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vsock.sock");
        let Err(err) = agent_client(&socket, Duration::from_millis(100)) else {
            panic!("connected without a guest");
        };
        assert!(matches!(err, VmAgentError::NoSocket(..)), "{err}");
    }

    #[test]
    fn a_guest_that_never_accepts_gives_not_ready_instead_of_hanging() {
        let dir = tempfile::tempdir().unwrap();
        // A real device with its host socket bound, but no guest driver behind it:
        // the CONNECT is queued for a guest that never takes it.
        let socket = dir.path().join("vsock.sock");
        let _device = Vsock::new(3, &socket).unwrap();
        let Err(err) = agent_client(&socket, Duration::from_millis(200)) else {
            panic!("connected without a guest");
        };
        assert!(
            matches!(
                err,
                VmAgentError::NotReady {
                    port: AGENT_VSOCK_PORT,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("not ready"));
    }
}
