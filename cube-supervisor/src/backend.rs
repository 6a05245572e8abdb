//! What a supervisor asks of the sandbox it holds, whatever the engine: the
//! [`SandboxBackend`] contract, the capabilities only some backends have
//! ([`Networked`], [`TestGuestControl`], in the manner of Cloud Hypervisor's
//! `Pausable`/`Snapshottable`), and [`dispatch`], which routes every request to them
//! once for all backends.
//!
//! A backend without a capability leaves its accessor at the default (None), and the
//! request is answered [`ErrorKind::Unsupported`].

use std::path::Path;

use crate::confinement::Profile;
use crate::jail_network::{network_failure, JailNetwork};
use crate::network::{NetworkPolicy, NetworkReport, PortMapping};
use crate::protocol::{ErrorKind, Failure, LimitChange, Request, Response, StatusReport};
use crate::records::SnapshotMeta;

/// A sandbox as its supervisor holds it: a test-guest VM, a Linux VM or a jail.
pub trait SandboxBackend: Send {
    /// The sandbox's directory.
    fn dir(&self) -> &Path;

    /// What the supervisor keeps once this sandbox is set up (see
    /// [`crate::confinement`]).
    fn confinement(&self) -> Profile;

    /// Its state now.
    fn status(&mut self) -> StatusReport;

    /// Stops it where it is, in memory.
    fn pause(&mut self) -> Result<(), Failure>;

    /// Lets a paused sandbox run on.
    fn resume(&mut self) -> Result<(), Failure>;

    /// Writes a snapshot into `staging`, for the library to move to `dest` (through a
    /// [`crate::snapshot_transaction::SnapshotTransaction`]); the sandbox runs on (or
    /// stays paused) as it was, whatever happens.
    fn snapshot(&mut self, staging: &Path, dest: &Path) -> Result<SnapshotMeta, Failure>;

    /// The snapshot staged last is now at `dest`: what it holds is no longer pending
    /// (a VM's dirty pages), and it is flushed in the background.
    fn snapshot_committed(&mut self, dest: &Path) -> Result<(), Failure>;

    /// Puts the sandbox back to the state of `snapshot`, checked before anything
    /// running is touched.
    fn rollback(&mut self, snapshot: &Path) -> Result<(), Failure>;

    /// Writes the state out and releases the memory.
    fn hibernate(&mut self) -> Result<(), Failure>;

    /// Brings a hibernated sandbox back.
    fn wake(&mut self) -> Result<(), Failure>;

    /// Releases everything the sandbox holds (its files stay for the store to
    /// remove); waits for its background work.
    fn destroy(&mut self);

    /// Changes its resource limits (see [`LimitChange`]). A VM's memory and vCPUs are
    /// fixed when it is made: VM backends refuse.
    fn set_limits(&mut self, change: LimitChange) -> Result<(), Failure> {
        let _ = change;
        Err(Failure::unsupported(
            "a VM's memory and vCPUs are fixed when it is created: only a jail sandbox's \
             limits change while it runs",
        ))
    }

    /// Its network controls, where the engine can have a network.
    fn networked(&mut self) -> Option<&mut dyn Networked> {
        None
    }

    /// Its test-guest controls, where it runs Cube's test guest.
    fn test_guest(&mut self) -> Option<&mut dyn TestGuestControl> {
        None
    }
}

/// A backend whose sandboxes can have a network from the host's pool.
pub trait Networked {
    /// The sandbox's network; a bad-state failure where it was created without one.
    fn network(&mut self) -> Result<&mut dyn NetworkControl, Failure>;
}

/// What the library can do with a sandbox's network through its supervisor: a jail's
/// does it itself ([`JailNetwork`]). (A VM's network keeper serves the library
/// directly: see [`crate::network_keeper`].)
pub trait NetworkControl {
    /// Device, policy (as asked and as the datapath holds it), ports and counters now.
    fn report(&mut self) -> Result<NetworkReport, Failure>;
    /// Replaces the egress policy; new flows see it at once.
    fn set_policy(&mut self, policy: NetworkPolicy) -> Result<(), Failure>;
    /// Serves sandbox port `port.sandbox_port` at `port.host_port` on the host.
    fn expose(&mut self, port: PortMapping) -> Result<(), Failure>;
    /// Withdraws host port `host_port`.
    fn unexpose(&mut self, host_port: u16) -> Result<(), Failure>;
}

impl NetworkControl for JailNetwork {
    fn report(&mut self) -> Result<NetworkReport, Failure> {
        JailNetwork::report(self).map_err(network_failure)
    }

    fn set_policy(&mut self, policy: NetworkPolicy) -> Result<(), Failure> {
        JailNetwork::set_policy(self, policy).map_err(network_failure)
    }

    fn expose(&mut self, port: PortMapping) -> Result<(), Failure> {
        JailNetwork::expose(self, port).map_err(network_failure)
    }

    fn unexpose(&mut self, host_port: u16) -> Result<(), Failure> {
        JailNetwork::unexpose(self, host_port).map_err(network_failure)
    }
}

/// The network a jail backend holds in `network`, or why there is none (see
/// [`Networked::network`]).
pub fn held_network<N: NetworkControl>(
    network: &mut Option<Box<N>>,
) -> Result<&mut dyn NetworkControl, Failure> {
    network
        .as_deref_mut()
        .map(|n| n as &mut dyn NetworkControl)
        .ok_or_else(|| Failure::bad_state("this sandbox has no network (create it with one)"))
}

/// What a VM sandbox runs (its machine), unless it is hibernated or `gone`. (A
/// function of the fields, so that the rest of the sandbox can be borrowed alongside.)
pub fn awake<'a, T>(
    held: &'a mut Option<T>,
    hibernated: bool,
    gone: &str,
) -> Result<&'a mut T, Failure> {
    if hibernated {
        return Err(Failure::bad_state("sandbox is hibernated: wake it first"));
    }
    held.as_mut().ok_or_else(|| Failure::bad_state(gone))
}

/// The controls of Cube's test guest, for tests and benchmarks.
pub trait TestGuestControl {
    /// Has the guest dirty `mib` MiB, writing `pattern` (one more per page).
    fn guest_dirty(&mut self, mib: u64, pattern: u64) -> Result<(), Failure>;

    /// Switches the guest between idle and spinning on its counter.
    fn guest_mode(&mut self, spin: bool) -> Result<(), Failure>;

    /// Waits until the guest has touched its working set.
    fn wait_working_set(&mut self) -> Result<(), Failure>;

    /// `len` bytes of guest memory from `addr`.
    fn read_memory(&mut self, addr: u64, len: u32) -> Result<Vec<u8>, Failure>;

    /// CRC32 of all guest RAM, region by region.
    fn memory_digest(&mut self) -> Result<Vec<u32>, Failure>;
}

/// Carries out one request on `backend`. (Destroy is the server's: it also ends the
/// process.) A failure nothing classified of a snapshot, rollback, hibernation or
/// wake is [`ErrorKind::SnapshotFailed`].
pub fn dispatch(backend: &mut dyn SandboxBackend, request: Request) -> Result<Response, Failure> {
    let snapshot_failed = |f: Failure| f.or_kind(ErrorKind::SnapshotFailed);
    match request {
        Request::Adopt { .. } => Err(Failure::invalid("already adopted")),
        Request::Destroy => Ok(Response::Ok),
        Request::Status => Ok(Response::Status(backend.status())),
        Request::Pause => backend.pause().map(|()| Response::Ok),
        Request::Resume => backend.resume().map(|()| Response::Ok),
        Request::Snapshot { staging, dest } => {
            let meta = backend.snapshot(&staging, &dest).map_err(snapshot_failed)?;
            Ok(Response::Snapshot {
                stats: meta.stats,
                kind: meta.kind,
                fallback: meta.fallback,
            })
        }
        Request::SnapshotCommitted { dest } => backend
            .snapshot_committed(&dest)
            .map(|()| Response::Ok)
            .map_err(snapshot_failed),
        Request::Rollback { snapshot } => backend
            .rollback(&snapshot)
            .map(|()| Response::Ok)
            .map_err(snapshot_failed),
        Request::Hibernate => backend
            .hibernate()
            .map(|()| Response::Ok)
            .map_err(snapshot_failed),
        Request::Wake => backend
            .wake()
            .map(|()| Response::Ok)
            .map_err(snapshot_failed),
        request @ (Request::NetworkStatus
        | Request::SetPolicy(_)
        | Request::Expose(_)
        | Request::Unexpose { .. }) => dispatch_network(networked(backend)?.network()?, request),
        Request::SetLimits(change) => backend.set_limits(change).map(|()| Response::Ok),
        Request::GuestDirty { mib, pattern } => test_guest(backend)?
            .guest_dirty(mib, pattern)
            .map(|()| Response::Ok),
        Request::GuestMode { spin } => test_guest(backend)?.guest_mode(spin).map(|()| Response::Ok),
        Request::GuestWaitWorkingSet => test_guest(backend)?
            .wait_working_set()
            .map(|()| Response::Ok),
        Request::ReadMemory { addr, len } => test_guest(backend)?
            .read_memory(addr, len)
            .map(Response::Memory),
        Request::MemoryDigest => test_guest(backend)?.memory_digest().map(Response::Digest),
    }
}

/// Carries out a network request (report, policy, ports) on `network`: a jail
/// supervisor's for the library, and a VM's network keeper's, which the library asks
/// directly. Any other request is refused.
pub fn dispatch_network(
    network: &mut dyn NetworkControl,
    request: Request,
) -> Result<Response, Failure> {
    match request {
        Request::NetworkStatus => network.report().map(Response::Network),
        Request::SetPolicy(policy) => network.set_policy(policy).map(|()| Response::Ok),
        Request::Expose(port) => network.expose(port).map(|()| Response::Ok),
        Request::Unexpose { host_port } => network.unexpose(host_port).map(|()| Response::Ok),
        other => Err(Failure::unsupported(format!(
            "not a network request: {other:?}"
        ))),
    }
}

fn networked(backend: &mut dyn SandboxBackend) -> Result<&mut dyn Networked, Failure> {
    backend.networked().ok_or_else(|| {
        Failure::unsupported(
            "Cube's test guest has no network device: networks are for Linux VM and jail \
             sandboxes",
        )
    })
}

fn test_guest(backend: &mut dyn SandboxBackend) -> Result<&mut dyn TestGuestControl, Failure> {
    backend.test_guest().ok_or_else(|| {
        Failure::unsupported("this sandbox runs no test guest (this request is for test-guest VMs)")
    })
}
