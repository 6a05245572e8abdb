//! Damaged snapshots and a full store, on both engines. Every file of a snapshot is in
//! turn truncated, bit-flipped and swapped with the same file of another snapshot of
//! the sandbox: creating from it and rolling back to it must either fail with an error
//! that says what is wrong (the sandbox rolled back staying as it was) or bring back
//! exactly the snapshot's state; never another state. A store that runs out of space
//! mid-snapshot fails the snapshot with ENOSPC, leaves no part of it listed or staged,
//! and the sandbox goes on; once space is back, snapshots work again.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::engines::Suite;
use common::*;

/// Regular files under `dir`, relative to it, sorted.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let t = entry.file_type().unwrap();
            if t.is_dir() {
                stack.push(entry.path());
            } else if t.is_file() {
                out.push(entry.path().strip_prefix(dir).unwrap().to_path_buf());
            }
        }
    }
    out.sort();
    out
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Damage {
    Truncated,
    BitFlipped,
    Swapped,
}

/// Applies `damage` to `file` (with `other`, the same file of another snapshot, for a
/// swap); false where it does not apply (an empty file, no counterpart).
fn damage(file: &Path, other: &Path, damage: Damage, salt: u64) -> bool {
    let len = std::fs::metadata(file).unwrap().len();
    match damage {
        Damage::Truncated => {
            if len == 0 {
                return false;
            }
            let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
            f.set_len(len / 2).unwrap();
        }
        Damage::BitFlipped => {
            if len == 0 {
                return false;
            }
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(file)
                .unwrap();
            // A byte of the first 64 KiB (headers, metadata, the start of page data):
            // where a flip has something to be noticed by.
            let at = salt % len.min(64 << 10);
            let mut b = [0u8];
            f.read_exact_at(&mut b, at).unwrap();
            b[0] ^= 1 << (salt % 8);
            f.write_all_at(&b, at).unwrap();
        }
        Damage::Swapped => {
            if !other.is_file() || std::fs::read(file).unwrap() == std::fs::read(other).unwrap() {
                return false;
            }
            std::fs::copy(other, file).unwrap();
        }
    }
    true
}

/// What happened to one damaged file: refused (with the error's first line), or
/// restored exactly.
#[derive(Default)]
struct Outcomes {
    refused: BTreeMap<String, usize>,
    restored_exactly: usize,
}

fn damaged_snapshots_are_refused_or_exact(suite: Suite) {
    let (mut sb, s0) = suite.create(0);
    let a = sb.snapshot().unwrap();
    let s1 = suite.set(&mut sb, Some(&s0), 1);
    let b = sb.snapshot().unwrap();
    let files = files_under(&a.dir);
    assert!(!files.is_empty());
    let saved = tempfile::TempDir::new().unwrap();
    let mut outcomes: BTreeMap<Damage, Outcomes> = BTreeMap::new();
    let mut salt = 0x9e37_79b9_u64;
    for rel in &files {
        for kind in [Damage::Truncated, Damage::BitFlipped, Damage::Swapped] {
            let file = a.dir.join(rel);
            let keep = saved.path().join("keep");
            std::fs::copy(&file, &keep).unwrap();
            salt = salt.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            if !damage(&file, &b.dir.join(rel), kind, salt >> 11) {
                continue;
            }
            let when = format!("{} {kind:?} {}", suite.name(), rel.display());
            let tally = outcomes.entry(kind).or_default();
            // Created from: refused, or exactly s0.
            match suite.rt.create_from_snapshot(&a.id, EPHEMERAL) {
                Ok(mut restored) => {
                    assert!(
                        s0.holds(&mut restored),
                        "{when}: a damaged snapshot restored to another state"
                    );
                    s0.check(&mut restored, &when);
                    restored.destroy().unwrap();
                    tally.restored_exactly += 1;
                }
                Err(e) => {
                    let text = error_chain(&e);
                    let first = text.replace(&a.id, "SNAP").replace(sb.id(), "SB");
                    *tally.refused.entry(first).or_default() += 1;
                }
            }
            // Rolled back to: refused with the sandbox as it was, or exactly s0 (then
            // back to s1 through the intact snapshot b).
            match sb.rollback(&a.id) {
                Ok(()) => {
                    s0.check(&mut sb, &format!("{when}, rolled back"));
                    sb.rollback(&b.id).unwrap();
                }
                Err(e) => {
                    assert!(!error_chain(&e).is_empty());
                }
            }
            s1.check(&mut sb, &format!("{when}, the sandbox after the rollback"));
            std::fs::rename(&keep, &file).unwrap();
        }
    }
    // Undamaged again, the snapshot restores.
    sb.rollback(&a.id).unwrap();
    s0.check(&mut sb, "after repair");
    for (kind, o) in &outcomes {
        eprintln!(
            "{} {kind:?}: {} files, {} refused, {} restored exactly; errors: {:#?}",
            suite.name(),
            o.refused.values().sum::<usize>() + o.restored_exactly,
            o.refused.values().sum::<usize>(),
            o.restored_exactly,
            o.refused
        );
    }
    let id = sb.id().to_string();
    sb.destroy().unwrap();
    assert!(suite.leftovers(&id, &[]).is_empty());
}

#[test]
fn jail_damaged_snapshot_files_are_refused_or_exact() {
    if let Some(suite) = Suite::jail() {
        damaged_snapshots_are_refused_or_exact(suite);
    }
}

#[test]
fn vm_damaged_snapshot_files_are_refused_or_exact() {
    if let Some(suite) = Suite::vm() {
        damaged_snapshots_are_refused_or_exact(suite);
    }
}

/// A size-limited tmpfs mounted for this test, unmounted on drop.
struct SmallStore {
    dir: tempfile::TempDir,
}

impl SmallStore {
    fn mount(mib: u64) -> Option<SmallStore> {
        let dir = tempfile::TempDir::new().unwrap();
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={mib}m,mode=0755"),
                "cube-enospc",
            ])
            .arg(dir.path())
            .output();
        match out {
            Ok(o) if o.status.success() => Some(SmallStore { dir }),
            Ok(o) => {
                eprintln!(
                    "skipped: cannot mount a small tmpfs: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
                None
            }
            Err(e) => {
                eprintln!("skipped: no mount command: {e}");
                None
            }
        }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().canonicalize().unwrap()
    }

    /// Bytes free on the store.
    fn free(&self) -> u64 {
        let path = std::ffi::CString::new(self.dir.path().as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: statvfs writes into the zeroed struct we pass; the path is a C string.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut st) }, 0);
        st.f_bavail * st.f_frsize
    }
}

impl Drop for SmallStore {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

fn full_store_fails_the_snapshot_cleanly(vm: bool) {
    let Some(store) = SmallStore::mount(if vm { 400 } else { 600 }) else {
        return;
    };
    let suite = Suite::open(vm, Some(&store.root()));
    let (mut sb, s0) = suite.create(0);
    let a = sb.snapshot().unwrap();
    let s1 = suite.set(&mut sb, Some(&s0), 1);
    // Fill the store, leaving a little (less than a snapshot needs).
    let filler = store.root().join("filler");
    let leave = 64 << 10;
    let size = store.free().saturating_sub(leave);
    let f = std::fs::File::create(&filler).unwrap();
    // Written, not fallocated: tmpfs counts pages, and written pages are what it has.
    use std::io::Write;
    let mut w = std::io::BufWriter::new(f);
    let chunk = vec![0x5au8; 1 << 20];
    let mut written = 0u64;
    while written < size {
        let n = chunk.len().min((size - written) as usize);
        if w.write_all(&chunk[..n]).is_err() {
            break;
        }
        written += n as u64;
    }
    let _ = w.flush();
    drop(w);
    let snapshots_before = suite.rt.snapshots(Some(sb.id())).unwrap().len();
    let err = match sb.snapshot() {
        Ok(s) => panic!(
            "{}: a snapshot fit in {} free bytes: {s:?}",
            suite.name(),
            store.free()
        ),
        Err(e) => e,
    };
    let text = error_chain(&err);
    eprintln!("{}: snapshot on a full store: {text}", suite.name());
    assert!(
        text.contains("No space left") || text.contains("ENOSPC") || text.contains("os error 28"),
        "the error does not say the store is full: {text}"
    );
    assert_eq!(
        suite.rt.snapshots(Some(sb.id())).unwrap().len(),
        snapshots_before,
        "a failed snapshot is listed"
    );
    let tmp = entries(&suite.root.join("tmp"));
    assert!(tmp.is_empty(), "a failed snapshot left {tmp:?} in tmp/");
    std::fs::remove_file(&filler).unwrap();
    // The sandbox went on, and snapshots work again.
    s1.check(&mut sb, "after the failed snapshot");
    let b = sb.snapshot().unwrap();
    sb.rollback(&a.id).unwrap();
    s0.check(&mut sb, "rolled back to the snapshot before the full store");
    sb.rollback(&b.id).unwrap();
    s1.check(&mut sb, "rolled back to the snapshot after it");
    let id = sb.id().to_string();
    sb.destroy().unwrap();
    assert!(suite.leftovers(&id, &[]).is_empty());
    drop(suite);
}

#[test]
fn jail_full_store_fails_the_snapshot_cleanly() {
    if common::skip_full_jail() {
        return;
    }
    full_store_fails_the_snapshot_cleanly(false);
}

#[test]
fn vm_full_store_fails_the_snapshot_cleanly() {
    if !kvm_present() {
        return;
    }
    full_store_fails_the_snapshot_cleanly(true);
}
