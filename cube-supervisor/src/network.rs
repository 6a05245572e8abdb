//! A sandbox's network as the `Sandbox` API sees it: whether it has one, its egress
//! policy, the ports it exposes, and its traffic counters. The jail engine serves it
//! from a host-wide `cube-net` pool (see [`crate::jail_network`]).
//!
//! Without [`NetworkOptions`] a sandbox has loopback only, as before.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

pub use cube_net::{Ipv4Cidr, Protocol};

/// Why a network option is unusable.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// A CIDR does not parse.
    #[error("egress policy")]
    Cidr(#[from] cube_net::policy::PolicyError),
    /// A port mapping does not parse.
    #[error("bad port mapping {0:?}: use PORT or HOST_PORT:SANDBOX_PORT (1-65535)")]
    Port(String),
}

/// What a sandbox may reach: by default the internet, and none of the host's
/// neighbours (private, link-local, loopback and reserved ranges, the host itself).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkPolicy {
    /// Whether destinations no list matches are reachable.
    pub internet: bool,
    /// Reachable even where the defaults or `internet: false` refuse
    /// (`a.b.c.d/n`; the host's own addresses only as an exact /32).
    pub allow_out: Vec<String>,
    /// Refused; the longer matching prefix of the two lists wins.
    pub deny_out: Vec<String>,
}

impl Default for NetworkPolicy {
    fn default() -> Self {
        NetworkPolicy {
            internet: true,
            allow_out: Vec::new(),
            deny_out: Vec::new(),
        }
    }
}

impl NetworkPolicy {
    /// The datapath's form; rejects malformed CIDRs. The deny list is
    /// [`cube_net::policy::DEFAULT_DENY`] plus `deny_out`; an `allow_out` entry for
    /// exactly a default range lifts that range (a longer allow prefix inside one
    /// wins anyway), and a network named in both lists is refused.
    pub fn to_egress(&self) -> Result<cube_net::EgressPolicy, NetworkError> {
        let parse = |list: &[String]| -> Result<Vec<Ipv4Cidr>, NetworkError> {
            list.iter()
                .map(|c| c.trim().parse::<Ipv4Cidr>().map_err(NetworkError::from))
                .collect()
        };
        let mut egress = cube_net::EgressPolicy {
            internet: self.internet,
            ..cube_net::EgressPolicy::default()
        };
        for cidr in parse(&self.allow_out)? {
            egress = egress.allow(cidr);
        }
        for cidr in parse(&self.deny_out)? {
            egress = egress.deny(cidr);
        }
        Ok(egress)
    }
}

/// A sandbox port served on the host's addresses (TCP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortMapping {
    /// The port on the host.
    pub host_port: u16,
    /// The port inside the sandbox.
    pub sandbox_port: u16,
}

impl std::str::FromStr for PortMapping {
    type Err = NetworkError;

    /// `PORT` (the same on both sides) or `HOST_PORT:SANDBOX_PORT`.
    fn from_str(text: &str) -> Result<Self, NetworkError> {
        let bad = || NetworkError::Port(text.to_string());
        let port = |p: &str| {
            p.trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(bad)
        };
        match text.split_once(':') {
            Some((host, sandbox)) => Ok(PortMapping {
                host_port: port(host)?,
                sandbox_port: port(sandbox)?,
            }),
            None => {
                let p = port(text)?;
                Ok(PortMapping {
                    host_port: p,
                    sandbox_port: p,
                })
            }
        }
    }
}

impl std::fmt::Display for PortMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host_port, self.sandbox_port)
    }
}

/// A sandbox's network at create time.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkOptions {
    /// The egress policy it starts with (changeable live).
    pub policy: NetworkPolicy,
    /// Ports exposed from the start.
    pub expose: Vec<PortMapping>,
}

impl NetworkOptions {
    /// Checks the policy before anything is started.
    pub fn validate(&self) -> Result<(), NetworkError> {
        self.policy.to_egress().map(drop)
    }
}

/// Traffic of a sandbox as its datapath counted it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkCounters {
    /// Packets the sandbox sent.
    pub tx_packets: u64,
    /// Bytes the sandbox sent.
    pub tx_bytes: u64,
    /// Packets delivered to the sandbox.
    pub rx_packets: u64,
    /// Bytes delivered to the sandbox.
    pub rx_bytes: u64,
    /// Packets refused (policy, no flow, malformed).
    pub dropped: u64,
}

impl From<cube_net::Counters> for NetworkCounters {
    fn from(c: cube_net::Counters) -> Self {
        NetworkCounters {
            tx_packets: c.tx_packets,
            tx_bytes: c.tx_bytes,
            rx_packets: c.rx_packets,
            rx_bytes: c.rx_bytes,
            dropped: c.dropped,
        }
    }
}

/// A sandbox's network now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkReport {
    /// The host side of its device.
    pub host_ifname: String,
    /// Its address inside the sandbox.
    pub guest_addr: Ipv4Addr,
    /// Its gateway inside the sandbox.
    pub gateway: Ipv4Addr,
    /// The policy as asked for.
    pub policy: NetworkPolicy,
    /// The allow list the datapath holds now.
    #[serde(default)]
    pub allow_in_force: Vec<String>,
    /// The deny list the datapath holds now: the default ranges (private, shared,
    /// loopback, link-local, multicast, reserved) and `policy.deny_out`. The host's
    /// own addresses are refused besides, unless allowed as an exact /32.
    #[serde(default)]
    pub deny_in_force: Vec<String>,
    /// Exposed ports.
    pub exposed: Vec<PortMapping>,
    /// Traffic so far.
    pub counters: NetworkCounters,
}

/// Which network namespace a jail sandbox's processes live in; for a Linux VM, whose
/// network it stands on (see [`crate::pod_network`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum NetnsChoice {
    /// A new one with loopback only (and the sandbox's network device when it asks
    /// for one).
    #[default]
    Own,
    /// The host's: a Kubernetes pod with `hostNetwork`. The sandbox sees and can bind
    /// the host's interfaces.
    Host,
    /// An existing one, by path (`/var/run/netns/NAME`, `/proc/PID/ns/net`): a pod's
    /// namespace as its CNI plugins set it up. A VM's NIC is spliced to its
    /// interface.
    Join(std::path::PathBuf),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_mappings_parse_and_bad_ones_are_refused() {
        let one: PortMapping = "8080".parse().unwrap();
        assert_eq!((one.host_port, one.sandbox_port), (8080, 8080));
        let two: PortMapping = "9000:80".parse().unwrap();
        assert_eq!((two.host_port, two.sandbox_port), (9000, 80));
        for bad in ["", "0", "70000", "a:1", "1:", "1:2:3"] {
            assert!(bad.parse::<PortMapping>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_default_deny_list_is_in_every_policy() {
        let defaults: Vec<Ipv4Cidr> = cube_net::policy::DEFAULT_DENY
            .iter()
            .map(|&(addr, prefix)| Ipv4Cidr::new(addr, prefix).unwrap())
            .collect();
        let plain = NetworkPolicy::default().to_egress().unwrap();
        for cidr in &defaults {
            assert!(plain.deny.contains(cidr), "{cidr} missing");
        }
        let mut policy = NetworkPolicy {
            internet: false,
            allow_out: vec!["10.0.0.0/8".into(), "192.168.1.0/24".into()],
            deny_out: vec!["203.0.113.0/24".into()],
        };
        let egress = policy.to_egress().unwrap();
        assert!(!egress.internet);
        // Exactly a default range: lifted; inside one: the longer prefix decides.
        assert!(!egress.deny.contains(&"10.0.0.0/8".parse().unwrap()));
        assert!(egress.deny.contains(&"192.168.0.0/16".parse().unwrap()));
        assert!(egress.deny.contains(&"203.0.113.0/24".parse().unwrap()));
        assert!(egress.deny.contains(&"169.254.0.0/16".parse().unwrap()));
        assert_eq!(egress.deny.len(), defaults.len() - 1 + 1);
        // Named in both lists: refused.
        policy.deny_out.push("10.0.0.0/8".into());
        let egress = policy.to_egress().unwrap();
        assert!(egress.deny.contains(&"10.0.0.0/8".parse().unwrap()));
        assert!(!egress.allow.contains(&"10.0.0.0/8".parse().unwrap()));
    }

    #[test]
    fn policies_with_malformed_cidrs_are_refused() {
        let mut policy = NetworkPolicy::default();
        policy.deny_out.push("203.0.113.0/24".into());
        assert!(policy.to_egress().is_ok());
        policy.allow_out.push("10.0.0.1/8".into());
        assert!(policy.to_egress().is_err(), "host bits set");
        policy.allow_out = vec!["banana".into()];
        assert!(policy.to_egress().is_err());
    }
}
