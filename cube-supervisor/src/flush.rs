//! Making a finished snapshot durable off the request path (see
//! [`cube_storage::durable_marker`]).

use std::path::PathBuf;
use std::thread::JoinHandle;

use cube_storage::durable_marker::{boot_id, make_durable};

/// The background flushes of the snapshots (and hibernation images) one sandbox
/// wrote: joined before its files go, since a flush still writing into a snapshot
/// directory would race its removal.
#[derive(Default)]
pub struct Flushes(Vec<JoinHandle<()>>);

impl Flushes {
    /// Syncs the finished snapshot `dir` to disk and marks it durable, off the
    /// request path; forgets flushes that have finished.
    pub fn start(&mut self, dir: PathBuf) {
        self.0.retain(|f| !f.is_finished());
        self.0.extend(flush_in_background(dir));
    }

    /// Waits for every flush still under way.
    pub fn join(&mut self) {
        for flush in std::mem::take(&mut self.0) {
            let _ = flush.join();
        }
    }
}

/// The nice value of a flush thread: the requests of this and other sandboxes (a
/// rollback right after the snapshot, a clone of it) should win the CPU from it, as
/// its work is off their path.
const FLUSH_NICE: i32 = 19;

/// Sets the calling thread's nice value to [`FLUSH_NICE`] (a thread's nice value is
/// its own on Linux).
fn lower_own_priority() {
    // SAFETY: gettid and setpriority take and return integers only.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, FLUSH_NICE);
    }
}

fn flush_in_background(dir: PathBuf) -> Option<JoinHandle<()>> {
    let boot = match boot_id() {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!("snapshot {} stays unflushed: {e}", dir.display());
            return None;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("flush".into())
        .spawn(move || {
            lower_own_priority();
            if let Err(e) = make_durable(&dir, &boot) {
                tracing::warn!("flushing snapshot {}: {e}", dir.display());
            }
        });
    match spawned {
        Ok(handle) => Some(handle),
        Err(e) => {
            tracing::warn!("cannot start a flush thread: {e}");
            None
        }
    }
}
