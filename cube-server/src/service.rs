//! The service's state: the Cube runtime, the sandboxes it serves (their records,
//! agent connections, running commands and code contexts), token lookup, limits.
//!
//! Every call into cube-core blocks (it talks to supervisor processes), so it runs on
//! tokio's blocking pool ([`Service::blocking`]), never on the async threads.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cube_agent::client::Client;
use cube_core::{Runtime, RuntimeConfig, SandboxError};
use subtle::ConstantTimeEq as _;

use crate::config::{PauseMode, ServeConfig};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::record::{PauseKind, Record, RecordStore};

use crate::lock::lock;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A fresh random token (32 hex digits).
pub fn new_token() -> Result<String, ApiError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)
        .map_err(|e| ApiError::internal(format!("No randomness for a token: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// One served sandbox.
pub struct Entry {
    /// Its Cube id.
    pub id: String,
    /// Its record (persisted on every change through [`Service::save`]).
    pub record: Mutex<Record>,
    /// Serialises lifecycle operations (pause, resume, snapshot, kill) on it.
    pub op: tokio::sync::Mutex<()>,
    /// The agent connection the service shares for it (reconnected when it drops).
    agent: Mutex<Option<Arc<Client>>>,
    /// Commands started through envd's Process service.
    pub processes: Arc<crate::envd::process::ProcessTable>,
    /// The last CPU sample: (when, CPU ns).
    pub cpu_sample: Mutex<Option<(std::time::Instant, u64)>>,
    /// Cells run per code context (the SDKs' execution count).
    pub executions: Mutex<HashMap<String, u64>>,
    /// Directory watchers made through envd's Filesystem service.
    pub watchers: crate::envd::watchers::Watchers,
}

impl Entry {
    fn new(record: Record) -> Arc<Entry> {
        Arc::new(Entry {
            id: record.id.clone(),
            record: Mutex::new(record),
            op: tokio::sync::Mutex::new(()),
            agent: Mutex::new(None),
            processes: Default::default(),
            cpu_sample: Mutex::new(None),
            executions: Mutex::new(HashMap::new()),
            watchers: Default::default(),
        })
    }

    /// A copy of the record.
    pub fn snapshot(&self) -> Record {
        lock(&self.record).clone()
    }

    /// Whether it is paused.
    pub fn is_paused(&self) -> bool {
        lock(&self.record).paused.is_some()
    }

    /// Forgets the agent connection and every command on it (after a pause, a
    /// full-state snapshot or a rollback ended them).
    pub fn drop_connections(&self, why: &str) {
        lock(&self.agent).take();
        self.processes.end_all(why);
        self.watchers.clear();
    }
}

/// The service.
pub struct Service {
    /// The settings in force.
    pub config: ServeConfig,
    /// The Cube runtime.
    pub rt: Arc<Runtime>,
    records: RecordStore,
    entries: RwLock<HashMap<String, Arc<Entry>>>,
    creates: Arc<tokio::sync::Semaphore>,
    /// Counters for `/metrics`.
    pub metrics: Metrics,
    /// Whether pause hibernates (full-state checkpoints work here) or freezes.
    pub pause_hibernates: bool,
}

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The Cube runtime could not be opened.
    #[error("Opening the Cube runtime")]
    Runtime(#[source] SandboxError),
    /// The records could not be read.
    #[error("Reading the sandbox records")]
    Records(#[source] crate::record::RecordError),
}

impl Service {
    /// Opens the runtime and reattaches to the sandboxes the records name: those whose
    /// supervisor is gone are forgotten, the others keep their deadlines.
    pub fn open(config: ServeConfig) -> Result<Arc<Service>, StartError> {
        let mut rt_config = RuntimeConfig::new().map_err(StartError::Runtime)?;
        if let Some(store) = &config.store {
            rt_config.store_root = store.clone();
        }
        rt_config.pool_size = config.pool_size;
        rt_config.network_pool_size = 0;
        let rt = Runtime::open(rt_config).map_err(StartError::Runtime)?;
        let records = RecordStore::open(rt.store().root()).map_err(StartError::Records)?;
        let pause_hibernates = match config.pause {
            PauseMode::Hibernate => true,
            PauseMode::Freeze => false,
            PauseMode::Auto => cube_core::host::criu_check(),
        };
        let service = Service {
            creates: Arc::new(tokio::sync::Semaphore::new(config.max_concurrent_creates)),
            config,
            rt: Arc::new(rt),
            records,
            entries: RwLock::new(HashMap::new()),
            metrics: Metrics::default(),
            pause_hibernates,
        };
        let known: std::collections::HashSet<String> = service
            .rt
            .list()
            .map_err(StartError::Runtime)?
            .into_iter()
            .map(|m| m.id)
            .collect();
        for record in service.records.load_all().map_err(StartError::Records)? {
            let alive = known.contains(&record.id) && service.rt.attach(&record.id).is_ok();
            if alive {
                tracing::info!(sandbox = %record.id, "reattached");
                service.insert(record);
            } else {
                tracing::info!(sandbox = %record.id, "its supervisor is gone; forgetting it");
                let _ = service.rt.remove_stale(&record.id);
                let _ = service.records.remove(&record.id);
            }
        }
        Ok(Arc::new(service))
    }

    /// Runs `f` on the blocking pool.
    pub async fn blocking<T, F>(&self, f: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce(&Runtime) -> Result<T, ApiError> + Send + 'static,
    {
        let rt = Arc::clone(&self.rt);
        tokio::task::spawn_blocking(move || f(&rt))
            .await
            .map_err(|e| ApiError::internal(format!("A worker failed: {e}")))?
    }

    /// Adds a sandbox to those served.
    pub fn insert(&self, record: Record) -> Arc<Entry> {
        let entry = Entry::new(record);
        self.entries
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(entry.id.clone(), Arc::clone(&entry));
        entry
    }

    /// Stops serving a sandbox and removes its record.
    pub fn forget(&self, id: &str) {
        let entry = self
            .entries
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
        if let Some(entry) = entry {
            entry.drop_connections("the sandbox was killed");
        }
        if let Err(e) = self.records.remove(id) {
            tracing::warn!(sandbox = id, error = %crate::error::error_chain(&e), "record not removed");
        }
    }

    /// Persists an entry's record.
    pub fn save(&self, entry: &Entry) -> Result<(), ApiError> {
        let record = entry.snapshot();
        self.records
            .save(&record)
            .map_err(|e| ApiError::internal(crate::error::error_chain(&e)))
    }

    /// The served sandbox with this Cube id.
    pub fn get(&self, id: &str) -> Option<Arc<Entry>> {
        self.entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    /// The served sandbox with this E2B id, or a 404.
    pub fn get_e2b(&self, e2b_id: &str) -> Result<Arc<Entry>, ApiError> {
        crate::ids::to_cube(e2b_id)
            .and_then(|id| self.get(&id))
            .ok_or_else(|| ApiError::not_found(format!("Sandbox {e2b_id} not found")))
    }

    /// Every served sandbox.
    pub fn all(&self) -> Vec<Arc<Entry>> {
        self.entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// The sandbox whose envd or traffic token this is (compared in constant time).
    pub fn by_token(&self, token: &str) -> Option<Arc<Entry>> {
        self.all().into_iter().find(|e| {
            let r = lock(&e.record);
            bool::from(r.envd_token.as_bytes().ct_eq(token.as_bytes()))
                || bool::from(r.traffic_token.as_bytes().ct_eq(token.as_bytes()))
        })
    }

    /// Whether `key` is one of the configured API keys (constant time per key).
    pub fn key_ok(&self, key: &str) -> bool {
        let mut ok = subtle::Choice::from(0u8);
        for k in &self.config.api_keys {
            ok |= k.as_bytes().ct_eq(key.as_bytes());
        }
        ok.into()
    }

    /// A permit to create, or a 429 when as many creates as allowed are under way or
    /// as many sandboxes as allowed exist.
    pub fn create_permit(
        &self,
        count: usize,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
        let existing = self
            .entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len();
        if existing + count > self.config.max_sandboxes {
            return Err(ApiError::new(
                axum::http::StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "Sandbox limit reached: {existing} of {} exist; kill some first",
                    self.config.max_sandboxes
                ),
            ));
        }
        Arc::clone(&self.creates).try_acquire_owned().map_err(|_| {
            ApiError::new(
                axum::http::StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "{} creates are under way, the most this server runs at once; retry shortly",
                    self.config.max_concurrent_creates
                ),
            )
        })
    }

    /// The shared agent connection of a running sandbox (connected on first use, and
    /// again after the previous one dropped).
    pub async fn agent(&self, entry: &Arc<Entry>) -> Result<Arc<Client>, ApiError> {
        if entry.is_paused() {
            return Err(ApiError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                format!(
                    "Sandbox {} is paused: connect to it to resume it",
                    crate::ids::to_e2b(&entry.id)
                ),
            ));
        }
        if let Some(client) = lock(&entry.agent).clone() {
            return Ok(client);
        }
        let id = entry.id.clone();
        let client = self
            .blocking(move |rt| {
                let sb = rt.attach(&id)?;
                Ok(Arc::new(sb.agent()?))
            })
            .await?;
        let mut slot = lock(&entry.agent);
        Ok(Arc::clone(slot.get_or_insert(client)))
    }

    /// Runs a blocking call on the sandbox's agent; a connection that turns out to be
    /// dead (the sandbox was snapshotted or restored meanwhile) is replaced and the
    /// call tried once more.
    pub async fn with_agent<T, F>(&self, entry: &Arc<Entry>, f: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: Fn(&Client) -> Result<T, cube_agent::client::ClientError> + Send + Sync + 'static,
    {
        let f = Arc::new(f);
        for attempt in 0..2 {
            let client = self.agent(entry).await?;
            let call = Arc::clone(&f);
            let result = tokio::task::spawn_blocking(move || call(&client))
                .await
                .map_err(|e| ApiError::internal(format!("A worker failed: {e}")))?;
            match result {
                Err(
                    cube_agent::client::ClientError::Disconnected
                    | cube_agent::client::ClientError::Send(_),
                ) if attempt == 0 => {
                    lock(&entry.agent).take();
                }
                other => return other.map_err(|e| ApiError::from_agent(&e)),
            }
        }
        Err(ApiError::new(
            axum::http::StatusCode::BAD_GATEWAY,
            "The sandbox's agent is unreachable",
        ))
    }

    /// Forgets a dead agent connection so the next call reconnects.
    pub fn reset_agent(&self, entry: &Entry) {
        lock(&entry.agent).take();
    }

    /// How a pause is done on this server.
    pub fn pause_kind(&self) -> PauseKind {
        if self.pause_hibernates {
            PauseKind::Hibernated
        } else {
            PauseKind::Frozen
        }
    }

    /// The store's root.
    pub fn store_root(&self) -> PathBuf {
        self.rt.store().root().to_path_buf()
    }

    /// The timeout asked for, checked against the limits.
    pub fn timeout(&self, secs: Option<u64>) -> Result<Duration, ApiError> {
        let t = secs
            .map(Duration::from_secs)
            .unwrap_or(self.config.default_timeout);
        if t > self.config.max_timeout {
            return Err(ApiError::bad_request(format!(
                "Timeout {}s is longer than the {}s this server allows",
                t.as_secs(),
                self.config.max_timeout.as_secs()
            )));
        }
        Ok(t)
    }
}
