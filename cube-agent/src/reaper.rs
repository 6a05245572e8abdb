//! Who waits for child processes.
//!
//! Inside a sandbox the agent is init: orphans are re-parented to it and it must reap
//! them, which means `waitpid(-1)` — and that would steal the exit statuses of exec's
//! own children. So in [`Reaper::all`] mode one thread owns *all* waiting: it reaps every
//! child and hands the statuses of exec's children to exec by pid; unknown pids are
//! orphans and their statuses are dropped.
//!
//! Two races are closed with one lock: exec spawns and registers the pid while holding
//! the table lock, so a status is never reaped before its pid is known; and the reaper
//! only reaps (with `WNOHANG`) while holding that lock, so it never reaps a child whose
//! exec failed while std is still waiting for it inside `spawn`. The reaper sleeps in
//! `waitid(P_ALL, WEXITED | WNOWAIT)`, which sees a zombie without reaping it.
//!
//! In [`Reaper::per_child`] mode (an agent embedded in a process that has other children,
//! such as a test harness) each exec waits for its own pid only.

use std::collections::HashMap;
use std::process::{Child, Command};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::protocol::ExitInfo;

/// How long the reaper sleeps when the agent has no children at all before looking
/// again (orphans of processes entered from outside can still be re-parented to it).
const IDLE_RECHECK: Duration = Duration::from_millis(100);

/// Errors of waiting for children.
#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    /// The process could not be started.
    #[error("spawning the process failed")]
    Spawn(#[source] std::io::Error),
    /// The reaper thread could not be started.
    #[error("starting the reaper thread failed")]
    Thread(#[source] std::io::Error),
    /// `waitpid` failed.
    #[error("waiting for pid {pid} failed")]
    Wait {
        /// The child.
        pid: i32,
        /// The errno.
        #[source]
        source: Errno,
    },
    /// The reaper thread is gone.
    #[error("the reaper thread stopped")]
    ReaperGone,
}

/// Who waits for children; cheap to clone.
#[derive(Clone)]
pub enum Reaper {
    /// Each child is waited for by pid.
    PerChild,
    /// One thread reaps every child, orphans included.
    All(Arc<ReapAll>),
}

/// The state of the reap-everything thread.
pub struct ReapAll {
    table: Mutex<Table>,
    spawned: Condvar,
}

#[derive(Default)]
struct Table {
    waiting: HashMap<i32, Sender<ExitInfo>>,
    spawn_count: u64,
    orphans_reaped: u64,
}

/// The way to learn how one child ended.
pub enum ChildStatus {
    /// Waited for by pid.
    Own(Pid),
    /// Delivered by the reaper thread.
    Reaped(Receiver<ExitInfo>),
}

impl Reaper {
    /// Each exec waits for its own child; nothing else is reaped.
    pub fn per_child() -> Self {
        Reaper::PerChild
    }

    /// Starts the thread that reaps every child of this process. Start at most one per
    /// process, and spawn children only through it afterwards.
    pub fn all() -> Result<Self, ReaperError> {
        let state = Arc::new(ReapAll {
            table: Mutex::default(),
            spawned: Condvar::new(),
        });
        let thread_state = Arc::clone(&state);
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || thread_state.run())
            .map_err(ReaperError::Thread)?;
        Ok(Reaper::All(state))
    }

    /// Spawns `cmd` and arranges for its exit status to reach the returned handle.
    pub fn spawn(&self, cmd: &mut Command) -> Result<(Child, ChildStatus), ReaperError> {
        match self {
            Reaper::PerChild => {
                let child = cmd.spawn().map_err(ReaperError::Spawn)?;
                let pid = Pid::from_raw(child.id() as i32);
                Ok((child, ChildStatus::Own(pid)))
            }
            Reaper::All(state) => {
                let mut table = state.lock();
                let child = cmd.spawn().map_err(ReaperError::Spawn)?;
                let (tx, rx) = mpsc::channel();
                table.waiting.insert(child.id() as i32, tx);
                table.spawn_count += 1;
                drop(table);
                state.spawned.notify_all();
                Ok((child, ChildStatus::Reaped(rx)))
            }
        }
    }

    /// How many orphans (children not started through this reaper) were reaped.
    pub fn orphans_reaped(&self) -> u64 {
        match self {
            Reaper::PerChild => 0,
            Reaper::All(state) => state.lock().orphans_reaped,
        }
    }
}

impl ReapAll {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn run(&self) {
        loop {
            let seen_spawns = self.lock().spawn_count;
            match waitid(Id::All, WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {
                Ok(_) => self.reap_ready(),
                Err(Errno::EINTR) => {}
                Err(Errno::ECHILD) => {
                    let table = self.lock();
                    if table.spawn_count == seen_spawns {
                        let _ = self.spawned.wait_timeout(table, IDLE_RECHECK);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "waitid failed");
                    std::thread::sleep(IDLE_RECHECK);
                }
            }
        }
    }

    /// Reaps every zombie child, under the table lock.
    fn reap_ready(&self) {
        let mut table = self.lock();
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
                Err(Errno::EINTR) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "waitpid failed");
                    return;
                }
                Ok(status) => {
                    let (pid, info) = match exit_info(status) {
                        Some(x) => x,
                        None => continue,
                    };
                    match table.waiting.remove(&pid) {
                        Some(tx) => {
                            let _ = tx.send(info);
                        }
                        None => {
                            table.orphans_reaped += 1;
                            tracing::debug!(pid, "reaped an orphan");
                        }
                    }
                }
            }
        }
    }
}

impl ChildStatus {
    /// The exit status if the child has ended, without blocking.
    pub fn try_wait(&self) -> Result<Option<ExitInfo>, ReaperError> {
        match self {
            ChildStatus::Own(pid) => loop {
                match waitpid(*pid, Some(WaitPidFlag::WNOHANG)) {
                    Ok(status) => return Ok(exit_info(status).map(|(_, info)| info)),
                    Err(Errno::EINTR) => {}
                    Err(source) => {
                        return Err(ReaperError::Wait {
                            pid: pid.as_raw(),
                            source,
                        })
                    }
                }
            },
            ChildStatus::Reaped(rx) => match rx.try_recv() {
                Ok(info) => Ok(Some(info)),
                Err(mpsc::TryRecvError::Empty) => Ok(None),
                Err(mpsc::TryRecvError::Disconnected) => Err(ReaperError::ReaperGone),
            },
        }
    }

    /// The exit status, waiting up to `timeout` for it.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<Option<ExitInfo>, ReaperError> {
        match self {
            ChildStatus::Own(_) => {
                // waitpid has no timeout; poll in small steps.
                let step = Duration::from_millis(5);
                let deadline = std::time::Instant::now() + timeout;
                loop {
                    if let Some(info) = self.try_wait()? {
                        return Ok(Some(info));
                    }
                    if std::time::Instant::now() >= deadline {
                        return Ok(None);
                    }
                    std::thread::sleep(step);
                }
            }
            ChildStatus::Reaped(rx) => match rx.recv_timeout(timeout) {
                Ok(info) => Ok(Some(info)),
                Err(RecvTimeoutError::Timeout) => Ok(None),
                Err(RecvTimeoutError::Disconnected) => Err(ReaperError::ReaperGone),
            },
        }
    }
}

/// The pid and ending of a wait status, for statuses that mean the child is gone.
fn exit_info(status: WaitStatus) -> Option<(i32, ExitInfo)> {
    match status {
        WaitStatus::Exited(pid, code) => Some((
            pid.as_raw(),
            ExitInfo {
                code: Some(code),
                signal: None,
                timed_out: false,
            },
        )),
        WaitStatus::Signaled(pid, sig, _) => Some((
            pid.as_raw(),
            ExitInfo {
                code: None,
                signal: Some(sig as i32),
                timed_out: false,
            },
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_child_reports_exit_code_and_signal() {
        let reaper = Reaper::per_child();
        let (_child, status) = reaper
            .spawn(Command::new("sh").args(["-c", "exit 7"]))
            .unwrap();
        let info = status
            .wait_timeout(Duration::from_secs(10))
            .unwrap()
            .unwrap();
        assert_eq!(info.code, Some(7));

        let (child, status) = reaper.spawn(Command::new("sleep").arg("30")).unwrap();
        assert_eq!(status.try_wait().unwrap(), None);
        nix::sys::signal::kill(Pid::from_raw(child.id() as i32), nix::sys::signal::SIGTERM)
            .unwrap();
        let info = status
            .wait_timeout(Duration::from_secs(10))
            .unwrap()
            .unwrap();
        assert_eq!(info.signal, Some(libc::SIGTERM));
    }

    #[test]
    fn spawn_failure_is_an_error() {
        let err = Reaper::per_child()
            .spawn(&mut Command::new("/nonexistent/program"))
            .err()
            .unwrap();
        assert!(matches!(err, ReaperError::Spawn(_)));
    }
}
