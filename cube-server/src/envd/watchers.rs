//! The directory watchers one sandbox has open (see [`super::watch`] for what they do):
//! kept with the sandbox's entry so that ending the sandbox stops them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::proto::FilesystemEvent;
use crate::lock::lock;

/// One polling watcher whose events are collected until fetched.
pub(crate) struct Watcher {
    pub(crate) events: Mutex<Vec<FilesystemEvent>>,
    pub(crate) stop: Arc<AtomicBool>,
}

/// The polling watchers of one sandbox, by id.
#[derive(Default)]
pub struct Watchers {
    pub(crate) map: Mutex<HashMap<String, Arc<Watcher>>>,
}

impl Watchers {
    /// Stops and forgets every watcher.
    pub fn clear(&self) {
        for (_, w) in lock(&self.map).drain() {
            w.stop.store(true, Ordering::SeqCst);
        }
    }
}
