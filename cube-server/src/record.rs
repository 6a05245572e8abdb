//! What the service remembers of each sandbox beyond what Cube's store holds: its end
//! time, what happens then, its access tokens, how it was paused. One JSON file per
//! sandbox under `<store>/serve/`, readable by root only (it holds the tokens), written
//! by rename so a crash of the server never leaves half a record; a restarted
//! `cube serve` reads them back and keeps every deadline.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What happens to a sandbox at its end time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnTimeout {
    /// It is destroyed.
    #[default]
    Kill,
    /// It is paused (and connect resumes it).
    Pause,
}

/// How a paused sandbox was paused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseKind {
    /// Processes frozen in memory.
    Frozen,
    /// State written out, memory released.
    Hibernated,
}

/// One sandbox's record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The Cube sandbox id.
    pub id: String,
    /// The template (or snapshot) as the client named it.
    pub template: String,
    /// When it was created, ms since the Unix epoch.
    pub started_ms: u64,
    /// When it ends (or pauses), ms since the Unix epoch.
    pub end_ms: u64,
    /// The token its envd traffic must carry (`X-Access-Token`).
    pub envd_token: String,
    /// The token other ports' traffic may carry instead (`E2B-Traffic-Access-Token`).
    pub traffic_token: String,
    /// What happens at the end time.
    pub on_timeout: OnTimeout,
    /// Whether traffic to a paused sandbox resumes it.
    #[serde(default)]
    pub auto_resume: bool,
    /// Set while paused.
    #[serde(default)]
    pub paused: Option<PauseKind>,
    /// The client's metadata.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// The memory limit asked for, MiB (0: none).
    #[serde(default)]
    pub memory_mib: u64,
    /// Whether it has a network.
    #[serde(default)]
    pub networked: bool,
    /// Code contexts made through `/contexts`: id -> (language, cwd).
    #[serde(default)]
    pub contexts: BTreeMap<String, (String, String)>,
}

/// Why a record could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// A file operation failed.
    #[error("{0}")]
    Io(String, #[source] std::io::Error),
    /// A record file is damaged.
    #[error("Record {0} is damaged")]
    Damaged(PathBuf, #[source] serde_json::Error),
}

/// The directory of records.
#[derive(Clone, Debug)]
pub struct RecordStore {
    dir: PathBuf,
}

impl RecordStore {
    /// Opens (making it, root-only) the directory of records under `store_root`.
    pub fn open(store_root: &Path) -> Result<RecordStore, RecordError> {
        let dir = store_root.join("serve");
        std::fs::create_dir_all(&dir)
            .map_err(|e| RecordError::Io(format!("Creating {}", dir.display()), e))?;
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| RecordError::Io(format!("Securing {}", dir.display()), e))?;
        Ok(RecordStore { dir })
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Writes a record (atomically, mode 0600).
    pub fn save(&self, record: &Record) -> Result<(), RecordError> {
        let path = self.path(&record.id);
        let tmp = self.dir.join(format!(".{}.tmp", record.id));
        let data =
            serde_json::to_vec_pretty(record).map_err(|e| RecordError::Damaged(path.clone(), e))?;
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&data)?;
            // No sync: a sandbox does not outlive a host restart (its supervisor does
            // not), so neither need its record; the rename alone keeps a crash of the
            // server from leaving half a record, and keeps fsync off the create path.
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| RecordError::Io(format!("Writing {}", path.display()), e))
    }

    /// Removes a record (gone already is fine).
    pub fn remove(&self, id: &str) -> Result<(), RecordError> {
        let path = self.path(id);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RecordError::Io(format!("Removing {}", path.display()), e)),
        }
    }

    /// Every record; damaged ones are reported and skipped.
    pub fn load_all(&self) -> Result<Vec<Record>, RecordError> {
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| RecordError::Io(format!("Listing {}", self.dir.display()), e))?;
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || !name.ends_with(".json") {
                continue;
            }
            let parsed = std::fs::read(&path)
                .map_err(|e| RecordError::Io(format!("Reading {}", path.display()), e))
                .and_then(|data| {
                    serde_json::from_slice::<Record>(&data)
                        .map_err(|e| RecordError::Damaged(path.clone(), e))
                });
            match parsed {
                Ok(r) => out.push(r),
                Err(e) => {
                    tracing::warn!(error = %crate::error::error_chain(&e), "skipping a sandbox record")
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_stay_private() {
        let dir = tempfile::tempdir().unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        let record = Record {
            id: "sb-0123456789abcdef".into(),
            template: "base".into(),
            started_ms: 1,
            end_ms: 2,
            envd_token: "t".into(),
            traffic_token: "u".into(),
            on_timeout: OnTimeout::Pause,
            auto_resume: false,
            paused: Some(PauseKind::Hibernated),
            metadata: [("a".to_string(), "b".to_string())].into(),
            memory_mib: 0,
            networked: false,
            contexts: BTreeMap::new(),
        };
        store.save(&record).unwrap();
        std::fs::write(dir.path().join("serve/broken.json"), b"{").unwrap();
        assert_eq!(store.load_all().unwrap(), vec![record.clone()]);
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.path().join("serve/sb-0123456789abcdef.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        store.remove(&record.id).unwrap();
        store.remove(&record.id).unwrap();
        assert!(store.load_all().unwrap().is_empty());
    }
}
