//! Jail sandboxes on root filesystems that are not the host's: a directory of the
//! caller's (a container's rootfs as containerd's snapshotter mounts it), snapshots of
//! them created from again on the directory asked for (exported, they say they need
//! such a tree), and templates built from container images (OCI layouts and `docker
//! save` archives the test writes).

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::sh;

use std::path::{Path, PathBuf};

use cube_core::templates::TreeSource;
use cube_core::testing::oci_image::{self, Compression::*, Entry};
use cube_core::{
    CreateOptions, ErrorKind, Runtime, RuntimeConfig, Sandbox, Snapshot, HOST_TEMPLATE,
};

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
    let Some(agent) = cube_core::testing::static_agent() else {
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

fn runtime(store: &Path) -> Runtime {
    Runtime::open(RuntimeConfig {
        store_root: store.canonicalize().unwrap(),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: Some(common::supervisor()),
    })
    .unwrap()
}

/// A sandbox on `tree` (whose marker it checks) with a note written in its home,
/// and a snapshot of it.
fn noted_snapshot(rt: &Runtime, tree: PathBuf) -> (Sandbox, Snapshot) {
    let marker = std::fs::read_to_string(tree.join("marker")).unwrap();
    let mut sb = rt.create(HOST_TEMPLATE, on_tree(tree)).unwrap();
    let agent = sb.agent().unwrap();
    assert_eq!(sh(&agent, "cat /marker").1, marker);
    let (code, _, err) = sh(&agent, "echo kept > $HOME/note");
    assert_eq!(code, 0, "{err}");
    drop(agent);
    let snap = sb.snapshot().unwrap();
    (sb, snap)
}

/// Checks that `sandbox` has the note of [`noted_snapshot`] and runs on the tree
/// marked `marker`.
fn assert_noted_on(sandbox: &Sandbox, marker: &str) {
    let (code, out, err) = sh(&sandbox.agent().unwrap(), "cat $HOME/note /marker");
    assert_eq!(
        (code, out.as_str()),
        (0, format!("kept\n{marker}").as_str()),
        "{err}"
    );
}

#[test]
fn a_snapshot_is_created_from_on_the_root_filesystem_asked_for() {
    if skip() {
        return;
    }
    let store = tempfile::TempDir::new().unwrap();
    let rt = runtime(store.path());
    let trees = tempfile::TempDir::new().unwrap();
    let first = busybox_tree(&trees.path().join("first"), "first");
    let (sb, snap) = noted_snapshot(&rt, first);
    // A container restored elsewhere: the same files under another directory, told
    // apart by the marker.
    let second = busybox_tree(&trees.path().join("second"), "second");
    let restored = rt.create_from_snapshot(&snap.id, on_tree(second)).unwrap();
    assert_noted_on(&restored, "second");
    restored.destroy().unwrap();
    sb.destroy().unwrap();
    assert!(rt.list().unwrap().is_empty());
}

/// A snapshot of a sandbox made on a directory lies over that tree, which no template
/// and no archive holds: its export says so (no template is named), its import records
/// it, and a create from it without a tree of its own is refused with the reason
/// instead of laying the layer over the host's userland.
#[test]
fn a_snapshot_over_a_directory_says_it_needs_a_tree() {
    if skip() {
        return;
    }
    let store = tempfile::TempDir::new().unwrap();
    let rt = runtime(store.path());
    let trees = tempfile::TempDir::new().unwrap();
    let first = busybox_tree(&trees.path().join("first"), "first");
    let (sb, snap) = noted_snapshot(&rt, first.clone());

    let archive = trees.path().join("snap.cube");
    let exported = rt.export_snapshot(&snap.id, &archive).unwrap();
    assert_eq!(exported.rootfs.as_deref(), Some(first.as_path()));
    assert_eq!(exported.template, None);
    assert_eq!(exported.required_template(), None);
    let said = exported.requirement();
    assert!(
        said.contains("not in the archive") && said.contains(&first.display().to_string()),
        "{said}"
    );
    assert!(!said.contains("userland"), "{said}");

    let refused = |rt: &Runtime, id: &str| {
        let err = rt
            .create_from_snapshot(id, CreateOptions::new(false))
            .err()
            .expect("a create without a tree is refused");
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
        assert!(err.to_string().contains("root directory"), "{err}");
    };
    refused(&rt, &snap.id);
    // Its snapshots go with it: the archive and its import stand alone from here.
    sb.destroy().unwrap();

    let other_store = tempfile::TempDir::new().unwrap();
    let other = runtime(other_store.path());
    let imported = other.import_snapshot(&archive).unwrap();
    assert_eq!(imported.rootfs.as_deref(), Some(first.as_path()));
    assert_eq!(imported.template, None);
    refused(&other, &imported.snapshot);
    assert!(other.list().unwrap().is_empty());
    let second = busybox_tree(&trees.path().join("second"), "second");
    let restored = other
        .create_from_snapshot(&imported.snapshot, on_tree(second))
        .unwrap();
    assert_noted_on(&restored, "second");
    restored.destroy().unwrap();
    assert!(other.list().unwrap().is_empty());
    assert!(rt.list().unwrap().is_empty());
}

/// Busybox as an image's base layer, with files the next layer changes.
fn busybox_layer() -> Vec<u8> {
    oci_image::busybox_layer(&[
        Entry::File("etc/msg", b"base"),
        Entry::File("etc/gone", b"whited out"),
        Entry::Dir("opq"),
        Entry::File("opq/old", b"hidden"),
    ])
    .unwrap()
}

/// The layer over it: a file replaced, one whited out, a directory made opaque.
fn top_layer() -> Vec<u8> {
    oci_image::layer(&[
        Entry::File("etc/msg", b"top"),
        Entry::File("etc/.wh.gone", b""),
        Entry::File("opq/.wh..wh..opq", b""),
        Entry::File("opq/new", b"new"),
    ])
    .unwrap()
}

fn image_config(layers: &[Vec<u8>]) -> Vec<u8> {
    oci_image::config(
        &["PATH=/bin", "GREETING=from the image", "MODE=image"],
        "/srv/app",
        "1000:1000",
        layers,
    )
}

/// What a sandbox of a template built from the test's image sees.
const PROBE: &str = "pwd; echo \"$GREETING|$MODE|$PATH\"; cat /etc/msg; echo; ls /opq; \
                     test -e /etc/gone || echo gone; id -u";

#[test]
fn templates_from_container_images_run_with_the_images_files_env_and_workdir() {
    if skip() {
        return;
    }
    let store = tempfile::TempDir::new().unwrap();
    let rt = runtime(store.path());
    let files = tempfile::TempDir::new().unwrap();
    let layers = vec![busybox_layer(), top_layer()];
    let config = image_config(&layers);
    let layout = files.path().join("layout");
    oci_image::oci_layout(&layout, &config, &layers, &[Gzip, Plain]).unwrap();
    let saved = files.path().join("saved.tar");
    oci_image::docker_save(&saved, &config, &layers).unwrap();

    for (name, image) in [("from-layout", &layout), ("from-save", &saved)] {
        let mut lines = Vec::new();
        let meta = rt
            .build_jail_template(name, &TreeSource::Oci(image.clone()), &mut |l| {
                lines.push(l.to_string())
            })
            .unwrap();
        let process = meta.process.clone().expect("an image's defaults are kept");
        assert_eq!(process.cwd.as_deref(), Some("/srv/app"));
        assert_eq!(process.user.as_deref(), Some("1000:1000"));
        assert!(lines.iter().any(|l| l.contains("2 layers")), "{lines:?}");
        // The caller's variables win over the image's of the same name.
        let sb = rt
            .create(
                name,
                CreateOptions {
                    env: vec![("MODE".into(), "caller".into())],
                    ..CreateOptions::new(false)
                },
            )
            .unwrap();
        let (code, out, err) = sh(&sb.agent().unwrap(), PROBE);
        assert_eq!(code, 0, "{err}");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[..6],
            [
                "/srv/app",
                "from the image|caller|/bin",
                "top",
                "new",
                "gone",
                // Every process of a jail runs as the sandbox's own host uid.
                lines[5],
            ],
            "{out}"
        );
        assert_ne!(lines[5], "0", "a sandbox's processes are not root");
        sb.destroy().unwrap();
    }
    assert!(rt.list().unwrap().is_empty());
}

#[test]
fn a_malformed_image_is_refused_and_leaves_no_template() {
    if skip() {
        return;
    }
    let store = tempfile::TempDir::new().unwrap();
    let rt = runtime(store.path());
    let files = tempfile::TempDir::new().unwrap();
    let escape = oci_image::layer(&[Entry::Raw("../../escaped", b"x")]).unwrap();
    let layout = files.path().join("escape");
    oci_image::oci_layout(
        &layout,
        &image_config(std::slice::from_ref(&escape)),
        &[escape],
        &[Plain],
    )
    .unwrap();
    let err = rt
        .build_jail_template("bad", &TreeSource::Oci(layout), &mut |_| {})
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert!(
        cube_core::error_report::chain(&err).contains("leaves the tree"),
        "{err}"
    );
    let saved = files.path().join("truncated.tar");
    let layers = vec![top_layer()];
    oci_image::docker_save(&saved, &image_config(&layers), &layers).unwrap();
    let whole = std::fs::read(&saved).unwrap();
    std::fs::write(&saved, &whole[..whole.len() / 3]).unwrap();
    let err = rt
        .build_jail_template("bad", &TreeSource::Oci(saved), &mut |_| {})
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert!(
        cube_core::error_report::chain(&err).contains("damaged or truncated"),
        "{}",
        cube_core::error_report::chain(&err)
    );
    assert!(rt
        .templates()
        .unwrap()
        .iter()
        .all(|t| t.name == HOST_TEMPLATE));
    assert_eq!(
        std::fs::read_dir(store.path().join("tmp")).unwrap().count(),
        0,
        "no staging debris"
    );
}
