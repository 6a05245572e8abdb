//! `cube template build --engine vm` and `cube bench --guest linux` where Debian's
//! stock kernel is the only guest kernel: on a PVM host, where it would run emulated
//! for about twelve minutes, both say so (why, what would work, the jail engine),
//! leave nothing behind, and measure nothing. On VMX/SVM hosts these tests skip.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output, Stdio};

use cube_core::host::{HostCapabilities, KvmKind};

const CUBE: &str = env!("CARGO_BIN_EXE_cube");

fn cube(store: &Path, args: &[&str]) -> Output {
    Command::new(CUBE)
        .arg("--store")
        .arg(store)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn pvm_host() -> bool {
    match HostCapabilities::probe().kvm {
        KvmKind::Pvm => true,
        other => {
            println!("skipped: KVM here is {other:?}, not PVM; a stock kernel would boot");
            false
        }
    }
}

fn assert_pvm_message(stderr: &str) {
    for needed in [
        "PVM",
        "emulated",
        "scripts/build-guest-kernel.sh",
        "--kernel",
        "--engine jail",
    ] {
        assert!(stderr.contains(needed), "{needed:?} missing from: {stderr}");
    }
}

/// A store whose only guest kernel is (a stand-in for) Debian's: the build refuses
/// it before reading it.
fn store_with_debian_kernel(root: &Path) {
    let kernels = root.join(cube_core::templates::DEBIAN_CLOUD_KERNEL);
    std::fs::create_dir_all(&kernels).unwrap();
    std::fs::write(kernels.join("vmlinux"), b"not booted").unwrap();
    std::fs::write(kernels.join("initramfs-cube.cpio.gz"), b"not read").unwrap();
}

#[test]
fn a_vm_template_with_debians_kernel_fails_fast_on_pvm_and_leaves_nothing() {
    if !pvm_host() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    store_with_debian_kernel(&store);
    let tree = dir.path().join("tree");
    std::fs::create_dir(&tree).unwrap();
    let out = cube(
        &store,
        &[
            "template",
            "build",
            "linux",
            "--engine",
            "vm",
            "--from",
            tree.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    assert_pvm_message(&text(&out.stderr));
    assert!(!store.join("templates/linux").exists());
    assert_eq!(std::fs::read_dir(store.join("tmp")).unwrap().count(), 0);

    let doctor = cube(&store, &["doctor"]);
    assert!(doctor.status.success());
    let report = text(&doctor.stdout);
    for needed in ["KVM is PVM", "emulated-kernel mode", "pvm_flavour"] {
        assert!(report.contains(needed), "{needed:?} missing from: {report}");
    }
}

#[test]
fn bench_guest_linux_records_the_skip_and_its_reason() {
    if !pvm_host() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    if let Some(kernel) = cube_core::templates::cube_guest_kernel(dir.path()) {
        println!(
            "skipped: Cube's guest kernel is built ({}): the Linux bench runs here",
            kernel.display()
        );
        return;
    }
    let out = cube(dir.path(), &["bench", "--guest", "linux", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["guest"], "linux");
    assert_eq!(report["skipped"], true);
    assert_eq!(report["kvm"], "pvm");
    assert_pvm_message(report["reason"].as_str().unwrap());
    assert!(report.get("create_to_agent_ready").is_none(), "{report}");
}
