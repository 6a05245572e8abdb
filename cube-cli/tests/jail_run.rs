//! `cube run` and `cube code` on the jail engine, through the real binary and the real
//! agent. Every test also checks that the invocation left nothing behind: no sandbox
//! directory, no mount under the store, no cgroup, no process.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

const CUBE: &str = env!("CARGO_BIN_EXE_cube");

/// Why this host cannot run jails, if it cannot.
fn skip() -> bool {
    // SAFETY: geteuid has no failure mode.
    let reason = if unsafe { libc::geteuid() } != 0 {
        Some("jails need root (namespaces, mounts, cgroups)")
    } else if !cube_core::testing::cgroups_readable() {
        Some("no cgroup hierarchy is readable")
    } else {
        None
    };
    match reason {
        Some(r) => {
            println!("skipped: {r}");
            true
        }
        None => false,
    }
}

/// True (after printing why) when this host cannot run jails or has no cgroup
/// controller of that name.
fn skip_without_controller(controller: &str) -> bool {
    if skip() {
        return true;
    }
    let has = cube_core::testing::cgroup_controller(controller);
    if !has {
        println!("skipped: no {controller} cgroup controller on this host");
    }
    !has
}

/// The agent binary cargo built next to `cube`; it is built when the cube-agent package
/// is part of the test run (as in `cargo test --workspace`).
fn agent_binary() -> PathBuf {
    let path = Path::new(CUBE).with_file_name("cube-agent");
    assert!(
        path.is_file(),
        "{} is missing: build cube-agent first (cargo build -p cube-agent, or run the \
         tests with --workspace or -p cube-agent -p cube-cli)",
        path.display()
    );
    path
}

/// A private store per test, and the checks that an invocation cleaned up.
struct Cube {
    store: tempfile::TempDir,
}

impl Cube {
    fn new() -> Cube {
        agent_binary();
        Cube {
            store: tempfile::tempdir().unwrap(),
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(CUBE);
        c.arg("--store").arg(self.store.path()).args(args);
        c.env_remove("CUBE_AGENT");
        c
    }

    fn spawn(&self, args: &[&str]) -> Child {
        self.command(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Runs cube to its end and checks it left nothing behind.
    fn run(&self, args: &[&str]) -> Output {
        let child = self.spawn(args);
        let pid = child.id();
        let out = child.wait_with_output().unwrap();
        self.assert_clean(pid);
        out
    }

    fn assert_clean(&self, cube_pid: u32) {
        for dir in ["tmp", "sandboxes"] {
            let dir = self.store.path().join(dir);
            if dir.exists() {
                let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
                assert!(left.is_empty(), "sandbox directories left: {left:?}");
            }
        }
        let store = self.store.path().to_str().unwrap();
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            !mounts.contains(store),
            "mounts left under the store:\n{mounts}"
        );
        let prefix = format!("run-{cube_pid}-");
        let mut found = Vec::new();
        cgroups_named(Path::new("/sys/fs/cgroup"), &prefix, 0, &mut found);
        assert!(found.is_empty(), "cgroups left: {found:?}");
    }
}

fn cgroups_named(dir: &Path, prefix: &str, depth: u32, found: &mut Vec<PathBuf>) {
    if depth > 6 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if e.file_name().to_string_lossy().starts_with(prefix) {
            found.push(e.path());
        }
        cgroups_named(&e.path(), prefix, depth + 1, found);
    }
}

/// Host processes whose command line holds `marker`, leaving out cube itself (whose
/// arguments hold it) and the sandbox's PID 1 before it runs the agent (a copy of cube).
fn processes_with(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(marker) && !cmd.starts_with(CUBE) {
                found.push(format!("{name}: {cmd}"));
            }
        }
    }
    found
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn run_prints_the_commands_output_and_exits_0() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let out = cube.run(&[
        "run",
        "--engine",
        "jail",
        "--",
        "python3",
        "-c",
        "print(6*7)",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "42\n");
}

#[test]
fn run_exits_with_the_commands_code_or_128_plus_its_signal() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let out = cube.run(&["run", "--", "sh", "-c", "exit 3"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let out = cube.run(&["run", "--", "sh", "-c", "kill -9 $$"]);
    assert_eq!(out.status.code(), Some(137), "{}", text(&out.stderr));
    let out = cube.run(&["run", "--", "no-such-command-here"]);
    assert_eq!(out.status.code(), Some(127));
    assert!(text(&out.stderr).contains("no-such-command-here"));
}

#[test]
fn run_streams_stderr_while_the_command_still_runs() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let mut child = cube.spawn(&[
        "run",
        "--",
        "sh",
        "-c",
        "echo early >&2; sleep 3; echo late",
    ]);
    let pid = child.id();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert_eq!(line, "early\n");
    // The line came while the command was still sleeping, not at its end.
    assert!(child.try_wait().unwrap().is_none(), "cube already exited");
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(text(&out.stdout), "late\n");
    cube.assert_clean(pid);
}

#[test]
fn run_hands_the_command_its_streams_stdin_of_any_size_included() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let mut child = cube
        .command(&[
            "run",
            "--",
            "sh",
            "-c",
            "wc -c; test -t 0 || echo not-a-terminal",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stdin = child.stdin.take().unwrap();
    // More than one agent message could carry, written while the command reads.
    let writer = std::thread::spawn(move || stdin.write_all(&vec![b'x'; 5 << 20]).unwrap());
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), format!("{}\nnot-a-terminal\n", 5 << 20));
    cube.assert_clean(pid);
}

#[test]
fn timeout_exits_124_and_leaves_no_process() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let marker = format!("cube-timeout-marker-{}", std::process::id());
    let script = format!("sleep 1000; : {marker}");
    let out = cube.run(&["run", "--timeout", "0.5", "--", "sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(124), "{}", text(&out.stderr));
    assert_eq!(processes_with(&marker), Vec::<String>::new());
}

#[test]
fn interrupt_destroys_the_sandbox_and_exits_130() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let marker = format!("cube-interrupt-marker-{}", std::process::id());
    let script = format!("sleep 1000; : {marker}");
    let child = cube.spawn(&["run", "--", "sh", "-c", &script]);
    let pid = child.id();
    let mut waited = 0;
    while processes_with(&marker).is_empty() {
        assert!(waited < 1000, "the command never started");
        std::thread::sleep(std::time::Duration::from_millis(10));
        waited += 1;
    }
    // SAFETY: signals the child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGINT) }, 0);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    assert_eq!(processes_with(&marker), Vec::<String>::new());
    cube.assert_clean(pid);
}

#[test]
fn the_command_cannot_see_host_processes() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let out = cube.run(&["run", "--", "ls", "/proc"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let pids: Vec<String> = text(&out.stdout)
        .lines()
        .filter(|l| l.bytes().all(|b| b.is_ascii_digit()))
        .map(String::from)
        .collect();
    // The agent (PID 1) and ls itself; the host has many more.
    assert!(pids.contains(&"1".to_string()), "{pids:?}");
    assert!(pids.len() <= 3, "host processes visible: {pids:?}");
}

#[test]
fn the_agent_channel_does_not_leak_into_commands() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let out = cube.run(&["run", "--", "ls", "-l", "/proc/self/fd"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let listing = text(&out.stdout);
    // The command sees its stdio and what it opened itself; never the host's socket.
    assert!(!listing.contains("socket:"), "{listing}");
    assert!(listing.contains("0 -> /dev/null"), "{listing}");
}

#[test]
fn code_prints_the_value_of_the_last_expression() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let out = cube.run(&["code", "1+1"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "2\n");
}

#[test]
fn each_code_invocation_is_a_fresh_sandbox() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let out = cube.run(&["code", "x = 20"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "");
    let out = cube.run(&["code", "x"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("NameError"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_python_error_prints_its_traceback_and_exits_1() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let out = cube.run(&["code", "print('before')\ndef f():\n    return 1/0\nf()"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stdout), "before\n");
    let err = text(&out.stderr);
    assert!(err.contains("Traceback"), "{err}");
    assert!(err.contains("in f"), "{err}");
    assert!(err.contains("ZeroDivisionError"), "{err}");
}

#[test]
fn code_reads_stdin_and_runs_bash() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let mut child = cube
        .command(&["code", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"print('from stdin')\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "from stdin\n");
    cube.assert_clean(pid);

    let out = cube.run(&["code", "--language", "bash", "echo $((6*7))"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "42\n");
}

#[test]
fn the_vm_engine_is_refused_with_a_pointer_to_the_jail() {
    let cube = Cube::new();
    let out = cube.run(&["run", "--engine", "vm", "--", "true"]);
    assert_eq!(out.status.code(), Some(4));
    let err = text(&out.stderr);
    assert!(err.contains("vm engine cannot run commands yet"), "{err}");
    assert!(err.contains("--engine jail"), "{err}");
    assert!(!cube.store.path().join("tmp").exists());
}

#[test]
fn memory_mib_limits_the_sandbox() {
    if skip_without_controller("memory") {
        return;
    }
    let cube = Cube::new();
    // The hog is the sandbox's largest process, so the OOM killer picks it, not the agent.
    let hog = "x = bytearray(512 << 20); print('survived')";
    let out = cube.run(&["run", "--memory-mib", "128", "--", "python3", "-c", hog]);
    assert_eq!(out.status.code(), Some(137), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "");
    let out = cube.run(&[
        "run",
        "--memory-mib",
        "128",
        "--",
        "python3",
        "-c",
        "print(1)",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

#[test]
fn pids_max_stops_a_fork_bomb_inside_the_sandbox() {
    if skip_without_controller("pids") {
        return;
    }
    let cube = Cube::new();
    // Forks until the kernel refuses, then reports how many it got and exits 0: the
    // limit, not the host, ends the bomb.
    let bomb = r#"
import os, time
n = 0
try:
    while n < 10000:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print('refused after', n, e.errno)
"#;
    let out = cube.run(&["run", "--pids-max", "16", "--", "python3", "-c", bomb]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let forked: u32 = stdout
        .strip_prefix("refused after ")
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected output: {stdout:?}"));
    // The agent and python count too.
    assert!(forked < 16, "{stdout:?}");
    assert!(
        stdout.trim_end().ends_with(&format!(" {}", libc::EAGAIN)),
        "{stdout:?}"
    );
    let out = cube.run(&["run", "--pids-max", "0", "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}
