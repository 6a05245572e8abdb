//! Destroy leaves nothing behind; overlay roots copy on write; in-memory roots never
//! reach the disk.

mod common;

use std::fs;
use std::path::Path;

use cube_jail::{Jail, JailExit, RootSpec, Stdio};

#[test]
fn destroy_leaves_no_process_mount_cgroup_or_file() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut c = common::config(tmp.path(), "destroy");
    c.stdout = Stdio::Null;
    c.stderr = Stdio::Null;
    let jail = Jail::spawn(
        &c,
        &[
            "/bin/sh",
            "-c",
            "sleep 60 & sleep 60 & (sleep 60 &) ; echo x > /tmp/f; sleep 60",
        ],
    )
    .unwrap();
    let cg = jail.cgroup().unwrap();
    let mut pids = Vec::new();
    for _ in 0..500 {
        pids = cg.procs().unwrap();
        if pids.len() >= 5 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(pids.len() >= 5, "expected sh and 4 sleeps, got {pids:?}");
    let cgroup_dirs: Vec<_> = cg.dirs().map(Path::to_path_buf).collect();
    let state_dir = jail.state_dir().unwrap().to_path_buf();
    // The sandbox's mounts live in its own namespace: the host never sees them.
    assert!(common::host_mounts_under(&state_dir).is_empty());
    jail.destroy().unwrap();
    for pid in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} survived destroy"
        );
    }
    assert!(common::host_mounts_under(&state_dir).is_empty());
    for d in cgroup_dirs {
        assert!(!d.exists(), "cgroup {} survived destroy", d.display());
    }
    assert!(!state_dir.exists(), "sandbox directory survived destroy");
}

#[test]
fn dropping_a_jail_destroys_it() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut c = common::config(tmp.path(), "drop");
    c.stdout = Stdio::Null;
    c.stderr = Stdio::Null;
    let jail = Jail::spawn(&c, &["/bin/sleep", "60"]).unwrap();
    let pid = jail.pid();
    let dirs: Vec<_> = jail
        .cgroup()
        .unwrap()
        .dirs()
        .map(Path::to_path_buf)
        .collect();
    drop(jail);
    assert!(!Path::new(&format!("/proc/{pid}")).exists());
    assert!(dirs.iter().all(|d| !d.exists()));
    assert!(!c.state_dir.exists());
}

#[test]
fn an_in_memory_root_never_touches_the_disk_and_leaves_nothing() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut c = common::config(tmp.path(), "memory");
    c.root = RootSpec::HostUserlandInMemory;
    c.stdout = Stdio::Pipe;
    c.stderr = Stdio::Pipe;
    let script = "echo kept > ~/f && cat ~/f; \
                  touch /etc/x 2>/dev/null || echo etc-not-writable; \
                  touch /x 2>/dev/null || echo root-not-writable; \
                  cat /etc/hostname; python3 -c 'print(6*7)'";
    let mut jail = Jail::spawn(&c, &["/bin/sh", "-c", script]).unwrap();
    let state_dir = jail.state_dir().unwrap().to_path_buf();
    // The host sees the sandbox directory empty: the root is a tmpfs in the
    // sandbox's own mount namespace.
    assert_eq!(fs::read_dir(&state_dir).unwrap().count(), 0);
    let out = common::collect(&mut jail);
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    assert_eq!(
        out.stdout,
        format!(
            "kept\netc-not-writable\nroot-not-writable\n{}\n42\n",
            c.hostname
        )
    );
    assert_eq!(fs::read_dir(&state_dir).unwrap().count(), 0);
    let dirs: Vec<_> = jail
        .cgroup()
        .unwrap()
        .dirs()
        .map(Path::to_path_buf)
        .collect();
    jail.destroy().unwrap();
    assert!(!state_dir.exists(), "sandbox directory survived destroy");
    assert!(dirs.iter().all(|d| !d.exists()));
    assert!(common::host_mounts_under(tmp.path()).is_empty());
}

#[test]
fn a_jail_that_is_not_pausable_and_unlimited_has_no_cgroup() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut c = common::config(tmp.path(), "nocg");
    c.pausable = false;
    let mut jail = Jail::spawn(&c, &["/bin/sh", "-c", "echo ran"]).unwrap();
    assert!(jail.cgroup().is_none());
    assert!(jail.pause().is_err(), "nothing to freeze");
    let out = common::collect(&mut jail);
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    assert_eq!(out.stdout, "ran\n");
    jail.destroy().unwrap();
    assert!(!c.state_dir.exists());

    // A limit still needs its cgroup.
    let mut c = common::config(tmp.path(), "nocg-limited");
    c.pausable = false;
    c.limits.pids_max = Some(64);
    let jail = Jail::spawn(&c, &["/bin/sleep", "30"]).unwrap();
    assert!(jail.cgroup().is_some());
    jail.destroy().unwrap();
}

#[test]
fn overlay_root_copies_on_write_and_keeps_the_template() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let template = tmp.path().join("template");
    fs::create_dir_all(template.join("data")).unwrap();
    fs::write(template.join("data/file"), "template\n").unwrap();
    let mut perms = fs::metadata(template.join("data/file"))
        .unwrap()
        .permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o666);
    fs::set_permissions(template.join("data/file"), perms).unwrap();
    let mut c = common::config(tmp.path(), "overlay");
    c.root = RootSpec::Overlay {
        lower: vec![template.clone()],
        host_userland: true,
    };
    let mut jail = Jail::spawn(
        &c,
        &[
            "/bin/sh",
            "-c",
            "cat /data/file; echo sandbox > /data/file; cat /data/file",
        ],
    )
    .unwrap();
    let upper = jail.state_dir().unwrap().join("upper/data/file");
    let out = common::collect(&mut jail);
    assert_eq!(out.exit, JailExit::Exited(0), "stderr: {}", out.stderr);
    assert_eq!(out.stdout, "template\nsandbox\n");
    assert_eq!(fs::read_to_string(&upper).unwrap(), "sandbox\n");
    jail.destroy().unwrap();
    assert_eq!(
        fs::read_to_string(template.join("data/file")).unwrap(),
        "template\n"
    );
}

#[test]
fn a_kept_layer_seeds_a_new_sandbox_with_the_files_written_before() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut c = common::config(tmp.path(), "keep1");
    let mut jail = Jail::spawn(&c, &["/bin/sh", "-c", "echo kept > $HOME/note"]).unwrap();
    assert!(common::collect(&mut jail).exit.success());
    let kept = tmp.path().join("kept-layer");
    let state_dir = jail.state_dir().unwrap().to_path_buf();
    let cgroups: Vec<_> = jail
        .cgroup()
        .unwrap()
        .dirs()
        .map(Path::to_path_buf)
        .collect();
    jail.destroy_keeping_layer(&kept).unwrap();
    assert!(!state_dir.exists(), "the sandbox directory goes");
    for d in cgroups {
        assert!(!d.exists(), "cgroup {} survived", d.display());
    }
    assert_eq!(
        fs::read_to_string(kept.join("home/user/note")).unwrap(),
        "kept\n"
    );

    // A planted symlink where the set-up makes a file must be replaced, not followed.
    let outside = tmp.path().join("outside");
    fs::write(&outside, "host file").unwrap();
    fs::remove_file(kept.join("etc/hostname")).unwrap();
    std::os::unix::fs::symlink(&outside, kept.join("etc/hostname")).unwrap();

    c = common::config(tmp.path(), "keep2");
    c.seed_layer = Some(kept.clone());
    let mut jail =
        Jail::spawn(&c, &["/bin/sh", "-c", "cat $HOME/note; cat /etc/hostname"]).unwrap();
    assert!(!kept.exists(), "the seed is moved into place");
    let out = common::collect(&mut jail);
    assert!(out.exit.success(), "{}", out.stderr);
    assert_eq!(out.stdout, "kept\nsandbox\n");
    assert_eq!(fs::read_to_string(&outside).unwrap(), "host file");
    jail.destroy().unwrap();
}

#[test]
fn a_running_sandbox_can_be_relocated() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut c = common::config(tmp.path(), "reloc");
    c.stdin = Stdio::Pipe;
    let mut jail = Jail::spawn(
        &c,
        &["/bin/sh", "-c", "read x; echo $x > $HOME/f; cat $HOME/f"],
    )
    .unwrap();
    let to = tmp.path().join("moved");
    jail.relocate(&to).unwrap();
    assert_eq!(jail.state_dir().unwrap(), to);
    assert!(jail.layer_dir().unwrap().starts_with(&to));
    {
        use std::io::Write;
        let mut stdin = jail.take_stdin().unwrap();
        stdin.write_all(b"hello\n").unwrap();
    }
    let out = common::collect(&mut jail);
    assert_eq!(out.stdout, "hello\n");
    assert_eq!(
        fs::read_to_string(jail.layer_dir().unwrap().join("home/user/f")).unwrap(),
        "hello\n"
    );
    jail.destroy().unwrap();
    assert!(!to.exists());
}

#[test]
fn a_failed_spawn_gives_the_seed_layer_back() {
    if common::skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let seed = tmp.path().join("seed");
    fs::create_dir_all(seed.join("home/user")).unwrap();
    fs::write(seed.join("home/user/precious"), "data").unwrap();
    let mut c = common::config(tmp.path(), "seedback");
    c.seed_layer = Some(seed.clone());
    let r = Jail::spawn(&c, &["/no/such/program"]);
    assert!(r.is_err(), "spawning a missing program must fail");
    assert!(!tmp.path().join("seedback").exists());
    assert_eq!(
        fs::read_to_string(seed.join("home/user/precious")).unwrap(),
        "data"
    );
}

#[test]
fn cgroups_named_after_a_dead_process_are_swept_and_a_live_ones_are_kept() {
    if common::skip() {
        return;
    }
    let layout = cube_jail::CgroupLayout::detect().unwrap();
    let prefix = format!("t{}-sweep-", std::process::id());
    // A pid that is gone: a child that exited and was reaped.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let live = std::process::id();
    let limits = cube_jail::Limits::default();
    let orphan =
        cube_jail::SandboxCgroup::create(&layout, &format!("{prefix}{dead}"), &limits).unwrap();
    let orphan_dirs: Vec<std::path::PathBuf> = orphan.dirs().map(|d| d.to_path_buf()).collect();
    assert!(!orphan_dirs.is_empty());
    // Its jail was still exiting when the sweep came (CI: `cube run` after a killed
    // one): a process is left inside, in a cgroup the jail made of its own (a
    // directory nested in each of the sandbox's, which its removal must go through).
    let mut straggler = KilledOnDrop(
        std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap(),
    );
    for dir in &orphan_dirs {
        let nested = dir.join("inner");
        std::fs::create_dir(&nested).unwrap();
        std::fs::write(nested.join("cgroup.procs"), straggler.0.id().to_string()).unwrap();
    }
    // As a SIGKILLed owner would: nothing removes it.
    std::mem::forget(orphan);
    let kept =
        cube_jail::SandboxCgroup::create(&layout, &format!("{prefix}{live}"), &limits).unwrap();
    assert_eq!(layout.remove_orphaned(&prefix), orphan_dirs.len());
    assert!(orphan_dirs.iter().all(|d| !d.exists()), "{orphan_dirs:?}");
    assert!(kept.dirs().all(|d| d.exists()));
    kept.remove().unwrap();
    let status = straggler.0.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "the process left in the orphaned cgroup was not killed"
    );
}

/// A child that a failing test does not leave running (it would hold the test
/// runner's output open).
struct KilledOnDrop(std::process::Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_frozen_jail_left_by_a_killed_owner_is_ended_and_its_cgroups_removed() {
    if common::skip() {
        return;
    }
    let layout = cube_jail::CgroupLayout::detect().unwrap();
    let name = format!("t{}-stale", std::process::id());
    let limits = cube_jail::Limits::default();
    // A sandbox's second jail (`<name>-2`), its process frozen as a supervisor killed
    // mid-snapshot leaves it: no lifeline can wake it.
    let cgroup = cube_jail::SandboxCgroup::create(&layout, &format!("{name}-2"), &limits).unwrap();
    let dirs: Vec<std::path::PathBuf> = cgroup.dirs().map(|d| d.to_path_buf()).collect();
    let mut child = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    for procs in cgroup.procs_files() {
        std::fs::write(procs, child.id().to_string()).unwrap();
    }
    // Reaped as it dies, as init reaps a killed supervisor's orphans: a zombie would
    // stay listed in its cgroup.
    let waiter = std::thread::spawn(move || child.wait().unwrap());
    let frozen = cgroup.freezer().is_some();
    if frozen {
        cgroup.freeze().unwrap();
    }
    std::mem::forget(cgroup);
    // A cgroup of another sandbox whose name starts the same stays.
    let other = cube_jail::SandboxCgroup::create(&layout, &format!("{name}-x-1"), &limits).unwrap();
    assert_eq!(
        layout.remove_jails_of(&name),
        Vec::<std::path::PathBuf>::new()
    );
    let status = waiter.join().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "the jail's process (frozen: {frozen}) was not killed"
    );
    assert!(dirs.iter().all(|d| !d.exists()), "{dirs:?}");
    assert!(other.dirs().all(|d| d.exists()));
    other.remove().unwrap();
}
