//! A jail sandbox's state as the long-running suites check it: a Python variable in
//! the agent's context, files written at known moments, a background server process
//! and its listening socket; plus the check that destroy leaves nothing behind.

use std::path::Path;
use std::time::{Duration, Instant};

use cube_agent::client::Client;
use cube_agent::protocol::ExecRequest;
use cube_core::Sandbox;

use cube_core::testing::TestGuestControl;
use cube_core::MachineStatus;

use super::{counter, dirty_area_words, pattern_words, py, wait_counter_above, wait_until};

/// The abstract unix socket the background server listens on inside the sandbox.
///
/// Not TCP: CRIU 4.1 cannot dump an inet socket on Linux 6.16 and later (the kernel
/// refuses SO_PASSCRED/SO_PASSSEC on them, which CRIU reads for every socket), so a
/// jail holding one gets filesystem-only snapshots and loses its processes on
/// hibernate. Abstract, so that no socket file is involved.
pub const SERVER_SOCKET: &str = "cube-test-server";

/// The background server: accepts on SERVER_SOCKET for ever and answers each
/// connection with its own pid, so a check sees the same process still serving.
const SERVER: &str = r#"import os, socket
s = socket.socket(socket.AF_UNIX)
s.bind('\0' + os.environ['NAME'])
s.listen(16)
open(os.environ['HOME'] + '/srv.pid.tmp', 'w').write(str(os.getpid()))
os.rename(os.environ['HOME'] + '/srv.pid.tmp', os.environ['HOME'] + '/srv.pid')
while True:
    c, _ = s.accept()
    c.sendall(b'pong %d' % os.getpid())
    c.close()
"#;

/// Runs `script` with /bin/sh in the sandbox; its stdout, after asserting it exited 0.
pub fn sh(client: &Client, script: &str) -> String {
    let out = client
        .exec(ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            ..ExecRequest::default()
        })
        .expect("exec in the sandbox");
    assert_eq!(
        out.exit.code,
        Some(0),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What a jail sandbox is expected to hold: the variable's value, the files written
/// so far (name and content), and the server's pid.
#[derive(Clone, Debug)]
pub struct JailState {
    /// Value of `x` in the agent's Python context "py".
    pub x: i64,
    /// Files under `$HOME/state/`, in the order written.
    pub files: Vec<(String, String)>,
    /// The background server's pid (inside the sandbox's pid namespace).
    pub server_pid: u32,
}

impl JailState {
    /// Sets `x`, writes a first file and starts the background server in `agent`'s
    /// sandbox; the state that results.
    pub fn start(agent: &Client) -> JailState {
        assert_eq!(py(agent, "x = 0\nx"), "0");
        let script = format!(
            "mkdir -p $HOME/state && echo before > $HOME/state/f-before && \
             cat > $HOME/srv.py <<'EOF'\n{SERVER}EOF\n\
             NAME={SERVER_SOCKET} setsid python3 $HOME/srv.py </dev/null >$HOME/srv.log 2>&1 &"
        );
        sh(agent, &script);
        let ready = wait_until(Duration::from_secs(20), || {
            sh(agent, "cat $HOME/srv.pid 2>/dev/null || true")
                .trim()
                .parse::<u32>()
                .is_ok()
        });
        assert!(
            ready,
            "the background server never started: {}",
            sh(agent, "cat $HOME/srv.log; ip addr 2>&1; ps ax 2>&1 || true")
        );
        let server_pid = sh(agent, "cat $HOME/srv.pid").trim().parse().unwrap();
        JailState {
            x: 0,
            files: vec![("f-before".into(), "before".into())],
            server_pid,
        }
    }

    /// Sets `x` to `x` and writes file `name` holding `content`, recording both.
    pub fn advance(&mut self, agent: &Client, x: i64, name: &str, content: &str) {
        assert_eq!(py(agent, &format!("x = {x}\nx")), x.to_string());
        sh(agent, &format!("echo {content} > $HOME/state/{name}"));
        match self.files.iter_mut().find(|(n, _)| n == name) {
            Some(entry) => entry.1 = content.to_string(),
            None => self.files.push((name.to_string(), content.to_string())),
        }
        self.x = x;
    }

    /// Asserts that `agent`'s sandbox holds this state exactly: the variable, every
    /// file and no other, the same server process, still accepting.
    pub fn check(&self, agent: &Client, when: &str) {
        assert_eq!(py(agent, "x"), self.x.to_string(), "{when}: the variable");
        let listing = sh(
            agent,
            "cd $HOME/state && for f in $(ls); do echo \"$f=$(cat $f)\"; done",
        );
        let mut expected: Vec<String> =
            self.files.iter().map(|(n, c)| format!("{n}={c}")).collect();
        expected.sort();
        let mut found: Vec<String> = listing.lines().map(str::to_string).collect();
        found.sort();
        assert_eq!(found, expected, "{when}: the files");
        let reply = sh(
            agent,
            &format!(
                "python3 -c \"import socket; s = socket.socket(socket.AF_UNIX); \
                 s.settimeout(10); s.connect('\\0{SERVER_SOCKET}'); print(s.recv(64).decode())\""
            ),
        );
        assert_eq!(
            reply.trim(),
            format!("pong {}", self.server_pid),
            "{when}: the background server"
        );
    }
}

/// The test guest's state: the pattern its dirty area holds.
pub struct VmState {
    /// The first word of the first page; each next page holds one more.
    pub pattern: u64,
}

/// Pages of the dirty area the checks cover (1 MiB).
pub const VM_PAGES: u64 = 256;

impl VmState {
    /// Has the guest write `pattern` over the checked pages (the guest idles after).
    pub fn set(sb: &mut Sandbox, pattern: u64) -> VmState {
        sb.guest_spin(false).unwrap();
        sb.guest_dirty(1, pattern).unwrap();
        VmState { pattern }
    }

    /// The memory holds the pattern, and the guest runs on (its counter moves, its
    /// self-check sees memory and registers agree).
    pub fn check(&self, sb: &mut Sandbox, when: &str) {
        assert_eq!(
            dirty_area_words(sb, VM_PAGES),
            pattern_words(self.pattern, VM_PAGES),
            "{when}: guest memory"
        );
        sb.guest_spin(true).unwrap();
        let now = counter(sb);
        wait_counter_above(sb, now);
        sb.guest_spin(false).unwrap();
        let status = sb.status().unwrap();
        assert_eq!(status.status, MachineStatus::Running, "{when}");
        assert!(!status.guest_error, "{when}: the guest's self-check failed");
    }
}

/// Destroys `sb` and checks that its supervisor, processes, cgroups, layer, socket,
/// directory and mounts are all gone.
pub fn destroy_and_check(mut sb: Sandbox) {
    let status = sb.status().expect("status");
    let jail = status.jail.clone().expect("a jail sandbox");
    let dir = sb.dir().to_path_buf();
    let pids: Vec<u32> = jail
        .cgroups
        .iter()
        .flat_map(|d| {
            std::fs::read_to_string(d.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
                .map(|l| l.parse::<u32>().expect("a pid"))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(!pids.is_empty(), "the sandbox's cgroups hold its processes");
    sb.destroy().expect("destroy");
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{}", status.pid)).exists() {
        assert!(Instant::now() < deadline, "the supervisor survived destroy");
        std::thread::sleep(Duration::from_millis(10));
    }
    for pid in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} survived"
        );
    }
    for cg in &jail.cgroups {
        assert!(!cg.exists(), "cgroup {} survived", cg.display());
    }
    assert!(!jail.layer.exists(), "layer survived");
    assert!(!jail.agent_socket.exists(), "agent socket survived");
    assert!(!dir.exists(), "sandbox directory survived");
    assert!(
        cube_jail::rootfs::mounts_under(&dir)
            .expect("mount table")
            .is_empty(),
        "a mount survived"
    );
}

/// A count from environment variable `var` (the full-size runs set it), else `default`.
pub fn count_from_env(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
