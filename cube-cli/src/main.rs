//! `cube`: create and drive sandboxes, check the host, and benchmark.

mod bench;
mod build_progress;
mod cli_error;
mod debug_cmd;
mod doctor;
mod files_cmd;
mod interrupts;
mod net_cmd;
pub mod progress;
mod run_cmd;
mod sandbox_cmd;
mod serve_cmd;
mod snapshot_cmd;
mod store_cmd;
mod table;
mod template_build_cmd;
mod terminal;
mod tty_exec;

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
    /// Serve E2B's API: E2B's SDKs create and drive Cube sandboxes through it.
    ///
    /// Example: CUBE_API_KEY=... cube serve --listen 127.0.0.1:3000
    Serve(serve_cmd::ServeArgs),
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
        Command::Serve(args) => serve_cmd::run(store, &args),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "cube", &mut std::io::stdout());
            Ok(0)
        }
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            // Messages can quote what a sandbox said (a file name, an agent error):
            // shown, never acted on by the terminal.
            eprintln!("cube: {}", table::printable_lines(&e.message));
            if let Some(hint) = e.hint {
                eprintln!("hint: {}", table::printable_lines(&hint));
            }
            ExitCode::from(e.code)
        }
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

    /// The help of `cube sandbox create` and `cube run` states the engine's default
    /// limits.
    #[test]
    fn the_limit_defaults_in_help_are_the_engines() {
        let mut cli = Cli::command();
        for path in [&["sandbox", "create"][..], &["run"][..]] {
            let mut cmd = &mut cli;
            for name in path {
                cmd = cmd
                    .find_subcommand_mut(name)
                    .unwrap_or_else(|| panic!("cube {path:?} exists"));
            }
            let help = cmd.render_long_help().to_string().replace('\n', " ");
            let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
            for stated in [
                format!("default: {} where", cube_core::DEFAULT_PIDS_MAX),
                format!("default: {} where", cube_core::DEFAULT_MEMORY_MIB),
                format!("default: {} where", cube_core::DEFAULT_CPU_MILLIS),
                format!("default: {} on", cube_core::DEFAULT_DISK_MIB),
            ] {
                assert!(help.contains(&stated), "{path:?}: {stated} missing: {help}");
            }
        }
    }

    /// Concurrency 0 ran no create and reported a row of zeros at millions per second.
    #[test]
    fn a_scaling_level_of_zero_is_refused() {
        let err = Cli::try_parse_from(["cube", "bench", "--scaling", "--levels", "1,0"])
            .err()
            .expect("level 0 refused");
        assert!(err.to_string().contains("--levels"), "{err}");
        assert!(Cli::try_parse_from(["cube", "bench", "--scaling", "--levels", "1,8"]).is_ok());
    }

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
