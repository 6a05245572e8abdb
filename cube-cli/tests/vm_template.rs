//! `cube template build --engine vm` and `cube bench --guest linux` where a Linux guest
//! cannot run: on a PVM host with a stock kernel both say so (exactly why, what would
//! work, and the jail engine), leave nothing behind, and measure nothing. On VMX/SVM
//! hosts, where the build would succeed, these tests skip.
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
        "emulation failure",
        "PVM-enabled guest kernel",
        "--kernel",
        "VMX/SVM",
        "--engine jail",
    ] {
        assert!(stderr.contains(needed), "{needed:?} missing from: {stderr}");
    }
}

#[test]
fn a_vm_template_with_the_stock_kernel_fails_fast_on_pvm_and_leaves_nothing() {
    if !pvm_host() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
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
    assert_pvm_message(&text(&doctor.stdout));
}

#[test]
fn bench_guest_linux_records_the_skip_and_its_reason() {
    if !pvm_host() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = cube(dir.path(), &["bench", "--guest", "linux", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["guest"], "linux");
    assert_eq!(report["skipped"], true);
    assert_eq!(report["kvm"], "pvm");
    assert_pvm_message(report["reason"].as_str().unwrap());
    assert!(report.get("create_to_agent_ready").is_none(), "{report}");
}

#[test]
fn a_given_stock_kernel_boots_until_the_emulation_failure_and_says_so() {
    if !pvm_host() {
        return;
    }
    if std::env::var_os("CUBE_LONG_TESTS").is_none() {
        println!(
            "skipped: set CUBE_LONG_TESTS=1 to boot a stock kernel to KVM's emulation \
             failure (about 100 s here)"
        );
        return;
    }
    let kernels = Path::new("/var/lib/cube/kernels/debian-cloud");
    let (kernel, initrd) = (
        kernels.join("vmlinux"),
        kernels.join("initramfs-cube.cpio.gz"),
    );
    if !kernel.is_file() || !initrd.is_file() {
        println!(
            "skipped: no kernel in {} (scripts/fetch-kernel.sh)",
            kernels.display()
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
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
            "--kernel",
            kernel.to_str().unwrap(),
            "--initrd",
            initrd.to_str().unwrap(),
            "--boot-timeout",
            "600",
        ],
    );
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    assert_pvm_message(&text(&out.stderr));
    assert!(!store.join("templates/linux").exists());
    assert_eq!(std::fs::read_dir(store.join("tmp")).unwrap().count(), 0);
}
