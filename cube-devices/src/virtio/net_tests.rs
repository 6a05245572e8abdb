//! virtio-net with a real TAP inside a network namespace the test makes: the test
//! plays the guest driver and talks ARP with the namespace's kernel.

use super::*;
use crate::event_loop::{DeviceEventLoop, Subscriber};
use crate::virtio::mmio::{regs, MmioTransport};
use crate::virtio::queue::{VIRTQ_DESC_F_NEXT as N, VIRTQ_DESC_F_WRITE as W};
use crate::virtio::slot::{SlotEvents, VirtioSlot};
use crate::virtio::test_driver::RecordingLine;
use crate::virtio::test_driver::{memory, Driver, Ring};
use std::process::Command;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use vm_memory::{Bytes, GuestAddress};

const MAC: [u8; 6] = [0x02, 0xcb, 0, 0, 0, 2];
const RX_RING: u64 = 0x20000;
const TX_RING: u64 = 0x24000;
const RX_BUFS: u64 = 0x40000;
const RX_BUF_LEN: u32 = 2048;
const TX_BUF: u64 = 0x80000;

/// A network namespace for one test, deleted on drop.
struct NetNs {
    name: String,
}

impl NetNs {
    fn new(tag: &str) -> Option<Self> {
        let name = format!("cube-vnet-{}-{tag}", std::process::id());
        let ok = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("skipping: cannot create a network namespace (needs root and iproute2)");
            return None;
        }
        Some(NetNs { name })
    }

    fn ip(&self, args: &[&str]) {
        let status = Command::new("ip")
            .args(["-n", &self.name])
            .args(args)
            .status()
            .unwrap();
        assert!(status.success(), "ip {args:?}");
    }

    /// Runs `f` on a thread that entered the namespace.
    fn enter<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(path).unwrap();
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            f()
        })
        .join()
        .unwrap()
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn arp_request(sender_ip: [u8; 4], target_ip: [u8; 4]) -> Vec<u8> {
    let mut f = vec![0u8; VNET_HDR_LEN];
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&MAC);
    f.extend_from_slice(&[0x08, 0x06]);
    f.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&MAC);
    f.extend_from_slice(&sender_ip);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&target_ip);
    f
}

struct Guest {
    slot: VirtioSlot,
    rx: Ring,
    tx: Ring,
    rx_seen: u16,
}

impl Guest {
    fn send(&mut self, frame: &[u8]) {
        self.tx
            .mem
            .write_slice(frame, GuestAddress(TX_BUF))
            .unwrap();
        // Header and frame in separate descriptors, as Linux may send them.
        self.tx.set_desc(0, TX_BUF, VNET_HDR_LEN as u32, N, 1);
        self.tx.set_desc(
            1,
            TX_BUF + VNET_HDR_LEN as u64,
            (frame.len() - VNET_HDR_LEN) as u32,
            0,
            0,
        );
        self.tx.publish(0);
        self.slot.lock().notify_queue(TX);
    }

    fn post_rx(&mut self, count: u16) {
        for i in 0..count {
            self.rx.set_desc(
                i,
                RX_BUFS + u64::from(i) * u64::from(RX_BUF_LEN),
                RX_BUF_LEN,
                W,
                0,
            );
            self.rx.publish(i);
        }
        self.slot.lock().notify_queue(RX);
    }

    /// Frames received so far and not yet looked at.
    fn received(&mut self) -> Vec<Vec<u8>> {
        let mut frames = Vec::new();
        while self.rx.used_idx() != self.rx_seen {
            let (id, len) = self.rx.used(self.rx_seen);
            self.rx_seen = self.rx_seen.wrapping_add(1);
            let addr = RX_BUFS + u64::from(id) * u64::from(RX_BUF_LEN);
            frames.push(self.rx.read_buf(addr, len as usize));
        }
        frames
    }
}

fn is_arp_reply_from(frame: &[u8], ip: [u8; 4]) -> bool {
    let eth = &frame[VNET_HDR_LEN..];
    eth.len() >= 42
        && eth[..6] == MAC
        && eth[12..14] == [0x08, 0x06]
        && eth[20..22] == [0, 2]
        && eth[28..32] == ip
}

#[test]
fn arp_round_trip_through_a_tap_in_a_namespace_including_a_starved_receive_queue() {
    let Some(ns) = NetNs::new("arp") else { return };
    let tap = ns.enter(|| Tap::open("cubetap0").unwrap());
    ns.ip(&["addr", "add", "10.77.0.1/24", "dev", "cubetap0"]);
    ns.ip(&["link", "set", "cubetap0", "up"]);

    let mem = memory();
    let net = Net::new(tap, MAC).unwrap();
    let mut driver = Driver::new(Box::new(net), &mem);
    assert_eq!(driver.read32(regs::DEVICE_ID), VIRTIO_ID_NET);
    let mut mac = [0u8; 6];
    driver.transport.read(regs::CONFIG, &mut mac);
    assert_eq!(mac, MAC);
    let rx = Ring::at(&mem, 64, RX_RING);
    let tx = Ring::at(&mem, 64, TX_RING);
    let features = 1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_NET_F_MAC;
    driver.bring_up_queues(features, &[&rx, &tx]);
    let line = driver.line.clone();
    let slot = VirtioSlot::new(driver.transport);
    let events: Subscriber = Arc::new(Mutex::new(SlotEvents::new(slot.clone(), Vec::new())));
    let _event_loop = DeviceEventLoop::start(vec![events]).unwrap();
    let guest = Arc::new(Mutex::new(Guest {
        slot,
        rx,
        tx,
        rx_seen: 0,
    }));

    // The guest asks before it has posted a single receive buffer: the reply waits in
    // the TAP.
    guest
        .lock()
        .unwrap()
        .send(&arp_request([10, 77, 0, 2], [10, 77, 0, 1]));
    assert_eq!(guest.lock().unwrap().tx.used_idx(), 1);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(guest.lock().unwrap().rx.used_idx(), 0);
    guest.lock().unwrap().post_rx(32);

    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = 0;
    loop {
        let frames = guest.lock().unwrap().received();
        seen += frames.len();
        if frames.iter().any(|f| is_arp_reply_from(f, [10, 77, 0, 1])) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no ARP reply among {seen} frames"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(line.raises() > 0);
    let frames_before = guest.lock().unwrap().rx.used_idx();

    // Malformed transmissions are consumed without reaching the wire or panicking.
    {
        let mut g = guest.lock().unwrap();
        g.tx.set_desc(2, TX_BUF, 4, 0, 0); // shorter than the header
        g.tx.publish(2);
        g.tx.set_desc(3, TX_BUF, 8, N, 3); // a loop
        g.tx.publish(3);
        g.tx.set_desc(4, 0x7000_0000, 64, 0, 0); // outside guest memory
        g.tx.publish(4);
        g.slot.lock().notify_queue(TX);
        assert_eq!(g.tx.used_idx(), 4);
    }
    assert!(guest.lock().unwrap().rx.used_idx() >= frames_before);
}

#[test]
fn state_round_trips_and_a_foreign_mac_is_refused() {
    let Some(ns) = NetNs::new("state") else {
        return;
    };
    let mem = memory();
    let mut driver = Driver::new(
        Box::new(Net::new(ns.enter(|| Tap::open("cubetap1").unwrap()), MAC).unwrap()),
        &mem,
    );
    let rx = Ring::at(&mem, 64, RX_RING);
    let tx = Ring::at(&mem, 64, TX_RING);
    driver.bring_up_queues(1 << VIRTIO_F_VERSION_1, &[&rx, &tx]);
    let state = driver.transport.save().unwrap();
    drop(driver);
    let same = Net::new(ns.enter(|| Tap::open("cubetap1").unwrap()), MAC).unwrap();
    let restored = MmioTransport::restore(
        Box::new(same),
        mem.clone(),
        Arc::new(RecordingLine::default()),
        &state,
    )
    .unwrap();
    assert!(restored.is_activated());
    drop(restored);
    let mut other_mac = MAC;
    other_mac[5] = 9;
    let other = Net::new(ns.enter(|| Tap::open("cubetap1").unwrap()), other_mac).unwrap();
    let err = MmioTransport::restore(
        Box::new(other),
        mem,
        Arc::new(RecordingLine::default()),
        &state,
    )
    .err()
    .unwrap();
    assert!(format!("{err:?}").contains("MAC"));
    assert!(matches!(
        Tap::open("bad name!"),
        Err(super::super::tap::TapError::Name(_))
    ));
}

#[test]
fn a_frame_queued_before_a_snapshot_is_sent_after_restore() {
    let Some(ns) = NetNs::new("restore") else {
        return;
    };
    let mem = memory();
    let mut driver = Driver::new(
        Box::new(Net::new(ns.enter(|| Tap::open("cubetap2").unwrap()), MAC).unwrap()),
        &mem,
    );
    let rx = Ring::at(&mem, 64, RX_RING);
    let mut tx = Ring::at(&mem, 64, TX_RING);
    driver.bring_up_queues(1 << VIRTIO_F_VERSION_1, &[&rx, &tx]);
    // The guest queues an ARP request; the snapshot comes before its notification.
    let frame = arp_request([10, 78, 0, 2], [10, 78, 0, 1]);
    mem.write_slice(&frame, GuestAddress(TX_BUF)).unwrap();
    tx.set_desc(0, TX_BUF, frame.len() as u32, 0, 0);
    tx.publish(0);
    let state = driver.transport.save().unwrap();
    drop(driver);

    // The clone gets its own TAP (the old one went away with its descriptor).
    let tap = ns.enter(|| Tap::open("cubetap3").unwrap());
    ns.ip(&["addr", "add", "10.78.0.1/24", "dev", "cubetap3"]);
    ns.ip(&["link", "set", "cubetap3", "up"]);
    let net = Net::new(tap, MAC).unwrap();
    let transport = MmioTransport::restore(
        Box::new(net),
        mem.clone(),
        Arc::new(RecordingLine::default()),
        &state,
    )
    .unwrap();
    let slot = VirtioSlot::new(transport);
    let events: Subscriber = Arc::new(Mutex::new(SlotEvents::new(slot.clone(), Vec::new())));
    let _event_loop = DeviceEventLoop::start(vec![events]).unwrap();
    let mut guest = Guest {
        slot,
        rx,
        tx,
        rx_seen: 0,
    };
    guest.post_rx(32);
    guest.slot.lock().notify_queue(TX);
    assert_eq!(guest.tx.used_idx(), 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if guest
            .received()
            .iter()
            .any(|f| is_arp_reply_from(f, [10, 78, 0, 1]))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restored device's frame got no reply"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_disconnected_nic_drops_what_the_guest_sends_and_restores_onto_a_tap() {
    let mem = memory();
    let mut driver = Driver::new(Box::new(Net::disconnected(MAC).unwrap()), &mem);
    assert_eq!(driver.read32(regs::DEVICE_ID), VIRTIO_ID_NET);
    let rx = Ring::at(&mem, 64, RX_RING);
    let tx = Ring::at(&mem, 64, TX_RING);
    driver.bring_up_queues(1 << VIRTIO_F_VERSION_1, &[&rx, &tx]);
    let line = driver.line.clone();
    let mut guest = Guest {
        slot: VirtioSlot::new(driver.transport),
        rx,
        tx,
        rx_seen: 0,
    };
    guest.post_rx(8);
    guest.send(&arp_request([10, 79, 0, 2], [10, 79, 0, 1]));
    // Consumed (the guest gets its buffer back), and nothing arrives.
    assert_eq!(guest.tx.used_idx(), 1);
    assert!(line.raises() > 0);
    guest.slot.lock().process_backend();
    assert_eq!(guest.rx.used_idx(), 0);
    let state = guest.slot.lock().save().unwrap();

    // The same guest NIC continues on a TAP (a sandbox whose clone has a network).
    let Some(ns) = NetNs::new("disc") else { return };
    let tap = ns.enter(|| Tap::open("cubetap4").unwrap());
    let restored = MmioTransport::restore(
        Box::new(Net::new(tap, MAC).unwrap()),
        mem,
        Arc::new(RecordingLine::default()),
        &state,
    )
    .unwrap();
    assert!(restored.is_activated());
}

/// A pool of cube-net opened inside `ns` (as if it were the host), private to a test;
/// destroyed on drop.
struct TestPool {
    pool: Option<cube_net::Pool>,
}

impl Drop for TestPool {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            let _ = pool.destroy();
        }
    }
}

#[test]
fn the_guest_driver_talks_to_the_pool_datapath_through_a_pool_tap() {
    let Some(ns) = NetNs::new("pool") else { return };
    ns.ip(&["link", "set", "lo", "up"]);
    let config = cube_net::PoolConfig {
        name: format!("vmnet-{}", std::process::id()),
        prefix: "cv".into(),
        veths: 0,
        taps: 0,
        ..cube_net::PoolConfig::default()
    };
    let opened = ns.enter(move || cube_net::Pool::open(config));
    let pool = match opened {
        Ok(pool) => TestPool { pool: Some(pool) },
        Err(e) => {
            eprintln!("skipping: the cube-net datapath does not load here: {e}");
            return;
        }
    };
    let Some(handle) = pool.pool.as_ref() else {
        return;
    };
    let egress = cube_net::EgressPolicy::default();
    let attachment = handle.attach_tap(MAC, &egress).unwrap();
    let name = attachment.tap_name().unwrap().to_string();
    let tap = {
        let name = name.clone();
        ns.enter(move || Tap::open(&name).unwrap())
    };

    let mem = memory();
    let mut driver = Driver::new(Box::new(Net::new(tap, MAC).unwrap()), &mem);
    let rx = Ring::at(&mem, 64, RX_RING);
    let tx = Ring::at(&mem, 64, TX_RING);
    driver.bring_up_queues(1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_NET_F_MAC, &[&rx, &tx]);
    let slot = VirtioSlot::new(driver.transport);
    let events: Subscriber = Arc::new(Mutex::new(SlotEvents::new(slot.clone(), Vec::new())));
    let event_loop = DeviceEventLoop::start(vec![events]).unwrap();
    let mut guest = Guest {
        slot,
        rx,
        tx,
        rx_seen: 0,
    };
    guest.post_rx(32);
    // The guest asks for its gateway; the datapath on the TAP answers for it (no
    // address is on the TAP, so the kernel would not). The TAP's queue comes up
    // shortly after it is opened: ask again until it does.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut sent = 0u16;
    'answered: loop {
        if sent < 32 {
            let head = sent % 16;
            let frame = arp_request([169, 254, 0, 2], [169, 254, 0, 1]);
            let at = TX_BUF + u64::from(head) * 0x100;
            guest.tx.mem.write_slice(&frame, GuestAddress(at)).unwrap();
            guest.tx.set_desc(head, at, frame.len() as u32, 0, 0);
            guest.tx.publish(head);
            guest.slot.lock().notify_queue(TX);
            sent += 1;
        }
        for frame in guest.received() {
            if is_arp_reply_from(&frame, [169, 254, 0, 1]) {
                break 'answered;
            }
        }
        assert!(Instant::now() < deadline, "the datapath never answered");
        std::thread::sleep(Duration::from_millis(100));
    }
    let counters = handle.counters(&attachment).unwrap();
    drop(event_loop);
    drop(guest);
    handle.release(attachment).unwrap();
    eprintln!("datapath counters of {name}: {counters:?}");
}
