//! A failed command: what went wrong, what to do about it, and the exit code, which
//! follows the failure's kind ([`cube_core::ErrorKind`]), never its message.

use cube_core::store::StoreError;
use cube_core::{ErrorKind, SandboxError};

pub use cube_core::error_report::chain;

/// The command failed (a sandbox operation, a cell that raised, i/o).
pub const EXIT_FAILED: u8 = 1;
/// Usage: a missing argument, a bad flag value, an impossible combination.
pub const EXIT_USAGE: u8 = 2;
/// Not found: no such sandbox, template, snapshot or file.
pub const EXIT_NOT_FOUND: u8 = 3;
/// This host cannot do it (no KVM, no cgroups, not root).
pub const EXIT_HOST_CANNOT: u8 = 4;
/// A `--timeout` passed (coreutils `timeout`'s code), or something did not answer in
/// time.
pub const EXIT_TIMEOUT: u8 = 124;
/// Interrupted (Ctrl-C or SIGTERM).
pub const EXIT_INTERRUPTED: u8 = 130;

/// The exit code of a failure of `kind`.
pub fn exit_code(kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::NotFound => EXIT_NOT_FOUND,
        ErrorKind::InvalidArgument => EXIT_USAGE,
        ErrorKind::HostCannot | ErrorKind::Unsupported => EXIT_HOST_CANNOT,
        ErrorKind::Timeout => EXIT_TIMEOUT,
        ErrorKind::AlreadyExists
        | ErrorKind::Busy
        | ErrorKind::BadState
        | ErrorKind::SnapshotFailed
        | ErrorKind::Internal => EXIT_FAILED,
    }
}

/// What to do about a failure of the host, wherever it came from.
const HOST_CANNOT_HINT: &str = "`cube doctor` lists what this host can do; the jail engine \
     works on any Linux host (--engine jail, or the built-in `host` template)";

/// A failed command: what went wrong, what to do, and the exit code.
pub struct CliError {
    pub(crate) message: String,
    pub(crate) hint: Option<String>,
    pub(crate) code: u8,
}

impl CliError {
    /// A failure of the operation itself (exit code 1).
    pub fn failed(message: impl Into<String>) -> Self {
        CliError {
            message: message.into(),
            hint: None,
            code: EXIT_FAILED,
        }
    }

    /// The command line asks for something impossible (exit code 2, as clap's own
    /// usage errors).
    pub fn usage(message: impl Into<String>) -> Self {
        CliError {
            message: message.into(),
            hint: None,
            code: EXIT_USAGE,
        }
    }

    /// The same error with another exit code.
    pub fn with_code(mut self, code: u8) -> Self {
        self.code = code;
        self
    }

    /// Something the user asked for does not exist (exit code 3).
    pub fn not_found(message: impl Into<String>) -> Self {
        CliError {
            message: message.into(),
            hint: None,
            code: EXIT_NOT_FOUND,
        }
    }

    /// The host lacks what the command needs (exit code 4).
    pub fn unsupported(message: impl Into<String>) -> Self {
        CliError {
            message: message.into(),
            hint: None,
            code: EXIT_HOST_CANNOT,
        }
    }

    /// A failure of `kind`, with the exit code and general advice that kind gets.
    pub fn of_kind(kind: ErrorKind, message: impl Into<String>) -> Self {
        let error = CliError {
            message: message.into(),
            hint: None,
            code: exit_code(kind),
        };
        match kind {
            ErrorKind::HostCannot => error.hint(HOST_CANNOT_HINT),
            _ => error,
        }
    }

    /// Adds advice.
    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }
}

impl From<SandboxError> for CliError {
    fn from(e: SandboxError) -> Self {
        use SandboxError as E;
        let error = CliError::of_kind(e.kind(), chain(&e));
        // Advice that names the way out, where the variant says which.
        match &e {
            E::UnknownSandbox(_) => error.hint("list sandboxes with `cube sandbox ls`"),
            E::UnknownSnapshot(_) => {
                error.hint("list snapshots with `cube sandbox snapshots [ID]`")
            }
            // A malformed name can name nothing: a usage error.
            E::Store(StoreError::InvalidName { what, .. }) => error.hint(match *what {
                "sandbox" => {
                    "sandbox ids look like sb-0123456789abcdef: `cube sandbox ls` lists them"
                }
                "template" => "`cube template ls` lists the templates",
                _ => "`cube sandbox snapshots` lists the snapshots",
            }),
            E::Hibernated(id) => error.hint(format!("wake it with `cube sandbox wake {id}`")),
            E::NoAgent(_) => error.hint("the jail engine runs commands and code: --engine jail"),
            _ => error,
        }
    }
}

/// The KVM device the vm engine opens.
pub const KVM_DEVICE: &str = "/dev/kvm";

/// Refuses vm-engine work on a host without `device`, naming the engine that works.
pub fn require_kvm(device: &std::path::Path) -> Result<(), CliError> {
    if device.exists() {
        return Ok(());
    }
    Err(CliError::unsupported(format!(
        "the vm engine needs KVM and {} does not exist on this host",
        device.display()
    ))
    .hint(
        "the jail engine works here: --engine jail, or the built-in `host` template \
         (`cube sandbox create`); `cube doctor` lists what this host can do",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_kvm_points_at_the_jail_engine() {
        let missing = require_kvm(std::path::Path::new("/nonexistent/kvm")).err();
        let e = missing.expect("a missing device is refused");
        assert_eq!(e.code, EXIT_HOST_CANNOT);
        assert!(e.hint.unwrap_or_default().contains("--engine jail"));
        assert!(require_kvm(std::path::Path::new("/")).is_ok());
    }

    #[test]
    fn exit_codes_follow_the_kind_not_the_message() {
        let not_found: CliError = SandboxError::UnknownTemplate("x".into()).into();
        assert_eq!(not_found.code, EXIT_NOT_FOUND);
        let bad_state: CliError = SandboxError::Hibernated("sb-1".into()).into();
        assert_eq!(bad_state.code, EXIT_FAILED);
        assert!(bad_state
            .hint
            .unwrap_or_default()
            .contains("cube sandbox wake"));
        // A host failure whose message says nothing of KVM is still the host's.
        let host = CliError::of_kind(ErrorKind::HostCannot, "cannot start");
        assert_eq!(host.code, EXIT_HOST_CANNOT);
        assert!(host.hint.unwrap_or_default().contains("cube doctor"));
        assert_eq!(exit_code(ErrorKind::Timeout), EXIT_TIMEOUT);
        assert_eq!(exit_code(ErrorKind::InvalidArgument), EXIT_USAGE);
        assert_eq!(exit_code(ErrorKind::Internal), EXIT_FAILED);
    }
}
