//! `cube serve`'s settings: the command line's (listen address, keys) over the config
//! file's (TOML: domain, templates, limits, lifecycle, TLS, admin port).
//!
//! ```toml
//! listen = "127.0.0.1:3000"
//! admin_listen = "127.0.0.1:3001"     # /metrics and the dashboard
//! domain = "cube.local"               # sandbox hosts: <port>-<sandboxID>.<domain>
//! api_key_file = "/etc/cube/api-keys" # one key a line
//! pause = "auto"                      # auto | hibernate | freeze
//! default_timeout_secs = 300
//! max_timeout_secs = 86400
//! max_sandboxes = 200
//! max_concurrent_creates = 16
//! max_upload_bytes = 1073741824
//!
//! [templates]                         # E2B template name -> Cube template
//! base = "host"
//! code-interpreter-v1 = "host"
//! python-data = "my-built-template"
//!
//! [tls]                               # the main listener serves HTTPS, or
//! # tls_listen = ["127.0.0.1:443"]    # (top level) these do, beside a plain `listen`
//! cert = "/etc/cube/tls/cert.pem"
//! key = "/etc/cube/tls/key.pem"
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Why the settings are unusable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("Reading {0}")]
    Read(PathBuf, #[source] std::io::Error),
    /// The config file is not valid TOML of the expected shape.
    #[error("Parsing {0}")]
    Parse(PathBuf, #[source] Box<toml::de::Error>),
    /// No API key was given anywhere.
    #[error("No API key: pass --api-key, set CUBE_API_KEY, or name a key file (api_key_file)")]
    NoKey,
    /// An API key is too short to be a secret.
    #[error("API keys must be at least 16 characters long")]
    ShortKey,
    /// A value is out of range.
    #[error("{0}")]
    Invalid(String),
}

/// What E2B's `pause` does to a sandbox.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseMode {
    /// `hibernate` where full-state (CRIU) snapshots work on this host, else `freeze`:
    /// either way a paused sandbox keeps its processes and memory state.
    #[default]
    Auto,
    /// Processes dumped to disk, memory released; connect restores them. Without a
    /// working CRIU the processes restart on the kept files instead.
    Hibernate,
    /// Processes frozen in memory (cgroup freezer, or stopped vCPUs); connect thaws.
    Freeze,
}

/// TLS certificate and key files (PEM).
#[derive(Clone, Debug, Deserialize)]
pub struct TlsFiles {
    /// The certificate chain.
    pub cert: PathBuf,
    /// The private key.
    pub key: PathBuf,
}

/// The config file's contents; every field may be left out.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Where the API and sandbox traffic are served.
    pub listen: Option<SocketAddr>,
    /// Where `/metrics` and the dashboard are served.
    pub admin_listen: Option<SocketAddr>,
    /// The domain of sandbox host names.
    pub domain: Option<String>,
    /// A file of API keys, one a line (`#` comments).
    pub api_key_file: Option<PathBuf>,
    /// API keys written in the config itself.
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// What `pause` does.
    pub pause: Option<PauseMode>,
    /// A create's timeout when it names none, seconds.
    pub default_timeout_secs: Option<u64>,
    /// The longest timeout a create or set_timeout may ask for, seconds.
    pub max_timeout_secs: Option<u64>,
    /// Sandboxes (running or paused) at most.
    pub max_sandboxes: Option<usize>,
    /// Creates (forks included) under way at most.
    pub max_concurrent_creates: Option<usize>,
    /// The largest file upload, bytes.
    pub max_upload_bytes: Option<u64>,
    /// Supervisors kept started for fast creates.
    pub pool_size: Option<usize>,
    /// E2B template names mapped to Cube templates.
    #[serde(default)]
    pub templates: BTreeMap<String, String>,
    /// TLS for the main listener.
    pub tls: Option<TlsFiles>,
    /// Further listeners that serve the same as the main one over TLS (e.g. port 443
    /// for `https://<port>-<sandboxID>.<domain>` while `listen` stays plain HTTP).
    #[serde(default)]
    pub tls_listen: Vec<SocketAddr>,
}

/// The settings in force.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Where the API and sandbox traffic are served.
    pub listen: SocketAddr,
    /// Where `/metrics` and the dashboard are served (None: not served).
    pub admin_listen: Option<SocketAddr>,
    /// The domain of sandbox host names and of the `domain` create answers carry.
    pub domain: String,
    /// Accepted API keys.
    pub api_keys: Vec<String>,
    /// What `pause` does.
    pub pause: PauseMode,
    /// A create's timeout when it names none.
    pub default_timeout: Duration,
    /// The longest timeout allowed.
    pub max_timeout: Duration,
    /// Sandboxes at most.
    pub max_sandboxes: usize,
    /// Creates under way at most.
    pub max_concurrent_creates: usize,
    /// The largest upload, bytes.
    pub max_upload_bytes: u64,
    /// Supervisors kept started.
    pub pool_size: usize,
    /// E2B template names to Cube templates (`base` and `code-interpreter-v1` map to
    /// the host template unless set otherwise).
    pub templates: BTreeMap<String, String>,
    /// TLS for the main listener, or for `tls_listen` when that is set.
    pub tls: Option<TlsFiles>,
    /// TLS listeners beside a plain main listener.
    pub tls_listen: Vec<SocketAddr>,
    /// The store (None: Cube's default).
    pub store: Option<PathBuf>,
}

/// What the command line contributes (it wins over the file).
#[derive(Clone, Debug, Default)]
pub struct CliOverrides {
    /// `--listen`.
    pub listen: Option<SocketAddr>,
    /// `--admin-listen`.
    pub admin_listen: Option<SocketAddr>,
    /// `--api-key` (or `CUBE_API_KEY`).
    pub api_keys: Vec<String>,
    /// `--api-key-file`.
    pub api_key_file: Option<PathBuf>,
    /// `--domain`.
    pub domain: Option<String>,
    /// `--store` / `CUBE_HOME`.
    pub store: Option<PathBuf>,
    /// `--tls-cert` and `--tls-key`.
    pub tls: Option<TlsFiles>,
    /// `--tls-listen`.
    pub tls_listen: Vec<SocketAddr>,
}

/// Where E2B's default templates go: Cube's built-in jail template.
pub const DEFAULT_TEMPLATES: &[&str] = &["base", "code-interpreter-v1", "code-interpreter-beta"];

impl ServeConfig {
    /// Reads the config file (if any) and applies the command line over it.
    pub fn load(file: Option<&Path>, cli: CliOverrides) -> Result<ServeConfig, ConfigError> {
        let parsed = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ConfigError::Read(path.to_path_buf(), e))?;
                toml::from_str::<FileConfig>(&text)
                    .map_err(|e| ConfigError::Parse(path.to_path_buf(), Box::new(e)))?
            }
            None => FileConfig::default(),
        };
        Self::resolve(parsed, cli)
    }

    /// Merges a parsed file and the command line.
    pub fn resolve(file: FileConfig, cli: CliOverrides) -> Result<ServeConfig, ConfigError> {
        let mut keys: Vec<String> = cli.api_keys.clone();
        keys.extend(file.api_keys.iter().cloned());
        for key_file in [cli.api_key_file.as_ref(), file.api_key_file.as_ref()]
            .into_iter()
            .flatten()
        {
            let text = std::fs::read_to_string(key_file)
                .map_err(|e| ConfigError::Read(key_file.clone(), e))?;
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(str::to_string),
            );
        }
        keys.retain(|k| !k.trim().is_empty());
        if keys.is_empty() {
            return Err(ConfigError::NoKey);
        }
        if keys.iter().any(|k| k.len() < 16) {
            return Err(ConfigError::ShortKey);
        }
        let mut templates = file.templates.clone();
        for name in DEFAULT_TEMPLATES {
            templates
                .entry((*name).to_string())
                .or_insert_with(|| cube_core::HOST_TEMPLATE.to_string());
        }
        let default_timeout = Duration::from_secs(file.default_timeout_secs.unwrap_or(300));
        let max_timeout = Duration::from_secs(file.max_timeout_secs.unwrap_or(24 * 3600));
        if default_timeout.is_zero() || default_timeout > max_timeout {
            return Err(ConfigError::Invalid(format!(
                "default_timeout_secs must be between 1 and max_timeout_secs ({})",
                max_timeout.as_secs()
            )));
        }
        let max_concurrent_creates = file.max_concurrent_creates.unwrap_or(16);
        if max_concurrent_creates == 0 {
            return Err(ConfigError::Invalid(
                "max_concurrent_creates must be at least 1".into(),
            ));
        }
        if (!file.tls_listen.is_empty() || !cli.tls_listen.is_empty())
            && cli.tls.is_none()
            && file.tls.is_none()
        {
            return Err(ConfigError::Invalid(
                "tls_listen needs a certificate and key (tls.cert, tls.key)".into(),
            ));
        }
        let listen = cli
            .listen
            .or(file.listen)
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 3000)));
        Ok(ServeConfig {
            listen,
            admin_listen: cli.admin_listen.or(file.admin_listen),
            domain: cli
                .domain
                .or(file.domain)
                .unwrap_or_else(|| "cube.local".to_string()),
            api_keys: keys,
            pause: file.pause.unwrap_or_default(),
            default_timeout,
            max_timeout,
            max_sandboxes: file.max_sandboxes.unwrap_or(200),
            max_concurrent_creates,
            max_upload_bytes: file.max_upload_bytes.unwrap_or(1 << 30),
            pool_size: file.pool_size.unwrap_or(2),
            templates,
            tls: cli.tls.or(file.tls),
            tls_listen: if cli.tls_listen.is_empty() {
                file.tls_listen
            } else {
                cli.tls_listen
            },
            store: cli.store,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli_with_key() -> CliOverrides {
        CliOverrides {
            api_keys: vec!["k".repeat(20)],
            ..CliOverrides::default()
        }
    }

    #[test]
    fn file_and_command_line_merge() {
        let file: FileConfig = toml::from_str(
            r#"
            listen = "0.0.0.0:8080"
            domain = "sb.example"
            pause = "freeze"
            max_sandboxes = 7
            [templates]
            data = "my-template"
            "#,
        )
        .unwrap();
        let mut cli = cli_with_key();
        cli.listen = Some("127.0.0.1:9000".parse().unwrap());
        let c = ServeConfig::resolve(file, cli).unwrap();
        assert_eq!(c.listen.port(), 9000);
        assert_eq!(c.domain, "sb.example");
        assert_eq!(c.pause, PauseMode::Freeze);
        assert_eq!(c.max_sandboxes, 7);
        assert_eq!(c.templates["data"], "my-template");
        assert_eq!(c.templates["base"], "host");
        assert_eq!(c.templates["code-interpreter-v1"], "host");
    }

    #[test]
    fn keys_are_required_and_long() {
        let err = ServeConfig::resolve(FileConfig::default(), CliOverrides::default());
        assert!(matches!(err, Err(ConfigError::NoKey)));
        let short = CliOverrides {
            api_keys: vec!["short".into()],
            ..CliOverrides::default()
        };
        assert!(matches!(
            ServeConfig::resolve(FileConfig::default(), short),
            Err(ConfigError::ShortKey)
        ));
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("keys");
        std::fs::write(&keys, "# team a\nAAAAAAAAAAAAAAAAAAAA\n\n").unwrap();
        let c = ServeConfig::resolve(
            FileConfig {
                api_key_file: Some(keys),
                ..FileConfig::default()
            },
            CliOverrides::default(),
        )
        .unwrap();
        assert_eq!(c.api_keys, ["AAAAAAAAAAAAAAAAAAAA"]);
    }

    #[test]
    fn unknown_settings_are_refused() {
        assert!(toml::from_str::<FileConfig>("listn = \"x\"").is_err());
    }
}
