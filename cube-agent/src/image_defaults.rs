//! What a container image asks of its processes (its config's Env, WorkingDir and
//! User), for a VM built from one: the template build writes them into the guest's
//! image at [`IMAGE_DEFAULTS_PATH`], and the agent, starting as the guest's init, takes
//! them as the environment, working directory and user every exec and code run starts
//! from (a jail's agent gets the first two from the host as its own environment and
//! directory instead; a jail's processes all run as the sandbox's own uid).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::protocol::UserSpec;

/// Where the defaults lie in a VM's image, from its root.
pub const IMAGE_DEFAULTS_PATH: &str = "/.cube/process.json";

/// The most bytes the file may hold: it is read by PID 1 before anything else runs.
const MAX_BYTES: u64 = 1 << 20;

/// Why the image's defaults could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum ImageDefaultsError {
    /// The file could not be read.
    #[error("reading {0}")]
    Read(String, #[source] std::io::Error),
    /// The file is larger than [`MAX_BYTES`].
    #[error("{0} holds {1} bytes, more than process defaults can")]
    TooLarge(String, u64),
    /// The file is not the JSON the template build writes.
    #[error("{0} is malformed")]
    Malformed(String, #[source] serde_json::Error),
    /// A variable name is empty or holds `=` or NUL, or a value holds NUL.
    #[error("{0} names a bad environment variable {1:?}")]
    BadVariable(String, String),
    /// The working directory is not absolute, or cannot be entered.
    #[error("the image's working directory {0:?} cannot be entered")]
    WorkingDir(String, #[source] std::io::Error),
}

/// A container image's defaults for its processes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageDefaults {
    /// Environment variables, in order; a later one replaces an earlier of its name.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// The working directory, absolute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// The user execs and code runs that name none run as, resolved to numbers by the
    /// build against the image's own /etc/passwd and /etc/group; root when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<UserSpec>,
}

impl ImageDefaults {
    /// Reads the defaults at `path`; None where the image has none (no file).
    pub fn load(path: &Path) -> Result<Option<ImageDefaults>, ImageDefaultsError> {
        let name = path.display().to_string();
        let len = match std::fs::metadata(path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(ImageDefaultsError::Read(name, e)),
        };
        if len > MAX_BYTES {
            return Err(ImageDefaultsError::TooLarge(name, len));
        }
        let bytes = std::fs::read(path).map_err(|e| ImageDefaultsError::Read(name.clone(), e))?;
        let defaults: ImageDefaults = serde_json::from_slice(&bytes)
            .map_err(|e| ImageDefaultsError::Malformed(name.clone(), e))?;
        for (key, value) in &defaults.env {
            if key.is_empty() || key.contains(['=', '\0']) || value.contains('\0') {
                return Err(ImageDefaultsError::BadVariable(name, key.clone()));
            }
        }
        Ok(Some(defaults))
    }

    /// `env` (the agent's own environment) with the image's variables over it.
    pub fn environment(&self, mut env: Vec<(String, String)>) -> Vec<(String, String)> {
        for (key, value) in &self.env {
            match env.iter_mut().find(|(k, _)| k == key) {
                Some(slot) => slot.1 = value.clone(),
                None => env.push((key.clone(), value.clone())),
            }
        }
        env
    }

    /// Makes the image's working directory this process's, which every exec and code
    /// run that names none inherits.
    pub fn enter_working_dir(&self) -> Result<(), ImageDefaultsError> {
        let Some(cwd) = &self.cwd else {
            return Ok(());
        };
        if !cwd.starts_with('/') {
            return Err(ImageDefaultsError::WorkingDir(
                cwd.clone(),
                std::io::Error::from(std::io::ErrorKind::InvalidInput),
            ));
        }
        std::env::set_current_dir(cwd).map_err(|e| ImageDefaultsError::WorkingDir(cwd.clone(), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, text: &str) -> std::path::PathBuf {
        let path = dir.join("process.json");
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn the_images_variables_go_over_the_agents_and_a_missing_file_is_none() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            ImageDefaults::load(&dir.path().join("absent")).unwrap(),
            None
        );
        let path = write(
            dir.path(),
            r#"{"env":[["PATH","/app/bin"],["GREETING","hi there"]],"cwd":"/app","user":{"uid":1000,"gid":100}}"#,
        );
        let defaults = ImageDefaults::load(&path).unwrap().unwrap();
        assert_eq!(defaults.cwd.as_deref(), Some("/app"));
        assert_eq!(
            defaults.user,
            Some(UserSpec {
                uid: 1000,
                gid: 100
            })
        );
        let env = defaults.environment(vec![
            ("PATH".into(), "/bin".into()),
            ("HOME".into(), "/".into()),
        ]);
        assert_eq!(
            env,
            [
                ("PATH".into(), "/app/bin".into()),
                ("HOME".into(), "/".into()),
                ("GREETING".into(), "hi there".into())
            ]
        );
    }

    #[test]
    fn malformed_or_dangerous_files_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        for (text, expected) in [
            ("{ not json", "is malformed"),
            (r#"{"env":[["A=B","c"]]}"#, "bad environment variable"),
            (r#"{"env":[["","c"]]}"#, "bad environment variable"),
            (r#"{"env":[["A","c\u0000d"]]}"#, "bad environment variable"),
        ] {
            let path = write(dir.path(), text);
            let err = ImageDefaults::load(&path).unwrap_err().to_string();
            assert!(
                err.contains(expected) && err.contains("process.json"),
                "{text}: {err}"
            );
        }
        let relative = ImageDefaults {
            env: Vec::new(),
            cwd: Some("app".into()),
            user: None,
        };
        assert!(relative.enter_working_dir().is_err());
    }
}
