//! TCP connections from the host to a port on the sandbox's loopback, carried over the
//! agent protocol ([`crate::protocol::RequestBody::TcpConnect`]): how the host reaches a
//! server started inside a sandbox that has no network of its own (a web app behind
//! `cube serve`'s port proxy), on either engine.
//!
//! Each connection has two threads: one connects and then writes what the host sends
//! (queued, so a slow reader in the sandbox never stalls the agent's stream), one reads
//! what the sandbox side sends and emits it as events.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use std::time::Duration;

use crate::protocol::{ErrorReply, ResponseBody};

/// Connections one agent stream may carry at once.
pub const MAX_TUNNELS: usize = 256;

/// How long connecting to the port may take (it is local, so this is generous).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Bytes read from the sandbox side at a time (and so the largest event).
const READ_CHUNK: usize = 64 * 1024;

/// What the host asks of a connection.
enum Command {
    Data(Vec<u8>),
    ShutdownWrite,
}

/// One connection into the sandbox; dropping it closes the connection.
pub struct Tunnel {
    commands: Sender<Command>,
    open: Arc<AtomicBool>,
}

impl Tunnel {
    /// Connects to `port` on 127.0.0.1 in the background; `emit` receives `Started`
    /// once connected, `Stdout` events with what the sandbox side sends, then `Done`
    /// at its end (or an `Error`). `emit` returns false once nobody listens.
    pub fn open<F>(port: u16, emit: F) -> std::io::Result<Tunnel>
    where
        F: Fn(ResponseBody) -> bool + Send + Sync + 'static,
    {
        let (commands, queue) = mpsc::channel::<Command>();
        let open = Arc::new(AtomicBool::new(true));
        let reader_open = Arc::clone(&open);
        let emit = Arc::new(emit);
        std::thread::Builder::new()
            .name(format!("tcp-{port}"))
            .spawn(move || {
                let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
                let stream = match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
                    Ok(s) => s,
                    Err(e) => {
                        emit(ResponseBody::Error(ErrorReply::from_io(
                            &e,
                            format!("connecting to port {port} in the sandbox: {e}"),
                        )));
                        reader_open.store(false, Ordering::SeqCst);
                        return;
                    }
                };
                let _ = stream.set_nodelay(true);
                let reading = match stream.try_clone() {
                    Ok(r) => r,
                    Err(e) => {
                        emit(ResponseBody::Error(ErrorReply::from_io(
                            &e,
                            "cloning the socket",
                        )));
                        reader_open.store(false, Ordering::SeqCst);
                        return;
                    }
                };
                emit(ResponseBody::Started { pid: 0 });
                let reader_emit = Arc::clone(&emit);
                let reader = std::thread::Builder::new()
                    .name(format!("tcp-{port}-read"))
                    .spawn(move || {
                        pump_out(reading, &*reader_emit);
                        reader_open.store(false, Ordering::SeqCst);
                    });
                if reader.is_err() {
                    emit(ResponseBody::Error(ErrorReply::new(
                        crate::protocol::ErrorCode::Busy,
                        "no thread to read the connection",
                    )));
                    let _ = stream.shutdown(Shutdown::Both);
                    return;
                }
                pump_in(&stream, queue);
            })?;
        Ok(Tunnel { commands, open })
    }

    /// Queues bytes for the sandbox side.
    pub fn send(&self, data: Vec<u8>) {
        let _ = self.commands.send(Command::Data(data));
    }

    /// Ends the writing side once the queued bytes are written.
    pub fn shutdown_write(&self) {
        let _ = self.commands.send(Command::ShutdownWrite);
    }

    /// Whether the sandbox side may still send.
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::SeqCst)
    }
}

/// Writes what the host queued until the queue closes (the tunnel was dropped).
fn pump_in(mut stream: &TcpStream, queue: mpsc::Receiver<Command>) {
    while let Ok(command) = queue.recv() {
        match command {
            Command::Data(data) => {
                if stream.write_all(&data).is_err() {
                    break;
                }
            }
            Command::ShutdownWrite => {
                let _ = stream.shutdown(Shutdown::Write);
            }
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Emits what the sandbox side sends until it closes, then `Done`.
fn pump_out(mut stream: TcpStream, emit: &dyn Fn(ResponseBody) -> bool) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if !emit(ResponseBody::Stdout(buf[..n].to_vec())) {
                    let _ = stream.shutdown(Shutdown::Both);
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    emit(ResponseBody::Done);
}
