//! virtio-vsock (virtio spec 5.10): stream sockets between the guest and the host,
//! with the host side as unix sockets (Firecracker's scheme), named after the host
//! socket path the device is given (`<socket>`, e.g. a sandbox's `vsock.sock`):
//!
//! - host → guest: a host process connects to `<socket>` and writes
//!   `CONNECT <port>\n`; once the guest accepts, it reads `OK <host port>\n` and the
//!   stream carries the connection.
//! - guest → host: a guest connection to host port P is a connection to the unix
//!   socket `<socket>_P`.
//!
//! Connections live in the host (sockets cannot go into a snapshot): after a restore
//! the device sends the guest a transport-reset event and the guest drops them, as
//! after a live migration. Host connections made meanwhile wait until the guest has
//! taken the event (Linux refills the event buffer and notifies the event queue once
//! it has reset its sockets): Linux serves the receive queue before the event queue,
//! so a connection request sent alongside the event would be accepted, then reset
//! with the stale ones. Guest packets are parsed from validated chains; every
//! header field is checked before use.

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::chain_io::Segments;
use super::device::{copy_config, ActiveQueues, DeviceError, VirtioDevice};
use super::device_state::{DeviceKind, DeviceStateError, Persist};
use super::queue::{ChainError, Queue};
use super::{VirtioMemory, VIRTIO_F_VERSION_1};

/// Virtio device type of a socket device.
pub const VIRTIO_ID_VSOCK: u32 = 19;
/// The host's context id.
pub const VSOCK_HOST_CID: u64 = 2;
/// Length of a packet header.
pub const VSOCK_HEADER_LEN: usize = 44;
/// Socket type: stream.
pub const VSOCK_TYPE_STREAM: u16 = 1;
/// Bytes of guest data the device buffers for each connection (its credit).
pub const CONNECTION_BUFFER: u32 = 256 << 10;
/// Largest payload the device puts into one packet for the guest.
const MAX_RX_PAYLOAD: usize = 64 << 10;
/// Largest payload accepted from the guest in one packet.
const MAX_TX_PAYLOAD: u32 = 64 << 10;
/// First host port given to host-initiated connections.
const FIRST_EPHEMERAL_PORT: u32 = 1 << 30;
/// Longest `CONNECT <port>\n` line accepted.
const MAX_CONNECT_LINE: usize = 32;
/// Queue indices.
const RX: u16 = 0;
const TX: u16 = 1;
const EVENT: u16 = 2;
const QUEUE_SIZES: [u16; 3] = [256, 256, 64];
/// Event id: the transport was reset (connections are gone).
const EVENT_TRANSPORT_RESET: u32 = 0;

/// Packet operations.
mod op {
    pub const REQUEST: u16 = 1;
    pub const RESPONSE: u16 = 2;
    pub const RST: u16 = 3;
    pub const SHUTDOWN: u16 = 4;
    pub const RW: u16 = 5;
    pub const CREDIT_UPDATE: u16 = 6;
    pub const CREDIT_REQUEST: u16 = 7;
}
/// Shutdown flag: the sender will receive no more.
const SHUTDOWN_RCV: u32 = 1;
/// Shutdown flag: the sender will send no more.
const SHUTDOWN_SEND: u32 = 2;

/// epoll tags of the device's own sources.
const TOKEN_LISTENER: u64 = 0;
const TOKEN_PENDING_BASE: u64 = 1 << 48;

/// Why a vsock device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// The guest context id is reserved.
    #[error("Guest CID {0} is reserved (0, 1, 2 and u32::MAX are not guest CIDs)")]
    Cid(u64),
    /// The host socket could not be bound.
    #[error("Binding the vsock host socket {path}")]
    Bind {
        /// Its path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The device's epoll set could not be made.
    #[error("Creating the vsock event set failed")]
    Epoll(#[source] std::io::Error),
}

/// A packet header (virtio_vsock_hdr), little-endian on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// Source context id.
    pub src_cid: u64,
    /// Destination context id.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length.
    pub len: u32,
    /// Socket type.
    pub type_: u16,
    /// Operation.
    pub op: u16,
    /// Operation flags.
    pub flags: u32,
    /// The sender's receive buffer size.
    pub buf_alloc: u32,
    /// Bytes the sender has consumed from its receive buffer.
    pub fwd_cnt: u32,
}

impl Header {
    /// The header's wire form.
    pub fn to_bytes(&self) -> [u8; VSOCK_HEADER_LEN] {
        let mut b = [0u8; VSOCK_HEADER_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// Parses the wire form.
    pub fn from_bytes(b: &[u8; VSOCK_HEADER_LEN]) -> Self {
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ConnState {
    /// Host-initiated, waiting for the guest's RESPONSE.
    Connecting,
    Established,
}

/// One connection; its key is (host port, guest port).
struct Connection {
    stream: UnixStream,
    state: ConnState,
    /// The host stream may have data (epoll said so and no read drained it yet).
    readable: bool,
    /// The host stream reached end of file: the guest was told.
    host_eof: bool,
    /// The guest's receive buffer and how much of it it has consumed.
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Bytes sent to the guest.
    tx_cnt: u32,
    /// Bytes of guest data written to the host stream.
    fwd_cnt: u32,
    /// `fwd_cnt` as last told to the guest.
    fwd_cnt_told: u32,
    /// Guest data the host stream has not taken yet (bounded by the credit the
    /// device gave: [`CONNECTION_BUFFER`]).
    to_host: VecDeque<u8>,
    /// The guest will send no more: shut the host stream's write side once
    /// `to_host` is written.
    guest_done_sending: bool,
    /// Whether the stream is in the epoll set.
    registered: bool,
    token: u64,
}

impl Connection {
    fn new(stream: UnixStream, state: ConnState, token: u64) -> Self {
        Connection {
            stream,
            state,
            readable: false,
            host_eof: false,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            tx_cnt: 0,
            fwd_cnt: 0,
            fwd_cnt_told: 0,
            to_host: VecDeque::new(),
            guest_done_sending: false,
            registered: false,
            token,
        }
    }

    /// Bytes the guest can still take.
    fn peer_credit(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }
}

/// A host stream that connected to `vsock.sock` and has not finished its CONNECT line.
struct PendingHost {
    stream: UnixStream,
    line: Vec<u8>,
}

/// A packet waiting for a guest receive buffer.
struct Outbound {
    header: Header,
    payload: Vec<u8>,
}

/// Device state in a snapshot: the CID the guest knows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    /// The guest's context id.
    pub guest_cid: u64,
}

/// The virtio socket device.
pub struct Vsock {
    guest_cid: u64,
    /// The host socket; guest connections to port P go to `<socket>_P`.
    socket: PathBuf,
    listener: UnixListener,
    epoll: Epoll,
    pending_hosts: BTreeMap<u64, PendingHost>,
    connections: BTreeMap<(u32, u32), Connection>,
    outbound: VecDeque<Outbound>,
    next_token: u64,
    next_host_port: u32,
    reset_event_pending: bool,
    /// The reset event was delivered and the guest has not yet notified the event
    /// queue (it does once it has dropped its connections).
    awaiting_reset_ack: bool,
    /// Host connections whose request waits for the guest to take the reset event.
    held_requests: Vec<(u32, u32)>,
    active: Option<ActiveQueues>,
}

fn epoll_add(epoll: &Epoll, fd: RawFd, events: EventSet, token: u64) -> std::io::Result<()> {
    epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(events, token))
}

impl Vsock {
    /// A device for guest context id `guest_cid`, whose host side listens on unix
    /// socket `socket` (created; an old socket file there is replaced).
    pub fn new(guest_cid: u64, socket: &Path) -> Result<Self, VsockError> {
        if guest_cid <= VSOCK_HOST_CID || guest_cid >= u64::from(u32::MAX) {
            return Err(VsockError::Cid(guest_cid));
        }
        let path = socket.to_path_buf();
        let bind_err = |source| VsockError::Bind {
            path: path.clone(),
            source,
        };
        if std::fs::symlink_metadata(&path)
            .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
        {
            std::fs::remove_file(&path).map_err(bind_err)?;
        }
        let listener = UnixListener::bind(&path).map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let epoll = Epoll::new().map_err(VsockError::Epoll)?;
        epoll_add(&epoll, listener.as_raw_fd(), EventSet::IN, TOKEN_LISTENER)
            .map_err(VsockError::Epoll)?;
        Ok(Vsock {
            guest_cid,
            socket: path,
            listener,
            epoll,
            pending_hosts: BTreeMap::new(),
            connections: BTreeMap::new(),
            outbound: VecDeque::new(),
            next_token: 1,
            next_host_port: FIRST_EPHEMERAL_PORT,
            reset_event_pending: false,
            awaiting_reset_ack: false,
            held_requests: Vec::new(),
            active: None,
        })
    }

    /// The guest's context id.
    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    /// How many connections are open.
    pub fn connection_count(&self) -> usize {
        self.connections.len()
    }

    fn header(&self, host_port: u32, guest_port: u32, op: u16) -> Header {
        let fwd_cnt = self
            .connections
            .get(&(host_port, guest_port))
            .map_or(0, |c| c.fwd_cnt);
        Header {
            src_cid: VSOCK_HOST_CID,
            dst_cid: self.guest_cid,
            src_port: host_port,
            dst_port: guest_port,
            len: 0,
            type_: VSOCK_TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: CONNECTION_BUFFER,
            fwd_cnt,
        }
    }

    fn send_control(&mut self, host_port: u32, guest_port: u32, op: u16, flags: u32) {
        let mut header = self.header(host_port, guest_port, op);
        header.flags = flags;
        if let Some(c) = self.connections.get_mut(&(host_port, guest_port)) {
            c.fwd_cnt_told = c.fwd_cnt;
        }
        self.outbound.push_back(Outbound {
            header,
            payload: Vec::new(),
        });
    }

    fn send_rst(&mut self, host_port: u32, guest_port: u32) {
        self.send_control(host_port, guest_port, op::RST, 0);
    }

    fn remove_connection(&mut self, key: (u32, u32)) {
        if let Some(c) = self.connections.remove(&key) {
            // Best effort: the stream closes when dropped anyway.
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                c.stream.as_raw_fd(),
                EpollEvent::default(),
            );
        }
    }

    /// Watches a connection's host stream for its next event: readable while the
    /// device has not seen it readable, writable while guest data waits for it.
    fn rearm(&mut self, key: (u32, u32)) {
        let Some(conn) = self.connections.get_mut(&key) else {
            return;
        };
        if conn.state != ConnState::Established {
            return;
        }
        let mut events = EventSet::ONE_SHOT;
        if !conn.readable && !conn.host_eof {
            events |= EventSet::IN;
        }
        if !conn.to_host.is_empty() {
            events |= EventSet::OUT;
        }
        let op = if conn.registered {
            ControlOperation::Modify
        } else {
            ControlOperation::Add
        };
        match self.epoll.ctl(
            op,
            conn.stream.as_raw_fd(),
            EpollEvent::new(events, conn.token),
        ) {
            Ok(()) => conn.registered = true,
            Err(e) => tracing::warn!("vsock: watching a host stream failed: {e}"),
        }
    }

    /// Writes what the guest sent to the host stream, as far as it takes it; the
    /// guest's credit comes back as bytes leave.
    fn flush_to_host(&mut self, key: (u32, u32)) {
        let Some(conn) = self.connections.get_mut(&key) else {
            return;
        };
        let mut failed = false;
        while !conn.to_host.is_empty() {
            let (front, _) = conn.to_host.as_slices();
            match send_nonblocking(&conn.stream, front) {
                Ok(n) => {
                    conn.to_host.drain(..n);
                    conn.fwd_cnt = conn.fwd_cnt.wrapping_add(n as u32);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::debug!("vsock: writing to the host stream failed: {e}");
                    failed = true;
                    break;
                }
            }
        }
        if failed {
            self.remove_connection(key);
            self.send_rst(key.0, key.1);
            return;
        }
        if conn.to_host.is_empty() && conn.guest_done_sending {
            let _ = conn.stream.shutdown(std::net::Shutdown::Write);
        }
        // Tell the guest its credit came back before it runs dry.
        if conn.fwd_cnt.wrapping_sub(conn.fwd_cnt_told) >= CONNECTION_BUFFER / 4 {
            self.send_control(key.0, key.1, op::CREDIT_UPDATE, 0);
        }
        self.rearm(key);
    }

    fn take_token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    // ---- host side ----

    fn accept_hosts(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    let token = TOKEN_PENDING_BASE + self.take_token();
                    if let Err(e) = epoll_add(&self.epoll, stream.as_raw_fd(), EventSet::IN, token)
                    {
                        tracing::warn!("vsock: watching a host connection failed: {e}");
                        continue;
                    }
                    self.pending_hosts.insert(
                        token,
                        PendingHost {
                            stream,
                            line: Vec::new(),
                        },
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!("vsock: accepting a host connection failed: {e}");
                    return;
                }
            }
        }
    }

    /// Reads more of a host's CONNECT line; starts the connection once it is whole.
    fn read_connect_line(&mut self, token: u64) {
        let Some(pending) = self.pending_hosts.get_mut(&token) else {
            return;
        };
        let mut buf = [0u8; MAX_CONNECT_LINE];
        let outcome = loop {
            match recv_nonblocking(&pending.stream, &mut buf) {
                Ok(0) => break Err("closed before CONNECT".to_string()),
                Ok(n) => {
                    pending.line.extend_from_slice(&buf[..n]);
                    if let Some(end) = pending.line.iter().position(|b| *b == b'\n') {
                        if end + 1 != pending.line.len() {
                            break Err("data after the CONNECT line".to_string());
                        }
                        break parse_connect(&pending.line[..end]);
                    }
                    if pending.line.len() > MAX_CONNECT_LINE {
                        break Err("CONNECT line too long".to_string());
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => break Err(e.to_string()),
            }
        };
        let Some(pending) = self.pending_hosts.remove(&token) else {
            return;
        };
        let _ = self.epoll.ctl(
            ControlOperation::Delete,
            pending.stream.as_raw_fd(),
            EpollEvent::default(),
        );
        let guest_port = match outcome {
            Ok(port) => port,
            Err(e) => {
                tracing::debug!("vsock: host connection refused: {e}");
                return;
            }
        };
        let host_port = self.next_host_port;
        self.next_host_port = self
            .next_host_port
            .wrapping_add(1)
            .max(FIRST_EPHEMERAL_PORT);
        let token = self.take_token();
        self.connections.insert(
            (host_port, guest_port),
            Connection::new(pending.stream, ConnState::Connecting, token),
        );
        if self.reset_event_pending || self.awaiting_reset_ack {
            self.held_requests.push((host_port, guest_port));
        } else {
            self.send_control(host_port, guest_port, op::REQUEST, 0);
        }
    }

    /// The guest notified the event queue: once it has taken a reset event, the host
    /// connections held meanwhile go to it.
    fn event_queue_notified(&mut self) {
        if !self.awaiting_reset_ack {
            return;
        }
        self.awaiting_reset_ack = false;
        for (host_port, guest_port) in std::mem::take(&mut self.held_requests) {
            if self.connections.contains_key(&(host_port, guest_port)) {
                self.send_control(host_port, guest_port, op::REQUEST, 0);
            }
        }
    }

    fn poll_host(&mut self) -> Result<(), DeviceError> {
        let mut events = [EpollEvent::default(); 32];
        loop {
            let n = self
                .epoll
                .wait(0, &mut events)
                .map_err(|source| DeviceError::Backend {
                    what: "waiting on vsock host sockets".into(),
                    source,
                })?;
            for event in &events[..n] {
                match event.data() {
                    TOKEN_LISTENER => self.accept_hosts(),
                    t if t >= TOKEN_PENDING_BASE => self.read_connect_line(t),
                    t => {
                        let Some((&key, c)) =
                            self.connections.iter_mut().find(|(_, c)| c.token == t)
                        else {
                            continue;
                        };
                        let set = event.event_set();
                        if set.intersects(EventSet::IN | EventSet::HANG_UP | EventSet::ERROR) {
                            c.readable = true;
                        }
                        // Flushing re-arms (oneshot) for whatever is still wanted.
                        self.flush_to_host(key);
                    }
                }
            }
            if n < events.len() {
                return Ok(());
            }
        }
    }

    /// Reads from readable host streams the guest has credit for, one packet each.
    fn read_hosts(&mut self) {
        let keys: Vec<(u32, u32)> = self
            .connections
            .iter()
            .filter(|(_, c)| c.state == ConnState::Established && c.readable && !c.host_eof)
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            let Some(conn) = self.connections.get_mut(&key) else {
                continue;
            };
            let credit = conn.peer_credit() as usize;
            if credit == 0 {
                // Stays readable: the guest's next credit update resumes it.
                continue;
            }
            let mut buf = vec![0u8; credit.min(MAX_RX_PAYLOAD)];
            match recv_nonblocking(&conn.stream, &mut buf) {
                Ok(0) => {
                    conn.host_eof = true;
                    conn.readable = false;
                    self.send_control(key.0, key.1, op::SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND);
                }
                Ok(n) => {
                    buf.truncate(n);
                    conn.tx_cnt = conn.tx_cnt.wrapping_add(n as u32);
                    conn.fwd_cnt_told = conn.fwd_cnt;
                    let mut header = self.header(key.0, key.1, op::RW);
                    header.len = n as u32;
                    self.outbound.push_back(Outbound {
                        header,
                        payload: buf,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    conn.readable = false;
                    self.rearm(key);
                }
                Err(e) => {
                    tracing::debug!("vsock: host stream failed: {e}");
                    self.remove_connection(key);
                    self.send_rst(key.0, key.1);
                }
            }
        }
    }

    // ---- guest side ----

    /// Handles one packet the guest sent.
    fn handle_tx(&mut self, header: Header, payload: &[u8]) {
        if header.src_cid != self.guest_cid || header.dst_cid != VSOCK_HOST_CID {
            tracing::debug!(?header, "vsock: packet with foreign addresses dropped");
            return;
        }
        let key = (header.dst_port, header.src_port);
        if header.type_ != VSOCK_TYPE_STREAM {
            if header.op != op::RST {
                self.send_rst(key.0, key.1);
            }
            return;
        }
        if let Some(c) = self.connections.get_mut(&key) {
            c.peer_buf_alloc = header.buf_alloc;
            c.peer_fwd_cnt = header.fwd_cnt;
        }
        match header.op {
            op::REQUEST => self.guest_connect(key),
            op::RESPONSE => {
                let Some(c) = self.connections.get_mut(&key) else {
                    self.send_rst(key.0, key.1);
                    return;
                };
                if c.state != ConnState::Connecting {
                    self.remove_connection(key);
                    self.send_rst(key.0, key.1);
                    return;
                }
                c.state = ConnState::Established;
                // A few bytes into a fresh socket's empty buffer: this does not block.
                let ok = format!("OK {}\n", key.0);
                if c.stream.write_all(ok.as_bytes()).is_err() {
                    self.remove_connection(key);
                    self.send_rst(key.0, key.1);
                    return;
                }
                self.rearm(key);
            }
            op::RST => self.remove_connection(key),
            op::SHUTDOWN => {
                let both = SHUTDOWN_RCV | SHUTDOWN_SEND;
                if header.flags & both == both {
                    self.remove_connection(key);
                    self.send_rst(key.0, key.1);
                } else if header.flags & SHUTDOWN_SEND != 0 {
                    if let Some(c) = self.connections.get_mut(&key) {
                        c.guest_done_sending = true;
                    }
                    self.flush_to_host(key);
                }
            }
            op::RW => {
                let Some(c) = self.connections.get_mut(&key) else {
                    self.send_rst(key.0, key.1);
                    return;
                };
                if c.state != ConnState::Established {
                    self.remove_connection(key);
                    self.send_rst(key.0, key.1);
                    return;
                }
                if c.to_host.len() + payload.len() > CONNECTION_BUFFER as usize {
                    tracing::debug!("vsock: guest sent past its credit; connection reset");
                    self.remove_connection(key);
                    self.send_rst(key.0, key.1);
                    return;
                }
                c.to_host.extend(payload);
                self.flush_to_host(key);
            }
            op::CREDIT_UPDATE => {}
            op::CREDIT_REQUEST => {
                if self.connections.contains_key(&key) {
                    self.send_control(key.0, key.1, op::CREDIT_UPDATE, 0);
                }
            }
            _ => {
                self.remove_connection(key);
                self.send_rst(key.0, key.1);
            }
        }
    }

    /// A guest connection to host port `key.0`: connect to `<socket>_<port>`.
    fn guest_connect(&mut self, key: (u32, u32)) {
        if self.connections.contains_key(&key) {
            self.remove_connection(key);
            self.send_rst(key.0, key.1);
            return;
        }
        let mut path = self.socket.clone().into_os_string();
        path.push(format!("_{}", key.0));
        let path = PathBuf::from(path);
        let stream = match UnixStream::connect(&path) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(path = %path.display(), "vsock: guest connection refused: {e}");
                self.send_rst(key.0, key.1);
                return;
            }
        };
        let token = self.take_token();
        let conn = Connection::new(stream, ConnState::Established, token);
        self.connections.insert(key, conn);
        self.rearm(key);
        self.send_control(key.0, key.1, op::RESPONSE, 0);
    }

    fn process_tx(&mut self, active: &mut ActiveQueues) -> Result<bool, DeviceError> {
        let queue_err = |source| DeviceError::Queue { index: TX, source };
        let mem = active.memory.clone();
        let mut used_any = false;
        loop {
            let queue = &mut active.queues[usize::from(TX)];
            let Some(head) = queue.pop_avail(&mem).map_err(queue_err)? else {
                break;
            };
            match queue.parse_chain(&mem, head) {
                Ok(chain) => {
                    let readable = Segments::readable(&chain);
                    match read_packet(&mem, &readable) {
                        Ok((header, payload)) => self.handle_tx(header, &payload),
                        Err(e) => tracing::warn!(head, "vsock: malformed packet refused: {e}"),
                    }
                }
                Err(ChainError::HeadOutOfRange { .. }) => {
                    tracing::warn!(head, "vsock: available ring names no descriptor");
                    continue;
                }
                Err(e) => tracing::warn!(error = %e, "vsock: malformed descriptor chain refused"),
            }
            active.queues[usize::from(TX)]
                .add_used(&mem, head, 0)
                .map_err(queue_err)?;
            used_any = true;
        }
        Ok(used_any)
    }

    /// Moves outbound packets (and fresh host data) into the guest's receive buffers.
    fn fill_rx(&mut self, active: &mut ActiveQueues) -> Result<bool, DeviceError> {
        let queue_err = |source| DeviceError::Queue { index: RX, source };
        let mem = active.memory.clone();
        let mut used_any = false;
        loop {
            if self.outbound.is_empty() {
                self.read_hosts();
            }
            if self.outbound.is_empty() {
                break;
            }
            let queue = &mut active.queues[usize::from(RX)];
            let Some(head) = queue.pop_avail(&mem).map_err(queue_err)? else {
                break;
            };
            let mut used_len = 0u32;
            match queue.parse_chain(&mem, head) {
                Ok(chain) => {
                    let writable = Segments::writable(&chain);
                    if writable.len() >= VSOCK_HEADER_LEN as u64 {
                        used_len = self.write_front_packet(&mem, &writable);
                    } else {
                        tracing::warn!(head, "vsock: receive buffer smaller than a header");
                    }
                }
                Err(ChainError::HeadOutOfRange { .. }) => {
                    tracing::warn!(head, "vsock: available ring names no descriptor");
                    continue;
                }
                Err(e) => tracing::warn!(error = %e, "vsock: malformed descriptor chain refused"),
            }
            active.queues[usize::from(RX)]
                .add_used(&mem, head, used_len)
                .map_err(queue_err)?;
            used_any = true;
        }
        Ok(used_any)
    }

    /// Writes as much of the first outbound packet as fits into `buffer`; returns the
    /// bytes written (0 if guest memory refused the write).
    fn write_front_packet(&mut self, mem: &VirtioMemory, buffer: &Segments) -> u32 {
        let Some(front) = self.outbound.front_mut() else {
            return 0;
        };
        let room = (buffer.len() - VSOCK_HEADER_LEN as u64).min(MAX_RX_PAYLOAD as u64) as usize;
        let n = front.payload.len().min(room);
        let mut header = front.header;
        header.len = n as u32;
        let ok = buffer.write_at(mem, 0, &header.to_bytes()).is_ok()
            && buffer
                .write_at(mem, VSOCK_HEADER_LEN as u64, &front.payload[..n])
                .is_ok();
        if n < front.payload.len() {
            front.payload.drain(..n);
        } else {
            self.outbound.pop_front();
        }
        if ok {
            (VSOCK_HEADER_LEN + n) as u32
        } else {
            0
        }
    }

    /// Tells the guest its connections are gone (after a restore).
    fn deliver_reset_event(&mut self, active: &mut ActiveQueues) -> Result<bool, DeviceError> {
        if !self.reset_event_pending {
            return Ok(false);
        }
        let queue_err = |source| DeviceError::Queue {
            index: EVENT,
            source,
        };
        let mem = active.memory.clone();
        let queue = &mut active.queues[usize::from(EVENT)];
        let Some(head) = queue.pop_avail(&mem).map_err(queue_err)? else {
            return Ok(false);
        };
        let mut len = 0;
        if let Ok(chain) = queue.parse_chain(&mem, head) {
            let writable = Segments::writable(&chain);
            if writable
                .write_at(&mem, 0, &EVENT_TRANSPORT_RESET.to_le_bytes())
                .is_ok()
            {
                len = 4;
            }
        }
        queue.add_used(&mem, head, len).map_err(queue_err)?;
        self.reset_event_pending = false;
        self.awaiting_reset_ack = true;
        Ok(true)
    }

    fn run(&mut self, active: &mut ActiveQueues, tx: bool) -> Result<(), DeviceError> {
        let mut interrupt = false;
        if tx && self.process_tx(active)? {
            interrupt |= active.queues[usize::from(TX)]
                .wants_interrupt(&active.memory)
                .map_err(|source| DeviceError::Queue { index: TX, source })?;
        }
        if self.deliver_reset_event(active)? {
            interrupt = true;
        }
        if self.fill_rx(active)? {
            interrupt |= active.queues[usize::from(RX)]
                .wants_interrupt(&active.memory)
                .map_err(|source| DeviceError::Queue { index: RX, source })?;
        }
        if interrupt {
            active
                .interrupt
                .signal_used_buffer()
                .map_err(DeviceError::Interrupt)?;
        }
        Ok(())
    }

    fn with_active(
        &mut self,
        f: impl FnOnce(&mut Self, &mut ActiveQueues) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let mut active = self.active.take().ok_or(DeviceError::NotActivated)?;
        let result = f(self, &mut active);
        self.active = Some(active);
        result
    }
}

/// Reads a packet header and its payload from the readable part of a chain.
fn read_packet(mem: &VirtioMemory, readable: &Segments) -> Result<(Header, Vec<u8>), String> {
    let mut raw = [0u8; VSOCK_HEADER_LEN];
    readable
        .read_at(mem, 0, &mut raw)
        .map_err(|_| format!("{} bytes hold no header", readable.len()))?;
    let header = Header::from_bytes(&raw);
    if header.len > MAX_TX_PAYLOAD {
        return Err(format!("payload of {} bytes is too large", header.len));
    }
    if header.op != op::RW && header.len != 0 {
        return Err(format!("op {} carries a payload", header.op));
    }
    let available = readable.len() - VSOCK_HEADER_LEN as u64;
    if u64::from(header.len) > available {
        return Err(format!(
            "header says {} payload bytes, the chain holds {available}",
            header.len
        ));
    }
    let mut payload = vec![0u8; header.len as usize];
    readable
        .read_at(mem, VSOCK_HEADER_LEN as u64, &mut payload)
        .map_err(|e| e.to_string())?;
    Ok((header, payload))
}

/// `CONNECT <port>` → the port.
fn parse_connect(line: &[u8]) -> Result<u32, String> {
    let text = std::str::from_utf8(line).map_err(|_| "CONNECT line is not text".to_string())?;
    let port = text
        .strip_prefix("CONNECT ")
        .ok_or_else(|| format!("expected `CONNECT <port>`, got {text:?}"))?;
    port.trim()
        .parse::<u32>()
        .map_err(|_| format!("bad port in {text:?}"))
}

fn send_nonblocking(stream: &UnixStream, data: &[u8]) -> std::io::Result<usize> {
    // SAFETY: `data` is a valid readable buffer of `data.len()` bytes for the duration
    // of the call, and the fd is the stream's own. MSG_NOSIGNAL: a closed peer is an
    // error, not a SIGPIPE.
    let n = unsafe {
        libc::send(
            stream.as_raw_fd(),
            data.as_ptr().cast(),
            data.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn recv_nonblocking(stream: &UnixStream, buf: &mut [u8]) -> std::io::Result<usize> {
    // SAFETY: `buf` is a valid writable buffer of `buf.len()` bytes for the duration
    // of the call, and the fd is the stream's own.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        copy_config(&self.guest_cid.to_le_bytes(), offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn active_queues(&mut self) -> &mut Option<ActiveQueues> {
        &mut self.active
    }

    fn activated(&mut self) {
        // A restored device tells the guest at once that its connections are gone. A
        // guest whose rings are broken only breaks its own device: the activation (and
        // so a restore) stands, as the same failure on a later notification would.
        // (Found by the virtio_mmio fuzz target.)
        if let Err(e) = self.with_active(|dev, active| dev.run(active, false)) {
            tracing::warn!(error = %e, "vsock: serving the queues after activation failed");
        }
    }

    fn process_queue(&mut self, index: u16) -> Result<(), DeviceError> {
        if usize::from(index) >= QUEUE_SIZES.len() {
            return Err(DeviceError::NoSuchQueue(index));
        }
        if index == EVENT {
            self.event_queue_notified();
        }
        self.with_active(|dev, active| dev.run(active, index == TX))
    }

    fn queues(&self) -> &[Queue] {
        self.active.as_ref().map_or(&[], |a| a.queues.as_slice())
    }

    fn reset(&mut self) {
        self.active = None;
        let keys: Vec<_> = self.connections.keys().copied().collect();
        for key in keys {
            self.remove_connection(key);
        }
        self.outbound.clear();
        self.held_requests.clear();
        self.awaiting_reset_ack = false;
    }

    fn backend_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn process_backend(&mut self) -> Result<(), DeviceError> {
        self.poll_host()?;
        if self.active.is_some() {
            self.with_active(|dev, active| dev.run(active, false))?;
        }
        Ok(())
    }
}

impl Persist for Vsock {
    type State = VsockState;
    const KIND: DeviceKind = DeviceKind::Vsock;
    const VERSION: u16 = 1;

    fn save(&self) -> Result<VsockState, DeviceStateError> {
        Ok(VsockState {
            guest_cid: self.guest_cid,
        })
    }

    fn restore(&mut self, saved: VsockState) -> Result<(), DeviceStateError> {
        if saved.guest_cid != self.guest_cid {
            return Err(DeviceStateError::mismatch(
                Self::KIND,
                "guest CID",
                saved.guest_cid,
                self.guest_cid,
            ));
        }
        // The guest's connections did not survive: tell it so once it runs again.
        self.reset_event_pending = true;
        self.next_host_port = restored_first_host_port();
        Ok(())
    }
}

/// Where a restored device starts numbering host connections: at a random port of
/// the ephemeral range. The guest keeps a reset connection in its table until its
/// program closes the socket, and a new connection from the same host port would
/// match it and be reset (the first agent connection after every restore was, when
/// numbering started again at [`FIRST_EPHEMERAL_PORT`]); among 3 × 2^30 ports a new
/// one meets an old one about never.
fn restored_first_host_port() -> u32 {
    let mut bytes = [0u8; 4];
    let random = if cube_storage::fill_random(&mut bytes).is_ok() {
        u32::from_ne_bytes(bytes)
    } else {
        // No entropy source: the clock's nanoseconds spread restores apart as well.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    };
    FIRST_EPHEMERAL_PORT + random % (u32::MAX - FIRST_EPHEMERAL_PORT)
}

/// How a host process reaches guest port `port` of the VM whose vsock device listens
/// on `socket`: connects, sends `CONNECT <port>\n` and returns the stream once the
/// guest accepted (waiting at most `timeout` for it).
pub fn connect_from_host(
    socket: &Path,
    port: u32,
    timeout: Duration,
) -> std::io::Result<UnixStream> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.write_all(format!("CONNECT {port}\n").as_bytes())?;
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    while !reply.ends_with(b"\n") {
        if reply.len() > MAX_CONNECT_LINE || stream.read(&mut byte)? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "the guest did not accept the vsock connection",
            ));
        }
        reply.push(byte[0]);
    }
    if reply.starts_with(b"OK ") {
        stream.set_read_timeout(None)?;
        Ok(stream)
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            format!(
                "unexpected vsock reply {:?}",
                String::from_utf8_lossy(&reply)
            ),
        ))
    }
}

#[cfg(test)]
#[path = "vsock_tests.rs"]
mod tests;
