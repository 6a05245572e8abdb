//! Sandbox networking for Cube: a pool of pre-created veth pairs (jail engine) and
//! TAPs (VM engine), and an eBPF datapath on TC that gives every sandbox source NAT
//! through the host, exposed ports, a per-sandbox egress policy, connection tracking
//! with timeouts and traffic counters, without iptables.
//!
//! ```no_run
//! use cube_net::{EgressPolicy, NetnsRef, Pool, PoolConfig, Protocol};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = Pool::open(PoolConfig::default())?;
//! let jail_pid = 4242;
//! let net = pool.attach_veth(&NetnsRef::Pid(jail_pid), &EgressPolicy::default())?;
//! pool.expose(&net, 8080, 80, Protocol::Tcp)?;
//! println!("{:?}", pool.counters(&net)?);
//! pool.release(net)?;
//! # Ok(()) }
//! ```
//!
//! See [`addressing`] for the addresses a sandbox sees and [`policy`] for how the
//! egress policy decides.

pub mod addressing;
pub mod bench;
pub mod datapath;
pub mod netlink;
pub mod netns;
pub mod pod_netns;
pub mod policy;
pub mod pool;
pub mod tap;

pub use netns::{Netns, NetnsRef};
pub use policy::{EgressPolicy, Ipv4Cidr};
pub use pool::{Attachment, Counters, DeviceKind, Pool, PoolConfig, PoolError, Protocol, Residue};
