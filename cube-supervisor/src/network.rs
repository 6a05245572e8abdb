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
    /// The datapath's form; rejects malformed CIDRs.
    pub fn to_egress(&self) -> Result<cube_net::EgressPolicy, NetworkError> {
        let parse = |list: &[String]| -> Result<Vec<Ipv4Cidr>, NetworkError> {
            list.iter()
                .map(|c| c.trim().parse::<Ipv4Cidr>().map_err(NetworkError::from))
                .collect()
        };
        Ok(cube_net::EgressPolicy {
            internet: self.internet,
            allow: parse(&self.allow_out)?,
            deny: parse(&self.deny_out)?,
        })
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
    /// The policy in force.
    pub policy: NetworkPolicy,
    /// Exposed ports.
    pub exposed: Vec<PortMapping>,
    /// Traffic so far.
    pub counters: NetworkCounters,
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
