//! Why a sandbox operation failed, and what kind of failure it was.

use cube_storage::StoreError;
use cube_supervisor::client::ClientError;
use cube_supervisor::jail_network::JailNetworkError;
use cube_supervisor::pool::PoolError;
use cube_supervisor::protocol::ErrorKind;
use cube_supervisor::records::Engine;
use cube_supervisor::templates::debian::RootfsBuildError;
use cube_supervisor::templates::oci::OciError;
use cube_supervisor::templates::tree::TemplateBuildError;
use cube_supervisor::templates::vm::VmTemplateError;
use cube_supervisor::vm_agent::VmAgentError;

use crate::engine_choice::EngineChoice;
use crate::portable_error::PortableError;

/// Why a sandbox operation failed.
///
/// Every failure has a kind ([`SandboxError::kind`]), whether it happened here or in
/// the sandbox's supervisor: callers (the CLI's exit codes, Python's exception
/// classes) tell failures apart by it, never by the message. Callers may also match
/// on the variants that mean "the name is wrong" ([`SandboxError::UnknownSandbox`],
/// [`SandboxError::UnknownTemplate`], [`SandboxError::UnknownSnapshot`]):
///
/// ```
/// use cube_core::{ErrorKind, Runtime, RuntimeConfig, SandboxError};
///
/// let store = tempfile::tempdir().unwrap();
/// let rt = Runtime::open(RuntimeConfig {
///     store_root: store.path().into(),
///     pool_size: 0,
///     network_pool_size: 0,
///     // Started when a sandbox is created; opening and reading the store need none.
///     supervisor: Some("/usr/local/bin/cube-supervisor".into()),
/// })
/// .unwrap();
/// match rt.attach("sb-0000000000000000") {
///     Err(e @ SandboxError::UnknownSandbox(_)) => assert_eq!(e.kind(), ErrorKind::NotFound),
///     other => panic!("expected UnknownSandbox, got {:?}", other.err()),
/// }
/// ```
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The store failed.
    #[error("Store")]
    Store(#[from] cube_storage::StoreError),
    /// A metadata file is damaged or could not be written.
    #[error("Metadata")]
    Metadata(#[from] cube_storage::MetadataError),
    /// Copying a file failed.
    #[error("Copying")]
    Clone(#[from] cube_storage::CloneError),
    /// A supervisor could not be started.
    #[error("Supervisor")]
    Pool(#[from] PoolError),
    /// The supervisor reported a failure.
    #[error("Sandbox {id}")]
    Supervisor {
        /// The sandbox.
        id: String,
        /// What failed.
        #[source]
        source: ClientError,
    },
    /// No sandbox with this id.
    #[error("No sandbox named {0}")]
    UnknownSandbox(String),
    /// No template with this name.
    #[error("No template named {0} (list them with `cube template ls`)")]
    UnknownTemplate(String),
    /// A template of this name exists.
    #[error("Template {0} already exists")]
    TemplateExists(String),
    /// No snapshot with this id.
    #[error("No snapshot named {0}")]
    UnknownSnapshot(String),
    /// The snapshot's files lie over a directory its sandbox was created on (a
    /// container's root filesystem), which it does not hold: a create from it gives
    /// the tree (`CreateOptions::rootfs`).
    #[error(
        "Snapshot {snapshot} lies over a root directory of its own ({}), which it does not hold: create from it with that tree (CreateOptions::rootfs)",
        tree.display()
    )]
    NeedsRootfs {
        /// The snapshot.
        snapshot: String,
        /// The directory it was taken over, on the host it was taken on.
        tree: std::path::PathBuf,
    },
    /// The snapshot belongs to another sandbox.
    #[error("Snapshot {snapshot} belongs to sandbox {owner}, not {sandbox}")]
    NotOwner {
        /// The snapshot.
        snapshot: String,
        /// Its owner.
        owner: String,
        /// The sandbox that asked.
        sandbox: String,
    },
    /// A filesystem operation failed.
    #[error("{0}")]
    Io(String, #[source] std::io::Error),
    /// A snapshot the supervisor staged holds something other than files and
    /// directories; it was removed.
    #[error(
        "Snapshot {snapshot} as the sandbox's supervisor wrote it holds {}, which is neither a file nor a directory: refused and removed",
        entry.display()
    )]
    ForeignSnapshotEntry {
        /// The snapshot.
        snapshot: String,
        /// The entry.
        entry: std::path::PathBuf,
    },
    /// The snapshot a VM sandbox rolls back to could not be lent to its supervisor.
    #[error("Handing snapshot {snapshot} to the sandbox's supervisor")]
    LendSnapshot {
        /// The snapshot.
        snapshot: String,
        /// What failed.
        #[source]
        source: cube_storage::lent_snapshot::LendError,
    },
    /// A snapshot or template could not be made durable.
    #[error("Flushing to disk")]
    Durability(#[from] cube_storage::DurabilityError),
    /// A worker thread panicked.
    #[error("A worker thread failed")]
    Thread,
    /// The template or snapshot is made for another engine than the one asked for.
    #[error("{what} runs on the {engine} engine, not {asked} (ask for --engine {engine} or auto)")]
    EngineMismatch {
        /// The template or snapshot.
        what: String,
        /// Its engine.
        engine: Engine,
        /// The engine asked for.
        asked: EngineChoice,
    },
    /// The template is used by sandboxes (their roots lie on its tree).
    #[error("Template {name} is in use by sandbox {sandboxes} (destroy them first)")]
    TemplateInUse {
        /// The template.
        name: String,
        /// The sandboxes using it, comma-separated.
        sandboxes: String,
    },
    /// A template's record or files are damaged.
    #[error("{0}")]
    BadTemplate(String),
    /// A template could not be built.
    #[error("Building template {0}")]
    Build(String, #[source] TemplateBuildError),
    /// A VM template could not be built.
    #[error("Building VM template {0}")]
    VmTemplate(String, #[source] VmTemplateError),
    /// A built-in template cannot be changed.
    #[error("Template {0} is built in")]
    BuiltInTemplate(String),
    /// The sandbox's engine has no in-sandbox agent yet.
    #[error("Sandboxes of the {0} engine have no agent yet")]
    NoAgent(Engine),
    /// The sandbox is hibernated: it has no processes, its agent included.
    #[error("Sandbox {0} is hibernated: wake it first")]
    Hibernated(String),
    /// The sandbox's network could not be set up or changed.
    #[error("Network")]
    Network(#[source] JailNetworkError),
    /// The agent inside the sandbox's VM could not be reached.
    #[error("Sandbox {0}'s agent")]
    VmAgent(String, #[source] VmAgentError),
    /// The sandbox's agent could not be reached.
    #[error("Sandbox {0}'s agent")]
    Agent(String, #[source] cube_agent::client::ClientError),
    /// A snapshot could not be exported or imported.
    #[error("Snapshot archive")]
    Portable(#[from] PortableError),
}

impl SandboxError {
    /// What kind of failure this is: the supervisor's own kind for a request it
    /// carried out, else what the failure here means.
    ///
    /// ```
    /// use cube_core::{ErrorKind, SandboxError};
    ///
    /// assert_eq!(SandboxError::UnknownTemplate("t".into()).kind(), ErrorKind::NotFound);
    /// assert_eq!(SandboxError::Hibernated("sb-1".into()).kind(), ErrorKind::BadState);
    /// ```
    pub fn kind(&self) -> ErrorKind {
        use SandboxError as E;
        match self {
            E::UnknownSandbox(_) | E::UnknownTemplate(_) | E::UnknownSnapshot(_) => {
                ErrorKind::NotFound
            }
            E::TemplateExists(_) => ErrorKind::AlreadyExists,
            E::TemplateInUse { .. } => ErrorKind::Busy,
            E::NotOwner { .. }
            | E::EngineMismatch { .. }
            | E::BuiltInTemplate(_)
            | E::NeedsRootfs { .. } => ErrorKind::InvalidArgument,
            E::Store(e) => store_kind(e),
            E::Hibernated(_) => ErrorKind::BadState,
            E::NoAgent(_) => ErrorKind::Unsupported,
            // No supervisor binary, or it cannot start: Cube is not set up here.
            E::Pool(_) => ErrorKind::HostCannot,
            E::Supervisor { source, .. } => source.kind(),
            E::Build(_, e) => tree_kind(e),
            E::VmTemplate(_, e) => match e {
                VmTemplateError::StockKernelOnPvm
                | VmTemplateError::NoKvm
                | VmTemplateError::NoKernel(_)
                | VmTemplateError::Agent(_) => ErrorKind::HostCannot,
                VmTemplateError::Exists(_) => ErrorKind::AlreadyExists,
                VmTemplateError::ImageUser(_) => ErrorKind::InvalidArgument,
                VmTemplateError::Timeout(..) | VmTemplateError::TimeoutOnPvm(..) => {
                    ErrorKind::Timeout
                }
                VmTemplateError::Tree(e) => tree_kind(e),
                VmTemplateError::Store(e) => store_kind(e),
                _ => ErrorKind::Internal,
            },
            E::Network(e) => e.kind(),
            E::Portable(e) => e.kind(),
            E::VmAgent(_, VmAgentError::NotReady { .. }) => ErrorKind::Timeout,
            E::Agent(_, cube_agent::client::ClientError::Timeout) => ErrorKind::Timeout,
            E::VmAgent(..)
            | E::Agent(..)
            | E::Metadata(_)
            | E::Clone(_)
            | E::Io(..)
            | E::LendSnapshot { .. }
            | E::ForeignSnapshotEntry { .. }
            | E::Durability(_)
            | E::Thread
            | E::BadTemplate(_) => ErrorKind::Internal,
        }
    }
}

/// The kind of a store failure: a malformed name is the caller's mistake.
fn store_kind(e: &StoreError) -> ErrorKind {
    match e {
        StoreError::InvalidName { .. } => ErrorKind::InvalidArgument,
        StoreError::NotFound { .. } => ErrorKind::NotFound,
        StoreError::AlreadyExists { .. } => ErrorKind::AlreadyExists,
        StoreError::NoHome => ErrorKind::HostCannot,
        StoreError::SocketPathTooLong { .. } => ErrorKind::InvalidArgument,
        _ => ErrorKind::Internal,
    }
}

/// The kind of a failed tree build: bad input, or a host without debootstrap.
fn tree_kind(e: &TemplateBuildError) -> ErrorKind {
    match e {
        TemplateBuildError::Exists(_) => ErrorKind::AlreadyExists,
        TemplateBuildError::NotADirectory(_) | TemplateBuildError::NoLoader(_) => {
            ErrorKind::InvalidArgument
        }
        TemplateBuildError::Debian(RootfsBuildError::NoDebootstrap) => ErrorKind::HostCannot,
        TemplateBuildError::Debian(
            RootfsBuildError::InvalidPackage(_)
            | RootfsBuildError::InvalidSuite(_)
            | RootfsBuildError::InvalidMirror(_),
        ) => ErrorKind::InvalidArgument,
        TemplateBuildError::Store(e) => store_kind(e),
        // A file of the image that cannot be read or written is the host's trouble;
        // anything else about the image is the caller's input.
        TemplateBuildError::Image(_, e) => match &**e {
            OciError::Io(_, io) if io.kind() == std::io::ErrorKind::NotFound => ErrorKind::NotFound,
            OciError::Io(..) => ErrorKind::Internal,
            _ => ErrorKind::InvalidArgument,
        },
        _ => ErrorKind::Internal,
    }
}
