//! Snapshots are exact, minimal and safe: rollback restores guest memory byte for
//! byte, a snapshot writes only the pages dirtied since the last one, damaged files are
//! rejected, a failed snapshot loses no dirty page, and a sandbox cannot be rolled back
//! to a snapshot it does not own.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use cube_storage::StoreError;

const MIB: u64 = 1 << 20;
const PAGES_PER_MIB: u64 = MIB / PAGE;
const MAILBOX_PAGE: u64 = MAILBOX_ADDR / PAGE;
const PD0_PAGE: u64 = PD0_ADDR / PAGE;
const DIRTY_AREA_PAGE: u64 = DIRTY_AREA_ADDR / PAGE;
/// Accessed and dirty bits of a page-table entry.
const PTE_ACCESSED_DIRTY: u64 = 0x60;

/// Byte offsets (within the mailbox page) of the words that differ between `a` and `b`.
fn differing_words(a: &[u8], b: &[u8]) -> Vec<u64> {
    (0..PAGE / 8)
        .map(|w| w * 8)
        .filter(|&o| u64_at(a, o) != u64_at(b, o))
        .collect()
}

fn page(image: &[u8], index: u64) -> &[u8] {
    &image[(index * PAGE) as usize..((index + 1) * PAGE) as usize]
}

#[test]
fn rollback_restores_memory_byte_for_byte() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    // No working set: after a restore the guest only acknowledges the restore.
    let template = env.template("exact", NO_WORKING_SET);
    let mut sb = env.create(&template);
    let id = sb.id().to_string();
    let pid = env.track(&mut sb);
    let snapshot = sb.snapshot().unwrap();
    assert_eq!(
        std::fs::metadata(memory_file(&snapshot)).unwrap().len(),
        GUEST_MEMORY + cube_mem::SEAL_BYTES
    );
    let image = guest_image(&snapshot);

    let dirty_mib = 8;
    let pattern: u64 = 0x524f_4c4c_0000_0000;
    sb.guest_dirty(dirty_mib, pattern).unwrap();
    let pages = dirty_mib * PAGES_PER_MIB;
    assert_eq!(
        dirty_area_words(&mut sb, pages),
        pattern_words(pattern, pages)
    );

    sb.rollback(&snapshot.id).unwrap();
    assert_eq!(sb.id(), id);
    let status = sb.status().unwrap();
    assert_eq!(
        status.pid, pid,
        "rollback happens inside the same supervisor"
    );
    assert_eq!(status.status, MachineStatus::Running);
    let listed: Vec<_> = env
        .rt()
        .list()
        .unwrap()
        .into_iter()
        .filter(|m| m.id == id)
        .collect();
    assert_eq!(listed.len(), 1);

    sb.pause().unwrap();
    let ram = read_guest(&mut sb, 0, GUEST_MEMORY);
    let differing = differing_pages(&ram, &image);
    // Exactly one page may differ: the mailbox, where the host announces every restore
    // (HOST_GENERATION) and the guest acknowledges it (ACK_GENERATION) and finishes its
    // empty working-set pass (WORKING_SET_GENERATION).
    //
    // The page tables do not differ. Under PVM's shadow paging KVM sets accessed and
    // dirty bits in the guest's own entries (snapshot_writes_only_dirty_pages sees the
    // dirty area's PD entries go 0x87 -> 0xe7), but the snapshot already holds the bits
    // of every 2 MiB page the guest used before it, rollback brings back the snapshot's
    // page directory with the dirty area's bits clear, and afterwards the guest touches
    // only pages whose bits are already set.
    assert_eq!(
        differing,
        vec![MAILBOX_PAGE],
        "pages other than the mailbox differ from the snapshot after rollback"
    );
    let mailbox_now = page(&ram, MAILBOX_PAGE);
    let mailbox_then = page(&image, MAILBOX_PAGE);
    assert_eq!(
        differing_words(mailbox_now, mailbox_then),
        vec![
            field::HOST_GENERATION,
            field::ACK_GENERATION,
            field::WORKING_SET_GENERATION
        ]
    );
    for word in [
        field::HOST_GENERATION,
        field::ACK_GENERATION,
        field::WORKING_SET_GENERATION,
    ] {
        assert_eq!(
            u64_at(mailbox_now, word),
            u64_at(mailbox_then, word) + 1,
            "mailbox word {word:#x}"
        );
    }
    // The guest's writes set A/D bits in the PD entries of the dirty area; the rollback
    // undid those too.
    let pd_entry = u64_at(&ram, PD0_ADDR + 8 * (DIRTY_AREA_ADDR >> 21));
    assert_eq!(pd_entry & PTE_ACCESSED_DIRTY, 0, "PD entry {pd_entry:#x}");
    // The supervisor's own digest of the live memory agrees with what was read.
    assert_eq!(sb.memory_digest().unwrap(), vec![crc32fast::hash(&ram)]);

    sb.resume().unwrap();
    sb.guest_dirty(1, 0x99).unwrap();
    assert_eq!(dirty_area_words(&mut sb, 4), pattern_words(0x99, 4));
    sb.destroy().unwrap();
    env.finish();
}

#[test]
fn snapshot_writes_only_dirty_pages() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("diff", NO_WORKING_SET);
    let mut sb = env.create(&template);
    let reflinks = env.rt().store().supports_reflink().unwrap();

    let first = sb.snapshot().unwrap();
    // Since the restore only the mailbox changed (the host's generation bump and the
    // guest's acknowledgement).
    assert_eq!(first.stats.dirty_pages, 1, "{:?}", first.stats);
    assert_eq!(first.stats.bytes_written, PAGE);

    let dirty_mib = 8;
    let pattern: u64 = 0x4449_4646_0000_0000;
    sb.guest_dirty(dirty_mib, pattern).unwrap();
    let second = sb.snapshot().unwrap();
    let pages = dirty_mib * PAGES_PER_MIB;
    // 2048 pages of the dirty area, plus exactly two: the mailbox (the command the host
    // posted and the guest's completion) and the page directory at 0x102000, whose
    // entries for 64..72 MiB got their accessed and dirty bits set by KVM's shadow MMU
    // when the guest first wrote there.
    assert_eq!(second.stats.dirty_pages, pages + 2, "{:?}", second.stats);
    assert_eq!(second.stats.bytes_written, second.stats.dirty_pages * PAGE);
    assert_eq!(second.stats.reflinked, reflinks);

    let a = guest_image(&first);
    let b = guest_image(&second);
    let differing = differing_pages(&a, &b);
    let mut expected: Vec<u64> = vec![MAILBOX_PAGE, PD0_PAGE];
    expected.extend(DIRTY_AREA_PAGE..DIRTY_AREA_PAGE + pages);
    assert_eq!(
        differing, expected,
        "the memory files differ outside the dirty area, the mailbox and the PD"
    );
    assert_eq!(differing.len() as u64, second.stats.dirty_pages);
    let area = &b[DIRTY_AREA_ADDR as usize..(DIRTY_AREA_ADDR + pages * PAGE) as usize];
    assert_eq!(page_words(area), pattern_words(pattern, pages));
    // In the page directory only the A/D bits of the four 2 MiB entries changed.
    let pd_a = page(&a, PD0_PAGE);
    let pd_b = page(&b, PD0_PAGE);
    let first_entry = 8 * (DIRTY_AREA_ADDR >> 21);
    assert_eq!(
        differing_words(pd_a, pd_b),
        (0..4).map(|i| first_entry + 8 * i).collect::<Vec<_>>()
    );
    for i in 0..4 {
        let o = first_entry + 8 * i;
        assert_eq!(u64_at(pd_b, o), u64_at(pd_a, o) | PTE_ACCESSED_DIRTY);
    }
    // In the mailbox only the command words and the guest's completion changed.
    assert_eq!(
        differing_words(page(&a, MAILBOX_PAGE), page(&b, MAILBOX_PAGE)),
        vec![
            field::COMMAND_SEQ,
            field::COMMAND_OP,
            field::COMMAND_ARG,
            field::COMMAND_PATTERN,
            field::DONE_SEQ
        ]
    );

    // Nothing happened since: the next snapshot writes nothing.
    let third = sb.snapshot().unwrap();
    assert_eq!(third.stats.dirty_pages, 0, "{:?}", third.stats);
    assert_eq!(third.stats.bytes_written, 0);
    assert_eq!(guest_image(&third), b);

    sb.destroy().unwrap();
    env.finish();
}

#[test]
fn corrupt_state_file_is_rejected_and_the_source_keeps_working() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("rot", NO_WORKING_SET);
    let mut sb = env.create(&template);
    sb.guest_dirty(1, 0x1000).unwrap();
    let snapshot = sb.snapshot().unwrap();
    let state_path = snapshot.dir.join("state.bin");
    let mut bytes = std::fs::read(&state_path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(&state_path, &bytes).unwrap();

    let err = env
        .rt()
        .create_from_snapshot(&snapshot.id, EPHEMERAL)
        .err()
        .expect("a corrupt state file was restored");
    let text = error_chain(&err);
    assert!(
        text.contains("state file") && text.contains("checksum"),
        "{text}"
    );
    assert_eq!(entries(&env.root().join("sandboxes")), vec![sb.id()]);

    // Rolling back to it fails too, and leaves the sandbox as it was.
    sb.guest_dirty(1, 0x2000).unwrap();
    let err = sb.rollback(&snapshot.id).unwrap_err();
    assert!(
        error_chain(&err).contains("checksum"),
        "{}",
        error_chain(&err)
    );
    assert_eq!(sb.status().unwrap().status, MachineStatus::Running);
    assert_eq!(dirty_area_words(&mut sb, 256), pattern_words(0x2000, 256));

    // The source still snapshots and restores.
    let good = sb.snapshot().unwrap();
    let mut restored = env.create_from_snapshot(&good.id);
    assert_eq!(
        dirty_area_words(&mut restored, 256),
        pattern_words(0x2000, 256)
    );
    restored.destroy().unwrap();
    sb.destroy().unwrap();
    env.finish();
}

#[test]
fn truncated_memory_file_is_rejected() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("short", NO_WORKING_SET);
    let mut sb = env.create(&template);
    let damaged = sb.snapshot().unwrap();
    // Move the sandbox's parent image on, so that only a past snapshot is damaged.
    sb.guest_dirty(1, 0x3000).unwrap();
    let _current = sb.snapshot().unwrap();
    let half = GUEST_MEMORY / 2;
    std::fs::OpenOptions::new()
        .write(true)
        .open(memory_file(&damaged))
        .unwrap()
        .set_len(half)
        .unwrap();

    let err = env
        .rt()
        .create_from_snapshot(&damaged.id, EPHEMERAL)
        .err()
        .expect("a truncated memory file was restored");
    let text = error_chain(&err);
    assert!(
        text.contains("memory file")
            && text.contains(&format!(
                "is {half} bytes, expected {}",
                GUEST_MEMORY + cube_mem::SEAL_BYTES
            )),
        "{text}"
    );
    let err = sb.rollback(&damaged.id).unwrap_err();
    assert!(
        error_chain(&err).contains(&format!("is {half} bytes")),
        "{}",
        error_chain(&err)
    );
    assert_eq!(sb.status().unwrap().status, MachineStatus::Running);
    assert_eq!(entries(&env.root().join("sandboxes")), vec![sb.id()]);

    sb.guest_dirty(1, 0x4000).unwrap();
    let later = sb.snapshot().unwrap();
    let mut restored = env.create_from_snapshot(&later.id);
    assert_eq!(
        dirty_area_words(&mut restored, 256),
        pattern_words(0x4000, 256)
    );
    restored.destroy().unwrap();
    sb.destroy().unwrap();
    env.finish();
}

/// Sets the immutable attribute on a directory (even root cannot add entries to it)
/// and clears it again on drop.
struct ImmutableDir(PathBuf);

impl ImmutableDir {
    fn set(path: &Path) -> Option<ImmutableDir> {
        let set = Command::new("chattr").arg("+i").arg(path).status();
        match set {
            Ok(s) if s.success() => Some(ImmutableDir(path.to_path_buf())),
            other => {
                eprintln!(
                    "skipped: cannot make {} immutable: {other:?}",
                    path.display()
                );
                None
            }
        }
    }
}

impl Drop for ImmutableDir {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
    }
}

#[test]
fn failed_snapshot_loses_no_dirty_page() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("retry", NO_WORKING_SET);
    let mut sb = env.create(&template);
    let base = sb.snapshot().unwrap();
    let dirty_mib = 4;
    let pages = dirty_mib * PAGES_PER_MIB;
    let pattern: u64 = 0x4c4f_5354_0000_0000;
    sb.guest_dirty(dirty_mib, pattern).unwrap();

    let snapshots_dir = env.root().join("snapshots");
    let failed = {
        let Some(_frozen) = ImmutableDir::set(&snapshots_dir) else {
            sb.destroy().unwrap();
            return;
        };
        // The memory file is written into staging (collecting and clearing KVM's dirty
        // log), then moving it into snapshots/ fails.
        sb.snapshot()
    };
    let err = failed.expect_err("a snapshot into a frozen store succeeded");
    assert!(
        error_chain(&err).contains("into place"),
        "{}",
        error_chain(&err)
    );
    assert_eq!(sb.status().unwrap().status, MachineStatus::Running);
    assert_eq!(entries(&snapshots_dir), vec![base.id.clone()]);
    assert!(entries(&env.root().join("tmp")).is_empty(), "scratch left");
    assert!(
        entries(sb.dir()).iter().all(|e| !e.ends_with(".staging")),
        "staging left"
    );

    // Nothing was written since the failure: only the pages the failed attempt took
    // from the dirty log can bring the pattern into this snapshot.
    let retry = sb.snapshot().unwrap();
    assert_eq!(retry.stats.dirty_pages, pages + 2, "{:?}", retry.stats);
    let area = read_file_at(
        &memory_file(&retry),
        DIRTY_AREA_ADDR,
        (pages * PAGE) as usize,
    );
    assert_eq!(page_words(&area), pattern_words(pattern, pages));
    let mut restored = env.create_from_snapshot(&retry.id);
    assert_eq!(
        dirty_area_words(&mut restored, pages),
        pattern_words(pattern, pages)
    );
    assert!(!restored.status().unwrap().guest_error);
    restored.destroy().unwrap();
    sb.destroy().unwrap();
    env.finish();
}

#[test]
fn foreign_and_unknown_names_are_refused() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("names", NO_WORKING_SET);
    let mut a = env.create(&template);
    let mut b = env.create(&template);
    let a_snapshot = a.snapshot().unwrap();
    b.guest_dirty(1, 0x6000).unwrap();
    let b_generation = b.status().unwrap().generation;

    match b.rollback(&a_snapshot.id) {
        Err(SandboxError::NotOwner {
            snapshot,
            owner,
            sandbox,
        }) => {
            assert_eq!(snapshot, a_snapshot.id);
            assert_eq!(owner, a.id());
            assert_eq!(sandbox, b.id());
        }
        other => panic!("rollback to a foreign snapshot: {other:?}"),
    }
    // b was not touched.
    assert_eq!(b.status().unwrap().generation, b_generation);
    assert_eq!(dirty_area_words(&mut b, 256), pattern_words(0x6000, 256));

    let rt = env.rt();
    assert!(matches!(
        rt.create("no-such-template", EPHEMERAL),
        Err(SandboxError::UnknownTemplate(n)) if n == "no-such-template"
    ));
    assert!(matches!(
        rt.create_from_snapshot("snap-0000000000000000", EPHEMERAL),
        Err(SandboxError::UnknownSnapshot(n)) if n == "snap-0000000000000000"
    ));
    assert!(matches!(
        b.rollback("snap-0000000000000000"),
        Err(SandboxError::UnknownSnapshot(n)) if n == "snap-0000000000000000"
    ));
    assert!(matches!(
        rt.attach("sb-0000000000000000"),
        Err(SandboxError::UnknownSandbox(n)) if n == "sb-0000000000000000"
    ));
    assert!(matches!(
        rt.build_test_template("names", machine(), NO_WORKING_SET, 0),
        Err(SandboxError::TemplateExists(n)) if n == "names"
    ));
    // Ids that could leave the store are refused before any path is built from them.
    for bad in ["../templates/names", "a/b", ".hidden", ""] {
        assert!(
            matches!(
                rt.create(bad, EPHEMERAL),
                Err(SandboxError::Store(StoreError::InvalidName { .. }))
            ),
            "create {bad:?}"
        );
        assert!(
            matches!(
                rt.create_from_snapshot(bad, EPHEMERAL),
                Err(SandboxError::Store(StoreError::InvalidName { .. }))
            ),
            "create_from_snapshot {bad:?}"
        );
        assert!(
            matches!(
                rt.attach(bad),
                Err(SandboxError::Store(StoreError::InvalidName { .. }))
            ),
            "attach {bad:?}"
        );
        assert!(
            matches!(
                b.rollback(bad),
                Err(SandboxError::Store(StoreError::InvalidName { .. }))
            ),
            "rollback {bad:?}"
        );
    }
    // None of the refusals left a sandbox behind.
    let mut expected = vec![a.id().to_string(), b.id().to_string()];
    expected.sort();
    assert_eq!(entries_sorted(&env.root().join("sandboxes")), expected);

    // Once its owner is destroyed, the snapshot is gone for everyone.
    a.destroy().unwrap();
    assert!(!a_snapshot.dir.exists());
    assert!(matches!(
        b.rollback(&a_snapshot.id),
        Err(SandboxError::UnknownSnapshot(_))
    ));
    assert_eq!(b.status().unwrap().status, MachineStatus::Running);
    b.destroy().unwrap();
    env.finish();
}

fn entries_sorted(dir: &Path) -> Vec<String> {
    let mut names = entries(dir);
    names.sort();
    names
}

#[test]
fn snapshots_after_a_rollback_diff_against_the_rolled_back_image() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("after-rollback", NO_WORKING_SET);
    let mut sb = env.create(&template);
    env.track(&mut sb);
    let first: u64 = 0x4649_5253_0000_0000;
    sb.guest_dirty(4, first).unwrap();
    let base = sb.snapshot().unwrap();

    // Pages written before the rollback must not leak into later snapshots...
    sb.guest_dirty(8, 0x5452_4153_4800_0000).unwrap();
    sb.rollback(&base.id).unwrap();
    // ...and pages written after it must all be in the next one.
    let second: u64 = 0x5345_434f_0000_0000;
    sb.guest_dirty(1, second).unwrap();
    let after = sb.snapshot().unwrap();
    // One MiB of guest writes plus the mailbox the host and guest write on restore.
    assert!(
        (PAGES_PER_MIB..=PAGES_PER_MIB + 4).contains(&after.stats.dirty_pages),
        "{} pages dirty after rollback",
        after.stats.dirty_pages
    );

    let mut restored = env.create_from_snapshot(&after.id);
    env.track(&mut restored);
    let mut expected = pattern_words(second, PAGES_PER_MIB);
    expected.extend(pattern_words(first + PAGES_PER_MIB, 3 * PAGES_PER_MIB));
    expected.extend(std::iter::repeat_n(0, (4 * PAGES_PER_MIB) as usize));
    assert_eq!(dirty_area_words(&mut restored, 8 * PAGES_PER_MIB), expected);
    restored.destroy().unwrap();
    sb.destroy().unwrap();
    env.finish();
}
