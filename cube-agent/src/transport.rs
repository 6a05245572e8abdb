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
}

impl Transport for UnixStream {
    fn try_clone_transport(&self) -> io::Result<Self> {
        self.try_clone()
    }

    fn shutdown_transport(&self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Both)
    }
}

impl Transport for std::net::TcpStream {
    fn try_clone_transport(&self) -> io::Result<Self> {
        self.try_clone()
    }

    fn shutdown_transport(&self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Both)
    }
}
