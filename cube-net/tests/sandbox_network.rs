//! Sandbox networks end to end, in namespaces this test creates (see lab/mod.rs):
//! NAT to an outside server, policy (denied CIDRs, the host, live changes, offline),
//! exposed ports from the host and from outside, isolation between sandboxes, crash
//! rebuild, conntrack timeouts, the TAP path, and that release leaves nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod lab;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use cube_net::{EgressPolicy, Ipv4Cidr, Protocol, Residue};
use lab::{Lab, PoolGuard, FAR_ADDR, HOST_ADDR, OUT_ADDR};

fn cidr(text: &str) -> Ipv4Cidr {
    text.parse().unwrap()
}

/// The peer address the lab's HTTP server reported in its answer.
fn peer(body: &str) -> SocketAddr {
    body.rsplit(' ').next().unwrap().parse().unwrap()
}

macro_rules! lab_and_pool {
    ($tag:expr, $veths:expr, $taps:expr) => {{
        let Some(lab) = Lab::new($tag) else { return };
        let Some(pool) = lab.open_pool(lab.pool_config($veths, $taps)) else {
            return;
        };
        (lab, PoolGuard(Some(pool)))
    }};
}

#[test]
fn sandbox_reaches_outside_through_nat_and_is_counted() {
    let (mut lab, guard) = lab_and_pool!("nat", 2, 0);
    let pool = guard.pool();
    lab.add_namespace("sb").unwrap();
    lab.serve_http("out", 80, "outside");
    assert_eq!(pool.uplinks().unwrap(), vec!["up0".to_string()]);

    let net = pool
        .attach_veth(&lab.netns_ref("sb"), &EgressPolicy::default())
        .unwrap();
    let inside = lab.ip_output("sb", &["-4", "-o", "addr", "show", "dev", "eth0"]);
    assert!(inside.contains("169.254.0.2/30"), "{inside}");

    let body = lab.http_get("sb", OUT_ADDR, 80).unwrap();
    assert!(body.starts_with("outside "), "{body}");
    let seen = peer(&body);
    assert_eq!(
        seen.ip(),
        std::net::IpAddr::V4(HOST_ADDR),
        "the server sees the host's address"
    );
    assert!(
        pool.config().nat_ports.contains(&seen.port()),
        "NAT port {}",
        seen.port()
    );

    let counters = pool.counters(&net).unwrap();
    assert!(counters.tx_packets >= 4, "{counters:?}");
    assert!(counters.rx_packets >= 3, "{counters:?}");
    assert!(counters.rx_bytes > body.len() as u64, "{counters:?}");
    assert_eq!(counters.dropped, 0, "{counters:?}");
    pool.release(net).unwrap();
}

#[test]
fn device_attached_ahead_refuses_everything_until_activated() {
    let (mut lab, guard) = lab_and_pool!("act", 0, 0);
    let pool = guard.pool();
    lab.add_namespace("sb").unwrap();
    lab.serve_http("out", 80, "outside");
    lab.serve_http("host", 81, "host");

    // Attached before any sandbox asked for it: registered, so a rebuild keeps it,
    // but nothing gets out.
    let net = pool
        .attach_veth(&lab.netns_ref("sb"), &EgressPolicy::offline())
        .unwrap();
    assert_eq!(
        pool.attached().unwrap(),
        vec![net.host_ifname().to_string()]
    );
    assert!(
        lab.http_get("sb", OUT_ADDR, 80).is_err(),
        "standby reached out"
    );
    assert!(
        lab.http_get("sb", HOST_ADDR, 81).is_err(),
        "standby reached the host"
    );
    assert!(pool.counters(&net).unwrap().dropped > 0);

    // Put into service: the real policy, counters from zero.
    let denying = EgressPolicy::default().deny(cidr("203.0.113.0/24"));
    pool.activate(&net, &denying).unwrap();
    assert_eq!(pool.counters(&net).unwrap(), cube_net::Counters::default());
    assert!(lab
        .http_get("sb", OUT_ADDR, 80)
        .unwrap()
        .starts_with("outside "));
    assert!(
        lab.http_get("sb", FAR_ADDR, 80).is_err(),
        "denied CIDR reached"
    );
    assert!(pool.counters(&net).unwrap().tx_packets >= 4);

    let (name, index) = (net.host_ifname().to_string(), net.host_ifindex());
    pool.release(net).unwrap();
    assert_clean(pool.residue(&name, index).unwrap());
}

#[test]
fn two_handles_on_one_pool_never_take_the_same_device_name() {
    let (mut lab, guard) = lab_and_pool!("two", 0, 0);
    let first = guard.pool();
    // A second handle, as a second jail supervisor holds: it knows only the devices
    // that were there when it opened.
    let second = lab.open_pool(lab.pool_config(0, 0)).unwrap();
    lab.add_namespace("a").unwrap();
    lab.add_namespace("b").unwrap();
    let a = first
        .attach_veth(&lab.netns_ref("a"), &EgressPolicy::offline())
        .unwrap();
    let b = second
        .attach_veth(&lab.netns_ref("b"), &EgressPolicy::offline())
        .unwrap();
    assert_ne!(a.host_ifname(), b.host_ifname());
    let (name, index) = (b.host_ifname().to_string(), b.host_ifindex());
    second.release(b).unwrap();
    assert_clean(first.residue(&name, index).unwrap());
    let (name, index) = (a.host_ifname().to_string(), a.host_ifindex());
    first.release(a).unwrap();
    assert_clean(first.residue(&name, index).unwrap());
}

#[test]
fn policy_refuses_denied_cidrs_and_the_host_and_changes_live() {
    let (mut lab, guard) = lab_and_pool!("pol", 1, 0);
    let pool = guard.pool();
    lab.add_namespace("sb").unwrap();
    lab.serve_http("out", 80, "outside");
    lab.serve_http("host", 81, "host");

    let denying = EgressPolicy::default().deny(cidr("203.0.113.0/24"));
    let net = pool.attach_veth(&lab.netns_ref("sb"), &denying).unwrap();
    assert!(lab.http_get("sb", OUT_ADDR, 80).is_ok());
    assert!(
        lab.http_get("sb", FAR_ADDR, 80).is_err(),
        "denied CIDR reached"
    );
    assert!(
        lab.http_get("sb", HOST_ADDR, 81).is_err(),
        "the host itself reached"
    );
    assert!(pool.counters(&net).unwrap().dropped > 0);

    // Live changes: lift the deny, then go offline, then allow the host exactly.
    pool.set_policy(&net, &EgressPolicy::default()).unwrap();
    assert!(
        lab.http_get("sb", FAR_ADDR, 80).is_ok(),
        "lifted deny not in force"
    );
    pool.set_policy(&net, &EgressPolicy::offline()).unwrap();
    assert!(
        lab.http_get("sb", OUT_ADDR, 80).is_err(),
        "offline sandbox reached out"
    );
    let only_far = EgressPolicy::offline().allow(cidr("203.0.113.0/24"));
    pool.set_policy(&net, &only_far).unwrap();
    assert!(
        lab.http_get("sb", FAR_ADDR, 80).is_ok(),
        "allow list not in force"
    );
    assert!(
        lab.http_get("sb", OUT_ADDR, 80).is_err(),
        "offline sandbox reached out"
    );
    // A broad allow does not open the host; an exact one does.
    pool.set_policy(
        &net,
        &EgressPolicy::default().allow(cidr("198.51.100.0/24")),
    )
    .unwrap();
    assert!(
        lab.http_get("sb", HOST_ADDR, 81).is_err(),
        "the host reached by a /24"
    );
    pool.set_policy(
        &net,
        &EgressPolicy::default().allow(Ipv4Cidr::host(HOST_ADDR)),
    )
    .unwrap();
    assert!(lab
        .http_get("sb", HOST_ADDR, 81)
        .unwrap()
        .starts_with("host "));
    pool.release(net).unwrap();
}

#[test]
fn exposed_port_is_reachable_from_the_host_and_from_outside() {
    let (mut lab, guard) = lab_and_pool!("exp", 1, 0);
    let pool = guard.pool();
    lab.add_namespace("sb").unwrap();
    let net = pool
        .attach_veth(&lab.netns_ref("sb"), &EgressPolicy::offline())
        .unwrap();
    lab.serve_http("sb", 8000, "inside");
    pool.expose(&net, 18080, 8000, Protocol::Tcp).unwrap();

    let from_outside = lab.http_get("out", HOST_ADDR, 18080).unwrap();
    assert!(from_outside.starts_with("inside "), "{from_outside}");
    assert_eq!(peer(&from_outside).ip(), std::net::IpAddr::V4(OUT_ADDR));
    let from_host = lab.http_get("host", HOST_ADDR, 18080).unwrap();
    assert!(from_host.starts_with("inside "), "{from_host}");
    // Not served on loopback (documented): the connection must not reach the sandbox.
    assert!(lab.http_get("host", Ipv4Addr::LOCALHOST, 18080).is_err());

    // UDP: an echo in the sandbox, exposed on another host port.
    let echo = lab
        .netns("sb")
        .run(|| std::net::UdpSocket::bind(("0.0.0.0", 5300)).unwrap())
        .unwrap();
    echo.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    pool.expose(&net, 15300, 5300, Protocol::Udp).unwrap();
    let client = lab
        .netns("out")
        .run(|| std::net::UdpSocket::bind(("0.0.0.0", 0)).unwrap())
        .unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    client.send_to(b"question", (HOST_ADDR, 15300)).unwrap();
    let mut buf = [0u8; 32];
    let (n, asker) = echo
        .recv_from(&mut buf)
        .expect("UDP never reached the sandbox");
    assert_eq!(&buf[..n], b"question");
    assert_eq!(asker.ip(), std::net::IpAddr::V4(OUT_ADDR));
    echo.send_to(b"answer", asker).unwrap();
    let (n, from) = client
        .recv_from(&mut buf)
        .expect("UDP answer never came back");
    assert_eq!(&buf[..n], b"answer");
    assert_eq!(
        from,
        SocketAddr::from((HOST_ADDR, 15300)),
        "answer from the exposed address"
    );
    pool.unexpose(&net, 18080, Protocol::Tcp).unwrap();
    assert!(
        lab.http_get("out", HOST_ADDR, 18080).is_err(),
        "withdrawn port still open"
    );
    pool.release(net).unwrap();
}

#[test]
fn sandboxes_cannot_reach_each_other_unless_allowed() {
    let (mut lab, guard) = lab_and_pool!("iso", 2, 0);
    let pool = guard.pool();
    lab.add_namespace("a").unwrap();
    lab.add_namespace("b").unwrap();
    let a = pool
        .attach_veth(&lab.netns_ref("a"), &EgressPolicy::default())
        .unwrap();
    let b = pool
        .attach_veth(&lab.netns_ref("b"), &EgressPolicy::default())
        .unwrap();
    lab.serve_http("b", 8000, "b");
    pool.expose(&b, 18081, 8000, Protocol::Tcp).unwrap();
    assert!(
        matches!(
            pool.expose(&a, 18081, 9000, Protocol::Tcp),
            Err(cube_net::PoolError::PortTaken(18081, Protocol::Tcp))
        ),
        "a took b's exposed port"
    );
    assert!(
        lab.http_get("out", HOST_ADDR, 18081).is_ok(),
        "b's exposed port is up"
    );

    // Every sandbox has the same address; the only way across is b's exposed port
    // on a host address, which a's default policy refuses.
    assert!(lab.http_get("a", HOST_ADDR, 18081).is_err(), "a reached b");
    assert!(lab.http_get("a", lab::OUT_ADDR, 18081).is_err());
    pool.set_policy(
        &a,
        &EgressPolicy::default().allow(Ipv4Cidr::host(HOST_ADDR)),
    )
    .unwrap();
    let body = lab.http_get("a", HOST_ADDR, 18081).unwrap();
    assert!(body.starts_with("b "), "{body}");
    pool.release(a).unwrap();
    pool.release(b).unwrap();
}

fn assert_clean(residue: Residue) {
    assert_eq!(residue, Residue::default(), "left behind");
}

#[test]
fn release_and_destroy_leave_nothing_behind() {
    let (mut lab, mut guard) = lab_and_pool!("rel", 1, 1);
    lab.add_namespace("sb").unwrap();
    lab.serve_http("out", 80, "outside");
    {
        let pool = guard.pool();
        assert_eq!(pool.free().unwrap(), (1, 1));
        let net = pool
            .attach_veth(
                &lab.netns_ref("sb"),
                &EgressPolicy::default().deny(cidr("203.0.113.0/24")),
            )
            .unwrap();
        let tap = pool
            .attach_tap([0x02, 0, 0, 0, 0, 9], &EgressPolicy::default())
            .unwrap();
        pool.expose(&net, 18082, 80, Protocol::Tcp).unwrap();
        lab.http_get("sb", OUT_ADDR, 80).unwrap();
        let (name, index) = (net.host_ifname().to_string(), net.host_ifindex());
        let before = pool.residue(&name, index).unwrap();
        assert_eq!(before.programs, 1, "{before:?}");
        assert_eq!(before.pins, 1, "{before:?}");
        assert!(before.flows > 0 && before.policy_entries > 0 && before.exposed_ports == 1);
        assert!(before.registered);

        pool.release(net).unwrap();
        assert_clean(pool.residue(&name, index).unwrap());
        let (tap_name, tap_index) = (tap.host_ifname().to_string(), tap.host_ifindex());
        pool.release(tap).unwrap();
        // The TAP waits in the pool armed: program attached, nothing of the sandbox.
        let armed = Residue {
            programs: 1,
            pins: 1,
            ..Residue::default()
        };
        assert_eq!(pool.residue(&tap_name, tap_index).unwrap(), armed);
        assert!(
            !lab.ip_output("sb", &["-o", "link"]).contains("eth0"),
            "guest device left in the sandbox"
        );
        assert!(
            !lab.ip_output("host", &["-o", "link"])
                .contains(&format!(": {name}@")),
            "veth left"
        );
        assert_eq!(
            pool.free().unwrap(),
            (1, 1),
            "the prepared namespace and the TAP wait in the pool"
        );

        // A prepared namespace: handed out, used, released with its pin.
        let prepared = pool.attach_prepared(&EgressPolicy::default()).unwrap();
        let pin = prepared.netns_pin().unwrap().to_path_buf();
        let (name, index) = (prepared.host_ifname().to_string(), prepared.host_ifindex());
        pool.release(prepared).unwrap();
        assert_clean(pool.residue(&name, index).unwrap());
        assert!(!pin.exists(), "namespace pin left at {}", pin.display());
        pool.refill().unwrap();
        assert_eq!(pool.free().unwrap(), (1, 1));
    }

    let pool_name = guard.pool().config().name.clone();
    let pin_dir = std::path::Path::new("/sys/fs/bpf/cube-net").join(&pool_name);
    assert!(pin_dir.join("maps/cube_ct_out").exists());
    guard.0.take().unwrap().destroy().unwrap();
    assert!(!pin_dir.exists(), "pins left in {}", pin_dir.display());
    let links = lab.ip_output("host", &["-o", "link"]);
    assert!(!links.contains(": cn"), "pool devices left: {links}");
    let netns_dir = std::path::Path::new("/run/cube-net").join(&pool_name);
    assert!(
        !netns_dir.exists(),
        "namespace pins left in {}",
        netns_dir.display()
    );
    let host = lab.netns("host");
    for (device, hook) in [
        ("up0", cube_net::datapath::Hook::Ingress),
        ("lo", cube_net::datapath::Hook::Egress),
    ] {
        let programs = host
            .run(|| cube_net::datapath::tcx_programs(device, hook))
            .unwrap()
            .unwrap();
        assert_eq!(programs, 0, "program left on {device}");
    }
}

#[test]
fn pool_rebuilds_after_a_crash() {
    let Some(mut lab) = Lab::new("crash") else {
        return;
    };
    lab.add_namespace("alive").unwrap();
    lab.add_namespace("dies").unwrap();
    lab.serve_http("out", 80, "outside");
    let config = lab.pool_config(2, 0);
    let Some(pool) = lab.open_pool(config.clone()) else {
        return;
    };
    let alive = pool
        .attach_veth(&lab.netns_ref("alive"), &EgressPolicy::default())
        .unwrap();
    let dies = pool
        .attach_veth(&lab.netns_ref("dies"), &EgressPolicy::default())
        .unwrap();
    lab.http_get("dies", OUT_ADDR, 80).unwrap();
    let alive_name = alive.host_ifname().to_string();
    let (dead_name, dead_index) = (dies.host_ifname().to_string(), dies.host_ifindex());
    // A re-attach replaces a hook's link, and with it the link's pin.
    let links_dir = std::path::Path::new("/sys/fs/bpf/cube-net")
        .join(&config.name)
        .join("links");
    let uplink_pins = || {
        ["up0-ingress", "lo-egress"].map(|pin| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(links_dir.join(pin))
                .map(|meta| meta.ino())
                .ok()
        })
    };
    let before = uplink_pins();
    // The process dies without releasing anything; one sandbox dies with it.
    drop(pool);
    drop(alive);
    drop(dies);
    lab.remove_namespace("dies");
    // The kernel tears a namespace down asynchronously; wait for its veth to go.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while lab
        .ip_output("host", &["-o", "link"])
        .contains(&format!(": {dead_name}@"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "{dead_name} outlived its namespace"
        );
        std::thread::sleep(Duration::from_millis(10));
    }

    let guard = PoolGuard(lab.open_pool(config));
    let pool = guard.pool();
    if cube_net::datapath::tcx_supported() {
        assert!(before.iter().all(Option::is_some), "{before:?}");
        assert_eq!(
            uplink_pins(),
            before,
            "reopening with the same datapath build re-attached the uplink or lo"
        );
    }
    assert_eq!(pool.attached().unwrap(), vec![alive_name.clone()]);
    assert_eq!(
        pool.free().unwrap().0,
        2,
        "prepared namespaces survive a crash"
    );
    assert_clean(pool.residue(&dead_name, dead_index).unwrap());
    let body = lab.http_get("alive", OUT_ADDR, 80).unwrap();
    assert!(
        body.starts_with("outside "),
        "surviving sandbox lost its network"
    );

    pool.release_by_name(&alive_name).unwrap();
    assert!(pool.attached().unwrap().is_empty());
    assert!(!lab.ip_output("alive", &["-o", "link"]).contains("eth0"));
}

#[test]
fn finished_flows_expire_from_conntrack() {
    let Some(mut lab) = Lab::new("ct") else {
        return;
    };
    lab.add_namespace("sb").unwrap();
    lab.serve_http("out", 80, "outside");
    let mut config = lab.pool_config(1, 0);
    config.tcp_closing_timeout = Duration::from_millis(1);
    let guard = PoolGuard(lab.open_pool(config));
    let Some(pool) = guard.0.as_ref() else { return };
    let net = pool
        .attach_veth(&lab.netns_ref("sb"), &EgressPolicy::default())
        .unwrap();
    lab.http_get("sb", OUT_ADDR, 80).unwrap();
    let flows = pool
        .residue(net.host_ifname(), net.host_ifindex())
        .unwrap()
        .flows;
    assert_eq!(flows, 2, "one NAT flow in each direction");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(pool.sweep_conntrack().unwrap(), 2);
    assert_eq!(
        pool.residue(net.host_ifname(), net.host_ifindex())
            .unwrap()
            .flows,
        0
    );
    pool.release(net).unwrap();
}

#[test]
fn prepared_namespace_carries_traffic() {
    let (mut lab, guard) = lab_and_pool!("prep", 1, 0);
    let pool = guard.pool();
    lab.serve_http("out", 80, "outside");
    let net = pool.attach_prepared(&EgressPolicy::default()).unwrap();
    // What a jail does: join the namespace, then talk.
    let body = net
        .netns()
        .unwrap()
        .run(|| {
            use std::io::{Read, Write};
            let target = SocketAddr::from((OUT_ADDR, 80));
            let mut stream =
                std::net::TcpStream::connect_timeout(&target, Duration::from_secs(2)).unwrap();
            stream.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
            let mut response = String::new();
            stream.read_to_string(&mut response).unwrap();
            response
        })
        .unwrap();
    assert!(body.contains("outside "), "{body}");
    assert!(pool.counters(&net).unwrap().rx_packets > 0);
    pool.release(net).unwrap();
}

#[test]
fn bulk_transfer_through_nat_arrives_whole() {
    use std::io::{Read, Write};
    let (mut lab, guard) = lab_and_pool!("bulk", 1, 0);
    let pool = guard.pool();
    lab.add_namespace("sb").unwrap();
    let net = pool
        .attach_veth(&lab.netns_ref("sb"), &EgressPolicy::default())
        .unwrap();
    let listener = lab
        .netns("out")
        .run(|| std::net::TcpListener::bind(("0.0.0.0", 7100)).unwrap())
        .unwrap();
    let sink = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut total = 0u64;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match stream.read(&mut buf).unwrap() {
                0 => break,
                n => total += n as u64,
            }
        }
        stream.write_all(&total.to_be_bytes()).unwrap();
    });
    // Large GSO segments on both CPUs: the flow must keep its NAT port throughout.
    let sent = 64u64 << 20;
    let received = lab
        .netns("sb")
        .run(move || {
            let target = SocketAddr::from((OUT_ADDR, 7100));
            let mut stream =
                std::net::TcpStream::connect_timeout(&target, Duration::from_secs(2)).unwrap();
            let chunk = vec![0xa5u8; 1 << 20];
            for _ in 0..(sent >> 20) {
                stream.write_all(&chunk).unwrap();
            }
            stream.shutdown(std::net::Shutdown::Write).unwrap();
            let mut total = [0u8; 8];
            stream.read_exact(&mut total).unwrap();
            u64::from_be_bytes(total)
        })
        .unwrap();
    sink.join().unwrap();
    assert_eq!(received, sent);
    assert!(pool.counters(&net).unwrap().tx_bytes > sent);
    pool.release(net).unwrap();
}

/// Sends one ICMP echo from namespace `which` (a ping socket) and waits for the reply.
fn ping(lab: &Lab, which: &str, to: Ipv4Addr) -> bool {
    use std::os::fd::FromRawFd;
    lab.netns(which)
        .run(move || {
            std::fs::write("/proc/sys/net/ipv4/ping_group_range", "0 0").unwrap();
            // SAFETY: plain socket(2); the fd is handed to UdpSocket, which owns it.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, libc::IPPROTO_ICMP) };
            assert!(fd >= 0, "ping socket: {}", std::io::Error::last_os_error());
            // SAFETY: `fd` is a fresh, open socket owned by nobody else.
            let socket = unsafe { std::net::UdpSocket::from_raw_fd(fd) };
            socket
                .set_read_timeout(Some(Duration::from_millis(700)))
                .unwrap();
            // Echo request: type 8, code 0; the kernel fills checksum and identifier.
            let request = [8u8, 0, 0, 0, 0, 0, 0, 1, b'c', b'u', b'b', b'e'];
            socket.send_to(&request, (to, 0)).unwrap();
            let mut reply = [0u8; 64];
            match socket.recv_from(&mut reply) {
                Ok((n, from)) => {
                    n == request.len()
                        && reply[0] == 0
                        && reply[8..n] == request[8..]
                        && from.ip() == to
                }
                Err(_) => false,
            }
        })
        .unwrap()
}

#[test]
fn ping_goes_through_nat_and_obeys_policy() {
    let (mut lab, guard) = lab_and_pool!("icmp", 1, 0);
    let pool = guard.pool();
    lab.add_namespace("sb").unwrap();
    let denying = EgressPolicy::default().deny(cidr("203.0.113.0/24"));
    let net = pool.attach_veth(&lab.netns_ref("sb"), &denying).unwrap();
    assert!(ping(&lab, "sb", OUT_ADDR), "no echo reply through NAT");
    assert!(!ping(&lab, "sb", FAR_ADDR), "denied address answered");
    assert!(!ping(&lab, "sb", HOST_ADDR), "the host answered");
    pool.set_policy(&net, &EgressPolicy::default()).unwrap();
    assert!(ping(&lab, "sb", FAR_ADDR), "lifted deny not in force");
    pool.release(net).unwrap();
}

/// Kills and reaps a helper process on every path.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn attaches_into_a_process_namespace_by_pid() {
    let (mut lab, guard) = lab_and_pool!("pid", 1, 0);
    let pool = guard.pool();
    lab.serve_http("out", 80, "outside");
    // A stand-in for a jail's init: a process in a network namespace of its own.
    let Ok(child) = std::process::Command::new("unshare")
        .args(["-n", "sleep", "60"])
        .spawn()
    else {
        eprintln!("skipping: unshare(1) is missing");
        return;
    };
    let child = Child(child);
    let pid = child.0.id() as i32;
    let own = std::fs::read_link("/proc/self/ns/net").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::fs::read_link(format!("/proc/{pid}/ns/net"))
        .ok()
        .as_ref()
        == Some(&own)
        || std::fs::read_link(format!("/proc/{pid}/exe"))
            .map(|exe| !exe.ends_with("sleep"))
            .unwrap_or(true)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "unshare never entered its namespace"
        );
        std::thread::sleep(Duration::from_millis(5));
    }

    let net = pool
        .attach_veth(&cube_net::NetnsRef::Pid(pid), &EgressPolicy::default())
        .unwrap();
    let body = net
        .netns()
        .unwrap()
        .run(|| {
            use std::io::{Read, Write};
            let target = SocketAddr::from((OUT_ADDR, 80));
            let mut stream =
                std::net::TcpStream::connect_timeout(&target, Duration::from_secs(2)).unwrap();
            stream.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
            let mut response = String::new();
            stream.read_to_string(&mut response).unwrap();
            response
        })
        .unwrap();
    assert!(body.contains("outside "), "{body}");
    let name = net.host_ifname().to_string();
    pool.release(net).unwrap();
    assert!(!lab
        .ip_output("host", &["-o", "link"])
        .contains(&format!(": {name}@")));
}

/// A UDP socket bound to 0.0.0.0:`port` in namespace `which`, as a host service
/// listening on every address would be.
fn udp_listener(lab: &Lab, which: &str, port: u16) -> std::net::UdpSocket {
    let socket = lab
        .netns(which)
        .run(move || std::net::UdpSocket::bind(("0.0.0.0", port)))
        .unwrap()
        .unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(400)))
        .unwrap();
    socket
}

/// Sends `payload` to `to` from namespace `which` (broadcast allowed on the socket).
fn udp_send(lab: &Lab, which: &str, to: SocketAddr, payload: &'static [u8]) {
    lab.netns(which)
        .run(move || {
            let socket = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            socket.set_broadcast(true).unwrap();
            // A refused packet is dropped silently; only local errors count here.
            let _ = socket.send_to(payload, to);
        })
        .unwrap();
}

/// Every payload `socket` receives until it stays quiet.
fn received(socket: &std::net::UdpSocket) -> Vec<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    while let Ok((n, _)) = socket.recv_from(&mut buf) {
        got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    got
}

#[test]
fn broadcast_multicast_and_host_addresses_added_later_stay_out_of_reach() {
    let (mut lab, guard) = lab_and_pool!("bc", 1, 0);
    let pool = guard.pool();
    lab.add_namespace("sb").unwrap();
    let port = 9999;
    let on_host = udp_listener(&lab, "host", port);
    let outside = udp_listener(&lab, "out", port);
    let net = pool
        .attach_veth(&lab.netns_ref("sb"), &EgressPolicy::default())
        .unwrap();
    let at = |addr: Ipv4Addr| SocketAddr::from((addr, port));

    // The host's subnet broadcast (198.51.100.0/24 is in no default deny range): the
    // host's stack would deliver it to every socket bound to 0.0.0.0.
    udp_send(
        &lab,
        "sb",
        at(Ipv4Addr::new(198, 51, 100, 255)),
        b"subnet-broadcast",
    );
    // A control that must arrive: plain unicast to the outside.
    udp_send(&lab, "sb", at(OUT_ADDR), b"unicast");
    assert_eq!(received(&on_host), Vec::<String>::new());
    assert_eq!(received(&outside), vec!["unicast".to_string()]);

    // Broadcast and multicast stay dropped even where a policy allows their ranges.
    let allow_all = EgressPolicy::default()
        .allow(cidr("224.0.0.0/4"))
        .allow(cidr("240.0.0.0/4"))
        .allow(cidr("198.51.100.0/24"));
    pool.set_policy(&net, &allow_all).unwrap();
    udp_send(&lab, "sb", at(Ipv4Addr::BROADCAST), b"limited-broadcast");
    udp_send(&lab, "sb", at(Ipv4Addr::new(224, 0, 0, 1)), b"all-hosts");
    udp_send(
        &lab,
        "sb",
        at(Ipv4Addr::new(198, 51, 100, 255)),
        b"subnet-again",
    );
    assert_eq!(received(&on_host), Vec::<String>::new());
    assert_eq!(received(&outside), Vec::<String>::new());

    // An address the host gains after the pool opened is the host's too: refused to
    // a policy that allows its range, reachable with an exact allow.
    lab.serve_http("host", 82, "host");
    ip_in(
        &lab,
        "host",
        &["addr", "add", "198.51.100.77/24", "dev", "up0"],
    );
    let added = Ipv4Addr::new(198, 51, 100, 77);
    assert!(
        lab.http_get("sb", added, 82).is_err(),
        "a host address added later was reached"
    );
    pool.set_policy(&net, &EgressPolicy::default().allow(Ipv4Cidr::host(added)))
        .unwrap();
    assert!(lab.http_get("sb", added, 82).unwrap().starts_with("host "));
    pool.release(net).unwrap();
}

fn ip_in(lab: &Lab, which: &str, args: &[&str]) {
    let name = lab.name(which);
    let mut full = vec!["-n", name.as_str()];
    full.extend_from_slice(args);
    lab::ip(&full).unwrap();
}
