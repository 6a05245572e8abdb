//! Making a finished snapshot durable off the request path (see
//! [`cube_storage::durable_marker`]).

use std::path::PathBuf;

use cube_storage::durable_marker::{boot_id, make_durable};

/// Syncs a finished snapshot to disk and marks it durable, off the request path.
pub fn flush_in_background(dir: PathBuf) -> Option<std::thread::JoinHandle<()>> {
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
