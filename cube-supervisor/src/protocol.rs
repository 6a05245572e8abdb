//! The messages between the library and a sandbox's supervisor process.
//!
//! One stream per client; each message is a little-endian `u32` length followed by that
//! many bytes of postcard. A frame larger than [`MAX_FRAME`] is refused before any
//! allocation, so a confused or hostile peer cannot make the other side allocate.

use std::io::{Read, Write};
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use cube_vmm::persist::{MachineConfig, SnapshotStats, WorkingSet};

use crate::network::{NetnsChoice, NetworkOptions, NetworkPolicy, NetworkReport, PortMapping};
use crate::records::{Engine, SnapshotKind};

/// Largest frame either side accepts.
pub const MAX_FRAME: u32 = 1 << 20;

/// Protocol version; a supervisor refuses clients of another version. (4: failures
/// carry an [`ErrorKind`]; 5: snapshot stats carry the time the sandbox was stopped,
/// `SnapshotStats::paused_us`, and a supervisor can be warmed for a jail restored
/// from an image, `--warm jail-from-image`;
/// settings carry a disk limit and [`Settings::netns`]; 6: settings carry the
/// processes' working directory, [`Settings::cwd`].)
pub const PROTOCOL_VERSION: u32 = 6;

/// Why a frame could not be exchanged.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The stream failed.
    #[error("Supervisor connection failed")]
    Io(#[from] std::io::Error),
    /// The peer closed the stream.
    #[error("Supervisor closed the connection")]
    Closed,
    /// The frame is larger than allowed.
    #[error("Frame of {0} bytes exceeds the {MAX_FRAME} byte limit")]
    TooLarge(u32),
    /// The frame does not decode.
    #[error("Malformed frame")]
    Decode(#[from] postcard::Error),
}

/// What kind of failure a supervisor reports: what callers (the CLI's exit codes,
/// Python's exception classes) tell failures apart by, never the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// Something the request names does not exist.
    NotFound,
    /// Something of that name exists already.
    AlreadyExists,
    /// Something the request needs is in use.
    Busy,
    /// The sandbox is not in a state that allows the request (hibernated, not
    /// hibernated, without a running machine).
    BadState,
    /// The request is malformed or asks for something impossible.
    InvalidArgument,
    /// The sandbox's engine or guest does not offer the operation.
    Unsupported,
    /// This host lacks what the request needs (KVM, CRIU, a cgroup controller).
    HostCannot,
    /// A snapshot could not be written, or restored from (rollback, wake, create).
    SnapshotFailed,
    /// Something did not answer in time (the guest, the agent).
    Timeout,
    /// Any other failure, of the host or of Cube.
    Internal,
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            ErrorKind::NotFound => "not found",
            ErrorKind::AlreadyExists => "already exists",
            ErrorKind::Busy => "busy",
            ErrorKind::BadState => "bad state",
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::HostCannot => "host cannot",
            ErrorKind::SnapshotFailed => "snapshot failed",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Internal => "internal",
        })
    }
}

/// A failed request as it crosses the process boundary: its kind and what went
/// wrong, for people.
///
/// Handlers build one with the kind where they know it; any other error (a `String`)
/// becomes [`ErrorKind::Internal`], which [`Failure::or_kind`] refines to what the
/// operation was (a failed rollback is [`ErrorKind::SnapshotFailed`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// What went wrong, cause by cause.
    pub message: String,
}

impl Failure {
    /// A failure of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Failure {
            kind,
            message: message.into(),
        }
    }

    /// The sandbox is not in a state that allows the request.
    pub fn bad_state(message: impl Into<String>) -> Self {
        Failure::new(ErrorKind::BadState, message)
    }

    /// The request is malformed or impossible.
    pub fn invalid(message: impl Into<String>) -> Self {
        Failure::new(ErrorKind::InvalidArgument, message)
    }

    /// The sandbox's engine or guest does not offer the operation.
    pub fn unsupported(message: impl Into<String>) -> Self {
        Failure::new(ErrorKind::Unsupported, message)
    }

    /// This failure with `context` (what was being done) before its message.
    pub fn prefixed(self, context: &str) -> Self {
        Failure {
            message: format!("{context}: {}", self.message),
            ..self
        }
    }

    /// This failure, or one of `kind` where it is [`ErrorKind::Internal`] (a failure
    /// nothing classified is of the kind of the operation that failed).
    pub fn or_kind(self, kind: ErrorKind) -> Self {
        match self.kind {
            ErrorKind::Internal => Failure { kind, ..self },
            _ => self,
        }
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::new(ErrorKind::Internal, message)
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Self {
        Failure::new(ErrorKind::Internal, message)
    }
}

/// Where a new sandbox's memory and state come from.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Source {
    /// A snapshot directory (a template or a sandbox's snapshot).
    Snapshot(PathBuf),
    /// Boot the test guest in fresh memory.
    BootTestGuest {
        /// The VM's shape.
        config: MachineConfig,
        /// What the guest touches after every start.
        working_set: WorkingSet,
    },
    /// A jail on the host template, with an empty writable layer or (`layer`) a copy of
    /// a snapshot's.
    Jail {
        /// A snapshot's layer directory to clone as the sandbox's writable layer.
        layer: Option<PathBuf>,
    },
    /// A jail whose root is a built template's tree, read-only under an overlay, with
    /// an empty writable layer or (`layer`) a copy of a snapshot's.
    JailOverlay {
        /// The template's root filesystem tree.
        tree: PathBuf,
        /// A snapshot's layer directory to clone as the sandbox's writable layer.
        layer: Option<PathBuf>,
    },
}

/// Per-sandbox settings applied by the supervisor.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Settings {
    /// Sandbox-wide environment variables (jail: every process the agent starts).
    pub env: Vec<(String, String)>,
    /// Memory limit, MiB (jail).
    pub memory_mib: Option<u64>,
    /// CPU limit in thousandths of a core (jail).
    pub cpu_millis: Option<u32>,
    /// Most processes and threads (jail).
    pub pids_max: Option<u32>,
    /// Disk limit of the writable root, MiB (jail).
    pub disk_mib: Option<u64>,
    /// Destroy the sandbox this many milliseconds after it was adopted.
    pub lifetime_ms: Option<u64>,
    /// A network from the host's pool (jail); None: loopback only.
    pub network: Option<NetworkOptions>,
    /// The network namespace (jail).
    #[serde(default)]
    pub netns: NetnsChoice,
    /// The working directory of the sandbox's processes (jail); None: the sandbox
    /// user's home.
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    /// The sandbox hosts containers with roots of their own (jail: its agent keeps
    /// CAP_SYS_CHROOT, see `cube_jail::JailConfig::pid1_may_chroot`).
    #[serde(default)]
    pub hosts_containers: bool,
}

/// A request to a supervisor.
// Adopt, the large one, is sent once per sandbox; boxing it would cost every caller a
// heap allocation to save bytes on a message that lives for one call.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Request {
    /// First message of a pooled supervisor: become sandbox `id` in `dir`.
    Adopt {
        /// [`PROTOCOL_VERSION`] of the client.
        version: u32,
        /// The sandbox's id.
        id: String,
        /// The sandbox's directory (holds its socket and rootfs).
        dir: PathBuf,
        /// What to start.
        source: Source,
        /// Exit (and release everything) when this connection closes.
        ephemeral: bool,
        /// Environment, limits, lifetime (boxed: the other requests are small).
        settings: Box<Settings>,
    },
    /// Report state.
    Status,
    /// Stop the vCPUs.
    Pause,
    /// Continue the vCPUs.
    Resume,
    /// Write a snapshot into `staging`, for the caller to move to `dest` and then send
    /// [`Request::SnapshotCommitted`].
    Snapshot {
        /// A path in the sandbox's own directory, not yet there.
        staging: PathBuf,
        /// Where the finished snapshot goes.
        dest: PathBuf,
    },
    /// The snapshot written last is now at `dest` (moved there by the caller, which
    /// a confined VM supervisor could not do): its pages are no longer pending, and
    /// it is flushed.
    SnapshotCommitted {
        /// The `dest` of that [`Request::Snapshot`].
        dest: PathBuf,
    },
    /// Replace the machine with one restored from `snapshot`.
    Rollback {
        /// A snapshot directory this sandbox owns.
        snapshot: PathBuf,
    },
    /// Write the state out and release the memory.
    Hibernate,
    /// Restore from the hibernation image.
    Wake,
    /// Have the test guest dirty `mib` MiB.
    GuestDirty {
        /// MiB to write.
        mib: u64,
        /// First value written (one more per page).
        pattern: u64,
    },
    /// Switch the test guest between idle and spin.
    GuestMode {
        /// True: spin on the counter.
        spin: bool,
    },
    /// Wait until the test guest has touched its working set.
    GuestWaitWorkingSet,
    /// Read guest memory (for tests and debugging).
    ReadMemory {
        /// Guest physical address.
        addr: u64,
        /// Bytes, at most `MAX_FRAME / 2`.
        len: u32,
    },
    /// CRC32 of all guest RAM, region by region.
    MemoryDigest,
    /// Release everything and exit.
    Destroy,
    /// Report the sandbox's network.
    NetworkStatus,
    /// Replace the sandbox's egress policy.
    SetPolicy(NetworkPolicy),
    /// Expose a sandbox port on the host.
    Expose(PortMapping),
    /// Withdraw an exposed host port.
    Unexpose {
        /// The host port.
        host_port: u16,
    },
    /// Change the running sandbox's resource limits (jail).
    SetLimits(LimitChange),
}

/// New resource limits for a running sandbox: each one given replaces the sandbox's,
/// each one left out (`None`) stays as it is. They hold from then on, across
/// rollbacks, hibernation and wake too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitChange {
    /// Memory limit, MiB.
    pub memory_mib: Option<u64>,
    /// CPU limit in thousandths of a core.
    pub cpu_millis: Option<u32>,
    /// Most processes and threads.
    pub pids_max: Option<u32>,
}

impl LimitChange {
    /// Whether it changes nothing.
    pub fn is_empty(&self) -> bool {
        *self == LimitChange::default()
    }

    /// `settings` with these limits in place of theirs.
    pub fn applied_to(&self, settings: &Settings) -> Settings {
        Settings {
            memory_mib: self.memory_mib.or(settings.memory_mib),
            cpu_millis: self.cpu_millis.or(settings.cpu_millis),
            pids_max: self.pids_max.or(settings.pids_max),
            ..settings.clone()
        }
    }
}

/// Machine state as a supervisor reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MachineStatus {
    /// vCPUs running.
    Running,
    /// vCPUs stopped in memory.
    Paused,
    /// State on disk, memory released.
    Hibernated,
    /// The guest stopped for good.
    Failed(String),
}

/// What a supervisor reports about its sandbox.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StatusReport {
    /// Machine state.
    pub status: MachineStatus,
    /// The supervisor's process id.
    pub pid: u32,
    /// The test guest's counter.
    pub counter: u64,
    /// The guest's generation (bumped on every start or restore).
    pub generation: u64,
    /// Whether the test guest found its memory and registers inconsistent.
    pub guest_error: bool,
    /// The machine's shape.
    pub config: Option<MachineConfig>,
    /// Resident memory of the supervisor process, KiB.
    pub rss_kib: u64,
    /// The sandbox's engine.
    pub engine: Engine,
    /// What a jail sandbox is made of on the host (None for a VM).
    pub jail: Option<JailStatus>,
}

/// Host-side facts about a jail sandbox, for inspection and for checking that destroy
/// left nothing behind.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JailStatus {
    /// Host pid of its PID 1 (the agent); None while hibernated.
    pub pid: Option<u32>,
    /// Its cgroup directories.
    pub cgroups: Vec<PathBuf>,
    /// Its writable layer on the host.
    pub layer: PathBuf,
    /// The socket its agent listens on.
    pub agent_socket: PathBuf,
}

/// A supervisor's answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Response {
    /// Done.
    Ok,
    /// Status report.
    Status(StatusReport),
    /// A snapshot was written.
    Snapshot {
        /// What writing it cost.
        stats: SnapshotStats,
        /// What it holds.
        kind: SnapshotKind,
        /// Why a jail's snapshot holds files only, where a full one was not possible.
        #[serde(default)]
        fallback: Option<String>,
    },
    /// Guest memory bytes.
    Memory(#[serde(with = "serde_bytes")] Vec<u8>),
    /// CRC32 per RAM region.
    Digest(Vec<u32>),
    /// The request failed: its kind, and a message that says why.
    Error(Failure),
    /// The sandbox's network.
    Network(NetworkReport),
}

/// Writes one frame.
pub fn write_frame<T: Serialize>(
    stream: &mut impl Write,
    message: &T,
) -> Result<(), ProtocolError> {
    let bytes = postcard::to_allocvec(message)?;
    let len = u32::try_from(bytes.len()).map_err(|_| ProtocolError::TooLarge(u32::MAX))?;
    if len > MAX_FRAME {
        return Err(ProtocolError::TooLarge(len));
    }
    let mut frame = Vec::with_capacity(4 + bytes.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&bytes);
    stream.write_all(&frame)?;
    Ok(())
}

/// Reads one frame.
pub fn read_frame<T: DeserializeOwned>(stream: &mut impl Read) -> Result<T, ProtocolError> {
    let mut header = [0u8; 4];
    if let Err(e) = stream.read_exact(&mut header) {
        return Err(if e.kind() == std::io::ErrorKind::UnexpectedEof {
            ProtocolError::Closed
        } else {
            e.into()
        });
    }
    let len = u32::from_le_bytes(header);
    if len > MAX_FRAME {
        return Err(ProtocolError::TooLarge(len));
    }
    let mut body = vec![0u8; len as usize];
    stream.read_exact(&mut body)?;
    Ok(postcard::from_bytes(&body)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &Request::GuestDirty { mib: 3, pattern: 9 }).unwrap();
        let back: Request = read_frame(&mut buf.as_slice()).unwrap();
        assert!(matches!(back, Request::GuestDirty { mib: 3, pattern: 9 }));
    }

    #[test]
    fn failures_keep_their_kind_across_a_frame() {
        let mut buf = Vec::new();
        let failure = Failure::bad_state("sandbox is hibernated: wake it first");
        write_frame(&mut buf, &Response::Error(failure.clone())).unwrap();
        match read_frame::<Response>(&mut buf.as_slice()).unwrap() {
            Response::Error(back) => assert_eq!(back, failure),
            other => panic!("{other:?}"),
        }
        // Unclassified errors are internal until the operation names their kind.
        let plain = Failure::from("disk full".to_string());
        assert_eq!(plain.kind, ErrorKind::Internal);
        assert_eq!(
            plain.or_kind(ErrorKind::SnapshotFailed).kind,
            ErrorKind::SnapshotFailed
        );
        assert_eq!(
            failure.or_kind(ErrorKind::SnapshotFailed).kind,
            ErrorKind::BadState
        );
    }

    #[test]
    fn oversized_frame_is_refused_before_allocation() {
        let mut buf = (MAX_FRAME + 1).to_le_bytes().to_vec();
        buf.extend_from_slice(&[0; 16]);
        assert!(matches!(
            read_frame::<Request>(&mut buf.as_slice()),
            Err(ProtocolError::TooLarge(_))
        ));
    }

    #[test]
    fn truncated_and_garbage_frames_are_errors() {
        let buf = 10u32.to_le_bytes().to_vec();
        assert!(read_frame::<Request>(&mut buf.as_slice()).is_err());
        let mut garbage = 3u32.to_le_bytes().to_vec();
        garbage.extend_from_slice(&[0xff, 0xff, 0xff]);
        assert!(matches!(
            read_frame::<Request>(&mut garbage.as_slice()),
            Err(ProtocolError::Decode(_))
        ));
        assert!(matches!(
            read_frame::<Request>(&mut [].as_slice()),
            Err(ProtocolError::Closed)
        ));
    }
}
