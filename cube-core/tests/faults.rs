//! Fault injection on both engines: the supervisor killed outright (SIGKILL) at a
//! random moment of snapshot, rollback, clone, hibernate, wake and destroy. After each
//! fault the sandbox is cleanly gone (no process, cgroup, mount or store entry left
//! once it is removed as stale), the error says the supervisor went away, every
//! snapshot in the store restores to a state the sandbox really had, and nothing
//! half-written is listed.
//!
//! The caller killed instead (the process that asked for the operation, a child of
//! this test running [`caller_child`]): the sandbox outlives it, still answers and
//! holds a state it really had (the operation done or not), every snapshot restores,
//! a clone made meanwhile is whole or removable as stale, and nothing is left.
//!
//! Sizes: `CUBE_FAULTS` supervisor faults and `CUBE_CALLER_FAULTS` caller faults per
//! operation and engine (default 3 and 2); `CUBE_FAULT_SEED` repeats a run's random
//! delays. `scripts/fault-suite.sh faults` runs 200 per operation.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::engines::{Expected, Suite};
use common::workload::count_from_env;
use common::*;
use cube_core::ErrorKind;

/// The operations a fault lands in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    Snapshot,
    Rollback,
    Clone,
    Hibernate,
    Wake,
    Destroy,
}

const OPS: [Op; 6] = [
    Op::Snapshot,
    Op::Rollback,
    Op::Clone,
    Op::Hibernate,
    Op::Wake,
    Op::Destroy,
];

/// splitmix64: the delays only need to be spread and repeatable from a seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A duration in [0, max).
    fn below(&mut self, max: Duration) -> Duration {
        let micros = max.as_micros().max(1) as u64;
        Duration::from_micros(self.next() % micros)
    }
}

fn seed() -> u64 {
    std::env::var("CUBE_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
}

/// A pidfd on process `pid`, so that a late kill cannot reach a reused pid.
fn pidfd(pid: u32) -> OwnedFd {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    assert!(
        fd >= 0,
        "pidfd_open({pid}): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: the fd was just returned to us and nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

/// SIGKILLs the process behind `fd` after `delay`; whether it was still there.
fn kill_after(fd: OwnedFd, delay: Duration) -> std::thread::JoinHandle<bool> {
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        // SAFETY: pidfd_send_signal on an fd we own, with no siginfo.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        r == 0
    })
}

/// Waits until the process behind pidfd `fd` has ended, threads and all.
fn pidfd_wait(fd: &OwnedFd, timeout: Duration) -> bool {
    let mut poll = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd, owned here, for the duration of the call.
    let r = unsafe { libc::poll(&mut poll, 1, timeout.as_millis() as i32) };
    r == 1
}

/// How one operation's faults went.
#[derive(Default)]
struct Tally {
    injected: usize,
    survived: usize,
    completed_first: usize,
    errors: BTreeMap<String, usize>,
}

/// Runs the operation `op` on a fresh sandbox with a SIGKILL of its supervisor after
/// `delay` (None: no fault, to time the operation), then checks everything.
fn one_run(suite: &Suite, op: Op, delay: Option<Duration>, tally: &mut Tally) -> Duration {
    let (mut sb, s0) = suite.create(0);
    let id = sb.id().to_string();
    let snap0 = sb.snapshot().unwrap();
    let s1 = suite.set(&mut sb, Some(&s0), 1);
    if op == Op::Wake {
        sb.hibernate().unwrap();
    }
    let status = sb.status().unwrap();
    let cgroup_parents: Vec<PathBuf> = status
        .jail
        .as_ref()
        .map(|j| {
            j.cgroups
                .iter()
                .filter_map(|c| c.parent().map(Path::to_path_buf))
                .collect()
        })
        .unwrap_or_default();
    let supervisor = status.pid;
    let supervisor_fd = pidfd(supervisor);
    let killer = delay.map(|d| kill_after(pidfd(supervisor), d));
    let start = Instant::now();
    let mut clone = None;
    let result = match op {
        Op::Snapshot => sb.snapshot().map(|_| ()),
        Op::Rollback => sb.rollback(&snap0.id),
        Op::Clone => suite
            .rt
            .clone_sandbox(&mut sb, 1, 1, PERSISTENT)
            .map(|mut c| clone = c.pop()),
        Op::Hibernate => sb.hibernate(),
        Op::Wake => sb.wake(),
        Op::Destroy => {
            let r = sb.destroy();
            // Destroy consumed the handle.
            return finish_run(
                suite,
                op,
                &id,
                supervisor,
                supervisor_fd,
                r,
                killer,
                start,
                &cgroup_parents,
                tally,
                None,
                &[],
            );
        }
    };
    let elapsed = start.elapsed();
    let expected: Vec<Expected> = match op {
        // A snapshot or clone taken before the kill holds s1; the earlier one s0.
        Op::Snapshot | Op::Clone => vec![s0.clone(), s1.clone()],
        _ => vec![s0.clone()],
    };
    let Some(killer) = killer else {
        result.unwrap();
        // No fault: the sandbox (and any clone) goes on, then is destroyed cleanly.
        if let Some(mut c) = clone {
            s1.check(&mut c, "an unfaulted clone");
            c.destroy().unwrap();
        }
        let now = if op == Op::Rollback { &s0 } else { &s1 };
        if op == Op::Hibernate {
            sb.wake().unwrap();
        }
        now.check(&mut sb, &format!("after an unfaulted {op:?}"));
        sb.destroy().unwrap();
        let left = suite.leftovers(&id, &cgroup_parents);
        assert!(left.is_empty(), "an unfaulted {op:?} left {left:?}");
        return elapsed;
    };
    finish_run(
        suite,
        op,
        &id,
        supervisor,
        supervisor_fd,
        result,
        Some(killer),
        start,
        &cgroup_parents,
        tally,
        clone,
        &expected,
    )
}

#[allow(clippy::too_many_arguments)]
fn finish_run(
    suite: &Suite,
    op: Op,
    id: &str,
    supervisor: u32,
    supervisor_fd: OwnedFd,
    result: Result<(), SandboxError>,
    killer: Option<std::thread::JoinHandle<bool>>,
    start: Instant,
    cgroup_parents: &[PathBuf],
    tally: &mut Tally,
    clone: Option<Sandbox>,
    expected: &[Expected],
) -> Duration {
    let elapsed = start.elapsed();
    let Some(killer) = killer else {
        result.unwrap();
        let left = wait_leftovers(suite, id, cgroup_parents);
        assert!(left.is_empty(), "an unfaulted {op:?} left {left:?}");
        return elapsed;
    };
    let killed = killer.join().unwrap();
    tally.injected += 1;
    if !killed {
        // The supervisor had exited already: only destroy ends it.
        assert_eq!(op, Op::Destroy, "the supervisor was gone before the kill");
        tally.completed_first += 1;
    }
    match &result {
        Ok(()) => tally.completed_first += usize::from(killed),
        Err(e) => {
            // The error names the sandbox and says the supervisor went away.
            let text = error_chain(e);
            assert!(
                text.contains(id),
                "{op:?}: the error does not name the sandbox: {text}"
            );
            assert!(
                matches!(e.kind(), ErrorKind::Internal | ErrorKind::NotFound),
                "{op:?}: a killed supervisor reads as {:?}: {text}",
                e.kind()
            );
            let line = text.replace(id, "ID");
            *tally.errors.entry(line).or_default() += 1;
        }
    }
    // A clone made before the kill is a sandbox of its own and holds s1.
    if let Some(mut c) = clone {
        expected[1].check(&mut c, &format!("a clone made before a fault in {op:?}"));
        c.destroy().unwrap();
    }
    // The sandbox is gone with its supervisor: it cannot be reached.
    // SIGKILL is delivered asynchronously, and a killed process's descriptors close
    // with its last thread (its leader shows as a zombie before that): wait on a pidfd,
    // which reads as ended only once the whole thread group is gone.
    assert!(
        pidfd_wait(&supervisor_fd, Duration::from_secs(30)),
        "{op:?}: supervisor {supervisor} outlived SIGKILL"
    );
    assert!(
        op == Op::Destroy || suite.rt.attach(id).is_err(),
        "{op:?}: the sandbox answers without its supervisor"
    );
    // Every snapshot the store lists restores to a state the sandbox had.
    if op != Op::Destroy {
        for meta in suite.rt.snapshots(Some(id)).unwrap() {
            let mut restored = suite
                .rt
                .create_from_snapshot(&meta.id, EPHEMERAL)
                .unwrap_or_else(|e| {
                    panic!(
                        "{op:?}: snapshot {} does not restore: {}",
                        meta.id,
                        error_chain(&e)
                    )
                });
            let matched = expected.iter().position(|s| s.holds(&mut restored));
            let Some(which) = matched else {
                panic!(
                    "{op:?}: snapshot {} restored to a state the sandbox never had",
                    meta.id
                );
            };
            expected[which].check(
                &mut restored,
                &format!("snapshot {} after a fault in {op:?}", meta.id),
            );
            restored.destroy().unwrap();
        }
        // Removing it as stale ends whatever of its jail is left (processes the
        // lifeline could not reach: frozen ones) and leaves nothing.
        suite.rt.remove_stale(id).unwrap();
    }
    let left = wait_leftovers(suite, id, cgroup_parents);
    assert!(left.is_empty(), "a fault in {op:?} left {left:?}");
    tally.survived += 1;
    elapsed
}

/// What of sandbox `id` is left once whatever is going away has gone.
fn wait_leftovers(suite: &Suite, id: &str, cgroup_parents: &[PathBuf]) -> Vec<String> {
    let mut left = Vec::new();
    wait_until(Duration::from_secs(20), || {
        left = suite.leftovers(id, cgroup_parents);
        left.is_empty()
    });
    left
}

/// The operations to fault: `CUBE_FAULT_OPS` (a comma-separated list), else all.
fn ops_from_env() -> Vec<Op> {
    match std::env::var("CUBE_FAULT_OPS") {
        Ok(list) => OPS
            .into_iter()
            .filter(|op| {
                list.split(',')
                    .any(|o| o.eq_ignore_ascii_case(&format!("{op:?}")))
            })
            .collect(),
        Err(_) => OPS.to_vec(),
    }
}

/// Whom a fault kills.
#[derive(Clone, Copy, Debug)]
enum Victim {
    /// The sandbox's supervisor.
    Supervisor,
    /// The process that asked for the operation.
    Caller,
}

impl Victim {
    /// Faults per operation and engine.
    fn count(self) -> usize {
        match self {
            Victim::Supervisor => count_from_env("CUBE_FAULTS", 3),
            Victim::Caller => count_from_env("CUBE_CALLER_FAULTS", 2),
        }
    }

    /// One run of `op` with this victim killed after `delay` (None: not killed).
    fn run(self, suite: &Suite, op: Op, delay: Option<Duration>, tally: &mut Tally) -> Duration {
        match self {
            Victim::Supervisor => one_run(suite, op, delay, tally),
            Victim::Caller => one_caller_run(suite, op, delay, tally),
        }
    }
}

fn run_suite(suite: Suite, victim: Victim) {
    let n = victim.count();
    let seed = seed();
    eprintln!(
        "{}: {n} kills of the {victim:?} per operation, CUBE_FAULT_SEED={seed}",
        suite.name()
    );
    let mut rng = Rng(seed);
    for op in ops_from_env() {
        let mut tally = Tally::default();
        let start = Instant::now();
        // One run without a fault times the operation: the kills land anywhere in it
        // and a little past it.
        let span = victim.run(&suite, op, None, &mut tally).mul_f64(1.25);
        for _ in 0..n {
            let delay = rng.below(span);
            victim.run(&suite, op, Some(delay), &mut tally);
        }
        eprintln!(
            "{} {op:?}: {} kills of the {victim:?} over 0..{span:?}, {} survived, {} after \
             the operation completed, {:?}; errors: {:?}",
            suite.name(),
            tally.injected,
            tally.survived,
            tally.completed_first,
            start.elapsed(),
            tally.errors
        );
        assert_eq!(tally.injected, tally.survived);
    }
}

#[test]
fn jail_supervisor_killed_at_random_points() {
    let Some(suite) = Suite::jail() else {
        return;
    };
    run_suite(suite, Victim::Supervisor);
}

#[test]
fn vm_supervisor_killed_at_random_points() {
    let Some(suite) = Suite::vm() else {
        return;
    };
    run_suite(suite, Victim::Supervisor);
}

#[test]
fn jail_caller_killed_at_random_points() {
    let Some(suite) = Suite::jail() else {
        return;
    };
    run_suite(suite, Victim::Caller);
}

#[test]
fn vm_caller_killed_at_random_points() {
    let Some(suite) = Suite::vm() else {
        return;
    };
    run_suite(suite, Victim::Caller);
}

/// The environment variable that makes [`caller_child`] the caller of one operation:
/// `OP ROOT ID SNAPSHOT` (the operation, the store root, the sandbox, the snapshot a
/// rollback goes to).
const CALLER_SPEC: &str = "CUBE_FAULT_CALLER";

/// How long a killed caller's last request is given to reach the supervisor's lock.
const CALLER_SETTLE: Duration = Duration::from_millis(300);

/// The caller side of a caller fault, run as a child process of the caller-fault
/// tests (this test binary again, with [`CALLER_SPEC`] set): attaches to the sandbox
/// through a runtime of its own and runs the operation, to be killed meanwhile. In a
/// plain test run (the variable unset) it returns at once.
#[test]
fn caller_child() {
    let Ok(spec) = std::env::var(CALLER_SPEC) else {
        return;
    };
    let [op, root, id, snap0]: [&str; 4] = spec
        .split(' ')
        .collect::<Vec<_>>()
        .try_into()
        .expect("OP ROOT ID SNAPSHOT");
    let rt = Runtime::open(RuntimeConfig {
        store_root: PathBuf::from(root),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: Some(supervisor()),
    })
    .unwrap();
    let mut sb = rt.attach(id).unwrap();
    let result = match op {
        "Snapshot" => sb.snapshot().map(|_| ()),
        "Rollback" => sb.rollback(snap0),
        "Clone" => rt.clone_sandbox(&mut sb, 1, 1, PERSISTENT).map(|_| ()),
        "Hibernate" => sb.hibernate(),
        "Wake" => sb.wake(),
        "Destroy" => sb.destroy(),
        other => panic!("no operation {other}"),
    };
    result.unwrap();
}

/// Runs `op` on a fresh sandbox from a child process that is SIGKILLed after `delay`
/// (None: not killed, to time the operation), then checks that the sandbox outlived
/// its caller in a state it really had.
fn one_caller_run(suite: &Suite, op: Op, delay: Option<Duration>, tally: &mut Tally) -> Duration {
    let (mut sb, s0) = suite.create(0);
    let id = sb.id().to_string();
    let snap0 = sb.snapshot().unwrap();
    let s1 = suite.set(&mut sb, Some(&s0), 1);
    if op == Op::Wake {
        sb.hibernate().unwrap();
    }
    let cgroup_parents: Vec<PathBuf> = sb
        .status()
        .unwrap()
        .jail
        .as_ref()
        .map(|j| {
            j.cgroups
                .iter()
                .filter_map(|c| c.parent().map(Path::to_path_buf))
                .collect()
        })
        .unwrap_or_default();
    drop(sb);
    let before: BTreeSet<String> = suite
        .rt
        .store()
        .list_sandboxes()
        .unwrap()
        .into_iter()
        .collect();
    let spec = format!("{op:?} {} {id} {}", suite.root.display(), snap0.id);
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["caller_child", "--exact", "--test-threads=1", "--quiet"])
        .env(CALLER_SPEC, spec)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let killer = delay.map(|d| kill_after(pidfd(child.id()), d));
    let exit = child.wait().unwrap();
    let elapsed = start.elapsed();
    match killer {
        None => assert!(exit.success(), "{op:?}: the unkilled caller failed: {exit}"),
        Some(killer) => {
            tally.injected += 1;
            if !killer.join().unwrap() || exit.success() {
                tally.completed_first += 1;
            }
        }
    }

    // The sandbox outlived its caller (unless the caller destroyed it): it answers,
    // and holds s1, or s0 after a rollback; hibernated, it wakes into s1.
    // The killed caller's request goes on in the supervisor: its bytes may still wait
    // in the socket for the supervisor's thread to read them. Give that thread time to
    // take the sandbox's lock (a status below then waits for the request to finish);
    // should it still come later, a wake it made first reads as "not hibernated".
    std::thread::sleep(CALLER_SETTLE);
    // A destroy the killed caller had sent may take the connection down between attach
    // and status: both are "going away".
    let reachable = suite
        .rt
        .attach(&id)
        .and_then(|mut sb| sb.status().map(|status| (sb, status)));
    match reachable {
        Ok((mut sb, status)) => {
            if matches!(status.status, MachineStatus::Hibernated) {
                match sb.wake() {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::BadState => {}
                    Err(e) => panic!(
                        "{op:?}: waking after its caller was killed: {}",
                        error_chain(&e)
                    ),
                }
            }
            let states = if op == Op::Rollback {
                vec![s0.clone(), s1.clone()]
            } else {
                vec![s1.clone()]
            };
            let Some(which) = states.iter().position(|s| s.holds(&mut sb)) else {
                panic!(
                    "{op:?}: after its caller was killed the sandbox holds a state it never had"
                );
            };
            states[which].check(&mut sb, &format!("after the caller of {op:?} was killed"));
            // Every snapshot it has restores to a state it had.
            for meta in suite.rt.snapshots(Some(&id)).unwrap() {
                let mut restored = suite
                    .rt
                    .create_from_snapshot(&meta.id, EPHEMERAL)
                    .unwrap_or_else(|e| {
                        panic!(
                            "{op:?}: snapshot {} does not restore: {}",
                            meta.id,
                            error_chain(&e)
                        )
                    });
                assert!(
                    [&s0, &s1].iter().any(|s| s.holds(&mut restored)),
                    "{op:?}: snapshot {} restored to a state the sandbox never had",
                    meta.id
                );
                restored.destroy().unwrap();
            }
            sb.destroy().unwrap();
        }
        Err(e) => {
            assert_eq!(
                op,
                Op::Destroy,
                "the caller of {op:?} was killed and the sandbox is unreachable: {}",
                error_chain(&e)
            );
            // The supervisor finishes a destroy whose caller died: the sandbox leaves
            // the store by itself, with no stale record for someone to sweep.
            let listed = || suite.rt.store().list_sandboxes().unwrap().contains(&id);
            assert!(
                wait_until(Duration::from_secs(20), || !listed()),
                "the caller of a destroy was killed and the sandbox stays listed"
            );
        }
    }
    // A clone the caller made is a sandbox of its own: whole (it holds s1), or, where
    // the caller died before adopting it, removable as stale.
    for new in suite.rt.store().list_sandboxes().unwrap() {
        if before.contains(&new) {
            continue;
        }
        assert_eq!(op, Op::Clone, "{op:?} made sandbox {new}");
        match suite.rt.attach(&new) {
            Ok(mut clone) => {
                s1.check(&mut clone, "a clone whose caller was killed");
                clone.destroy().unwrap();
            }
            Err(_) => suite.rt.remove_stale(&new).unwrap(),
        }
        let left = wait_leftovers(suite, &new, &cgroup_parents);
        assert!(
            left.is_empty(),
            "a clone whose caller was killed left {left:?}"
        );
    }
    let left = wait_leftovers(suite, &id, &cgroup_parents);
    assert!(
        left.is_empty(),
        "killing the caller of {op:?} left {left:?}"
    );
    if delay.is_some() {
        tally.survived += 1;
    }
    elapsed
}
