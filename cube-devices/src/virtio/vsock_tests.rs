//! virtio-vsock driven by a test playing the guest's driver on real guest memory,
//! with the device on the event loop as in a VM.

use super::*;
use crate::event_loop::{DeviceEventLoop, Subscriber};
use crate::virtio::mmio::{regs, MmioTransport};
use crate::virtio::queue::VIRTQ_DESC_F_WRITE as W;
use crate::virtio::slot::{SlotEvents, VirtioSlot};
use crate::virtio::test_driver::RecordingLine;
use crate::virtio::test_driver::{memory, Driver, Ring};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Instant;
use vm_memory::{Bytes, GuestAddress};

/// The host socket the tests give the device, named as a sandbox names it.
const SOCKET: &str = "vsock.sock";

const CID: u64 = 3;
const RX_RING: u64 = 0x20000;
const TX_RING: u64 = 0x24000;
const EV_RING: u64 = 0x28000;
const RX_BUFS: u64 = 0x30000;
const RX_BUF_LEN: u32 = 4096;
const RX_COUNT: u16 = 16;
const EV_BUFS: u64 = 0x50000;
const TX_BUF: u64 = 0x60000;
const TX_MAX_PAYLOAD: usize = 16 << 10;
const GUEST_BUF_ALLOC: u32 = 1 << 20;
const WAIT: Duration = Duration::from_secs(10);

/// The guest's virtio-vsock driver: rings in guest memory, the device behind a slot.
struct GuestDriver {
    slot: VirtioSlot,
    rx: Ring,
    tx: Ring,
    ev: Ring,
    rx_seen: u16,
    ev_seen: u16,
}

impl GuestDriver {
    fn send(&mut self, header: Header, payload: &[u8]) {
        let mem = &self.tx.mem;
        let mut header = header;
        header.len = payload.len() as u32;
        mem.write_slice(&header.to_bytes(), GuestAddress(TX_BUF))
            .unwrap();
        mem.write_slice(payload, GuestAddress(TX_BUF + VSOCK_HEADER_LEN as u64))
            .unwrap();
        // Header and payload in two descriptors, as Linux sends them.
        self.tx.set_desc(
            0,
            TX_BUF,
            VSOCK_HEADER_LEN as u32,
            crate::virtio::queue::VIRTQ_DESC_F_NEXT,
            1,
        );
        self.tx.set_desc(
            1,
            TX_BUF + VSOCK_HEADER_LEN as u64,
            payload.len().max(1) as u32,
            0,
            0,
        );
        if payload.is_empty() {
            self.tx.set_desc(0, TX_BUF, VSOCK_HEADER_LEN as u32, 0, 0);
        }
        let before = self.tx.used_idx();
        self.tx.publish(0);
        self.slot.lock().notify_queue(TX);
        assert_eq!(self.tx.used_idx(), before.wrapping_add(1));
    }

    /// The next packet the device put into a receive buffer, if one is there.
    fn try_recv(&mut self) -> Option<(Header, Vec<u8>)> {
        if self.rx.used_idx() == self.rx_seen {
            return None;
        }
        let (id, len) = self.rx.used(self.rx_seen);
        self.rx_seen = self.rx_seen.wrapping_add(1);
        assert!(len as usize >= VSOCK_HEADER_LEN, "used length {len}");
        let addr = RX_BUFS + u64::from(id) * u64::from(RX_BUF_LEN);
        let raw = self.rx.read_buf(addr, len as usize);
        let mut h = [0u8; VSOCK_HEADER_LEN];
        h.copy_from_slice(&raw[..VSOCK_HEADER_LEN]);
        let header = Header::from_bytes(&h);
        assert_eq!(header.len as usize, len as usize - VSOCK_HEADER_LEN);
        // Give the buffer back, as a driver refilling its receive queue does.
        self.rx.publish(id as u16);
        self.slot.lock().notify_queue(RX);
        Some((header, raw[VSOCK_HEADER_LEN..].to_vec()))
    }

    fn event(&mut self) -> Option<u32> {
        if self.ev.used_idx() == self.ev_seen {
            return None;
        }
        let (id, len) = self.ev.used(self.ev_seen);
        self.ev_seen += 1;
        assert_eq!(len, 4);
        self.ev
            .mem
            .read_obj(GuestAddress(EV_BUFS + 8 * u64::from(id)))
            .ok()
    }
}

fn guest_header(guest_port: u32, host_port: u32, op_: u16, fwd_cnt: u32) -> Header {
    Header {
        src_cid: CID,
        dst_cid: VSOCK_HOST_CID,
        src_port: guest_port,
        dst_port: host_port,
        len: 0,
        type_: VSOCK_TYPE_STREAM,
        op: op_,
        flags: 0,
        buf_alloc: GUEST_BUF_ALLOC,
        fwd_cnt,
    }
}

/// A running device: its driver (shared by guest threads), the event loop, the dir.
struct Setup {
    guest: Arc<Mutex<GuestDriver>>,
    _event_loop: DeviceEventLoop,
    dir: tempfile::TempDir,
    line: Arc<RecordingLine>,
}

fn bring_up(driver: &mut Driver, mem: &VirtioMemory) -> (Ring, Ring, Ring) {
    let rx = Ring::at(mem, 64, RX_RING);
    let tx = Ring::at(mem, 64, TX_RING);
    let ev = Ring::at(mem, 4, EV_RING);
    driver.bring_up_queues(1 << VIRTIO_F_VERSION_1, &[&rx, &tx, &ev]);
    (rx, tx, ev)
}

fn post_buffers(rx: &mut Ring, ev: &mut Ring) {
    for i in 0..RX_COUNT {
        rx.set_desc(
            i,
            RX_BUFS + u64::from(i) * u64::from(RX_BUF_LEN),
            RX_BUF_LEN,
            W,
            0,
        );
        rx.publish(i);
    }
    for i in 0..4 {
        ev.set_desc(i, EV_BUFS + 8 * u64::from(i), 8, W, 0);
        ev.publish(i);
    }
}

fn start_with(
    dir: tempfile::TempDir,
    transport: MmioTransport,
    line: Arc<RecordingLine>,
    rings: (Ring, Ring, Ring),
    post: bool,
) -> Setup {
    let (mut rx, tx, mut ev) = rings;
    if post {
        post_buffers(&mut rx, &mut ev);
    }
    // Nothing was used before the device started (or before the snapshot).
    let (rx_seen, ev_seen) = (0, 0);
    let slot = VirtioSlot::new(transport);
    let events: Subscriber = Arc::new(Mutex::new(SlotEvents::new(slot.clone(), Vec::new())));
    let event_loop = DeviceEventLoop::start(vec![events]).unwrap();
    slot.lock().notify_queue(RX);
    Setup {
        guest: Arc::new(Mutex::new(GuestDriver {
            slot,
            rx,
            tx,
            ev,
            rx_seen,
            ev_seen,
        })),
        _event_loop: event_loop,
        dir,
        line,
    }
}

fn start() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let mem = memory();
    let vsock = Vsock::new(CID, &dir.path().join(SOCKET)).unwrap();
    let mut driver = Driver::new(Box::new(vsock), &mem);
    let rings = bring_up(&mut driver, &mem);
    let line = driver.line.clone();
    start_with(dir, driver.transport, line, rings, true)
}

/// Waits for the next packet to the guest.
fn recv(guest: &Mutex<GuestDriver>) -> (Header, Vec<u8>) {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(p) = guest.lock().unwrap().try_recv() {
            return p;
        }
        assert!(Instant::now() < deadline, "no packet reached the guest");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// One guest-side stream socket, as the guest's vsock transport would give the agent.
#[derive(Clone)]
struct GuestStream {
    guest: Arc<Mutex<GuestDriver>>,
    guest_port: u32,
    host_port: u32,
    state: Arc<Mutex<StreamState>>,
}

#[derive(Default)]
struct StreamState {
    data: VecDeque<u8>,
    closed: bool,
    fwd_cnt: u32,
    fwd_cnt_told: u32,
    /// The host's receive buffer and how much of it it consumed (its credit).
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Bytes this guest sent.
    tx_cnt: u32,
}

impl GuestStream {
    /// Takes one packet from the device, if there is one; whether there was.
    fn pump(&self) -> bool {
        let packet = self.guest.lock().unwrap().try_recv();
        let Some((h, payload)) = packet else {
            return false;
        };
        assert_eq!((h.src_port, h.dst_port), (self.host_port, self.guest_port));
        let mut st = self.state.lock().unwrap();
        st.peer_buf_alloc = h.buf_alloc;
        st.peer_fwd_cnt = h.fwd_cnt;
        match h.op {
            op::RW => st.data.extend(payload),
            op::SHUTDOWN | op::RST => st.closed = true,
            _ => {}
        }
        true
    }
}

impl Read for GuestStream {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        loop {
            {
                let mut st = self.state.lock().unwrap();
                if !st.data.is_empty() {
                    let n = out.len().min(st.data.len());
                    for (o, b) in out.iter_mut().zip(st.data.drain(..n)) {
                        *o = b;
                    }
                    st.fwd_cnt = st.fwd_cnt.wrapping_add(n as u32);
                    if st.fwd_cnt.wrapping_sub(st.fwd_cnt_told) > GUEST_BUF_ALLOC / 4 {
                        st.fwd_cnt_told = st.fwd_cnt;
                        let h = guest_header(
                            self.guest_port,
                            self.host_port,
                            op::CREDIT_UPDATE,
                            st.fwd_cnt,
                        );
                        self.guest.lock().unwrap().send(h, &[]);
                    }
                    return Ok(n);
                }
                if st.closed {
                    return Ok(0);
                }
            }
            if !self.pump() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

impl Write for GuestStream {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        // A driver sends no more than the host's credit allows, as Linux's does.
        let deadline = Instant::now() + WAIT;
        let credit = loop {
            {
                let st = self.state.lock().unwrap();
                if st.closed {
                    return Err(std::io::ErrorKind::BrokenPipe.into());
                }
                let in_flight = st.tx_cnt.wrapping_sub(st.peer_fwd_cnt);
                let credit = st.peer_buf_alloc.saturating_sub(in_flight) as usize;
                if credit > 0 {
                    break credit;
                }
            }
            assert!(Instant::now() < deadline, "the host never returned credit");
            if !self.pump() {
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        let n = data.len().min(TX_MAX_PAYLOAD).min(credit);
        let fwd = {
            let mut st = self.state.lock().unwrap();
            st.tx_cnt = st.tx_cnt.wrapping_add(n as u32);
            st.fwd_cnt
        };
        let h = guest_header(self.guest_port, self.host_port, op::RW, fwd);
        self.guest.lock().unwrap().send(h, &data[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl cube_agent::transport::Transport for GuestStream {
    fn try_clone_transport(&self) -> std::io::Result<Self> {
        Ok(self.clone())
    }

    fn shutdown_transport(&self) -> std::io::Result<()> {
        self.state.lock().unwrap().closed = true;
        Ok(())
    }
}

/// The guest accepts the next connection request to `port`.
fn guest_accept(guest: &Arc<Mutex<GuestDriver>>, port: u32) -> GuestStream {
    let (h, _) = recv(guest);
    assert_eq!(h.op, op::REQUEST);
    assert_eq!(
        (h.src_cid, h.dst_cid, h.dst_port),
        (VSOCK_HOST_CID, CID, port)
    );
    assert!(h.src_port >= FIRST_EPHEMERAL_PORT);
    let reply = guest_header(port, h.src_port, op::RESPONSE, 0);
    guest.lock().unwrap().send(reply, &[]);
    GuestStream {
        guest: Arc::clone(guest),
        guest_port: port,
        host_port: h.src_port,
        state: Arc::new(Mutex::new(StreamState {
            peer_buf_alloc: h.buf_alloc,
            peer_fwd_cnt: h.fwd_cnt,
            ..Default::default()
        })),
    }
}

#[test]
fn config_space_holds_the_guest_cid_and_reserved_cids_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = Driver::new(
        Box::new(Vsock::new(42, &dir.path().join(SOCKET)).unwrap()),
        &memory(),
    );
    assert_eq!(d.read32(regs::DEVICE_ID), VIRTIO_ID_VSOCK);
    assert_eq!(d.read32(regs::CONFIG), 42);
    assert_eq!(d.read32(regs::CONFIG + 4), 0);
    assert_eq!(d.read32(regs::QUEUE_NUM_MAX), 256);
    for cid in [0, 1, 2, u64::from(u32::MAX), u64::MAX] {
        assert!(matches!(
            Vsock::new(cid, &dir.path().join(SOCKET)),
            Err(VsockError::Cid(_))
        ));
    }
}

#[test]
fn the_agent_protocol_runs_over_the_device_with_the_test_as_guest() {
    let setup = start();
    let dir = setup.dir.path().to_path_buf();
    let host = std::thread::spawn(move || {
        let stream = connect_from_host(&dir.join(SOCKET), 1024, WAIT).unwrap();
        let client = cube_agent::client::Client::new(stream).unwrap();
        let out = client
            .exec(cube_agent::protocol::ExecRequest {
                argv: vec![
                    "sh".into(),
                    "-c".into(),
                    "echo hello from $0; head -c 300000 /dev/zero | wc -c".into(),
                ],
                ..Default::default()
            })
            .unwrap();
        (out.exit.code, String::from_utf8(out.stdout).unwrap())
    });
    let stream = guest_accept(&setup.guest, 1024);
    let agent = cube_agent::server::Agent::new(cube_agent::server::AgentConfig {
        reaper: cube_agent::reaper::Reaper::per_child(),
        env: Vec::new(),
        default_user: None,
        vm_init: false,
    });
    let served = agent.clone();
    let server = std::thread::spawn(move || served.serve(stream));
    let (code, stdout) = host.join().unwrap();
    assert_eq!(code, Some(0));
    assert_eq!(stdout, "hello from sh\n300000\n");
    // The host hung up: the guest sees the stream end and the agent finishes.
    server.join().unwrap().unwrap();
    assert!(
        setup.line.raises() > 0,
        "the guest was interrupted for used buffers"
    );
}

#[test]
fn large_transfers_respect_credit_both_ways() {
    let setup = start();
    let dir = setup.dir.path().to_path_buf();
    const LEN: usize = 3 << 20;
    let host = std::thread::spawn(move || {
        let mut stream = connect_from_host(&dir.join(SOCKET), 7, WAIT).unwrap();
        let data: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
        let mut writer = stream.try_clone().unwrap();
        let sent = data.clone();
        let writing = std::thread::spawn(move || writer.write_all(&sent).unwrap());
        let mut back = vec![0u8; LEN];
        stream.read_exact(&mut back).unwrap();
        writing.join().unwrap();
        assert!(back == data, "echoed data differs");
    });
    let mut stream = guest_accept(&setup.guest, 7);
    // The guest echoes everything; without credit updates from it the host would
    // stall after CONNECTION_BUFFER bytes.
    let mut buf = vec![0u8; 8192];
    let mut echoed = 0;
    while echoed < LEN {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0);
        stream.write_all(&buf[..n]).unwrap();
        echoed += n;
    }
    host.join().unwrap();
}

#[test]
fn guest_connections_reach_the_host_port_socket_or_are_reset() {
    let setup = start();
    let listener = UnixListener::bind(setup.dir.path().join("vsock.sock_5000")).unwrap();
    let guest = &setup.guest;
    guest
        .lock()
        .unwrap()
        .send(guest_header(40000, 5000, op::REQUEST, 0), &[]);
    let (mut host_side, _) = listener.accept().unwrap();
    let (h, _) = recv(guest);
    assert_eq!((h.op, h.src_port, h.dst_port), (op::RESPONSE, 5000, 40000));
    guest
        .lock()
        .unwrap()
        .send(guest_header(40000, 5000, op::RW, 0), b"ping");
    let mut got = [0u8; 4];
    host_side.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"ping");
    host_side.write_all(b"pong").unwrap();
    let (h, payload) = recv(guest);
    assert_eq!((h.op, payload.as_slice()), (op::RW, &b"pong"[..]));
    assert_eq!(h.fwd_cnt, 4, "the device reports what it forwarded");
    // The host closes: the guest is told to shut down, and answers with a reset.
    drop(host_side);
    let (h, _) = recv(guest);
    assert_eq!(
        (h.op, h.flags),
        (op::SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND)
    );
    guest
        .lock()
        .unwrap()
        .send(guest_header(40000, 5000, op::RST, 0), &[]);
    // A port nobody listens on is refused with a reset.
    guest
        .lock()
        .unwrap()
        .send(guest_header(40001, 5001, op::REQUEST, 0), &[]);
    let (h, _) = recv(guest);
    assert_eq!((h.op, h.dst_port), (op::RST, 40001));
    // Data for a connection that does not exist is answered with a reset too.
    guest
        .lock()
        .unwrap()
        .send(guest_header(40002, 5000, op::RW, 0), b"x");
    let (h, _) = recv(guest);
    assert_eq!((h.op, h.dst_port), (op::RST, 40002));
    let slot = guest.lock().unwrap().slot.clone();
    let mut transport = slot.lock();
    let dev = transport.device_mut();
    assert_eq!(dev.device_type(), VIRTIO_ID_VSOCK);
}

#[test]
fn malformed_packets_and_host_lines_are_refused_without_a_panic() {
    let setup = start();
    let guest = &setup.guest;
    {
        let mut g = guest.lock().unwrap();
        let mem = g.tx.mem.clone();
        // A header cut short: one 20-byte descriptor.
        g.tx.set_desc(2, TX_BUF, 20, 0, 0);
        g.tx.publish(2);
        // A header whose length claims more than the chain holds.
        let mut h = guest_header(1, 2, op::RW, 0);
        h.len = 1000;
        mem.write_slice(&h.to_bytes(), GuestAddress(TX_BUF + 0x1000))
            .unwrap();
        g.tx.set_desc(3, TX_BUF + 0x1000, 100, 0, 0);
        g.tx.publish(3);
        // A huge length.
        h.len = u32::MAX;
        mem.write_slice(&h.to_bytes(), GuestAddress(TX_BUF + 0x2000))
            .unwrap();
        g.tx.set_desc(4, TX_BUF + 0x2000, VSOCK_HEADER_LEN as u32, 0, 0);
        g.tx.publish(4);
        // A spoofed source CID, and a non-stream socket type.
        let mut spoofed = guest_header(1, 2, op::REQUEST, 0);
        spoofed.src_cid = 99;
        mem.write_slice(&spoofed.to_bytes(), GuestAddress(TX_BUF + 0x3000))
            .unwrap();
        g.tx.set_desc(5, TX_BUF + 0x3000, VSOCK_HEADER_LEN as u32, 0, 0);
        g.tx.publish(5);
        // A descriptor loop and a buffer outside guest memory.
        g.tx.set_desc(6, TX_BUF, 44, crate::virtio::queue::VIRTQ_DESC_F_NEXT, 6);
        g.tx.publish(6);
        g.tx.set_desc(7, 0x7000_0000, 44, 0, 0);
        g.tx.publish(7);
        let before = g.tx.used_idx();
        g.slot.lock().notify_queue(TX);
        assert_eq!(g.tx.used_idx(), before.wrapping_add(6));
        assert!(g.try_recv().is_none(), "nothing is answered to garbage");
    }
    // Host processes sending anything but a CONNECT line are dropped.
    for line in [
        &b"HELLO\n"[..],
        b"CONNECT x\n",
        b"CONNECT 1\nextra",
        &[b'C'; 100],
    ] {
        let mut s = UnixStream::connect(setup.dir.path().join(SOCKET)).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(line).unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(s.read(&mut buf).unwrap_or(0), 0, "{line:?}");
    }
    // The device still works.
    let dir = setup.dir.path().to_path_buf();
    let host =
        std::thread::spawn(move || connect_from_host(&dir.join(SOCKET), 9, WAIT).map(|_| ()));
    let _stream = guest_accept(guest, 9);
    host.join().unwrap().unwrap();
}

#[test]
fn restore_resets_connections_serves_pending_packets_and_checks_state() {
    let dir = tempfile::tempdir().unwrap();
    let mem = memory();
    let mut driver = Driver::new(
        Box::new(Vsock::new(CID, &dir.path().join(SOCKET)).unwrap()),
        &mem,
    );
    let (mut rx, mut tx, mut ev) = bring_up(&mut driver, &mem);
    post_buffers(&mut rx, &mut ev);
    let listener = UnixListener::bind(dir.path().join("vsock.sock_6000")).unwrap();
    // The guest asks for a connection; the snapshot is taken before the device saw it.
    mem.write_slice(
        &guest_header(41000, 6000, op::REQUEST, 0).to_bytes(),
        GuestAddress(TX_BUF),
    )
    .unwrap();
    tx.set_desc(0, TX_BUF, VSOCK_HEADER_LEN as u32, 0, 0);
    tx.publish(0);
    let state = driver.transport.save().unwrap();
    let bytes = postcard::to_allocvec(&state).unwrap();
    drop(driver);

    let state: crate::virtio::persist::VirtioMmioState = postcard::from_bytes(&bytes).unwrap();
    let line = Arc::new(RecordingLine::default());
    let vsock = Vsock::new(CID, &dir.path().join(SOCKET)).unwrap();
    let transport =
        MmioTransport::restore(Box::new(vsock), mem.clone(), line.clone(), &state).unwrap();
    // The reset event's buffer is used and the guest is interrupted for it: the saved
    // status (nothing pending) must not wipe that. A Linux guest looks at its event
    // queue only when interrupted, and holds no connection it could be told of
    // otherwise: woken from hibernation, it never answered again.
    assert_eq!(state.interrupt_status, 0);
    let mut status = [0u8; 4];
    transport.read(regs::INTERRUPT_STATUS, &mut status);
    assert_eq!(
        u32::from_le_bytes(status) & crate::virtio::interrupt::INTERRUPT_USED_BUFFER,
        crate::virtio::interrupt::INTERRUPT_USED_BUFFER
    );
    assert!(line.asserted(), "the reset event's interrupt was lowered");
    let setup = start_with(dir, transport, line, (rx, tx, ev), false);
    // The restored device told the guest its old connections are gone.
    assert_eq!(
        setup.guest.lock().unwrap().event(),
        Some(EVENT_TRANSPORT_RESET)
    );
    // The pending request is served once the guest notifies.
    setup.guest.lock().unwrap().slot.lock().notify_queue(TX);
    let (_conn, _) = listener.accept().unwrap();
    let (h, _) = recv(&setup.guest);
    assert_eq!((h.op, h.dst_port), (op::RESPONSE, 41000));

    // A host connection made before the guest took the reset event waits for it: the
    // guest would otherwise accept it, then reset it with the stale connections.
    let socket = setup.dir.path().join(SOCKET);
    let host = std::thread::spawn(move || connect_from_host(&socket, 1024, WAIT));
    // The device has the CONNECT line once the host is waiting for the answer; a
    // bound on how long it takes to get there, nothing timed.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        setup.guest.lock().unwrap().try_recv().is_none(),
        "a request reached the guest before it took the reset event"
    );
    // The guest has reset its sockets: it gives the event buffer back and notifies.
    {
        let mut guest = setup.guest.lock().unwrap();
        guest.ev.publish(0);
        guest.slot.lock().notify_queue(EVENT);
    }
    let (h, _) = recv(&setup.guest);
    assert_eq!((h.op, h.dst_port), (op::REQUEST, 1024));
    // Not from the host port a fresh device gives its first connection: the guest may
    // still hold that connection (reset, not yet closed), and would reset this one
    // as its duplicate.
    assert_ne!(h.src_port, FIRST_EPHEMERAL_PORT);
    let response = guest_header(1024, h.src_port, op::RESPONSE, 0);
    setup.guest.lock().unwrap().send(response, &[]);
    host.join().unwrap().unwrap();

    // State for another CID, or garbage, is refused.
    let other = tempfile::tempdir().unwrap();
    let wrong = Vsock::new(CID + 1, &other.path().join(SOCKET)).unwrap();
    let err = MmioTransport::restore(
        Box::new(wrong),
        mem.clone(),
        Arc::new(RecordingLine::default()),
        &state,
    )
    .err()
    .unwrap();
    assert!(format!("{err:?}").contains("CID"));
    let mut garbage = state.clone();
    garbage.device_state.bytes = vec![0xff; 20];
    let dev = Vsock::new(CID, &other.path().join(SOCKET)).unwrap();
    assert!(MmioTransport::restore(
        Box::new(dev),
        mem,
        Arc::new(RecordingLine::default()),
        &garbage
    )
    .is_err());
}

#[test]
fn a_guest_sending_past_its_credit_is_reset() {
    let setup = start();
    let listener = UnixListener::bind(setup.dir.path().join("vsock.sock_7000")).unwrap();
    let guest = &setup.guest;
    guest
        .lock()
        .unwrap()
        .send(guest_header(42000, 7000, op::REQUEST, 0), &[]);
    // The host accepts but never reads.
    let (_host_side, _) = listener.accept().unwrap();
    let (h, _) = recv(guest);
    assert_eq!(h.op, op::RESPONSE);
    assert_eq!(h.buf_alloc, CONNECTION_BUFFER);
    let chunk = vec![7u8; TX_MAX_PAYLOAD];
    let mut sent = 0usize;
    let reset = loop {
        guest
            .lock()
            .unwrap()
            .send(guest_header(42000, 7000, op::RW, 0), &chunk);
        sent += chunk.len();
        let packets: Vec<_> = std::iter::from_fn(|| guest.lock().unwrap().try_recv()).collect();
        if let Some((h, _)) = packets.iter().find(|(h, _)| h.op == op::RST) {
            break *h;
        }
        assert!(sent < 64 << 20, "no reset after {sent} bytes");
    };
    assert_eq!(reset.dst_port, 42000);
    // At least the credit it was given went through before the reset.
    assert!(sent > CONNECTION_BUFFER as usize);
}
