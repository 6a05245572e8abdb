//! A sandbox's network: the options it is created with, its live egress policy and
//! exposed ports, and what it reports (see [`crate::Sandbox::network`]). The types are
//! the ones the supervisor protocol carries.

pub use cube_supervisor::network::{
    Ipv4Cidr, NetworkCounters, NetworkError, NetworkOptions, NetworkPolicy, NetworkReport,
    PortMapping, Protocol,
};
