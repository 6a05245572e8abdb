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

/// Waits (10 s at most) until a host process's command line holds `marker`.
fn wait_until_running(marker: &str) {
    let mut waited = 0;
    while processes_with(marker).is_empty() {
        assert!(waited < 1000, "the command never started");
        std::thread::sleep(std::time::Duration::from_millis(10));
        waited += 1;
    }
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
    wait_until_running(&marker);
    // SAFETY: signals the child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGINT) }, 0);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    assert_eq!(processes_with(&marker), Vec::<String>::new());
    cube.assert_clean(pid);
}

#[test]
fn a_killed_runner_takes_its_sandbox_along_and_the_next_run_sweeps_its_leftovers() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    let marker = format!("cube-killed-runner-marker-{}", std::process::id());
    let script = format!("sleep 1000; : {marker}");
    let mut child = cube.spawn(&["run", "--", "sh", "-c", &script]);
    let pid = child.id();
    wait_until_running(&marker);
    // SIGKILL: cube gets no chance to clean up.
    child.kill().unwrap();
    child.wait().unwrap();
    let mut waited = 0;
    while !processes_with(&marker).is_empty() {
        assert!(
            waited < 500,
            "the sandbox outlived its runner: {:?}",
            processes_with(&marker)
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
        waited += 1;
    }
    // Its directory (and cgroup) stayed; the next run removes them.
    let out = cube.run(&["run", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    cube.assert_clean(pid);
}

/// A pseudo-terminal pair, both ends close-on-exec.
fn open_terminal() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
    use std::os::fd::FromRawFd;
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty writes two descriptors into the live ints; the name, termios and
    // winsize pointers may be null.
    let r = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
    for fd in [master, slave] {
        // SAFETY: sets close-on-exec on a descriptor just opened.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    // SAFETY: both were just opened by openpty and nothing else owns them.
    unsafe {
        (
            std::os::fd::OwnedFd::from_raw_fd(master),
            std::os::fd::OwnedFd::from_raw_fd(slave),
        )
    }
}

/// The terminal settings of `fd`.
fn terminal_settings(fd: &std::os::fd::OwnedFd) -> libc::termios {
    use std::os::fd::AsRawFd;
    // SAFETY: tcgetattr fills in the zeroed termios.
    unsafe {
        let mut t: libc::termios = std::mem::zeroed();
        assert_eq!(libc::tcgetattr(fd.as_raw_fd(), &mut t), 0);
        t
    }
}

#[test]
fn a_host_terminal_is_out_of_reach_of_tiocsti_and_keeps_its_settings() {
    if skip() {
        return;
    }
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let cube = Cube::new();
    // A terminal that is nobody's controlling terminal, as cube's three streams.
    let (master, slave) = open_terminal();
    let before = terminal_settings(&slave);
    // Inside: take the terminal on fd 0 as controlling terminal from a new session,
    // push a command line into its input with TIOCSTI, and turn its echo off.
    let script = r#"
import fcntl, os, sys, termios
print("tty", os.isatty(0), flush=True)
sys.stdout.flush()
pid = os.fork()
if pid == 0:
    os.setsid()
    for name, req, arg in [("sctty", termios.TIOCSCTTY, 0), ("sti", termios.TIOCSTI, b"x")]:
        try:
            fcntl.ioctl(0, req, arg)
            print(name, "ok", flush=True)
        except OSError as e:
            print(name, e.errno, flush=True)
    for c in b"echo INJECTED\n":
        try:
            fcntl.ioctl(0, termios.TIOCSTI, bytes([c]))
        except OSError:
            break
    os._exit(0)
os.waitpid(pid, 0)
attrs = termios.tcgetattr(0)
attrs[3] &= ~(termios.ECHO | termios.ICANON)
termios.tcsetattr(0, termios.TCSANOW, attrs)
print("done", flush=True)
"#;
    let mut command = cube.command(&["run", "--", "python3", "-c", script]);
    let stream = || std::process::Stdio::from(slave.try_clone().unwrap());
    command.stdin(stream()).stdout(stream()).stderr(stream());
    // SAFETY: setsid in the forked child before exec: cube runs without a controlling
    // terminal, as the terminal is nobody's.
    unsafe {
        command.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = command.spawn().unwrap();
    let pid = child.id();
    let status = child.wait().unwrap();
    // What cube wrote to the terminal (a few lines: the terminal's buffer holds them).
    // SAFETY: makes our own descriptor non-blocking.
    unsafe { libc::fcntl(master.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
    let mut output = std::fs::File::from(master.try_clone().unwrap());
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = output.read(&mut buf) {
        if n == 0 {
            break;
        }
        all.extend_from_slice(&buf[..n]);
    }
    let shown = String::from_utf8_lossy(&all).into_owned();
    cube.assert_clean(pid);
    assert_eq!(status.code(), Some(0), "{shown}");
    assert!(shown.contains("done"), "{shown}");
    // The command saw a terminal (its own).
    assert!(shown.contains("tty True"), "{shown}");
    // Nothing was pushed into the host terminal's input...
    // SAFETY: makes our own descriptor non-blocking; then reads into a live buffer.
    let pending = unsafe {
        libc::fcntl(slave.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK);
        let mut buf = [0u8; 64];
        libc::read(slave.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len())
    };
    assert!(
        pending <= 0,
        "input was injected into the host terminal: {shown}"
    );
    // ...and its settings are as they were.
    let after = terminal_settings(&slave);
    let flags = libc::ECHO | libc::ICANON | libc::ISIG;
    assert_eq!(
        after.c_lflag & flags,
        before.c_lflag & flags,
        "the host terminal's settings changed: {shown}"
    );
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
fn the_command_cannot_read_or_write_the_agents_memory_or_take_its_descriptors() {
    if skip() {
        return;
    }
    let cube = Cube::new();
    // The agent (PID 1) holds this process's streams; the command runs as its uid.
    let script = r#"
import os
for path in ["/proc/1/mem", "/proc/1/environ"]:
    try:
        open(path, "rb").close()
        print("OPENED", path)
    except OSError as e:
        print("refused", path, e.errno)
try:
    print("LISTED", os.listdir("/proc/1/fd"))
except OSError as e:
    print("refused fd", e.errno)
"#;
    let out = cube.run(&["run", "--", "python3", "-c", script]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("OPENED"), "{stdout}");
    assert!(!stdout.contains("LISTED"), "{stdout}");
    assert_eq!(stdout.matches("refused").count(), 3, "{stdout}");
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
