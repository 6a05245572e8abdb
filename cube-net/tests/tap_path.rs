//! The VM engine's path: a TAP from the pool, driven through its file descriptor as
//! a VMM would. The guest's ARP for the gateway is answered by the datapath, and a
//! UDP datagram goes out through NAT to a server in the lab's outside namespace and
//! its answer comes back into the TAP addressed to the guest.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod lab;

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use cube_net::addressing::{GATEWAY_ADDR, GUEST_ADDR};
use cube_net::EgressPolicy;
use lab::{Lab, PoolGuard, HOST_ADDR, OUT_ADDR};

const GUEST_MAC: [u8; 6] = [0x02, 0xc0, 0xbe, 0x00, 0x00, 0x01];

fn open_tap(name: &str) -> File {
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .unwrap();
    #[repr(C)]
    struct IfReq {
        name: [u8; 16],
        flags: libc::c_short,
        pad: [u8; 22],
    }
    let mut request = IfReq {
        name: [0; 16],
        flags: (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short,
        pad: [0; 22],
    };
    request.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes one struct ifreq, which `request` is.
    let rc = unsafe { libc::ioctl(tun.as_raw_fd(), 0x4004_54ca as _, &mut request) };
    assert_eq!(
        rc,
        0,
        "TUNSETIFF {name}: {}",
        std::io::Error::last_os_error()
    );
    tun
}

/// Reads frames until `wanted` accepts one or `timeout` passes.
fn read_frame(
    tap: &mut File,
    timeout: Duration,
    wanted: impl Fn(&[u8]) -> bool,
) -> Option<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; 65536];
    while Instant::now() < deadline {
        let mut poll = libc::pollfd {
            fd: tap.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let ready = unsafe { libc::poll(&mut poll, 1, 50) };
        if ready <= 0 {
            continue;
        }
        let n = tap.read(&mut buf).unwrap();
        if wanted(&buf[..n]) {
            return Some(buf[..n].to_vec());
        }
    }
    None
}

fn checksum(chunks: &[&[u8]]) -> u16 {
    let mut sum = 0u32;
    for chunk in chunks {
        for pair in chunk.chunks(2) {
            let word = if pair.len() == 2 {
                u16::from_be_bytes([pair[0], pair[1]])
            } else {
                u16::from(pair[0]) << 8
            };
            sum += u32::from(word);
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn arp_request() -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend_from_slice(&[0xff; 6]);
    frame.extend_from_slice(&GUEST_MAC);
    frame.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    frame.extend_from_slice(&GUEST_MAC);
    frame.extend_from_slice(&GUEST_ADDR.octets());
    frame.extend_from_slice(&[0; 6]);
    frame.extend_from_slice(&GATEWAY_ADDR.octets());
    frame
}

fn udp_frame(gateway_mac: &[u8], dst: Ipv4Addr, sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let udp_len = 8 + payload.len() as u16;
    let mut ip = vec![0x45, 0, 0, 0, 0, 1, 0x40, 0, 64, 17, 0, 0];
    ip[2..4].copy_from_slice(&(20 + udp_len).to_be_bytes());
    ip.extend_from_slice(&GUEST_ADDR.octets());
    ip.extend_from_slice(&dst.octets());
    let sum = checksum(&[&ip]);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let mut frame = Vec::new();
    frame.extend_from_slice(gateway_mac);
    frame.extend_from_slice(&GUEST_MAC);
    frame.extend_from_slice(&[0x08, 0x00]);
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&sport.to_be_bytes());
    frame.extend_from_slice(&dport.to_be_bytes());
    frame.extend_from_slice(&udp_len.to_be_bytes());
    frame.extend_from_slice(&[0, 0]); // no checksum, as UDP over IPv4 allows
    frame.extend_from_slice(payload);
    frame
}

#[test]
fn tap_guest_gets_arp_answers_and_udp_through_nat() {
    let Some(lab) = Lab::new("tap") else { return };
    if !std::path::Path::new("/dev/net/tun").exists() {
        eprintln!("skipping: /dev/net/tun is missing");
        return;
    }
    let guard = PoolGuard(lab.open_pool(lab.pool_config(0, 1)));
    let Some(pool) = guard.0.as_ref() else { return };
    let net = pool
        .attach_tap(GUEST_MAC, &EgressPolicy::default())
        .unwrap();
    let tap_name = net.tap_name().unwrap().to_string();
    let host_mac = {
        let line = lab.ip_output("host", &["-o", "link", "show", "dev", &tap_name]);
        let mac = line
            .split("link/ether ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .to_string();
        mac.split(':')
            .map(|byte| u8::from_str_radix(byte, 16).unwrap())
            .collect::<Vec<u8>>()
    };
    let mut tap = lab.netns("host").run(|| open_tap(&tap_name)).unwrap();
    // Opening the TAP brings its carrier up; the kernel activates the queue shortly.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !lab
        .ip_output("host", &["-o", "link", "show", "dev", &tap_name])
        .contains("state UP")
    {
        assert!(Instant::now() < deadline, "TAP never came up");
        std::thread::sleep(Duration::from_millis(5));
    }

    tap.write_all(&arp_request()).unwrap();
    let reply = read_frame(&mut tap, Duration::from_secs(3), |frame| {
        frame.len() >= 42 && frame[12..14] == [0x08, 0x06]
    })
    .expect("no ARP reply");
    assert_eq!(&reply[0..6], &GUEST_MAC, "reply goes to the guest");
    assert_eq!(&reply[20..22], &[0, 2], "ARP reply opcode");
    assert_eq!(
        &reply[22..28],
        host_mac.as_slice(),
        "gateway MAC is the TAP's"
    );
    assert_eq!(&reply[28..32], &GATEWAY_ADDR.octets());
    assert_eq!(&reply[38..42], &GUEST_ADDR.octets());

    let server = lab
        .netns("out")
        .run(|| UdpSocket::bind(("0.0.0.0", 9999)).unwrap())
        .unwrap();
    server
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    tap.write_all(&udp_frame(&host_mac, OUT_ADDR, 5555, 9999, b"ping"))
        .unwrap();
    let mut buf = [0u8; 64];
    let (n, from) = server
        .recv_from(&mut buf)
        .expect("datagram never arrived outside");
    assert_eq!(&buf[..n], b"ping");
    assert_eq!(
        from.ip(),
        std::net::IpAddr::V4(HOST_ADDR),
        "source-NATed to the host"
    );
    server.send_to(b"pong", from).unwrap();

    let answer = read_frame(&mut tap, Duration::from_secs(3), |frame| {
        frame.len() >= 46
            && frame[12..14] == [0x08, 0x00]
            && frame[23] == 17
            && frame[36..38] == 5555u16.to_be_bytes()
    })
    .expect("answer never came back into the TAP");
    assert_eq!(&answer[0..6], &GUEST_MAC);
    assert_eq!(
        &answer[26..30],
        &OUT_ADDR.octets(),
        "from the outside server"
    );
    assert_eq!(
        &answer[30..34],
        &GUEST_ADDR.octets(),
        "to the guest's own address"
    );
    assert_eq!(
        &answer[34..36],
        &9999u16.to_be_bytes(),
        "from the server's port"
    );
    assert_eq!(&answer[42..46], b"pong");
    assert_eq!(checksum(&[&answer[14..34]]), 0, "IP checksum after NAT");
    let udp = &answer[34..];
    if udp[6..8] != [0, 0] {
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&answer[26..34]);
        pseudo.extend_from_slice(&[0, 17]);
        pseudo.extend_from_slice(&(udp.len() as u16).to_be_bytes());
        assert_eq!(checksum(&[&pseudo, udp]), 0, "UDP checksum after NAT");
    }
    let counters = pool.counters(&net).unwrap();
    assert_eq!(
        (counters.tx_packets, counters.rx_packets),
        (1, 1),
        "{counters:?}"
    );
    drop(tap);
    pool.release(net).unwrap();
}
