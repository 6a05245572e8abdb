//! Runs the real agent binary over a unix socket and drives it with the client.

// Test helpers outside #[test] functions panic on failure like the tests do.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cube_agent::client::{Client, ClientError};
use cube_agent::frame::MAX_FRAME_LEN;
use cube_agent::protocol::{
    ErrorCode, ErrorReply, ExecRequest, ExitInfo, FileKind, Language, RequestBody, ResponseBody,
    TerminalSize, UserSpec, REQUEST_KINDS,
};

const AGENT: &str = env!("CARGO_BIN_EXE_cube-agent");

/// The agent process; killed and waited for on drop.
struct AgentProcess {
    child: Child,
    /// The agent's pid as the host sees it.
    pid: i32,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl AgentProcess {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let child = Command::new(AGENT)
            .arg("--listen")
            .arg(&socket)
            .arg("--grace-ms")
            .arg("500")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let agent = Self {
            child,
            pid,
            socket,
            _dir: dir,
        };
        agent.wait_for_socket();
        agent
    }

    /// Starts the agent as PID 1 of a new PID namespace, or says why it cannot.
    fn start_in_pid_namespace() -> Result<Self, String> {
        let probe = Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc", "true"])
            .stderr(Stdio::null())
            .status()
            .map_err(|e| format!("unshare not runnable: {e}"))?;
        if !probe.success() {
            return Err("unshare --pid --fork --mount-proc is not permitted here".into());
        }
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let child = Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc", "--kill-child"])
            .arg(AGENT)
            .arg("--listen")
            .arg(&socket)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let unshare_pid = child.id() as i32;
        let mut agent = Self {
            child,
            pid: 0,
            socket,
            _dir: dir,
        };
        agent.wait_for_socket();
        agent.pid = *children_of(unshare_pid)
            .first()
            .ok_or("the agent is not a child of unshare")?;
        Ok(agent)
    }

    fn wait_for_socket(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&self.socket).is_err() {
            assert!(Instant::now() < deadline, "agent socket never appeared");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn client(&self) -> Client {
        Client::connect_unix(&self.socket).unwrap()
    }

    fn vm_hwm_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }
}

impl AgentProcess {
    /// Sends SIGTERM and waits for the process started (the agent, or unshare around it)
    /// to exit; returns its exit code.
    fn terminate(&mut self) -> Option<i32> {
        // SAFETY: plain kill(2) of the agent this test started.
        assert_eq!(unsafe { libc::kill(self.pid, libc::SIGTERM) }, 0);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                self.pid = 0;
                return status.code();
            }
            assert!(Instant::now() < deadline, "the agent ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if self.pid > 0 {
            // A clean shutdown first, so the agent removes what it made (context dirs).
            // SAFETY: plain kill(2) of a process this test started.
            unsafe { libc::kill(self.pid, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if self.pid > 0 {
            // SAFETY: plain kill(2) of a process this test started.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `(pid, ppid, state, pgrp)` of every process, read from /proc.
fn processes() -> Vec<(i32, i32, char, i32)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // The command name is in parentheses and may contain spaces.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() < 3 {
            continue;
        }
        let state = f[0].chars().next().unwrap_or('?');
        out.push((
            pid,
            f[1].parse().unwrap_or(0),
            state,
            f[2].parse().unwrap_or(0),
        ));
    }
    out
}

fn children_of(ppid: i32) -> Vec<i32> {
    processes()
        .into_iter()
        .filter(|p| p.1 == ppid)
        .map(|p| p.0)
        .collect()
}

fn is_gone_or_zombie(pid: i32) -> bool {
    processes()
        .into_iter()
        .find(|p| p.0 == pid)
        .is_none_or(|p| p.2 == 'Z' || p.2 == 'X')
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn sh(script: &str) -> ExecRequest {
    ExecRequest {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

/// The standard output a call streams until its exec's exit, and that exit.
fn stdout_until_exit(call: &mut cube_agent::client::Call) -> (Vec<u8>, ExitInfo) {
    let mut out = Vec::new();
    loop {
        match call.recv().unwrap() {
            Some(ResponseBody::Stdout(b)) => out.extend(b),
            Some(ResponseBody::Exited(e)) => return (out, e),
            other => panic!("{other:?}"),
        }
    }
}

/// Starts `script` (which prints "before" first) on a connection of its own, reads
/// its start and that line, and closes the connection; the exec's pid.
fn start_then_close(agent: &AgentProcess, script: &str) -> u32 {
    let first = agent.client();
    let mut call = first.start(RequestBody::Exec(sh(script))).unwrap();
    let pid = match call.recv().unwrap() {
        Some(ResponseBody::Started { pid }) => pid,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        call.recv().unwrap(),
        Some(ResponseBody::Stdout(b"before\n".to_vec()))
    );
    pid
}

fn agent_error<T: std::fmt::Debug>(r: Result<T, ClientError>) -> ErrorReply {
    match r {
        Err(ClientError::Agent(e)) => e,
        other => panic!("expected an agent error, got {other:?}"),
    }
}

#[test]
fn health_and_version() {
    let agent = AgentProcess::start();
    let client = agent.client();
    assert!(matches!(
        client.call(RequestBody::Health).unwrap(),
        ResponseBody::Healthy { .. }
    ));
    match client.call(RequestBody::Version).unwrap() {
        ResponseBody::Version { protocol, agent } => {
            assert_eq!(protocol, cube_agent::protocol::PROTOCOL_VERSION);
            assert_eq!(agent, env!("CARGO_PKG_VERSION"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn two_execs_stream_at_once() {
    let agent = AgentProcess::start();
    let client = Arc::new(agent.client());
    // Each prints, then waits for a file the *other* one creates after printing; so each
    // can only end if the other's output was streamed while it was still running.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let script = |me: &str, other: &str| {
        format!(
            "echo {me}-start; touch {d}/{me}; while [ ! -e {d}/{other} ]; do sleep 0.01; done; echo {me}-end"
        )
    };
    let mut a = client
        .start(RequestBody::Exec(sh(&script("a", "b"))))
        .unwrap();
    let mut b = client
        .start(RequestBody::Exec(sh(&script("b", "a"))))
        .unwrap();
    let collect = |call: &mut cube_agent::client::Call| {
        let mut out = Vec::new();
        let mut exit = None;
        while let Some(body) = call.recv_timeout(Duration::from_secs(20)).unwrap() {
            match body {
                ResponseBody::Stdout(bytes) => out.extend(bytes),
                ResponseBody::Exited(e) => exit = Some(e),
                ResponseBody::Started { .. } => {}
                other => panic!("{other:?}"),
            }
        }
        (String::from_utf8(out).unwrap(), exit.unwrap())
    };
    let (out_a, exit_a) = collect(&mut a);
    let (out_b, exit_b) = collect(&mut b);
    assert_eq!(out_a, "a-start\na-end\n");
    assert_eq!(out_b, "b-start\nb-end\n");
    assert_eq!((exit_a.code, exit_b.code), (Some(0), Some(0)));

    // Output arrives while the process still runs: the first chunk comes before the
    // process is told (by a file) that it may finish.
    let gate = dir.path().join("gate");
    let mut call = client
        .start(RequestBody::Exec(sh(&format!(
            "echo ready; while [ ! -e {} ]; do sleep 0.01; done; echo done",
            gate.display()
        ))))
        .unwrap();
    assert!(matches!(
        call.recv().unwrap(),
        Some(ResponseBody::Started { .. })
    ));
    assert_eq!(
        call.recv().unwrap(),
        Some(ResponseBody::Stdout(b"ready\n".to_vec()))
    );
    std::fs::write(&gate, b"").unwrap();
    assert_eq!(
        call.recv().unwrap(),
        Some(ResponseBody::Stdout(b"done\n".to_vec()))
    );
    assert!(matches!(
        call.recv().unwrap(),
        Some(ResponseBody::Exited(_))
    ));
}

#[test]
fn bad_frames_get_errors_and_serving_goes_on() {
    let agent = AgentProcess::start();
    let client = agent.client();

    // Garbage: no id can be read, so the answer comes under id 0.
    client
        .send_raw(&[4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff])
        .unwrap();
    let resp = client.next_unsolicited(Duration::from_secs(20)).unwrap();
    assert_eq!(resp.id, 0);
    assert!(matches!(
        resp.body,
        ResponseBody::Error(ErrorReply {
            code: ErrorCode::Malformed,
            ..
        })
    ));

    // An unknown request kind: answered under its id.
    let mut body = postcard::to_allocvec(&777u64).unwrap();
    body.extend(postcard::to_allocvec(&(REQUEST_KINDS + 5)).unwrap());
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend(&body);
    client.send_raw(&frame).unwrap();
    let resp = client.next_unsolicited(Duration::from_secs(20)).unwrap();
    assert_eq!(resp.id, 777);
    assert!(matches!(
        resp.body,
        ResponseBody::Error(ErrorReply {
            code: ErrorCode::UnknownMessage,
            ..
        })
    ));

    // Oversized: skipped whole, answered under the id at its start.
    let len = MAX_FRAME_LEN + 4096;
    let mut frame = len.to_le_bytes().to_vec();
    frame.extend(postcard::to_allocvec(&888u64).unwrap());
    frame.resize(4 + len as usize, 0x5a);
    client.send_raw(&frame).unwrap();
    let resp = client.next_unsolicited(Duration::from_secs(20)).unwrap();
    assert_eq!(resp.id, 888);
    assert!(matches!(
        resp.body,
        ResponseBody::Error(ErrorReply {
            code: ErrorCode::TooLarge,
            ..
        })
    ));

    // Still serving, on the same stream.
    let out = client.exec(sh("echo alive")).unwrap();
    assert_eq!(out.stdout, b"alive\n");
}

#[test]
fn exec_env_cwd_stdin_user_and_exit() {
    let agent = AgentProcess::start();
    let client = agent.client();
    let dir = tempfile::tempdir().unwrap();
    client
        .set_env(vec![("SANDBOX_WIDE".into(), "yes".into())], vec![])
        .unwrap();
    let mut req = sh("echo $SANDBOX_WIDE $MINE; pwd; tr a-z A-Z; echo err >&2; exit 4");
    req.env = vec![("MINE".into(), "mine".into())];
    req.cwd = Some(dir.path().display().to_string());
    req.stdin = b"hello stdin".to_vec();
    let out = client.exec(req).unwrap();
    let cwd = dir.path().canonicalize().unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("yes mine\n{}\nHELLO STDIN", cwd.display())
    );
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.exit.code, Some(4));

    // Per-exec env overrides the sandbox-wide one; unset removes it.
    let mut req = sh("echo ${SANDBOX_WIDE:-none}");
    req.env = vec![("SANDBOX_WIDE".into(), "over".into())];
    assert_eq!(client.exec(req).unwrap().stdout, b"over\n");
    client.set_env(vec![], vec!["SANDBOX_WIDE".into()]).unwrap();
    assert_eq!(
        client
            .exec(sh("echo ${SANDBOX_WIDE:-none}"))
            .unwrap()
            .stdout,
        b"none\n"
    );

    // Running as another user works when the agent is root.
    let mut req = sh("id -u; id -g");
    req.user = Some(UserSpec {
        uid: 65534,
        gid: 65534,
    });
    let out = client.exec(req);
    if nix::unistd::geteuid().is_root() {
        assert_eq!(out.unwrap().stdout, b"65534\n65534\n");
    } else {
        assert_eq!(agent_error(out).code, ErrorCode::PermissionDenied);
    }

    // A program that does not exist, and an empty argv.
    let missing = ExecRequest {
        argv: vec!["/no/such/program".into()],
        ..Default::default()
    };
    assert_eq!(agent_error(client.exec(missing)).code, ErrorCode::NotFound);
    assert_eq!(
        agent_error(client.exec(ExecRequest::default())).code,
        ErrorCode::InvalidArgument
    );
}

#[test]
fn exec_timeout_kill_and_background() {
    let agent = AgentProcess::start();
    let client = agent.client();

    // Timeout: the whole group dies, children included.
    let mut req = sh("sleep 30 & echo $!; sleep 30");
    req.timeout_ms = Some(300);
    let out = client.exec(req).unwrap();
    assert!(out.exit.timed_out);
    assert_eq!(out.exit.signal, Some(libc::SIGKILL));
    let grandchild: i32 = String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    wait_until("the timed-out grandchild is gone", || {
        is_gone_or_zombie(grandchild)
    });

    // Background: started, left running, killed later by id with its children, waited.
    let mut req = sh("sleep 30 & sleep 30; exit 0");
    req.background = true;
    let mut call = client.start(RequestBody::Exec(req)).unwrap();
    let pgid = match call.recv().unwrap() {
        Some(ResponseBody::Started { pid }) => pid as i32,
        other => panic!("{other:?}"),
    };
    let exec_id = call.id;
    drop(call);
    wait_until("the background group has two sleeps", || {
        processes().iter().filter(|p| p.3 == pgid).count() >= 3
    });
    client.kill(exec_id, libc::SIGTERM).unwrap();
    let exit = client.wait(exec_id).unwrap();
    assert_eq!(exit.signal, Some(libc::SIGTERM));
    wait_until("the whole group is gone", || {
        let left: Vec<_> = processes().into_iter().filter(|p| p.3 == pgid).collect();
        left.iter().all(|p| p.2 == 'Z')
    });
    assert_eq!(
        agent_error(client.kill(exec_id, libc::SIGTERM)).code,
        ErrorCode::NoSuchExec
    );

    // Background exec that ends on its own is waited for afterwards.
    let mut req = sh("exit 9");
    req.background = true;
    let call = client.start(RequestBody::Exec(req)).unwrap();
    let id = call.id;
    assert!(matches!(call.finish().unwrap(), ResponseBody::Exited(_)));
    assert_eq!(client.wait(id).unwrap().code, Some(9));
    assert_eq!(agent_error(client.wait(id)).code, ErrorCode::NoSuchExec);

    // Killing an exec that has ended.
    let mut req = sh("sleep 0.05");
    req.background = true;
    let call = client.start(RequestBody::Exec(req)).unwrap();
    let id = call.id;
    call.finish().unwrap();
    assert_eq!(
        agent_error(client.kill(id, libc::SIGKILL)).code,
        ErrorCode::NotRunning
    );
}

/// A deterministic byte stream of a given length, never held whole in memory.
struct Pattern {
    left: u64,
    state: u32,
}

impl Read for Pattern {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (buf.len() as u64).min(self.left) as usize;
        for b in &mut buf[..n] {
            self.state = self.state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            *b = (self.state >> 16) as u8;
        }
        self.left -= n as u64;
        Ok(n)
    }
}

struct Crc(crc32fast::Hasher, u64);

impl Write for Crc {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        self.1 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn files_stream_64_mib_in_bounded_memory() {
    const SIZE: u64 = 64 * 1024 * 1024;
    let agent = AgentProcess::start();
    let client = agent.client();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/dir/big.bin").display().to_string();

    let mut expected = Crc(crc32fast::Hasher::new(), 0);
    std::io::copy(
        &mut Pattern {
            left: SIZE,
            state: 1,
        },
        &mut expected,
    )
    .unwrap();
    let written = client
        .write_file(
            &path,
            &mut Pattern {
                left: SIZE,
                state: 1,
            },
        )
        .unwrap();
    assert_eq!(written, SIZE);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), SIZE);

    let mut got = Crc(crc32fast::Hasher::new(), 0);
    assert_eq!(client.read_file(&path, &mut got).unwrap(), SIZE);
    assert_eq!(got.1, SIZE);
    assert_eq!(got.0.finalize(), expected.0.finalize());

    let hwm_kib = agent.vm_hwm_kib();
    println!("agent peak RSS: {hwm_kib} KiB for a {SIZE}-byte round trip");
    assert!(
        hwm_kib * 1024 < SIZE / 4,
        "agent peak RSS {hwm_kib} KiB is not far below the {SIZE}-byte file"
    );
}

#[test]
fn files_list_stat_mkdir_remove_rename_and_errors() {
    let agent = AgentProcess::start();
    let client = agent.client();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().display().to_string();
    let p = |rel: &str| format!("{root}/{rel}");

    client.make_dir(&p("a/b/c"), true).unwrap();
    client.make_dir(&p("a/b/c"), true).unwrap();
    client.write_file(&p("a/one.txt"), &mut &b"1"[..]).unwrap();
    client
        .write_file(&p("a/b/two.txt"), &mut &b"22"[..])
        .unwrap();
    client
        .write_file(&p("a/b/c/three.txt"), &mut &b"333"[..])
        .unwrap();

    let names = |depth| {
        let mut v: Vec<String> = client
            .list_dir(&p("a"), depth)
            .unwrap()
            .into_iter()
            .map(|e| e.path.strip_prefix(&p("a")).unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(1), ["/b", "/one.txt"]);
    assert_eq!(names(2), ["/b", "/b/c", "/b/two.txt", "/one.txt"]);
    assert_eq!(
        names(3),
        ["/b", "/b/c", "/b/c/three.txt", "/b/two.txt", "/one.txt"]
    );

    let st = client.stat(&p("a/b/two.txt")).unwrap();
    assert_eq!((st.kind, st.size), (FileKind::File, 2));
    assert_eq!(client.stat(&p("a/b")).unwrap().kind, FileKind::Dir);
    assert!(client.exists(&p("a/one.txt")).unwrap());
    assert!(!client.exists(&p("a/nope")).unwrap());

    client.rename(&p("a/one.txt"), &p("a/b/moved.txt")).unwrap();
    assert!(!client.exists(&p("a/one.txt")).unwrap());
    let mut back = Vec::new();
    client.read_file(&p("a/b/moved.txt"), &mut back).unwrap();
    assert_eq!(back, b"1");

    assert_eq!(
        agent_error(client.stat(&p("missing"))).code,
        ErrorCode::NotFound
    );
    assert_eq!(
        agent_error(client.list_dir(&p("a/b/two.txt"), 1)).code,
        ErrorCode::NotADirectory
    );
    assert_eq!(
        agent_error(client.read_file(&p("a"), &mut Vec::new())).code,
        ErrorCode::IsADirectory
    );
    assert_eq!(
        agent_error(client.remove(&p("a"), false)).code,
        ErrorCode::NotEmpty
    );
    assert_eq!(
        agent_error(client.make_dir(&p("x/y"), false)).code,
        ErrorCode::NotFound
    );
    assert_eq!(
        agent_error(client.list_dir(&p("a"), 0)).code,
        ErrorCode::InvalidArgument
    );
    client.remove(&p("a"), true).unwrap();
    assert!(!client.exists(&p("a")).unwrap());
    assert!(!Path::new(&p("a")).exists());
}

#[test]
fn reaps_orphans_as_subreaper() {
    let agent = AgentProcess::start();
    check_orphan_reaped(&agent);
}

#[test]
fn reaps_orphans_as_pid1() {
    let agent = match AgentProcess::start_in_pid_namespace() {
        Ok(a) => a,
        Err(reason) => {
            println!("skipped: {reason}");
            return;
        }
    };
    let client = agent.client();
    // PID 1 inside: the exec sees its own shell's parent as 1.
    let out = client.exec(sh("echo $PPID")).unwrap();
    assert_eq!(out.stdout, b"1\n");
    drop(client);
    check_orphan_reaped(&agent);
    // PID 1 gets no default signal actions; SIGTERM from the parent namespace must
    // still shut it down cleanly.
    let mut agent = agent;
    assert_eq!(agent.terminate(), Some(0));
}

fn check_orphan_reaped(agent: &AgentProcess) {
    let client = agent.client();
    // The orphan lets go of the exec's pipes so the exec is answered at once.
    let out = client.exec(sh("sleep 2 >/dev/null 2>&1 & exit 0")).unwrap();
    assert_eq!(out.exit.code, Some(0));
    // The orphaned sleep is re-parented to the agent, then reaped when it ends.
    let adopted = children_of(agent.pid);
    assert!(
        !adopted.is_empty(),
        "the orphan was not re-parented to the agent"
    );
    wait_until("the orphan is reaped", || {
        processes()
            .iter()
            .all(|p| !(adopted.contains(&p.0) && p.1 == agent.pid))
    });
    // Exec statuses still reach exec while the reaper reaps everything.
    for code in 0..5 {
        let out = client.exec(sh(&format!("exit {code}"))).unwrap();
        assert_eq!(out.exit.code, Some(code));
    }
}

#[test]
fn sigterm_forwards_and_exits_cleanly() {
    let mut agent = AgentProcess::start();
    let client = agent.client();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("got-term");
    let mut req = sh(&format!(
        "trap 'echo term > {}; exit 0' TERM; echo ready; sleep 30 & wait",
        marker.display()
    ));
    req.background = true;
    let mut call = client.start(RequestBody::Exec(req)).unwrap();
    let pid = match call.recv().unwrap() {
        Some(ResponseBody::Started { pid }) => pid as i32,
        other => panic!("{other:?}"),
    };
    // The trap is set once the shell says so.
    assert_eq!(
        call.recv().unwrap(),
        Some(ResponseBody::Stdout(b"ready\n".to_vec()))
    );
    assert_eq!(agent.terminate(), Some(0));
    // The exec got the forwarded SIGTERM itself (not only the SIGKILL after the grace).
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "term\n");
    wait_until("the exec is gone", || is_gone_or_zombie(pid));
    wait_until("its group is gone", || {
        processes().iter().all(|p| p.3 != pid || p.2 == 'Z')
    });
}

#[test]
fn run_code_contexts_over_the_wire() {
    let have_python = Command::new("python3")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have_python {
        println!("skipped: python3 is not installed");
        return;
    }
    let agent = AgentProcess::start();
    let client = Arc::new(agent.client());
    client
        .create_context("one", Language::Python, None)
        .unwrap();
    client
        .create_context("two", Language::Python, None)
        .unwrap();
    assert_eq!(
        agent_error(client.create_context("one", Language::Python, None)).code,
        ErrorCode::AlreadyExists
    );
    client.run_code("one", "n = 1", None).unwrap();
    client.run_code("two", "n = 2", None).unwrap();

    // A long cell in one context does not hold up another.
    let slow_client = Arc::clone(&client);
    let slow = std::thread::spawn(move || {
        slow_client.run_code(
            "one",
            "import time\nwhile True:\n    time.sleep(0.01)",
            Some(Duration::from_millis(500)),
        )
    });
    let r = client.run_code("two", "n * 10", None).unwrap();
    assert_eq!(r.value.as_deref(), Some("20"));
    let r = slow.join().unwrap().unwrap();
    assert!(r.timed_out);
    assert_eq!(r.error.unwrap().name, "KeyboardInterrupt");
    let r = client.run_code("one", "print('n is', n)\nn", None).unwrap();
    assert_eq!(r.stdout, "n is 1\n");
    assert_eq!(r.value.as_deref(), Some("1"));

    let r = client.run_code("one", "{}['missing']", None).unwrap();
    let e = r.error.unwrap();
    assert_eq!(
        (e.name.as_str(), e.value.as_str()),
        ("KeyError", "'missing'")
    );
    assert!(e.traceback.contains("KeyError"));

    let names: Vec<String> = client
        .list_contexts()
        .unwrap()
        .into_iter()
        .map(|c| c.name)
        .collect();
    assert_eq!(names, ["one", "two"]);
    client.delete_context("one").unwrap();
    assert_eq!(
        agent_error(client.run_code("one", "n", None)).code,
        ErrorCode::NoSuchContext
    );
}

/// The host binds the socket and hands the agent the listening descriptor: the path
/// may lie where the agent cannot see it (outside a jail's root).
#[test]
fn listen_fd_serves_a_socket_the_host_bound() {
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixListener;
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("host-side.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let fd = listener.as_raw_fd();
    let mut command = Command::new(AGENT);
    command.args(["--listen-fd", "3"]).stdin(Stdio::null());
    // SAFETY: dup2 is async-signal-safe; it clears FD_CLOEXEC on the new fd 3.
    unsafe {
        command.pre_exec(move || {
            // dup2 onto itself would keep FD_CLOEXEC: clear it explicitly then.
            let r = if fd == 3 {
                libc::fcntl(3, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, 3)
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command.spawn().unwrap();
    drop(listener);
    let client = Client::connect_unix(&socket).unwrap();
    let out = client
        .exec(ExecRequest {
            argv: vec!["sh".into(), "-c".into(), "echo fd-mode".into()],
            ..ExecRequest::default()
        })
        .unwrap();
    assert_eq!(out.stdout, b"fd-mode\n");
    // A second client is served too: it is a listener, not one stream.
    assert!(matches!(
        Client::connect_unix(&socket)
            .unwrap()
            .call(RequestBody::Health),
        Ok(ResponseBody::Healthy { .. })
    ));
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn listen_fd_that_is_not_a_listener_is_an_error() {
    let status = Command::new(AGENT)
        .args(["--listen-fd", "0"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success());
}

#[test]
fn exec_with_stdin_takes_input_until_closed() {
    let agent = AgentProcess::start();
    let client = agent.client();
    let mut call = client
        .start(RequestBody::ExecWithStdin(sh(
            "while read l; do echo got:$l; done; echo eof",
        )))
        .unwrap();
    assert!(matches!(
        call.recv().unwrap(),
        Some(ResponseBody::Started { .. })
    ));
    let write = |data: &[u8]| {
        client.call(RequestBody::StdinWrite {
            exec_id: call.id,
            data: data.to_vec(),
        })
    };
    assert_eq!(write(b"one\n").unwrap(), ResponseBody::Done);
    assert_eq!(write(b"two\n").unwrap(), ResponseBody::Done);
    assert_eq!(
        client
            .call(RequestBody::StdinClose { exec_id: call.id })
            .unwrap(),
        ResponseBody::Done
    );
    let (out, exit) = stdout_until_exit(&mut call);
    assert_eq!(String::from_utf8(out).unwrap(), "got:one\ngot:two\neof\n");
    assert_eq!(exit.code, Some(0));
    // Closed, then gone: both answered with errors, never a hang.
    let err = agent_error(client.call(RequestBody::StdinWrite {
        exec_id: call.id,
        data: b"late".to_vec(),
    }));
    assert_eq!(err.code, ErrorCode::NoSuchExec);
    // A plain exec has no input to write to.
    let mut plain = client.start(RequestBody::Exec(sh("sleep 5"))).unwrap();
    assert!(matches!(
        plain.recv().unwrap(),
        Some(ResponseBody::Started { .. })
    ));
    let err = agent_error(client.call(RequestBody::StdinWrite {
        exec_id: plain.id,
        data: b"x".to_vec(),
    }));
    assert_eq!(err.code, ErrorCode::NotRunning);
    client.kill(plain.id, 9).unwrap();
    // Initial bytes and an input kept open do not mix.
    let err = agent_error(client.call(RequestBody::ExecWithStdin(ExecRequest {
        stdin: b"x".to_vec(),
        ..sh("cat")
    })));
    assert_eq!(err.code, ErrorCode::InvalidArgument);
}

#[test]
fn tcp_connect_carries_a_connection_to_a_local_port() {
    let agent = AgentProcess::start();
    let client = agent.client();
    // A server "inside the sandbox": this test's own loopback, as the agent sees it.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut req = Vec::new();
        conn.read_to_end(&mut req).unwrap();
        conn.write_all(b"echo:").unwrap();
        conn.write_all(&req).unwrap();
    });
    let mut call = client.start(RequestBody::TcpConnect { port }).unwrap();
    assert!(matches!(
        call.recv().unwrap(),
        Some(ResponseBody::Started { pid: 0 })
    ));
    client
        .send(
            call.id,
            RequestBody::TcpSend {
                data: b"hello".to_vec(),
            },
        )
        .unwrap();
    client
        .send(call.id, RequestBody::TcpSend { data: vec![] })
        .unwrap();
    let mut got = Vec::new();
    loop {
        match call.recv().unwrap() {
            Some(ResponseBody::Stdout(b)) => got.extend(b),
            Some(ResponseBody::Done) => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got, b"echo:hello");
    server.join().unwrap();
    // Nothing listens on a port just freed: the error says so.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_port = free.local_addr().unwrap().port();
    drop(free);
    let err = agent_error(client.call(RequestBody::TcpConnect { port: closed_port }));
    assert!(err.message.contains("connecting"), "{}", err.message);
}

/// Output an exec writes after its connection closed and before anyone follows it
/// (what a checkpoint's dropped connections leave) reaches the next follower first.
#[test]
fn output_nobody_heard_reaches_the_next_follower() {
    let agent = AgentProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let (go, printed, go2) = (
        dir.path().join("go"),
        dir.path().join("printed"),
        dir.path().join("go2"),
    );
    let script = format!(
        "echo before; while [ ! -e {go} ]; do sleep 0.02; done; echo gap; touch {printed}; \
         while [ ! -e {go2} ]; do sleep 0.02; done; echo after; exit 3",
        go = go.display(),
        printed = printed.display(),
        go2 = go2.display()
    );
    // The first connection closes once the exec printed "before".
    let pid = start_then_close(&agent, &script);
    std::fs::write(&go, b"").unwrap();
    wait_until("the exec wrote with nobody listening", || printed.exists());
    // Well past the agent's poll step: it has read the line and found nobody.
    std::thread::sleep(Duration::from_millis(300));
    let second = agent.client();
    let mut follow = second.attach(pid).unwrap();
    assert_eq!(follow.recv().unwrap(), Some(ResponseBody::Started { pid }));
    std::fs::write(&go2, b"").unwrap();
    let (out, exit) = stdout_until_exit(&mut follow);
    // Without the unheard output kept, the follower sees only "after".
    assert_eq!(String::from_utf8_lossy(&out), "gap\nafter\n");
    assert_eq!(exit.code, Some(3));
}

/// An exec outlives its connection; another connection follows it by pid (what a host
/// does after a checkpoint dropped its connections), gets its later output and its
/// exit, and signals it under the attach's id.
#[test]
fn attach_follows_an_exec_of_a_closed_connection() {
    let agent = AgentProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let script = format!(
        "echo before; while [ ! -e {} ]; do sleep 0.02; done; echo after; exit 5",
        go.display()
    );
    // The first connection closes once the exec printed "before"; the exec runs on.
    let pid = start_then_close(&agent, &script);
    let second = agent.client();
    let mut follow = second.attach(pid).unwrap();
    assert_eq!(follow.recv().unwrap(), Some(ResponseBody::Started { pid }));
    std::fs::write(&go, b"").unwrap();
    let (out, exit) = stdout_until_exit(&mut follow);
    assert_eq!(out, b"after\n");
    assert_eq!(exit.code, Some(5));
    // Ended and forgotten: nothing to follow under its pid any more.
    assert_eq!(
        agent_error(second.attach(pid).and_then(|c| c.finish())).code,
        ErrorCode::NoSuchExec
    );

    // A kill under the attach's id reaches the followed exec's group.
    let sleeper = {
        let first = agent.client();
        let mut call = first.start(RequestBody::Exec(sh("sleep 30"))).unwrap();
        match call.recv().unwrap() {
            Some(ResponseBody::Started { pid }) => pid,
            other => panic!("{other:?}"),
        }
    };
    let follow = second.attach(sleeper).unwrap();
    let id = follow.id;
    let waiter = std::thread::spawn(move || follow.finish());
    wait_until("the attach is in place", || {
        second.kill(id, libc::SIGTERM).is_ok()
    });
    match waiter.join().unwrap().unwrap() {
        ResponseBody::Exited(e) => assert_eq!(e.signal, Some(libc::SIGTERM)),
        other => panic!("{other:?}"),
    }
}

/// Output of `call` until `marker` appears in it (an exec on a terminal writes in
/// pieces).
fn stdout_until(call: &mut cube_agent::client::Call, marker: &str) -> String {
    let mut out = Vec::new();
    while !String::from_utf8_lossy(&out).contains(marker) {
        match call.recv().unwrap() {
            Some(ResponseBody::Stdout(b)) => out.extend(b),
            other => panic!(
                "before {marker:?} in {:?}: {other:?}",
                String::from_utf8_lossy(&out)
            ),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn exec_in_a_terminal_is_typed_into_resized_and_killed() {
    let agent = AgentProcess::start();
    let client = agent.client();
    let mut call = client
        .start(RequestBody::ExecInTerminal {
            root: None,
            size: TerminalSize { rows: 33, cols: 77 },
            exec: sh("tty; stty size; exec 3</dev/tty && echo controlling; \
                      echo TERM=$TERM; echo ready; read l; stty size; echo got:$l; exit 4"),
        })
        .unwrap();
    assert!(matches!(
        call.recv().unwrap(),
        Some(ResponseBody::Started { .. })
    ));
    let first = stdout_until(&mut call, "ready");
    assert!(first.contains("/dev/pts/"), "{first:?}");
    assert!(first.contains("33 77\r\n"), "size at start: {first:?}");
    // /dev/tty opens only for a process with a controlling terminal.
    assert!(first.contains("controlling"), "{first:?}");
    assert!(first.contains("TERM=xterm\r\n"), "{first:?}");
    client
        .resize_terminal(
            call.id,
            TerminalSize {
                rows: 40,
                cols: 100,
            },
        )
        .unwrap();
    client.write_stdin(call.id, b"hi\n".to_vec()).unwrap();
    let (rest, exit) = stdout_until_exit(&mut call);
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.contains("40 100\r\n"),
        "size after the resize: {rest:?}"
    );
    assert!(rest.contains("got:hi\r\n"), "{rest:?}");
    assert_eq!(exit.code, Some(4));

    // A signal reaches the session the exec leads.
    let mut sleeper = client
        .start(RequestBody::ExecInTerminal {
            root: None,
            size: TerminalSize::default(),
            exec: sh("sleep 30 & echo started; wait"),
        })
        .unwrap();
    assert!(matches!(
        sleeper.recv().unwrap(),
        Some(ResponseBody::Started { .. })
    ));
    stdout_until(&mut sleeper, "started");
    client.kill(sleeper.id, libc::SIGKILL).unwrap();
    let (_, exit) = stdout_until_exit(&mut sleeper);
    assert_eq!(exit.signal, Some(libc::SIGKILL));

    // A plain exec has no terminal to resize; a terminal takes no initial bytes.
    let mut plain = client.start(RequestBody::Exec(sh("sleep 5"))).unwrap();
    assert!(matches!(
        plain.recv().unwrap(),
        Some(ResponseBody::Started { .. })
    ));
    let err = agent_error(client.resize_terminal(plain.id, TerminalSize::default()));
    assert_eq!(err.code, ErrorCode::NotRunning);
    assert!(err.message.contains("has no terminal"), "{}", err.message);
    client.kill(plain.id, 9).unwrap();
    let err = agent_error(client.call(RequestBody::ExecInTerminal {
        root: None,
        size: TerminalSize::default(),
        exec: ExecRequest {
            stdin: b"x".to_vec(),
            ..sh("cat")
        },
    }));
    assert_eq!(err.code, ErrorCode::InvalidArgument);
}
