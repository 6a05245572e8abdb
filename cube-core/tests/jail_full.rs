//! Full-state jail snapshots through CRIU, behind the Sandbox API: a Python variable
//! set before a snapshot is back after rollback, a clone sees it, source and clone do
//! not see each other's changes, hibernate/wake keeps it, and destroy leaves nothing.
//! Skipped (with the reason) where no working CRIU exists.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use cube_agent::client::Client;
use cube_agent::protocol::ExecRequest;
use cube_core::MachineStatus;
use cube_core::SnapshotKind;
use cube_core::{CreateOptions, Runtime, RuntimeConfig, Sandbox, HOST_TEMPLATE};

use common::workload::destroy_and_check;
use common::{py, skip_full_jail};

struct Env {
    _dir: tempfile::TempDir,
    rt: Runtime,
}

impl Env {
    fn new() -> Env {
        let dir = tempfile::TempDir::new().unwrap();
        let rt = Runtime::open(RuntimeConfig {
            store_root: dir.path().canonicalize().unwrap(),
            pool_size: 0,
            network_pool_size: 0,
            supervisor: Some(common::supervisor()),
        })
        .unwrap();
        Env { _dir: dir, rt }
    }

    fn create(&self) -> Sandbox {
        self.rt
            .create(HOST_TEMPLATE, CreateOptions::new(false))
            .unwrap()
    }
}

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
fn rollback_brings_back_a_python_variable() {
    if skip_full_jail() {
        return;
    }
    let env = Env::new();
    let mut sb = env.create();
    let agent = sb.agent().unwrap();
    assert_eq!(py(&agent, "x = 41\nx"), "41");
    sh(&agent, "echo before > $HOME/f");
    let snap = sb.snapshot().unwrap();
    assert_eq!(snap.kind, SnapshotKind::Full, "{:?}", snap.fallback);
    assert!(snap.fallback.is_none());
    // The snapshot dropped the connection: the client reconnects.
    let agent = sb.agent().unwrap();
    assert_eq!(py(&agent, "x"), "41", "the context survives the snapshot");
    assert_eq!(py(&agent, "x = 99\nx"), "99");
    sh(&agent, "echo after > $HOME/f");
    sb.rollback(&snap.id).unwrap();
    let agent = sb.agent().unwrap();
    assert_eq!(py(&agent, "x"), "41");
    assert_eq!(sh(&agent, "cat $HOME/f"), "before\n");
    // Again, from the same snapshot.
    assert_eq!(py(&agent, "x += 1\nx"), "42");
    sb.rollback(&snap.id).unwrap();
    assert_eq!(py(&sb.agent().unwrap(), "x"), "41");
    destroy_and_check(sb);
}

#[test]
fn a_clone_sees_the_variable_and_diverges_from_its_source() {
    if skip_full_jail() {
        return;
    }
    let env = Env::new();
    let mut source = env.create();
    assert_eq!(py(&source.agent().unwrap(), "x = [1]\nx"), "[1]");
    let mut clones = env
        .rt
        .clone_sandbox(&mut source, 1, 1, CreateOptions::new(false))
        .unwrap();
    let clone = clones.pop().unwrap();
    let a = source.agent().unwrap();
    let b = clone.agent().unwrap();
    assert_eq!(py(&b, "x"), "[1]", "the clone sees the source's variable");
    assert_eq!(py(&b, "x.append(2)\nx"), "[1, 2]");
    assert_eq!(py(&a, "x"), "[1]", "the source saw the clone's change");
    assert_eq!(py(&a, "x.append(3)\nx"), "[1, 3]");
    assert_eq!(py(&b, "x"), "[1, 2]", "the clone saw the source's change");
    sh(&b, "echo clone > $HOME/only-clone");
    assert_eq!(sh(&a, "ls $HOME"), "");
    // The clone runs as its source's uid (CRIU restores credentials) and shares its
    // lease: with the source gone, the uid stays leased while the clone runs.
    let uid = sh(&b, "id -u").trim().to_string();
    assert_eq!(sh(&a, "id -u").trim(), uid);
    let lease = Path::new(cube_jail::sandbox_uid::LEASE_DIR).join(&uid);
    destroy_and_check(source);
    assert!(lease.exists(), "uid {uid} was let go while its clone ran");
    assert_eq!(sh(&b, "cat $HOME/only-clone").trim(), "clone");
    destroy_and_check(clone);
}

#[test]
fn hibernate_and_wake_keep_the_variable() {
    if skip_full_jail() {
        return;
    }
    let env = Env::new();
    let mut sb = env.create();
    assert_eq!(py(&sb.agent().unwrap(), "x = 'kept'\nx"), "'kept'");
    let pid = sb.status().unwrap().jail.unwrap().pid.unwrap();
    sb.hibernate().unwrap();
    assert_eq!(sb.status().unwrap().status, MachineStatus::Hibernated);
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "processes outlived hibernate"
    );
    // A snapshot of the hibernated sandbox is full too, and a rollback to it works.
    let snap = sb.snapshot().unwrap();
    assert_eq!(snap.kind, SnapshotKind::Full, "{:?}", snap.fallback);
    sb.wake().unwrap();
    let agent = sb.agent().unwrap();
    assert_eq!(py(&agent, "x"), "'kept'");
    assert_eq!(py(&agent, "x = 'changed'\nx"), "'changed'");
    sb.rollback(&snap.id).unwrap();
    assert_eq!(py(&sb.agent().unwrap(), "x"), "'kept'");
    destroy_and_check(sb);
}

/// Wakes racing one another (callers that each saw the sandbox hibernated, through
/// handles of their own) serve one: it wakes with its state, every other says the
/// sandbox is not hibernated, and nothing of the checkpoint is used twice. (The
/// "layer.hibernated is not a directory" of earlier runs came from a destroy racing
/// other requests: tests/jail.rs.)
#[test]
fn racing_wakes_wake_the_sandbox_once() {
    if skip_full_jail() {
        return;
    }
    let env = Env::new();
    let mut sb = env.create();
    assert_eq!(py(&sb.agent().unwrap(), "x = 'kept'\nx"), "'kept'");
    for round in 0..3 {
        sb.hibernate().unwrap();
        let woken: Vec<_> = std::thread::scope(|s| {
            let racers: Vec<_> = (0..3)
                .map(|_| {
                    let mut handle = env.rt.attach(sb.id()).unwrap();
                    s.spawn(move || handle.wake())
                })
                .collect();
            racers.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let (won, lost): (Vec<_>, Vec<_>) = woken.into_iter().partition(Result::is_ok);
        assert_eq!(won.len(), 1, "round {round}: {lost:?}");
        for e in lost.into_iter().filter_map(Result::err) {
            let why = cube_core::error_report::chain(&e);
            assert_eq!(
                e.kind(),
                cube_core::ErrorKind::BadState,
                "round {round}: {why}"
            );
            assert!(why.contains("not hibernated"), "round {round}: {why}");
        }
        assert_eq!(sb.status().unwrap().status, MachineStatus::Running);
        assert_eq!(py(&sb.agent().unwrap(), "x"), "'kept'", "round {round}");
    }
    destroy_and_check(sb);
}

/// A hibernation checkpoint is recorded, flushed and checked as a snapshot is: a
/// layer file changed on disk, or a record of an earlier boot without the flush's
/// marker (a host crash right after the hibernation), makes the wake fail with a
/// clear error and leaves the sandbox hibernated with its checkpoint; put right, it
/// wakes with its state.
#[test]
fn a_damaged_or_unflushed_hibernation_is_refused_and_kept() {
    if skip_full_jail() {
        return;
    }
    let env = Env::new();
    let mut sb = env.create();
    let agent = sb.agent().unwrap();
    assert_eq!(py(&agent, "x = 'kept'\nx"), "'kept'");
    sh(&agent, "echo kept > $HOME/notes");
    drop(agent);
    sb.hibernate().unwrap();
    let checkpoint = cube_storage::SandboxDir::new(sb.dir()).hibernated_checkpoint();
    common::wait_flushed(&checkpoint);
    let image = cube_storage::SnapshotDir::new(&checkpoint);
    let notes = image.layer().join("home/user/notes");
    assert_eq!(std::fs::read(&notes).unwrap(), b"kept\n");
    let refused = |sb: &mut Sandbox, what: &str, expected: &str| {
        let err = common::error_chain(&sb.wake().unwrap_err());
        assert!(err.contains(expected), "{what}: {err}");
        assert_eq!(
            sb.status().unwrap().status,
            MachineStatus::Hibernated,
            "{what}"
        );
        assert!(image.record().is_file(), "{what}: the checkpoint stays");
    };

    std::fs::write(&notes, b"lost\n").unwrap();
    refused(&mut sb, "a damaged layer file", "hibernation is damaged");
    std::fs::write(&notes, b"kept\n").unwrap();

    let record: serde_json::Value =
        cube_storage::read_verified(&image.record(), cube_storage::SnapshotDir::RECORD_KIND)
            .unwrap();
    let mut earlier = record.clone();
    earlier["boot_id"] = serde_json::Value::from("00000000-0000-4000-8000-000000000000");
    let write = |record: &serde_json::Value| {
        cube_storage::write_atomic(
            &image.record(),
            cube_storage::SnapshotDir::RECORD_KIND,
            record,
        )
        .unwrap()
    };
    write(&earlier);
    let marker = std::fs::read(image.durable_marker()).unwrap();
    std::fs::remove_file(image.durable_marker()).unwrap();
    refused(
        &mut sb,
        "an unflushed checkpoint of an earlier boot",
        "never flushed",
    );
    write(&record);
    std::fs::write(image.durable_marker(), marker).unwrap();

    sb.wake().unwrap();
    let agent = sb.agent().unwrap();
    assert_eq!(py(&agent, "x"), "'kept'");
    assert_eq!(sh(&agent, "cat $HOME/notes"), "kept\n");
    drop(agent);
    destroy_and_check(sb);
}

#[test]
fn a_sandbox_cannot_point_agent_connections_at_a_host_socket() {
    // Runs without CRIU too: the agent's socket is on the sandbox's /tmp either way.
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 || cube_jail::CgroupLayout::detect().is_err() {
        eprintln!("skipping: jails need root and a readable cgroup hierarchy");
        return;
    }
    let env = Env::new();
    let sb = env.create();
    // A host socket the sandbox's code must not make host clients reach.
    let host_dir = tempfile::TempDir::new().unwrap();
    let host_socket = host_dir.path().canonicalize().unwrap().join("host.sock");
    let listener = std::os::unix::net::UnixListener::bind(&host_socket).unwrap();
    listener.set_nonblocking(true).unwrap();
    let agent = sb.agent().unwrap();
    let script = format!(
        "rm -f /tmp/.cube-agent.sock && ln -s {} /tmp/.cube-agent.sock",
        host_socket.display()
    );
    let out = agent
        .exec(ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), script],
            ..ExecRequest::default()
        })
        .unwrap();
    assert_eq!(
        out.exit.code,
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A plain connect through the link would follow the absolute symlink on the host:
    // the threat is real here.
    let link = sb.dir().join("agent.sock");
    let plain = std::os::unix::net::UnixStream::connect(&link);
    assert!(
        plain.is_ok(),
        "the symlink on the sandbox's /tmp was not followed"
    );
    drop(plain);
    let deadline = Instant::now() + Duration::from_secs(5);
    while listener.accept().is_err() {
        assert!(
            Instant::now() < deadline,
            "the plain connect went elsewhere"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The agent's connections resolve inside the sandbox's root, where the host path
    // does not exist.
    assert!(sb.agent().is_err());
    assert!(
        listener.accept().is_err(),
        "a host client was redirected to a host socket"
    );
    drop(agent);
    sb.destroy().unwrap();
}
