//! The eBPF datapath (`bpf/datapath.c`, built by build.rs): loading it with its maps
//! pinned under a pool's bpffs directory, attaching its programs on TC, and the
//! map records mirrored from the C side.
//!
//! Attachments use tcx links where the kernel has them (6.6+), pinned so they outlive
//! the process that made them; older kernels get netlink TC filters on a clsact
//! qdisc, which outlive it by themselves.

use std::io;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key as LpmKey, LpmTrie};
use aya::maps::{HashMap as BpfHashMap, MapData, MapError, PerCpuHashMap};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::tc::{self, SchedClassifier, TcAttachType};
use aya::programs::ProgramError;
use aya::{Ebpf, EbpfError, EbpfLoader, Pod};

/// The compiled datapath object.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/datapath.o"));

/// Errors of loading and driving the datapath.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// The crate was built without clang, so it carries no datapath.
    #[error("eBPF datapath not built: clang was missing at build time (scripts/setup-net.sh)")]
    NotBuilt,
    /// The eBPF object could not be loaded (verifier, BTF, pinned maps).
    #[error("load eBPF datapath")]
    Load(#[source] Box<EbpfError>),
    /// A program is missing from the object or of the wrong type.
    #[error("eBPF program {0} missing from the datapath object")]
    MissingProgram(&'static str),
    /// A map is missing from the object or of the wrong type.
    #[error("eBPF map {0} missing from the datapath object")]
    MissingMap(&'static str),
    /// A program could not be loaded, attached or detached.
    #[error("{op} {program} on {ifname}")]
    Program {
        /// What was being done.
        op: &'static str,
        /// The program.
        program: &'static str,
        /// The interface.
        ifname: String,
        /// Why.
        #[source]
        source: Box<ProgramError>,
    },
    /// A map operation failed.
    #[error("eBPF map {0}")]
    Map(&'static str, #[source] Box<MapError>),
    /// A pin or pin directory could not be made or removed.
    #[error("bpffs pin {0}")]
    Pin(PathBuf, #[source] io::Error),
    /// The clsact qdisc could not be added (netlink TC fallback).
    #[error("add clsact qdisc on {0}")]
    Clsact(String, #[source] io::Error),
}

type Result<T> = std::result::Result<T, DatapathError>;

/// A network as (address, prefix length).
pub type Cidr = (Ipv4Addr, u8);

/// The datapath's programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Program {
    /// Packets leaving a sandbox (tc ingress of its host-side device).
    FromSandbox,
    /// Packets arriving at the host (tc ingress of uplinks, tc egress of lo).
    ToHost,
}

impl Program {
    fn name(self) -> &'static str {
        match self {
            Self::FromSandbox => "from_sandbox",
            Self::ToHost => "to_host",
        }
    }
}

/// Which TC hook of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// Packets the device receives.
    Ingress,
    /// Packets the device sends.
    Egress,
}

impl Hook {
    fn attach_type(self) -> TcAttachType {
        match self {
            Self::Ingress => TcAttachType::Ingress,
            Self::Egress => TcAttachType::Egress,
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Self::Ingress => "ingress",
            Self::Egress => "egress",
        }
    }
}

/// Sandbox flag: destinations no list matches are reachable.
pub const SANDBOX_INTERNET: u32 = 1;

/// Mirror of `struct config`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ConfigRecord {
    /// Idle timeout of open TCP flows, in ns.
    pub tcp_timeout_ns: u64,
    /// Idle timeout of TCP flows that saw FIN or RST, in ns.
    pub tcp_closing_timeout_ns: u64,
    /// Idle timeout of UDP flows, in ns.
    pub udp_timeout_ns: u64,
    /// Guest address, network order.
    pub guest_addr: u32,
    /// Gateway address, network order.
    pub gateway_addr: u32,
    /// First NAT port, host order.
    pub nat_port_min: u16,
    /// Last NAT port, host order.
    pub nat_port_max: u16,
    /// ifindex of lo, through which packets for the host itself are delivered.
    pub lo_ifindex: u32,
}

/// Mirror of `struct sandbox`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SandboxRecord {
    /// MAC of the sandbox's own device.
    pub guest_mac: [u8; 6],
    /// MAC of the host-side device (the gateway's MAC as the guest sees it).
    pub host_mac: [u8; 6],
    /// `SANDBOX_*` flags.
    pub flags: u32,
}

/// Mirror of `struct counters` (one per CPU in the map).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterRecord {
    /// Packets the sandbox sent that passed parsing.
    pub tx_packets: u64,
    /// Their bytes.
    pub tx_bytes: u64,
    /// Packets delivered into the sandbox.
    pub rx_packets: u64,
    /// Their bytes.
    pub rx_bytes: u64,
    /// Packets from the sandbox dropped by policy or parsing.
    pub dropped: u64,
}

/// Mirror of `struct policy_key` (without the LPM prefix length, which aya adds).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyData {
    /// The sandbox's host-side ifindex.
    pub ifindex: u32,
    /// Network address, network order.
    pub addr: u32,
}

/// Mirror of `struct flow_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowKey {
    /// The sandbox's host-side ifindex.
    pub ifindex: u32,
    /// Remote address, network order.
    pub remote_addr: u32,
    /// Guest port, network order.
    pub guest_port: u16,
    /// Remote port, network order.
    pub remote_port: u16,
    /// IP protocol.
    pub proto: u8,
    /// Padding.
    pub pad: [u8; 3],
}

/// Mirror of `struct nat_entry`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NatEntry {
    /// CLOCK_MONOTONIC ns of the last packet.
    pub last_seen: u64,
    /// NAT address, network order.
    pub nat_addr: u32,
    /// NAT port, network order.
    pub nat_port: u16,
    /// 0 open, 1 closing.
    pub state: u8,
    /// Padding.
    pub pad: u8,
}

/// Mirror of `struct reverse_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReverseKey {
    /// NAT address, network order.
    pub nat_addr: u32,
    /// Remote address, network order.
    pub remote_addr: u32,
    /// NAT port, network order.
    pub nat_port: u16,
    /// Remote port, network order.
    pub remote_port: u16,
    /// IP protocol.
    pub proto: u8,
    /// Padding.
    pub pad: [u8; 3],
}

/// Mirror of `struct reverse_entry`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ReverseEntry {
    /// CLOCK_MONOTONIC ns of the last packet.
    pub last_seen: u64,
    /// The sandbox's host-side ifindex.
    pub ifindex: u32,
    /// Guest port, network order.
    pub guest_port: u16,
    /// 0 open, 1 closing.
    pub state: u8,
    /// Padding.
    pub pad: u8,
}

/// Mirror of `struct expose_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExposeKey {
    /// Host port, network order.
    pub host_port: u16,
    /// IP protocol.
    pub proto: u8,
    /// Padding.
    pub pad: u8,
}

/// Mirror of `struct expose_entry`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExposeEntry {
    /// The sandbox's host-side ifindex.
    pub ifindex: u32,
    /// Guest port, network order.
    pub guest_port: u16,
    /// Padding.
    pub pad: u16,
}

/// Mirror of `struct exposed_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExposedKey {
    /// The sandbox's host-side ifindex.
    pub ifindex: u32,
    /// Peer address, network order.
    pub peer_addr: u32,
    /// Guest port, network order.
    pub guest_port: u16,
    /// Peer port, network order.
    pub peer_port: u16,
    /// IP protocol.
    pub proto: u8,
    /// Padding.
    pub pad: [u8; 3],
}

/// Mirror of `struct exposed_entry`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ExposedEntry {
    /// CLOCK_MONOTONIC ns of the last packet.
    pub last_seen: u64,
    /// Host address the peer connected to, network order.
    pub host_addr: u32,
    /// Host port the peer connected to, network order.
    pub host_port: u16,
    /// 0 open, 1 closing.
    pub state: u8,
    /// Padding.
    pub pad: u8,
}

// SAFETY: each type below is #[repr(C)], Copy, has explicit padding fields and no
// pointers, so every bit pattern the kernel hands back is a valid value.
unsafe impl Pod for ConfigRecord {}
// SAFETY: as above.
unsafe impl Pod for SandboxRecord {}
// SAFETY: as above.
unsafe impl Pod for CounterRecord {}
// SAFETY: as above.
unsafe impl Pod for PolicyData {}
// SAFETY: as above.
unsafe impl Pod for FlowKey {}
// SAFETY: as above.
unsafe impl Pod for NatEntry {}
// SAFETY: as above.
unsafe impl Pod for ReverseKey {}
// SAFETY: as above.
unsafe impl Pod for ReverseEntry {}
// SAFETY: as above.
unsafe impl Pod for ExposeKey {}
// SAFETY: as above.
unsafe impl Pod for ExposeEntry {}
// SAFETY: as above.
unsafe impl Pod for ExposedKey {}
// SAFETY: as above.
unsafe impl Pod for ExposedEntry {}

/// Map names, as in the C source (the pins in `<pool>/maps/` carry these names).
pub const MAP_NAMES: [&str; 10] = [
    "cube_config",
    "cube_sandboxes",
    "cube_counters",
    "cube_allow",
    "cube_deny",
    "cube_host_addrs",
    "cube_ct_out",
    "cube_ct_in",
    "cube_expose",
    "cube_ct_exposed",
];

/// A loaded datapath: maps shared through their pins, programs loaded when first
/// attached and shared through their pins too.
///
/// Verifying the programs and re-attaching the uplinks is most of what opening a
/// pool costs, and re-attaching briefly detaches the uplinks' programs. So programs
/// are pinned under `programs/<build id>/` once verified: an open by the same
/// datapath build attaches the pinned programs and leaves uplinks that run them
/// alone ([`Datapath::attached_current`]); a different build finds another id,
/// drops the old program pins and attaches its own, deliberately replacing the old
/// build's attachments.
pub struct Datapath {
    ebpf: Ebpf,
    links_dir: PathBuf,
    programs_dir: PathBuf,
}

/// An id of the compiled datapath object (FNV-1a of its bytes): program pins and
/// attachments are reused only by the build that made them.
pub fn build_id() -> String {
    let hash = OBJECT.iter().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{hash:016x}")
}

/// Unpins every program pinned in `dir` and removes it; a missing `dir` is fine.
fn remove_program_pins(dir: &Path) -> Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(DatapathError::Pin(dir.to_path_buf(), error)),
    };
    for entry in entries.filter_map(|entry| entry.ok()) {
        let path = entry.path();
        std::fs::remove_file(&path).map_err(|error| DatapathError::Pin(path, error))?;
    }
    std::fs::remove_dir(dir).map_err(|error| DatapathError::Pin(dir.to_path_buf(), error))
}

fn map_error(name: &'static str) -> impl Fn(MapError) -> DatapathError {
    move |error| DatapathError::Map(name, Box::new(error))
}

impl Datapath {
    /// Loads the datapath, reusing maps pinned in `pin_dir/maps` (created there on
    /// first use, each connection-tracking map sized for `max_flows` flows) and
    /// keeping link pins in `pin_dir/links`.
    pub fn load(pin_dir: &Path, max_flows: u32) -> Result<Self> {
        if OBJECT.is_empty() {
            return Err(DatapathError::NotBuilt);
        }
        let maps_dir = pin_dir.join("maps");
        let links_dir = pin_dir.join("links");
        for dir in [&maps_dir, &links_dir] {
            std::fs::create_dir_all(dir).map_err(|error| DatapathError::Pin(dir.clone(), error))?;
        }
        let programs_root = pin_dir.join("programs");
        let build = build_id();
        if let Ok(entries) = std::fs::read_dir(&programs_root) {
            for entry in entries.filter_map(|entry| entry.ok()) {
                if entry.file_name().to_str() != Some(build.as_str()) {
                    remove_program_pins(&entry.path())?;
                }
            }
        }
        let programs_dir = programs_root.join(build);
        // Pinned programs hold the maps they were loaded with: when a map is about
        // to be made anew, they would keep using the old one, so they go too.
        if !MAP_NAMES.iter().all(|name| maps_dir.join(name).exists()) {
            remove_program_pins(&programs_dir)?;
        }
        std::fs::create_dir_all(&programs_dir)
            .map_err(|error| DatapathError::Pin(programs_dir.clone(), error))?;
        let ebpf = EbpfLoader::new()
            .map_pin_path(&maps_dir)
            .set_max_entries("cube_ct_out", max_flows)
            .set_max_entries("cube_ct_in", max_flows)
            .set_max_entries("cube_ct_exposed", max_flows)
            .load(OBJECT)
            .map_err(|error| DatapathError::Load(Box::new(error)))?;
        Ok(Self {
            ebpf,
            links_dir,
            programs_dir,
        })
    }

    /// Whether `ifname`'s `hook` already runs this build's `program` through a link
    /// this pool pinned: such a hook can stay as it is.
    pub fn attached_current(&self, program: Program, ifname: &str, hook: Hook) -> bool {
        if !tcx_supported() || PinnedLink::from_pin(self.link_pin(ifname, hook)).is_err() {
            return false;
        }
        let Ok(pinned) = SchedClassifier::from_pin(self.programs_dir.join(program.name())) else {
            return false;
        };
        let Ok(id) = pinned.info().map(|info| info.id()) else {
            return false;
        };
        SchedClassifier::query_tcx(ifname, hook.attach_type())
            .is_ok_and(|(_, programs)| programs.iter().any(|info| info.id() == id))
    }

    /// `program` as pinned by this build, or else verified and loaded here and then
    /// pinned for the next open.
    fn classifier(&mut self, program: Program) -> Result<Classifier<'_>> {
        let name = program.name();
        let pin = self.programs_dir.join(name);
        if let Ok(pinned) = SchedClassifier::from_pin(&pin) {
            return Ok(Classifier::Pinned(Box::new(pinned)));
        }
        let classifier: &mut SchedClassifier = self
            .ebpf
            .program_mut(name)
            .ok_or(DatapathError::MissingProgram(name))?
            .try_into()
            .map_err(|_| DatapathError::MissingProgram(name))?;
        if classifier.fd().is_err() {
            classifier.load().map_err(|error| DatapathError::Program {
                op: "load",
                program: name,
                ifname: String::new(),
                source: Box::new(error),
            })?;
        }
        if !pin.exists() {
            classifier
                .pin(&pin)
                .map_err(|error| DatapathError::Pin(pin.clone(), io::Error::other(error)))?;
        }
        Ok(Classifier::Loaded(classifier))
    }

    /// Where the link of `program` on `ifname`'s `hook` is pinned.
    pub fn link_pin(&self, ifname: &str, hook: Hook) -> PathBuf {
        self.links_dir.join(format!("{ifname}-{}", hook.suffix()))
    }

    /// Attaches `program` to a device's hook, replacing an attachment this pool
    /// already pinned there.
    pub fn attach(&mut self, program: Program, ifname: &str, hook: Hook) -> Result<()> {
        let pin = self.link_pin(ifname, hook);
        detach_pinned(&pin)?;
        let name = program.name();
        let program_error = |op: &'static str| {
            let ifname = ifname.to_string();
            move |error: ProgramError| DatapathError::Program {
                op,
                program: name,
                ifname,
                source: Box::new(error),
            }
        };
        let mut classifier = self.classifier(program)?;
        let classifier = classifier.get();
        if !tcx_supported() {
            if let Err(error) = tc::qdisc_add_clsact(ifname) {
                if error.raw_os_error() != Some(libc::EEXIST) {
                    return Err(DatapathError::Clsact(ifname.to_string(), error));
                }
            }
        }
        let id = classifier
            .attach(ifname, hook.attach_type())
            .map_err(program_error("attach"))?;
        let link = classifier
            .take_link(id)
            .map_err(program_error("take link"))?;
        if !tcx_supported() {
            // A netlink TC filter stays attached without any fd; dropping the link
            // object would detach it.
            std::mem::forget(link);
            return Ok(());
        }
        let fd_link = FdLink::try_from(link)
            .map_err(|error| DatapathError::Pin(pin.clone(), io::Error::other(error)))?;
        fd_link
            .pin(&pin)
            .map_err(|error| DatapathError::Pin(pin.clone(), io::Error::other(error)))?;
        Ok(())
    }

    /// Detaches whatever this pool attached to a device's hook.
    pub fn detach(&mut self, program: Program, ifname: &str, hook: Hook) -> Result<()> {
        let pin = self.link_pin(ifname, hook);
        if pin.exists() {
            return detach_pinned(&pin);
        }
        if !tcx_supported() {
            match tc::qdisc_detach_program(ifname, hook.attach_type(), program.name()) {
                Ok(()) => {}
                Err(error)
                    if error.kind() == io::ErrorKind::NotFound
                        || error.raw_os_error() == Some(libc::ENODEV) => {}
                Err(error) => {
                    return Err(DatapathError::Program {
                        op: "detach",
                        program: program.name(),
                        ifname: ifname.to_string(),
                        source: Box::new(ProgramError::IOError(error)),
                    })
                }
            }
        }
        Ok(())
    }

    /// Names of the link pins present (one per attached hook).
    pub fn link_pins(&self) -> Result<Vec<String>> {
        let entries = std::fs::read_dir(&self.links_dir)
            .map_err(|error| DatapathError::Pin(self.links_dir.clone(), error))?;
        Ok(entries
            .filter_map(|entry| entry.ok())
            .filter_map(|entry| entry.file_name().into_string().ok())
            .collect())
    }

    /// Removes a link pin by its file name, detaching what it held.
    pub fn remove_link_pin(&mut self, name: &str) -> Result<()> {
        detach_pinned(&self.links_dir.join(name))
    }

    fn hash_map<K: Pod, V: Pod>(
        &mut self,
        name: &'static str,
    ) -> Result<BpfHashMap<&mut MapData, K, V>> {
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(DatapathError::MissingMap(name))?;
        BpfHashMap::try_from(map).map_err(map_error(name))
    }

    fn lpm(&mut self, name: &'static str) -> Result<LpmTrie<&mut MapData, PolicyData, u8>> {
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(DatapathError::MissingMap(name))?;
        LpmTrie::try_from(map).map_err(map_error(name))
    }

    /// Writes the datapath's configuration.
    pub fn set_config(&mut self, config: &ConfigRecord) -> Result<()> {
        let name = "cube_config";
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(DatapathError::MissingMap(name))?;
        let mut array: aya::maps::Array<&mut MapData, ConfigRecord> =
            aya::maps::Array::try_from(map).map_err(map_error(name))?;
        array.set(0, config, 0).map_err(map_error(name))
    }

    /// Replaces the set of host addresses (the datapath refuses them by default and
    /// delivers exposed ports on them).
    pub fn set_host_addrs(&mut self, addrs: &[Ipv4Addr]) -> Result<()> {
        let name = "cube_host_addrs";
        let mut map = self.hash_map::<u32, u8>(name)?;
        let wanted: Vec<u32> = addrs.iter().map(|addr| u32::from(*addr).to_be()).collect();
        for addr in &wanted {
            map.insert(addr, 1, 0).map_err(map_error(name))?;
        }
        let stale: Vec<u32> = map
            .keys()
            .filter_map(|key| key.ok())
            .filter(|key| !wanted.contains(key))
            .collect();
        for key in stale {
            map.remove(&key).map_err(map_error(name))?;
        }
        Ok(())
    }

    /// Registers a sandbox's device; its packets are dropped until this is done.
    pub fn set_sandbox(&mut self, ifindex: u32, record: &SandboxRecord) -> Result<()> {
        let name = "cube_sandboxes";
        self.hash_map::<u32, SandboxRecord>(name)?
            .insert(ifindex, record, 0)
            .map_err(map_error(name))
    }

    /// The registered sandbox devices.
    pub fn sandboxes(&mut self) -> Result<Vec<(u32, SandboxRecord)>> {
        let name = "cube_sandboxes";
        let map = self.hash_map::<u32, SandboxRecord>(name)?;
        Ok(map.iter().filter_map(|entry| entry.ok()).collect())
    }

    /// Zeroes a sandbox's counters.
    pub fn reset_counters(&mut self, ifindex: u32) -> Result<()> {
        let name = "cube_counters";
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(DatapathError::MissingMap(name))?;
        let mut map: PerCpuHashMap<&mut MapData, u32, CounterRecord> =
            PerCpuHashMap::try_from(map).map_err(map_error(name))?;
        let cpus = aya::util::nr_cpus()
            .map_err(|(_, error)| DatapathError::Map(name, Box::new(MapError::IoError(error))))?;
        let zeroes = aya::maps::PerCpuValues::try_from(vec![CounterRecord::default(); cpus])
            .map_err(|error| DatapathError::Map(name, Box::new(MapError::IoError(error))))?;
        map.insert(ifindex, zeroes, 0).map_err(map_error(name))
    }

    /// A sandbox's counters summed over CPUs.
    pub fn counters(&mut self, ifindex: u32) -> Result<CounterRecord> {
        let name = "cube_counters";
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(DatapathError::MissingMap(name))?;
        let map: PerCpuHashMap<&mut MapData, u32, CounterRecord> =
            PerCpuHashMap::try_from(map).map_err(map_error(name))?;
        let values = match map.get(&ifindex, 0) {
            Ok(values) => values,
            Err(MapError::KeyNotFound) => return Ok(CounterRecord::default()),
            Err(error) => return Err(DatapathError::Map(name, Box::new(error))),
        };
        Ok(values
            .iter()
            .fold(CounterRecord::default(), |sum, cpu| CounterRecord {
                tx_packets: sum.tx_packets + cpu.tx_packets,
                tx_bytes: sum.tx_bytes + cpu.tx_bytes,
                rx_packets: sum.rx_packets + cpu.rx_packets,
                rx_bytes: sum.rx_bytes + cpu.rx_bytes,
                dropped: sum.dropped + cpu.dropped,
            }))
    }

    /// Replaces a sandbox's allow (`allow == true`) or deny list. New entries go in
    /// before stale ones leave, so a live sandbox never sees an empty list.
    pub fn set_policy_list(
        &mut self,
        allow: bool,
        ifindex: u32,
        cidrs: &[(Ipv4Addr, u8)],
    ) -> Result<()> {
        let name = if allow { "cube_allow" } else { "cube_deny" };
        let mut trie = self.lpm(name)?;
        let wanted: Vec<(u32, u32)> = cidrs
            .iter()
            .map(|&(addr, prefix)| (32 + u32::from(prefix), u32::from(addr).to_be()))
            .collect();
        for &(prefix_len, addr) in &wanted {
            let key = LpmKey::new(prefix_len, PolicyData { ifindex, addr });
            trie.insert(&key, (prefix_len - 32) as u8, 0)
                .map_err(map_error(name))?;
        }
        let stale: Vec<LpmKey<PolicyData>> = trie
            .keys()
            .filter_map(|key| key.ok())
            .filter(|key| {
                key.data().ifindex == ifindex
                    && !wanted.contains(&(key.prefix_len(), key.data().addr))
            })
            .collect();
        for key in stale {
            trie.remove(&key).map_err(map_error(name))?;
        }
        Ok(())
    }

    /// Policy entries of a sandbox (allow, deny) as (address, prefix) pairs.
    pub fn policy_entries(&mut self, ifindex: u32) -> Result<(Vec<Cidr>, Vec<Cidr>)> {
        let mut lists = (Vec::new(), Vec::new());
        for (name, list) in [("cube_allow", &mut lists.0), ("cube_deny", &mut lists.1)] {
            let trie = self.lpm(name)?;
            for key in trie.keys().filter_map(|key| key.ok()) {
                if key.data().ifindex == ifindex {
                    list.push((
                        Ipv4Addr::from(u32::from_be(key.data().addr)),
                        (key.prefix_len() - 32) as u8,
                    ));
                }
            }
        }
        Ok(lists)
    }

    /// Exposes a host port; fails with `Ok(false)` when another sandbox holds it.
    pub fn expose(&mut self, key: ExposeKey, entry: ExposeEntry) -> Result<bool> {
        let name = "cube_expose";
        let mut map = self.hash_map::<ExposeKey, ExposeEntry>(name)?;
        match map.get(&key, 0) {
            Ok(existing) if existing.ifindex != entry.ifindex => return Ok(false),
            Ok(_) | Err(MapError::KeyNotFound) => {}
            Err(error) => return Err(DatapathError::Map(name, Box::new(error))),
        }
        map.insert(key, entry, 0).map_err(map_error(name))?;
        Ok(true)
    }

    /// Withdraws an exposed port if `ifindex` holds it.
    pub fn unexpose(&mut self, key: ExposeKey, ifindex: u32) -> Result<()> {
        let name = "cube_expose";
        let mut map = self.hash_map::<ExposeKey, ExposeEntry>(name)?;
        match map.get(&key, 0) {
            Ok(existing) if existing.ifindex == ifindex => {
                map.remove(&key).map_err(map_error(name))
            }
            Ok(_) | Err(MapError::KeyNotFound) => Ok(()),
            Err(error) => Err(DatapathError::Map(name, Box::new(error))),
        }
    }

    /// Exposed ports of a sandbox.
    pub fn exposed(&mut self, ifindex: u32) -> Result<Vec<(ExposeKey, ExposeEntry)>> {
        let map = self.hash_map::<ExposeKey, ExposeEntry>("cube_expose")?;
        Ok(map
            .iter()
            .filter_map(|entry| entry.ok())
            .filter(|(_, entry)| entry.ifindex == ifindex)
            .collect())
    }

    /// Removes every entry a sandbox's device has in any map. Returns how many.
    pub fn purge(&mut self, ifindex: u32) -> Result<usize> {
        let mut removed = 0;
        removed += remove_where(
            &mut self.hash_map::<u32, SandboxRecord>("cube_sandboxes")?,
            "cube_sandboxes",
            |key, _| *key == ifindex,
        )?;
        {
            let name = "cube_counters";
            let map = self
                .ebpf
                .map_mut(name)
                .ok_or(DatapathError::MissingMap(name))?;
            let mut map: PerCpuHashMap<&mut MapData, u32, CounterRecord> =
                PerCpuHashMap::try_from(map).map_err(map_error(name))?;
            match map.remove(&ifindex) {
                Ok(()) => removed += 1,
                Err(MapError::KeyNotFound) => {}
                Err(MapError::SyscallError(error))
                    if error.io_error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(error) => return Err(DatapathError::Map(name, Box::new(error))),
            }
        }
        self.set_policy_list(true, ifindex, &[])?;
        self.set_policy_list(false, ifindex, &[])?;
        removed += remove_where(
            &mut self.hash_map::<FlowKey, NatEntry>("cube_ct_out")?,
            "cube_ct_out",
            |key, _| key.ifindex == ifindex,
        )?;
        removed += remove_where(
            &mut self.hash_map::<ReverseKey, ReverseEntry>("cube_ct_in")?,
            "cube_ct_in",
            |_, entry| entry.ifindex == ifindex,
        )?;
        removed += remove_where(
            &mut self.hash_map::<ExposeKey, ExposeEntry>("cube_expose")?,
            "cube_expose",
            |_, entry| entry.ifindex == ifindex,
        )?;
        removed += remove_where(
            &mut self.hash_map::<ExposedKey, ExposedEntry>("cube_ct_exposed")?,
            "cube_ct_exposed",
            |key, _| key.ifindex == ifindex,
        )?;
        Ok(removed)
    }

    /// Entries a sandbox's device has in the connection-tracking maps.
    pub fn flows(&mut self, ifindex: u32) -> Result<usize> {
        let out = self.hash_map::<FlowKey, NatEntry>("cube_ct_out")?;
        let mut count = out
            .keys()
            .filter_map(|key| key.ok())
            .filter(|key| key.ifindex == ifindex)
            .count();
        let inbound = self.hash_map::<ReverseKey, ReverseEntry>("cube_ct_in")?;
        count += inbound
            .iter()
            .filter_map(|entry| entry.ok())
            .filter(|(_, entry)| entry.ifindex == ifindex)
            .count();
        let exposed = self.hash_map::<ExposedKey, ExposedEntry>("cube_ct_exposed")?;
        count += exposed
            .keys()
            .filter_map(|key| key.ok())
            .filter(|key| key.ifindex == ifindex)
            .count();
        Ok(count)
    }

    /// Deletes connection-tracking entries idle past their timeout. Returns how many.
    pub fn sweep(&mut self, config: &ConfigRecord, now_ns: u64) -> Result<usize> {
        let timeout = |proto: u8, state: u8| {
            if proto == libc::IPPROTO_TCP as u8 {
                if state == 1 {
                    config.tcp_closing_timeout_ns
                } else {
                    config.tcp_timeout_ns
                }
            } else {
                config.udp_timeout_ns
            }
        };
        let idle = |last_seen: u64, proto: u8, state: u8| {
            now_ns.saturating_sub(last_seen) > timeout(proto, state)
        };
        let mut removed = 0;
        removed += remove_where(
            &mut self.hash_map::<FlowKey, NatEntry>("cube_ct_out")?,
            "cube_ct_out",
            |key, entry| idle(entry.last_seen, key.proto, entry.state),
        )?;
        removed += remove_where(
            &mut self.hash_map::<ReverseKey, ReverseEntry>("cube_ct_in")?,
            "cube_ct_in",
            |key, entry| idle(entry.last_seen, key.proto, entry.state),
        )?;
        removed += remove_where(
            &mut self.hash_map::<ExposedKey, ExposedEntry>("cube_ct_exposed")?,
            "cube_ct_exposed",
            |key, entry| idle(entry.last_seen, key.proto, entry.state),
        )?;
        Ok(removed)
    }

    /// Unpins every program of the pool under `programs_root` (every build's).
    pub fn unpin_programs(programs_root: &Path) -> Result<()> {
        if let Ok(entries) = std::fs::read_dir(programs_root) {
            for entry in entries.filter_map(|entry| entry.ok()) {
                remove_program_pins(&entry.path())?;
            }
        }
        match std::fs::remove_dir(programs_root) {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(error) => Err(DatapathError::Pin(programs_root.to_path_buf(), error)),
        }
    }

    /// Unpins every map of the pool (the maps die with the last program using them).
    pub fn unpin_maps(maps_dir: &Path) -> Result<()> {
        for name in MAP_NAMES {
            let pin = maps_dir.join(name);
            match std::fs::remove_file(&pin) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => return Err(DatapathError::Pin(pin, error)),
            }
        }
        Ok(())
    }
}

fn remove_where<K: Pod, V: Pod>(
    map: &mut BpfHashMap<&mut MapData, K, V>,
    name: &'static str,
    doomed: impl Fn(&K, &V) -> bool,
) -> Result<usize> {
    let keys: Vec<K> = map
        .iter()
        .filter_map(|entry| entry.ok())
        .filter(|(key, value)| doomed(key, value))
        .map(|(key, _)| key)
        .collect();
    let mut removed = 0;
    for key in keys {
        match map.remove(&key) {
            Ok(()) => removed += 1,
            // An LRU map may have evicted it meanwhile.
            Err(MapError::KeyNotFound) => {}
            Err(MapError::SyscallError(error))
                if error.io_error.raw_os_error() == Some(libc::ENOENT) => {}
            Err(error) => return Err(DatapathError::Map(name, Box::new(error))),
        }
    }
    Ok(removed)
}

/// A program ready to attach: loaded from this build's pin, or held by the object.
enum Classifier<'a> {
    Pinned(Box<SchedClassifier>),
    Loaded(&'a mut SchedClassifier),
}

impl Classifier<'_> {
    fn get(&mut self) -> &mut SchedClassifier {
        match self {
            Self::Pinned(classifier) => classifier,
            Self::Loaded(classifier) => classifier,
        }
    }
}

/// Unpins a link pin, which detaches its program; a missing pin is fine.
fn detach_pinned(pin: &Path) -> Result<()> {
    if !pin.exists() {
        return Ok(());
    }
    match PinnedLink::from_pin(pin) {
        Ok(link) => {
            let fd_link = link
                .unpin()
                .map_err(|error| DatapathError::Pin(pin.to_path_buf(), error))?;
            drop(fd_link);
            Ok(())
        }
        Err(_) => {
            std::fs::remove_file(pin).map_err(|error| DatapathError::Pin(pin.to_path_buf(), error))
        }
    }
}

/// Whether the kernel has tcx links (Linux 6.6+), which aya then uses.
pub fn tcx_supported() -> bool {
    aya::util::KernelVersion::current()
        .map(|version| version >= aya::util::KernelVersion::new(6, 6, 0))
        .unwrap_or(false)
}

/// Programs attached by tcx to a device's hook (for checks that nothing is left).
pub fn tcx_programs(ifname: &str, hook: Hook) -> Result<usize> {
    if !tcx_supported() {
        return Ok(0);
    }
    let (_, programs) =
        SchedClassifier::query_tcx(ifname, hook.attach_type()).map_err(|error| {
            DatapathError::Program {
                op: "query",
                program: "tcx",
                ifname: ifname.to_string(),
                source: Box::new(error),
            }
        })?;
    Ok(programs.len())
}

/// Now on CLOCK_MONOTONIC in ns, the clock bpf_ktime_get_ns reads.
pub fn monotonic_now_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the valid, owned `now`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::size_of;

    /// Sizes of the C structs as clang lays them out for BPF (x86-64 the same);
    /// a mirror that drifts from its C struct would corrupt every map access.
    #[test]
    fn mirrors_match_the_c_layouts() {
        assert_eq!(size_of::<ConfigRecord>(), 40);
        assert_eq!(size_of::<SandboxRecord>(), 16);
        assert_eq!(size_of::<CounterRecord>(), 40);
        assert_eq!(size_of::<PolicyData>(), 8);
        assert_eq!(size_of::<FlowKey>(), 16);
        assert_eq!(size_of::<NatEntry>(), 16);
        assert_eq!(size_of::<ReverseKey>(), 16);
        assert_eq!(size_of::<ReverseEntry>(), 16);
        assert_eq!(size_of::<ExposeKey>(), 4);
        assert_eq!(size_of::<ExposeEntry>(), 8);
        assert_eq!(size_of::<ExposedKey>(), 16);
        assert_eq!(size_of::<ExposedEntry>(), 16);
    }

    #[test]
    fn the_object_holds_every_program_and_map() {
        if OBJECT.is_empty() {
            eprintln!("skipping: built without clang, no datapath object");
            return;
        }
        let object = aya_obj::Object::parse(OBJECT).unwrap();
        for program in ["from_sandbox", "to_host"] {
            assert!(object.programs.contains_key(program), "{program}");
        }
        for map in MAP_NAMES {
            assert!(object.maps.contains_key(map), "{map}");
        }
    }
}
