//! `cube`: create and drive sandboxes, check the host, and benchmark.

mod bench;
mod build_progress;
mod debug_cmd;
mod doctor;
mod files_cmd;
mod interrupts;
mod net_cmd;
pub mod progress;
mod run_cmd;
mod sandbox_cmd;
mod snapshot_cmd;
mod store_cmd;
mod table;
mod template_build_cmd;
mod vm_template_cmd;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

/// What every exit code means; shown by `cube --help` and kept in one place.
const EXIT_CODES: &str = "\
Exit codes:
  0    success
  1    the command failed (a sandbox operation, a cell that raised, i/o)
  2    usage: a missing argument, a bad flag value, an impossible combination
  3    not found: no such sandbox, template, snapshot or file
  4    this host cannot do it (no KVM, no cgroups, not root); `cube doctor` says what works
  124  --timeout passed (run, exec)
  130  interrupted (Ctrl-C)
  N    run/exec: the command's own exit code; 128+N when signal N killed it

Examples:
  cube doctor
  id=$(cube sandbox create)
  cube sandbox code $id 'x = 41'
  cube sandbox code $id 'x + 1'
  cube sandbox cp ./data.csv $id:/tmp/data.csv
  cube sandbox rm $id";

/// Cube: fast, snapshot-able sandboxes for AI agents.
#[derive(Parser)]
#[command(name = "cube", version, about, long_about = None, after_help = EXIT_CODES)]
struct Cli {
    /// Root directory of the store (default: $CUBE_HOME, else /var/lib/cube for root).
    #[arg(long, global = true, env = "CUBE_HOME")]
    store: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Report what this host can do.
    ///
    /// Example: cube doctor --json
    Doctor {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Reproduce CubeSandbox's benchmark tables on this host.
    ///
    /// Example: cube bench --quick --json
    Bench(bench::BenchArgs),
    /// Manage the store.
    ///
    /// Example: cube store info
    #[command(subcommand)]
    Store(store_cmd::StoreCommand),
    /// Manage templates.
    ///
    /// Example: cube template ls
    #[command(subcommand)]
    Template(sandbox_cmd::TemplateCommand),
    /// Manage sandboxes that live across invocations.
    ///
    /// Example: cube sandbox create && cube sandbox ls
    #[command(subcommand)]
    Sandbox(sandbox_cmd::SandboxCommand),
    /// Move snapshots between hosts: export one into a file, import it elsewhere.
    ///
    /// Example: cube snapshot export snap-0123456789abcdef -o snap.cube
    #[command(subcommand)]
    Snapshot(snapshot_cmd::SnapshotCommand),
    /// Run one command in a fresh sandbox that is destroyed when it ends; exits with
    /// the command's exit code (128+N when signal N killed it, 124 on --timeout).
    ///
    /// Example: cube run --engine jail -- python3 -c 'print(6*7)'
    Run(run_cmd::RunArgs),
    /// Run one code cell in a fresh sandbox; prints its output and, for Python, the
    /// value of its last expression; exits 1 when it raises. Nothing is kept between
    /// invocations: each one is a new sandbox.
    ///
    /// Example: cube code '1+1'
    Code(run_cmd::CodeArgs),
    /// Look inside the VMM.
    ///
    /// Example: cube debug boot --kernel vmlinux --until 'Linux version'
    #[command(subcommand)]
    Debug(debug_cmd::DebugCommand),
    /// Print a shell completion script.
    ///
    /// Example: cube completions bash > /etc/bash_completion.d/cube
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

fn main() -> ExitCode {
    // Output piped into `head` should end quietly, as other Unix tools do, instead of
    // panicking on a closed pipe.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CUBE_LOG").unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,netlink_packet_route=error")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let store = cli.store.as_deref();
    let result = match cli.command {
        Command::Doctor { json } => doctor::run(store, json).map(|()| 0),
        Command::Bench(args) => bench::run(store, &args).map(|()| 0),
        Command::Store(cmd) => store_cmd::run(store, cmd).map(|()| 0),
        Command::Template(cmd) => sandbox_cmd::run_template(store, cmd).map(|()| 0),
        Command::Sandbox(cmd) => sandbox_cmd::run_sandbox(store, cmd),
        Command::Snapshot(cmd) => snapshot_cmd::run(store, cmd).map(|()| 0),
        Command::Run(args) => run_cmd::run(store, &args),
        Command::Code(args) => run_cmd::code(store, &args),
        Command::Debug(cmd) => debug_cmd::run(cmd).map(|()| 0),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "cube", &mut std::io::stdout());
            Ok(0)
        }
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("cube: {}", e.message);
            if let Some(hint) = e.hint {
                eprintln!("hint: {hint}");
            }
            ExitCode::from(e.code)
        }
    }
}

/// A failed command: what went wrong, what to do, and the exit code.
pub struct CliError {
    message: String,
    hint: Option<String>,
    code: u8,
}

impl CliError {
    /// A failure of the operation itself (exit code 1).
    pub fn failed(message: impl Into<String>) -> Self {
        CliError {
            message: message.into(),
            hint: None,
            code: 1,
        }
    }

    /// The command line asks for something impossible (exit code 2, as clap's own
    /// usage errors).
    pub fn usage(message: impl Into<String>) -> Self {
        CliError {
            message: message.into(),
            hint: None,
            code: 2,
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
            code: 3,
        }
    }

    /// The host lacks what the command needs (exit code 4).
    pub fn unsupported(message: impl Into<String>) -> Self {
        CliError {
            message: message.into(),
            hint: None,
            code: 4,
        }
    }

    /// Adds advice.
    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }
}

pub use cube_core::error_report::chain;

impl From<cube_core::SandboxError> for CliError {
    fn from(e: cube_core::SandboxError) -> Self {
        use cube_core::SandboxError as E;
        let message = chain(&e);
        let (code, hint) = match &e {
            E::UnknownSandbox(_) => (3, Some("list sandboxes with `cube sandbox ls`".to_string())),
            // Its message already names `cube template ls`.
            E::UnknownTemplate(_) => (3, None),
            E::EngineMismatch { .. } => (2, None),
            E::UnknownSnapshot(_) => (
                3,
                Some("list snapshots with `cube sandbox snapshots [ID]`".to_string()),
            ),
            // A malformed name can name nothing: a usage error.
            E::Store(cube_storage::StoreError::InvalidName { what, .. }) => (
                2,
                Some(match *what {
                    "sandbox" => {
                        "sandbox ids look like sb-0123456789abcdef: `cube sandbox ls` lists them"
                            .to_string()
                    }
                    "template" => "`cube template ls` lists the templates".to_string(),
                    _ => "`cube sandbox snapshots` lists the snapshots".to_string(),
                }),
            ),
            E::Hibernated(id) => (1, Some(format!("wake it with `cube sandbox wake {id}`"))),
            E::NoAgent(_) => (
                4,
                Some("the jail engine runs commands and code: --engine jail".to_string()),
            ),
            _ => host_hint(&message),
        };
        CliError {
            message,
            hint,
            code,
        }
    }
}

/// The exit code and advice for a failure whose cause is the host, read off the
/// error chain: no KVM points at the jail engine, no reflink at `cube store setup`.
fn host_hint(message: &str) -> (u8, Option<String>) {
    let lower = message.to_lowercase();
    if lower.contains("/dev/kvm") || lower.contains("kvm") && lower.contains("no such file") {
        (
            4,
            Some(
                "this host has no usable KVM: the jail engine works here (--engine jail, \
                 or the built-in `host` template); `cube doctor` lists what this host can do"
                    .to_string(),
            ),
        )
    } else if lower.contains("reflink") {
        (
            4,
            Some(
                "put the store on a reflink-capable filesystem with `cube store setup`".to_string(),
            ),
        )
    } else {
        (1, None)
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

/// Prints a value as pretty JSON on standard output.
pub fn print_json<T: serde::Serialize + ?Sized>(value: &T) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| CliError::failed(chain(&e)))?;
    println!("{text}");
    Ok(())
}

/// The store root chosen on the command line or by default.
pub fn store_root(store: Option<&std::path::Path>) -> Result<PathBuf, CliError> {
    match store {
        Some(p) => Ok(p.to_path_buf()),
        None => cube_storage::Store::default_root().map_err(|e| CliError::failed(chain(&e))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every command and subcommand shows an example in its `--help`.
    #[test]
    fn every_command_has_an_example() {
        fn walk(cmd: &mut clap::Command, path: &str, missing: &mut Vec<String>) {
            let name = format!("{path} {}", cmd.get_name()).trim().to_string();
            let help = cmd.render_long_help().to_string();
            if !help.contains("Example") && cmd.get_name() != "help" {
                missing.push(name.clone());
            }
            for sub in cmd.get_subcommands_mut() {
                walk(sub, &name, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&mut Cli::command(), "", &mut missing);
        assert!(missing.is_empty(), "no example in --help of: {missing:?}");
    }

    /// The help of `cube sandbox create` states the engine's default pids limit.
    #[test]
    fn the_pids_default_in_help_is_the_engines() {
        let mut cli = Cli::command();
        let create = cli
            .find_subcommand_mut("sandbox")
            .and_then(|s| s.find_subcommand_mut("create"))
            .expect("cube sandbox create exists");
        let help = create.render_long_help().to_string();
        let stated = format!("default: {} where", cube_core::DEFAULT_PIDS_MAX);
        assert!(help.contains(&stated), "{help}");
    }

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn no_kvm_points_at_the_jail_engine() {
        let missing = require_kvm(std::path::Path::new("/nonexistent/kvm")).err();
        let e = missing.expect("a missing device is refused");
        assert_eq!(e.code, 4);
        assert!(e.hint.unwrap_or_default().contains("--engine jail"));
        assert!(require_kvm(std::path::Path::new("/")).is_ok());
    }

    #[test]
    fn host_failures_point_at_what_works() {
        let (code, hint) = host_hint("Sandbox sb-1: opening /dev/kvm: No such file or directory");
        assert_eq!(code, 4);
        assert!(hint.unwrap_or_default().contains("--engine jail"));
        let (code, hint) = host_hint("Cannot probe the store for reflink support");
        assert_eq!(code, 4);
        assert!(hint.unwrap_or_default().contains("cube store setup"));
        assert_eq!(host_hint("something else").0, 1);
    }
}
