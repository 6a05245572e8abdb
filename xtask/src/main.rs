//! `cargo xtask`: one entry point for the loops a contributor runs, each the same
//! commands `.ci/run` and `scripts/` run, so that a green `cargo xtask check` here means
//! a green check stage in CI.
//!
//! ```text
//! cargo xtask check              format, layering, cargo-deny, clippy
//! cargo xtask test-fast [ARGS]   unit tests (lib and bin targets) of the workspace
//! cargo xtask test [ARGS]        the whole suite: the README's test command
//! cargo xtask bench [ARGS]       `cube bench --quick`, vm and jail engines, as CI runs it
//! cargo xtask fuzz [SECONDS]     every fuzz target for SECONDS (default 15) from its seeds
//! cargo xtask wheel              the `cubesandbox` Python wheel (target/wheels/)
//! ```
//!
//! ARGS go to `cargo test` (e.g. `-p cube-storage`, which narrows it from the whole
//! workspace to that package) or to `cube bench`. The alias lives
//! in `.cargo/config.toml`.

use std::env;
use std::ffi::OsString;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

/// Why a task stopped.
#[derive(Debug)]
enum TaskError {
    /// The command line named no task, or one that does not exist.
    Usage(String),
    /// A step's program could not be started (not installed, not executable).
    Spawn {
        program: String,
        source: std::io::Error,
    },
    /// A step ran and exited unsuccessfully.
    Failed { step: String, code: Option<i32> },
    /// A file a step writes could not be created.
    Output {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl fmt::Display for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TaskError::Usage(why) => write!(f, "{why}\n\n{USAGE}"),
            TaskError::Spawn { program, source } => write!(f, "Cannot start {program}: {source}"),
            TaskError::Failed {
                step,
                code: Some(code),
            } => {
                write!(f, "Step failed with exit status {code}: {step}")
            }
            TaskError::Failed { step, code: None } => {
                write!(f, "Step killed by a signal: {step}")
            }
            TaskError::Output { path, source } => {
                write!(f, "Cannot write {}: {source}", path.display())
            }
        }
    }
}

const USAGE: &str = "usage: cargo xtask <task> [args]
  check              format, layering, cargo-deny, clippy (CI's check stages)
  test-fast [ARGS]   unit tests: cargo test --workspace --release --locked --lib --bins ARGS
  test [ARGS]        the whole suite: cargo test --workspace --release --locked ARGS
  bench [ARGS]       cube bench --quick, vm and jail engines (ARGS go to both runs)
  fuzz [SECONDS]     scripts/fuzz-smoke.sh: every fuzz target SECONDS (default 15)
  wheel              scripts/build-wheel.sh: the cubesandbox wheel in target/wheels/";

fn main() -> ExitCode {
    let mut args = env::args_os().skip(1);
    let task = args.next().and_then(|a| a.into_string().ok());
    let rest: Vec<OsString> = args.collect();
    let root = workspace_root();
    let result = match task.as_deref() {
        Some("check") if rest.is_empty() => check(&root),
        Some("test-fast") => cargo_test(&root, &["--lib", "--bins"], &rest),
        Some("test") => cargo_test(&root, &[], &rest),
        Some("bench") => bench(&root, &rest),
        Some("fuzz") => run(Command::new("bash")
            .arg(root.join("scripts/fuzz-smoke.sh"))
            .args(&rest)),
        Some("wheel") if rest.is_empty() => {
            run(Command::new("bash").arg(root.join("scripts/build-wheel.sh")))
        }
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(TaskError::Usage(format!(
            "Unknown task or arguments: {other}"
        ))),
        None => Err(TaskError::Usage("No task given".into())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root: this crate's parent directory, wherever cargo was called from.
fn workspace_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or(manifest_dir)
}

/// CI's check stages, in CI's order: the cheap ones first, so a format slip fails in
/// seconds rather than after clippy's build.
fn check(root: &Path) -> Result<(), TaskError> {
    run(cargo(root).args(["fmt", "--all", "--check"]))?;
    let layering = root.join("scripts/check-layering.py");
    run(Command::new("python3").arg(&layering).arg("--self-test"))?;
    run(Command::new("python3").arg(&layering))?;
    run(Command::new("python3").arg(root.join("scripts/check-feature-unification.py")))?;
    deny(root)?;
    run(cargo(root).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--release",
        "--locked",
        "--",
        "-D",
        "warnings",
    ]))
}

/// cargo-deny's offline checks, with the cargo-deny that scripts/setup-deny.sh installs
/// (it installs it first where it is missing).
fn deny(root: &Path) -> Result<(), TaskError> {
    let setup = root.join("scripts/setup-deny.sh");
    let step = describe(Command::new("bash").arg(&setup));
    let output = Command::new("bash")
        .arg(&setup)
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|source| TaskError::Spawn {
            program: "bash".into(),
            source,
        })?;
    if !output.status.success() {
        return Err(TaskError::Failed {
            step,
            code: output.status.code(),
        });
    }
    let binary = String::from_utf8_lossy(&output.stdout).trim().to_string();
    run(Command::new(root.join(binary)).current_dir(root).args([
        "--offline",
        "check",
        "licenses",
        "bans",
    ]))
}

/// `cargo test` as CI runs it, over the workspace unless ARGS name packages.
fn cargo_test(root: &Path, targets: &[&str], rest: &[OsString]) -> Result<(), TaskError> {
    let names_package = rest.iter().any(|arg| {
        let arg = arg.to_string_lossy();
        arg == "-p" || arg.starts_with("-p") || arg.starts_with("--package")
    });
    let mut command = cargo(root);
    command.arg("test");
    if !names_package {
        command.arg("--workspace");
    }
    run(command
        .args(["--release", "--locked"])
        .args(targets)
        .args(rest))
}

/// The quick benches CI runs, through the `cube` of this tree (its supervisor and agent
/// beside it), each report kept in the target directory and summarised as CI does.
fn bench(root: &Path, rest: &[OsString]) -> Result<(), TaskError> {
    run(cargo(root).args(["build", "--release", "--locked", "--workspace", "--bins"]))?;
    let target = env::var_os("CARGO_TARGET_DIR")
        .map(|dir| root.join(dir))
        .unwrap_or_else(|| root.join("target"));
    let cube = target.join("release/cube");
    for (engine, report) in [
        (None, "bench-quick.json"),
        (Some("jail"), "bench-jail-quick.json"),
    ] {
        let path = target.join(report);
        let file = File::create(&path).map_err(|source| TaskError::Output {
            path: path.clone(),
            source,
        })?;
        let mut command = Command::new(&cube);
        command.args(["bench", "--quick", "--json"]);
        if let Some(engine) = engine {
            command.args(["--engine", engine]);
        }
        run(command.args(rest).stdout(file))?;
        run(Command::new("python3")
            .arg(root.join("scripts/bench-summary.py"))
            .arg(&path))?;
    }
    Ok(())
}

/// `cargo` as the one running xtask (the pinned toolchain), in the workspace root.
fn cargo(root: &Path) -> Command {
    let mut command = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    command.current_dir(root);
    command
}

fn describe(command: &Command) -> String {
    let mut line = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        line.push(' ');
        line.push_str(&arg.to_string_lossy());
    }
    line
}

/// Runs one step, echoing it first, as `.ci/run`'s stages do.
fn run(command: &mut Command) -> Result<(), TaskError> {
    let step = describe(command);
    println!("xtask: $ {step}");
    let status = command.status().map_err(|source| TaskError::Spawn {
        program: command.get_program().to_string_lossy().into_owned(),
        source,
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(TaskError::Failed {
            step,
            code: status.code(),
        })
    }
}
