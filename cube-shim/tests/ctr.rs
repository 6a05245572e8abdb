//! The shim under a real containerd (Debian's, started privately): `ctr run` prints the
//! container's output and returns its exit code, the process runs inside a Cube
//! sandbox (PID 1 is Cube's agent), `ctr task exec`, `metrics`, `ps`, `kill` and
//! `delete` work, and after delete no process, mount, cgroup, sandbox or network
//! device of the container is left. Skipped without root, containerd or busybox-static.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{mounts_under, skip, wait_until, Containerd, IMAGE, RUNTIME};

fn net_devices() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/sys/class/net")
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// What a running container holds on the host, to find released after its delete.
struct Held {
    /// Its processes' host pids.
    pids: Vec<u32>,
    /// Its sandbox's cgroups.
    cgroups: Vec<PathBuf>,
    /// Its bundle (its rootfs is mounted under it).
    bundle: PathBuf,
    /// The store, to find its sandbox gone.
    runtime: cube_core::Runtime,
}

impl Held {
    /// What container `id` (a Cube sandbox of the store, its only one) holds; `pids`
    /// are its processes as `ctr task ps` lists them.
    fn of(c: &Containerd, id: &str, pids: Vec<u32>) -> Held {
        let runtime = c.cube_store();
        let sandboxes = runtime.list().unwrap();
        assert_eq!(sandboxes.len(), 1, "{sandboxes:?}");
        assert_eq!(
            sandboxes[0]
                .metadata
                .get("containerd.id")
                .map(String::as_str),
            Some(id)
        );
        let jail = runtime
            .attach(&sandboxes[0].id)
            .unwrap()
            .status()
            .unwrap()
            .jail
            .unwrap();
        assert!(!jail.cgroups.is_empty());
        let bundle = c
            .dir
            .path()
            .join("state/io.containerd.runtime.v2.task")
            .join(common::NAMESPACE)
            .join(id);
        assert!(
            !mounts_under(&bundle.display().to_string()).is_empty(),
            "rootfs not mounted"
        );
        Held {
            pids,
            cgroups: jail.cgroups,
            bundle,
            runtime,
        }
    }

    /// Checks that no process, cgroup, mount or Cube sandbox of the container is left.
    fn assert_released(&self) {
        for pid in &self.pids {
            assert!(
                wait_until(Duration::from_secs(10), || !Path::new(&format!(
                    "/proc/{pid}"
                ))
                .exists()),
                "process {pid} outlived delete"
            );
        }
        for dir in &self.cgroups {
            assert!(
                wait_until(Duration::from_secs(10), || !dir.exists()),
                "cgroup {} left",
                dir.display()
            );
        }
        assert!(
            mounts_under(&self.bundle.display().to_string()).is_empty(),
            "mounts left under {}",
            self.bundle.display()
        );
        assert!(
            wait_until(Duration::from_secs(10), || self
                .runtime
                .list()
                .unwrap()
                .is_empty()),
            "Cube sandbox left"
        );
    }
}

/// The host pids `ctr task ps` lists for `id`.
fn task_pids(c: &Containerd, id: &str) -> Vec<u32> {
    c.ctr_ok(&["task", "ps", id])
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect()
}

/// The standard output of a `ctr` that exited with `code` (else a failure that shows
/// its output and containerd's log).
fn exited_with(c: &Containerd, out: &std::process::Output, code: i32) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(code),
        "{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        c.log()
    );
    stdout
}

/// Runs an exec on a terminal in container `id`: its own pty in the sandbox (or the
/// guest), the size of ctr's terminal (ctr sends it with ResizePty once started, so
/// the command waits for it to change from Cube's 24 x 80 first), a line typed, and
/// its exit status back.
fn exec_on_a_terminal(c: &Containerd, id: &str) {
    let out = c.ctr_on_terminal(
        &[
            "task",
            "exec",
            "-t",
            "--exec-id",
            "t1",
            id,
            "sh",
            "-c",
            "for i in $(seq 200); do [ \"$(stty size)\" != '24 80' ] && break; sleep 0.05; done; \
             tty; stty size; read l; echo typed-$((l+2)); exit 3",
        ],
        33,
        77,
        b"40\n",
    );
    let shown = exited_with(c, &out, 3);
    assert!(shown.contains("/dev/pts/"), "no terminal in {id}: {shown}");
    assert!(shown.contains("33 77"), "size not passed on: {shown}");
    assert!(shown.contains("typed-42"), "{shown}");
}

/// Kills task `id`, waits for it to stop, deletes it and removes its container.
fn kill_and_remove(c: &Containerd, id: &str) {
    c.ctr_ok(&["task", "kill", "-s", "SIGKILL", id]);
    wait_stopped(c, id);
    c.ctr_ok(&["task", "delete", id]);
    c.ctr_ok(&["container", "rm", id]);
}

/// Waits until task `id` is stopped.
fn wait_stopped(c: &Containerd, id: &str) {
    assert!(
        wait_until(Duration::from_secs(10), || c
            .ctr_ok(&["task", "ls"])
            .lines()
            .any(|l| l.starts_with(id) && l.contains("STOPPED"))),
        "task {id} did not stop: {}",
        c.ctr_ok(&["task", "ls"])
    );
}

#[test]
fn ctr_runs_execs_measures_kills_and_deletes_a_cube_container() {
    if skip() {
        return;
    }
    let c = Containerd::start();
    c.import_images(common::NAMESPACE);
    let devices_before = net_devices();

    // Foreground: output, exit code, and Cube's agent as PID 1.
    let out = c.ctr(&[
        "run",
        "--rm",
        "--runtime",
        RUNTIME,
        IMAGE,
        "c1",
        "sh",
        "-c",
        "echo hello from cube; tr '\\0' ' ' < /proc/1/cmdline; echo; exit 7",
    ]);
    let stdout = exited_with(&c, &out, 7);
    assert!(stdout.contains("hello from cube"), "{stdout}");
    assert!(
        stdout.contains("cube-agent"),
        "PID 1 is not Cube's agent: {stdout}"
    );

    // Detached, with a memory limit in its spec: exec, metrics, ps, kill, delete.
    c.ctr_ok(&[
        "run",
        "-d",
        "--memory-limit",
        "201326592",
        "--runtime",
        RUNTIME,
        IMAGE,
        "c2",
        "sleep",
        "1000",
    ]);
    let exec = c.ctr(&[
        "task",
        "exec",
        "--exec-id",
        "e1",
        "c2",
        "sh",
        "-c",
        "echo exec-ok; ls /proc | grep -c '^[0-9]'; exit 3",
    ]);
    let text = String::from_utf8_lossy(&exec.stdout);
    assert_eq!(
        exec.status.code(),
        Some(3),
        "{text}\n{}",
        String::from_utf8_lossy(&exec.stderr)
    );
    assert!(text.contains("exec-ok"), "{text}");
    let metrics = c.ctr_ok(&["task", "metrics", "c2"]);
    assert!(metrics.contains("pids.current"), "{metrics}");
    assert!(metrics.contains("memory.usage_in_bytes"), "{metrics}");
    // The spec's limit is the sandbox's (192 MiB, Cube's default is larger).
    let limit = metrics
        .lines()
        .find(|l| l.trim_start().starts_with("memory.limit_in_bytes"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_else(|| panic!("no memory limit in {metrics}"));
    assert_eq!(limit, "201326592", "{metrics}");
    let pids = task_pids(&c, "c2");
    assert!(pids.len() >= 2, "agent and sleep: {pids:?}");

    // What the container holds on the host, to check after delete.
    let held = Held::of(&c, "c2", pids);

    kill_and_remove(&c, "c2");
    held.assert_released();
    assert_eq!(net_devices(), devices_before, "network devices changed");
    // The shim exits once its last container is gone.
    assert!(
        wait_until(Duration::from_secs(10), || !std::process::Command::new(
            "pgrep"
        )
        .args([
            "-f",
            &format!("containerd-shim-cubesandbox-v2.*{}", c.socket().display())
        ])
        .status()
        .unwrap()
        .success()),
        "shim still running"
    );
}

/// The process of the checkpoint test: a secret drawn at start and a counter, both
/// held in shell variables only. The secret goes to the container's log at start;
/// `/tmp/tick` has it print the counter there, `/tmp/ask` has it write both to
/// `/tmp/answer`.
/// Every start of the command adds a line to `/tmp/starts`.
const REMEMBERING: &str = "secret=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'); \
    echo start >> /tmp/starts; echo \"secret $secret\"; n=0; \
    while :; do n=$((n+1)); \
    if [ -e /tmp/tick ]; then rm /tmp/tick; echo \"tick $n\"; fi; \
    if [ -e /tmp/ask ]; then rm /tmp/ask; echo \"$secret $n\" > /tmp/answer.new; mv /tmp/answer.new /tmp/answer; fi; \
    sleep 0.1; done";

/// The first line of `path` that starts with `prefix`, its rest; waits up to 30 s.
fn log_line(path: &Path, prefix: &str) -> String {
    let mut found = None;
    wait_until(Duration::from_secs(30), || {
        found = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(prefix).map(str::to_string));
        found.is_some()
    });
    found.unwrap_or_else(|| {
        panic!(
            "no {prefix:?} in {}: {:?}",
            path.display(),
            std::fs::read_to_string(path)
        )
    })
}

/// Runs `sh -c script` in task `id` through `ctr task exec`; its standard output.
fn exec_sh(c: &Containerd, id: &str, exec_id: &str, script: &str) -> String {
    c.ctr_ok(&["task", "exec", "--exec-id", exec_id, id, "sh", "-c", script])
}

/// Has the checkpoint test's process print its counter to the log; returns it.
fn tick(c: &Containerd, id: &str, exec_id: &str, log: &Path, seen: usize) -> u64 {
    exec_sh(c, id, exec_id, "touch /tmp/tick");
    let mut ticks = Vec::new();
    wait_until(Duration::from_secs(30), || {
        ticks = std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.strip_prefix("tick ")?.parse::<u64>().ok())
            .collect();
        ticks.len() > seen
    });
    *ticks
        .get(seen)
        .unwrap_or_else(|| panic!("no tick {seen} in {}", log.display()))
}

#[test]
fn checkpoint_and_restore_into_a_new_container_keep_a_process_memory() {
    if skip() {
        return;
    }
    if !cube_core::testing::criu_works() {
        println!("skipped: no working CRIU (scripts/setup.sh installs it)");
        return;
    }
    let c = Containerd::start();
    c.import_images(common::NAMESPACE);
    let devices_before = net_devices();
    let log = c.dir.path().join("c1.log");
    let log_uri = format!("file://{}", log.display());
    c.ctr_ok(&[
        "run",
        "-d",
        "--log-uri",
        &log_uri,
        "--runtime",
        RUNTIME,
        IMAGE,
        "c1",
        "sh",
        "-c",
        REMEMBERING,
    ]);
    let secret = log_line(&log, "secret ");
    assert_eq!(secret.len(), 32, "{secret:?}");
    // Let the counter climb well above what a fresh start would reach by the end.
    std::thread::sleep(Duration::from_secs(3));
    let before = tick(&c, "c1", "t1", &log, 0);
    assert!(before >= 10, "counter {before}");

    // `ctr c checkpoint --task`: the shim's Checkpoint writes a Cube snapshot archive
    // into containerd's checkpoint image.
    let out = c.ctr(&["container", "checkpoint", "--task", "c1", "checkpoint/c1:1"]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        c.log()
    );
    let images = c.ctr_ok(&["image", "ls"]);
    assert!(images.contains("checkpoint/c1:1"), "{images}");
    // The checkpointed container runs on, its output still relayed: the shim
    // followed its process again after the snapshot dropped the agent's connections.
    let after_checkpoint = tick(&c, "c1", "t2", &log, 1);
    assert!(after_checkpoint > before, "{after_checkpoint} <= {before}");
    let held = Held::of(&c, "c1", task_pids(&c, "c1"));
    kill_and_remove(&c, "c1");
    held.assert_released();

    // Restored into a new container: the process's memory is back.
    let out = c.ctr(&["container", "restore", "--live", "c2", "checkpoint/c1:1"]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        c.log()
    );
    assert!(wait_until(Duration::from_secs(10), || c
        .ctr_ok(&["task", "ls"])
        .lines()
        .any(|l| l.starts_with("c2") && l.contains("RUNNING"))));
    exec_sh(&c, "c2", "a1", "touch /tmp/ask");
    let mut answer = String::new();
    assert!(
        wait_until(Duration::from_secs(30), || {
            answer = c
                .ctr(&[
                    "task",
                    "exec",
                    "--exec-id",
                    "a2",
                    "c2",
                    "cat",
                    "/tmp/answer",
                ])
                .stdout
                .into_iter()
                .map(char::from)
                .collect();
            !answer.trim().is_empty()
        }),
        "the restored process never answered"
    );
    let mut words = answer.split_whitespace();
    assert_eq!(
        words.next(),
        Some(secret.as_str()),
        "{answer:?}\n{}",
        c.log()
    );
    // The count goes on from where the checkpoint caught it (after `before`); a
    // fresh start would count from 1.
    let counter: u64 = words.next().and_then(|n| n.parse().ok()).unwrap();
    assert!(
        counter > before,
        "counter {counter} after restore, {before} before the checkpoint"
    );
    // Taken back, not run again: the command started once, in the first container.
    assert_eq!(exec_sh(&c, "c2", "a3", "cat /tmp/starts"), "start\n");

    // The restored main process is the task's: its kill stops the task.
    let held = Held::of(&c, "c2", task_pids(&c, "c2"));
    kill_and_remove(&c, "c2");
    held.assert_released();
    assert!(
        held.runtime.snapshots(None).unwrap().is_empty(),
        "snapshots left in the store"
    );
    assert_eq!(net_devices(), devices_before, "network devices changed");
}

#[test]
fn ctr_relays_standard_input_and_runs_processes_on_terminals() {
    if skip() {
        return;
    }
    if std::process::Command::new("script")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: util-linux's script is not installed (it gives ctr a terminal)");
        return;
    }
    let c = Containerd::start();
    c.import_images(common::NAMESPACE);

    // A foreground container reads what ctr is given, to its end.
    let out = c.ctr_with_input(
        &[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            IMAGE,
            "in1",
            "sh",
            "-c",
            "while read l; do echo got:$l; done; echo end; exit 6",
        ],
        b"one\ntwo\n",
    );
    let stdout = exited_with(&c, &out, 6);
    assert_eq!(stdout, "got:one\ngot:two\nend\n");

    c.ctr_ok(&[
        "run",
        "-d",
        "--runtime",
        RUNTIME,
        IMAGE,
        "in2",
        "sleep",
        "1000",
    ]);
    // An exec's input, larger than one FIFO buffer.
    let big: Vec<u8> = (0..200_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let out = c.ctr_with_input(
        &["task", "exec", "--exec-id", "e1", "in2", "wc", "-c"],
        &big,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "200000");

    exec_on_a_terminal(&c, "in2");

    kill_and_remove(&c, "in2");
}

#[test]
fn ctr_run_mounts_bind_host_directories_into_its_sandbox() {
    if skip() {
        return;
    }
    let c = Containerd::start();
    c.import_images(common::NAMESPACE);
    use std::os::unix::fs::PermissionsExt;
    // A volume the sandbox's uid may write, and one it may only read.
    let rw = tempfile::tempdir().unwrap();
    std::fs::set_permissions(rw.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::write(rw.path().join("from-host"), "host data\n").unwrap();
    let ro = tempfile::tempdir().unwrap();
    std::fs::set_permissions(ro.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::write(ro.path().join("readme"), "read only\n").unwrap();
    let out = c.ctr(&[
        "run",
        "--rm",
        "--runtime",
        RUNTIME,
        "--mount",
        &format!(
            "type=bind,src={},dst=/data,options=rbind:rw",
            rw.path().display()
        ),
        // A destination the image lacks: made in the sandbox's own layer.
        "--mount",
        &format!(
            "type=bind,src={},dst=/deep/ro,options=rbind:ro",
            ro.path().display()
        ),
        IMAGE,
        "b1",
        "sh",
        "-c",
        "cat /data/from-host /deep/ro/readme; echo inside > /data/from-inside; \
         touch /deep/ro/x 2>/dev/null && echo wrote-read-only; exit 4",
    ]);
    let stdout = exited_with(&c, &out, 4);
    assert!(stdout.contains("host data\nread only\n"), "{stdout}");
    assert!(!stdout.contains("wrote-read-only"), "{stdout}");
    assert_eq!(
        std::fs::read_to_string(rw.path().join("from-inside")).unwrap(),
        "inside\n"
    );
    assert!(!ro.path().join("x").exists());
    // A checkpoint carries a bind (an external mount of its image); the container
    // restored from it has the bind again.
    c.ctr_ok(&[
        "run",
        "-d",
        "--runtime",
        RUNTIME,
        "--mount",
        &format!(
            "type=bind,src={},dst=/data,options=rbind:rw",
            rw.path().display()
        ),
        IMAGE,
        "b2",
        "sleep",
        "1000",
    ]);
    // An exec reading its standard input across the checkpoint (the snapshot drops
    // the agent's connections; the relay goes on on a new one).
    let typed = rw.path().join("typed");
    let mut reader = c.ctr_fed(&[
        "task",
        "exec",
        "--exec-id",
        "s1",
        "b2",
        "sh",
        "-c",
        "while read l; do echo got:$l >> /data/typed; done; echo end >> /data/typed",
    ]);
    let mut input = reader.stdin.take().unwrap();
    use std::io::Write;
    input.write_all(b"before\n").unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || std::fs::read_to_string(&typed)
            .is_ok_and(|t| t.contains("got:before"))),
        "the exec did not read its input"
    );
    let out = c.ctr(&["container", "checkpoint", "--task", "b2", "checkpoint/b2:1"]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        c.log()
    );
    input.write_all(b"after\n").unwrap();
    drop(input);
    // Input lost after the checkpoint leaves the exec reading for ever: bounded.
    let ended = wait_until(Duration::from_secs(30), || {
        reader.try_wait().unwrap().is_some()
    });
    if !ended {
        let _ = reader.kill();
    }
    let done = reader.wait_with_output().unwrap();
    assert!(
        ended,
        "the exec never read the end of its input after the checkpoint"
    );
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(&typed).unwrap(),
        "got:before\ngot:after\nend\n"
    );
    kill_and_remove(&c, "b2");
    let out = c.ctr(&["container", "restore", "--live", "b3", "checkpoint/b2:1"]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        c.log()
    );
    let seen = c.ctr_ok(&[
        "task",
        "exec",
        "--exec-id",
        "e1",
        "b3",
        "cat",
        "/data/from-host",
    ]);
    assert_eq!(seen, "host data\n");
    kill_and_remove(&c, "b3");
    // Nothing of the binds is left on the host once the container is gone.
    c.assert_no_mounts_left();
}

#[test]
fn ctr_runs_a_container_in_a_vm_when_its_annotation_asks() {
    let Some(c) = Containerd::start_for_vms() else {
        return;
    };
    c.import_images(common::NAMESPACE);
    let vm = "io.cubesandbox.engine=vm";
    // The container's root is the guest's root disk, the agent the guest's init; a
    // bind is copied into that disk.
    let data = tempfile::tempdir().unwrap();
    std::fs::write(data.path().join("note"), "from the host\n").unwrap();
    let bind = format!(
        "type=bind,src={},dst=/data,options=rbind:ro",
        data.path().display()
    );
    let started = std::time::Instant::now();
    c.ctr_ok(&[
        "run",
        "-d",
        "--runtime",
        RUNTIME,
        "--annotation",
        vm,
        "--mount",
        &bind,
        IMAGE,
        "v1",
        "sleep",
        "1000",
    ]);
    println!(
        "ctr run -d in a VM (template built from the image, guest booted): {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let out = c.ctr(&[
        "task",
        "exec",
        "--exec-id",
        "e1",
        "v1",
        "sh",
        "-c",
        "echo init=$(tr '\\0' ' ' < /proc/1/cmdline); echo kernel=$(uname -r); \
         test -x /bin/busybox && echo image-root; cat /data/note; exit 3",
    ]);
    let stdout = exited_with(&c, &out, 3);
    common::assert_ran_in_a_guest(&stdout);
    assert!(
        stdout.contains("from the host"),
        "the bind was not copied: {stdout}"
    );
    exec_on_a_terminal(&c, "v1");
    // Metrics: the VM's use on the host, against the guest's 512 MiB.
    let metrics = c.ctr_ok(&["task", "metrics", "v1"]);
    let limit = metrics
        .lines()
        .find(|l| l.trim_start().starts_with("memory.limit_in_bytes"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_else(|| panic!("no memory limit in {metrics}"));
    assert_eq!(limit, (512u64 << 20).to_string(), "{metrics}");
    // What a VM container lacks is refused, saying so.
    let out = c.ctr(&["container", "checkpoint", "--task", "v1", "checkpoint/v1:1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("not supported for VM containers"),
        "{stderr}"
    );
    kill_and_remove(&c, "v1");
    // Its template and sandbox went with it.
    let store = c.cube_store();
    assert!(
        wait_until(Duration::from_secs(10), || store.list().unwrap().is_empty()
            && store
                .templates()
                .unwrap()
                .iter()
                .all(|t| !t.name.starts_with("ctr-"))),
        "left: {:?} {:?}",
        store.list().unwrap(),
        store.templates().unwrap()
    );
}
