//! A pooled supervisor killed outright (SIGKILL: no clean-up runs) must not leave its
//! pre-started jail running: the agent watches a lifeline pipe whose write end only the
//! supervisor holds, and shuts the sandbox down when it reads as closed. The cgroups
//! it leaves are swept by the next pooled supervisor.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cube_core::{Runtime, RuntimeConfig};

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

fn parent(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .and_then(|v| v.trim().parse().ok())
}

fn pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// A runtime on the store at `root` keeping one supervisor ready.
fn pooled_runtime(root: &Path) -> Runtime {
    Runtime::open(RuntimeConfig {
        store_root: root.to_path_buf(),
        pool_size: 1,
        network_pool_size: 0,
        supervisor: Some(common::supervisor()),
    })
    .unwrap()
}

/// Gone, or a zombie waiting for its reaper.
fn ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

#[test]
fn a_killed_pool_supervisor_takes_its_prestarted_jail_with_it() {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 || cube_jail::CgroupLayout::detect().is_err() {
        eprintln!("skipping: jails need root and a readable cgroup hierarchy");
        return;
    }
    let dir = tempfile::TempDir::new().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let rt = pooled_runtime(&root);
    rt.wait_pool_ready();
    let marker = format!("--scratch {}", root.display());
    let supervisor = pids()
        .into_iter()
        .find(|p| cmdline(*p).contains(&marker))
        .expect("a pooled supervisor runs");
    // Its pre-started jail's PID 1, the agent (started once the supervisor is warm).
    let deadline = Instant::now() + Duration::from_secs(10);
    let agent = loop {
        if let Some(a) = pids()
            .into_iter()
            .find(|p| parent(*p) == Some(supervisor) && cmdline(*p).contains("cube-agent"))
        {
            break a;
        }
        if Instant::now() > deadline {
            eprintln!("skipping: the pooled supervisor started no jail ahead (see its log)");
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let cgroups: Vec<PathBuf> = std::fs::read_to_string(format!("/proc/{agent}/cgroup"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once(':')?;
            let (ctrl, path) = rest.split_once(':')?;
            let hierarchy = match ctrl {
                "" => "unified".to_string(),
                c => c.trim_start_matches("name=").to_string(),
            };
            Some(
                Path::new("/sys/fs/cgroup")
                    .join(hierarchy)
                    .join(path.trim_start_matches('/')),
            )
        })
        .filter(|p| p.to_string_lossy().contains("pool-"))
        .collect();

    eprintln!("killing supervisor {supervisor}; its jail's agent is {agent}, cgroups {cgroups:?}");
    // SAFETY: signals a process this test found by its command line; no memory effects.
    assert_eq!(unsafe { libc::kill(supervisor as i32, libc::SIGKILL) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ended(agent) {
        assert!(
            Instant::now() < deadline,
            "the pre-started jail's agent {agent} outlived its supervisor"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Its cgroups (empty now) are named after it: the next pooled supervisor sweeps them
    // when it starts its first jail.
    assert!(!cgroups.is_empty());
    drop(rt);
    let rt = pooled_runtime(&root);
    rt.wait_pool_ready();
    let deadline = Instant::now() + Duration::from_secs(10);
    while cgroups.iter().any(|cg| cg.exists()) {
        assert!(
            Instant::now() < deadline,
            "the killed supervisor's cgroups outlived the next pooled supervisor's start: {cgroups:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(rt);
}
