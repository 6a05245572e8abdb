//! Snapshots that travel between stores: a full-state jail snapshot exported from one
//! store and imported into another (a fresh `CUBE_HOME`) starts a sandbox whose Python
//! variable and file are the ones set before the export; a tampered or truncated
//! archive is refused with a clear error and leaves the importing store unchanged.
//! Prints export and import throughput. Skipped (with the reason) without root, cgroups
//! or a working CRIU.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use cube_core::{
    CreateOptions, PortableError, Runtime, RuntimeConfig, SandboxError, SnapshotKind, HOST_TEMPLATE,
};

mod common;
use common::{py, skip_full_jail};

fn runtime(root: &Path) -> Runtime {
    Runtime::open(RuntimeConfig {
        store_root: root.to_path_buf(),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: Some(common::supervisor()),
    })
    .unwrap()
}

/// Every path under `root` with its length: what "the store is unchanged" compares.
fn listing(root: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let meta = std::fs::symlink_metadata(e.path()).unwrap();
            let rel = e.path().strip_prefix(root).unwrap().display().to_string();
            if meta.is_dir() {
                stack.push(e.path());
            }
            out.push((rel, if meta.is_file() { meta.len() } else { 0 }));
        }
    }
    out.sort();
    out
}

fn mib_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / elapsed.as_secs_f64()
}

#[test]
fn a_snapshot_travels_to_a_fresh_store_and_bad_archives_are_refused() {
    if skip_full_jail() {
        return;
    }
    let here = tempfile::tempdir().unwrap();
    let there = tempfile::tempdir().unwrap();
    let files = tempfile::tempdir().unwrap();
    let source = runtime(&here.path().canonicalize().unwrap());

    let mut sb = source
        .create(HOST_TEMPLATE, CreateOptions::new(true))
        .unwrap();
    let agent = sb.agent().unwrap();
    // 32 MiB of random bytes (incompressible) make the memory worth measuring; the
    // variable is the proof.
    py(
        &agent,
        "import os; ballast = os.urandom(32 << 20); x = 41 * 1000 + 1",
    );
    agent
        .write_file(
            "/home/user/notes.txt",
            &mut &b"written before the export"[..],
        )
        .unwrap();
    drop(agent);
    let snap = sb.snapshot().unwrap();
    assert_eq!(snap.kind, SnapshotKind::Full, "{:?}", snap.fallback);

    let archive = files.path().join("snap.cube");
    let start = Instant::now();
    let exported = source.export_snapshot(&snap.id, &archive).unwrap();
    let export_time = start.elapsed();
    assert_eq!(exported.template.as_deref(), Some(HOST_TEMPLATE));
    // Every store has the built-in template: an importer needs none.
    assert_eq!(exported.required_template(), None);
    assert_eq!(
        std::fs::metadata(&archive).unwrap().len(),
        exported.archive_bytes
    );

    let target_root = there.path().canonicalize().unwrap();
    let target = runtime(&target_root);
    let before = listing(&target_root);

    // Damaged archives first: each is refused and the store stays as it was.
    let bytes = std::fs::read(&archive).unwrap();
    let mut tampered = bytes.clone();
    let middle = tampered.len() / 2;
    tampered[middle] ^= 0x01;
    let cases = [
        ("tampered", tampered),
        ("truncated", bytes[..bytes.len() - 100].to_vec()),
        ("cut in its header", bytes[..10].to_vec()),
    ];
    for (what, damaged) in cases {
        let path = files
            .path()
            .join(format!("{}.cube", what.replace(' ', "-")));
        std::fs::write(&path, &damaged).unwrap();
        let err = target.import_snapshot(&path).unwrap_err();
        let text = cube_core::error_report::chain(&err);
        eprintln!("{what}: {text}");
        assert!(
            text.contains("is not a usable snapshot archive"),
            "{what}: {text}"
        );
        assert!(
            text.contains("checksum")
                || text.contains("truncated")
                || text.contains("corrupt")
                || text.contains("Malformed"),
            "{what}: {text}"
        );
        assert_eq!(listing(&target_root), before, "{what} changed the store");
        assert!(target.snapshots(None).unwrap().is_empty());
    }

    let start = Instant::now();
    let imported = target.import_snapshot(&archive).unwrap();
    let import_time = start.elapsed();
    assert_eq!(imported.snapshot, snap.id);
    assert_eq!(imported.kind, SnapshotKind::Full);
    assert!(matches!(
        target.import_snapshot(&archive),
        Err(SandboxError::Portable(PortableError::Exists(_)))
    ));

    // The source goes first: the clone must stand on the imported files alone.
    sb.destroy().unwrap();
    drop(source);

    let clone = target
        .create_from_snapshot(&imported.snapshot, CreateOptions::new(true))
        .unwrap();
    let agent = clone.agent().unwrap();
    assert_eq!(py(&agent, "x"), "41001");
    assert_eq!(py(&agent, "len(ballast)"), (32u32 << 20).to_string());
    let mut notes = Vec::new();
    agent.read_file("/home/user/notes.txt", &mut notes).unwrap();
    assert_eq!(notes, b"written before the export");
    drop(agent);
    clone.destroy().unwrap();
    target.remove_snapshot(&imported.snapshot).unwrap();

    println!(
        "portable snapshot: {} MiB of files, {} MiB of data -> {} MiB archive; export {:.0} ms ({:.0} MiB/s of data), import {:.0} ms ({:.0} MiB/s of data)",
        exported.file_bytes >> 20,
        exported.data_bytes >> 20,
        exported.archive_bytes >> 20,
        export_time.as_secs_f64() * 1e3,
        mib_per_s(exported.data_bytes, export_time),
        import_time.as_secs_f64() * 1e3,
        mib_per_s(exported.data_bytes, import_time),
    );
}
