//! The v1 code paths (limits, freezer.state, kill without cgroup.kill), exercised on a
//! hybrid host by hiding its v2 hierarchy.

mod common;

use std::fs;
use std::process::Command;
use std::time::Duration;

use cube_jail::cgroup::{CgroupVersion, Freezer, LayoutKind};
use cube_jail::{CgroupLayout, Limits, SandboxCgroup};

#[test]
fn v1_freezer_limits_and_kill() {
    if common::skip() {
        return;
    }
    let mut layout = CgroupLayout::detect().unwrap();
    if layout
        .v1
        .iter()
        .all(|h| !h.controllers.iter().any(|c| c == "freezer"))
    {
        println!("skipped: no v1 freezer hierarchy on this host");
        return;
    }
    layout.v2 = None;
    assert_eq!(layout.kind(), LayoutKind::Legacy);
    let limits = Limits {
        memory_bytes: Some(256 << 20),
        cpu_quota: Some(0.5),
        pids_max: Some(16),
        disk_bytes: None,
    };
    if ["memory", "cpu", "pids"]
        .iter()
        .any(|c| layout.provider(c).is_none())
    {
        println!("skipped: v1 lacks one of memory, cpu, pids");
        return;
    }
    let cg = SandboxCgroup::create(&layout, &common::unique("v1"), &limits).unwrap();
    let Some(Freezer::V1(freezer_dir)) = cg.freezer().cloned() else {
        panic!("expected the v1 freezer, got {:?}", cg.freezer());
    };
    let mem = layout.provider("memory").unwrap();
    assert_eq!(mem.version, CgroupVersion::V1);
    let mem_dir = cg
        .dirs()
        .find(|d| d.starts_with(&mem.mount))
        .unwrap()
        .to_path_buf();
    assert_eq!(
        fs::read_to_string(mem_dir.join("memory.limit_in_bytes"))
            .unwrap()
            .trim(),
        (256u64 << 20).to_string()
    );
    let cpu = layout.provider("cpu").unwrap();
    let cpu_dir = cg.dirs().find(|d| d.starts_with(&cpu.mount)).unwrap();
    assert_eq!(
        fs::read_to_string(cpu_dir.join("cpu.cfs_quota_us"))
            .unwrap()
            .trim(),
        "50000",
        "half a core of a 100 ms period"
    );
    let pids = layout.provider("pids").unwrap();
    let pids_dir = cg.dirs().find(|d| d.starts_with(&pids.mount)).unwrap();
    assert_eq!(
        fs::read_to_string(pids_dir.join("pids.max"))
            .unwrap()
            .trim(),
        "16"
    );

    let tmp = tempfile::tempdir().unwrap();
    let counter = tmp.path().join("counter");
    let mut child = Command::new("/bin/sh")
        .arg("-c")
        .arg(format!(
            "while :; do echo x >> {}; sleep 0.01; done",
            counter.display()
        ))
        .spawn()
        .unwrap();
    for f in cg.procs_files() {
        fs::write(f, child.id().to_string()).unwrap();
    }
    assert!(cg.procs().unwrap().contains(&(child.id() as i32)));
    let size = || fs::metadata(&counter).map(|m| m.len()).unwrap_or(0);
    std::thread::sleep(Duration::from_millis(100));
    cg.freeze().unwrap();
    assert_eq!(
        fs::read_to_string(freezer_dir.join("freezer.state"))
            .unwrap()
            .trim(),
        "FROZEN"
    );
    let frozen = size();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(size(), frozen);
    cg.thaw().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(size() > frozen);

    // Kill while frozen: kill_all thaws first, then SIGKILLs each process.
    cg.freeze().unwrap();
    let dirs: Vec<_> = cg.dirs().map(|d| d.to_path_buf()).collect();
    // The shell is our child: reap it concurrently so kill_all sees the cgroup empty.
    let reaper = std::thread::spawn(move || child.wait().unwrap());
    cg.remove().unwrap();
    assert!(!reaper.join().unwrap().success());
    assert!(dirs.iter().all(|d| !d.exists()));
}
