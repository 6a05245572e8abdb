//! Jail snapshots where no working CRIU exists: they hold the files only, say so in
//! their kind and give the reason, and rollback, clone and wake restart the processes.
//! A hibernation keeps the files recorded as such a snapshot, and a wake refuses them
//! damaged.
//! The supervisors of this test binary are pointed at a CRIU that does not exist
//! (`CUBE_CRIU`), which is how a host without one looks; its one test runs alone in
//! this process, so setting the variable races with nothing.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use cube_agent::client::Client;
use cube_agent::protocol::{ExecRequest, Language};
use cube_core::{CreateOptions, Runtime, RuntimeConfig, HOST_TEMPLATE};
use cube_core::{MachineStatus, SnapshotKind};

fn sh(client: &Client, script: &str) -> String {
    let out = client
        .exec(ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            ..ExecRequest::default()
        })
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn without_criu_snapshots_hold_files_and_say_why() {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 || cube_jail::CgroupLayout::detect().is_err() {
        eprintln!("skipping: jails need root and a readable cgroup hierarchy");
        return;
    }
    if !Path::new("/usr/bin/python3").exists() {
        eprintln!("skipping: no /usr/bin/python3 on the host template");
        return;
    }
    std::env::set_var(cube_jail::criu::CRIU_ENV, "/nonexistent/criu");
    let dir = tempfile::TempDir::new().unwrap();
    let rt = Runtime::open(RuntimeConfig {
        store_root: dir.path().canonicalize().unwrap(),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: Some(common::supervisor()),
    })
    .unwrap();
    let mut sb = rt.create(HOST_TEMPLATE, CreateOptions::new(false)).unwrap();
    let agent = sb.agent().unwrap();
    agent.create_context("py", Language::Python, None).unwrap();
    let set = agent
        .run_code("py", "x = 41", Some(Duration::from_secs(30)))
        .unwrap();
    assert!(set.error.is_none());
    sh(&agent, "echo before > $HOME/f");
    let snap = sb.snapshot().unwrap();
    assert_eq!(snap.kind, SnapshotKind::Filesystem);
    let why = snap
        .fallback
        .clone()
        .expect("the fallback gives its reason");
    assert!(
        why.contains("CRIU") && why.contains("/nonexistent/criu"),
        "{why}"
    );
    let listed = rt.snapshots(Some(sb.id())).unwrap();
    assert_eq!(listed[0].fallback.as_deref(), Some(why.as_str()));
    // A filesystem snapshot leaves the connection alone.
    sh(&agent, "echo after > $HOME/f");
    sb.rollback(&snap.id).unwrap();
    let agent = sb.agent().unwrap();
    assert_eq!(sh(&agent, "cat $HOME/f"), "before\n");
    // The processes started afresh: the interpreter context is gone.
    assert!(agent.list_contexts().unwrap().is_empty());
    sb.hibernate().unwrap();
    let checkpoint = cube_storage::SandboxDir::new(sb.dir()).hibernated_checkpoint();
    let image = cube_storage::SnapshotDir::new(&checkpoint);
    let record: serde_json::Value =
        cube_storage::read_verified(&image.record(), cube_storage::SnapshotDir::RECORD_KIND)
            .unwrap();
    assert_eq!(record["kind"], "filesystem", "{record}");
    assert!(
        record["fallback"]
            .as_str()
            .is_some_and(|f| f.contains("/nonexistent/criu")),
        "{record}"
    );
    let f = image.layer().join("home/user/f");
    std::fs::write(&f, b"changed behind its back\n").unwrap();
    let err = common::error_chain(&sb.wake().unwrap_err());
    assert!(err.contains("hibernation is damaged"), "{err}");
    assert_eq!(sb.status().unwrap().status, MachineStatus::Hibernated);
    assert!(image.record().is_file(), "the hibernated files stay");
    std::fs::write(&f, b"before\n").unwrap();
    sb.wake().unwrap();
    assert_eq!(sh(&sb.agent().unwrap(), "cat $HOME/f"), "before\n");
    assert!(!checkpoint.exists(), "the woken files' record is removed");
    let sb_dir = sb.dir().to_path_buf();
    sb.destroy().unwrap();
    assert!(!sb_dir.exists());
}
