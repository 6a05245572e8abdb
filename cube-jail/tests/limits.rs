//! Resource limits contain what runs inside, and the freezer stops it.

mod common;

use std::fs;
use std::time::Duration;

use cube_jail::{Jail, JailExit, Stdio};

#[test]
fn a_memory_hog_is_oom_killed_inside_its_limit() {
    if common::skip() {
        return;
    }
    if !common::has_controller("memory") {
        println!("skipped: no memory cgroup controller on this host");
        return;
    }
    if common::skip_without_python() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut c = common::config(tmp.path(), "oom");
    c.limits.memory_bytes = Some(64 << 20);
    let mut jail = Jail::spawn(
        &c,
        &[
            "/bin/sh",
            "-c",
            "/usr/bin/python3 -c 'b = bytearray(1 << 30); print(\"ALLOCATED\")'; echo rc=$?",
        ],
    )
    .unwrap();
    let out = common::collect(&mut jail);
    let kills = jail.cgroup().unwrap().oom_kills().unwrap();
    println!("stdout: {:?} oom kills: {kills:?}", out.stdout);
    jail.destroy().unwrap();
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    assert!(!out.stdout.contains("ALLOCATED"), "{}", out.stdout);
    // Killed by SIGKILL (128 + 9) from the OOM killer, or MemoryError inside the limit.
    assert!(
        out.stdout.contains("rc=137") || out.stderr.contains("MemoryError"),
        "stdout: {} stderr: {}",
        out.stdout,
        out.stderr
    );
    if out.stdout.contains("rc=137") {
        assert!(kills.unwrap_or(1) >= 1, "SIGKILL but no OOM kill counted");
    }
}

#[test]
fn a_fork_bomb_stops_at_pids_max_and_the_host_keeps_going() {
    if common::skip() {
        return;
    }
    if !common::has_controller("pids") {
        println!("skipped: no pids cgroup controller on this host");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut c = common::config(tmp.path(), "bomb");
    c.stdout = Stdio::Null;
    c.stderr = Stdio::Null;
    c.limits.pids_max = Some(32);
    let jail = Jail::spawn(
        &c,
        &["/bin/sh", "-c", "bomb() { bomb | bomb & }; bomb; sleep 30"],
    )
    .unwrap();
    let cg = jail.cgroup().unwrap();
    let mut hits = 0;
    for _ in 0..300 {
        hits = cg.pids_max_hits().unwrap().unwrap_or(0);
        if hits > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(hits > 0, "the bomb never reached pids.max");
    // The kernel's own count: the process lists of several v1 hierarchies, read one
    // after the other while the bomb forks and dies, can add up to more.
    let inside = cg.pids_current().unwrap().unwrap();
    assert!(inside <= 32, "{inside} tasks despite pids.max = 32");
    // The host can still create processes.
    assert!(std::process::Command::new("true")
        .status()
        .unwrap()
        .success());
    jail.destroy().unwrap();
}

#[test]
fn pause_stops_progress_and_resume_continues() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut c = common::config(tmp.path(), "pause");
    c.stdout = Stdio::Null;
    c.stderr = Stdio::Null;
    let jail = Jail::spawn(
        &c,
        &[
            "/bin/sh",
            "-c",
            "while :; do echo x >> /home/user/counter; sleep 0.01; done",
        ],
    )
    .unwrap();
    if jail.cgroup().unwrap().freezer().is_none() {
        println!("skipped: no cgroup freezer on this host");
        return;
    }
    let counter = jail.root_dir().unwrap().join("home/user/counter");
    let size = || fs::metadata(&counter).map(|m| m.len()).unwrap_or(0);
    std::thread::sleep(Duration::from_millis(200));
    assert!(size() > 0, "the counter never grew");
    jail.pause().unwrap();
    let frozen = size();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(size(), frozen, "the counter grew while paused");
    jail.resume().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(size() > frozen, "the counter did not grow after resume");
    // A paused jail can be destroyed too.
    jail.pause().unwrap();
    jail.destroy().unwrap();
}
