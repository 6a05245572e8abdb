//! Pseudo-terminals for execs that ask for one ([`crate::protocol::RequestBody::ExecInTerminal`]).
//!
//! The agent opens a new terminal from the sandbox's own devpts (`/dev/ptmx`), takes
//! its other end by descriptor (`TIOCGPTPEER`, so no path under `/dev/pts` is looked
//! up: a pod container's root has none), hands that end to the process as its
//! standard streams and controlling terminal, and keeps the master: it reads the
//! output there, writes input there and sets the size there.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::protocol::TerminalSize;

/// Why a terminal could not be made or changed.
#[derive(Debug, thiserror::Error)]
pub enum TerminalError {
    /// `/dev/ptmx` could not be opened (no devpts in this sandbox?).
    #[error("opening /dev/ptmx")]
    Open(#[source] std::io::Error),
    /// The terminal's other end could not be unlocked or opened.
    #[error("opening the terminal's other end")]
    Peer(#[source] std::io::Error),
    /// Its size could not be set.
    #[error("setting the terminal's size")]
    Size(#[source] std::io::Error),
    /// A descriptor could not be duplicated.
    #[error("duplicating the terminal's descriptor")]
    Duplicate(#[source] std::io::Error),
}

/// A new pseudo-terminal: the master the agent keeps, and the end the process gets.
pub struct Pty {
    /// The agent's end: output is read here, input written, the size set.
    pub master: File,
    /// The process's end (its standard streams and controlling terminal).
    pub peer: File,
}

impl Pty {
    /// Opens a terminal of `size`.
    pub fn open(size: TerminalSize) -> Result<Pty, TerminalError> {
        let path = c"/dev/ptmx";
        // SAFETY: `path` is a NUL-terminated string; open returns a new descriptor or -1.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(TerminalError::Open(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let master = unsafe { File::from_raw_fd(fd) };
        let unlock: libc::c_int = 0;
        // SAFETY: TIOCSPTLCK reads one int from the pointer, which is valid for the call.
        if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) } != 0 {
            return Err(TerminalError::Peer(std::io::Error::last_os_error()));
        }
        // SAFETY: TIOCGPTPEER takes open flags by value and returns a new descriptor
        // of the terminal's other end, or -1.
        let peer = unsafe {
            libc::ioctl(
                master.as_raw_fd(),
                libc::TIOCGPTPEER,
                libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
            )
        };
        if peer < 0 {
            return Err(TerminalError::Peer(std::io::Error::last_os_error()));
        }
        // SAFETY: `peer` was just returned by the kernel and is owned by nothing else.
        let peer = unsafe { File::from_raw_fd(peer) };
        set_size(&master, size)?;
        Ok(Pty { master, peer })
    }

    /// The process's end, once per standard stream.
    pub fn peer_streams(&self) -> Result<[OwnedFd; 3], TerminalError> {
        let dup = || {
            self.peer
                .try_clone()
                .map(OwnedFd::from)
                .map_err(TerminalError::Duplicate)
        };
        Ok([dup()?, dup()?, dup()?])
    }
}

/// Sets the size of the terminal whose master (or other end) is `terminal`.
pub fn set_size(terminal: &File, size: TerminalSize) -> Result<(), TerminalError> {
    let winsize = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize from the pointer, valid for the call.
    if unsafe { libc::ioctl(terminal.as_raw_fd(), libc::TIOCSWINSZ, &winsize) } != 0 {
        return Err(TerminalError::Size(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// In the child, between fork and exec: leads a new session and takes standard
/// input (the terminal's other end) as its controlling terminal. Only
/// async-signal-safe system calls.
pub(crate) fn take_as_controlling_terminal() -> std::io::Result<()> {
    // SAFETY: setsid and ioctl(TIOCSCTTY, 0) act on the calling process and its
    // descriptor 0 only; both are async-signal-safe.
    unsafe {
        if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn size_of(terminal: &File) -> (u16, u16) {
        let mut ws = libc::winsize {
            ws_row: 0,
            ws_col: 0,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCGWINSZ writes one winsize through the pointer, valid for the call.
        let rc = unsafe { libc::ioctl(terminal.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) };
        assert_eq!(rc, 0);
        (ws.ws_row, ws.ws_col)
    }

    #[test]
    fn a_terminal_has_its_size_and_carries_bytes_both_ways() {
        let Ok(mut pty) = Pty::open(TerminalSize { rows: 33, cols: 77 }) else {
            eprintln!("skipped: no /dev/ptmx to open here");
            return;
        };
        assert_eq!(size_of(&pty.peer), (33, 77));
        set_size(&pty.master, TerminalSize { rows: 10, cols: 20 }).unwrap();
        assert_eq!(size_of(&pty.peer), (10, 20));
        // Output of the process's end reaches the master (the line discipline turns
        // "\n" into "\r\n").
        pty.peer.write_all(b"out\n").unwrap();
        let mut buf = [0u8; 16];
        let n = pty.master.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"out\r\n");
        // Input typed at the master reaches it, a line at a time.
        pty.master.write_all(b"in\n").unwrap();
        let n = pty.peer.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"in\n");
        let streams = pty.peer_streams().unwrap();
        assert_eq!(streams.len(), 3);
    }
}
