//! Jail sandboxes on a root filesystem directory of the caller's (a container's rootfs
//! as containerd's snapshotter mounts it), and snapshots of them created from again on
//! the directory asked for.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::sh;

use std::path::{Path, PathBuf};

use cube_core::{CreateOptions, Runtime, RuntimeConfig, HOST_TEMPLATE};

/// The statically linked agent (`scripts/build-static.sh`, run by the set-up): a
/// rootfs that is not the host's carries no C library the host's build could use.
fn static_agent() -> Option<PathBuf> {
    let supervisor = common::supervisor().canonicalize().ok()?;
    let bins = supervisor.parent()?;
    let built = bins
        .parent()?
        .join("static")
        .join(bins.file_name()?)
        .join("cube-agent");
    built.is_file().then_some(built)
}

/// Whether this host cannot run these tests; prints why. Points the supervisors this
/// test starts at the static agent.
fn skip() -> bool {
    if common::skip_jail() {
        return true;
    }
    if !Path::new("/bin/busybox").is_file() {
        eprintln!("skipped: /bin/busybox is missing (scripts/setup.sh installs busybox-static)");
        return true;
    }
    let Some(agent) = static_agent() else {
        eprintln!(
            "skipped: no statically linked cube-agent \
             (scripts/build-static.sh --musl cube-agent cube-agent --release)"
        );
        return true;
    };
    // Every test of this binary sets the same value before it starts a supervisor.
    std::env::set_var("CUBE_AGENT", agent);
    false
}

/// A root filesystem directory at `dir`: static busybox with the applets a shell needs,
/// the usual mount points, and `/marker` holding `marker`.
fn busybox_tree(dir: &Path, marker: &str) -> PathBuf {
    for d in ["bin", "etc", "tmp", "proc", "dev", "sys", "root", "home"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", dir.join("bin/busybox")).unwrap();
    for applet in ["sh", "cat", "echo", "test", "true"] {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(applet)).unwrap();
    }
    std::fs::write(dir.join("marker"), marker).unwrap();
    dir.to_path_buf()
}

fn on_tree(tree: PathBuf) -> CreateOptions {
    CreateOptions {
        rootfs: Some(tree),
        ..CreateOptions::new(false)
    }
}

#[test]
fn a_snapshot_is_created_from_on_the_root_filesystem_asked_for() {
    if skip() {
        return;
    }
    let store = tempfile::TempDir::new().unwrap();
    let rt = Runtime::open(RuntimeConfig {
        store_root: store.path().canonicalize().unwrap(),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: Some(common::supervisor()),
    })
    .unwrap();
    let trees = tempfile::TempDir::new().unwrap();
    let first = busybox_tree(&trees.path().join("first"), "first");
    let mut sb = rt.create(HOST_TEMPLATE, on_tree(first)).unwrap();
    let agent = sb.agent().unwrap();
    assert_eq!(sh(&agent, "cat /marker").1, "first");
    let (code, _, err) = sh(&agent, "echo kept > $HOME/note");
    assert_eq!(code, 0, "{err}");
    let snap = sb.snapshot().unwrap();
    // A container restored elsewhere: the same files under another directory, told
    // apart by the marker.
    let second = busybox_tree(&trees.path().join("second"), "second");
    let restored = rt.create_from_snapshot(&snap.id, on_tree(second)).unwrap();
    let (code, out, err) = sh(&restored.agent().unwrap(), "cat $HOME/note /marker");
    assert_eq!((code, out.as_str()), (0, "kept\nsecond"), "{err}");
    restored.destroy().unwrap();
    sb.destroy().unwrap();
    assert!(rt.list().unwrap().is_empty());
}
