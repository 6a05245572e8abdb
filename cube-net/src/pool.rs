//! The device pool: veth pairs (jail engine) and TAPs (VM engine) created ahead of
//! time, handed to sandboxes with their datapath state, taken back on release, and
//! rebuilt from what is on the host after a crash.
//!
//! Device names: `<prefix><slot>h` (host end of a veth; its peer is `eth0` in the
//! sandbox's namespace), `<prefix><slot>t` (a TAP). Prepared namespaces are pinned
//! at `<run_dir>/<pool>/<slot>`, datapath maps at `<bpffs>/cube-net/<pool>/maps`,
//! attachments at `.../links`, so a fresh process finds everything a crashed one
//! left.
//!
//! TAPs go back to the pool on release. A veth does not: moving a device between
//! namespaces waits for an RCU barrier (20-35 ms measured here, against ~1 ms to
//! create a pair with its peer straight in the target namespace), and a namespace
//! a sandbox used may hold whatever it left there. So the pool keeps *prepared*
//! namespaces ready, each with its veth configured, for jails that can join one
//! ([`Pool::attach_prepared`]); a jail that made its own namespace gets a pair
//! created straight into it ([`Pool::attach_veth`]). Released veths are deleted
//! and [`Pool::refill`] makes new prepared ones off the create path.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::Ipv4Addr;
use std::ops::RangeInclusive;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::addressing::{GATEWAY_ADDR, GUEST_ADDR, GUEST_IFNAME, GUEST_PREFIX};
use crate::datapath::{
    self, ConfigRecord, CounterRecord, Datapath, DatapathError, ExposeEntry, ExposeKey, Hook,
    Program, SandboxRecord, SANDBOX_INTERNET,
};
use crate::netlink::{Link, NetlinkError, Rtnl};
use crate::netns::{Netns, NetnsError, NetnsRef};
use crate::policy::{EgressPolicy, Ipv4Cidr};
use crate::tap::{self, TapError};

/// Errors of the pool.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The configuration is unusable.
    #[error("bad pool configuration: {0}")]
    Config(String),
    /// bpffs is not mounted and could not be mounted.
    #[error("mount bpffs at {0}")]
    Bpffs(PathBuf, #[source] nix::Error),
    /// A state directory could not be made or removed.
    #[error("pool directory {0}")]
    Dir(PathBuf, #[source] io::Error),
    /// A sysctl of a pool device could not be written.
    #[error("sysctl {0}")]
    Sysctl(PathBuf, #[source] io::Error),
    /// A netlink request failed.
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    /// A network namespace could not be opened or entered.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// The datapath failed.
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    /// A TAP could not be created.
    #[error(transparent)]
    Tap(#[from] TapError),
    /// Another sandbox already exposes this host port.
    #[error("host port {0}/{1} is already exposed")]
    PortTaken(u16, Protocol),
    /// The device is not attached to a sandbox of this pool.
    #[error("{0} is not attached to a sandbox of this pool")]
    NotAttached(String),
    /// A device did not come up in time.
    #[error("{0} did not come up")]
    NotRunning(String),
    /// A pool lock was poisoned by a panic.
    #[error("pool lock poisoned")]
    Poisoned,
}

type Result<T> = std::result::Result<T, PoolError>;

/// Transport protocol of an exposed port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl Protocol {
    fn number(self) -> u8 {
        match self {
            Self::Tcp => libc::IPPROTO_TCP as u8,
            Self::Udp => libc::IPPROTO_UDP as u8,
        }
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
        })
    }
}

/// How a pool is sized and where it keeps its state.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Pool name: its pins live in `<bpffs>/cube-net/<name>`.
    pub name: String,
    /// Device name prefix (at most 8 characters; names are `<prefix><slot>h|g|t`).
    pub prefix: String,
    /// Prepared network namespaces kept ready, each with its veth configured
    /// inside (see [`Pool::attach_prepared`]).
    pub veths: usize,
    /// TAPs kept ready.
    pub taps: usize,
    /// Interfaces whose ingress carries replies and exposed ports to sandboxes.
    /// `None`: every interface with an IPv4 address except lo and pool devices.
    pub uplinks: Option<Vec<String>>,
    /// Source ports for NAT; keep it outside `net.ipv4.ip_local_port_range` so NAT
    /// never takes a port the host's own connections use.
    pub nat_ports: RangeInclusive<u16>,
    /// Flows each connection-tracking map holds (LRU: the least recently used
    /// flow makes room). Preallocated: about 100 bytes each, three maps. Fixed
    /// when the pool's maps are first made.
    pub max_flows: u32,
    /// Idle timeout of open TCP flows.
    pub tcp_timeout: Duration,
    /// Idle timeout of TCP flows after FIN or RST.
    pub tcp_closing_timeout: Duration,
    /// Idle timeout of UDP flows.
    pub udp_timeout: Duration,
    /// Where bpffs is (mounted there if it is not).
    pub bpffs: PathBuf,
    /// Where prepared namespaces are pinned: `<run_dir>/<name>/<slot>`.
    pub run_dir: PathBuf,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            name: "default".to_string(),
            prefix: "cube".to_string(),
            veths: 16,
            taps: 0,
            uplinks: None,
            nat_ports: 61000..=65535,
            max_flows: 65536,
            tcp_timeout: Duration::from_secs(7200),
            tcp_closing_timeout: Duration::from_secs(10),
            udp_timeout: Duration::from_secs(60),
            bpffs: PathBuf::from("/sys/fs/bpf"),
            run_dir: PathBuf::from("/run/cube-net"),
        }
    }
}

impl PoolConfig {
    fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(PoolError::Config(why));
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return bad(format!(
                "name {:?}: use letters, digits, '-' and '_'",
                self.name
            ));
        }
        if self.prefix.is_empty()
            || self.prefix.len() > 8
            || !self
                .prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-')
        {
            return bad(format!(
                "prefix {:?}: 1 to 8 letters, digits or '-'",
                self.prefix
            ));
        }
        if self.veths + self.taps > 65536 {
            return bad("more than 65536 devices".to_string());
        }
        if self.max_flows < 64 {
            return bad(format!("max_flows {}: at least 64", self.max_flows));
        }
        if self.nat_ports.is_empty() || *self.nat_ports.start() < 1024 {
            return bad(format!(
                "NAT ports {:?}: a non-empty range above 1023",
                self.nat_ports
            ));
        }
        Ok(())
    }

    /// Where the pool's maps, programs and links are pinned in bpffs.
    pub fn pin_dir(&self) -> PathBuf {
        self.bpffs.join("cube-net").join(&self.name)
    }

    fn netns_dir(&self) -> PathBuf {
        self.run_dir.join(&self.name)
    }
}

/// The engine a device serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// A veth pair; its guest end goes into a jail's network namespace.
    Veth,
    /// A TAP; a VMM opens it by name.
    Tap,
}

#[derive(Debug, Clone)]
struct Slot {
    number: u32,
    kind: DeviceKind,
    host: Link,
    /// Pin of the namespace the pool made for this veth (prepared slots).
    netns_pin: Option<PathBuf>,
}

/// A sandbox's network: which device it holds and what the guest side is.
#[derive(Debug)]
pub struct Attachment {
    slot: Slot,
    guest_mac: [u8; 6],
    netns: Option<Netns>,
}

impl Attachment {
    /// Host-side device name (a veth's host end or the TAP).
    pub fn host_ifname(&self) -> &str {
        &self.slot.host.name
    }

    /// Host-side ifindex, the datapath's key for this sandbox.
    pub fn host_ifindex(&self) -> u32 {
        self.slot.host.index
    }

    /// The device's kind.
    pub fn kind(&self) -> DeviceKind {
        self.slot.kind
    }

    /// The guest's MAC address.
    pub fn guest_mac(&self) -> [u8; 6] {
        self.guest_mac
    }

    /// The sandbox's network namespace (veth only): a jail joins it with
    /// setns(2) when the pool prepared it.
    pub fn netns(&self) -> Option<&Netns> {
        self.netns.as_ref()
    }

    /// Where a prepared namespace is pinned (for a jail in another process).
    pub fn netns_pin(&self) -> Option<&Path> {
        self.slot.netns_pin.as_deref()
    }

    /// The TAP a VMM opens (with [`tap::TAP_FLAGS`]); `None` for a veth.
    pub fn tap_name(&self) -> Option<&str> {
        (self.slot.kind == DeviceKind::Tap).then_some(self.slot.host.name.as_str())
    }
}

/// A sandbox's traffic as the datapath counted it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Packets the sandbox sent.
    pub tx_packets: u64,
    /// Bytes the sandbox sent.
    pub tx_bytes: u64,
    /// Packets delivered to the sandbox.
    pub rx_packets: u64,
    /// Bytes delivered to the sandbox.
    pub rx_bytes: u64,
    /// Packets from the sandbox the policy or parser dropped.
    pub dropped: u64,
}

impl From<CounterRecord> for Counters {
    fn from(record: CounterRecord) -> Self {
        Self {
            tx_packets: record.tx_packets,
            tx_bytes: record.tx_bytes,
            rx_packets: record.rx_packets,
            rx_bytes: record.rx_bytes,
            dropped: record.dropped,
        }
    }
}

/// What is left of one sandbox device in the datapath (all zero after release).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Residue {
    /// Programs attached by tcx to the device's hooks.
    pub programs: usize,
    /// Link pins for the device.
    pub pins: usize,
    /// Policy entries.
    pub policy_entries: usize,
    /// Exposed ports.
    pub exposed_ports: usize,
    /// Connection-tracking entries.
    pub flows: usize,
    /// Whether the device is still registered as a sandbox.
    pub registered: bool,
}

struct State {
    datapath: Datapath,
    free_veths: Vec<Slot>,
    free_taps: Vec<Slot>,
    attached: BTreeMap<String, Slot>,
    /// Slot numbers of devices being made outside the lock.
    reserved: BTreeSet<u32>,
    /// Slot numbers another process's handle on the pool took since this one
    /// adopted the host's devices.
    foreign: BTreeSet<u32>,
    uplinks: Vec<String>,
}

/// A pool of sandbox network devices and the datapath serving them.
pub struct Pool {
    config: PoolConfig,
    record: ConfigRecord,
    host_netns: Netns,
    state: Mutex<State>,
}

fn mac6(mac: &[u8]) -> [u8; 6] {
    let mut out = [0u8; 6];
    let n = mac.len().min(6);
    out[..n].copy_from_slice(&mac[..n]);
    out
}

/// Mounts bpffs at `path` unless it is already there.
fn ensure_bpffs(path: &Path) -> Result<()> {
    if let Ok(stat) = nix::sys::statfs::statfs(path) {
        if stat.filesystem_type() == nix::sys::statfs::FsType(libc::BPF_FS_MAGIC) {
            return Ok(());
        }
    }
    std::fs::create_dir_all(path).map_err(|error| PoolError::Dir(path.to_path_buf(), error))?;
    nix::mount::mount(
        Some("bpf"),
        path,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        Some("mode=0700"),
    )
    .map_err(|error| PoolError::Bpffs(path.to_path_buf(), error))
}

fn write_sysctl(path: PathBuf, value: &str) -> Result<()> {
    std::fs::write(&path, value).map_err(|error| PoolError::Sysctl(path, error))
}

impl Pool {
    /// Opens (or, after a crash, rebuilds) the pool in the calling thread's network
    /// namespace: loads the datapath (reusing this build's pinned programs), attaches
    /// it to the uplinks and lo where this build's program is not attached already,
    /// adopts the pool devices already on the host, and creates the missing ones.
    pub fn open(config: PoolConfig) -> Result<Self> {
        config.validate()?;
        ensure_bpffs(&config.bpffs)?;
        let pin_dir = config.pin_dir();
        std::fs::create_dir_all(&pin_dir)
            .map_err(|error| PoolError::Dir(pin_dir.clone(), error))?;
        let host_netns = Netns::current()?;
        let mut rtnl = Rtnl::open()?;
        let lo = rtnl.link("lo")?;
        let record = ConfigRecord {
            tcp_timeout_ns: config.tcp_timeout.as_nanos() as u64,
            tcp_closing_timeout_ns: config.tcp_closing_timeout.as_nanos() as u64,
            udp_timeout_ns: config.udp_timeout.as_nanos() as u64,
            guest_addr: u32::from(GUEST_ADDR).to_be(),
            gateway_addr: u32::from(GATEWAY_ADDR).to_be(),
            nat_port_min: *config.nat_ports.start(),
            nat_port_max: *config.nat_ports.end(),
            lo_ifindex: lo.index,
        };
        let mut datapath = Datapath::load(&pin_dir, config.max_flows)?;
        datapath.set_config(&record)?;

        let pool = Self {
            config,
            record,
            host_netns,
            state: Mutex::new(State {
                datapath,
                free_veths: Vec::new(),
                free_taps: Vec::new(),
                attached: BTreeMap::new(),
                reserved: BTreeSet::new(),
                foreign: BTreeSet::new(),
                uplinks: Vec::new(),
            }),
        };
        pool.rebuild(&mut rtnl)?;
        pool.refresh_host()?;
        pool.refill()?;
        Ok(pool)
    }

    /// Runs `work` in the pool's host namespace: netlink, interface names and
    /// /proc/sys/net all resolve in the caller's namespace, and must mean the host's.
    fn in_host<T: Send>(&self, work: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        self.host_netns.enter(work)?
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| PoolError::Poisoned)
    }

    /// The pool's configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Parses a pool device name into (slot, suffix).
    fn parse_name(&self, name: &str) -> Option<(u32, char)> {
        parse_device_name(&self.config.prefix, name)
    }

    /// Adopts the devices on the host: free ones back into the pool, attached ones
    /// (registered in the datapath) as attached, broken ones deleted; and clears
    /// datapath state of devices that are gone.
    fn rebuild(&self, rtnl: &mut Rtnl) -> Result<()> {
        let mut state = self.lock()?;
        let links = rtnl.links()?;
        let registered: BTreeSet<u32> = state
            .datapath
            .sandboxes()?
            .into_iter()
            .map(|(ifindex, _)| ifindex)
            .collect();
        let netns_dir = self.config.netns_dir();
        let mut live = BTreeSet::new();
        let mut kept_pins = BTreeSet::new();
        for link in links {
            let Some((number, suffix)) = self.parse_name(&link.name) else {
                continue;
            };
            let pin = netns_dir.join(number.to_string());
            let prepared = suffix == 'h' && NetnsRef::Path(pin.clone()).open().is_ok();
            let slot = Slot {
                number,
                kind: if suffix == 't' {
                    DeviceKind::Tap
                } else {
                    DeviceKind::Veth
                },
                host: link,
                netns_pin: prepared.then(|| pin.clone()),
            };
            let attached = registered.contains(&slot.host.index);
            match (slot.kind, attached) {
                (_, true) => {
                    live.insert(slot.host.index);
                    if prepared {
                        kept_pins.insert(pin);
                    }
                    state.attached.insert(slot.host.name.clone(), slot);
                }
                (DeviceKind::Tap, false) => state.free_taps.push(slot),
                (DeviceKind::Veth, false) if prepared => {
                    kept_pins.insert(pin);
                    state.free_veths.push(slot);
                }
                // A veth into some other namespace whose sandbox was never
                // registered (or released halfway): nothing can use it.
                (DeviceKind::Veth, false) => rtnl.delete_link(slot.host.index)?,
            }
        }
        for ifindex in registered.difference(&live) {
            state.datapath.purge(*ifindex)?;
        }
        // Namespace pins whose veth is gone.
        if let Ok(entries) = std::fs::read_dir(&netns_dir) {
            for entry in entries.filter_map(|entry| entry.ok()) {
                if !kept_pins.contains(&entry.path()) {
                    Netns::remove_pin(&entry.path())?;
                }
            }
        }
        // Link pins of devices that are gone; the uplinks are re-pinned later.
        let known: BTreeSet<String> = state
            .attached
            .keys()
            .cloned()
            .chain(state.free_veths.iter().map(|slot| slot.host.name.clone()))
            .chain(state.free_taps.iter().map(|slot| slot.host.name.clone()))
            .collect();
        let pins = state.datapath.link_pins()?;
        for pin in &pins {
            let device = pin.rsplit_once('-').map(|(device, _)| device).unwrap_or("");
            if self.parse_name(device).is_some() && !known.contains(device) {
                state.datapath.remove_link_pin(pin)?;
            }
        }
        // Free devices whose program went missing (a crash between make and arm).
        let unarmed: Vec<Slot> = state
            .free_veths
            .iter()
            .chain(state.free_taps.iter())
            .filter(|slot| {
                let pin = state.datapath.link_pin(&slot.host.name, Hook::Ingress);
                datapath::tcx_supported() && !pin.exists()
            })
            .cloned()
            .collect();
        for slot in unarmed {
            Self::arm(&mut state, &slot)?;
        }
        Ok(())
    }

    /// Re-reads the host's addresses (refused to sandboxes by default, and where
    /// exposed ports are served) and attaches the uplink programs where this datapath
    /// build's are not attached already.
    pub fn refresh_host(&self) -> Result<()> {
        self.in_host(|| self.refresh_host_here())
    }

    fn refresh_host_here(&self) -> Result<()> {
        let mut rtnl = Rtnl::open()?;
        let links = rtnl.links()?;
        let addresses = rtnl.ipv4_addresses()?;
        let mut state = self.lock()?;
        let host_addrs: Vec<Ipv4Addr> = addresses.iter().map(|(_, addr, _)| *addr).collect();
        state.datapath.set_host_addrs(&host_addrs)?;
        let uplinks: Vec<String> = match &self.config.uplinks {
            Some(uplinks) => uplinks.clone(),
            None => links
                .iter()
                .filter(|link| link.name != "lo" && self.parse_name(&link.name).is_none())
                .filter(|link| addresses.iter().any(|(index, _, _)| *index == link.index))
                .map(|link| link.name.clone())
                .collect(),
        };
        // Hooks this datapath build attached before stay as they are: re-attaching
        // costs tens of ms per open and leaves the uplink briefly without a program.
        let hooks = uplinks
            .iter()
            .map(|uplink| (uplink.as_str(), Hook::Ingress))
            .chain([("lo", Hook::Egress)]);
        for (ifname, hook) in hooks {
            if !state
                .datapath
                .attached_current(Program::ToHost, ifname, hook)
            {
                state.datapath.attach(Program::ToHost, ifname, hook)?;
            }
        }
        // Packets the datapath hands to the host's own stack come in through lo
        // with a host address as source (a sandbox's NAT address, or the host's own
        // address for replies from exposed ports); without accept_local the
        // kernel would drop them as martians. Only lo is affected.
        write_sysctl(
            PathBuf::from("/proc/sys/net/ipv4/conf/lo/accept_local"),
            "1",
        )?;
        state.uplinks = uplinks;
        Ok(())
    }

    /// Re-reads the host's addresses into the datapath: done before every policy is
    /// put in force, so that an exact allow of an address the host gained since the
    /// pool opened works. (Until then such an address is refused like a broadcast
    /// address: the datapath hands the host's stack only the addresses it knows.)
    fn refresh_host_addrs(&self) -> Result<()> {
        self.in_host(|| {
            let addresses = Rtnl::open()?.ipv4_addresses()?;
            let host_addrs: Vec<Ipv4Addr> = addresses.iter().map(|(_, addr, _)| *addr).collect();
            self.lock()?.datapath.set_host_addrs(&host_addrs)?;
            Ok(())
        })
    }

    fn used_numbers(state: &State) -> BTreeSet<u32> {
        state
            .free_veths
            .iter()
            .chain(state.free_taps.iter())
            .chain(state.attached.values())
            .map(|slot| slot.number)
            .chain(state.reserved.iter().copied())
            .chain(state.foreign.iter().copied())
            .collect()
    }

    /// Creates veth `<prefix><number>h` with its peer as eth0 in `target`,
    /// configured there (address, route, no IPv6), host end up and forwarding.
    fn new_veth_into(&self, rtnl: &mut Rtnl, number: u32, target: &Netns) -> Result<Link> {
        let host_name = format!("{}{number}h", self.config.prefix);
        rtnl.add_veth(&host_name, GUEST_IFNAME, Some(target.fd().as_raw_fd()))?;
        let configured = (|| -> Result<Link> {
            let host = rtnl.link(&host_name)?;
            // The datapath's FIB lookups need forwarding on the device packets enter by.
            write_sysctl(
                PathBuf::from(format!("/proc/sys/net/ipv4/conf/{host_name}/forwarding")),
                "1",
            )?;
            rtnl.set_up(host.index, true)?;
            target.run(|| -> Result<()> {
                let mut inside = Rtnl::open()?;
                let guest = inside.link(GUEST_IFNAME)?;
                // The datapath carries IPv4 only; without IPv6 the guest does not
                // send router solicitations that would only be dropped.
                write_sysctl(
                    PathBuf::from(format!(
                        "/proc/sys/net/ipv6/conf/{GUEST_IFNAME}/disable_ipv6"
                    )),
                    "1",
                )?;
                inside.add_address(guest.index, GUEST_ADDR, GUEST_PREFIX)?;
                inside.set_up(guest.index, true)?;
                inside.add_default_route(guest.index, GATEWAY_ADDR)?;
                Ok(())
            })??;
            // Read again: the MAC and state are final now.
            Ok(rtnl.link(&host_name)?)
        })();
        if configured.is_err() {
            if let Ok(host) = rtnl.link(&host_name) {
                let _ = rtnl.delete_link(host.index);
            }
        }
        configured
    }

    /// A prepared slot: a new namespace (lo up) pinned under the run directory,
    /// with its veth configured inside.
    fn new_prepared(&self, rtnl: &mut Rtnl, number: u32) -> Result<Slot> {
        let dir = self.config.netns_dir();
        std::fs::create_dir_all(&dir).map_err(|error| PoolError::Dir(dir.clone(), error))?;
        let pin = dir.join(number.to_string());
        let netns = Netns::create_pinned(&pin)?;
        let made = (|| -> Result<Link> {
            netns.run(|| -> Result<()> {
                let mut inside = Rtnl::open()?;
                let lo = inside.link("lo")?;
                inside.set_up(lo.index, true)?;
                Ok(())
            })??;
            self.new_veth_into(rtnl, number, &netns)
        })();
        match made {
            Ok(host) => Ok(Slot {
                number,
                kind: DeviceKind::Veth,
                host,
                netns_pin: Some(pin),
            }),
            Err(error) => {
                let _ = Netns::remove_pin(&pin);
                Err(error)
            }
        }
    }

    fn new_tap(&self, rtnl: &mut Rtnl, number: u32) -> Result<Slot> {
        let name = format!("{}{number}t", self.config.prefix);
        tap::create_persistent(&name)?;
        let host = rtnl.link(&name)?;
        write_sysctl(
            PathBuf::from(format!("/proc/sys/net/ipv4/conf/{name}/forwarding")),
            "1",
        )?;
        rtnl.set_up(host.index, true)?;
        Ok(Slot {
            number,
            kind: DeviceKind::Tap,
            host,
            netns_pin: None,
        })
    }

    fn next_number(state: &State) -> u32 {
        let used = Self::used_numbers(state);
        (0..)
            .find(|number| !used.contains(number))
            .unwrap_or(u32::MAX)
    }

    /// Creates devices until the configured number are free. Call it off the
    /// create path (after attaches) to keep attaching fast.
    pub fn refill(&self) -> Result<()> {
        self.in_host(|| self.refill_here())
    }

    fn refill_here(&self) -> Result<()> {
        let mut rtnl = Rtnl::open()?;
        loop {
            let mut state = self.lock()?;
            let kind = if state.free_veths.len() < self.config.veths {
                DeviceKind::Veth
            } else if state.free_taps.len() < self.config.taps {
                DeviceKind::Tap
            } else {
                return Ok(());
            };
            let number = Self::next_number(&state);
            match kind {
                DeviceKind::Veth => {
                    let slot = self.new_prepared(&mut rtnl, number)?;
                    if let Err(error) = Self::arm(&mut state, &slot) {
                        self.discard(slot);
                        return Err(error);
                    }
                    state.free_veths.push(slot);
                }
                DeviceKind::Tap => {
                    let slot = self.new_tap(&mut rtnl, number)?;
                    if let Err(error) = Self::arm(&mut state, &slot) {
                        self.discard(slot);
                        return Err(error);
                    }
                    state.free_taps.push(slot);
                }
            }
        }
    }

    /// Deletes free devices beyond the configured sizes (released devices return
    /// to the pool, so it can grow past them).
    pub fn trim(&self) -> Result<usize> {
        self.in_host(|| self.trim_here())
    }

    fn trim_here(&self) -> Result<usize> {
        let mut rtnl = Rtnl::open()?;
        let mut deleted = 0;
        loop {
            let slot = {
                let mut state = self.lock()?;
                let slot = if state.free_veths.len() > self.config.veths {
                    state.free_veths.pop()
                } else if state.free_taps.len() > self.config.taps {
                    state.free_taps.pop()
                } else {
                    None
                };
                // A free device is armed (see `arm`): its link pin would outlive it.
                if let Some(slot) = &slot {
                    state
                        .datapath
                        .detach(Program::FromSandbox, &slot.host.name, Hook::Ingress)?;
                }
                slot
            };
            let Some(slot) = slot else {
                return Ok(deleted);
            };
            rtnl.delete_link(slot.host.index)?;
            if let Some(pin) = &slot.netns_pin {
                Netns::remove_pin(pin)?;
            }
            deleted += 1;
        }
    }

    /// Free devices of each kind (veths, TAPs).
    pub fn free(&self) -> Result<(usize, usize)> {
        let state = self.lock()?;
        Ok((state.free_veths.len(), state.free_taps.len()))
    }

    /// Host-side names of the devices attached to sandboxes.
    pub fn attached(&self) -> Result<Vec<String>> {
        Ok(self.lock()?.attached.keys().cloned().collect())
    }

    /// The uplinks the datapath serves.
    pub fn uplinks(&self) -> Result<Vec<String>> {
        Ok(self.lock()?.uplinks.clone())
    }

    fn take_slot(&self, kind: DeviceKind) -> Result<Slot> {
        let mut state = self.lock()?;
        let free = match kind {
            DeviceKind::Veth => state.free_veths.pop(),
            DeviceKind::Tap => state.free_taps.pop(),
        };
        if let Some(slot) = free {
            return Ok(slot);
        }
        // Pool empty: make one on the create path rather than fail.
        tracing::warn!(pool = %self.config.name, ?kind, "device pool empty, creating a device on demand");
        let number = Self::next_number(&state);
        // Reserve the number while the lock is held.
        let mut rtnl = Rtnl::open()?;
        let slot = match kind {
            DeviceKind::Veth => self.new_prepared(&mut rtnl, number)?,
            DeviceKind::Tap => self.new_tap(&mut rtnl, number)?,
        };
        if let Err(error) = Self::arm(&mut state, &slot) {
            drop(state);
            self.discard(slot);
            return Err(error);
        }
        Ok(slot)
    }

    /// Attaches the datapath to a slot's device while it waits in the pool: the
    /// attach (a tcx link waits for an RCU grace period) stays off the create path,
    /// and the program drops every packet until a sandbox is registered.
    fn arm(state: &mut State, slot: &Slot) -> Result<()> {
        state
            .datapath
            .attach(Program::FromSandbox, &slot.host.name, Hook::Ingress)?;
        Ok(())
    }

    fn give_back(&self, slot: Slot) {
        if let Ok(mut state) = self.lock() {
            match slot.kind {
                DeviceKind::Veth => state.free_veths.push(slot),
                DeviceKind::Tap => state.free_taps.push(slot),
            }
        }
    }

    /// Gives a jail its network: a veth from the pool whose guest end becomes
    /// `eth0` (169.254.0.2/30, default route via 169.254.0.1) in `netns`, with
    /// `policy` in force.
    pub fn attach_veth(&self, netns: &NetnsRef, policy: &EgressPolicy) -> Result<Attachment> {
        self.in_host(|| self.attach_veth_here(netns, policy))
    }

    fn attach_veth_here(&self, netns: &NetnsRef, policy: &EgressPolicy) -> Result<Attachment> {
        let target = netns.open()?;
        let mut rtnl = Rtnl::open()?;
        // Several processes hold handles on one host pool (each jail supervisor its
        // own), and a handle knows the devices that were there when it opened: a
        // name another one took since is skipped, up to this many times.
        const MAX_TAKEN_ELSEWHERE: usize = 64;
        let mut tries = 0;
        let (mut state, number, made) = loop {
            // The number is taken under the lock; the device is made outside it.
            let number = {
                let mut state = self.lock()?;
                let number = Self::next_number(&state);
                state.reserved.insert(number);
                number
            };
            let made = self.new_veth_into(&mut rtnl, number, &target);
            let mut state = self.lock()?;
            state.reserved.remove(&number);
            match made {
                Err(PoolError::Netlink(NetlinkError::Request { source, .. }))
                    if source.raw_os_error() == Some(libc::EEXIST)
                        && tries < MAX_TAKEN_ELSEWHERE =>
                {
                    state.foreign.insert(number);
                    tries += 1;
                }
                made => break (state, number, made),
            }
        };
        let slot = Slot {
            number,
            kind: DeviceKind::Veth,
            host: made?,
            netns_pin: None,
        };
        if let Err(error) = Self::arm(&mut state, &slot) {
            drop(state);
            self.discard(slot);
            return Err(error);
        }
        drop(state);
        let attachment = Attachment {
            guest_mac: [0; 6],
            slot,
            netns: Some(target),
        };
        self.hand_out(attachment, policy)
    }

    /// Gives a jail its network in a namespace the pool prepared ahead of time
    /// (eth0 169.254.0.2/30 via 169.254.0.1, lo up): the fastest attach. The jail
    /// joins [`Attachment::netns`] (or the file at [`Attachment::netns_pin`]) with
    /// setns(2) instead of creating its own network namespace.
    pub fn attach_prepared(&self, policy: &EgressPolicy) -> Result<Attachment> {
        self.in_host(|| self.attach_prepared_here(policy))
    }

    fn attach_prepared_here(&self, policy: &EgressPolicy) -> Result<Attachment> {
        let slot = self.take_slot(DeviceKind::Veth)?;
        let netns = match &slot.netns_pin {
            Some(pin) => NetnsRef::Path(pin.clone()).open(),
            None => return Err(PoolError::NotAttached(slot.host.name.clone())),
        };
        let netns = match netns {
            Ok(netns) => netns,
            Err(error) => {
                self.discard(slot);
                return Err(error.into());
            }
        };
        let attachment = Attachment {
            guest_mac: [0; 6],
            slot,
            netns: Some(netns),
        };
        self.hand_out(attachment, policy)
    }

    /// Finishes a veth attach: the guest's MAC, a running host end, the datapath.
    fn hand_out(&self, mut attachment: Attachment, policy: &EgressPolicy) -> Result<Attachment> {
        let ready = (|| -> Result<()> {
            let netns = attachment
                .netns
                .as_ref()
                .ok_or_else(|| PoolError::NotAttached(attachment.slot.host.name.clone()))?;
            let guest =
                netns.run(|| -> Result<Link> { Ok(Rtnl::open()?.link(GUEST_IFNAME)?) })??;
            attachment.guest_mac = mac6(&guest.mac);
            // The host end's qdisc is activated by linkwatch, asynchronously, once the
            // guest end brings the carrier up; until then packets into the sandbox
            // would be dropped. The kernel sets operstate in the same step.
            self.wait_running(&attachment.slot.host.name)?;
            self.enable(&attachment, policy)
        })();
        match ready {
            Ok(()) => Ok(attachment),
            Err(error) => {
                let _ = self.release_here(attachment);
                Err(error)
            }
        }
    }

    /// Deletes a slot's device and namespace pin, on error paths.
    fn discard(&self, slot: Slot) {
        if let Ok(mut rtnl) = Rtnl::open() {
            let _ = rtnl.delete_link(slot.host.index);
        }
        if let Some(pin) = &slot.netns_pin {
            let _ = Netns::remove_pin(pin);
        }
    }

    fn wait_running(&self, ifname: &str) -> Result<()> {
        let mut rtnl = Rtnl::open()?;
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            if rtnl.link(ifname)?.running {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(PoolError::NotRunning(ifname.to_string()));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Gives a VM its network: a TAP from the pool for a guest NIC with `guest_mac`
    /// (the guest configures 169.254.0.2/30 via 169.254.0.1 itself).
    pub fn attach_tap(&self, guest_mac: [u8; 6], policy: &EgressPolicy) -> Result<Attachment> {
        self.in_host(|| self.attach_tap_here(guest_mac, policy))
    }

    fn attach_tap_here(&self, guest_mac: [u8; 6], policy: &EgressPolicy) -> Result<Attachment> {
        let slot = self.take_slot(DeviceKind::Tap)?;
        let attachment = Attachment {
            slot,
            guest_mac,
            netns: None,
        };
        match self.enable(&attachment, policy) {
            Ok(()) => Ok(attachment),
            Err(error) => {
                let _ = self.release_here(attachment);
                Err(error)
            }
        }
    }

    /// Registers the device in the datapath and attaches the program to it.
    fn enable(&self, attachment: &Attachment, policy: &EgressPolicy) -> Result<()> {
        let ifindex = attachment.host_ifindex();
        self.refresh_host_addrs()?;
        let mut state = self.lock()?;
        // A slot's entries went with its last release (or with the rebuild).
        state.datapath.reset_counters(ifindex)?;
        apply_policy(&mut state.datapath, ifindex, policy)?;
        state.datapath.set_sandbox(
            ifindex,
            &SandboxRecord {
                guest_mac: attachment.guest_mac,
                host_mac: mac6(&attachment.slot.host.mac),
                flags: if policy.internet { SANDBOX_INTERNET } else { 0 },
            },
        )?;
        state.attached.insert(
            attachment.host_ifname().to_string(),
            attachment.slot.clone(),
        );
        Ok(())
    }

    /// Puts a device attached ahead of time (with [`EgressPolicy::offline`], before
    /// any sandbox asked for it) into service: its counters start from zero and
    /// `policy` replaces the deny-everything one. Only map writes: this is what is
    /// left of an attach on the create path.
    pub fn activate(&self, attachment: &Attachment, policy: &EgressPolicy) -> Result<()> {
        let ifindex = attachment.host_ifindex();
        {
            let mut state = self.lock()?;
            if !state.attached.contains_key(attachment.host_ifname()) {
                return Err(PoolError::NotAttached(attachment.host_ifname().to_string()));
            }
            state.datapath.reset_counters(ifindex)?;
        }
        self.set_policy(attachment, policy)
    }

    /// Replaces a live sandbox's egress policy; new flows see it at once.
    pub fn set_policy(&self, attachment: &Attachment, policy: &EgressPolicy) -> Result<()> {
        let ifindex = attachment.host_ifindex();
        self.refresh_host_addrs()?;
        let mut state = self.lock()?;
        if !state.attached.contains_key(attachment.host_ifname()) {
            return Err(PoolError::NotAttached(attachment.host_ifname().to_string()));
        }
        apply_policy(&mut state.datapath, ifindex, policy)?;
        state.datapath.set_sandbox(
            ifindex,
            &SandboxRecord {
                guest_mac: attachment.guest_mac,
                host_mac: mac6(&attachment.slot.host.mac),
                flags: if policy.internet { SANDBOX_INTERNET } else { 0 },
            },
        )?;
        Ok(())
    }

    /// Exposes `guest_port` of the sandbox as `host_port` on the host's addresses
    /// (not on 127.0.0.0/8), to the outside, to the host and to sandboxes whose
    /// policy allows the host address.
    pub fn expose(
        &self,
        attachment: &Attachment,
        host_port: u16,
        guest_port: u16,
        protocol: Protocol,
    ) -> Result<()> {
        let mut state = self.lock()?;
        if !state.attached.contains_key(attachment.host_ifname()) {
            return Err(PoolError::NotAttached(attachment.host_ifname().to_string()));
        }
        let key = ExposeKey {
            host_port: host_port.to_be(),
            proto: protocol.number(),
            pad: 0,
        };
        let entry = ExposeEntry {
            ifindex: attachment.host_ifindex(),
            guest_port: guest_port.to_be(),
            pad: 0,
        };
        if !state.datapath.expose(key, entry)? {
            return Err(PoolError::PortTaken(host_port, protocol));
        }
        Ok(())
    }

    /// Withdraws an exposed port of the sandbox.
    pub fn unexpose(
        &self,
        attachment: &Attachment,
        host_port: u16,
        protocol: Protocol,
    ) -> Result<()> {
        let key = ExposeKey {
            host_port: host_port.to_be(),
            proto: protocol.number(),
            pad: 0,
        };
        self.lock()?
            .datapath
            .unexpose(key, attachment.host_ifindex())?;
        Ok(())
    }

    /// The allow and deny lists the datapath holds for the sandbox now (what is in
    /// force, the default deny ranges included), each sorted.
    pub fn policy_in_force(
        &self,
        attachment: &Attachment,
    ) -> Result<(Vec<Ipv4Cidr>, Vec<Ipv4Cidr>)> {
        let (allow, deny) = self
            .lock()?
            .datapath
            .policy_entries(attachment.host_ifindex())?;
        let cidrs = |list: Vec<datapath::Cidr>| {
            let mut cidrs: Vec<Ipv4Cidr> = list
                .into_iter()
                .filter_map(|(addr, prefix)| Ipv4Cidr::new(addr, prefix).ok())
                .collect();
            cidrs.sort();
            cidrs
        };
        Ok((cidrs(allow), cidrs(deny)))
    }

    /// The sandbox's traffic counters.
    pub fn counters(&self, attachment: &Attachment) -> Result<Counters> {
        Ok(self
            .lock()?
            .datapath
            .counters(attachment.host_ifindex())?
            .into())
    }

    /// Deletes connection-tracking entries idle past their timeouts; returns how
    /// many went. Run it periodically (the maps are LRU, so it only frees room).
    pub fn sweep_conntrack(&self) -> Result<usize> {
        let now = datapath::monotonic_now_ns();
        Ok(self.lock()?.datapath.sweep(&self.record, now)?)
    }

    /// What the datapath still holds for a device (all zero once released).
    pub fn residue(&self, host_ifname: &str, host_ifindex: u32) -> Result<Residue> {
        self.in_host(|| self.residue_here(host_ifname, host_ifindex))
    }

    fn residue_here(&self, host_ifname: &str, host_ifindex: u32) -> Result<Residue> {
        let mut state = self.lock()?;
        let (allow, deny) = state.datapath.policy_entries(host_ifindex)?;
        let pins = state
            .datapath
            .link_pins()?
            .into_iter()
            .filter(|pin| pin.rsplit_once('-').map(|(device, _)| device) == Some(host_ifname))
            .count();
        let programs = match datapath::tcx_programs(host_ifname, Hook::Ingress) {
            Ok(programs) => programs,
            // The device itself is gone: nothing can be attached to it.
            Err(_) if Rtnl::open()?.link(host_ifname).is_err() => 0,
            Err(error) => return Err(error.into()),
        };
        Ok(Residue {
            programs,
            pins,
            policy_entries: allow.len() + deny.len(),
            exposed_ports: state.datapath.exposed(host_ifindex)?.len(),
            flows: state.datapath.flows(host_ifindex)?,
            registered: state
                .datapath
                .sandboxes()?
                .iter()
                .any(|(ifindex, _)| *ifindex == host_ifindex),
        })
    }

    /// Takes a sandbox's network back: detaches the program, removes every map
    /// entry, moves a veth's guest end home and returns the device to the pool (or,
    /// when the device is beyond reuse, deletes it and the next refill replaces it).
    pub fn release(&self, attachment: Attachment) -> Result<()> {
        self.in_host(|| self.release_here(attachment))
    }

    fn release_here(&self, attachment: Attachment) -> Result<()> {
        let Attachment { slot, netns, .. } = attachment;
        self.release_slot(slot, netns)
    }

    /// Releases a device by its host-side name, as a process that did not attach it
    /// does (after a restart; see [`Pool::attached`]).
    pub fn release_by_name(&self, host_ifname: &str) -> Result<()> {
        self.in_host(|| {
            let slot = self
                .lock()?
                .attached
                .get(host_ifname)
                .cloned()
                .ok_or_else(|| PoolError::NotAttached(host_ifname.to_string()))?;
            self.release_slot(slot, None)
        })
    }

    fn release_slot(&self, slot: Slot, netns: Option<Netns>) -> Result<()> {
        {
            let mut state = self.lock()?;
            state.attached.remove(&slot.host.name);
            // A TAP goes back to the pool armed (see `arm`); a veth is deleted below.
            if slot.kind == DeviceKind::Veth {
                state
                    .datapath
                    .detach(Program::FromSandbox, &slot.host.name, Hook::Ingress)?;
            }
            state.datapath.purge(slot.host.index)?;
        }
        match slot.kind {
            DeviceKind::Tap => {
                self.give_back(slot);
                Ok(())
            }
            DeviceKind::Veth => {
                // A veth is never reused: moving it back would wait for an RCU
                // barrier, and a namespace a sandbox used may hold its leftovers.
                // Deleting the host end takes the guest end with it.
                drop(netns);
                match Rtnl::open()?.delete_link(slot.host.index) {
                    Ok(()) => {}
                    Err(NetlinkError::Request { source, .. })
                        if source.raw_os_error() == Some(libc::ENODEV) => {}
                    Err(error) => return Err(error.into()),
                }
                if let Some(pin) = &slot.netns_pin {
                    Netns::remove_pin(pin)?;
                }
                Ok(())
            }
        }
    }

    /// Removes the whole pool from the host: every device (attached or free),
    /// every attachment, map and pin.
    pub fn destroy(self) -> Result<()> {
        self.in_host(|| self.destroy_here())
    }

    fn destroy_here(&self) -> Result<()> {
        let mut rtnl = Rtnl::open()?;
        let mut guard = self.lock()?;
        let state = &mut *guard;
        let uplinks = std::mem::take(&mut state.uplinks);
        for uplink in &uplinks {
            state
                .datapath
                .detach(Program::ToHost, uplink, Hook::Ingress)?;
        }
        state.datapath.detach(Program::ToHost, "lo", Hook::Egress)?;
        let slots: Vec<Slot> = state
            .free_veths
            .drain(..)
            .chain(state.free_taps.drain(..))
            .chain(std::mem::take(&mut state.attached).into_values())
            .collect();
        for slot in slots {
            state
                .datapath
                .detach(Program::FromSandbox, &slot.host.name, Hook::Ingress)?;
            state.datapath.purge(slot.host.index)?;
            match rtnl.delete_link(slot.host.index) {
                Ok(()) => {}
                Err(NetlinkError::Request { source, .. })
                    if source.raw_os_error() == Some(libc::ENODEV) => {}
                Err(error) => return Err(error.into()),
            }
        }
        for pin in state.datapath.link_pins()? {
            state.datapath.remove_link_pin(&pin)?;
        }
        drop(guard);
        let netns_dir = self.config.netns_dir();
        if let Ok(entries) = std::fs::read_dir(&netns_dir) {
            for entry in entries.filter_map(|entry| entry.ok()) {
                Netns::remove_pin(&entry.path())?;
            }
        }
        match std::fs::remove_dir(&netns_dir) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(PoolError::Dir(netns_dir, error)),
        }
        let pin_dir = self.config.pin_dir();
        Datapath::unpin_maps(&pin_dir.join("maps"))?;
        Datapath::unpin_programs(&pin_dir.join("programs"))?;
        for dir in [pin_dir.join("maps"), pin_dir.join("links"), pin_dir.clone()] {
            match std::fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => return Err(PoolError::Dir(dir, error)),
            }
        }
        Ok(())
    }
}

/// Splits `<prefix><slot><h|g|t>` into (slot, suffix); `None` for other names.
fn parse_device_name(prefix: &str, name: &str) -> Option<(u32, char)> {
    let rest = name.strip_prefix(prefix)?;
    let suffix = rest.chars().last()?;
    let number = rest[..rest.len() - suffix.len_utf8()].parse::<u32>().ok()?;
    matches!(suffix, 'h' | 'g' | 't').then_some((number, suffix))
}

fn apply_policy(datapath: &mut Datapath, ifindex: u32, policy: &EgressPolicy) -> Result<()> {
    let allow: Vec<(Ipv4Addr, u8)> = policy
        .allow
        .iter()
        .map(|cidr| (cidr.addr(), cidr.prefix()))
        .collect();
    let deny: Vec<(Ipv4Addr, u8)> = policy
        .deny
        .iter()
        .map(|cidr| (cidr.addr(), cidr.prefix()))
        .collect();
    // Deny first: during the switch a flow may be refused, never wrongly allowed.
    datapath.set_policy_list(false, ifindex, &deny)?;
    datapath.set_policy_list(true, ifindex, &allow)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid() {
        PoolConfig::default().validate().unwrap();
    }

    #[test]
    fn rejects_bad_configs() {
        let bad = [
            PoolConfig {
                name: String::new(),
                ..PoolConfig::default()
            },
            PoolConfig {
                name: "a/b".to_string(),
                ..PoolConfig::default()
            },
            PoolConfig {
                prefix: "far-too-long".to_string(),
                ..PoolConfig::default()
            },
            PoolConfig {
                prefix: String::new(),
                ..PoolConfig::default()
            },
            PoolConfig {
                nat_ports: 80..=1000,
                ..PoolConfig::default()
            },
            PoolConfig {
                max_flows: 10,
                ..PoolConfig::default()
            },
        ];
        for config in bad {
            assert!(
                matches!(config.validate(), Err(PoolError::Config(_))),
                "{config:?}"
            );
        }
    }

    #[test]
    fn parses_only_its_own_device_names() {
        let parse = |name: &str| parse_device_name("cube", name);
        assert_eq!(parse("cube12h"), Some((12, 'h')));
        assert_eq!(parse("cube3t"), Some((3, 't')));
        assert_eq!(parse("cubeh"), None);
        assert_eq!(parse("cube1x"), None);
        assert_eq!(parse("eth0"), None);
        assert_eq!(parse("cubeé"), None);
    }
}
