//! Why a snapshot could not be exported or imported (see [`crate::Runtime::export_snapshot`]
//! and [`crate::Runtime::import_snapshot`]).

use std::path::PathBuf;

use cube_supervisor::protocol::ErrorKind;

/// Why a snapshot could not be exported or imported.
#[derive(Debug, thiserror::Error)]
pub enum PortableError {
    /// The archive file could not be written.
    #[error("Writing {0}")]
    Write(PathBuf, #[source] cube_archive::PackError),
    /// The archive file could not be opened or finished.
    #[error("{0}")]
    File(String, #[source] std::io::Error),
    /// The archive was refused: damaged, truncated, tampered with, or not an archive.
    #[error("{0} is not a usable snapshot archive")]
    Archive(PathBuf, #[source] cube_archive::UnpackError),
    /// The archive's header could not be read.
    #[error("{0} is not a usable snapshot archive")]
    Header(PathBuf, #[source] cube_archive::ReadError),
    /// The archive does not describe a Cube snapshot this build can import.
    #[error("{path} is not a Cube snapshot this build can import: {why}")]
    NotASnapshot {
        /// The archive.
        path: PathBuf,
        /// What is missing or wrong.
        why: String,
    },
    /// The snapshot was taken on another machine architecture.
    #[error("The snapshot was taken on {theirs}; this host is {ours}")]
    Arch {
        /// Where it was taken.
        theirs: String,
        /// This host.
        ours: String,
    },
    /// The template the snapshot lies over is not in this store.
    #[error("The snapshot needs template {0}, which this store does not have (build or import it first)")]
    MissingTemplate(String),
    /// The template of that name here is not the one the snapshot was taken over.
    #[error(
        "Template {0} here is not the one the snapshot was taken over (it was built differently)"
    )]
    TemplateMismatch(String),
    /// A snapshot of this id is already in the store.
    #[error("Snapshot {0} is already in this store")]
    Exists(String),
    /// The unpacked snapshot's own records are damaged or disagree with the archive.
    #[error("The archive's snapshot record is unusable: {0}")]
    Record(String),
}

impl PortableError {
    /// What kind of failure this is: a bad archive or a template that does not match
    /// is the caller's input; another architecture is this host's limit.
    pub fn kind(&self) -> ErrorKind {
        match self {
            PortableError::Archive(..)
            | PortableError::Header(..)
            | PortableError::NotASnapshot { .. }
            | PortableError::TemplateMismatch(_)
            | PortableError::Record(_) => ErrorKind::InvalidArgument,
            PortableError::Arch { .. } => ErrorKind::HostCannot,
            PortableError::MissingTemplate(_) => ErrorKind::NotFound,
            PortableError::File(_, e) if e.kind() == std::io::ErrorKind::NotFound => {
                ErrorKind::NotFound
            }
            PortableError::Exists(_) => ErrorKind::AlreadyExists,
            PortableError::Write(..) | PortableError::File(..) => ErrorKind::Internal,
        }
    }
}
