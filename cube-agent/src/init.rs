//! Init duties: becoming the reaper of orphans, and turning SIGTERM/SIGINT/SIGHUP into
//! a clean shutdown that forwards the signal to every exec first.
//!
//! The termination signals are blocked in every thread (call
//! [`block_termination_signals`] before starting any) and taken synchronously by one
//! thread with `sigwait`; std resets the signal mask of the children it spawns, so execs
//! still see them.

use std::time::Duration;

use nix::sys::signal::{kill, SigSet, Signal};
use nix::unistd::{getpid, Pid};

use crate::server::Agent;

/// Errors of init duties.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// `prctl(PR_SET_CHILD_SUBREAPER)` failed.
    #[error("becoming a child subreaper failed")]
    Subreaper(#[source] nix::errno::Errno),
    /// Blocking the termination signals failed.
    #[error("blocking termination signals failed")]
    SignalMask(#[source] nix::errno::Errno),
    /// The signal thread could not be started.
    #[error("starting the signal thread failed")]
    Thread(#[source] std::io::Error),
    /// Emptying the ambient or inheritable capability set failed.
    #[error("emptying the inheritable capabilities failed")]
    Capabilities(#[source] nix::errno::Errno),
    /// `prctl(PR_SET_DUMPABLE, 0)` failed.
    #[error("making the agent undumpable failed")]
    Undumpable(#[source] nix::errno::Errno),
}

/// Whether this process is PID 1 (of its PID namespace).
pub fn is_pid1() -> bool {
    getpid().as_raw() == 1
}

/// Closes the agent to inspection by the code it runs, which has the same uid: with
/// the process undumpable, `/proc/<agent>/mem`, ptrace, `process_vm_readv` and
/// `pidfd_getfd` on it need CAP_SYS_PTRACE, which nothing in a sandbox has. The agent
/// holds what the sandbox must not reach: the host's channel, and with `--exec` the
/// host's standard streams. The commands it starts are dumpable again after their
/// exec (the kernel resets it), as ordinary processes are. CRIU restores the flag.
pub fn forbid_inspection() -> Result<(), InitError> {
    // SAFETY: PR_SET_DUMPABLE takes one integer argument and touches no memory of
    // ours; the unused arguments are zero as prctl(2) asks.
    let rc = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(InitError::Undumpable(nix::errno::Errno::last()))
    }
}

/// Keeps a capability the sandbox left the agent (a pod sandbox's agent holds
/// CAP_SYS_CHROOT, given as an ambient capability so that it survived the agent's own
/// exec) to the agent: empties the ambient and inheritable sets, so every process the
/// agent starts as the sandbox's uid runs with none. The effective and permitted sets
/// stay as they are (all of them for an agent running as root, in a VM).
pub fn keep_capabilities_to_itself() -> Result<(), InitError> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    let err = || InitError::Capabilities(nix::errno::Errno::last());
    // SAFETY: integer-only prctl.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if rc != 0 {
        return Err(err());
    }
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: header and data are live and laid out as capget's version 3 expects
    // (two data elements); the kernel writes only into `data`.
    if unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut Header,
            data.as_mut_ptr(),
        )
    } != 0
    {
        return Err(err());
    }
    if data.iter().all(|d| d.inheritable == 0) {
        return Ok(());
    }
    for d in &mut data {
        d.inheritable = 0;
    }
    // SAFETY: as above; lowering the inheritable set needs no privilege.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) } != 0 {
        return Err(err());
    }
    Ok(())
}

/// Makes orphaned descendants re-parent to this process, as they would to PID 1.
pub fn become_subreaper() -> Result<(), InitError> {
    // SAFETY: PR_SET_CHILD_SUBREAPER takes one integer argument and touches no memory of
    // ours; the unused arguments are zero as prctl(2) asks.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(InitError::Subreaper(nix::errno::Errno::last()))
    }
}

/// The signal that makes the agent close every host connection (and go on serving new
/// ones): what the host sends before a CRIU checkpoint of the sandbox, which cannot hold
/// a stream whose peer is outside. See [`Agent::drop_connections`].
pub const DISCONNECT_SIGNAL: Signal = Signal::SIGUSR2;

/// The signals that shut the agent down, and [`DISCONNECT_SIGNAL`].
fn termination_signals() -> SigSet {
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    set.add(Signal::SIGHUP);
    set.add(DISCONNECT_SIGNAL);
    set
}

/// Blocks the termination signals in the calling thread and every thread it starts
/// afterwards, so only the signal thread receives them.
pub fn block_termination_signals() -> Result<SigSet, InitError> {
    let set = termination_signals();
    set.thread_block().map_err(InitError::SignalMask)?;
    Ok(set)
}

/// Starts the thread that waits for a termination signal, forwards it to every exec,
/// kills what is left after `grace` and exits the process with status 0.
pub fn spawn_signal_thread(set: SigSet, agent: Agent, grace: Duration) -> Result<(), InitError> {
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            let sig = match set.wait() {
                Ok(sig) => sig,
                Err(e) => {
                    tracing::warn!(error = %e, "sigwait failed");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            if sig == DISCONNECT_SIGNAL {
                let closed = agent.drop_connections();
                tracing::debug!(closed, "host connections dropped");
                continue;
            }
            tracing::info!(signal = ?sig, "shutting down");
            shutdown(&agent, sig, grace);
            std::process::exit(0);
        })
        .map_err(InitError::Thread)?;
    Ok(())
}

/// Stops the interpreter contexts, forwards `sig` to every exec, waits up to `grace`,
/// then kills what is left; as PID 1
/// also kills every other process of the namespace (orphans included).
pub fn shutdown(agent: &Agent, sig: Signal, grace: Duration) {
    agent.stop_children(sig, grace);
    if is_pid1() {
        // As PID 1, kill(-1) reaches every process in our namespace but ourselves.
        let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    } else {
        kill_descendants();
    }
}

/// Kills every remaining child of this process and its process group: processes an
/// exec left behind (forked as it was being stopped, or orphans re-parented to us as
/// subreaper). Repeats while killing orphans more of them onto us.
fn kill_descendants() {
    let me = getpid().as_raw();
    let my_group = nix::unistd::getpgrp().as_raw();
    for _ in 0..50 {
        let children: Vec<(i32, i32)> = processes()
            .into_iter()
            .filter(|p| p.ppid == me && !p.zombie)
            .map(|p| (p.pid, p.pgrp))
            .collect();
        if children.is_empty() {
            return;
        }
        for (pid, pgrp) in children {
            if pgrp != my_group && pgrp > 1 {
                let _ = nix::sys::signal::killpg(Pid::from_raw(pgrp), Signal::SIGKILL);
            }
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One line of `/proc/<pid>/stat`, the fields shutdown needs.
struct ProcStat {
    pid: i32,
    ppid: i32,
    pgrp: i32,
    zombie: bool,
}

/// Every process visible in `/proc` (those that vanish while being read are skipped).
fn processes() -> Vec<ProcStat> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            parse_stat(pid, &stat)
        })
        .collect()
}

/// Parses `/proc/<pid>/stat`; the command name is in parentheses and may hold anything.
fn parse_stat(pid: i32, stat: &str) -> Option<ProcStat> {
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some(ProcStat {
        pid,
        ppid,
        pgrp,
        zombie: state == "Z" || state == "X",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_stat_with_odd_names() {
        let p = parse_stat(42, "42 (a) b (c) S 7 42 42 0 -1").unwrap();
        assert_eq!((p.pid, p.ppid, p.pgrp, p.zombie), (42, 7, 42, false));
        assert!(parse_stat(1, "1 (x) Z 0 1").unwrap().zombie);
        assert!(parse_stat(1, "garbage").is_none());
        let me = processes()
            .into_iter()
            .find(|p| p.pid == std::process::id() as i32)
            .unwrap();
        assert_eq!(me.ppid, nix::unistd::getppid().as_raw());
    }

    #[test]
    fn termination_signals_are_the_three() {
        let set = termination_signals();
        assert!(set.contains(Signal::SIGTERM));
        assert!(set.contains(Signal::SIGINT));
        assert!(set.contains(Signal::SIGHUP));
        assert!(!set.contains(Signal::SIGCHLD));
    }
}
