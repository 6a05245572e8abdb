//! Jail sandboxes through the Sandbox API: create on the built-in host template, the
//! agent, env, limits, pause, filesystem snapshots (rollback, clone, hibernate, wake),
//! isolation between sandboxes, and destroy leaving nothing behind.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::workload::destroy_and_check;
use common::{race_a_destroy, sh};

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cube_agent::protocol::{ExecRequest, Language, RequestBody};
use cube_core::{
    CreateOptions, Engine, Runtime, RuntimeConfig, Sandbox, DEFAULT_PIDS_MAX, HOST_TEMPLATE,
};
use cube_core::{EngineChoice, SandboxError, SnapshotKind};
use cube_core::{JailStatus, LimitChange, MachineStatus};

/// Why this host cannot run jails, if it cannot.
fn skip() -> bool {
    if common::skip_jail() {
        return true;
    }
    let agent = common::supervisor().with_file_name("cube-agent");
    assert!(
        agent.is_file(),
        "{} is missing: build cube-agent first (cargo build -p cube-agent, or run the tests \
         with -p cube-agent -p cube-core)",
        agent.display()
    );
    false
}

/// A private store and a runtime on it.
struct Env {
    _dir: tempfile::TempDir,
    root: PathBuf,
    rt: Runtime,
}

impl Env {
    fn new(pool_size: usize) -> Env {
        let dir = tempfile::TempDir::new().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let rt = Runtime::open(RuntimeConfig {
            store_root: root.clone(),
            pool_size,
            network_pool_size: 0,
            supervisor: Some(common::supervisor()),
        })
        .unwrap();
        if pool_size > 0 {
            rt.wait_pool_ready();
        }
        Env {
            _dir: dir,
            root,
            rt,
        }
    }

    fn create(&self, options: CreateOptions) -> Sandbox {
        self.rt.create(HOST_TEMPLATE, options).unwrap()
    }
}

/// The kind a jail snapshot has on this host: full where CRIU works (tests/jail_full.rs
/// covers that path, tests/jail_fallback.rs the other).
fn expected_kind() -> SnapshotKind {
    match cube_jail::Criu::probe() {
        Ok(_) => SnapshotKind::Full,
        Err(_) => SnapshotKind::Filesystem,
    }
}

fn jail_status(sb: &mut Sandbox) -> JailStatus {
    sb.status()
        .unwrap()
        .jail
        .expect("a jail sandbox reports its jail")
}

#[test]
fn host_template_is_listed_and_engines_are_checked() {
    if skip() {
        return;
    }
    let env = Env::new(0);
    let templates = env.rt.templates().unwrap();
    let host = templates.iter().find(|t| t.name == HOST_TEMPLATE).unwrap();
    assert_eq!(host.engine, Engine::Jail);
    let err = env
        .rt
        .create(
            HOST_TEMPLATE,
            CreateOptions {
                engine: EngineChoice::Vm,
                ..CreateOptions::default()
            },
        )
        .err()
        .unwrap();
    assert!(matches!(err, SandboxError::EngineMismatch { .. }), "{err}");
    assert!(err.to_string().contains("jail engine"), "{err}");
    assert!(matches!(
        env.rt.remove_template(HOST_TEMPLATE),
        Err(SandboxError::BuiltInTemplate(_))
    ));
    // Nothing was left by the refused create.
    assert!(env.rt.list().unwrap().is_empty());
}

/// The nice value of every thread of process `pid`.
fn nice_values(pid: u32) -> Vec<i64> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
        .map(|stat| {
            // Fields after the command name (which may hold spaces): nice is the 19th
            // field of the line, the 17th after the name.
            let after = &stat[stat.rfind(')').unwrap() + 2..];
            after.split(' ').nth(16).unwrap().parse().unwrap()
        })
        .collect()
}

fn lifecycle(pool_size: usize) {
    let env = Env::new(pool_size);
    let mut options = CreateOptions::new(false);
    options.engine = EngineChoice::Jail;
    options.env = vec![("CUBE_TEST_VAR".into(), "forty-two".into())];
    options.metadata.insert("owner".into(), "test".into());
    let mut sb = env.create(options);
    assert_eq!(sb.engine(), Engine::Jail);
    let list = env.rt.list().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].engine, Engine::Jail);
    assert_eq!(
        list[0].metadata.get("owner").map(String::as_str),
        Some("test")
    );
    let status = sb.status().unwrap();
    assert_eq!(status.status, MachineStatus::Running);
    // A pool starts supervisors (and their jails) behind the creates; a sandbox in
    // use runs at normal priority, every thread of it.
    // One reading: threads come and go (the supervisor's VM built ahead is torn
    // down by a thread of its own), so a second reading may count differently.
    for pid in [status.pid, status.jail.as_ref().unwrap().pid.unwrap()] {
        let nice = nice_values(pid);
        assert!(nice.iter().all(|&n| n == 0), "pid {pid}: {nice:?}");
    }

    let agent = sb.agent().unwrap();
    let (code, out, err) = sh(&agent, "echo $CUBE_TEST_VAR; id -u; hostname");
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!((lines[0], lines[2]), ("forty-two", "sandbox"), "{out}");
    // A uid of the sandbox's own.
    let uid: u32 = lines[1].parse().unwrap();
    assert!(cube_jail::sandbox_uid::RANGE.contains(&uid), "{out}");
    // The sandbox sees its own processes only: the agent and this shell.
    let (_, out, _) = sh(&agent, "ls /proc | grep -c '^[0-9]'");
    // The agent, sh, ls and grep.
    assert!(out.trim().parse::<u32>().unwrap() <= 4, "{out}");

    // Another process (here: another handle) reaches the same agent.
    let again = env.rt.attach(sb.id()).unwrap();
    assert_eq!(sh(&again.agent().unwrap(), "echo hi").1, "hi\n");

    // A Python cell round trip through a context.
    agent
        .create_context("main", Language::Python, None)
        .unwrap();
    let r = agent.run_code("main", "x = 20\nx + 22", None).unwrap();
    assert_eq!(r.value.as_deref(), Some("42"));

    destroy_and_check(sb);
}

#[test]
fn lifecycle_without_a_pool() {
    if skip() {
        return;
    }
    lifecycle(0);
}

#[test]
fn lifecycle_with_a_jail_started_ahead_in_the_pool() {
    if skip() {
        return;
    }
    lifecycle(1);
}

#[test]
fn pause_stops_progress_and_resume_continues() {
    if skip() {
        return;
    }
    let env = Env::new(0);
    let mut sb = env.create(CreateOptions::new(false));
    let agent = sb.agent().unwrap();
    // Started, never waited for: the loop runs until destroy.
    let _counter = agent
        .start(RequestBody::Exec(ExecRequest {
            argv: vec![
                "/bin/sh".into(),
                "-c".into(),
                "i=0; while true; do i=$((i+1)); echo $i > $HOME/count; done".into(),
            ],
            ..ExecRequest::default()
        }))
        .unwrap();
    let file = jail_status(&mut sb).layer.join("home/user/count");
    let read = || std::fs::read_to_string(&file).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(10);
    while read().is_empty() {
        assert!(Instant::now() < deadline, "the counter never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    sb.pause().unwrap();
    assert_eq!(sb.status().unwrap().status, MachineStatus::Paused);
    // A write already under way may land; after that nothing moves.
    std::thread::sleep(Duration::from_millis(50));
    let frozen = read();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(read(), frozen, "the counter moved while paused");
    sb.resume().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while read() == frozen {
        assert!(Instant::now() < deadline, "the counter did not continue");
        std::thread::sleep(Duration::from_millis(10));
    }
    destroy_and_check(sb);
}

#[test]
fn memory_and_pids_limits_hold() {
    if skip() {
        return;
    }
    let env = Env::new(0);
    let mut options = CreateOptions::new(true);
    options.memory_mib = Some(64);
    options.pids_max = Some(32);
    let sb = env.create(options);
    let agent = sb.agent().unwrap();
    // 256 MiB touched page by page cannot fit into 64 MiB.
    let (code, _, _) = sh(
        &agent,
        "python3 -c 'b = bytearray(256 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint(\"fit\")'",
    );
    assert_ne!(code, 0, "256 MiB fit into a 64 MiB sandbox");
    let forks = r#"
import os, signal, time
pids = []
for _ in range(100):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    pids.append(pid)
print(len(pids))
for pid in pids:
    os.kill(pid, signal.SIGKILL)
"#;
    let (code, out, err) = sh(&agent, &format!("python3 -c '{forks}'"));
    assert_eq!(code, 0, "{err}");
    let forked: u32 = out.trim().parse().unwrap();
    assert!(
        (1..32).contains(&forked),
        "{forked} processes forked under a pids limit of 32"
    );
    sb.destroy().unwrap();
}

/// The `pids.max` of a jail sandbox's cgroup.
fn pids_max_of(sb: &mut Sandbox) -> String {
    cgroup_value(sb, &["pids.max"])
}

#[test]
fn a_sandbox_that_names_no_pids_limit_gets_the_default_one() {
    if skip() {
        return;
    }
    let has_pids = cube_jail::CgroupLayout::detect().is_ok_and(|l| l.provider("pids").is_some());
    if !has_pids {
        eprintln!("skipped: no pids cgroup controller on this host");
        return;
    }
    // Without a pool and from one (whose jail was started before the create's options
    // were known).
    for pool_size in [0, 1] {
        let env = Env::new(pool_size);
        let mut plain = env.create(CreateOptions::new(true));
        assert_eq!(pids_max_of(&mut plain), DEFAULT_PIDS_MAX.to_string());
        let mut options = CreateOptions::new(true);
        options.pids_max = Some(64);
        let mut limited = env.create(options);
        assert_eq!(pids_max_of(&mut limited), "64");
        destroy_and_check(plain);
        destroy_and_check(limited);
    }
}

/// The first of `files` found in the sandbox's cgroups, trimmed.
fn cgroup_value(sb: &mut Sandbox, files: &[&str]) -> String {
    let dirs = jail_status(sb).cgroups;
    let file = files
        .iter()
        .flat_map(|f| dirs.iter().map(move |d| d.join(f)))
        .find(|f| f.is_file())
        .unwrap_or_else(|| panic!("no cgroup of the sandbox has {files:?}"));
    std::fs::read_to_string(file).unwrap().trim().to_string()
}

#[test]
fn limits_change_while_the_sandbox_runs_and_hold_after_a_rollback() {
    if skip() {
        return;
    }
    let env = Env::new(1);
    let mut options = CreateOptions::new(false);
    options.memory_mib = Some(64);
    options.pids_max = Some(32);
    let mut sb = env.create(options);
    let memory = ["memory.max", "memory.limit_in_bytes"];
    assert_eq!(cgroup_value(&mut sb, &memory), (64u64 << 20).to_string());
    let touch = "python3 -c 'b = bytearray(100 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint(\"fit\")'";
    assert_ne!(sh(&sb.agent().unwrap(), touch).0, 0, "100 MiB fit into 64");
    assert_eq!(tmpfs_sizes(&mut sb), [64 << 20, 64 << 20]);
    // 40 MiB in /tmp: it may not shrink below that (the limits stay), and may grow.
    let agent = sb.agent().unwrap();
    assert_eq!(sh(&agent, "head -c 41943040 /dev/zero > /tmp/fill").0, 0);
    let refused = sb
        .set_limits(LimitChange {
            memory_mib: Some(32),
            ..LimitChange::default()
        })
        .unwrap_err();
    let why = format!("{refused:?}");
    assert!(why.contains("cannot shrink below what it holds"), "{why}");
    assert_eq!(cgroup_value(&mut sb, &memory), (64u64 << 20).to_string());
    assert_eq!(sh(&agent, "rm /tmp/fill").0, 0);

    sb.set_limits(LimitChange {
        memory_mib: Some(256),
        pids_max: Some(48),
        cpu_millis: None,
    })
    .unwrap();
    assert_eq!(cgroup_value(&mut sb, &memory), (256u64 << 20).to_string());
    assert_eq!(pids_max_of(&mut sb), "48");
    // /tmp and /dev/shm follow the memory limit.
    assert_eq!(tmpfs_sizes(&mut sb), [256 << 20, 256 << 20]);
    let (code, out, err) = sh(&sb.agent().unwrap(), touch);
    assert_eq!((code, out.trim()), (0, "fit"), "{err}");
    // Nothing to change is no call; a limit the host refuses is an error naming it,
    // and the limits stay as they were.
    sb.set_limits(LimitChange::default()).unwrap();
    let refused = sb
        .set_limits(LimitChange {
            pids_max: Some(0),
            ..LimitChange::default()
        })
        .unwrap_err();
    let why = format!("{refused:?}");
    assert!(why.contains("pids_max must be positive"), "{why}");
    assert_eq!(pids_max_of(&mut sb), "48");

    // A rollback starts a new jail: with the new limits.
    let snap = sb.snapshot().unwrap();
    sb.rollback(&snap.id).unwrap();
    assert_eq!(cgroup_value(&mut sb, &memory), (256u64 << 20).to_string());
    assert_eq!(pids_max_of(&mut sb), "48");
    assert_eq!(tmpfs_sizes(&mut sb), [256 << 20, 256 << 20]);
    destroy_and_check(sb);
}

/// The sizes of the sandbox's /tmp and /dev/shm, in bytes.
fn tmpfs_sizes(sb: &mut cube_core::Sandbox) -> [u64; 2] {
    let (code, out, err) = sh(
        &sb.agent().unwrap(),
        "python3 -c 'import os\nfor p in (\"/tmp\", \"/dev/shm\"): s = os.statvfs(p); print(s.f_blocks * s.f_frsize)'",
    );
    assert_eq!(code, 0, "{err}");
    let sizes: Vec<u64> = out.lines().map(|l| l.trim().parse().unwrap()).collect();
    [sizes[0], sizes[1]]
}

#[test]
fn snapshot_and_rollback_restore_the_files_and_restart_the_agent() {
    if skip() {
        return;
    }
    let env = Env::new(0);
    let mut sb = env.create(CreateOptions::new(false));
    let agent = sb.agent().unwrap();
    assert_eq!(sh(&agent, "echo before > $HOME/a").0, 0);
    let snap = sb.snapshot().unwrap();
    assert_eq!(snap.kind, expected_kind());
    let listed = env.rt.snapshots(Some(sb.id())).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].kind, expected_kind());
    // A full snapshot ends the agent's connections: clients reconnect.
    let agent = sb.agent().unwrap();
    assert_eq!(listed[0].engine, Engine::Jail);
    assert_eq!(sh(&agent, "echo after > $HOME/a; echo new > $HOME/b").0, 0);
    let generation = sb.status().unwrap().generation;
    sb.rollback(&snap.id).unwrap();
    assert!(sb.status().unwrap().generation > generation);
    // The old agent is gone with its processes; a new connection reaches the new one.
    let agent = sb.agent().unwrap();
    let (_, out, _) = sh(
        &agent,
        "cat $HOME/a; test -e $HOME/b && echo b-exists; true",
    );
    assert_eq!(out, "before\n");
    // The snapshot can be rolled back to again.
    assert_eq!(sh(&agent, "echo third > $HOME/a").0, 0);
    sb.rollback(&snap.id).unwrap();
    assert_eq!(sh(&sb.agent().unwrap(), "cat $HOME/a").1, "before\n");
    let snap_dir = snap.dir.clone();
    destroy_and_check(sb);
    assert!(!snap_dir.exists(), "the sandbox's snapshots go with it");
}

#[test]
fn clones_and_their_source_do_not_see_each_others_changes() {
    if skip() {
        return;
    }
    let env = Env::new(0);
    let mut source = env.create(CreateOptions::new(false));
    let src_agent = source.agent().unwrap();
    assert_eq!(sh(&src_agent, "echo shared > $HOME/f").0, 0);
    let clones = env
        .rt
        .clone_sandbox(&mut source, 2, 2, CreateOptions::new(false))
        .unwrap();
    assert_eq!(clones.len(), 2);
    // The clone's snapshot may have ended the source's connections.
    let src_agent = source.agent().unwrap();
    let a = clones[0].agent().unwrap();
    let b = clones[1].agent().unwrap();
    assert_eq!(sh(&a, "cat $HOME/f").1, "shared\n");
    assert_eq!(
        sh(&a, "echo from-clone > $HOME/f; echo x > $HOME/only-clone").0,
        0
    );
    assert_eq!(sh(&src_agent, "echo from-source > $HOME/only-source").0, 0);
    assert_eq!(
        sh(&src_agent, "cat $HOME/f; ls $HOME").1,
        "shared\nf\nonly-source\n"
    );
    assert_eq!(sh(&a, "ls $HOME").1, "f\nonly-clone\n");
    assert_eq!(sh(&b, "cat $HOME/f; ls $HOME").1, "shared\nf\n");
    for c in clones {
        assert_eq!(c.engine(), Engine::Jail);
        destroy_and_check(c);
    }
    destroy_and_check(source);
}

#[test]
fn two_sandboxes_cannot_see_each_others_files() {
    if skip() {
        return;
    }
    let env = Env::new(0);
    let mut a = env.create(CreateOptions::new(true));
    let b = env.create(CreateOptions::new(true));
    let a_agent = a.agent().unwrap();
    let b_agent = b.agent().unwrap();
    assert_eq!(sh(&a_agent, "echo secret > $HOME/secret").0, 0);
    let a_layer = jail_status(&mut a).layer;
    let probe = format!(
        "test -e $HOME/secret && echo own-home; \
         test -e {}/home/user/secret && echo host-path; \
         test -e {} && echo store; \
         find / -xdev -name secret 2>/dev/null | head -1; true",
        a_layer.display(),
        env.root.display()
    );
    assert_eq!(sh(&b_agent, &probe).1, "");
    a.destroy().unwrap();
    b.destroy().unwrap();
}

#[test]
fn hibernate_keeps_the_files_and_wake_starts_again() {
    if skip() {
        return;
    }
    let env = Env::new(0);
    let mut sb = env.create(CreateOptions::new(false));
    assert_eq!(sh(&sb.agent().unwrap(), "echo kept > $HOME/k").0, 0);
    let pid = jail_status(&mut sb).pid.unwrap();
    sb.hibernate().unwrap();
    assert_eq!(sb.status().unwrap().status, MachineStatus::Hibernated);
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "processes outlived hibernate"
    );
    assert!(jail_status(&mut sb).pid.is_none());
    assert!(matches!(sb.agent(), Err(SandboxError::Hibernated(_))));
    // A snapshot of a hibernated sandbox copies the kept layer.
    let snap = sb.snapshot().unwrap();
    assert_eq!(snap.kind, expected_kind());
    sb.wake().unwrap();
    assert_eq!(sb.status().unwrap().status, MachineStatus::Running);
    assert_eq!(sh(&sb.agent().unwrap(), "cat $HOME/k").1, "kept\n");
    destroy_and_check(sb);
}

/// Requests on other connections racing a destroy are served before it or refused
/// after it, never by a supervisor whose jail is gone. In the fault suite, a status
/// sent while a killed caller's destroy ran read "hibernated", and the wake that
/// followed tried to start a jail on the removed layer.
#[test]
fn requests_racing_a_destroy_are_served_before_it_or_refused() {
    if skip() {
        return;
    }
    let env = Env::new(0);
    for round in 0..10 {
        let sb = env.create(CreateOptions::new(true));
        let id = sb.id().to_string();
        let seen = race_a_destroy(&env.rt, sb);
        for (status, wake) in seen {
            if let Ok(status) = status {
                assert_eq!(status, MachineStatus::Running, "round {round}");
            }
            // Never hibernated: no wake succeeds, none tries to start a jail.
            let e = wake.expect_err("a wake of a sandbox that never hibernated");
            let why = cube_core::error_report::chain(&e);
            assert!(!why.contains("starting the jail"), "round {round}: {why}");
        }
        assert!(
            !env.root.join("sandboxes").join(&id).exists(),
            "round {round}"
        );
    }
}

#[test]
fn a_sandbox_past_its_lifetime_is_destroyed() {
    if skip() {
        return;
    }
    let env = Env::new(0);
    let mut options = CreateOptions::new(false);
    options.lifetime = Some(Duration::from_millis(300));
    let mut sb = env.create(options);
    let dir = sb.dir().to_path_buf();
    let jail = jail_status(&mut sb);
    drop(sb);
    let deadline = Instant::now() + Duration::from_secs(10);
    while dir.exists() {
        assert!(
            Instant::now() < deadline,
            "the sandbox outlived its lifetime"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for cg in &jail.cgroups {
        let deadline = Instant::now() + Duration::from_secs(5);
        while cg.exists() {
            assert!(
                Instant::now() < deadline,
                "cgroup {} survived",
                cg.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    assert!(env.rt.list().unwrap().is_empty());
}

#[test]
fn an_ephemeral_sandbox_ends_with_its_handle() {
    if skip() {
        return;
    }
    let env = Env::new(0);
    let mut sb = env.create(CreateOptions::new(true));
    let dir = sb.dir().to_path_buf();
    let supervisor = sb.status().unwrap().pid;
    drop(sb);
    let deadline = Instant::now() + Duration::from_secs(10);
    while dir.exists() || Path::new(&format!("/proc/{supervisor}")).exists() {
        assert!(
            Instant::now() < deadline,
            "the ephemeral sandbox outlived its handle"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A supervisor on a host without KVM (here: /dev/kvm hidden in its mount namespace)
/// still serves jail sandboxes, pooled ones included, and says why a VM cannot start.
#[test]
fn supervisors_without_kvm_serve_jails() {
    if skip() {
        return;
    }
    let unshare_works = std::process::Command::new("unshare")
        .args(["-m", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !unshare_works {
        eprintln!("skipped: unshare -m is not available to hide /dev/kvm");
        return;
    }
    let dir = tempfile::TempDir::new().unwrap();
    let root = dir.path().canonicalize().unwrap();
    // The wrapper execs the real supervisor, which finds the agent next to itself.
    let wrapper = root.join("cube-supervisor");
    let hide = if Path::new("/dev/kvm").exists() {
        "mount --bind /dev/null /dev/kvm || exit 1"
    } else {
        ":"
    };
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec unshare -m sh -c '{hide}; exec \"$0\" \"$@\"' {} \"$@\"\n",
            common::supervisor().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let store = root.join("store");
    let rt = Runtime::open(RuntimeConfig {
        store_root: store.clone(),
        pool_size: 1,
        network_pool_size: 0,
        supervisor: Some(wrapper),
    })
    .unwrap();
    rt.wait_pool_ready();
    let sb = rt.create(HOST_TEMPLATE, CreateOptions::new(true)).unwrap();
    assert_eq!(
        sh(&sb.agent().unwrap(), "echo no-kvm-needed").1,
        "no-kvm-needed\n"
    );
    sb.destroy().unwrap();
    let err = rt
        .build_test_template(
            "vm",
            cube_core::templates::MachineConfig::default(),
            cube_core::templates::WorkingSet::default(),
            0,
        )
        .expect_err("a VM cannot start without KVM");
    let message = cube_core::error_report::chain(&err);
    assert!(message.contains("needs KVM"), "{message}");
    // The supervisor's refusal crossed the process boundary with its kind.
    assert_eq!(err.kind(), cube_core::ErrorKind::HostCannot, "{message}");
    drop(rt);
}

#[test]
fn usage_counts_the_memory_cpu_and_tasks_of_the_sandbox() {
    if skip() {
        return;
    }
    let env = Env::new(0);
    let mut options = CreateOptions::new(true);
    options.memory_mib = Some(512);
    let mut sb = env.create(options);
    let before = sb.usage().unwrap();
    assert_eq!(before.memory_limit_bytes, Some(512 << 20));
    let agent = sb.agent().unwrap();
    // A process that holds 96 MiB, touched, while the usage is read.
    let mut hold = agent
        .start(RequestBody::Exec(ExecRequest {
            argv: vec![
                "python3".into(),
                "-c".into(),
                "import sys, time\nb = bytearray(96 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n\
                 print('held', flush=True)\ntime.sleep(30)"
                    .into(),
            ],
            ..ExecRequest::default()
        }))
        .unwrap();
    loop {
        match hold.recv().unwrap() {
            Some(cube_agent::protocol::ResponseBody::Stdout(b))
                if String::from_utf8_lossy(&b).contains("held") =>
            {
                break
            }
            Some(cube_agent::protocol::ResponseBody::Exited(e)) => panic!("exited: {e:?}"),
            _ => {}
        }
    }
    let during = sb.usage().unwrap();
    assert!(
        during.memory_bytes >= 96 << 20,
        "{} bytes charged while 96 MiB are held",
        during.memory_bytes
    );
    let (before_cpu, during_cpu) = (before.cpu_time_ns.unwrap(), during.cpu_time_ns.unwrap());
    assert!(during_cpu > before_cpu, "{before_cpu} -> {during_cpu} ns");
    if let Some(tasks) = during.tasks {
        assert!(
            tasks >= 2,
            "{tasks} tasks with the agent and python running"
        );
    }
    assert!(during.cpus >= 1);
    agent.kill(hold.id, 9).unwrap();
    drop(agent);
    sb.hibernate().unwrap();
    assert_eq!(sb.usage().unwrap(), cube_core::ResourceUsage::default());
    sb.destroy().unwrap();
}

#[test]
fn a_sandbox_hosting_containers_runs_a_process_in_a_root_of_its_own() {
    if skip() {
        return;
    }
    if !Path::new("/bin/busybox").is_file() {
        eprintln!("skipped: no /bin/busybox (Debian's busybox-static) to fill a root with");
        return;
    }
    let env = Env::new(0);
    let sh_in = |agent: &cube_agent::client::Client, root: &str, script: &str| {
        agent.exec_in_root(
            root,
            ExecRequest {
                argv: vec![
                    "/bin/busybox".into(),
                    "sh".into(),
                    "-c".into(),
                    script.into(),
                ],
                cwd: Some("/work".into()),
                ..ExecRequest::default()
            },
        )
    };
    // A sandbox that hosts no containers refuses, and says why.
    let plain = env.create(CreateOptions::new(true));
    let agent = plain.agent().unwrap();
    let err = sh_in(&agent, "/", "true").unwrap_err().to_string();
    assert!(
        err.contains("only a pod sandbox's agent may chroot"),
        "{err}"
    );
    plain.destroy().unwrap();

    let pod = env.create(CreateOptions {
        hosts_containers: true,
        ..CreateOptions::new(true)
    });
    let agent = pod.agent().unwrap();
    let (code, _, err) = sh(
        &agent,
        "mkdir -p $HOME/c1/bin $HOME/c1/work && cp /bin/busybox $HOME/c1/bin/ && \
         for a in cat ls chroot true; do ln -s busybox $HOME/c1/bin/$a; done && echo c1 > $HOME/c1/marker",
    );
    assert_eq!(code, 0, "{err}");
    let root = format!("{}/c1", sh(&agent, "echo -n $HOME").1);
    // Inside: its own tree (its PATH finds its own programs), its working directory,
    // and no capability (the agent keeps CAP_SYS_CHROOT to itself: chroot fails).
    let out = sh_in(
        &agent,
        &root,
        "pwd; cat /marker; ls /; chroot / /bin/true 2>&1 || echo REFUSED",
    )
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.exit.code, Some(0), "{stdout}{stderr}");
    let mut lines = stdout.lines();
    assert_eq!(lines.next(), Some("/work"), "{stdout}{stderr}");
    assert_eq!(lines.next(), Some("c1"), "{stdout}{stderr}");
    // /proc is not there: the host side binds what a container needs.
    assert!(
        !stdout.contains("home"),
        "the sandbox's tree shows: {stdout}"
    );
    assert!(stdout.ends_with("REFUSED\n"), "{stdout}");
    // The agent itself: CAP_SYS_CHROOT effective, nothing to pass on.
    let (_, status, _) = sh(&agent, "grep -E '^Cap(Inh|Prm|Eff|Amb):' /proc/1/status");
    assert!(status.contains("CapEff:\t0000000000040000"), "{status}");
    assert!(status.contains("CapInh:\t0000000000000000"), "{status}");
    assert!(status.contains("CapAmb:\t0000000000000000"), "{status}");
    let (_, child, _) = sh(&agent, "grep -E '^Cap(Prm|Eff|Amb):' /proc/self/status");
    assert_eq!(child.matches("0000000000000000").count(), 3, "{child}");
    // A root that is not a directory of the sandbox: a clear failure, not a crash.
    let err = sh_in(&agent, "/no/such/root", "true")
        .unwrap_err()
        .to_string();
    assert!(err.contains("No such file"), "{err}");
    pod.destroy().unwrap();
}

#[test]
fn a_pooled_create_gets_more_memory_than_its_jail_started_with() {
    if skip() {
        return;
    }
    // The pool's jail starts with the default limits; the create raises memory past
    // them (on cgroup v1 with swap accounting: memory+swap first, or EINVAL).
    let env = Env::new(1);
    env.rt.wait_pool_ready();
    let mut options = CreateOptions::new(true);
    options.memory_mib = Some(4096);
    let mut sb = env.create(options);
    let memory = ["memory.max", "memory.limit_in_bytes"];
    assert_eq!(cgroup_value(&mut sb, &memory), (4096u64 << 20).to_string());
    // Its /tmp and /dev/shm too (they had the default limit's size).
    assert_eq!(tmpfs_sizes(&mut sb), [4096 << 20, 4096 << 20]);
    destroy_and_check(sb);
}
