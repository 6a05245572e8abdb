//! A Linux VM in a network namespace somebody else set up ([`NetnsChoice::Join`]: a
//! Kubernetes pod's, made by its CNI plugins): a TAP made in that namespace and
//! spliced to the pod's interface (cube-net's [`cube_net::pod_netns`]), and the
//! guest given that interface's MAC, MTU, address and gateway through its agent. The
//! guest is then the pod on the pod's network; no host pool, NAT or Cube policy is in
//! the way (the cluster's network policy is the CNI's).
//!
//! The TAP is not persistent: it goes when the supervisor's last descriptor of it
//! closes, and the redirect from the TAP with it. The pod interface's redirect stays
//! until the namespace goes (CNI's `DEL`) or a sandbox started again in it replaces it.
//!
//! [`NetnsChoice::Join`]: crate::network::NetnsChoice::Join

use std::path::Path;
use std::time::{Duration, Instant};

use cube_agent::protocol::NicSettings;
use cube_devices::virtio::tap::{Tap, TapError};
use cube_net::netlink::{NetlinkError, Rtnl};
use cube_net::netns::{NetnsError, NetnsRef};
use cube_net::pod_netns::{self, PodInterface, PodNetnsError};

use crate::error_report::chain as error_chain;
use crate::vm_agent::{agent_client, VmAgentError};

/// The TAP's name in the pod's namespace (one VM per pod).
pub const POD_TAP: &str = "cube-tap0";

/// Why a VM could not be put on its pod's network.
#[derive(Debug, thiserror::Error)]
pub enum PodNetworkError {
    /// The namespace could not be opened or entered.
    #[error("the pod's network namespace")]
    Netns(#[from] NetnsError),
    /// A netlink request in the namespace failed.
    #[error("the pod's network namespace")]
    Netlink(#[from] NetlinkError),
    /// The pod's interface could not be found or spliced.
    #[error("the pod's interface")]
    Pod(#[from] PodNetnsError),
    /// The TAP could not be made.
    #[error("making the VM's TAP {POD_TAP} in the pod's namespace")]
    Tap(#[from] TapError),
    /// The guest's agent did not answer in time.
    #[error("the guest's agent did not answer within {0:?} to take the pod's address")]
    AgentSilent(Duration, #[source] VmAgentError),
    /// The guest's agent refused the settings.
    #[error("the guest did not take the pod's address")]
    Guest(#[source] cube_agent::client::ClientError),
}

/// A VM's link to its pod's network: the TAP behind its NIC, and what the guest must
/// be.
pub struct PodLink {
    tap: Tap,
    interface: PodInterface,
}

impl PodLink {
    /// Makes the TAP in the namespace at `netns` and splices it to the pod's
    /// interface.
    pub fn open(netns: &Path) -> Result<Self, PodNetworkError> {
        let netns = NetnsRef::Path(netns.to_path_buf()).open()?;
        netns.run(|| -> Result<Self, PodNetworkError> {
            let mut rtnl = Rtnl::open()?;
            let interface = pod_netns::pod_interface(&mut rtnl, POD_TAP)?;
            let tap = Tap::open(POD_TAP)?;
            let index = rtnl.link(POD_TAP)?.index;
            rtnl.set_up(index, true)?;
            pod_netns::splice(&mut rtnl, &interface, index)?;
            tracing::info!(
                interface = %interface.name,
                address = %interface.address,
                prefix = interface.prefix_len,
                gateway = ?interface.gateway,
                "VM spliced to the pod's interface"
            );
            Ok(PodLink { tap, interface })
        })?
    }

    /// The TAP behind the VM's NIC.
    pub fn tap(&self) -> &Tap {
        &self.tap
    }

    /// What the guest's NIC must be: the pod interface's MAC, MTU, address and
    /// gateway.
    pub fn nic_settings(&self) -> NicSettings {
        nic_settings(&self.interface)
    }

    /// Has the guest behind the vsock device at `vsock_socket` take the pod's
    /// address, waiting up to `within` for its agent to answer.
    pub fn configure_guest(
        &self,
        vsock_socket: &Path,
        within: Duration,
    ) -> Result<(), PodNetworkError> {
        let deadline = Instant::now() + within;
        let client = loop {
            match agent_client(vsock_socket, Duration::from_millis(500)) {
                Ok(client) => break client,
                Err(e) if Instant::now() >= deadline => {
                    return Err(PodNetworkError::AgentSilent(within, e))
                }
                Err(VmAgentError::NotReady { .. }) => {}
                Err(e) => {
                    tracing::debug!("the guest's agent is not there yet: {}", error_chain(&e));
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        };
        client
            .configure_nic(self.nic_settings())
            .map_err(PodNetworkError::Guest)
    }
}

fn nic_settings(interface: &PodInterface) -> NicSettings {
    NicSettings {
        mac: interface.mac,
        // A link that did not say keeps Ethernet's.
        mtu: if interface.mtu == 0 {
            1500
        } else {
            interface.mtu
        },
        address: interface.address.octets(),
        prefix_len: interface.prefix_len,
        gateway: interface.gateway.map(|g| g.octets()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn the_guest_takes_the_pod_interfaces_identity() {
        let interface = PodInterface {
            index: 3,
            name: "eth0".into(),
            mac: [0x0a, 0x58, 10, 88, 0, 5],
            mtu: 0,
            address: Ipv4Addr::new(10, 88, 0, 5),
            prefix_len: 16,
            gateway: Some(Ipv4Addr::new(10, 88, 0, 1)),
        };
        let settings = nic_settings(&interface);
        assert_eq!(settings.mac, interface.mac);
        assert_eq!(settings.mtu, 1500);
        assert_eq!(settings.address, [10, 88, 0, 5]);
        assert_eq!(settings.prefix_len, 16);
        assert_eq!(settings.gateway, Some([10, 88, 0, 1]));
        let mtu = nic_settings(&PodInterface {
            mtu: 1450,
            gateway: None,
            ..interface
        });
        assert_eq!((mtu.mtu, mtu.gateway), (1450, None));
    }

    #[test]
    fn a_missing_namespace_is_a_clear_error() {
        let Err(err) = PodLink::open(Path::new("/nonexistent/netns/cni-0")) else {
            panic!("a namespace that is not there was opened");
        };
        assert!(
            error_chain(&err).contains("/nonexistent/netns/cni-0"),
            "{}",
            error_chain(&err)
        );
    }
}
