//! Making a finished snapshot durable off the request path (see
//! [`cube_storage::durable_marker`]).

use std::fs::File;
use std::path::PathBuf;
use std::thread::JoinHandle;

use cube_storage::durable_marker::{boot_id, make_durable, make_durable_through};

/// The background flushes of the snapshots (and hibernation images) one sandbox
/// wrote: joined before its files go, since a flush still writing into a snapshot
/// directory would race its removal.
#[derive(Default)]
pub struct Flushes(Vec<JoinHandle<()>>);

impl Flushes {
    /// Syncs the finished snapshot `dir` to disk and marks it durable through
    /// `marker` (made while it was staged: the supervisor may not be able to create
    /// files where it now lies), off the request path; forgets flushes that have
    /// finished.
    pub fn start(&mut self, dir: PathBuf, marker: File) {
        self.push(dir, Some(marker));
    }

    /// [`Flushes::start`] for a directory of this sandbox's own (a jail's
    /// hibernation checkpoint), where the marker is made when the flush is done.
    pub fn start_in_own_dir(&mut self, dir: PathBuf) {
        self.push(dir, None);
    }

    fn push(&mut self, dir: PathBuf, marker: Option<File>) {
        self.0.retain(|f| !f.is_finished());
        self.0.extend(flush_in_background(dir, marker));
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

fn flush_in_background(dir: PathBuf, marker: Option<File>) -> Option<JoinHandle<()>> {
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
            let flushed = match marker {
                Some(marker) => make_durable_through(&dir, &boot, marker),
                None => make_durable(&dir, &boot),
            };
            if let Err(e) = flushed {
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
