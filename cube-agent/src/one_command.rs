//! A sandbox made for one command (`cube-agent --exec -- CMD ARGS...`, what `cube run`
//! starts): the agent stays the sandbox's init, reaping orphans and passing termination
//! signals on, runs the command on the standard streams it was itself given, and exits
//! with the command's status. As PID 1 its exit ends the sandbox: the kernel kills
//! whatever the command left running in the PID namespace.
//!
//! No host channel is involved: the host waits for this process and reads the status
//! from its exit, and the command's output goes straight to the streams the host
//! handed in, as it is produced, with nothing copied on the way.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::errno::Errno;
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// Exit status when the command does not exist, as shells use.
pub const EXIT_NOT_FOUND: u8 = 127;

/// Exit status when the command exists but cannot be run, as shells use.
pub const EXIT_CANNOT_RUN: u8 = 126;

/// Signals passed on to the command's process group rather than acted on.
const FORWARDED: [Signal; 8] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGWINCH,
    Signal::SIGCONT,
];

/// Why the command could not be run to its end.
#[derive(Debug, thiserror::Error)]
pub enum OneCommandError {
    /// There is no command.
    #[error("no command given")]
    NoCommand,
    /// Blocking the signals init takes failed.
    #[error("blocking signals failed")]
    SignalMask(#[source] Errno),
    /// The command could not be started.
    #[error("cannot run {program}")]
    Spawn {
        /// argv[0].
        program: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Waiting for a signal failed.
    #[error("waiting for signals failed")]
    SignalWait(#[source] Errno),
}

impl OneCommandError {
    /// The exit status the sandbox ends with: 127 for a command that does not exist,
    /// 126 for one that cannot be run, 1 otherwise.
    pub fn exit_status(&self) -> u8 {
        match self {
            OneCommandError::Spawn { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => EXIT_NOT_FOUND,
                std::io::ErrorKind::PermissionDenied => EXIT_CANNOT_RUN,
                _ => 1,
            },
            _ => 1,
        }
    }
}

/// Runs `argv` and returns its status in the shell's convention (the exit code, or
/// 128 + the signal that killed it), after reaping every child that ended meanwhile.
///
/// Call before any other thread exists: the signals init takes are blocked here and
/// received synchronously, so they must be blocked in every thread of the process.
pub fn run(argv: &[OsString]) -> Result<u8, OneCommandError> {
    let (program, args) = argv.split_first().ok_or(OneCommandError::NoCommand)?;
    let mut taken = SigSet::empty();
    taken.add(Signal::SIGCHLD);
    for sig in FORWARDED {
        taken.add(sig);
    }
    taken.thread_block().map_err(OneCommandError::SignalMask)?;
    // std starts the child with an empty signal mask and default SIGPIPE, and leads a
    // process group of its own so that a forwarded signal reaches the pipeline it
    // starts, not only its first process.
    let mut command = Command::new(program);
    command.args(args).process_group(0);
    if crate::init::is_pid1() && take_terminal() {
        // SAFETY: the closure runs in the forked child before exec and makes only
        // async-signal-safe calls.
        unsafe {
            command.pre_exec(|| {
                foreground_in_child();
                Ok(())
            });
        }
    }
    let child = command.spawn().map_err(|source| OneCommandError::Spawn {
        program: program.to_string_lossy().into_owned(),
        source,
    })?;
    let leader = Pid::from_raw(child.id() as i32);
    // The status comes from waitpid below, never from `child`, which is not waited for.
    drop(child);
    loop {
        let sig = taken.wait().map_err(OneCommandError::SignalWait)?;
        if sig != Signal::SIGCHLD {
            // The group may be gone already (its leader ended); nothing to do then.
            let _ = kill(Pid::from_raw(-leader.as_raw()), sig);
            continue;
        }
        if let Some(status) = reap(leader) {
            return Ok(status);
        }
    }
}

/// When stdin is a terminal (the sandbox's own: `cube run` on a terminal), makes it
/// the controlling terminal of the sandbox's session, which this process (PID 1)
/// leads, so that the command can be its foreground job: Ctrl-C there interrupts the
/// command, and it reads the terminal without being stopped. Whether it did.
fn take_terminal() -> bool {
    // SAFETY: isatty and TIOCSCTTY (argument 0: no stealing) only act on descriptor 0.
    unsafe { libc::isatty(0) == 1 && libc::ioctl(0, libc::TIOCSCTTY, 0) == 0 }
}

/// In the command's child, once it leads its own process group: makes that group the
/// terminal's foreground. (SIGTTOU, which a background group asking this gets, is
/// ignored meanwhile.) Async-signal-safe.
fn foreground_in_child() {
    // SAFETY: signal and tcsetpgrp take integers and touch no memory of ours.
    unsafe {
        libc::signal(libc::SIGTTOU, libc::SIG_IGN);
        libc::tcsetpgrp(0, libc::getpid());
        libc::signal(libc::SIGTTOU, libc::SIG_DFL);
    }
}

/// Reaps every ended child (orphans re-parented to init included); the leader's status
/// if it was among them.
fn reap(leader: Pid) -> Option<u8> {
    let mut status = None;
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) if pid == leader => {
                status = Some((code & 0xff) as u8);
            }
            Ok(WaitStatus::Signaled(pid, sig, _)) if pid == leader => {
                status = Some(128 + (sig as i32 & 0x7f) as u8);
            }
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return status,
            Err(Errno::EINTR) | Ok(_) => {}
            Err(_) => return status,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    /// Runs `run` in a forked child (it blocks signals and reaps every child, which
    /// must not disturb the test harness) and returns what it returned.
    fn in_child(argv: &[&str]) -> i32 {
        let argv = os(argv);
        // SAFETY: the child only calls `run` (spawn, sigwait, waitpid) and `_exit`; the
        // harness's other threads are not touched by it.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                // As init would be: orphans come to this process.
                let _ = crate::init::become_subreaper();
                let code = match run(&argv) {
                    Ok(c) => i32::from(c),
                    Err(e) => 200 + i32::from(e.exit_status()) % 50,
                };
                // SAFETY: ends the forked child without running the harness's exit hooks.
                unsafe { libc::_exit(code) }
            }
            nix::unistd::ForkResult::Parent { child } => match waitpid(child, None).unwrap() {
                WaitStatus::Exited(_, code) => code,
                other => panic!("the child ended as {other:?}"),
            },
        }
    }

    #[test]
    fn returns_the_commands_exit_code() {
        assert_eq!(in_child(&["sh", "-c", "exit 7"]), 7);
        assert_eq!(in_child(&["true"]), 0);
    }

    #[test]
    fn a_killed_command_reads_as_128_plus_its_signal() {
        assert_eq!(in_child(&["sh", "-c", "kill -KILL $$"]), 128 + 9);
    }

    #[test]
    fn reaps_orphans_and_returns_when_the_command_ends() {
        // The background sleep outlives its parent; `run` must not wait for it.
        assert_eq!(in_child(&["sh", "-c", "sleep 1 & exit 3"]), 3);
    }

    #[test]
    fn a_missing_command_is_127() {
        assert_eq!(in_child(&["/nonexistent/program"]), 200 + 127 % 50);
        let e = OneCommandError::Spawn {
            program: "x".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert_eq!(e.exit_status(), 127);
        assert!(matches!(run(&[]), Err(OneCommandError::NoCommand)));
    }
}
