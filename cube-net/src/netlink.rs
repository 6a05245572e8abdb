//! A blocking rtnetlink connection: the few link, address, route and traffic-control
//! operations the pool and a pod-bridged VM need, built from `netlink-packet-route`
//! messages.
//!
//! A socket stays in the network namespace it was opened in, so a connection opened
//! inside a sandbox's namespace (see [`crate::netns`]) configures that namespace.

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::RawFd;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL,
    NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage, State,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::tc::{
    TcAction, TcActionAttribute, TcActionMirrorOption, TcActionOption, TcActionType, TcAttribute,
    TcFilterU32Option, TcHandle, TcMessage, TcMirror, TcMirrorActionType, TcOption, TcU32Key,
    TcU32Selector, TcU32SelectorFlags,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

/// Errors of rtnetlink requests.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// The netlink socket could not be opened or used.
    #[error("netlink socket")]
    Socket(#[source] io::Error),
    /// The kernel refused a request.
    #[error("netlink {op} {target}")]
    Request {
        /// What was asked.
        op: &'static str,
        /// The link, address or route it was asked for.
        target: String,
        /// The kernel's answer.
        #[source]
        source: io::Error,
    },
    /// The kernel's answer could not be decoded.
    #[error("malformed netlink reply")]
    Decode,
    /// No link has this name.
    #[error("no link named {0}")]
    NoSuchLink(String),
}

type Result<T> = std::result::Result<T, NetlinkError>;

/// One link as the kernel reports it.
#[derive(Debug, Clone)]
pub struct Link {
    /// Interface index.
    pub index: u32,
    /// Interface name.
    pub name: String,
    /// Hardware address (empty for devices without one).
    pub mac: Vec<u8>,
    /// Whether the link is administratively up.
    pub up: bool,
    /// Whether the kernel reports the link operationally up (carrier, and its
    /// qdisc activated).
    pub running: bool,
    /// Its MTU (0 where the kernel did not say).
    pub mtu: u32,
}

/// A blocking rtnetlink connection in the namespace it was opened in.
pub struct Rtnl {
    socket: Socket,
    sequence: u32,
}

impl Rtnl {
    /// Opens a connection in the calling thread's network namespace.
    pub fn open() -> Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE).map_err(NetlinkError::Socket)?;
        socket.bind_auto().map_err(NetlinkError::Socket)?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .map_err(NetlinkError::Socket)?;
        socket.set_ext_ack(true).map_err(NetlinkError::Socket)?;
        Ok(Self {
            socket,
            sequence: 0,
        })
    }

    /// Sends one request and collects the answers up to the ACK or the end of a dump.
    fn request(
        &mut self,
        message: RouteNetlinkMessage,
        flags: u16,
        op: &'static str,
        target: &str,
    ) -> Result<Vec<RouteNetlinkMessage>> {
        self.sequence = self.sequence.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = self.sequence;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(message));
        packet.finalize();
        let mut buf = vec![0u8; packet.buffer_len()];
        packet.serialize(&mut buf);
        self.socket.send(&buf, 0).map_err(NetlinkError::Socket)?;

        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        let mut answers = Vec::new();
        loop {
            let (bytes, _) = self.socket.recv_from_full().map_err(NetlinkError::Socket)?;
            let mut offset = 0;
            while offset < bytes.len() {
                let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&bytes[offset..])
                    .map_err(|_| NetlinkError::Decode)?;
                let length = reply.header.length as usize;
                if length == 0 {
                    return Err(NetlinkError::Decode);
                }
                offset += length;
                if reply.header.sequence_number != self.sequence {
                    continue;
                }
                match reply.payload {
                    NetlinkPayload::Done(_) => return Ok(answers),
                    NetlinkPayload::Error(error) => match error.code {
                        None => return Ok(answers),
                        Some(_) => {
                            return Err(NetlinkError::Request {
                                op,
                                target: target.to_string(),
                                source: error.to_io(),
                            })
                        }
                    },
                    NetlinkPayload::InnerMessage(inner) => {
                        answers.push(inner);
                        if !dump {
                            return Ok(answers);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// Lists every link in the namespace.
    pub fn links(&mut self) -> Result<Vec<Link>> {
        let answers = self.request(
            RouteNetlinkMessage::GetLink(LinkMessage::default()),
            NLM_F_DUMP,
            "dump",
            "links",
        )?;
        Ok(answers
            .into_iter()
            .filter_map(|answer| match answer {
                RouteNetlinkMessage::NewLink(message) => Some(link_from(message)),
                _ => None,
            })
            .collect())
    }

    /// Looks a link up by name.
    pub fn link(&mut self, name: &str) -> Result<Link> {
        let mut message = LinkMessage::default();
        message
            .attributes
            .push(LinkAttribute::IfName(name.to_string()));
        match self.request(
            RouteNetlinkMessage::GetLink(message),
            NLM_F_ACK,
            "get",
            name,
        ) {
            Ok(answers) => answers
                .into_iter()
                .find_map(|answer| match answer {
                    RouteNetlinkMessage::NewLink(message) => Some(link_from(message)),
                    _ => None,
                })
                .ok_or_else(|| NetlinkError::NoSuchLink(name.to_string())),
            Err(NetlinkError::Request { source, .. })
                if source.raw_os_error() == Some(libc::ENODEV) =>
            {
                Err(NetlinkError::NoSuchLink(name.to_string()))
            }
            Err(error) => Err(error),
        }
    }

    /// Creates a veth pair `host` ↔ `peer`, both down; the peer goes straight into
    /// the namespace behind `peer_netns` when given (creating it there is far
    /// cheaper than moving it later, which waits for an RCU barrier).
    pub fn add_veth(&mut self, host: &str, peer: &str, peer_netns: Option<RawFd>) -> Result<()> {
        let mut peer_message = LinkMessage::default();
        peer_message
            .attributes
            .push(LinkAttribute::IfName(peer.to_string()));
        if let Some(fd) = peer_netns {
            peer_message.attributes.push(LinkAttribute::NetNsFd(fd));
        }
        let mut message = LinkMessage::default();
        message
            .attributes
            .push(LinkAttribute::IfName(host.to_string()));
        message.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer_message))),
        ]));
        self.request(
            RouteNetlinkMessage::NewLink(message),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
            "create veth",
            host,
        )
        .map(drop)
    }

    /// Deletes a link (for a veth, both ends go).
    pub fn delete_link(&mut self, index: u32) -> Result<()> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        self.request(
            RouteNetlinkMessage::DelLink(message),
            NLM_F_ACK,
            "delete link",
            &index.to_string(),
        )
        .map(drop)
    }

    fn set_link(&mut self, message: LinkMessage, op: &'static str) -> Result<()> {
        let target = message.header.index.to_string();
        self.request(
            RouteNetlinkMessage::SetLink(message),
            NLM_F_ACK,
            op,
            &target,
        )
        .map(drop)
    }

    /// Brings a link up or down.
    pub fn set_up(&mut self, index: u32, up: bool) -> Result<()> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        message.header.change_mask = LinkFlags::Up;
        if up {
            message.header.flags = LinkFlags::Up;
        }
        self.set_link(message, "set link state")
    }

    /// Renames a link (it must be down).
    pub fn rename(&mut self, index: u32, name: &str) -> Result<()> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        message
            .attributes
            .push(LinkAttribute::IfName(name.to_string()));
        self.set_link(message, "rename link")
    }

    /// Moves a link into the network namespace behind `netns_fd`.
    pub fn move_to_netns(&mut self, index: u32, netns_fd: RawFd) -> Result<()> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        message.attributes.push(LinkAttribute::NetNsFd(netns_fd));
        self.set_link(message, "move link")
    }

    /// Adds an IPv4 address with its prefix length to a link.
    pub fn add_address(&mut self, index: u32, address: Ipv4Addr, prefix_len: u8) -> Result<()> {
        let mut message = AddressMessage::default();
        message.header.family = AddressFamily::Inet;
        message.header.prefix_len = prefix_len;
        message.header.index = index;
        message
            .attributes
            .push(AddressAttribute::Local(IpAddr::V4(address)));
        message
            .attributes
            .push(AddressAttribute::Address(IpAddr::V4(address)));
        self.request(
            RouteNetlinkMessage::NewAddress(message),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
            "add address",
            &address.to_string(),
        )
        .map(drop)
    }

    /// Lists the IPv4 addresses of the namespace as (link index, address, prefix).
    pub fn ipv4_addresses(&mut self) -> Result<Vec<(u32, Ipv4Addr, u8)>> {
        let mut request = AddressMessage::default();
        request.header.family = AddressFamily::Inet;
        let answers = self.request(
            RouteNetlinkMessage::GetAddress(request),
            NLM_F_DUMP,
            "dump",
            "addresses",
        )?;
        Ok(answers
            .into_iter()
            .filter_map(|answer| match answer {
                RouteNetlinkMessage::NewAddress(message) => {
                    message
                        .attributes
                        .iter()
                        .find_map(|attribute| match attribute {
                            AddressAttribute::Local(IpAddr::V4(address)) => {
                                Some((message.header.index, *address, message.header.prefix_len))
                            }
                            _ => None,
                        })
                }
                _ => None,
            })
            .collect())
    }

    /// Deletes an IPv4 address from a link.
    pub fn delete_address(&mut self, index: u32, address: Ipv4Addr, prefix_len: u8) -> Result<()> {
        let mut message = AddressMessage::default();
        message.header.family = AddressFamily::Inet;
        message.header.prefix_len = prefix_len;
        message.header.index = index;
        message
            .attributes
            .push(AddressAttribute::Local(IpAddr::V4(address)));
        self.request(
            RouteNetlinkMessage::DelAddress(message),
            NLM_F_ACK,
            "delete address",
            &address.to_string(),
        )
        .map(drop)
    }

    /// Adds an IPv4 default route through `gateway` on link `index`.
    pub fn add_default_route(&mut self, index: u32, gateway: Ipv4Addr) -> Result<()> {
        let mut message = RouteMessage::default();
        message.header.address_family = AddressFamily::Inet;
        message.header.table = libc::RT_TABLE_MAIN;
        message.header.protocol = RouteProtocol::Static;
        message.header.scope = RouteScope::Universe;
        message.header.kind = RouteType::Unicast;
        message
            .attributes
            .push(RouteAttribute::Gateway(RouteAddress::Inet(gateway)));
        message.attributes.push(RouteAttribute::Oif(index));
        self.request(
            RouteNetlinkMessage::NewRoute(message),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
            "add default route",
            &gateway.to_string(),
        )
        .map(drop)
    }

    /// The IPv4 default route of the main table, as (link index, gateway); `None`
    /// where there is none (or it has no gateway: a device route).
    pub fn ipv4_default_route(&mut self) -> Result<Option<(u32, Ipv4Addr)>> {
        let mut request = RouteMessage::default();
        request.header.address_family = AddressFamily::Inet;
        let answers = self.request(
            RouteNetlinkMessage::GetRoute(request),
            NLM_F_DUMP,
            "dump",
            "routes",
        )?;
        Ok(answers.into_iter().find_map(|answer| match answer {
            RouteNetlinkMessage::NewRoute(message)
                if message.header.destination_prefix_length == 0
                    && message.header.table == libc::RT_TABLE_MAIN =>
            {
                let mut oif = None;
                let mut gateway = None;
                for attribute in &message.attributes {
                    match attribute {
                        RouteAttribute::Oif(index) => oif = Some(*index),
                        RouteAttribute::Gateway(RouteAddress::Inet(address)) => {
                            gateway = Some(*address)
                        }
                        _ => {}
                    }
                }
                oif.zip(gateway)
            }
            _ => None,
        }))
    }

    /// Removes link `index`'s `ingress` qdisc and its filters (nothing to do where it
    /// has none).
    pub fn remove_ingress(&mut self, index: u32) -> Result<()> {
        match self.request(
            RouteNetlinkMessage::DelQueueDiscipline(ingress_qdisc(index)?),
            NLM_F_ACK,
            "remove ingress qdisc",
            &index.to_string(),
        ) {
            Ok(_) => Ok(()),
            Err(NetlinkError::Request { source, .. })
                if matches!(source.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) =>
            {
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    /// Hands every frame that arrives on link `from` to link `to`'s transmit queue
    /// unchanged (an `ingress` qdisc on `from` with a `u32` filter that matches
    /// everything and whose `mirred` action redirects to `to`), as `tc filter add dev
    /// FROM parent ffff: protocol all u32 match u32 0 0 action mirred egress redirect
    /// dev TO` would (`u32`, not `matchall`: kernels often lack the latter). The
    /// namespace's own stack no longer sees what arrives on `from`.
    pub fn redirect_ingress(&mut self, from: u32, to: u32) -> Result<()> {
        let target = format!("{from} -> {to}");
        let mut qdisc = ingress_qdisc(from)?;
        qdisc
            .attributes
            .push(TcAttribute::Kind("ingress".to_string()));
        self.request(
            RouteNetlinkMessage::NewQueueDiscipline(qdisc),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
            "add ingress qdisc",
            &target,
        )?;

        let mut mirror = TcMirror::default();
        mirror.generic.action = TcActionType::Stolen;
        mirror.eaction = TcMirrorActionType::EgressRedir;
        mirror.ifindex = to;
        let mut action = TcAction::default();
        action.tab = 1;
        action.attributes = vec![
            TcActionAttribute::Kind("mirred".to_string()),
            TcActionAttribute::Options(vec![TcActionOption::Mirror(TcActionMirrorOption::Parms(
                mirror,
            ))]),
        ];
        let mut filter = TcMessage::with_index(qdisc_index(from)?);
        filter.header.parent = INGRESS_HANDLE;
        // Priority 1, every protocol (ETH_P_ALL in network byte order).
        filter.header.info = (1 << 16) | u32::from((libc::ETH_P_ALL as u16).to_be());
        // One key that masks everything away: every frame matches.
        let mut selector = TcU32Selector::default();
        selector.flags = TcU32SelectorFlags::Terminal;
        selector.nkeys = 1;
        selector.keys = vec![TcU32Key::default()];
        filter.attributes = vec![
            TcAttribute::Kind("u32".to_string()),
            TcAttribute::Options(vec![
                TcOption::U32(TcFilterU32Option::Selector(selector)),
                TcOption::U32(TcFilterU32Option::Action(vec![action])),
            ]),
        ];
        self.request(
            RouteNetlinkMessage::NewTrafficFilter(filter),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
            "add redirect filter",
            &target,
        )
        .map(drop)
    }
}

/// The `ingress` qdisc's handle (`ffff:`), which its filters name as their parent.
const INGRESS_HANDLE: TcHandle = TcHandle {
    major: u16::MAX,
    minor: 0,
};

/// Link `index` as a traffic-control message takes it.
fn qdisc_index(index: u32) -> Result<i32> {
    i32::try_from(index).map_err(|_| NetlinkError::NoSuchLink(index.to_string()))
}

/// A message naming link `index`'s `ingress` qdisc.
fn ingress_qdisc(index: u32) -> Result<TcMessage> {
    let mut qdisc = TcMessage::with_index(qdisc_index(index)?);
    qdisc.header.handle = INGRESS_HANDLE;
    qdisc.header.parent = TcHandle::INGRESS;
    Ok(qdisc)
}

fn link_from(message: LinkMessage) -> Link {
    let mut link = Link {
        index: message.header.index,
        name: String::new(),
        mac: Vec::new(),
        up: message.header.flags.contains(LinkFlags::Up),
        running: false,
        mtu: 0,
    };
    for attribute in message.attributes {
        match attribute {
            LinkAttribute::IfName(name) => link.name = name,
            LinkAttribute::Address(mac) => link.mac = mac,
            LinkAttribute::OperState(state) => link.running = state == State::Up,
            LinkAttribute::Mtu(mtu) => link.mtu = mtu,
            _ => {}
        }
    }
    link
}
