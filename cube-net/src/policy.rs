//! Egress policy of a sandbox: CIDR allow and deny lists and an internet switch.
//!
//! The datapath decides per new flow: of the longest matching allow and deny
//! prefixes, the longer wins; the host's own addresses need an allow entry for
//! exactly that address (/32); where no list matches, the internet switch decides.
//! [`DEFAULT_DENY`] (private, shared, loopback, link-local, multicast and reserved
//! ranges) is in every sandbox's deny list unless the policy leaves it out.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

/// Errors of parsing a policy.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    /// A CIDR is not `a.b.c.d/len` or `a.b.c.d`.
    #[error("bad CIDR {0:?}: expected a.b.c.d/len")]
    BadCidr(String),
    /// The prefix length is over 32.
    #[error("bad prefix length in {0:?}: at most 32")]
    BadPrefix(String),
    /// Bits are set past the prefix length.
    #[error("{0:?} has host bits set past its prefix")]
    HostBits(String),
}

/// An IPv4 network: address and prefix length, no bits past the prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv4Cidr {
    addr: Ipv4Addr,
    prefix: u8,
}

impl Ipv4Cidr {
    /// A network from its address and prefix length.
    pub fn new(addr: Ipv4Addr, prefix: u8) -> Result<Self, PolicyError> {
        let text = format!("{addr}/{prefix}");
        if prefix > 32 {
            return Err(PolicyError::BadPrefix(text));
        }
        if u32::from(addr) & !mask(prefix) != 0 {
            return Err(PolicyError::HostBits(text));
        }
        Ok(Self { addr, prefix })
    }

    /// A single address (/32).
    pub fn host(addr: Ipv4Addr) -> Self {
        Self { addr, prefix: 32 }
    }

    /// The network address.
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Whether `addr` lies in this network.
    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        u32::from(addr) & mask(self.prefix) == u32::from(self.addr)
    }
}

fn mask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix))
    }
}

impl FromStr for Ipv4Cidr {
    type Err = PolicyError;

    fn from_str(text: &str) -> Result<Self, PolicyError> {
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, prefix)) => (
                addr,
                prefix
                    .parse::<u8>()
                    .map_err(|_| PolicyError::BadCidr(text.to_string()))?,
            ),
            None => (text, 32),
        };
        let addr = addr
            .parse::<Ipv4Addr>()
            .map_err(|_| PolicyError::BadCidr(text.to_string()))?;
        Self::new(addr, prefix).map_err(|error| match error {
            PolicyError::BadPrefix(_) => PolicyError::BadPrefix(text.to_string()),
            PolicyError::HostBits(_) => PolicyError::HostBits(text.to_string()),
            other => other,
        })
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Ranges no sandbox reaches unless its policy allows them: this host's neighbours
/// and infrastructure, never the internet.
pub const DEFAULT_DENY: [(Ipv4Addr, u8); 11] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(10, 0, 0, 0), 8),
    (Ipv4Addr::new(100, 64, 0, 0), 10),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(172, 16, 0, 0), 12),
    (Ipv4Addr::new(192, 0, 0, 0), 24),
    (Ipv4Addr::new(192, 168, 0, 0), 16),
    (Ipv4Addr::new(198, 18, 0, 0), 15),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
];

/// What a sandbox may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressPolicy {
    /// Whether destinations no list matches are reachable.
    pub internet: bool,
    /// Networks reachable even where a shorter deny prefix covers them.
    pub allow: Vec<Ipv4Cidr>,
    /// Networks refused even where a shorter allow prefix covers them.
    pub deny: Vec<Ipv4Cidr>,
}

impl Default for EgressPolicy {
    /// Internet on, [`DEFAULT_DENY`] refused.
    fn default() -> Self {
        Self {
            internet: true,
            allow: Vec::new(),
            deny: DEFAULT_DENY
                .iter()
                .map(|&(addr, prefix)| Ipv4Cidr { addr, prefix })
                .collect(),
        }
    }
}

impl EgressPolicy {
    /// No internet and no allow entries: the sandbox reaches nothing.
    pub fn offline() -> Self {
        Self {
            internet: false,
            ..Self::default()
        }
    }

    /// Adds an allow entry, dropping a deny entry for the same network so the most
    /// recent word on a network wins.
    pub fn allow(mut self, cidr: Ipv4Cidr) -> Self {
        self.deny.retain(|deny| *deny != cidr);
        if !self.allow.contains(&cidr) {
            self.allow.push(cidr);
        }
        self
    }

    /// Adds a deny entry, dropping an allow entry for the same network.
    pub fn deny(mut self, cidr: Ipv4Cidr) -> Self {
        self.allow.retain(|allow| *allow != cidr);
        if !self.deny.contains(&cidr) {
            self.deny.push(cidr);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cidrs_and_single_addresses() {
        let cidr: Ipv4Cidr = "10.1.0.0/16".parse().unwrap();
        assert_eq!(cidr.addr(), Ipv4Addr::new(10, 1, 0, 0));
        assert_eq!(cidr.prefix(), 16);
        assert!(cidr.contains(Ipv4Addr::new(10, 1, 200, 3)));
        assert!(!cidr.contains(Ipv4Addr::new(10, 2, 0, 1)));
        let host: Ipv4Cidr = "192.0.2.7".parse().unwrap();
        assert_eq!(host.prefix(), 32);
        let all: Ipv4Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(Ipv4Addr::new(8, 8, 8, 8)));
    }

    #[test]
    fn rejects_bad_cidrs() {
        assert!(matches!(
            "10.0.0.0/33".parse::<Ipv4Cidr>(),
            Err(PolicyError::BadPrefix(_))
        ));
        assert!(matches!(
            "10.0.0.1/8".parse::<Ipv4Cidr>(),
            Err(PolicyError::HostBits(_))
        ));
        assert!(matches!(
            "10.0.0/8".parse::<Ipv4Cidr>(),
            Err(PolicyError::BadCidr(_))
        ));
        assert!(matches!(
            "".parse::<Ipv4Cidr>(),
            Err(PolicyError::BadCidr(_))
        ));
        assert!(matches!(
            "10.0.0.0/x".parse::<Ipv4Cidr>(),
            Err(PolicyError::BadCidr(_))
        ));
    }

    #[test]
    fn later_word_on_a_network_wins() {
        let private: Ipv4Cidr = "10.0.0.0/8".parse().unwrap();
        let policy = EgressPolicy::default().allow(private);
        assert!(policy.allow.contains(&private));
        assert!(!policy.deny.contains(&private));
        let policy = policy.deny(private);
        assert!(!policy.allow.contains(&private));
        assert!(policy.deny.contains(&private));
    }

    #[test]
    fn default_denies_private_and_link_local() {
        let policy = EgressPolicy::default();
        for addr in [
            "10.1.2.3",
            "172.20.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "127.0.0.1",
        ] {
            let addr: Ipv4Addr = addr.parse().unwrap();
            assert!(policy.deny.iter().any(|cidr| cidr.contains(addr)), "{addr}");
        }
        assert!(policy.internet);
    }
}
