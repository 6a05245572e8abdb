//! Repeated cycles stay correct on both engines: consecutive pause/resume and
//! hibernate/wake cycles, and chained snapshot → rollback → clone generations, each
//! step checked against the state the sandbox must hold.
//!
//! A jail is checked through its agent: a Python variable, files written before and
//! after each cycle, a background server process (the same pid) and its listening
//! socket still accepting. A VM (the synthetic test guest) is checked through its
//! memory: a pattern it wrote, and its counter going on without a consistency error.
//!
//! Sizes: `CUBE_CYCLES` cycles of each kind (default 10) and `CUBE_GENERATIONS`
//! generations (default 3); `scripts/fault-suite.sh cycles` runs 100 and 20.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::Instant;

use common::engines::Suite;
use common::workload::{count_from_env, destroy_and_check, JailState, VmState};
use common::*;
use cube_core::{SnapshotKind, HOST_TEMPLATE};

fn cycles() -> usize {
    count_from_env("CUBE_CYCLES", 10)
}

fn generations() -> usize {
    count_from_env("CUBE_GENERATIONS", 3)
}

#[test]
fn jail_pause_resume_and_hibernate_wake_cycles_keep_everything() {
    let Some(suite) = Suite::jail() else {
        return;
    };
    let rt = &suite.rt;
    let n = cycles();
    let mut sb = rt.create(HOST_TEMPLATE, PERSISTENT).unwrap();
    let agent = sb.agent().unwrap();
    let mut state = JailState::start(&agent);
    drop(agent);
    let start = Instant::now();
    for i in 0..n {
        let agent = sb.agent().unwrap();
        state.advance(&agent, i as i64, &format!("p-{i}"), &format!("pause-{i}"));
        drop(agent);
        sb.pause().unwrap();
        sb.resume().unwrap();
        state.check(&sb.agent().unwrap(), &format!("pause/resume cycle {i}"));
    }
    let paused = start.elapsed();
    let start = Instant::now();
    for i in 0..n {
        let agent = sb.agent().unwrap();
        state.advance(
            &agent,
            1000 + i as i64,
            &format!("h-{i}"),
            &format!("hib-{i}"),
        );
        drop(agent);
        sb.hibernate().unwrap();
        assert_eq!(sb.status().unwrap().status, MachineStatus::Hibernated);
        sb.wake().unwrap();
        state.check(&sb.agent().unwrap(), &format!("hibernate/wake cycle {i}"));
    }
    eprintln!(
        "jail: {n} pause/resume cycles in {paused:?}, {n} hibernate/wake cycles in {:?}",
        start.elapsed()
    );
    destroy_and_check(sb);
}

#[test]
fn jail_snapshot_rollback_clone_generations_keep_everything() {
    let Some(suite) = Suite::jail() else {
        return;
    };
    let rt = &suite.rt;
    let n = generations();
    let mut sb = rt.create(HOST_TEMPLATE, PERSISTENT).unwrap();
    let mut state = JailState::start(&sb.agent().unwrap());
    let start = Instant::now();
    for g in 0..n {
        let when = format!("generation {g}");
        let agent = sb.agent().unwrap();
        state.advance(&agent, g as i64, &format!("g-{g}"), &format!("gen-{g}"));
        drop(agent);
        let snap = sb.snapshot().unwrap();
        assert_eq!(snap.kind, SnapshotKind::Full, "{:?}", snap.fallback);
        // Changes after the snapshot, which the rollback must undo.
        let mut changed = state.clone();
        changed.advance(&sb.agent().unwrap(), -1, &format!("g-{g}"), "changed");
        changed.advance(&sb.agent().unwrap(), -2, "junk", "junk");
        sb.rollback(&snap.id).unwrap();
        state.check(&sb.agent().unwrap(), &format!("{when}, after rollback"));
        let mut clones = rt.clone_sandbox(&mut sb, 1, 1, PERSISTENT).unwrap();
        let clone = clones.pop().unwrap();
        state.check(&clone.agent().unwrap(), &format!("{when}, the clone"));
        // The source is unchanged by its clone.
        state.check(&sb.agent().unwrap(), &format!("{when}, the source"));
        destroy_and_check(sb);
        sb = clone;
    }
    eprintln!("jail: {n} generations in {:?}", start.elapsed());
    state.check(&sb.agent().unwrap(), "the last generation");
    destroy_and_check(sb);
}

#[test]
fn vm_pause_resume_and_hibernate_wake_cycles_keep_memory() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let n = cycles();
    let template = env.template("cycles", NO_WORKING_SET);
    let mut sb = env.create_with(&template, PERSISTENT);
    let start = Instant::now();
    for i in 0..n as u64 {
        let state = VmState::set(&mut sb, 0x1000_0000_0000 * (i + 1));
        sb.pause().unwrap();
        assert_eq!(sb.status().unwrap().status, MachineStatus::Paused);
        sb.resume().unwrap();
        state.check(&mut sb, &format!("pause/resume cycle {i}"));
    }
    let paused = start.elapsed();
    let start = Instant::now();
    for i in 0..n as u64 {
        let state = VmState::set(&mut sb, 0x2000_0000_0000 * (i + 1));
        sb.hibernate().unwrap();
        assert_eq!(sb.status().unwrap().status, MachineStatus::Hibernated);
        sb.wake().unwrap();
        env.track(&mut sb);
        state.check(&mut sb, &format!("hibernate/wake cycle {i}"));
    }
    eprintln!(
        "vm: {n} pause/resume cycles in {paused:?}, {n} hibernate/wake cycles in {:?}",
        start.elapsed()
    );
    sb.destroy().unwrap();
    env.finish();
}

#[test]
fn vm_snapshot_rollback_clone_generations_keep_memory() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let n = generations() as u64;
    let template = env.template("generations", NO_WORKING_SET);
    let mut sb = env.create_with(&template, PERSISTENT);
    let start = Instant::now();
    for g in 0..n {
        let when = format!("generation {g}");
        let state = VmState::set(&mut sb, 0x3000_0000_0000 * (g + 1));
        let snap = sb.snapshot().unwrap();
        VmState::set(&mut sb, 0xdead_0000_0000);
        sb.rollback(&snap.id).unwrap();
        state.check(&mut sb, &format!("{when}, after rollback"));
        let mut clones = env.rt().clone_sandbox(&mut sb, 1, 1, PERSISTENT).unwrap();
        let mut clone = clones.pop().unwrap();
        env.track(&mut clone);
        state.check(&mut clone, &format!("{when}, the clone"));
        state.check(&mut sb, &format!("{when}, the source"));
        let dir = sb.dir().to_path_buf();
        sb.destroy().unwrap();
        assert!(!dir.exists(), "{when}: the source's directory survived");
        sb = clone;
    }
    eprintln!("vm: {n} generations in {:?}", start.elapsed());
    sb.destroy().unwrap();
    env.finish();
}
