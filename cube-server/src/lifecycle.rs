//! End times: a task wakes every [`TICK`] and kills (or pauses, where the create asked
//! for auto-pause) each running sandbox whose end time has passed. End times live in
//! the records, so they survive a restart of the server.

use std::sync::Arc;
use std::time::Duration;

use crate::lock::lock;
use crate::record::OnTimeout;
use crate::service::{now_ms, Service};

/// How often end times are checked.
pub const TICK: Duration = Duration::from_millis(250);

/// Runs until the process ends.
pub async fn reap(service: Arc<Service>) {
    loop {
        tokio::time::sleep(TICK).await;
        let now = now_ms();
        for entry in service.all() {
            let (due, action) = {
                let r = lock(&entry.record);
                (r.paused.is_none() && r.end_ms <= now, r.on_timeout)
            };
            if !due {
                continue;
            }
            // The entry is busy from now on; the next tick sees its new state.
            lock(&entry.record).end_ms = u64::MAX;
            let service = Arc::clone(&service);
            tokio::spawn(async move {
                let result = match action {
                    OnTimeout::Kill => crate::control::kill_entry(&service, &entry).await,
                    OnTimeout::Pause => crate::control::pause_entry(&service, &entry)
                        .await
                        .map(drop),
                };
                match result {
                    Ok(()) => {
                        service.metrics.timed_out(action == OnTimeout::Pause);
                        tracing::info!(sandbox = %entry.id, ?action, "end time reached");
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %entry.id, error = %e.message, "end time reached; acting on it failed");
                        // Not again at every tick: try once more a little later.
                        lock(&entry.record).end_ms = now_ms() + 5_000;
                    }
                }
            });
        }
    }
}
