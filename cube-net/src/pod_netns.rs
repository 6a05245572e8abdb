//! A network namespace somebody else set up, such as a Kubernetes pod's (its CNI
//! plugins made an interface in it, gave it an address and routes): what a VM whose
//! NIC stands in for that interface must know of it, and the redirects that splice a
//! TAP to it.
//!
//! The model is Kata Containers' `tcfilter`: every frame that arrives on the pod's
//! interface leaves through the TAP (to the VM), and every frame the VM sends leaves
//! through the pod's interface. The guest, given the interface's MAC, address and
//! gateway, is then the pod on the pod's network, and nothing of the namespace's own
//! stack (its addresses stay where CNI put them) sees the traffic. No bridge is made
//! and no address moves, so CNI's later `DEL` finds what it made.

use std::net::Ipv4Addr;

use crate::netlink::{NetlinkError, Rtnl};

/// Why the pod's interface could not be found or spliced.
#[derive(Debug, thiserror::Error)]
pub enum PodNetnsError {
    /// A netlink request failed.
    #[error("pod network namespace")]
    Netlink(#[from] NetlinkError),
    /// No interface other than loopback (and the TAP) has an IPv4 address.
    #[error("the pod's network namespace has no interface with an IPv4 address")]
    NoAddress,
    /// Several interfaces have addresses and no default route says which is the pod's.
    #[error("the pod's network namespace has several addressed interfaces ({0}) and no default route to choose one")]
    Ambiguous(String),
    /// The interface has no Ethernet address to give the guest.
    #[error("the pod's interface {0} has no Ethernet address")]
    NoMac(String),
}

/// The pod's interface, as CNI set it up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInterface {
    /// Its index in the pod's namespace.
    pub index: u32,
    /// Its name (`eth0` under most CNI plugins).
    pub name: String,
    /// Its Ethernet address: the guest takes it, so that neighbours that learnt it
    /// (CNI plugins announce it) reach the guest.
    pub mac: [u8; 6],
    /// Its MTU.
    pub mtu: u32,
    /// The pod's IPv4 address on it.
    pub address: Ipv4Addr,
    /// That address's prefix length.
    pub prefix_len: u8,
    /// The default route's gateway, where the namespace has one through it.
    pub gateway: Option<Ipv4Addr>,
}

/// Finds the pod's interface in the namespace `rtnl` was opened in: the one the
/// default route leaves through, or else the only one with an IPv4 address; loopback
/// and `skip` (the TAP, where it exists already) never count.
pub fn pod_interface(rtnl: &mut Rtnl, skip: &str) -> Result<PodInterface, PodNetnsError> {
    let links = rtnl.links()?;
    let default_route = rtnl.ipv4_default_route()?;
    let candidates: Vec<(u32, Ipv4Addr, u8)> = rtnl
        .ipv4_addresses()?
        .into_iter()
        .filter(|(index, address, _)| {
            !address.is_loopback()
                && links
                    .iter()
                    .any(|link| link.index == *index && link.name != skip && link.name != "lo")
        })
        .collect();
    let chosen = match default_route {
        Some((index, _)) => candidates.iter().find(|(i, _, _)| *i == index),
        None if candidates.len() == 1 => candidates.first(),
        None => None,
    };
    let Some(&(index, address, prefix_len)) = chosen else {
        return Err(if candidates.is_empty() {
            PodNetnsError::NoAddress
        } else {
            let names: Vec<String> = candidates
                .iter()
                .map(|(i, a, p)| format!("{}: {a}/{p}", link_name(&links, *i)))
                .collect();
            PodNetnsError::Ambiguous(names.join(", "))
        });
    };
    let link = links
        .iter()
        .find(|link| link.index == index)
        .ok_or_else(|| NetlinkError::NoSuchLink(index.to_string()))?;
    let mac: [u8; 6] = link
        .mac
        .as_slice()
        .try_into()
        .map_err(|_| PodNetnsError::NoMac(link.name.clone()))?;
    Ok(PodInterface {
        index,
        name: link.name.clone(),
        mac,
        mtu: link.mtu,
        address,
        prefix_len,
        gateway: default_route
            .filter(|(i, _)| *i == index)
            .map(|(_, gateway)| gateway),
    })
}

fn link_name(links: &[crate::netlink::Link], index: u32) -> String {
    links
        .iter()
        .find(|link| link.index == index)
        .map_or_else(|| index.to_string(), |link| link.name.clone())
}

/// Redirects the pod's interface and the TAP `tap` to each other, both ways (see the
/// module's comment), in place of any redirect there was (a sandbox started again in
/// the same pod). Both must be in the namespace `rtnl` was opened in.
pub fn splice(rtnl: &mut Rtnl, pod: &PodInterface, tap: u32) -> Result<(), PodNetnsError> {
    rtnl.remove_ingress(pod.index)?;
    rtnl.remove_ingress(tap)?;
    rtnl.redirect_ingress(pod.index, tap)?;
    rtnl.redirect_ingress(tap, pod.index)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netns::Netns;
    use std::os::fd::AsRawFd;

    fn root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    /// A namespace of the test's own with a veth pair in it, set up as a CNI plugin
    /// would: `eth0` with an address and a default route, its peer `peer0`.
    fn pod_like(pin: &std::path::Path, with_route: bool) -> Netns {
        let netns = Netns::create_pinned(pin).unwrap();
        netns
            .run(|| {
                let mut rtnl = Rtnl::open().unwrap();
                rtnl.add_veth("eth0", "peer0", None).unwrap();
                let eth0 = rtnl.link("eth0").unwrap();
                rtnl.set_up(eth0.index, true).unwrap();
                let peer = rtnl.link("peer0").unwrap().index;
                rtnl.set_up(peer, true).unwrap();
                rtnl.add_address(eth0.index, Ipv4Addr::new(10, 22, 0, 5), 24)
                    .unwrap();
                if with_route {
                    rtnl.add_default_route(eth0.index, Ipv4Addr::new(10, 22, 0, 1))
                        .unwrap();
                }
            })
            .unwrap();
        netns
    }

    #[test]
    fn the_pod_interface_is_the_default_routes_and_a_spliced_tap_carries_its_traffic() {
        if !root() {
            eprintln!("skipped: needs root (network namespaces)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let pin = dir.path().join("pod");
        let netns = pod_like(&pin, true);
        // The pod's peer0 goes to a namespace of its own (the node's side, 10.22.0.1);
        // a veth tap0 <-> guest0 stands in for the TAP, guest0 in a third namespace
        // (the guest, which takes the pod's address).
        let node_pin = dir.path().join("node");
        let node = Netns::create_pinned(&node_pin).unwrap();
        let guest_pin = dir.path().join("guest");
        let guest = Netns::create_pinned(&guest_pin).unwrap();
        let found = netns
            .run(|| {
                let mut rtnl = Rtnl::open().unwrap();
                let pod = pod_interface(&mut rtnl, "tap0").unwrap();
                let peer = rtnl.link("peer0").unwrap().index;
                rtnl.move_to_netns(peer, node.fd().as_raw_fd()).unwrap();
                rtnl.add_veth("tap0", "guest0", Some(guest.fd().as_raw_fd()))
                    .unwrap();
                let tap = rtnl.link("tap0").unwrap().index;
                rtnl.set_up(tap, true).unwrap();
                // A second splice (a sandbox started again in the pod) replaces the
                // first.
                splice(&mut rtnl, &pod, tap).unwrap();
                splice(&mut rtnl, &pod, tap).unwrap();
                pod
            })
            .unwrap();
        assert_eq!(found.name, "eth0");
        assert_eq!(found.address, Ipv4Addr::new(10, 22, 0, 5));
        assert_eq!(found.prefix_len, 24);
        assert_eq!(found.gateway, Some(Ipv4Addr::new(10, 22, 0, 1)));
        assert!(found.mtu >= 68, "{found:?}");
        assert_ne!(found.mac, [0; 6]);
        let configure = |ns: &Netns, name: &'static str, address: Ipv4Addr| {
            ns.run(move || {
                let mut rtnl = Rtnl::open().unwrap();
                let lo = rtnl.link("lo").unwrap().index;
                rtnl.set_up(lo, true).unwrap();
                let link = rtnl.link(name).unwrap().index;
                rtnl.add_address(link, address, 24).unwrap();
                rtnl.set_up(link, true).unwrap();
            })
            .unwrap()
        };
        configure(&node, "peer0", Ipv4Addr::new(10, 22, 0, 1));
        configure(&guest, "guest0", found.address);
        // A datagram from the node to the pod's address reaches the guest, and the
        // guest's answer comes back: both through the splice only.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let answer = std::thread::scope(|scope| {
            scope.spawn(|| {
                guest
                    .run(|| {
                        let socket = std::net::UdpSocket::bind("10.22.0.5:7777").unwrap();
                        socket
                            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
                            .unwrap();
                        ready_tx.send(()).unwrap();
                        let mut buf = [0u8; 64];
                        let (n, from) = socket.recv_from(&mut buf).unwrap();
                        let mut reply = b"guest got ".to_vec();
                        reply.extend_from_slice(&buf[..n]);
                        socket.send_to(&reply, from).unwrap();
                    })
                    .unwrap()
            });
            ready_rx.recv().unwrap();
            node.run(|| {
                let socket = std::net::UdpSocket::bind("10.22.0.1:0").unwrap();
                socket
                    .set_read_timeout(Some(std::time::Duration::from_secs(10)))
                    .unwrap();
                socket.send_to(b"hello", "10.22.0.5:7777").unwrap();
                let mut buf = [0u8; 64];
                let n = socket.recv(&mut buf).unwrap();
                String::from_utf8_lossy(&buf[..n]).into_owned()
            })
            .unwrap()
        });
        assert_eq!(answer, "guest got hello");
        drop((netns, node, guest));
        for pin in [pin, node_pin, guest_pin] {
            Netns::remove_pin(&pin).unwrap();
        }
    }

    #[test]
    fn without_a_default_route_the_only_addressed_interface_is_the_pods() {
        if !root() {
            eprintln!("skipped: needs root (network namespaces)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let pin = dir.path().join("pod");
        let netns = pod_like(&pin, false);
        let result = netns
            .run(|| {
                let mut rtnl = Rtnl::open().unwrap();
                let one = pod_interface(&mut rtnl, "tap0").unwrap();
                // A second addressed interface and still no route: refused, named.
                let peer = rtnl.link("peer0").unwrap().index;
                rtnl.add_address(peer, Ipv4Addr::new(10, 23, 0, 5), 24)
                    .unwrap();
                let two = pod_interface(&mut rtnl, "tap0").unwrap_err().to_string();
                (one, two)
            })
            .unwrap();
        assert_eq!(result.0.gateway, None);
        assert_eq!(result.0.name, "eth0");
        assert!(result.1.contains("eth0: 10.22.0.5/24"), "{}", result.1);
        assert!(result.1.contains("peer0: 10.23.0.5/24"), "{}", result.1);
        drop(netns);
        Netns::remove_pin(&pin).unwrap();
    }
}
