//! The shim under a real containerd (Debian's, started privately): `ctr run` prints the
//! container's output and returns its exit code, the process runs inside a Cube
//! sandbox (PID 1 is Cube's agent), `ctr task exec`, `metrics`, `ps`, `kill` and
//! `delete` work, and after delete no process, mount, cgroup, sandbox or network
//! device of the container is left. Skipped without root, containerd or busybox-static.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

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
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(7),
        "{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        c.log()
    );
    assert!(stdout.contains("hello from cube"), "{stdout}");
    assert!(
        stdout.contains("cube-agent"),
        "PID 1 is not Cube's agent: {stdout}"
    );

    // Detached: exec, metrics, ps, kill, delete.
    c.ctr_ok(&[
        "run",
        "-d",
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
    let ps = c.ctr_ok(&["task", "ps", "c2"]);
    let pids: Vec<u32> = ps
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    assert!(pids.len() >= 2, "agent and sleep: {ps}");

    // What the container holds on the host, to check after delete.
    let rt = cube_core::Runtime::open(cube_core::RuntimeConfig {
        store_root: c.store.clone(),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: Some("/nonexistent".into()),
    })
    .unwrap();
    let sandboxes = rt.list().unwrap();
    assert_eq!(sandboxes.len(), 1, "{sandboxes:?}");
    assert_eq!(
        sandboxes[0]
            .metadata
            .get("containerd.id")
            .map(String::as_str),
        Some("c2")
    );
    let jail = rt
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
        .join("c2");
    assert!(
        !mounts_under(&bundle.display().to_string()).is_empty(),
        "rootfs not mounted"
    );

    c.ctr_ok(&["task", "kill", "-s", "SIGKILL", "c2"]);
    assert!(wait_until(Duration::from_secs(10), || c
        .ctr_ok(&["task", "ls"])
        .lines()
        .any(|l| l.starts_with("c2") && l.contains("STOPPED"))));
    c.ctr_ok(&["task", "delete", "c2"]);
    c.ctr_ok(&["container", "rm", "c2"]);

    for pid in &pids {
        assert!(
            wait_until(Duration::from_secs(10), || !std::path::Path::new(&format!(
                "/proc/{pid}"
            ))
            .exists()),
            "process {pid} outlived delete"
        );
    }
    for dir in &jail.cgroups {
        assert!(
            wait_until(Duration::from_secs(10), || !dir.exists()),
            "cgroup {} left",
            dir.display()
        );
    }
    assert!(
        mounts_under(&bundle.display().to_string()).is_empty(),
        "mounts left under {}",
        bundle.display()
    );
    assert!(
        wait_until(Duration::from_secs(10), || rt.list().unwrap().is_empty()),
        "Cube sandbox left"
    );
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
