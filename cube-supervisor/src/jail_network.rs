//! A jail sandbox's network, held by its supervisor: a veth from the host's
//! `cube-net` pool created straight into the jail's own network namespace (by the
//! jail's PID), the datapath state for it, and its release.
//!
//! The pool is host-wide (its maps and links are pinned in bpffs, its devices are on
//! the host), and every supervisor opens its own handle on it. `Pool::open` adopts
//! what is on the host and deletes veths no sandbox registered, so opening, attaching
//! and releasing happen under one host-wide file lock: no supervisor's rebuild can
//! take a device another is still setting up. A supervisor that was killed leaves a
//! registered device; it goes with the jail's namespace, and the next `Pool::open`
//! clears the datapath entries of devices that are gone. The device name is also
//! recorded in the sandbox directory ([`SandboxDir::network_record`]) so that removing a stale
//! sandbox can release it by name while its jail lives on.
//!
//! Opening the pool per supervisor costs ~20 ms once the host pool is set up: the
//! datapath's programs are reused from their pins and uplinks already running them
//! are left attached (see `cube_net::datapath::Datapath`). Only the first open by a
//! datapath build verifies the programs and attaches the uplinks (~150 ms); a
//! long-lived pool owner would take the rest off the create path too.
//!
//! `attach_veth` (a pair made straight into the jail's namespace, ~15 ms) is used
//! rather than a prepared namespace the jail would join: jails are pre-started by
//! pooled supervisors before anyone asks for a network, so they already own a
//! namespace by the time a create arrives.
//!
//! A Linux VM sandbox gets a TAP from the same pool instead ([`JailNetwork::attach_tap`]),
//! with the same datapath program, policy and exposed ports on it; its supervisor
//! opens the TAP for the VM's virtio-net device. Released, the TAP goes back to the
//! pool, which keeps none free ([`pool_config`]): it is deleted with its program and
//! link pin, so a destroyed VM sandbox leaves nothing on the host.
//!
//! Supervisors pooled for networked sandboxes take both costs off the create path
//! ([`JailNetwork::standby`]): they open the pool and attach a device into their
//! pre-started jail's namespace while idle, registered with a deny-everything policy
//! ([`cube_net::EgressPolicy::offline`]), so that no other supervisor's pool open
//! takes it for a leftover. The create then only writes the policy and the exposed
//! ports ([`JailNetwork::activate`]). A standby device is an attached device like any
//! other: when its supervisor dies, its jail (lifeline) and namespace go, the device
//! with them, and the next pool open clears its datapath entries.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use cube_storage::SandboxDir;

use crate::protocol::{ErrorKind, Failure};
use cube_net::{Attachment, EgressPolicy, NetnsRef, Pool, PoolConfig, PoolError, Protocol};

use crate::network::{NetworkError, NetworkOptions, NetworkPolicy, NetworkReport, PortMapping};

/// Environment variable naming the host pool (default [`DEFAULT_POOL`]). Keep one
/// pool per host: every pool attaches its datapath to the host's uplinks and lo, and
/// a second one there sees the first one's traffic.
pub const POOL_ENV: &str = "CUBE_NET_POOL";
/// The host pool every sandbox shares unless [`POOL_ENV`] says otherwise.
pub const DEFAULT_POOL: &str = "cube";

/// Why a sandbox's network could not be set up or changed.
#[derive(Debug, thiserror::Error)]
pub enum JailNetworkError {
    /// The options are malformed.
    #[error("network options")]
    Options(#[from] NetworkError),
    /// The pool failed.
    #[error("network pool")]
    Pool(#[from] PoolError),
    /// The host-wide pool lock could not be taken.
    #[error("locking {0}")]
    Lock(PathBuf, #[source] std::io::Error),
    /// The pool name is unusable.
    #[error("{POOL_ENV}={0:?}: 1 to 8 letters, digits or '-'")]
    PoolName(String),
    /// The sandbox's device is not attached (hibernated).
    #[error("the sandbox has no network device while hibernated")]
    Detached,
    /// The sandbox does not expose this port.
    #[error("host port {0} is not exposed by this sandbox")]
    NotExposed(u16),
    /// The sandbox's guest cannot have a network.
    #[error("{0}")]
    NoGuestNic(String),
    /// The device record could not be written.
    #[error("recording the device in {0}")]
    Record(PathBuf, #[source] std::io::Error),
}

impl JailNetworkError {
    /// What kind of failure this is, for the supervisor's answer.
    pub fn kind(&self) -> ErrorKind {
        match self {
            JailNetworkError::Options(_) | JailNetworkError::PoolName(_) => {
                ErrorKind::InvalidArgument
            }
            JailNetworkError::NotExposed(_) => ErrorKind::NotFound,
            JailNetworkError::Detached => ErrorKind::BadState,
            JailNetworkError::NoGuestNic(_) => ErrorKind::Unsupported,
            JailNetworkError::Pool(_)
            | JailNetworkError::Lock(..)
            | JailNetworkError::Record(..) => ErrorKind::Internal,
        }
    }
}

/// The failure a handler answers for a network operation that failed.
pub fn network_failure(e: JailNetworkError) -> Failure {
    Failure::new(e.kind(), crate::error_report::chain(&e))
}

type Result<T> = std::result::Result<T, JailNetworkError>;

/// The host pool's name: `$CUBE_NET_POOL` or [`DEFAULT_POOL`].
pub fn pool_name() -> Result<String> {
    let name = std::env::var(POOL_ENV).unwrap_or_else(|_| DEFAULT_POOL.to_string());
    let fits = !name.is_empty()
        && name.len() <= 8
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
    if !fits {
        return Err(JailNetworkError::PoolName(name));
    }
    Ok(name)
}

/// The configuration of host pool `name`: devices are made on attach (jails own
/// their namespaces), named after the pool.
pub fn pool_config(name: &str) -> PoolConfig {
    PoolConfig {
        name: name.to_string(),
        prefix: name.to_string(),
        veths: 0,
        taps: 0,
        ..PoolConfig::default()
    }
}

/// The host-wide lock around opening the pool, attaching and releasing.
pub struct PoolLock {
    _file: File,
}

impl PoolLock {
    /// The lock file of pool `config`.
    pub fn path(config: &PoolConfig) -> PathBuf {
        config.run_dir.join(format!("{}.lock", config.name))
    }

    /// Blocks until this process holds the lock of pool `config`.
    pub fn take(config: &PoolConfig) -> Result<PoolLock> {
        let dir = config.run_dir.clone();
        let path = Self::path(config);
        let file = std::fs::create_dir_all(&dir)
            .and_then(|()| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&path)
            })
            .map_err(|e| JailNetworkError::Lock(path.clone(), e))?;
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(JailNetworkError::Lock(
                path,
                std::io::Error::last_os_error(),
            ));
        }
        // Closing the file releases the lock.
        Ok(PoolLock { _file: file })
    }
}

/// Opens the host pool under its lock (the lock is returned held).
pub fn open_pool() -> Result<(Pool, PoolLock)> {
    let config = pool_config(&pool_name()?);
    let lock = PoolLock::take(&config)?;
    let pool = Pool::open(config)?;
    Ok((pool, lock))
}

/// What a sandbox's device is attached for.
#[derive(Clone, Copy, Debug)]
enum Target {
    /// A veth whose guest end goes into the namespace of the jail with this PID 1.
    Jail(i32),
    /// A TAP for a VM's NIC with this MAC address.
    Vm([u8; 6]),
}

/// A sandbox's network: a jail's veth or a VM's TAP.
pub struct JailNetwork {
    pool: Pool,
    attachment: Option<Attachment>,
    policy: NetworkPolicy,
    exposed: Vec<PortMapping>,
    record: PathBuf,
}

impl JailNetwork {
    /// Gives the jail whose PID 1 is `pid` its network, with `options` in force, and
    /// records the device in `dir`.
    pub fn attach(pid: i32, options: &NetworkOptions, dir: &Path) -> Result<JailNetwork> {
        options.validate()?;
        let (pool, lock) = open_pool()?;
        let mut network = JailNetwork {
            pool,
            attachment: None,
            policy: options.policy.clone(),
            exposed: options.expose.clone(),
            record: SandboxDir::new(dir).network_record(),
        };
        drop(lock);
        network.connect(Target::Jail(pid))?;
        Ok(network)
    }

    /// Gives a VM sandbox its network: a TAP from the pool for the guest NIC whose MAC
    /// is `guest_mac`, with `options` in force, recorded in `dir`. The VMM opens the
    /// TAP by [`JailNetwork::tap_name`].
    pub fn attach_tap(
        guest_mac: [u8; 6],
        options: &NetworkOptions,
        dir: &Path,
    ) -> Result<JailNetwork> {
        options.validate()?;
        let (pool, lock) = open_pool()?;
        let mut network = JailNetwork {
            pool,
            attachment: None,
            policy: options.policy.clone(),
            exposed: options.expose.clone(),
            record: SandboxDir::new(dir).network_record(),
        };
        drop(lock);
        network.connect(Target::Vm(guest_mac))?;
        Ok(network)
    }

    /// The TAP a VM sandbox's NIC is to open (None for a jail's veth).
    pub fn tap_name(&self) -> Option<&str> {
        self.attachment.as_ref().and_then(Attachment::tap_name)
    }

    /// Opens the pool and attaches a device into `pid`'s namespace ahead of any
    /// create, holding a deny-everything policy until [`JailNetwork::activate`] puts
    /// the sandbox's own in force. Dropping it releases the device.
    pub fn standby(pid: i32) -> Result<JailNetwork> {
        let (pool, lock) = open_pool()?;
        let attachment = pool.attach_veth(&NetnsRef::Pid(pid), &EgressPolicy::offline())?;
        drop(lock);
        Ok(JailNetwork {
            pool,
            attachment: Some(attachment),
            policy: NetworkPolicy {
                internet: false,
                ..NetworkPolicy::default()
            },
            exposed: Vec::new(),
            record: PathBuf::new(),
        })
    }

    /// Puts a [`JailNetwork::standby`] device into service for the sandbox in `dir`:
    /// `options` in force and the device recorded (map writes and a file; no device
    /// or program is made here). On failure the device is released.
    pub fn activate(mut self, options: &NetworkOptions, dir: &Path) -> Result<JailNetwork> {
        options.validate()?;
        let egress = options.policy.to_egress()?;
        let attachment = self.attachment.take().ok_or(JailNetworkError::Detached)?;
        self.record = SandboxDir::new(dir).network_record();
        self.policy = options.policy.clone();
        self.exposed = options.expose.clone();
        match self.pool.activate(&attachment, &egress) {
            Ok(()) => {}
            Err(e) => {
                self.release_attachment(attachment);
                return Err(e.into());
            }
        }
        self.finish_connect(attachment)?;
        Ok(self)
    }

    /// The host side of the device, while attached.
    pub fn host_ifname(&self) -> Option<&str> {
        self.attachment.as_ref().map(Attachment::host_ifname)
    }

    /// Attaches a device for `target` and puts the policy and exposed ports on it; on
    /// failure nothing stays attached.
    fn connect(&mut self, target: Target) -> Result<()> {
        let egress = self.policy.to_egress()?;
        let attachment = {
            let _lock = PoolLock::take(self.pool.config())?;
            match target {
                Target::Jail(pid) => self.pool.attach_veth(&NetnsRef::Pid(pid), &egress)?,
                Target::Vm(mac) => self.pool.attach_tap(mac, &egress)?,
            }
        };
        self.finish_connect(attachment)
    }

    /// Exposes the ports on a device carrying the policy and records it; on failure
    /// the device is released.
    fn finish_connect(&mut self, attachment: Attachment) -> Result<()> {
        let ready = (|| -> Result<()> {
            for port in &self.exposed {
                self.pool.expose(
                    &attachment,
                    port.host_port,
                    port.sandbox_port,
                    Protocol::Tcp,
                )?;
            }
            write_record(&self.record, attachment.host_ifname())
                .map_err(|e| JailNetworkError::Record(self.record.clone(), e))
        })();
        match ready {
            Ok(()) => {
                self.attachment = Some(attachment);
                Ok(())
            }
            Err(e) => {
                self.release_attachment(attachment);
                Err(e)
            }
        }
    }

    /// After the jail was replaced (rollback, wake): the old device goes, a new one
    /// comes in the new jail's namespace with the same policy and ports.
    pub fn reconnect(&mut self, pid: i32) -> Result<()> {
        self.disconnect();
        self.connect(Target::Jail(pid))
    }

    /// Releases the device and its datapath state, keeping policy and ports for a
    /// later [`JailNetwork::reconnect`].
    pub fn disconnect(&mut self) {
        if let Some(attachment) = self.attachment.take() {
            self.release_attachment(attachment);
        }
    }

    fn release_attachment(&self, attachment: Attachment) {
        let name = attachment.host_ifname().to_string();
        let tap = attachment.tap_name().is_some();
        let released = PoolLock::take(self.pool.config())
            .map_err(|e| e.to_string())
            .and_then(|_lock| {
                self.pool.release(attachment).map_err(|e| e.to_string())?;
                // A TAP returns to the pool, which keeps none free: it goes.
                if tap {
                    self.pool.trim().map_err(|e| e.to_string())?;
                }
                Ok(())
            });
        if let Err(e) = released {
            tracing::warn!(device = %name, "releasing the sandbox's network: {e}");
        }
        let _ = std::fs::remove_file(&self.record);
    }

    /// Replaces the egress policy; new flows see it at once.
    pub fn set_policy(&mut self, policy: NetworkPolicy) -> Result<()> {
        let egress = policy.to_egress()?;
        if let Some(attachment) = &self.attachment {
            self.pool.set_policy(attachment, &egress)?;
        }
        self.policy = policy;
        Ok(())
    }

    /// Serves sandbox port `port.sandbox_port` at `port.host_port` on the host.
    pub fn expose(&mut self, port: PortMapping) -> Result<()> {
        let attachment = self.attachment.as_ref().ok_or(JailNetworkError::Detached)?;
        if let Some(old) = self
            .exposed
            .iter()
            .position(|p| p.host_port == port.host_port)
        {
            self.pool
                .unexpose(attachment, port.host_port, Protocol::Tcp)?;
            self.exposed.remove(old);
        }
        self.pool
            .expose(attachment, port.host_port, port.sandbox_port, Protocol::Tcp)?;
        self.exposed.push(port);
        Ok(())
    }

    /// Withdraws host port `host_port`.
    pub fn unexpose(&mut self, host_port: u16) -> Result<()> {
        let index = self
            .exposed
            .iter()
            .position(|p| p.host_port == host_port)
            .ok_or(JailNetworkError::NotExposed(host_port))?;
        if let Some(attachment) = &self.attachment {
            self.pool.unexpose(attachment, host_port, Protocol::Tcp)?;
        }
        self.exposed.remove(index);
        Ok(())
    }

    /// Device, policy (as asked and as the datapath holds it), ports and counters now.
    pub fn report(&self) -> Result<NetworkReport> {
        let (host_ifname, counters, (allow, deny)) = match &self.attachment {
            Some(a) => (
                a.host_ifname().to_string(),
                self.pool.counters(a)?.into(),
                self.pool.policy_in_force(a)?,
            ),
            // Hibernated: what a wake will put in force.
            None => {
                let egress = self.policy.to_egress()?;
                (
                    String::new(),
                    Default::default(),
                    (egress.allow, egress.deny),
                )
            }
        };
        let text = |mut list: Vec<cube_net::Ipv4Cidr>| {
            list.sort();
            list.iter().map(ToString::to_string).collect()
        };
        Ok(NetworkReport {
            host_ifname,
            guest_addr: cube_net::addressing::GUEST_ADDR,
            gateway: cube_net::addressing::GATEWAY_ADDR,
            policy: self.policy.clone(),
            allow_in_force: text(allow),
            deny_in_force: text(deny),
            exposed: self.exposed.clone(),
            counters,
        })
    }
}

impl Drop for JailNetwork {
    fn drop(&mut self) {
        self.disconnect();
    }
}

/// Records the device `name` at `record` in a sandbox's directory as a new file of
/// this process's uid (root's), following no link: the directory of a VM sandbox
/// belongs to its supervisor's uid, which could have put a link to a host file there.
fn write_record(record: &Path, name: &str) -> std::io::Result<()> {
    use std::io::Write;
    match std::fs::remove_file(record) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    cube_storage::no_follow::create_new(record, 2, 0o644)?.write_all(name.as_bytes())
}

/// The device name recorded at `record`, if a record is there that this uid (root)
/// wrote: a VM supervisor runs as a uid of its own and owns its sandbox's directory,
/// and one taken over could record another sandbox's device there (or link the
/// record to its record) for the library to release when it removes this sandbox.
/// Such a record is refused, and said so in the log.
fn read_record(record: &Path) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    // Non-blocking: a FIFO in its place must not hang the library (refused below).
    let opened = match cube_storage::no_follow::open_file(record) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(record = %record.display(), "network record refused: {e}");
            return None;
        }
    };
    let meta = opened.metadata().ok()?;
    let uid = nix::unistd::geteuid().as_raw();
    if !meta.is_file() || (meta.uid() != 0 && meta.uid() != uid) {
        tracing::warn!(
            record = %record.display(),
            owner = meta.uid(),
            "network record refused: Cube did not write it (its device is not released by name)"
        );
        return None;
    }
    let mut name = String::new();
    opened.take(256).read_to_string(&mut name).ok()?;
    Some(name)
}

/// Releases the device recorded in a stale sandbox's directory (its supervisor is
/// gone); nothing to do when none is recorded, the record is not one Cube wrote
/// ([`read_record`]), or the pool already let it go.
pub fn release_recorded(dir: &Path) -> Result<()> {
    let record = SandboxDir::new(dir).network_record();
    let Some(name) = read_record(&record) else {
        return Ok(());
    };
    let (pool, _lock) = open_pool()?;
    match pool.release_by_name(name.trim()) {
        Ok(()) | Err(PoolError::NotAttached(_)) => {}
        Err(e) => return Err(e.into()),
    }
    // A VM's TAP went back to the pool, which keeps none free.
    pool.trim()?;
    let _ = std::fs::remove_file(&record);
    Ok(())
}
