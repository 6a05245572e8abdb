//! The messages between the library and a sandbox's supervisor process.
//!
//! One stream per client; each message is a little-endian `u32` length followed by that
//! many bytes of postcard. A frame larger than [`MAX_FRAME`] is refused before any
//! allocation, so a confused or hostile peer cannot make the other side allocate.

use std::io::{Read, Write};
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::sandbox::metadata::{Engine, SnapshotKind};
use crate::sandbox::network::{
    NetnsChoice, NetworkOptions, NetworkPolicy, NetworkReport, PortMapping,
};
use crate::snapshot::MachineConfig;
use crate::test_guest::WorkingSet;
use crate::vmm::machine::SnapshotStats;

/// Largest frame either side accepts.
pub const MAX_FRAME: u32 = 1 << 20;

/// Protocol version; a supervisor refuses clients of another version.
pub const PROTOCOL_VERSION: u32 = 4;

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
    /// Destroy the sandbox this many milliseconds after it was adopted.
    pub lifetime_ms: Option<u64>,
    /// A network from the host's pool (jail); None: loopback only.
    pub network: Option<NetworkOptions>,
    /// The network namespace (jail).
    #[serde(default)]
    pub netns: NetnsChoice,
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
        /// Environment, limits, lifetime.
        settings: Settings,
    },
    /// Report state.
    Status,
    /// Stop the vCPUs.
    Pause,
    /// Continue the vCPUs.
    Resume,
    /// Write a snapshot into `staging`, then move it to `dest`.
    Snapshot {
        /// An empty directory on the store's filesystem.
        staging: PathBuf,
        /// Where the finished snapshot goes.
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
    /// The request failed; the message says why.
    Error(String),
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
