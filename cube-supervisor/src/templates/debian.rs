//! A template's root filesystem tree built from Debian packages with `debootstrap`.
//!
//! The tree is built in a staging directory next to its destination and renamed into
//! place only when `debootstrap` succeeded and the tree holds what was asked for, so an
//! interrupted or failed build never leaves a half-made template behind. The tree is
//! engine-neutral: the jail engine mounts it under an overlay, a VM template turns it
//! into a disk image.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Why a root filesystem could not be built.
#[derive(Debug, thiserror::Error)]
pub enum RootfsBuildError {
    /// `debootstrap` is not installed.
    #[error("debootstrap is not installed (apt-get install debootstrap)")]
    NoDebootstrap,
    /// A package name is not a Debian package name.
    #[error("{0:?} is not a Debian package name")]
    InvalidPackage(String),
    /// The suite name is not a Debian suite name.
    #[error("{0:?} is not a Debian suite name")]
    InvalidSuite(String),
    /// The mirror is not an http(s) URL.
    #[error("{0:?} is not an http(s) mirror URL")]
    InvalidMirror(String),
    /// The destination exists already.
    #[error("{0} already exists")]
    DestinationExists(PathBuf),
    /// `debootstrap` failed; the last lines it printed say why.
    #[error("debootstrap failed ({status}): {tail}")]
    Debootstrap {
        /// Its exit status.
        status: String,
        /// Its last output lines.
        tail: String,
    },
    /// The finished tree lacks a program that was asked for.
    #[error("the built tree has no {0}")]
    Missing(String),
    /// A file operation failed.
    #[error("{action} {path}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// On which path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// What to build: a Debian release with extra packages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DebianRootfs {
    /// Debian suite, such as `bookworm`.
    pub suite: String,
    /// Package mirror.
    pub mirror: String,
    /// Packages installed on top of the minimal base.
    pub packages: Vec<String>,
}

/// The suite templates are built from unless told otherwise.
pub const DEFAULT_SUITE: &str = "bookworm";
/// The mirror templates are built from unless told otherwise.
pub const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
/// Packages every built template holds: Python with pip, so code cells and `pip
/// install` work in a sandbox made from it.
pub const BASE_PACKAGES: &[&str] = &["python3", "python3-pip", "ca-certificates"];

impl Default for DebianRootfs {
    fn default() -> Self {
        DebianRootfs {
            suite: DEFAULT_SUITE.into(),
            mirror: DEFAULT_MIRROR.into(),
            packages: BASE_PACKAGES.iter().map(|p| p.to_string()).collect(),
        }
    }
}

/// How many lines of `debootstrap` output an error carries.
const ERROR_TAIL_LINES: usize = 6;

impl DebianRootfs {
    /// Checks every field before anything runs: names reach a command line.
    pub fn validate(&self) -> Result<(), RootfsBuildError> {
        if !is_debian_name(&self.suite) {
            return Err(RootfsBuildError::InvalidSuite(self.suite.clone()));
        }
        let m = &self.mirror;
        let scheme_ok = m.starts_with("http://") || m.starts_with("https://");
        if !scheme_ok || m.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(RootfsBuildError::InvalidMirror(m.clone()));
        }
        if let Some(p) = self.packages.iter().find(|p| !is_debian_name(p)) {
            return Err(RootfsBuildError::InvalidPackage(p.clone()));
        }
        Ok(())
    }

    /// Builds the tree at `dest` (which must not exist), calling `progress` with each
    /// line `debootstrap` prints. On any failure nothing is left at `dest`.
    pub fn build(
        &self,
        dest: &Path,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), RootfsBuildError> {
        self.validate()?;
        if dest.exists() {
            return Err(RootfsBuildError::DestinationExists(dest.to_path_buf()));
        }
        let debootstrap = find_debootstrap().ok_or(RootfsBuildError::NoDebootstrap)?;
        let staging = staging_path(dest);
        // A staging tree left by a killed build is garbage by construction.
        remove_tree(&staging)?;
        let result = self
            .run_debootstrap(&debootstrap, &staging, progress)
            .and_then(|()| self.finish_tree(&staging))
            .and_then(|()| {
                std::fs::rename(&staging, dest).map_err(|source| RootfsBuildError::Io {
                    action: "moving the built tree to",
                    path: dest.to_path_buf(),
                    source,
                })
            });
        if result.is_err() {
            let _ = remove_tree(&staging);
        }
        result
    }

    fn run_debootstrap(
        &self,
        debootstrap: &Path,
        target: &Path,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), RootfsBuildError> {
        let mut cmd = Command::new(debootstrap);
        cmd.arg("--variant=minbase");
        if !self.packages.is_empty() {
            cmd.arg(format!("--include={}", self.packages.join(",")));
        }
        cmd.arg(&self.suite)
            .arg(target)
            .arg(&self.mirror)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            // debootstrap reports progress on stdout and errors on stderr; one stream
            // keeps their order for the error tail.
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|source| RootfsBuildError::Io {
            action: "starting",
            path: debootstrap.to_path_buf(),
            source,
        })?;
        let mut tail: Vec<String> = Vec::new();
        let stderr = child.stderr.take();
        // stderr is drained on a thread so that neither pipe can fill up and stall it.
        let stderr_lines = std::thread::spawn(move || {
            stderr
                .map(|s| {
                    BufReader::new(s)
                        .lines()
                        .map_while(Result::ok)
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default()
        });
        if let Some(stdout) = child.stdout.take() {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                progress(&line);
                push_tail(&mut tail, line);
            }
        }
        let status = child.wait().map_err(|source| RootfsBuildError::Io {
            action: "waiting for",
            path: debootstrap.to_path_buf(),
            source,
        })?;
        for line in stderr_lines.join().unwrap_or_default() {
            push_tail(&mut tail, line);
        }
        if !status.success() {
            // debootstrap keeps its detailed log inside the target.
            if let Ok(log) = std::fs::read_to_string(target.join("debootstrap/debootstrap.log")) {
                for line in log.lines() {
                    push_tail(&mut tail, line.to_string());
                }
            }
            return Err(RootfsBuildError::Debootstrap {
                status: status.to_string(),
                tail: tail.join(" | "),
            });
        }
        Ok(())
    }

    /// Checks the tree and drops what a template does not need.
    fn finish_tree(&self, tree: &Path) -> Result<(), RootfsBuildError> {
        for (package, program) in [
            ("python3", "usr/bin/python3"),
            ("python3-pip", "usr/bin/pip3"),
        ] {
            if self.packages.iter().any(|p| p == package) && !tree.join(program).exists() {
                return Err(RootfsBuildError::Missing(format!("/{program}")));
            }
        }
        // The downloaded .debs are a copy of what is already unpacked.
        let archives = tree.join("var/cache/apt/archives");
        if let Ok(entries) = std::fs::read_dir(&archives) {
            for entry in entries.flatten() {
                if entry.path().extension().is_some_and(|e| e == "deb") {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        Ok(())
    }
}

fn push_tail(tail: &mut Vec<String>, line: String) {
    if line.trim().is_empty() {
        return;
    }
    tail.push(line);
    if tail.len() > ERROR_TAIL_LINES {
        tail.remove(0);
    }
}

/// Debian package and suite names: lower-case letters, digits, `+ - .`, starting with a
/// letter or digit, at least two characters (Debian policy 5.6.1).
fn is_debian_name(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() >= 2
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"+-.".contains(c))
}

fn staging_path(dest: &Path) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".building");
    dest.with_file_name(name)
}

fn find_debootstrap() -> Option<PathBuf> {
    [
        "/usr/sbin/debootstrap",
        "/usr/bin/debootstrap",
        "/sbin/debootstrap",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
}

fn remove_tree(path: &Path) -> Result<(), RootfsBuildError> {
    // debootstrap mounts /proc and /sys inside the tree; a killed one leaves them, and
    // deleting through a mount would reach the host's files.
    if super::mounts::unmount_all_under(path).is_err() {
        return Err(RootfsBuildError::Io {
            action: "unmounting what is mounted inside",
            path: path.to_path_buf(),
            source: std::io::Error::from_raw_os_error(libc::EBUSY),
        });
    }
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(RootfsBuildError::Io {
            action: "removing",
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_reach_the_command_line_are_checked() {
        let mut r = DebianRootfs::default();
        assert!(r.validate().is_ok());
        r.packages.push("--foo".into());
        assert!(matches!(r.validate(), Err(RootfsBuildError::InvalidPackage(p)) if p == "--foo"));
        r.packages.pop();
        r.packages.push("python3,evil".into());
        assert!(matches!(
            r.validate(),
            Err(RootfsBuildError::InvalidPackage(_))
        ));
        r.packages.pop();
        r.suite = "Bookworm".into();
        assert!(matches!(
            r.validate(),
            Err(RootfsBuildError::InvalidSuite(_))
        ));
        r.suite = "bookworm".into();
        r.mirror = "ftp://x".into();
        assert!(matches!(
            r.validate(),
            Err(RootfsBuildError::InvalidMirror(_))
        ));
        r.mirror = "http://a b".into();
        assert!(matches!(
            r.validate(),
            Err(RootfsBuildError::InvalidMirror(_))
        ));
    }

    #[test]
    fn debian_names() {
        for ok in ["python3", "g++", "libc6.1", "0ad", "python3-pip"] {
            assert!(is_debian_name(ok), "{ok}");
        }
        for bad in ["", "a", "-x", "A", "a b", "a/b", "a,b", "a_b"] {
            assert!(!is_debian_name(bad), "{bad}");
        }
    }

    #[test]
    fn an_existing_destination_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("keep"), b"x").unwrap();
        let err = DebianRootfs::default()
            .build(dir.path(), &mut |_| {})
            .unwrap_err();
        assert!(matches!(err, RootfsBuildError::DestinationExists(_)));
        assert!(dir.path().join("keep").exists());
    }

    #[test]
    fn a_failed_build_leaves_nothing() {
        if find_debootstrap().is_none() {
            eprintln!("skipping: debootstrap is not installed");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("tree");
        // No such suite: debootstrap fails before downloading anything large.
        let r = DebianRootfs {
            suite: "no-such-suite-cube".into(),
            // A local port nothing listens on: the test sends no traffic off the host.
            mirror: "http://127.0.0.1:9/debian".into(),
            packages: vec![],
        };
        let err = r.build(&dest, &mut |_| {}).unwrap_err();
        assert!(matches!(err, RootfsBuildError::Debootstrap { .. }), "{err}");
        assert!(!dest.exists());
        assert!(!staging_path(&dest).exists());
    }
}
