//! Full-process-state checkpoints through CRIU: a Python interpreter holding state in a
//! jail is dumped, rolled back and cloned; damaged images are refused without harming
//! the running sandbox; nothing is left after destroy.
//!
//! PID 1 of each sandbox is a small Python read-eval loop on pipes passed in as fds 3
//! (requests) and 4 (replies), the way a supervisor talks to a sandbox's agent: at
//! restore the supervisor hands in new pipes. (Pipes, not a socketpair: CRIU finds
//! sockets through the dumped network namespace and cannot see a socket made outside.)

// Helpers outside #[test] functions panic like the tests they serve.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use cube_jail::checkpoint::{self, CheckpointError, DumpOptions};
use cube_jail::{Criu, Jail, JailConfig, Stdio};

/// Each line received is a Python statement or expression; the reply is one line: the
/// repr of the expression's value ("None" for a statement) or "ERR <exception>".
const REPL: &str = r#"
import os
requests = os.fdopen(3, "rb", buffering=0)
replies = os.fdopen(4, "wb", buffering=0)
ns = {}
while True:
    line = requests.readline()
    if not line:
        break
    code = line.decode()
    try:
        try:
            r = repr(eval(code, ns))
        except SyntaxError:
            exec(code, ns)
            r = "None"
    except Exception as e:
        r = "ERR " + type(e).__name__ + ": " + str(e)
    replies.write((r.replace("\n", " ") + "\n").encode())
"#;

/// The sandbox's mounts as (mount point, file system, security-relevant flags),
/// sorted: a Python expression for the REPL.
const MOUNT_FLAGS: &str = "sorted((l.split()[4], l.split(' - ')[1].split()[0], \
    sorted(set(l.split()[5].split(',')) & {'ro', 'nosuid', 'nodev', 'noexec'})) \
    for l in open('/proc/self/mountinfo'))";

/// The host ends of a sandbox's REPL pipes.
struct Repl {
    writer: File,
    reader: BufReader<File>,
}

/// The sandbox's ends of the REPL pipes, to install as fds 3 and 4.
struct SandboxEnds {
    requests: OwnedFd,
    replies: OwnedFd,
}

impl SandboxEnds {
    fn fds(&self) -> [(BorrowedFd<'_>, i32); 2] {
        [(self.requests.as_fd(), 3), (self.replies.as_fd(), 4)]
    }
}

impl Repl {
    fn new() -> (Repl, SandboxEnds) {
        let (req_r, req_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let (rep_r, rep_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        (
            Repl {
                writer: File::from(req_w),
                reader: BufReader::new(File::from(rep_r)),
            },
            SandboxEnds {
                requests: req_r,
                replies: rep_w,
            },
        )
    }

    fn eval(&mut self, code: &str) -> String {
        self.writer.write_all(code.as_bytes()).unwrap();
        self.writer.write_all(b"\n").unwrap();
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        assert!(line.ends_with('\n'), "the sandbox closed its pipe");
        line.trim_end().to_owned()
    }
}

/// The CRIU to use, or None after saying why these tests cannot run here.
fn criu() -> Option<Criu> {
    if common::skip() || common::skip_without_python() {
        return None;
    }
    match Criu::probe() {
        Ok(c) => Some(c),
        Err(e) => {
            println!("skipped: no working CRIU: {e}");
            None
        }
    }
}

fn config(tmp: &Path, test: &str) -> JailConfig {
    let mut c = common::config(tmp, test);
    c.stdout = Stdio::Null;
    c
}

/// Starts the REPL as PID 1 of a jail.
fn spawn_repl(config: &JailConfig) -> (Jail, Repl) {
    let (repl, ends) = Repl::new();
    let jail =
        Jail::spawn_with_fds(config, &["/usr/bin/python3", "-u", "-c", REPL], &ends.fds()).unwrap();
    (jail, repl)
}

/// Restores `image` as `config`, with fresh pipes for the REPL.
fn restore_repl(criu: &Criu, image: &Path, config: &JailConfig) -> (Jail, Repl) {
    let (repl, ends) = Repl::new();
    let jail = checkpoint::restore(criu, image, config, &ends.fds())
        .unwrap_or_else(|e| panic!("restore failed: {e}"));
    (jail, repl)
}

fn dump_options(leave_running: bool) -> DumpOptions {
    DumpOptions {
        leave_running,
        passed_fds: vec![3, 4],
    }
}

/// Destroys `jail` and checks that none of its processes, cgroups or files remain.
fn destroy_and_check(jail: Jail) {
    let state_dir = jail.state_dir().unwrap().to_path_buf();
    let cgroups: Vec<PathBuf> = jail
        .cgroup()
        .unwrap()
        .dirs()
        .map(Path::to_path_buf)
        .collect();
    let pid = jail.pid();
    jail.destroy().unwrap();
    assert!(!state_dir.exists(), "{} is left", state_dir.display());
    for dir in cgroups {
        assert!(!dir.exists(), "cgroup {} is left", dir.display());
    }
    // SAFETY: signal 0 only checks whether the PID exists.
    assert_ne!(unsafe { libc::kill(pid, 0) }, 0, "PID 1 {pid} still exists");
    assert!(common::host_mounts_under(&state_dir).is_empty());
}

#[test]
fn rollback_brings_back_variables_files_and_isolation() {
    let Some(criu) = criu() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), "rollback");
    let (mut jail, mut repl) = spawn_repl(&c);
    assert_eq!(repl.eval("x = 41"), "None");
    assert_eq!(
        repl.eval("open('/home/user/note', 'w').write('before')"),
        "6"
    );
    assert_eq!(repl.eval("import os"), "None");
    assert_eq!(repl.eval("os.getpid()"), "1");
    // The tmpfs mounts' contents, which Cube saves and restores itself.
    assert_eq!(repl.eval("open('/tmp/t', 'w').write('in tmp')"), "6");
    assert_eq!(repl.eval("os.mkfifo('/tmp/fifo')"), "None");
    assert_eq!(repl.eval("open('/dev/shm/s', 'w').write('in shm')"), "6");
    let mounts_before = repl.eval(MOUNT_FLAGS);
    let image = tmp.path().join("image");
    let cp = checkpoint::dump(&criu, &jail, &image, &dump_options(false)).unwrap();
    assert_eq!(cp.passed_fds(), vec![3, 4]);
    assert_eq!(cp.source_name(), c.name);
    // Without leave_running the sandbox's processes are gone.
    let mut rest = String::new();
    let _ = repl.reader.read_to_string(&mut rest);
    jail.wait().unwrap();
    destroy_and_check(jail);

    // The same name and directory again: a rollback.
    let (jail, mut repl) = restore_repl(&criu, &image, &c);
    assert_eq!(repl.eval("x + 1"), "42");
    assert_eq!(repl.eval("open('/home/user/note').read()"), "'before'");
    assert_eq!(repl.eval("open('/tmp/t').read()"), "'in tmp'");
    assert_eq!(
        repl.eval("__import__('stat').S_ISFIFO(os.stat('/tmp/fifo').st_mode)"),
        "True"
    );
    assert_eq!(repl.eval("open('/dev/shm/s').read()"), "'in shm'");
    assert_eq!(repl.eval("open('/dev/null', 'w').write('x')"), "1");
    assert_eq!(repl.eval("len(open('/dev/urandom', 'rb').read(8))"), "8");
    // Every mount of the sandbox, with its flags (nosuid, nodev, noexec, ro), as
    // before the dump.
    assert_eq!(repl.eval(MOUNT_FLAGS), mounts_before);
    assert_eq!(repl.eval("os.getpid()"), "1");
    let id = jail.identity();
    assert!(cube_jail::sandbox_uid::RANGE.contains(&id.uid));
    assert_eq!(
        repl.eval("os.getuid(), os.getgid()"),
        format!("({}, {})", id.uid, id.gid)
    );
    let status = repl.eval("open('/proc/self/status').read()");
    assert!(status.contains("NoNewPrivs:\\t1"), "{status}");
    assert!(status.contains("Seccomp:\\t2"), "{status}");
    assert!(status.contains("CapEff:\\t0000000000000000"), "{status}");
    // The host userland is still read-only, and the host's processes invisible.
    assert!(
        repl.eval("open('/usr/cube-write-test', 'w')")
            .starts_with("ERR "),
        "/usr became writable"
    );
    let pids = repl.eval("sorted(int(p) for p in os.listdir('/proc') if p.isdigit())");
    assert_eq!(pids, "[1]");
    assert_eq!(repl.eval("__import__('socket').gethostname()"), "'sandbox'");
    // The network namespace is not in the images: restore made a new one, with only
    // loopback, and up. (CRIU 4.1 cannot dump TCP sockets on this kernel, so the
    // listener is made after the restore.)
    assert_eq!(repl.eval("import socket"), "None");
    assert_eq!(repl.eval("socket.if_nameindex()"), "[(1, 'lo')]");
    assert_eq!(
        repl.eval(
            "srv = socket.create_server(('127.0.0.1', 0)); \
             c = socket.create_connection(srv.getsockname()); c.sendall(b'hi')"
        ),
        "None"
    );
    assert_eq!(repl.eval("srv.accept()[0].recv(2)"), "b'hi'");
    // The restored sandbox is in the new cgroups, as their only process.
    let procs = jail.cgroup().unwrap().procs().unwrap();
    assert_eq!(procs, vec![jail.pid()]);
    assert_eq!(
        repl.eval("open('/proc/self/cgroup').read().count('::/\\n')"),
        "1",
        "the cgroup namespace is rooted at the sandbox cgroup"
    );
    destroy_and_check(jail);
}

/// The options of the sandbox's `/` mount, as its own mountinfo shows them.
fn root_mount_options(repl: &mut Repl) -> String {
    repl.eval("[l.split()[5] for l in open('/proc/self/mountinfo') if l.split()[4] == '/'][0]")
}

#[test]
fn a_restored_root_keeps_nosuid_and_nodev_and_a_socket_file_does_not_stop_a_dump() {
    let Some(criu) = criu() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), "mountflags");
    let (source, mut repl) = spawn_repl(&c);
    let spawned = root_mount_options(&mut repl);
    for flag in ["nosuid", "nodev"] {
        assert!(spawned.contains(flag), "spawned root: {spawned}");
    }
    // A socket file left in the writable layer (bound, then closed): nothing a copy of
    // the layer can hold, and no reason to refuse the snapshot.
    assert_eq!(
        repl.eval(
            "__import__('socket').socket(1).bind('/home/user/stale.sock') or \
             __import__('os').path.exists('/home/user/stale.sock')"
        ),
        "True"
    );
    let image = tmp.path().join("image");
    checkpoint::dump(&criu, &source, &image, &dump_options(true))
        .unwrap_or_else(|e| panic!("dump failed: {e}"));
    let clone_config = config(tmp.path(), "mountflags-clone");
    let (clone, mut b) = restore_repl(&criu, &image, &clone_config);
    let restored = root_mount_options(&mut b);
    for flag in ["nosuid", "nodev"] {
        assert!(restored.contains(flag), "restored root: {restored}");
    }
    destroy_and_check(clone);
    destroy_and_check(source);
}

#[test]
fn a_clone_starts_from_the_snapshot_and_diverges_from_its_source() {
    let Some(criu) = criu() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), "source");
    let (source, mut a) = spawn_repl(&c);
    assert_eq!(a.eval("x = [1]"), "None");
    assert_eq!(a.eval("open('/home/user/f', 'w').write('a')"), "1");
    let image = tmp.path().join("image");
    checkpoint::dump(&criu, &source, &image, &dump_options(true)).unwrap();
    // The source goes on where it was.
    assert_eq!(a.eval("x"), "[1]");

    let clone_config = config(tmp.path(), "clone");
    let (clone, mut b) = restore_repl(&criu, &image, &clone_config);
    assert_ne!(clone.pid(), source.pid());
    assert_eq!(clone.name(), clone_config.name);
    assert_eq!(b.eval("x"), "[1]");
    assert_eq!(b.eval("open('/home/user/f').read()"), "'a'");
    // Each in its own cgroups: the clone's limits and freezer apply to the clone alone.
    let procs = |j: &Jail| {
        let mut p = j.cgroup().unwrap().procs().unwrap();
        p.dedup();
        p
    };
    assert_eq!(procs(&clone), vec![clone.pid()]);
    assert_eq!(procs(&source), vec![source.pid()]);
    clone.pause().unwrap();
    assert_eq!(a.eval("x"), "[1]", "pausing the clone froze the source");
    clone.resume().unwrap();

    assert_eq!(b.eval("x.append(2)"), "None");
    assert_eq!(b.eval("open('/home/user/f', 'w').write('bb')"), "2");
    assert_eq!(a.eval("x"), "[1]", "the source saw the clone's change");
    assert_eq!(a.eval("open('/home/user/f').read()"), "'a'");
    assert_eq!(a.eval("x.append(3)"), "None");
    assert_eq!(b.eval("x"), "[1, 2]", "the clone saw the source's change");

    // A second clone of the same snapshot is independent of both.
    let third_config = config(tmp.path(), "third");
    let (third, mut t) = restore_repl(&criu, &image, &third_config);
    assert_eq!(t.eval("x"), "[1]");
    assert_eq!(t.eval("open('/home/user/f').read()"), "'a'");

    destroy_and_check(third);
    destroy_and_check(clone);
    assert_eq!(a.eval("x"), "[1, 3]");
    destroy_and_check(source);
}

#[test]
fn a_damaged_image_is_refused_and_the_sandbox_keeps_running() {
    let Some(criu) = criu() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), "intact");
    let (source, mut a) = spawn_repl(&c);
    assert_eq!(a.eval("y = 'kept'"), "None");
    let image = tmp.path().join("image");
    checkpoint::dump(&criu, &source, &image, &dump_options(true)).unwrap();
    assert!(matches!(
        checkpoint::dump(&criu, &source, &image, &dump_options(true)),
        Err(CheckpointError::ImageDirExists(_))
    ));

    let target = config(tmp.path(), "fromdamaged");
    let (_repl, ends) = Repl::new();
    let restore = |dir: &Path| checkpoint::restore(&criu, dir, &target, &ends.fds());

    // A restore without the pipes fds 3 and 4 need is refused before anything is made.
    assert!(matches!(
        checkpoint::restore(&criu, &image, &target, &[]),
        Err(CheckpointError::MissingFd(3))
    ));

    // CRIU's own images garbled: their recorded checksums refuse them before CRIU
    // runs.
    let damaged = tmp.path().join("damaged");
    cube_storage::reflink::clone_tree(&image, &damaged).unwrap();
    let mut garbled = 0;
    for entry in std::fs::read_dir(damaged.join("images")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("pstree") || name.starts_with("core-") || name.starts_with("mm-") {
            let len = std::fs::metadata(&path).unwrap().len() as usize;
            std::fs::write(&path, vec![0xa5; len.max(16)]).unwrap();
            garbled += 1;
        }
    }
    assert!(garbled >= 3, "expected pstree, core and mm images");
    let err = restore(&damaged).unwrap_err();
    assert!(
        matches!(&err, CheckpointError::BadManifest { reason, .. } if reason.contains("damaged")),
        "{err}"
    );
    println!("garbled images: {err}");

    // The manifest missing, or not ours.
    std::fs::remove_file(damaged.join(checkpoint::MANIFEST)).unwrap();
    assert!(matches!(
        restore(&damaged),
        Err(CheckpointError::NotACheckpoint(_))
    ));
    std::fs::write(damaged.join(checkpoint::MANIFEST), b"{\"format\": 1}").unwrap();
    assert!(matches!(
        restore(&damaged),
        Err(CheckpointError::BadManifest { .. })
    ));

    // Each failed restore left nothing behind, and the source still runs.
    assert!(!target.state_dir.exists());
    let layout = cube_jail::CgroupLayout::detect().unwrap();
    let v2 = layout
        .v2
        .as_ref()
        .map(|h| h.mount.join("cube").join(&target.name));
    assert!(v2.is_none_or(|d| !d.exists()));
    assert_eq!(a.eval("y"), "'kept'");

    // And the intact image still restores.
    let (clone, mut b) = restore_repl(&criu, &image, &target);
    assert_eq!(b.eval("y"), "'kept'");
    destroy_and_check(clone);
    destroy_and_check(source);
}

/// The cube-agent binary: `$CUBE_AGENT`, else next to this test's target directory.
fn agent_binary() -> Option<PathBuf> {
    let path = match std::env::var_os("CUBE_AGENT") {
        Some(p) => PathBuf::from(p),
        None => std::env::current_exe()
            .ok()?
            .parent()?
            .parent()?
            .join("cube-agent"),
    };
    path.is_file().then_some(path)
}

/// Connects to the agent listening on `/tmp/agent.sock` of the sandbox whose PID 1 is
/// `pid`, through that process's root, retrying while the socket is being bound.
fn connect_agent(pid: i32) -> cube_agent::client::Client {
    let path = PathBuf::from(format!("/proc/{pid}/root/tmp/agent.sock"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match cube_agent::client::Client::connect_unix(&path) {
            Ok(c) => return c,
            Err(e) if std::time::Instant::now() > deadline => panic!("agent: {e}"),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    }
}

/// Waits until PID 1 holds no socket but its listener: the host's connections are
/// gone, which CRIU needs (it cannot dump a connection whose far end is outside).
fn wait_for_disconnect(pid: i32) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let sockets = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
            .filter(|l| l.to_string_lossy().starts_with("socket:"))
            .count();
        if sockets <= 1 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the agent kept {sockets} sockets"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The agent as PID 1, listening inside the sandbox, with a Python context: the way
/// the Sandbox API runs code. The context's variable survives a dump and shows in a
/// clone, which diverges from the source.
#[test]
fn an_agent_python_context_survives_dump_and_clone() {
    let Some(criu) = criu() else { return };
    let Some(agent) = agent_binary() else {
        println!("skipped: the cube-agent binary is not built (cargo build -p cube-agent)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut c = config(tmp.path(), "agent");
    c.stderr = Stdio::Null;
    c.binds.push(cube_jail::ReadOnlyBind {
        source: agent,
        target: PathBuf::from("/.cube/cube-agent"),
    });
    let source = Jail::spawn(&c, &["/.cube/cube-agent", "--listen", "/tmp/agent.sock"]).unwrap();
    let client = connect_agent(source.pid());
    client
        .create_context("py", cube_agent::protocol::Language::Python, None)
        .unwrap();
    let r = client.run_code("py", "x = 41", None).unwrap();
    assert!(r.error.is_none(), "{r:?}");
    drop(client);
    wait_for_disconnect(source.pid());

    let image = tmp.path().join("image");
    checkpoint::dump(
        &criu,
        &source,
        &image,
        &DumpOptions {
            leave_running: true,
            passed_fds: Vec::new(),
        },
    )
    .unwrap();

    let clone_config = {
        let mut cc = config(tmp.path(), "agentclone");
        cc.stderr = Stdio::Null;
        cc.binds = c.binds.clone();
        cc
    };
    let clone = checkpoint::restore(&criu, &image, &clone_config, &[]).unwrap();
    let b = connect_agent(clone.pid());
    let r = b.run_code("py", "x + 1", None).unwrap();
    assert_eq!(r.value.as_deref(), Some("42"), "{r:?}");
    b.run_code("py", "x = 'clone'", None).unwrap();

    let a = connect_agent(source.pid());
    let r = a.run_code("py", "x", None).unwrap();
    assert_eq!(r.value.as_deref(), Some("41"), "{r:?}");
    drop((a, b));
    destroy_and_check(clone);
    destroy_and_check(source);
}

/// A sandbox on an overlay root (template trees under a per-sandbox upper directory):
/// the clone gets the template through a new overlay and the source's upper layer as
/// it was at the dump.
#[test]
fn an_overlay_root_sandbox_clones() {
    let Some(criu) = criu() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let template = tmp.path().join("template");
    std::fs::create_dir_all(template.join("srv")).unwrap();
    std::fs::write(template.join("srv/hello.txt"), "from the template").unwrap();
    let overlay = |test: &str| {
        let mut c = config(tmp.path(), test);
        c.root = cube_jail::RootSpec::Overlay {
            lower: vec![template.clone()],
            host_userland: true,
        };
        c
    };
    let c = overlay("ovl");
    let (source, mut a) = spawn_repl(&c);
    assert_eq!(a.eval("x = 5"), "None");
    assert_eq!(a.eval("open('/home/user/f', 'w').write('layer')"), "5");
    assert_eq!(
        a.eval("open('/srv/hello.txt').read()"),
        "'from the template'"
    );
    let image = tmp.path().join("image");
    checkpoint::dump(&criu, &source, &image, &dump_options(true)).unwrap();

    // The checkpoint's root kind and the configuration's must agree.
    let (_r, ends) = Repl::new();
    let mismatch = checkpoint::restore(&criu, &image, &config(tmp.path(), "plain"), &ends.fds());
    assert!(
        matches!(mismatch, Err(CheckpointError::UnsupportedRoot(_))),
        "{mismatch:?}"
    );

    let (clone, mut b) = restore_repl(&criu, &image, &overlay("ovlclone"));
    assert_eq!(b.eval("x"), "5");
    assert_eq!(b.eval("open('/home/user/f').read()"), "'layer'");
    assert_eq!(
        b.eval("open('/srv/hello.txt').read()"),
        "'from the template'"
    );
    assert_eq!(b.eval("open('/home/user/f', 'w').write('clone')"), "5");
    assert_eq!(a.eval("open('/home/user/f').read()"), "'layer'");
    let root = b.eval(
        "[l.split(' - ')[1].split()[0] for l in open('/proc/self/mountinfo') \
         if l.split()[4] == '/']",
    );
    assert_eq!(root, "['overlay']");
    destroy_and_check(clone);
    destroy_and_check(source);
    assert_eq!(
        std::fs::read_to_string(template.join("srv/hello.txt")).unwrap(),
        "from the template"
    );
}
