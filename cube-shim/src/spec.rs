//! What the shim reads of an OCI runtime spec (the bundle's `config.json`, and the
//! process spec of an exec): the process, the network namespace, the resource limits,
//! and the annotations the CRI plugin and Cube's users set.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use cube_core::network::NetnsChoice;
use cube_core::{EngineChoice, LimitChange};
use serde::Deserialize;

use crate::resources::{Resources, ResourcesError};

/// Annotation the CRI plugin sets on every container: `sandbox` for a pod's pause
/// container, `container` for the others.
pub const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
/// Annotation the CRI plugin sets on every container: its pod's sandbox id.
pub const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
/// Annotation (pod or container) choosing Cube's engine: `auto`, `jail` or `vm`.
pub const ENGINE: &str = "io.cubesandbox.engine";
/// Annotation (pod or container) naming a Cube snapshot to start the container from:
/// a clone of a warm sandbox, in the node's store.
pub const SNAPSHOT: &str = "io.cubesandbox.snapshot";

/// Why a spec could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The file could not be read.
    #[error("Reading {0}")]
    Read(PathBuf, #[source] std::io::Error),
    /// The JSON is not an OCI spec.
    #[error("Parsing the OCI spec")]
    Json(#[from] serde_json::Error),
    /// The spec has no process to run.
    #[error("The OCI spec has no process")]
    NoProcess,
    /// The engine annotation names no engine.
    #[error("Annotation {ENGINE}: {0}")]
    Engine(String),
    /// `linux.resources` cannot be honoured.
    #[error("linux.resources: {0}")]
    Resources(#[from] ResourcesError),
}

/// The parts of a runtime spec the shim uses.
#[derive(Debug, Default, Deserialize)]
pub struct Spec {
    /// The container's process.
    #[serde(default)]
    pub process: Option<ProcessSpec>,
    /// Annotations.
    #[serde(default)]
    pub annotations: HashMap<String, String>,
    /// Linux specifics.
    #[serde(default)]
    pub linux: Option<Linux>,
    /// Mounts to make in the container's root.
    #[serde(default)]
    pub mounts: Vec<MountSpec>,
}

/// One entry of the spec's `mounts`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct MountSpec {
    /// Where, in the container.
    pub destination: String,
    /// The filesystem type (`bind`, `proc`, `tmpfs`...); may be empty for a bind.
    #[serde(rename = "type", default)]
    pub kind: String,
    /// What: a host path for a bind.
    #[serde(default)]
    pub source: String,
    /// Mount options (`rbind`, `ro`, ...).
    #[serde(default)]
    pub options: Vec<String>,
}

impl MountSpec {
    /// Whether it binds a host path (`type: bind`, or a `bind`/`rbind` option).
    pub fn is_bind(&self) -> bool {
        self.kind == "bind" || self.options.iter().any(|o| o == "bind" || o == "rbind")
    }

    /// Whether it is read-only.
    pub fn read_only(&self) -> bool {
        self.options.iter().any(|o| o == "ro")
    }

    /// Whether the destination lies in what the sandbox provides itself (`/proc`,
    /// `/dev`, `/sys`): the sandbox's own take their place.
    pub fn under_sandbox_filesystems(&self) -> bool {
        let dest = std::path::Path::new(&self.destination);
        ["/proc", "/dev", "/sys"]
            .iter()
            .any(|p| dest.starts_with(p))
    }
}

/// A process to run.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ProcessSpec {
    /// Program and arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// `KEY=VALUE` entries.
    #[serde(default)]
    pub env: Vec<String>,
    /// Working directory.
    #[serde(default)]
    pub cwd: String,
    /// Whether it wants a terminal.
    #[serde(default)]
    pub terminal: bool,
    /// Who it runs as (the image's `User`, or the pod's `runAsUser`).
    #[serde(default)]
    pub user: Option<User>,
}

/// A process's user, as numbers (`additionalGids` are not carried over).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct User {
    /// User id.
    #[serde(default)]
    pub uid: u32,
    /// Group id.
    #[serde(default)]
    pub gid: u32,
}

/// Linux specifics.
#[derive(Debug, Default, Deserialize)]
pub struct Linux {
    /// Namespaces to create or join.
    #[serde(default)]
    pub namespaces: Vec<Namespace>,
    /// Resource limits.
    #[serde(default)]
    pub resources: Option<Resources>,
}

/// One namespace entry.
#[derive(Debug, Default, Deserialize)]
pub struct Namespace {
    /// `network`, `pid`, `mount`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// A namespace to join; none: create one.
    #[serde(default)]
    pub path: Option<String>,
}

impl Spec {
    /// Reads `<bundle>/config.json`.
    pub fn read(bundle: &Path) -> Result<Spec, SpecError> {
        let path = bundle.join("config.json");
        let bytes = std::fs::read(&path).map_err(|e| SpecError::Read(path, e))?;
        Ok(serde_json::from_slice(&bytes)?)
    }

    /// Whether this is a pod's pause container, which Cube absorbs: it runs nothing.
    pub fn is_pod_sandbox(&self) -> bool {
        self.annotations.get(CONTAINER_TYPE).map(String::as_str) == Some("sandbox")
    }

    /// The pod this container belongs to, as the CRI plugin names it.
    pub fn pod(&self) -> Option<&str> {
        self.annotations.get(SANDBOX_ID).map(String::as_str)
    }

    /// The network namespace: the one a `network` entry names (a pod's, made by CNI),
    /// a new one for an entry without a path, the host's where there is no entry
    /// (`hostNetwork` pods).
    pub fn netns(&self) -> NetnsChoice {
        let entry = self
            .linux
            .as_ref()
            .and_then(|l| l.namespaces.iter().find(|n| n.kind == "network"));
        match entry {
            None => NetnsChoice::Host,
            Some(Namespace {
                path: Some(path), ..
            }) if !path.is_empty() => NetnsChoice::Join(PathBuf::from(path)),
            Some(_) => NetnsChoice::Own,
        }
    }

    /// The engine the annotations ask for (`auto` without one).
    pub fn engine(&self) -> Result<EngineChoice, SpecError> {
        match self.annotations.get(ENGINE) {
            None => Ok(EngineChoice::Auto),
            Some(name) => name.parse().map_err(SpecError::Engine),
        }
    }

    /// The Cube snapshot the annotations ask the container to start from.
    pub fn snapshot(&self) -> Option<&str> {
        self.annotations.get(SNAPSHOT).map(String::as_str)
    }

    /// The host paths to bind into the container's root: volumes, and the kubelet's
    /// `/etc/hosts`, `/etc/hostname` and `/etc/resolv.conf` (not those under `/proc`,
    /// `/dev` and `/sys`, which the sandbox provides).
    pub fn binds(&self) -> impl Iterator<Item = &MountSpec> {
        self.mounts
            .iter()
            .filter(|m| m.is_bind() && !m.under_sandbox_filesystems())
    }

    /// The limits `linux.resources` asks for (see [`Resources::limits`]).
    pub fn limits(&self) -> Result<LimitChange, SpecError> {
        match self.linux.as_ref().and_then(|l| l.resources.as_ref()) {
            Some(resources) => Ok(resources.limits()?),
            None => Ok(LimitChange::default()),
        }
    }

    /// The container's process.
    pub fn process(&self) -> Result<&ProcessSpec, SpecError> {
        self.process.as_ref().ok_or(SpecError::NoProcess)
    }
}

impl ProcessSpec {
    /// Parses an exec's process spec (JSON, as containerd passes it).
    pub fn from_json(bytes: &[u8]) -> Result<ProcessSpec, SpecError> {
        Ok(serde_json::from_slice(bytes)?)
    }

    /// The environment as pairs; entries without `=` are skipped.
    pub fn env_pairs(&self) -> Vec<(String, String)> {
        self.env
            .iter()
            .filter_map(|e| e.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cri_pod_container_is_read() {
        let spec: Spec = serde_json::from_str(
            r#"{"ociVersion":"1.0.2","process":{"args":["sh","-c","echo hi"],"env":["A=1","PATH=/bin","BAD"],"cwd":"/"},
                "annotations":{"io.kubernetes.cri.container-type":"container","io.kubernetes.cri.sandbox-id":"p1","io.cubesandbox.engine":"jail"},
                "linux":{"namespaces":[{"type":"pid"},{"type":"network","path":"/var/run/netns/cni-1"}]}}"#,
        )
        .unwrap();
        assert!(!spec.is_pod_sandbox());
        assert_eq!(spec.pod(), Some("p1"));
        assert_eq!(
            spec.netns(),
            NetnsChoice::Join("/var/run/netns/cni-1".into())
        );
        assert_eq!(spec.engine().unwrap(), EngineChoice::Jail);
        let p = spec.process().unwrap();
        assert_eq!(
            p.env_pairs(),
            vec![("A".into(), "1".into()), ("PATH".into(), "/bin".into())]
        );
    }

    #[test]
    fn binds_are_the_host_paths_outside_proc_dev_and_sys() {
        let spec: Spec = serde_json::from_str(
            r#"{"mounts":[
                {"destination":"/proc","type":"proc","source":"proc"},
                {"destination":"/dev/shm","type":"bind","source":"/run/s/shm","options":["rbind","ro"]},
                {"destination":"/etc/hosts","type":"bind","source":"/run/s/hosts","options":["rbind","rprivate","rw"]},
                {"destination":"/data","source":"/srv/vol","options":["rbind","ro"]},
                {"destination":"/run","type":"tmpfs","source":"tmpfs"}]}"#,
        )
        .unwrap();
        let binds: Vec<_> = spec
            .binds()
            .map(|m| (m.destination.as_str(), m.read_only()))
            .collect();
        assert_eq!(binds, vec![("/etc/hosts", false), ("/data", true)]);
    }

    #[test]
    fn host_and_own_network_namespaces() {
        let host: Spec =
            serde_json::from_str(r#"{"linux":{"namespaces":[{"type":"pid"}]}}"#).unwrap();
        assert_eq!(host.netns(), NetnsChoice::Host);
        let own: Spec =
            serde_json::from_str(r#"{"linux":{"namespaces":[{"type":"network"}]}}"#).unwrap();
        assert_eq!(own.netns(), NetnsChoice::Own);
        let bad: Spec =
            serde_json::from_str(r#"{"annotations":{"io.cubesandbox.engine":"qemu"}}"#).unwrap();
        assert!(bad.engine().is_err());
    }
}
