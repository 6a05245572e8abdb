//! The addresses every sandbox sees.
//!
//! Every sandbox's guest side looks the same: address [`GUEST_ADDR`]/[`GUEST_PREFIX`],
//! default route through [`GATEWAY_ADDR`]. The host side carries no address at all:
//! the datapath tells sandboxes apart by the ifindex of their host-side device,
//! answers ARP for the gateway itself and source-NATs every flow to the host's own
//! address with a port from the NAT range. So thousands of sandboxes on one host
//! never clash, and nothing of the host's routing table grows per sandbox.

use std::net::Ipv4Addr;

/// The guest address of every sandbox.
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 2);
/// The gateway every sandbox routes through (answered by the datapath's ARP reply).
pub const GATEWAY_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 1);
/// Prefix length of the guest's on-link network (169.254.0.0/30).
pub const GUEST_PREFIX: u8 = 30;
/// Name the sandbox's device gets inside a jail's network namespace.
pub const GUEST_IFNAME: &str = "eth0";
