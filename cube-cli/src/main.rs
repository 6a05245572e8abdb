//! `cube`: create and drive sandboxes, check the host, and benchmark.

mod bench;
mod build_progress;
mod debug_cmd;
mod doctor;
mod run_cmd;
mod sandbox_cmd;
mod store_cmd;
mod template_build_cmd;
mod vm_template_cmd;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Cube: fast, snapshot-able sandboxes for AI agents.
#[derive(Parser)]
#[command(name = "cube", version, about, long_about = None)]
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
    #[command(subcommand)]
    Store(store_cmd::StoreCommand),
    /// Manage templates.
    #[command(subcommand)]
    Template(sandbox_cmd::TemplateCommand),
    /// Manage sandboxes that live across invocations.
    #[command(subcommand)]
    Sandbox(sandbox_cmd::SandboxCommand),
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
    #[command(subcommand)]
    Debug(debug_cmd::DebugCommand),
}

fn main() -> ExitCode {
    // Output piped into `head` should end quietly, as other Unix tools do, instead of
    // panicking on a closed pipe.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CUBE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
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
        Command::Run(args) => run_cmd::run(store, &args),
        Command::Code(args) => run_cmd::code(store, &args),
        Command::Debug(cmd) => debug_cmd::run(cmd).map(|()| 0),
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
        let code = match e {
            cube_core::SandboxError::UnknownSandbox(_)
            | cube_core::SandboxError::UnknownTemplate(_)
            | cube_core::SandboxError::UnknownSnapshot(_) => 3,
            _ => 1,
        };
        CliError {
            message: chain(&e),
            hint: None,
            code,
        }
    }
}

/// The store root chosen on the command line or by default.
pub fn store_root(store: Option<&std::path::Path>) -> Result<PathBuf, CliError> {
    match store {
        Some(p) => Ok(p.to_path_buf()),
        None => cube_storage::Store::default_root().map_err(|e| CliError::failed(chain(&e))),
    }
}
