//! Directory watchers (envd's `WatchDir` stream and the `CreateWatcher` /
//! `GetWatcherEvents` / `RemoveWatcher` calls). The agent has no change notification,
//! so a watcher lists the directory every [`POLL`] and reports what differs: created,
//! written (size or modification time changed) and removed entries.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cube_agent::protocol::FileKind;

use super::connect::{Code, RpcError};
use super::proto::{event_type, FilesystemEvent};
use super::watchers::Watcher;
use crate::lock::lock;
use crate::service::{Entry, Service};

/// How often a watcher lists its directory.
pub const POLL: Duration = Duration::from_millis(250);

/// Watchers alive per sandbox at most.
const MAX_WATCHERS: usize = 64;

/// Depth listed for a recursive watch.
const RECURSIVE_DEPTH: u32 = 16;

/// Events a polling watcher keeps for `GetWatcherEvents` at most.
const MAX_QUEUED: usize = 10_000;

type Listing = HashMap<String, (FileKind, u64, i64)>;

/// Lists `dir` (to `RECURSIVE_DEPTH` levels when recursive) relative to it.
pub async fn list(
    service: &Arc<Service>,
    entry: &Arc<Entry>,
    dir: &str,
    recursive: bool,
) -> Result<Listing, RpcError> {
    let path = dir.to_string();
    let depth = if recursive { RECURSIVE_DEPTH } else { 1 };
    let infos = service
        .with_agent(entry, move |c| c.list_dir(&path, depth))
        .await
        .map_err(|e| super::process::rpc_from_api(&e))?;
    let prefix = format!("{}/", dir.trim_end_matches('/'));
    Ok(infos
        .into_iter()
        .map(|i| {
            let name = i.path.strip_prefix(&prefix).unwrap_or(&i.path).to_string();
            (name, (i.kind, i.size, i.modified_ns))
        })
        .collect())
}

/// The events that turn `before` into `after`.
pub fn diff(before: &Listing, after: &Listing) -> Vec<FilesystemEvent> {
    let mut events = Vec::new();
    for (name, now) in after {
        match before.get(name) {
            None => events.push((name.clone(), event_type::CREATE)),
            Some(then) if then != now && now.0 != FileKind::Dir => {
                events.push((name.clone(), event_type::WRITE))
            }
            _ => {}
        }
    }
    for name in before.keys() {
        if !after.contains_key(name) {
            events.push((name.clone(), event_type::REMOVE));
        }
    }
    events.sort();
    events
        .into_iter()
        .map(|(name, kind)| FilesystemEvent {
            name,
            kind,
            entry: None,
        })
        .collect()
}

/// Starts a polling watcher; returns its id.
pub async fn create(
    service: &Arc<Service>,
    entry: &Arc<Entry>,
    dir: String,
    recursive: bool,
) -> Result<String, RpcError> {
    if lock(&entry.watchers.map).len() >= MAX_WATCHERS {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("At most {MAX_WATCHERS} watchers per sandbox"),
        ));
    }
    let mut last = list(service, entry, &dir, recursive).await?;
    let id = crate::service::new_token().map_err(|e| super::process::rpc_from_api(&e))?;
    let watcher = Arc::new(Watcher {
        events: Mutex::new(Vec::new()),
        stop: Arc::new(AtomicBool::new(false)),
    });
    lock(&entry.watchers.map).insert(id.clone(), Arc::clone(&watcher));
    let (service, entry) = (Arc::clone(service), Arc::clone(entry));
    tokio::spawn(async move {
        while !watcher.stop.load(Ordering::SeqCst) {
            tokio::time::sleep(POLL).await;
            let Ok(now) = list(&service, &entry, &dir, recursive).await else {
                continue;
            };
            let new = diff(&last, &now);
            last = now;
            let mut queue = lock(&watcher.events);
            queue.extend(new);
            let excess = queue.len().saturating_sub(MAX_QUEUED);
            queue.drain(..excess);
        }
    });
    Ok(id)
}

/// Takes the events a watcher collected.
pub fn take(entry: &Entry, id: &str) -> Result<Vec<FilesystemEvent>, RpcError> {
    let map = lock(&entry.watchers.map);
    let w = map
        .get(id)
        .ok_or_else(|| RpcError::new(Code::NotFound, format!("No watcher {id}")))?;
    let events = std::mem::take(&mut *lock(&w.events));
    Ok(events)
}

/// Stops a watcher.
pub fn remove(entry: &Entry, id: &str) -> Result<(), RpcError> {
    let w = lock(&entry.watchers.map)
        .remove(id)
        .ok_or_else(|| RpcError::new(Code::NotFound, format!("No watcher {id}")))?;
    w.stop.store(true, Ordering::SeqCst);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diffs_name_created_written_and_removed_entries() {
        let before: Listing = [
            ("a".to_string(), (FileKind::File, 1, 1)),
            ("b".to_string(), (FileKind::File, 1, 1)),
            ("d".to_string(), (FileKind::Dir, 0, 1)),
        ]
        .into();
        let after: Listing = [
            ("a".to_string(), (FileKind::File, 2, 2)),
            ("c".to_string(), (FileKind::File, 1, 1)),
            ("d".to_string(), (FileKind::Dir, 0, 2)),
        ]
        .into();
        let got: Vec<(String, i32)> = diff(&before, &after)
            .into_iter()
            .map(|e| (e.name, e.kind))
            .collect();
        assert_eq!(
            got,
            [
                ("a".to_string(), event_type::WRITE),
                ("b".to_string(), event_type::REMOVE),
                ("c".to_string(), event_type::CREATE)
            ]
        );
    }
}
