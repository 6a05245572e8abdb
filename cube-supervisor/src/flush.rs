//! Making a finished snapshot durable off the request path (see
//! [`cube_storage::durable_marker`]).

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::thread::JoinHandle;

use cube_storage::durable_marker::{boot_id, make_durable, make_durable_through, PendingFlush};

/// The store's areas a snapshot of this process's sandbox may be moved into (its
/// snapshots, its templates), opened before the supervisor was confined: a flush
/// syncs the directory that names a snapshot, which a confined VM supervisor may no
/// longer open (the templates not at all). Listing one through its descriptor shows
/// names only: opening what it holds is still checked against the confinement.
static STORE_AREAS: OnceLock<Vec<(PathBuf, File)>> = OnceLock::new();

/// Opens the areas of the store holding `sandbox_dir` for later flushes, before the
/// supervisor is confined; nothing for a directory outside a store's layout. An area
/// that cannot be opened is left out (its snapshots' flushes then say why they
/// failed).
pub fn hold_store_areas(sandbox_dir: &Path) {
    let Some(root) = crate::confinement::filesystem::store_root_of(sandbox_dir) else {
        return;
    };
    let areas = cube_storage::Store::areas_at(root);
    let opened = [areas.snapshots, areas.templates]
        .into_iter()
        .filter_map(|area| {
            let dir = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&area);
            match dir {
                Ok(dir) => Some((area, dir)),
                Err(e) => {
                    tracing::warn!("opening {} for flushes: {e}", area.display());
                    None
                }
            }
        })
        .collect();
    let _ = STORE_AREAS.set(opened);
}

/// A descriptor of the directory `dest` is moved into, if it is an area held open
/// by [`hold_store_areas`].
pub fn held_area_of(dest: &Path) -> Option<File> {
    let parent = dest.parent()?;
    let (_, dir) = STORE_AREAS.get()?.iter().find(|(area, _)| area == parent)?;
    dir.try_clone().ok()
}

/// The background flushes of the snapshots (and hibernation images) one sandbox
/// wrote: joined before its files go, since a flush still writing into a snapshot
/// directory would race its removal.
#[derive(Default)]
pub struct Flushes(Vec<JoinHandle<()>>);

impl Flushes {
    /// Syncs the finished snapshot `dir` to disk and marks it durable through
    /// `staged` (its marker and files, opened while it was staged: the supervisor may
    /// not be able to open them where they now lie), off the request path; forgets
    /// flushes that have finished.
    pub fn start(&mut self, dir: PathBuf, staged: PendingFlush) {
        self.push(dir, Some(staged));
    }

    /// [`Flushes::start`] for a directory of this sandbox's own (a jail's
    /// hibernation checkpoint), where the marker is made when the flush is done.
    pub fn start_in_own_dir(&mut self, dir: PathBuf) {
        self.push(dir, None);
    }

    fn push(&mut self, dir: PathBuf, staged: Option<PendingFlush>) {
        self.0.retain(|f| !f.is_finished());
        self.0.extend(flush_in_background(dir, staged));
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

fn flush_in_background(dir: PathBuf, staged: Option<PendingFlush>) -> Option<JoinHandle<()>> {
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
            let flushed = match staged {
                Some(staged) => make_durable_through(&dir, &boot, staged),
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
