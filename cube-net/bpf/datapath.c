// SPDX-License-Identifier: (Apache-2.0 OR GPL-2.0)
//
// Cube's sandbox datapath on TC. Every sandbox sees the same guest address and
// gateway; the host tells sandboxes apart by the ifindex of their host-side device.
//
//   from_sandbox  tc ingress of a sandbox's host-side device (veth or TAP): answers
//                 ARP for the gateway, applies the egress policy, source-NATs to the
//                 host's address for the route, and redirects the packet out itself.
//   to_host       tc ingress of the uplinks and tc egress of lo: replies to NATed
//                 flows and connections to exposed ports are rewritten and redirected
//                 into their sandbox; all other traffic passes untouched.
//
// Only IPv4 TCP, UDP and ICMP echo without IP options or fragments leave a sandbox,
// and never to a broadcast, multicast or reserved address; ARP for the gateway is
// answered here; everything else from a sandbox is dropped.
//
// The structs below are mirrored in src/datapath.rs (#[repr(C)], same padding).

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#ifndef AF_INET
#define AF_INET 2
#endif

#define IP_OFF ETH_HLEN
#define L4_OFF (ETH_HLEN + sizeof(struct iphdr))
#define IP_CSUM_OFF (IP_OFF + offsetof(struct iphdr, check))
#define IP_SRC_OFF (IP_OFF + offsetof(struct iphdr, saddr))
#define IP_DST_OFF (IP_OFF + offsetof(struct iphdr, daddr))
#define SPORT_OFF L4_OFF
#define DPORT_OFF (L4_OFF + 2)
// An ICMP echo's identifier plays both ports' part: NAT rewrites it.
#define ICMP_ID_OFF (L4_OFF + offsetof(struct icmp_echo, id))
#define ICMP_CSUM_OFF (L4_OFF + offsetof(struct icmp_echo, checksum))
#define TCP_CSUM_OFF (L4_OFF + offsetof(struct tcphdr, check))
#define UDP_CSUM_OFF (L4_OFF + offsetof(struct udphdr, check))

// From linux/if_arp.h, whose includes pull in libc headers a BPF target lacks.
#define ARPHRD_ETHER 1
#define ARPOP_REQUEST 1
#define ARPOP_REPLY 2
struct arphdr {
	__be16 ar_hrd;
	__be16 ar_pro;
	unsigned char ar_hln;
	unsigned char ar_pln;
	__be16 ar_op;
};

// From linux/icmp.h (same reason): the echo header.
#define ICMP_ECHOREPLY 0
#define ICMP_ECHO 8
struct icmp_echo {
	__u8 type;
	__u8 code;
	__sum16 checksum;
	__be16 id;
	__be16 sequence;
};

#define SANDBOX_INTERNET 1u
#define STATE_OPEN 0
#define STATE_CLOSING 1
#define NAT_PORT_TRIES 16

struct config {
	__u64 tcp_timeout_ns;
	__u64 tcp_closing_timeout_ns;
	__u64 udp_timeout_ns;
	__u32 guest_addr;   // network order
	__u32 gateway_addr; // network order
	__u16 nat_port_min; // host order
	__u16 nat_port_max; // host order
	__u32 lo_ifindex;
};

struct sandbox {
	__u8 guest_mac[6];
	__u8 host_mac[6];
	__u32 flags;
};

struct counters {
	__u64 tx_packets;
	__u64 tx_bytes;
	__u64 rx_packets;
	__u64 rx_bytes;
	__u64 dropped;
};

// LPM key: the first 32 bits (the sandbox's ifindex) always match in full, so one
// trie holds the lists of every sandbox; prefixlen = 32 + CIDR length.
struct policy_key {
	__u32 prefixlen;
	__u32 ifindex;
	__u32 addr;
};

// Outbound flow as the sandbox sees it.
struct flow_key {
	__u32 ifindex;
	__u32 remote_addr;
	__u16 guest_port;
	__u16 remote_port;
	__u8 proto;
	__u8 pad[3];
};

struct nat_entry {
	__u64 last_seen;
	__u32 nat_addr;
	__u16 nat_port;
	__u8 state;
	__u8 pad;
};

// The same flow as its replies arrive at the host.
struct reverse_key {
	__u32 nat_addr;
	__u32 remote_addr;
	__u16 nat_port;
	__u16 remote_port;
	__u8 proto;
	__u8 pad[3];
};

struct reverse_entry {
	__u64 last_seen;
	__u32 ifindex;
	__u16 guest_port;
	__u8 state;
	__u8 pad;
};

struct expose_key {
	__u16 host_port;
	__u8 proto;
	__u8 pad;
};

struct expose_entry {
	__u32 ifindex;
	__u16 guest_port;
	__u16 pad;
};

// An inbound connection to an exposed port, keyed as the sandbox's replies look.
struct exposed_key {
	__u32 ifindex;
	__u32 peer_addr;
	__u16 guest_port;
	__u16 peer_port;
	__u8 proto;
	__u8 pad[3];
};

struct exposed_entry {
	__u64 last_seen;
	__u32 host_addr;
	__u16 host_port;
	__u8 state;
	__u8 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cube_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct sandbox);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cube_sandboxes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cube_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct policy_key);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cube_allow SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct policy_key);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cube_deny SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cube_host_addrs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536); // PoolConfig::max_flows overrides
	__type(key, struct flow_key);
	__type(value, struct nat_entry);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cube_ct_out SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536); // PoolConfig::max_flows overrides
	__type(key, struct reverse_key);
	__type(value, struct reverse_entry);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cube_ct_in SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct expose_key);
	__type(value, struct expose_entry);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cube_expose SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536); // PoolConfig::max_flows overrides
	__type(key, struct exposed_key);
	__type(value, struct exposed_entry);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cube_ct_exposed SEC(".maps");

// What the parser found; ports in network order.
struct packet {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	__u8 proto;
	__u8 closing;
};

static __always_inline struct config *config(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&cube_config, &zero);
}

static __always_inline int expired(const struct config *cfg, __u8 proto, __u8 state, __u64 last_seen,
				   __u64 now)
{
	__u64 timeout = cfg->udp_timeout_ns;
	if (proto == IPPROTO_TCP)
		timeout = state == STATE_CLOSING ? cfg->tcp_closing_timeout_ns : cfg->tcp_timeout_ns;
	// Another CPU may have stamped last_seen after this one read `now`.
	return now > last_seen && now - last_seen > timeout;
}

static __always_inline struct counters *counters(__u32 ifindex)
{
	struct counters *c = bpf_map_lookup_elem(&cube_counters, &ifindex);
	if (c)
		return c;
	struct counters fresh = {};
	bpf_map_update_elem(&cube_counters, &ifindex, &fresh, BPF_NOEXIST);
	return bpf_map_lookup_elem(&cube_counters, &ifindex);
}

// Parses an IPv4 TCP/UDP packet without options or fragments. Returns 0 on success.
static __always_inline int parse(struct __sk_buff *skb, struct packet *pkt)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + IP_OFF;
	if ((void *)(ip + 1) > data_end) {
		if (bpf_skb_pull_data(skb, L4_OFF + sizeof(struct tcphdr)) < 0)
			return -1;
		data = (void *)(long)skb->data;
		data_end = (void *)(long)skb->data_end;
		eth = data;
		ip = data + IP_OFF;
		if ((void *)(ip + 1) > data_end)
			return -1;
	}
	if (eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != 5 || (ip->frag_off & bpf_htons(0x3fff)))
		return -1;
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP && ip->protocol != IPPROTO_ICMP)
		return -1;
	__u32 need = L4_OFF + (ip->protocol == IPPROTO_TCP ? sizeof(struct tcphdr) : sizeof(struct udphdr));
	if (data + need > data_end) {
		if (bpf_skb_pull_data(skb, need) < 0)
			return -1;
		data = (void *)(long)skb->data;
		data_end = (void *)(long)skb->data_end;
		ip = data + IP_OFF;
		if ((void *)(ip + 1) > data_end)
			return -1;
	}
	pkt->saddr = ip->saddr;
	pkt->daddr = ip->daddr;
	pkt->proto = ip->protocol;
	pkt->closing = 0;
	if (ip->protocol == IPPROTO_TCP) {
		struct tcphdr *tcp = data + L4_OFF;
		if ((void *)(tcp + 1) > data_end)
			return -1;
		pkt->sport = tcp->source;
		pkt->dport = tcp->dest;
		pkt->closing = tcp->fin || tcp->rst;
	} else if (ip->protocol == IPPROTO_ICMP) {
		// Echo requests carry the flow's "source port", replies its "destination".
		struct icmp_echo *icmp = data + L4_OFF;
		if ((void *)(icmp + 1) > data_end)
			return -1;
		if (icmp->type == ICMP_ECHO) {
			pkt->sport = icmp->id;
			pkt->dport = 0;
		} else if (icmp->type == ICMP_ECHOREPLY) {
			pkt->sport = 0;
			pkt->dport = icmp->id;
		} else {
			return -1;
		}
	} else {
		struct udphdr *udp = data + L4_OFF;
		if ((void *)(udp + 1) > data_end)
			return -1;
		pkt->sport = udp->source;
		pkt->dport = udp->dest;
	}
	return 0;
}

static __always_inline int l4_csum_off(__u8 proto)
{
	if (proto == IPPROTO_ICMP)
		return ICMP_CSUM_OFF;
	return proto == IPPROTO_TCP ? TCP_CSUM_OFF : UDP_CSUM_OFF;
}

static __always_inline int sport_off(__u8 proto)
{
	return proto == IPPROTO_ICMP ? ICMP_ID_OFF : SPORT_OFF;
}

static __always_inline int dport_off(__u8 proto)
{
	return proto == IPPROTO_ICMP ? ICMP_ID_OFF : DPORT_OFF;
}

static __always_inline __u64 l4_csum_flags(__u8 proto)
{
	return proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

static __always_inline int rewrite_addr(struct __sk_buff *skb, __u8 proto, int off, __u32 old, __u32 new)
{
	if (old == new)
		return 0;
	// ICMP's checksum covers no pseudo-header: addresses do not enter it.
	if (proto != IPPROTO_ICMP &&
	    bpf_l4_csum_replace(skb, l4_csum_off(proto), old, new, BPF_F_PSEUDO_HDR | sizeof(new) | l4_csum_flags(proto)))
		return -1;
	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, old, new, sizeof(new)))
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

static __always_inline int rewrite_port(struct __sk_buff *skb, __u8 proto, int off, __u16 old, __u16 new)
{
	if (old == new)
		return 0;
	if (bpf_l4_csum_replace(skb, l4_csum_off(proto), old, new, sizeof(new) | l4_csum_flags(proto)))
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

// Sends a rewritten packet into a sandbox through its host-side device's egress.
static __always_inline int into_sandbox(struct __sk_buff *skb, __u32 ifindex)
{
	struct sandbox *sb = bpf_map_lookup_elem(&cube_sandboxes, &ifindex);
	if (!sb)
		return TC_ACT_SHOT;
	if (bpf_skb_store_bytes(skb, 0, sb->guest_mac, 6, 0) || bpf_skb_store_bytes(skb, 6, sb->host_mac, 6, 0))
		return TC_ACT_SHOT;
	struct counters *c = counters(ifindex);
	if (c) {
		c->rx_packets += 1;
		c->rx_bytes += skb->len;
	}
	return bpf_redirect(ifindex, 0);
}

// Hands a packet addressed to the host itself to the host's stack through lo.
static __always_inline int into_host(struct __sk_buff *skb, const struct config *cfg)
{
	__u8 zero[12] = {};
	if (bpf_skb_store_bytes(skb, 0, zero, sizeof(zero), 0))
		return TC_ACT_SHOT;
	return bpf_redirect(cfg->lo_ifindex, BPF_F_INGRESS);
}

// A reply to a flow a sandbox opened: back to the sandbox's own address and port.
// Returns -1 when the packet belongs to no such flow.
static __always_inline int reverse_nat(struct __sk_buff *skb, const struct config *cfg,
				       const struct packet *pkt, __u64 now)
{
	struct reverse_key rk = {
		.nat_addr = pkt->daddr,
		.remote_addr = pkt->saddr,
		.nat_port = pkt->dport,
		.remote_port = pkt->sport,
		.proto = pkt->proto,
	};
	struct reverse_entry *re = bpf_map_lookup_elem(&cube_ct_in, &rk);
	if (!re || expired(cfg, pkt->proto, re->state, re->last_seen, now))
		return -1;
	re->last_seen = now;
	if (pkt->closing)
		re->state = STATE_CLOSING;
	__u32 ifindex = re->ifindex;
	__u16 guest_port = re->guest_port;
	if (rewrite_addr(skb, pkt->proto, IP_DST_OFF, pkt->daddr, cfg->guest_addr) ||
	    rewrite_port(skb, pkt->proto, dport_off(pkt->proto), pkt->dport, guest_port))
		return TC_ACT_SHOT;
	return into_sandbox(skb, ifindex);
}

// A packet for an exposed host port: destination-NAT it into its sandbox.
// Returns -1 when the port is not exposed.
static __always_inline int expose_nat(struct __sk_buff *skb, const struct config *cfg,
				      const struct packet *pkt, __u64 now)
{
	struct expose_key ek = {.host_port = pkt->dport, .proto = pkt->proto};
	struct expose_entry *ee = bpf_map_lookup_elem(&cube_expose, &ek);
	if (!ee)
		return -1;
	__u32 ifindex = ee->ifindex;
	__u16 guest_port = ee->guest_port;
	struct exposed_key xk = {
		.ifindex = ifindex,
		.peer_addr = pkt->saddr,
		.guest_port = guest_port,
		.peer_port = pkt->sport,
		.proto = pkt->proto,
	};
	struct exposed_entry xe = {
		.last_seen = now,
		.host_addr = pkt->daddr,
		.host_port = pkt->dport,
		.state = pkt->closing ? STATE_CLOSING : STATE_OPEN,
	};
	bpf_map_update_elem(&cube_ct_exposed, &xk, &xe, BPF_ANY);
	if (rewrite_addr(skb, pkt->proto, IP_DST_OFF, pkt->daddr, cfg->guest_addr) ||
	    rewrite_port(skb, pkt->proto, dport_off(pkt->proto), pkt->dport, guest_port))
		return TC_ACT_SHOT;
	return into_sandbox(skb, ifindex);
}

static __always_inline int is_host_addr(__u32 addr)
{
	return (addr & bpf_htonl(0xff000000)) == bpf_htonl(0x7f000000) ||
	       bpf_map_lookup_elem(&cube_host_addrs, &addr) != 0;
}

// Multicast (224/4), reserved (240/4) and the limited broadcast 255.255.255.255: no
// sandbox sends there, whatever its policy. (A subnet's broadcast address is caught by
// the route lookup: the host's stack would take it, see nat_source.)
static __always_inline int is_group_or_reserved(__u32 addr)
{
	return (addr & bpf_htonl(0xe0000000)) == bpf_htonl(0xe0000000);
}

// Egress policy: the longer of the matching allow and deny prefixes decides; the
// host's own addresses need an allow entry for exactly that address; otherwise the
// sandbox's internet flag decides.
static __always_inline int allowed(__u32 ifindex, __u32 flags, __u32 daddr)
{
	struct policy_key key = {.prefixlen = 64, .ifindex = ifindex, .addr = daddr};
	__u8 *allow = bpf_map_lookup_elem(&cube_allow, &key);
	__u8 *deny = bpf_map_lookup_elem(&cube_deny, &key);
	int allow_len = allow ? *allow : -1;
	int deny_len = deny ? *deny : -1;
	if (is_host_addr(daddr))
		return allow_len == 32;
	if (allow_len > deny_len)
		return 1;
	if (deny_len >= 0)
		return 0;
	return flags & SANDBOX_INTERNET;
}

static __always_inline int answer_arp(struct __sk_buff *skb, const struct config *cfg, const struct sandbox *sb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct arphdr *arp = data + ETH_HLEN;
	// Ethernet/IPv4 ARP body: sha[6] spa[4] tha[6] tpa[4]
	__u8 *body = (void *)(arp + 1);
	if ((void *)(body + 20) > data_end)
		return TC_ACT_SHOT;
	if (arp->ar_hrd != bpf_htons(ARPHRD_ETHER) || arp->ar_pro != bpf_htons(ETH_P_IP) ||
	    arp->ar_hln != 6 || arp->ar_pln != 4 || arp->ar_op != bpf_htons(ARPOP_REQUEST))
		return TC_ACT_SHOT;
	__u32 target, sender;
	__builtin_memcpy(&target, body + 16, 4);
	__builtin_memcpy(&sender, body + 6, 4);
	if (target != cfg->gateway_addr)
		return TC_ACT_SHOT;
	__u8 sender_mac[6];
	__builtin_memcpy(sender_mac, body, 6);
	__builtin_memcpy(eth->h_dest, sender_mac, 6);
	__builtin_memcpy(eth->h_source, sb->host_mac, 6);
	arp->ar_op = bpf_htons(ARPOP_REPLY);
	__builtin_memcpy(body, sb->host_mac, 6);
	__builtin_memcpy(body + 6, &target, 4);
	__builtin_memcpy(body + 10, sender_mac, 6);
	__builtin_memcpy(body + 16, &sender, 4);
	return bpf_redirect(skb->ifindex, 0);
}

// Routes a packet that leaves through the host: redirect by the FIB, or hand it to
// the host's stack when its destination is local.
static __always_inline int route_out(struct __sk_buff *skb, const struct config *cfg, __u32 daddr)
{
	struct bpf_fib_lookup fib = {
		.family = AF_INET,
		.ipv4_dst = daddr,
		.ifindex = skb->ifindex,
	};
	int rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		if (bpf_skb_store_bytes(skb, 0, fib.dmac, 6, 0) || bpf_skb_store_bytes(skb, 6, fib.smac, 6, 0))
			return TC_ACT_SHOT;
		return bpf_redirect(fib.ifindex, 0);
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH)
		return bpf_redirect_neigh(fib.ifindex, 0, 0, 0);
	// Not forwarded: local to the host. Only its known unicast addresses are handed
	// to its stack (a broadcast address, or an address the host gained since the pool
	// last read them, is not).
	if (rc == BPF_FIB_LKUP_RET_NOT_FWDED && is_host_addr(daddr))
		return into_host(skb, cfg);
	return TC_ACT_SHOT;
}

// Source address for traffic to daddr: the host's own address on the route, or the
// destination itself when that is a host address (a sandbox talking to the host).
static __always_inline __u32 nat_source(struct __sk_buff *skb, __u32 daddr)
{
	struct bpf_fib_lookup fib = {
		.family = AF_INET,
		.ipv4_dst = daddr,
		.ifindex = skb->ifindex,
	};
	int rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH);
	// The route lookup says "not forwarded" for every destination the host's stack
	// takes itself: its addresses, and the broadcast addresses of its subnets, which
	// reach every socket bound to 0.0.0.0. Only the addresses the pool knows as the
	// host's (where the policy's exact allow was checked) pass; the rest is dropped.
	if (rc == BPF_FIB_LKUP_RET_NOT_FWDED)
		return is_host_addr(daddr) ? daddr : 0;
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return 0;
	return fib.ipv4_src;
}

static __always_inline int snat(struct __sk_buff *skb, const struct config *cfg, const struct packet *pkt,
				__u32 ifindex, __u64 now)
{
	struct flow_key fk = {
		.ifindex = ifindex,
		.remote_addr = pkt->daddr,
		.guest_port = pkt->sport,
		.remote_port = pkt->dport,
		.proto = pkt->proto,
	};
	__u32 nat_addr = 0;
	__u16 nat_port = 0;
	struct nat_entry *ne = bpf_map_lookup_elem(&cube_ct_out, &fk);
	if (ne && !expired(cfg, pkt->proto, ne->state, ne->last_seen, now)) {
		ne->last_seen = now;
		if (pkt->closing)
			ne->state = STATE_CLOSING;
		nat_addr = ne->nat_addr;
		nat_port = ne->nat_port;
		struct reverse_key rk = {
			.nat_addr = nat_addr,
			.remote_addr = pkt->daddr,
			.nat_port = nat_port,
			.remote_port = pkt->dport,
			.proto = pkt->proto,
		};
		struct reverse_entry *re = bpf_map_lookup_elem(&cube_ct_in, &rk);
		if (re) {
			re->last_seen = now;
			if (pkt->closing)
				re->state = STATE_CLOSING;
		}
	} else {
		nat_addr = nat_source(skb, pkt->daddr);
		if (!nat_addr)
			return TC_ACT_SHOT;
		__u32 span = (__u32)cfg->nat_port_max - cfg->nat_port_min + 1;
		__u32 start = bpf_get_prandom_u32();
		struct reverse_key rk = {
			.nat_addr = nat_addr,
			.remote_addr = pkt->daddr,
			.remote_port = pkt->dport,
			.proto = pkt->proto,
		};
		int found = 0;
		for (int i = 0; i < NAT_PORT_TRIES; i++) {
			__u16 port = cfg->nat_port_min + (start + i) % span;
			rk.nat_port = bpf_htons(port);
			struct reverse_entry *taken = bpf_map_lookup_elem(&cube_ct_in, &rk);
			if (taken && !expired(cfg, pkt->proto, taken->state, taken->last_seen, now))
				continue;
			found = 1;
			break;
		}
		if (!found)
			return TC_ACT_SHOT;
		nat_port = rk.nat_port;
		struct reverse_entry re = {
			.last_seen = now,
			.ifindex = ifindex,
			.guest_port = pkt->sport,
			.state = pkt->closing ? STATE_CLOSING : STATE_OPEN,
		};
		struct nat_entry fresh = {
			.last_seen = now,
			.nat_addr = nat_addr,
			.nat_port = nat_port,
			.state = re.state,
		};
		if (bpf_map_update_elem(&cube_ct_in, &rk, &re, BPF_ANY) ||
		    bpf_map_update_elem(&cube_ct_out, &fk, &fresh, BPF_ANY))
			return TC_ACT_SHOT;
	}
	if (rewrite_addr(skb, pkt->proto, IP_SRC_OFF, pkt->saddr, nat_addr) ||
	    rewrite_port(skb, pkt->proto, sport_off(pkt->proto), pkt->sport, nat_port))
		return TC_ACT_SHOT;
	if (is_host_addr(pkt->daddr)) {
		// Hairpin: a sandbox reaching another sandbox's exposed port on a host address.
		struct packet local = *pkt;
		local.saddr = nat_addr;
		local.sport = nat_port;
		int verdict = expose_nat(skb, cfg, &local, now);
		if (verdict >= 0)
			return verdict;
		return into_host(skb, cfg);
	}
	return route_out(skb, cfg, pkt->daddr);
}

SEC("classifier")
int from_sandbox(struct __sk_buff *skb)
{
	__u32 ifindex = skb->ifindex;
	struct sandbox *sb = bpf_map_lookup_elem(&cube_sandboxes, &ifindex);
	struct config *cfg = config();
	if (!sb || !cfg)
		return TC_ACT_SHOT;
	__u32 flags = sb->flags;
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end)
		return TC_ACT_SHOT;
	if (eth->h_proto == bpf_htons(ETH_P_ARP))
		return answer_arp(skb, cfg, sb);

	struct counters *c = counters(ifindex);
	struct packet pkt;
	if (parse(skb, &pkt) || pkt.saddr != cfg->guest_addr) {
		if (c)
			c->dropped += 1;
		return TC_ACT_SHOT;
	}
	if (c) {
		c->tx_packets += 1;
		c->tx_bytes += skb->len;
	}
	__u64 now = bpf_ktime_get_ns();

	// A reply on a connection that arrived through an exposed port.
	struct exposed_key xk = {
		.ifindex = ifindex,
		.peer_addr = pkt.daddr,
		.guest_port = pkt.sport,
		.peer_port = pkt.dport,
		.proto = pkt.proto,
	};
	struct exposed_entry *xe = bpf_map_lookup_elem(&cube_ct_exposed, &xk);
	if (xe && !expired(cfg, pkt.proto, xe->state, xe->last_seen, now)) {
		xe->last_seen = now;
		if (pkt.closing)
			xe->state = STATE_CLOSING;
		__u32 host_addr = xe->host_addr;
		__u16 host_port = xe->host_port;
		if (rewrite_addr(skb, pkt.proto, IP_SRC_OFF, pkt.saddr, host_addr) ||
		    rewrite_port(skb, pkt.proto, sport_off(pkt.proto), pkt.sport, host_port))
			return TC_ACT_SHOT;
		if (is_host_addr(pkt.daddr)) {
			struct packet local = pkt;
			local.saddr = host_addr;
			local.sport = host_port;
			int verdict = reverse_nat(skb, cfg, &local, now);
			if (verdict >= 0)
				return verdict;
			return into_host(skb, cfg);
		}
		return route_out(skb, cfg, pkt.daddr);
	}

	if (is_group_or_reserved(pkt.daddr) || !allowed(ifindex, flags, pkt.daddr)) {
		if (c)
			c->dropped += 1;
		return TC_ACT_SHOT;
	}
	int verdict = snat(skb, cfg, &pkt, ifindex, now);
	if (verdict == TC_ACT_SHOT && c)
		c->dropped += 1;
	return verdict;
}

SEC("classifier")
int to_host(struct __sk_buff *skb)
{
	struct config *cfg = config();
	if (!cfg)
		return TC_ACT_OK;
	struct packet pkt;
	if (parse(skb, &pkt))
		return TC_ACT_OK;
	__u64 now = bpf_ktime_get_ns();
	int verdict = reverse_nat(skb, cfg, &pkt, now);
	if (verdict >= 0)
		return verdict;
	// Exposed ports are served on the host's addresses, not on 127.0.0.0/8: a
	// sandbox would drop a packet from a loopback source as a martian.
	if ((pkt.daddr & bpf_htonl(0xff000000)) == bpf_htonl(0x7f000000) || !is_host_addr(pkt.daddr))
		return TC_ACT_OK;
	verdict = expose_nat(skb, cfg, &pkt, now);
	if (verdict >= 0)
		return verdict;
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
