//! A handle on one sandbox: the calls its supervisor carries out, and its agent.

use std::path::{Path, PathBuf};

use cube_storage::{SandboxDir, SnapshotDir};
use cube_supervisor::client::{ClientError, SupervisorClient};
use cube_supervisor::jail_sandbox::connect_agent;
use cube_supervisor::network::{NetworkPolicy, NetworkReport, PortMapping};
use cube_supervisor::protocol::{LimitChange, MachineStatus, Request, Response, StatusReport};
use cube_supervisor::records::{Engine, SnapshotKind, SnapshotMeta};
use cube_supervisor::vm_agent::{agent_client, DEFAULT_CONNECT_TIMEOUT};
use cube_vmm::persist::SnapshotStats;

use crate::error::SandboxError;
use crate::usage::{self, ResourceUsage};

/// A snapshot a sandbox took.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// Snapshot id.
    pub id: String,
    /// Its directory.
    pub dir: PathBuf,
    /// What writing it cost.
    pub stats: SnapshotStats,
    /// What it holds: the whole state, or the filesystem only.
    pub kind: SnapshotKind,
    /// Why a jail's snapshot holds the filesystem only (no working CRIU, or its dump
    /// failed); None for a full one.
    pub fallback: Option<String>,
}

/// A handle on one sandbox.
pub struct Sandbox {
    pub(crate) id: String,
    pub(crate) engine: Engine,
    pub(crate) dir: PathBuf,
    pub(crate) client: SupervisorClient,
    pub(crate) store: cube_storage::Store,
}

impl Sandbox {
    /// The sandbox's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The sandbox's directory in the store.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The sandbox's engine.
    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// A new connection to the sandbox's agent (handshake done). Any number may be
    /// open at once, from any process: the agent listens on `agent.sock` in the
    /// sandbox's directory. While the sandbox is paused the handshake waits for
    /// [`Sandbox::resume`] (up to [`cube_agent::client::HANDSHAKE_TIMEOUT`]); a
    /// hibernated sandbox is an error. A full-state snapshot, rollback, clone or
    /// hibernation ends every connection (CRIU cannot save one to the host): connect
    /// again afterwards.
    ///
    /// A VM sandbox's agent is reached over the vsock device's host socket
    /// (`vsock.sock`) with its `CONNECT` handshake; a guest whose agent does not
    /// answer within two seconds is an error ([`SandboxError::VmAgent`], of kind
    /// [`crate::ErrorKind::Timeout`]), never a hang.
    ///
    /// ```no_run
    /// // no_run: the jail engine needs root (namespaces, mounts, cgroups).
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let rt = cube_core::Runtime::open(cube_core::RuntimeConfig::new()?)?;
    /// let sb = rt.attach("sb-0123456789abcdef")?;
    /// let out = sb.agent()?.exec(cube_agent::protocol::ExecRequest {
    ///     argv: vec!["uname".into(), "-r".into()],
    ///     ..Default::default()
    /// })?;
    /// print!("{}", String::from_utf8_lossy(&out.stdout));
    /// # Ok(())
    /// # }
    /// ```
    pub fn agent(&self) -> Result<cube_agent::client::Client, SandboxError> {
        let dir = SandboxDir::new(&self.dir);
        if self.engine == Engine::Vm {
            return agent_client(&dir.vsock_socket(), DEFAULT_CONNECT_TIMEOUT)
                .map_err(|e| SandboxError::VmAgent(self.id.clone(), e));
        }
        // A clear error rather than the dangling socket link's "not found".
        if dir.is_hibernated_jail() {
            return Err(SandboxError::Hibernated(self.id.clone()));
        }
        connect_agent(&dir.agent_socket())
            .map_err(cube_agent::client::ClientError::Connect)
            .and_then(cube_agent::client::Client::new)
            .map_err(|e| SandboxError::Agent(self.id.clone(), e))
    }

    /// The socket a jail sandbox's agent listens on (a link into the jail, to connect
    /// to with [`crate::connect_jail_agent`]); None for a VM, whose agent is reached
    /// over vsock ([`Sandbox::agent`]).
    pub fn agent_socket(&self) -> Option<PathBuf> {
        (self.engine == Engine::Jail).then(|| SandboxDir::new(&self.dir).agent_socket())
    }

    pub(crate) fn call(&mut self, request: &Request) -> Result<Response, SandboxError> {
        self.client
            .call(request)
            .map_err(|source| SandboxError::Supervisor {
                id: self.id.clone(),
                source,
            })
    }

    pub(crate) fn call_ok(&mut self, request: &Request) -> Result<(), SandboxError> {
        self.client
            .call_ok(request)
            .map_err(|source| SandboxError::Supervisor {
                id: self.id.clone(),
                source,
            })
    }

    /// Sends a network request where the sandbox's network is held: to a networked
    /// VM's network keeper (never through its supervisor, which its guest may have
    /// taken over), else to the supervisor (a jail's holds its network itself).
    fn network_call(&mut self, request: &Request) -> Result<Response, SandboxError> {
        match cube_supervisor::network_keeper::ask_keeper(&self.dir, request) {
            Ok(Some(response)) => Ok(response),
            Ok(None) => self.call(request),
            Err(source) => Err(SandboxError::Supervisor {
                id: self.id.clone(),
                source,
            }),
        }
    }

    fn network_call_ok(&mut self, request: &Request) -> Result<(), SandboxError> {
        match self.network_call(request)? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected(other)),
        }
    }

    pub(crate) fn unexpected(&self, response: Response) -> SandboxError {
        SandboxError::Supervisor {
            id: self.id.clone(),
            source: ClientError::Unexpected(format!("{response:?}")),
        }
    }

    /// State as the supervisor reports it.
    pub fn status(&mut self) -> Result<StatusReport, SandboxError> {
        match self.call(&Request::Status)? {
            Response::Status(s) => Ok(s),
            other => Err(self.unexpected(other)),
        }
    }

    /// What the sandbox uses now: a jail's counters from its cgroups, a VM's from its
    /// supervisor process. A hibernated sandbox uses nothing (all zero).
    pub fn usage(&mut self) -> Result<ResourceUsage, SandboxError> {
        let status = self.status()?;
        if matches!(status.status, MachineStatus::Hibernated) {
            return Ok(ResourceUsage::default());
        }
        Ok(match &status.jail {
            Some(jail) => usage::from_cgroups(&jail.cgroups),
            None => usage::from_supervisor(
                status.pid,
                status.rss_kib,
                status.config.map(|c| u32::from(c.vcpus)).unwrap_or(1),
            ),
        })
    }

    /// Stops the vCPUs (VM) or freezes every process (jail); memory stays.
    ///
    /// ```no_run
    /// // no_run: the jail engine needs root (namespaces, mounts, cgroups).
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let rt = cube_core::Runtime::open(cube_core::RuntimeConfig::new()?)?;
    /// let mut sb = rt.attach("sb-0123456789abcdef")?;
    /// sb.pause()?; // frozen: no CPU used, memory kept
    /// sb.resume()?;
    /// sb.hibernate()?; // processes end, the files stay on disk
    /// sb.wake()?; // started afresh on the same files
    /// # Ok(())
    /// # }
    /// ```
    pub fn pause(&mut self) -> Result<(), SandboxError> {
        self.call_ok(&Request::Pause)
    }

    /// Continues after [`Sandbox::pause`].
    pub fn resume(&mut self) -> Result<(), SandboxError> {
        self.call_ok(&Request::Resume)
    }

    /// Takes a snapshot; the sandbox keeps running. A VM's is [`SnapshotKind::Full`]
    /// (only dirty pages are written). A jail's is [`SnapshotKind::Full`] where CRIU
    /// works (its processes dumped, its writable layer reflinked alongside, agent
    /// connections ended), else [`SnapshotKind::Filesystem`] with the reason in
    /// [`Snapshot::fallback`]: the layer, cloned while its processes are frozen.
    pub fn snapshot(&mut self) -> Result<Snapshot, SandboxError> {
        let id = cube_storage::Store::new_id("snap")?;
        let dest = self.store.snapshot_dir(&id)?;
        let (stats, kind, fallback) = self.write_snapshot(&id, &dest)?;
        Ok(Snapshot {
            id,
            dir: dest,
            stats,
            kind,
            fallback,
        })
    }

    /// Has the supervisor write snapshot `id` into staging in the sandbox's own
    /// directory, moves it to `dest` and tells the supervisor it is there. The move is
    /// the library's, as a confined VM supervisor may read the store's snapshots but
    /// not add to them (nor alter another sandbox's). The snapshot is whole at `dest`
    /// or absent: on any failure nothing is left there, and what a VM's snapshot
    /// held stays pending for its next one.
    pub(crate) fn write_snapshot(
        &mut self,
        id: &str,
        dest: &Path,
    ) -> Result<(SnapshotStats, SnapshotKind, Option<String>), SandboxError> {
        let staging = SandboxDir::new(&self.dir).snapshot_staging(id);
        let response = self.call(&Request::Snapshot {
            staging: staging.clone(),
            dest: dest.to_path_buf(),
        });
        let written = match response {
            Ok(Response::Snapshot {
                stats,
                kind,
                fallback,
            }) => Ok((stats, kind, fallback)),
            Ok(other) => Err(self.unexpected(other)),
            Err(e) => Err(e),
        };
        let moved = written.and_then(|written| {
            std::fs::rename(&staging, dest)
                .map_err(|e| SandboxError::Io(format!("moving snapshot {id} into place"), e))?;
            // Checked where the supervisor may no longer add to it (Landlock): one
            // taken over by its guest could have staged a symlink to another
            // sandbox's files, for a clone of this snapshot to restore.
            let foreign = SnapshotDir::new(dest)
                .foreign_entry()
                .map_err(|e| SandboxError::Io(format!("checking snapshot {id}"), e))?;
            if let Some(entry) = foreign {
                remove_debris(dest);
                return Err(SandboxError::ForeignSnapshotEntry {
                    snapshot: id.to_string(),
                    entry,
                });
            }
            Ok(written)
        });
        let written = match moved {
            Ok(written) => written,
            Err(e) => {
                // A supervisor that fails cleans its staging up; one killed on the
                // way cannot, and one that answered left it for this move.
                remove_debris(&staging);
                return Err(e);
            }
        };
        if let Err(e) = self.call_ok(&Request::SnapshotCommitted {
            dest: dest.to_path_buf(),
        }) {
            // Not committed in the sandbox (a VM's parent for its next diff is still
            // the earlier snapshot): it must not stay as if it were.
            remove_debris(dest);
            return Err(e);
        }
        Ok(written)
    }

    /// Puts the sandbox back to `snapshot`, which this sandbox must own; it keeps its
    /// id. A full snapshot brings back memory, vCPUs, devices and rootfs; a filesystem
    /// snapshot brings back the files and restarts the processes (the agent too:
    /// open agent connections end, interpreter contexts are gone).
    pub fn rollback(&mut self, snapshot: &str) -> Result<(), SandboxError> {
        let store = &self.store;
        let dir = store.snapshot(snapshot)?;
        let meta: SnapshotMeta =
            cube_storage::read_verified(&dir.record(), SnapshotDir::RECORD_KIND).map_err(|e| {
                match e {
                    cube_storage::MetadataError::Read { .. } => {
                        SandboxError::UnknownSnapshot(snapshot.to_string())
                    }
                    other => other.into(),
                }
            })?;
        if meta.sandbox != self.id {
            return Err(SandboxError::NotOwner {
                snapshot: snapshot.to_string(),
                owner: meta.sandbox,
                sandbox: self.id.clone(),
            });
        }
        if meta.engine != Engine::Vm {
            return self.call_ok(&Request::Rollback {
                snapshot: dir.into_path(),
            });
        }
        // A VM supervisor reads no snapshot where it lies (one taken over by its guest
        // would read every other sandbox's): it is lent this one, and it is taken
        // back whatever the rollback's outcome.
        let lent = SandboxDir::new(&self.dir).rollback_source();
        cube_storage::lent_snapshot::lend(&dir, &lent).map_err(|source| {
            SandboxError::LendSnapshot {
                snapshot: snapshot.to_string(),
                source,
            }
        })?;
        let rolled_back = self.call_ok(&Request::Rollback {
            snapshot: lent.path().to_path_buf(),
        });
        if let Err(e) = cube_storage::lent_snapshot::take_back(&lent) {
            tracing::warn!(sandbox = %self.id, error = %e, "Cannot remove a lent snapshot");
        }
        rolled_back
    }

    /// Writes the state out and releases the guest's memory (CubeSandbox's "pause").
    /// A jail's processes end and its writable layer stays; [`Sandbox::wake`] starts
    /// them afresh on it.
    pub fn hibernate(&mut self) -> Result<(), SandboxError> {
        self.call_ok(&Request::Hibernate)
    }

    /// Restores after [`Sandbox::hibernate`].
    pub fn wake(&mut self) -> Result<(), SandboxError> {
        self.call_ok(&Request::Wake)
    }

    /// The sandbox's network: device, policy, exposed ports, counters.
    pub fn network(&mut self) -> Result<NetworkReport, SandboxError> {
        match self.network_call(&Request::NetworkStatus)? {
            Response::Network(report) => Ok(report),
            other => Err(self.unexpected(other)),
        }
    }

    /// Replaces the sandbox's egress policy; new connections see it at once.
    pub fn set_policy(&mut self, policy: &NetworkPolicy) -> Result<(), SandboxError> {
        policy
            .to_egress()
            .map_err(|e| SandboxError::Network(e.into()))?;
        self.network_call_ok(&Request::SetPolicy(policy.clone()))
    }

    /// Changes the running sandbox's resource limits (jail engine): each limit
    /// `change` gives replaces the sandbox's, the others stay. They hold from then
    /// on, across rollbacks, hibernation and wake. A VM's memory and vCPUs are fixed
    /// at create: a VM sandbox refuses. Memory below what the sandbox uses now is
    /// reclaimed from it, or refused by the host where it cannot be.
    pub fn set_limits(&mut self, change: LimitChange) -> Result<(), SandboxError> {
        if change.is_empty() {
            return Ok(());
        }
        self.call_ok(&Request::SetLimits(change))
    }

    /// Serves sandbox port `port.sandbox_port` at `port.host_port` on the host's
    /// addresses (not 127.0.0.0/8), TCP.
    pub fn expose(&mut self, port: PortMapping) -> Result<(), SandboxError> {
        self.network_call_ok(&Request::Expose(port))
    }

    /// Withdraws exposed host port `host_port`.
    pub fn unexpose(&mut self, host_port: u16) -> Result<(), SandboxError> {
        self.network_call_ok(&Request::Unexpose { host_port })
    }

    /// Ends the sandbox: the supervisor releases the VM and exits, and the sandbox's
    /// directory and snapshots are removed.
    ///
    /// A supervisor that dies on the way (the connection ends without an answer)
    /// cannot finish: what it leaves (its jail's processes and cgroups, its network
    /// device) is released here as for [`crate::Runtime::remove_stale`], and the
    /// error is still returned.
    pub fn destroy(mut self) -> Result<(), SandboxError> {
        let result = self.call_ok(&Request::Destroy);
        if let Err(SandboxError::Supervisor {
            source: ClientError::Protocol(_),
            ..
        }) = &result
        {
            release_orphaned(&self.store, &self.id)?;
        }
        self.store.remove_sandbox_files(&self.id)?;
        result
    }
}

/// Removes a snapshot's staging or an uncommitted snapshot, saying so where it cannot.
fn remove_debris(path: &Path) {
    if let Err(e) = std::fs::remove_dir_all(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "Cannot remove a failed snapshot's files");
        }
    }
}

/// Releases what a sandbox whose supervisor is gone holds outside its directory: the
/// processes and cgroups of its jails (a killed supervisor's jail may still run, or
/// stay frozen if it was killed mid-snapshot) and its network device.
pub(crate) fn release_orphaned(store: &cube_storage::Store, id: &str) -> Result<(), SandboxError> {
    let dir = store.sandbox_dir(id)?;
    if let Ok(layout) = cube_jail::CgroupLayout::detect() {
        let left = layout.remove_jails_of(id);
        if !left.is_empty() {
            tracing::warn!(sandbox = id, ?left, "cgroups of a stale sandbox stay busy");
        }
    }
    cube_supervisor::jail_network::release_recorded(&dir).map_err(SandboxError::Network)
}
