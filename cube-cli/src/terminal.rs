//! A terminal of the sandbox's own for `cube run`: when one of this process's standard
//! streams is a terminal, the sandbox gets the far end of a new pseudo-terminal in its
//! place, never the host's terminal itself, and this process copies bytes between the
//! two.
//!
//! Why: a process holding a terminal can make it its controlling terminal (when it is
//! nobody's) and push keystrokes into it with TIOCSTI, which the host's shell then
//! reads as typed; and it can change the terminal's settings (echo off, raw mode),
//! which outlive it. On a pseudo-terminal of its own the sandbox can do both to itself
//! only. While the sandbox runs, the host terminal is in raw mode (so that Ctrl-C, line
//! editing and echo are the sandbox terminal's business, as in `ssh` or `docker run
//! -t`); its settings are put back when the run ends, interrupted or not.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::thread::JoinHandle;

use cube_agent::protocol::TerminalSize;
use cube_agent::terminal::{set_size, Pty};

use crate::cli_error::{chain, CliError};

/// The host terminal a window size is read from and settings are restored to.
struct HostTerminal {
    /// The first of this process's standard streams that is a terminal.
    fd: RawFd,
    /// Stdin in raw mode during the run, when it is a terminal.
    raw: Option<RawMode>,
}

/// A terminal on standard input in raw mode (keys pass as typed, no echo, no line
/// editing, Ctrl-C a byte like others); its settings are put back on drop.
pub struct RawMode {
    saved: libc::termios,
}

impl RawMode {
    /// Puts standard input, when it is a terminal, into raw mode.
    pub fn enter() -> Option<RawMode> {
        // SAFETY: `termios` is plain data tcgetattr fills in; cfmakeraw edits a copy.
        unsafe {
            let mut saved: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(0, &mut saved) != 0 {
                return None;
            }
            let mut raw = saved;
            libc::cfmakeraw(&mut raw);
            (libc::tcsetattr(0, libc::TCSANOW, &raw) == 0).then_some(RawMode { saved })
        }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: `saved` is the termios tcgetattr returned for this descriptor.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &self.saved) };
    }
}

/// The window size of terminal `fd`, as (rows, columns); None when it is no terminal.
pub fn window_size(fd: RawFd) -> Option<(u16, u16)> {
    // SAFETY: `winsize` is plain data TIOCGWINSZ fills in.
    unsafe {
        let mut size: libc::winsize = std::mem::zeroed();
        (libc::ioctl(fd, libc::TIOCGWINSZ, &mut size) == 0).then_some((size.ws_row, size.ws_col))
    }
}

/// The sandbox's terminal and the copying between it and the host's.
pub struct SandboxTerminal {
    master: OwnedFd,
    /// The sandbox's end, kept until the sandbox holds its own copies.
    slave: Option<OwnedFd>,
    /// Which of stdin, stdout and stderr are terminals (and become the slave).
    streams: [bool; 3],
    host: HostTerminal,
    output: Option<JoinHandle<()>>,
}

/// Whether descriptor `fd` is a terminal.
pub fn is_terminal(fd: RawFd) -> bool {
    // SAFETY: isatty only inspects the descriptor.
    unsafe { libc::isatty(fd) == 1 }
}

impl SandboxTerminal {
    /// A new pseudo-terminal with the host terminal's settings and window size when
    /// one of this process's standard streams is a terminal; None otherwise (nothing
    /// to protect, nothing copied).
    pub fn open() -> Result<Option<SandboxTerminal>, CliError> {
        let streams = [0, 1, 2].map(is_terminal);
        let Some(host_fd) = (0..3).find(|fd| streams[*fd as usize]) else {
            return Ok(None);
        };
        // The host terminal's size where it says one (else 0 x 0, a new terminal's own).
        let size = window_size(host_fd)
            .map_or(TerminalSize { rows: 0, cols: 0 }, |(rows, cols)| {
                TerminalSize { rows, cols }
            });
        let pty = Pty::open(size).map_err(|e| {
            CliError::failed(format!("opening a terminal for the sandbox: {}", chain(&e)))
        })?;
        // SAFETY: `termios` is plain data tcgetattr fills in and tcsetattr reads.
        unsafe {
            let mut settings: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(host_fd, &mut settings) == 0 {
                libc::tcsetattr(pty.peer.as_raw_fd(), libc::TCSANOW, &settings);
            }
        }
        Ok(Some(SandboxTerminal {
            master: OwnedFd::from(pty.master),
            slave: Some(OwnedFd::from(pty.peer)),
            streams,
            host: HostTerminal {
                fd: host_fd,
                raw: None,
            },
            output: None,
        }))
    }

    /// What the sandbox gets as standard stream `n` (0-2): its terminal where this
    /// process's stream is a terminal, None (this process's own stream) otherwise.
    pub fn stream(&self, n: usize) -> Option<RawFd> {
        match (&self.slave, self.streams.get(n)) {
            (Some(slave), Some(true)) => Some(slave.as_raw_fd()),
            _ => None,
        }
    }

    /// Once the sandbox holds its own copies of the terminal: closes this process's
    /// (so the copying ends when the sandbox's last one goes), puts a host terminal
    /// on stdin into raw mode and starts copying in both directions.
    pub fn start(&mut self) -> Result<(), CliError> {
        self.slave = None;
        if self.streams[0] {
            self.host.raw = RawMode::enter();
            let to_sandbox = self.master_file()?;
            // Ends with this process: a read of the host terminal cannot be called off.
            std::thread::Builder::new()
                .name("terminal-in".into())
                .spawn(move || copy(&mut std::io::stdin().lock(), to_sandbox))
                .map_err(|e| CliError::failed(format!("starting the terminal copy: {e}")))?;
        }
        let from_sandbox = self.master_file()?;
        // The sandbox's output goes to the host terminal among stdout and stderr.
        let out = [1, 2].into_iter().find(|fd| self.streams[*fd as usize]);
        self.output = Some(
            std::thread::Builder::new()
                .name("terminal-out".into())
                .spawn(move || match out {
                    Some(1) => copy_to(from_sandbox, std::io::stdout()),
                    Some(_) => copy_to(from_sandbox, std::io::stderr()),
                    // Only stdin is a terminal: its echo has nowhere to go.
                    None => copy_to(from_sandbox, std::io::sink()),
                })
                .map_err(|e| CliError::failed(format!("starting the terminal copy: {e}")))?,
        );
        Ok(())
    }

    fn master_file(&self) -> Result<File, CliError> {
        self.master
            .try_clone()
            .map(File::from)
            .map_err(|e| CliError::failed(format!("duplicating the sandbox's terminal: {e}")))
    }

    /// What gives the sandbox's terminal the host terminal's window size, for the
    /// thread that takes SIGWINCH.
    pub fn resizer(&self) -> Result<Resizer, CliError> {
        Ok(Resizer {
            host: self.host.fd,
            master: self.master_file()?,
        })
    }

    /// Once the sandbox has ended: copies what it wrote last, then restores the host
    /// terminal's settings.
    pub fn finish(mut self) {
        if let Some(output) = self.output.take() {
            let _ = output.join();
        }
        self.restore();
    }

    fn restore(&mut self) {
        self.host.raw = None;
    }
}

impl Drop for SandboxTerminal {
    /// Every path out of a run, panics and errors included, gives the host terminal
    /// its settings back.
    fn drop(&mut self) {
        self.restore();
    }
}

/// Copies the host terminal's window size onto the sandbox's terminal.
pub struct Resizer {
    host: RawFd,
    master: File,
}

impl Resizer {
    /// Copies the size now (the sandbox's foreground processes get SIGWINCH).
    pub fn resize(&self) {
        if let Some((rows, cols)) = window_size(self.host) {
            let _ = set_size(&self.master, TerminalSize { rows, cols });
        }
    }
}

/// Copies `from` into `to` until either ends.
fn copy(from: &mut impl Read, mut to: File) {
    let mut buf = [0u8; 4096];
    loop {
        match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Copies the sandbox's terminal output to `to` until the terminal's last sandbox
/// copy closes (the read then fails with EIO). Once `to` fails, the output is still
/// read and dropped: a sandbox writing into a full terminal would wait for ever.
fn copy_to(mut from: File, mut to: impl Write) {
    let mut buf = [0u8; 4096];
    let mut writable = true;
    loop {
        match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if writable && to.write_all(&buf[..n]).and_then(|()| to.flush()).is_err() {
                    writable = false;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}
