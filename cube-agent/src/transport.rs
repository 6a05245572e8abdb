//! The stream between host and agent: anything readable, writable and clonable into a
//! second handle, so one thread can read while others write (a unix socket for the jail,
//! vsock in a VM).

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;

/// A bidirectional byte stream that can be split into a reading and a writing handle.
pub trait Transport: Read + Write + Send + 'static {
    /// Another handle to the same stream.
    fn try_clone_transport(&self) -> io::Result<Self>
    where
        Self: Sized;

    /// Shuts both directions down so a thread blocked reading the other handle wakes up.
    fn shutdown_transport(&self) -> io::Result<()>;

    /// The descriptor under this handle, when it has one: how the agent closes every
    /// host connection at once (see [`crate::server::Agent::drop_connections`]).
    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

impl Transport for UnixStream {
    fn try_clone_transport(&self) -> io::Result<Self> {
        self.try_clone()
    }

    fn shutdown_transport(&self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Both)
    }

    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(std::os::fd::AsRawFd::as_raw_fd(self))
    }
}

impl Transport for std::net::TcpStream {
    fn try_clone_transport(&self) -> io::Result<Self> {
        self.try_clone()
    }

    fn shutdown_transport(&self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Both)
    }

    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(std::os::fd::AsRawFd::as_raw_fd(self))
    }
}

/// `AF_VSOCK` streams: the agent's channel to the host when it runs inside a microVM
/// (the VMM maps them to unix sockets on the host side).
pub mod vsock {
    use std::io::{self, Read, Write};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// `VMADDR_CID_ANY`: listen on whatever context id the VM has.
    pub const CID_ANY: u32 = u32::MAX;
    /// The host's context id.
    pub const CID_HOST: u32 = 2;
    /// `VMADDR_CID_LOCAL`: this machine, through the loopback transport.
    pub const CID_LOCAL: u32 = 1;

    fn sockaddr(cid: u32, port: u32) -> libc::sockaddr_vm {
        // SAFETY: sockaddr_vm is plain data; all-zero is a valid value.
        let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
        addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
        addr.svm_cid = cid;
        addr.svm_port = port;
        addr
    }

    fn socket() -> io::Result<OwnedFd> {
        // SAFETY: plain socket(2) call; the returned fd is owned right away.
        let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn check(rc: libc::c_int) -> io::Result<()> {
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// A listening vsock socket.
    pub struct VsockListener {
        fd: OwnedFd,
    }

    impl VsockListener {
        /// Listens on `port` of every context id the machine has.
        pub fn bind(port: u32) -> io::Result<Self> {
            let fd = socket()?;
            let addr = sockaddr(CID_ANY, port);
            // SAFETY: `addr` is a valid sockaddr_vm of the size passed, alive for the call.
            check(unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    (&addr as *const libc::sockaddr_vm).cast(),
                    std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
                )
            })?;
            // SAFETY: listen(2) on a socket this listener owns.
            check(unsafe { libc::listen(fd.as_raw_fd(), 16) })?;
            Ok(VsockListener { fd })
        }

        /// Waits for the next connection.
        pub fn accept(&self) -> io::Result<VsockStream> {
            loop {
                // SAFETY: accept4 with null address arguments only returns a new fd.
                let fd = unsafe {
                    libc::accept4(
                        self.fd.as_raw_fd(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        libc::SOCK_CLOEXEC,
                    )
                };
                if fd >= 0 {
                    // SAFETY: `fd` was just returned by accept4 and nothing else owns it.
                    return Ok(VsockStream(unsafe { OwnedFd::from_raw_fd(fd) }));
                }
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }

    /// A connected vsock stream.
    pub struct VsockStream(OwnedFd);

    impl VsockStream {
        /// Connects to `port` of context `cid`.
        pub fn connect(cid: u32, port: u32) -> io::Result<Self> {
            let fd = socket()?;
            let addr = sockaddr(cid, port);
            // SAFETY: `addr` is a valid sockaddr_vm of the size passed, alive for the call.
            check(unsafe {
                libc::connect(
                    fd.as_raw_fd(),
                    (&addr as *const libc::sockaddr_vm).cast(),
                    std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
                )
            })?;
            Ok(VsockStream(fd))
        }
    }

    impl Read for VsockStream {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            // SAFETY: `buf` is valid for writes of its length for the whole call.
            let n = unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        }
    }

    impl Write for VsockStream {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            // SAFETY: `buf` is valid for reads of its length; MSG_NOSIGNAL turns a
            // closed peer into EPIPE instead of a signal.
            let n = unsafe {
                libc::send(
                    self.0.as_raw_fd(),
                    buf.as_ptr().cast(),
                    buf.len(),
                    libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl super::Transport for VsockStream {
        fn try_clone_transport(&self) -> io::Result<Self> {
            Ok(VsockStream(self.0.try_clone()?))
        }

        fn shutdown_transport(&self) -> io::Result<()> {
            // SAFETY: shutdown(2) on a socket this stream owns.
            check(unsafe { libc::shutdown(self.0.as_raw_fd(), libc::SHUT_RDWR) })
        }

        fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
            Some(self.0.as_raw_fd())
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::client::Client;
        use crate::protocol::ExecRequest;
        use crate::reaper::Reaper;
        use crate::server::{Agent, AgentConfig};

        #[test]
        fn the_agent_serves_over_vsock_loopback() {
            let listener = match VsockListener::bind(47_123) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("skipping: AF_VSOCK unavailable: {e}");
                    return;
                }
            };
            let connecting = std::thread::spawn(|| VsockStream::connect(CID_LOCAL, 47_123));
            let client_stream = match connecting.join().unwrap() {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("skipping: vsock loopback transport not loaded: {e}");
                    return;
                }
            };
            let server_stream = listener.accept().unwrap();
            let agent = Agent::new(AgentConfig {
                reaper: Reaper::per_child(),
                env: Vec::new(),
                default_user: None,
                vm_init: false,
            });
            let served = agent.clone();
            let server = std::thread::spawn(move || served.serve(server_stream));
            let client = Client::new(client_stream).unwrap();
            let out = client
                .exec(ExecRequest {
                    argv: vec!["echo".into(), "over vsock".into()],
                    ..Default::default()
                })
                .unwrap();
            assert_eq!(out.stdout, b"over vsock\n");
            drop(client);
            server.join().unwrap().unwrap();
        }
    }
}
