//! The `cube` binary, run as a user would: sandboxes across invocations, JSON output,
//! and the error paths with their exit codes.

// Helpers outside #[test] functions may panic too: a failure there is a test failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kvm_present() -> bool {
    if Path::new("/dev/kvm").exists() {
        return true;
    }
    eprintln!("skipped: /dev/kvm not present");
    false
}

/// The supervisor binary cargo built next to `cube`.
fn supervisor() -> PathBuf {
    let cube = PathBuf::from(env!("CARGO_BIN_EXE_cube"));
    let path = cube.with_file_name("cube-supervisor");
    assert!(
        path.is_file(),
        "{} is missing: build cube-supervisor too (cargo test --workspace does)",
        path.display()
    );
    path
}

fn cube(store: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cube"))
        .arg("--store")
        .arg(store)
        .args(args)
        .env("CUBE_SUPERVISOR", supervisor())
        .output()
        .expect("running cube")
}

fn ok(store: &Path, args: &[&str]) -> String {
    let out = cube(store, args);
    assert!(
        out.status.success(),
        "cube {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

#[test]
fn doctor_json_has_the_documented_keys() {
    let store = tempfile::tempdir().unwrap();
    let out = ok(store.path(), &["doctor", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for key in [
        "kvm",
        "reflink",
        "soft_dirty",
        "uffd_wp",
        "criu",
        "ebpf",
        "cgroup",
        "engines",
    ] {
        assert!(v.get(key).is_some(), "doctor --json lacks {key}: {out}");
    }
    let kvm = v["kvm"].as_str().unwrap();
    assert!(["hardware", "pvm", "none"].contains(&kvm));
    assert!(["v1", "v2", "hybrid"].contains(&v["cgroup"].as_str().unwrap_or("v2")));
    assert!(v["engines"].is_array());
    // As root on a Linux host the jail engine is proven by starting one.
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } == 0 {
        assert!(
            v["engines"].as_array().unwrap().iter().any(|e| e == "jail"),
            "{out}"
        );
        assert!(v["notes"].to_string().contains("weaker than a VM"), "{out}");
    }
    // The table form prints the same facts for people.
    let table = ok(store.path(), &["doctor"]);
    assert!(table.contains("kvm") && table.contains(kvm));
}

#[test]
fn sandboxes_live_across_invocations() {
    if !kvm_present() {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    ok(
        s,
        &[
            "template",
            "build-test",
            "t",
            "--memory-mib",
            "128",
            "--disk-mib",
            "16",
        ],
    );
    let templates: serde_json::Value =
        serde_json::from_str(&ok(s, &["template", "ls", "--json"])).unwrap();
    assert_eq!(templates[0]["name"], "t");

    let id = ok(s, &["sandbox", "create", "t"]).trim().to_string();
    let listed: serde_json::Value =
        serde_json::from_str(&ok(s, &["sandbox", "ls", "--json"])).unwrap();
    assert_eq!(listed[0]["id"], id.as_str());
    let inspect: serde_json::Value =
        serde_json::from_str(&ok(s, &["sandbox", "inspect", &id, "--json"])).unwrap();
    assert_eq!(inspect["status"], "Running");

    ok(s, &["sandbox", "dirty", &id, "2"]);
    let snap = ok(s, &["sandbox", "snapshot", &id]).trim().to_string();
    assert!(snap.starts_with("snap-"));
    ok(s, &["sandbox", "rollback", &id, &snap]);
    ok(s, &["sandbox", "pause", &id]);
    let paused: serde_json::Value =
        serde_json::from_str(&ok(s, &["sandbox", "inspect", &id, "--json"])).unwrap();
    assert_eq!(paused["status"], "Paused");
    ok(s, &["sandbox", "resume", &id]);
    ok(s, &["sandbox", "hibernate", &id]);
    let hibernated: serde_json::Value =
        serde_json::from_str(&ok(s, &["sandbox", "inspect", &id, "--json"])).unwrap();
    assert_eq!(hibernated["status"], "Hibernated");
    ok(s, &["sandbox", "wake", &id]);
    let clones: Vec<String> = ok(s, &["sandbox", "clone", &id, "-n", "2"])
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(clones.len(), 2);

    let mut all = vec!["sandbox", "rm", id.as_str()];
    all.extend(clones.iter().map(String::as_str));
    ok(s, &all);
    let listed: serde_json::Value =
        serde_json::from_str(&ok(s, &["sandbox", "ls", "--json"])).unwrap();
    assert_eq!(listed, serde_json::json!([]));
    assert_eq!(std::fs::read_dir(s.join("sandboxes")).unwrap().count(), 0);
    assert_eq!(std::fs::read_dir(s.join("snapshots")).unwrap().count(), 0);
    ok(s, &["template", "rm", "t"]);
}

#[test]
fn errors_say_what_is_wrong_with_meaningful_exit_codes() {
    let store = tempfile::tempdir().unwrap();
    let s = store.path();
    let unknown = cube(s, &["sandbox", "inspect", "sb-0000000000000000"]);
    assert_eq!(unknown.status.code(), Some(3));
    assert!(
        String::from_utf8_lossy(&unknown.stderr).contains("No sandbox named sb-0000000000000000")
    );

    let bad_template = cube(s, &["sandbox", "create", "no-such-template"]);
    assert_eq!(bad_template.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&bad_template.stderr)
        .contains("No template named no-such-template"));

    let bad_id = cube(s, &["sandbox", "inspect", "../etc"]);
    assert!(!bad_id.status.success());

    let missing = cube(s, &["sandbox", "rollback", "sb-0000000000000000"]);
    assert_eq!(
        missing.status.code(),
        Some(2),
        "clap reports usage errors with 2"
    );

    let unknown_rm = cube(s, &["template", "rm", "nope"]);
    assert_eq!(unknown_rm.status.code(), Some(3));
}

#[test]
fn bench_quick_json_has_the_documented_shape() {
    if !kvm_present() {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    // A small guest keeps this test short; the shape is what is checked here.
    let out = ok(
        store.path(),
        &["bench", "--quick", "--json", "--memory-mib", "256"],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["guest"], "synthetic");
    assert_eq!(v["engine"], "vm");
    for key in [
        "rollback_ms",
        "pause_ms",
        "resume_ms",
        "hibernate_ms",
        "wake_ms",
    ] {
        assert!(
            v[key].as_f64().is_some_and(|x| x >= 0.0),
            "{key} missing: {out}"
        );
    }
    for key in ["floor_kvm_vm_ms", "floor_write_mib_per_s"] {
        assert!(
            v[key].as_f64().is_some_and(|x| x > 0.0),
            "{key} missing: {out}"
        );
    }
    // Other processes on a shared host move "used memory" too, so only its presence
    // is checked here; the bench reports it over 20+ sandboxes to average that out.
    assert!(v["memory_overhead_mib_per_sandbox"].as_f64().is_some());
    assert!(v["memory_overhead_sandboxes"]
        .as_u64()
        .is_some_and(|n| n >= 20));
    for row in v["create_from_template"].as_array().unwrap() {
        for key in ["concurrency", "n", "p50_ms", "p95_ms", "throughput_per_s"] {
            assert!(row[key].is_number(), "create row lacks {key}");
        }
        assert!(row["p50_ms"].as_f64() <= row["p95_ms"].as_f64());
    }
    let sizes = v["create_vs_guest_size"].as_array().unwrap();
    assert_eq!(sizes.len(), 2);
    for row in sizes {
        assert!(row["p50_ms"].as_f64().is_some_and(|x| x > 0.0));
    }
    let snaps = v["snapshot_vs_dirty"].as_array().unwrap();
    assert!(snaps.len() >= 2);
    for row in snaps {
        for key in ["dirty_mib", "snapshot_ms", "create_from_snapshot_ms"] {
            assert!(row[key].is_number(), "snapshot row lacks {key}");
        }
        // Every page the guest was asked to dirty is in the snapshot's dirty set.
        let mib = row["dirty_mib"].as_u64().unwrap();
        assert!(row["dirty_pages"].as_u64().unwrap() >= mib * 256);
    }
    for row in v["clone"].as_array().unwrap() {
        for key in ["n", "concurrency", "samples", "wall_ms", "per_clone_ms"] {
            assert!(row[key].is_number(), "clone row lacks {key}");
        }
        // A single clone is timed more than once (its bar is the median).
        if row["n"] == 1 {
            assert!(row["samples"].as_u64().unwrap() > 1, "{row}");
        }
    }
    // Nothing is left behind.
    assert_eq!(
        std::fs::read_dir(store.path().join("sandboxes"))
            .unwrap()
            .count(),
        0
    );
    assert_eq!(
        std::fs::read_dir(store.path().join("templates"))
            .unwrap()
            .count(),
        0
    );
}
