//! Finding a CRIU binary that works on this host: version 4 or newer (3.x cannot dump
//! on kernels whose vDSO has a `[vvar_vclock]` area) and passing `criu check`.
//!
//! The search order is `$CUBE_CRIU` alone when set, else `/usr/local/sbin/criu` (where
//! `scripts/setup-criu.sh` installs it), the distribution's `/usr/sbin/criu`, then every
//! `criu` on `PATH`. The first that works wins; when none does, the error names each
//! candidate and why it was refused, so "why is full-state snapshot unavailable" has a
//! one-line answer.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub use crate::criu_version::{parse_version, CriuVersion};

/// The oldest CRIU major version this crate drives.
pub const MIN_MAJOR: u32 = 4;

/// Environment variable naming the CRIU binary to use instead of searching.
pub const CRIU_ENV: &str = "CUBE_CRIU";

/// Places searched before `PATH`, best first.
const WELL_KNOWN: &[&str] = &["/usr/local/sbin/criu", "/usr/sbin/criu"];

/// Why no usable CRIU was found.
#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    /// No criu binary exists at any searched place.
    #[error("no criu binary found (searched {searched}); run scripts/setup-criu.sh")]
    NotFound {
        /// The places searched, comma separated.
        searched: String,
    },
    /// The binary could not be started.
    #[error("cannot run {path}")]
    Run {
        /// The binary.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// `criu --version` printed nothing this module understands.
    #[error("{path}: unrecognised version output {output:?}")]
    UnknownVersion {
        /// The binary.
        path: PathBuf,
        /// What it printed.
        output: String,
    },
    /// The binary is older than [`MIN_MAJOR`].
    #[error("{path} is CRIU {version}, older than {MIN_MAJOR}.0")]
    TooOld {
        /// The binary.
        path: PathBuf,
        /// Its version.
        version: CriuVersion,
    },
    /// `criu check` reports that this kernel lacks something CRIU needs.
    #[error("{path}: `criu check` fails: {reason}")]
    CheckFailed {
        /// The binary.
        path: PathBuf,
        /// The last error line criu printed.
        reason: String,
    },
    /// Several candidates exist and none is usable; each reason is listed.
    #[error("no usable criu: {0}")]
    NoneUsable(String),
}

/// A CRIU binary that is new enough and whose `criu check` passed.
#[derive(Clone, Debug)]
pub struct Criu {
    path: PathBuf,
    version: CriuVersion,
}

impl Criu {
    /// Finds a working CRIU (see the module docs for the search order). Runs `criu
    /// check` (~0.1 s), so callers keep the result instead of probing per operation.
    pub fn probe() -> Result<Criu, CriuError> {
        if let Some(path) = std::env::var_os(CRIU_ENV) {
            return Criu::at(Path::new(&path));
        }
        let mut candidates: Vec<PathBuf> = WELL_KNOWN.iter().map(PathBuf::from).collect();
        if let Some(path) = std::env::var_os("PATH") {
            candidates.extend(std::env::split_paths(&path).map(|d| d.join("criu")));
        }
        let mut seen: Vec<PathBuf> = Vec::new();
        let mut refused: Vec<CriuError> = Vec::new();
        for candidate in &candidates {
            // One binary reached through symlinks or repeated PATH entries is tried once.
            let Ok(real) = std::fs::canonicalize(candidate) else {
                continue;
            };
            if seen.contains(&real) || !real.is_file() {
                continue;
            }
            seen.push(real);
            match Criu::at(candidate) {
                Ok(criu) => return Ok(criu),
                Err(e) => refused.push(e),
            }
        }
        match refused.len() {
            0 => Err(CriuError::NotFound {
                searched: candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
            1 => Err(refused.remove(0)),
            _ => Err(CriuError::NoneUsable(
                refused
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            )),
        }
    }

    /// Uses the binary at `path` if it is new enough and `criu check` passes. A binary
    /// found good since the host booted is not run again (see `kdat_cache.rs`): every
    /// supervisor probes once, and the check takes ~100 ms.
    pub fn at(path: &Path) -> Result<Criu, CriuError> {
        if let Some(version) = crate::kdat_cache::checked_version(path) {
            return Ok(Criu {
                path: path.to_path_buf(),
                version,
            });
        }
        let run_err = |source| CriuError::Run {
            path: path.to_path_buf(),
            source,
        };
        let out = Command::new(path)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .map_err(run_err)?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let version = parse_version(&text).ok_or_else(|| CriuError::UnknownVersion {
            path: path.to_path_buf(),
            output: text.trim().to_owned(),
        })?;
        if version.major < MIN_MAJOR {
            return Err(CriuError::TooOld {
                path: path.to_path_buf(),
                version,
            });
        }
        let out = Command::new(path)
            .arg("check")
            .stdin(Stdio::null())
            .output()
            .map_err(run_err)?;
        if !out.status.success() {
            let mut text = String::from_utf8_lossy(&out.stderr).into_owned();
            text.push_str(&String::from_utf8_lossy(&out.stdout));
            return Err(CriuError::CheckFailed {
                path: path.to_path_buf(),
                reason: error_summary(&text),
            });
        }
        crate::kdat_cache::record_checked(path, version);
        Ok(Criu {
            path: path.to_path_buf(),
            version,
        })
    }

    /// The binary's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The binary's version.
    pub fn version(&self) -> CriuVersion {
        self.version
    }
}

/// Error lines criu prints on every run where root lacks CAP_SYS_RESOURCE; they are
/// not why anything failed.
const BENIGN: &[&str] = &["Can't setup RLIMIT_NOFILE for self"];

/// The telling part of criu's output: its first error lines (the cause and its first
/// consequences; the last is usually a bare "Dumping FAILED"), else the last non-empty
/// line.
pub(crate) fn error_summary(text: &str) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !BENIGN.iter().any(|b| l.contains(b)))
        .collect();
    let errors: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with("Error") || l.contains("error:"))
        .take(3)
        .collect();
    if errors.is_empty() {
        return lines
            .last()
            .map_or_else(|| "no output".to_owned(), |l| (*l).to_owned());
    }
    errors.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_error_line() {
        let text = "Warn  (criu/kerndat.c:1285): Can't keep kdat cache\n\
                    Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: x\n\
                    Error (criu/cr-check.c:1): vdso: [vvar_vclock] unsupported\n\
                    Error (criu/cr-check.c:2): check failed\n\
                    Looks bad.\n";
        let summary = error_summary(text);
        assert!(
            summary.starts_with("Error (criu/cr-check.c:1)"),
            "{summary}"
        );
        assert!(!summary.contains("RLIMIT"), "{summary}");
        assert_eq!(error_summary("only this\n\n"), "only this");
        assert_eq!(error_summary(""), "no output");
    }

    #[test]
    fn a_missing_binary_is_a_run_error() {
        let err = Criu::at(Path::new("/nonexistent/criu")).unwrap_err();
        assert!(matches!(err, CriuError::Run { .. }), "{err}");
    }

    #[test]
    fn a_binary_that_is_not_criu_is_refused() {
        // /bin/true prints no version line.
        let err = Criu::at(Path::new("/bin/true")).unwrap_err();
        assert!(matches!(err, CriuError::UnknownVersion { .. }), "{err}");
    }
}
