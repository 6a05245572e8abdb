//! Lifecycle scenarios across the library, the supervisor process and KVM: a restored
//! guest continues where it stopped, clones are isolated, pause stops the guest, and
//! hibernate/wake keeps every byte.
//!
//! The synthetic test guest checks itself: while spinning it compares its counter in
//! memory with the copy in r15 on every iteration, so a restore that mixes memory and
//! registers from two moments sets `guest_error`.

mod common;

use std::time::Duration;

use common::*;
use cube_core::testing::read_state;
use cube_core::testing::GuestMode as Mode;

const MIB: u64 = 1 << 20;
const PAGES_PER_MIB: u64 = MIB / PAGE;

#[test]
fn restored_guest_continues_exactly_where_it_was() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("spin", SMALL_WORKING_SET);
    let mut source = env.create(&template);
    source.guest_spin(true).unwrap();
    let seen = wait_counter_above(&mut source, 10_000);

    let snapshot = source.snapshot().unwrap();
    let memory = memory_file(&snapshot);
    let c = file_u64(&memory, MAILBOX_ADDR + field::COUNTER);
    assert!(
        c >= seen,
        "snapshot counter {c} is older than {seen} seen before it"
    );
    assert_eq!(file_u64(&memory, MAILBOX_ADDR + field::ERROR), 0);
    assert_eq!(
        file_u64(&memory, MAILBOX_ADDR + field::MODE),
        Mode::Spin as u64
    );
    // Memory and registers come from the same instant: the vCPU stopped either with
    // r15 == counter, or between `inc r15` and the store of r15 (then r15 == C + 1).
    let state = read_state(&snapshot.dir).unwrap();
    let r15 = state.vcpus[0].regs.r15;
    assert!(
        r15 == c || r15 == c + 1,
        "saved r15 {r15} does not match the saved counter {c}"
    );
    let saved_generation = file_u64(&memory, MAILBOX_ADDR + field::HOST_GENERATION);

    let mut restored = env.create_from_snapshot(&snapshot.id);
    let first = restored.status().unwrap();
    eprintln!(
        "snapshot counter {c}, saved r15 {r15}, restored guest first seen at {}",
        first.counter
    );
    assert_eq!(first.status, MachineStatus::Running);
    assert!(
        first.counter >= c,
        "restored guest counts from {} but the snapshot holds {c}",
        first.counter
    );
    // The restore told the guest about itself exactly once, and the guest saw it.
    assert_eq!(first.generation, saved_generation + 1);
    let later = wait_counter_above(&mut restored, first.counter);
    let later = wait_counter_above(&mut restored, later);
    let status = restored.status().unwrap();
    assert!(
        !status.guest_error,
        "restored guest saw its memory and registers disagree"
    );
    assert!(status.counter >= later);

    // The source was only paused for the snapshot and keeps counting, consistently.
    let source_now = wait_counter_above(&mut source, c);
    assert!(source_now > c);
    assert!(!source.status().unwrap().guest_error);
    assert_ne!(restored.status().unwrap().pid, source.status().unwrap().pid);

    restored.destroy().unwrap();
    source.destroy().unwrap();
    env.finish();
}

#[test]
fn clone_writes_never_reach_source_siblings_or_snapshot() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("iso", NO_WORKING_SET);
    let mut source = env.create(&template);
    // 4 MiB every clone inherits; each then overwrites only the first 2 MiB.
    let inherited: u64 = 0x1111_0000_0000_0000;
    let total = 4 * PAGES_PER_MIB;
    let own = 2 * PAGES_PER_MIB;
    source.guest_dirty(4, inherited).unwrap();

    let mut clones = env
        .rt()
        .clone_sandbox(&mut source, 2, 2, EPHEMERAL)
        .unwrap();
    assert_eq!(clones.len(), 2);
    for clone in &mut clones {
        env.track(clone);
    }
    let snapshots = entries(&env.root().join("snapshots"));
    assert_eq!(snapshots.len(), 1, "clone_sandbox takes one snapshot");
    let snapshot_memory = env
        .root()
        .join("snapshots")
        .join(&snapshots[0])
        .join("memory.bin");

    let patterns: [u64; 3] = [
        0xaaaa_0000_0000_0000,
        0xbbbb_0000_0000_0000,
        0xcccc_0000_0000_0000,
    ];
    source.guest_dirty(2, patterns[0]).unwrap();
    clones[0].guest_dirty(2, patterns[1]).unwrap();
    clones[1].guest_dirty(2, patterns[2]).unwrap();

    let mut expected_tail = pattern_words(inherited, total);
    expected_tail.drain(..own as usize);
    let sandboxes: Vec<&mut Sandbox> = std::iter::once(&mut source).chain(&mut clones).collect();
    let mut ids = Vec::new();
    for (sb, pattern) in sandboxes.into_iter().zip(patterns) {
        let words = dirty_area_words(sb, total);
        assert_eq!(
            words[..own as usize],
            pattern_words(pattern, own)[..],
            "sandbox {} does not see only its own writes",
            sb.id()
        );
        assert_eq!(
            words[own as usize..],
            expected_tail[..],
            "sandbox {} lost the state it inherited",
            sb.id()
        );
        assert!(!sb.status().unwrap().guest_error);
        ids.push(sb.id().to_string());
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "clones need ids of their own");

    // The clones map the snapshot's memory file copy-on-write: their writes must not
    // reach the file either.
    let file_words = page_words(&read_file_at(
        &snapshot_memory,
        DIRTY_AREA_ADDR,
        (total * PAGE) as usize,
    ));
    assert_eq!(file_words, pattern_words(inherited, total));

    for clone in clones {
        clone.destroy().unwrap();
    }
    source.destroy().unwrap();
    env.finish();
}

#[test]
fn a_template_build_killed_outright_leaves_nothing_after_the_next_build() {
    let Some(env) = TestEnv::new() else {
        return;
    };
    // What a build killed outright leaves: its image, hidden among the templates under
    // the name of a process that has ended (no pid is this large).
    let templates = env.root().join("templates");
    let killed = templates.join(".template-999999999-1-0123456789abcdef");
    std::fs::create_dir_all(&killed).unwrap();
    std::fs::write(killed.join("memory.bin"), b"half").unwrap();
    let template = env.template("after-a-killed-build", NO_WORKING_SET);
    assert_eq!(
        entries(&templates),
        vec![template],
        "the killed build's image stayed, or the build left its own"
    );
    env.finish();
}

#[test]
fn paused_guest_makes_no_progress() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("pause", NO_WORKING_SET);
    let mut sb = env.create(&template);
    sb.guest_spin(true).unwrap();
    let running = wait_counter_above(&mut sb, 0);

    sb.pause().unwrap();
    let paused = sb.status().unwrap();
    assert_eq!(paused.status, MachineStatus::Paused);
    assert!(paused.counter >= running);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(counter(&mut sb), paused.counter, "a paused guest counted");
    let mailbox = sb.read_memory(MAILBOX_ADDR, PAGE as u32).unwrap();
    assert_eq!(u64_at(&mailbox, field::COUNTER), paused.counter);
    // The guest cannot carry out commands while stopped, and says why.
    let refused = sb.guest_dirty(1, 1).unwrap_err();
    assert!(
        error_chain(&refused).contains("paused"),
        "{}",
        error_chain(&refused)
    );
    sb.pause().unwrap();
    assert_eq!(
        counter(&mut sb),
        paused.counter,
        "a second pause ran the guest"
    );

    sb.resume().unwrap();
    assert_eq!(sb.status().unwrap().status, MachineStatus::Running);
    let resumed = wait_counter_above(&mut sb, paused.counter);
    assert!(resumed > paused.counter);
    assert!(!sb.status().unwrap().guest_error);
    sb.guest_dirty(1, 0x77).unwrap();
    assert_eq!(dirty_area_words(&mut sb, 4), pattern_words(0x77, 4));

    sb.destroy().unwrap();
    env.finish();
}

#[test]
fn hibernate_then_wake_loses_nothing() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("hib", SMALL_WORKING_SET);
    let mut sb = env.create(&template);
    let pid = env.track(&mut sb);
    let dirty_mib = 16;
    let pages = dirty_mib * PAGES_PER_MIB;
    let pattern: u64 = 0x4849_4245_0000_0000;
    sb.guest_dirty(dirty_mib, pattern).unwrap();
    sb.guest_spin(true).unwrap();
    let before = wait_counter_above(&mut sb, 1000);
    let running = sb.status().unwrap();

    sb.hibernate().unwrap();
    let hibernated = sb.status().unwrap();
    assert_eq!(hibernated.status, MachineStatus::Hibernated);
    assert_eq!(hibernated.pid, pid, "hibernation keeps the supervisor");
    eprintln!(
        "supervisor RSS: {} KiB running, {} KiB hibernated",
        running.rss_kib, hibernated.rss_kib
    );
    // The guest's 16 MiB of private pages were resident; hibernation unmapped them.
    let released = running.rss_kib.saturating_sub(hibernated.rss_kib);
    assert!(
        running.rss_kib >= dirty_mib * 1024 && released >= (dirty_mib - 4) * 1024,
        "RSS went from {} KiB to {} KiB",
        running.rss_kib,
        hibernated.rss_kib
    );
    assert!(sb.dir().join("hibernate").join("memory.bin").is_file());
    let image_counter = file_u64(
        &sb.dir().join("hibernate").join("memory.bin"),
        MAILBOX_ADDR + field::COUNTER,
    );
    assert!(image_counter >= before);
    let refused = sb.guest_dirty(1, 1).unwrap_err();
    assert!(
        error_chain(&refused).contains("hibernated"),
        "{}",
        error_chain(&refused)
    );

    sb.wake().unwrap();
    let woken = sb.status().unwrap();
    assert_eq!(woken.status, MachineStatus::Running);
    assert_eq!(woken.pid, pid);
    assert!(
        woken.counter >= image_counter,
        "woke at counter {} but hibernated at {image_counter}",
        woken.counter
    );
    assert!(woken.generation > running.generation);
    wait_counter_above(&mut sb, woken.counter);
    assert!(!sb.status().unwrap().guest_error);
    assert_eq!(
        dirty_area_words(&mut sb, pages),
        pattern_words(pattern, pages),
        "the dirty area did not survive hibernation"
    );

    // Afterwards the sandbox is a normal one: snapshot, overwrite, roll back.
    let snapshot = sb.snapshot().unwrap();
    sb.guest_dirty(2, 0x5151).unwrap();
    assert_eq!(
        dirty_area_words(&mut sb, 2),
        pattern_words(0x5151, 2),
        "the overwrite did not happen"
    );
    sb.rollback(&snapshot.id).unwrap();
    assert_eq!(
        dirty_area_words(&mut sb, pages),
        pattern_words(pattern, pages)
    );
    let after = sb.status().unwrap();
    wait_counter_above(&mut sb, after.counter);
    assert!(!sb.status().unwrap().guest_error);

    sb.destroy().unwrap();
    env.finish();
}

/// Sandboxes of the default shape (2 vCPU, 2 GiB) are loaded into the VM a pooled
/// supervisor built while it waited; this proves that path end to end.
#[test]
fn default_shape_sandboxes_load_into_prebuilt_vms() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let spec = cube_core::templates::MachineConfig::default();
    env.rt()
        .build_test_template("default-shape", spec, SMALL_WORKING_SET, 0)
        .unwrap();
    let mut sb = env.create("default-shape");
    env.track(&mut sb);
    let status = sb.status().unwrap();
    assert_eq!(status.config, Some(spec));
    let pattern: u64 = 0x5348_454c_4c00_0000;
    sb.guest_dirty(2, pattern).unwrap();
    let snap = sb.snapshot().unwrap();
    let mut clone = env.create_from_snapshot(&snap.id);
    env.track(&mut clone);
    assert_eq!(
        dirty_area_words(&mut clone, 512),
        pattern_words(pattern, 512)
    );
    // The clone runs on its own: its writes stay its own.
    clone.guest_dirty(1, 7).unwrap();
    assert_eq!(dirty_area_words(&mut sb, 256), pattern_words(pattern, 256));
    sb.guest_spin(true).unwrap();
    let before = sb.status().unwrap().counter;
    assert!(wait_until(Duration::from_secs(10), || {
        sb.status().unwrap().counter > before
    }));
    assert!(!sb.status().unwrap().guest_error);
    assert!(!clone.status().unwrap().guest_error);
    clone.destroy().unwrap();
    sb.destroy().unwrap();
    env.finish();
}

/// Requests on other connections racing a destroy are served before it or refused
/// after it (the sandbox was destroyed), on the VM engine as on the jail engine
/// (tests/jail.rs): never by a supervisor whose machine is gone.
#[test]
fn requests_racing_a_destroy_are_served_before_it_or_refused() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("race", SMALL_WORKING_SET);
    for round in 0..10 {
        let sb = env.create_with(&template, PERSISTENT);
        let id = sb.id().to_string();
        let seen = race_a_destroy(env.rt(), sb);
        for (status, wake) in seen {
            if let Ok(status) = status {
                assert_eq!(status, MachineStatus::Running, "round {round}");
            }
            // Not hibernated (before), destroyed (after), or the supervisor gone.
            assert!(wake.is_err(), "round {round}: a never hibernated VM woke");
        }
        assert!(
            !env.root().join("sandboxes").join(&id).exists(),
            "round {round}"
        );
    }
}

#[test]
fn a_vm_refuses_new_limits_and_runs_on() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("limits", NO_WORKING_SET);
    let mut sb = env.create(&template);
    let refused = sb
        .set_limits(cube_core::LimitChange {
            memory_mib: Some(64),
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(
        refused.kind(),
        cube_core::ErrorKind::Unsupported,
        "{refused:?}"
    );
    assert!(
        error_chain(&refused).contains("fixed when it is created"),
        "{}",
        error_chain(&refused)
    );
    sb.guest_spin(true).unwrap();
    wait_counter_above(&mut sb, 0);
    sb.destroy().unwrap();
    env.finish();
}
