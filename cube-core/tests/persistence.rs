//! Sandboxes and their supervisor processes across the life of the process that made
//! them: a persistent sandbox outlives its handle and its runtime, is listed and
//! reattached by a new runtime and ends with `destroy`; an ephemeral one ends, store
//! entries included, when its handle goes.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn persistent_sandbox_outlives_its_creator_and_is_reattached() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("keep", SMALL_WORKING_SET);
    let mut sb = env.create_with(&template, PERSISTENT);
    let id = sb.id().to_string();
    let dir = sb.dir().to_path_buf();
    let pid = env.track(&mut sb);
    let pattern: u64 = 0x5045_5253_0000_0000;
    sb.guest_dirty(1, pattern).unwrap();
    sb.guest_spin(true).unwrap();
    let counted = wait_counter_above(&mut sb, 0);

    // The creator goes away: its handle, then its runtime.
    drop(sb);
    env.reopen_runtime();
    std::thread::sleep(Duration::from_millis(200));
    assert!(pid_alive(pid), "the supervisor exited with its creator");

    let listed = env.rt().list().unwrap();
    let meta = listed
        .iter()
        .find(|m| m.id == id)
        .unwrap_or_else(|| panic!("{id} is not listed: {listed:?}"));
    assert!(!meta.ephemeral);
    assert_eq!(meta.origin, template);

    let mut again = env.rt().attach(&id).unwrap();
    assert_eq!(again.id(), id);
    assert_eq!(again.dir(), dir);
    let status = again.status().unwrap();
    assert_eq!(status.status, MachineStatus::Running);
    assert_eq!(status.pid, pid, "attach reached another process");
    assert!(status.counter >= counted);
    // The same VM kept running meanwhile: still spinning, state intact.
    wait_counter_above(&mut again, status.counter);
    assert!(!again.status().unwrap().guest_error);
    assert_eq!(
        dirty_area_words(&mut again, 256),
        pattern_words(pattern, 256)
    );

    // A second handle at the same time works too, and dropping it ends nothing.
    let mut second = env.rt().attach(&id).unwrap();
    assert_eq!(second.status().unwrap().pid, pid);
    drop(second);
    assert_eq!(again.status().unwrap().status, MachineStatus::Running);

    // The leak check in TestEnv::finish sees this supervisor (so it would see one
    // that failed to exit): it listens on a socket and maps a file in the store.
    assert_eq!(env.live_supervisors(), vec![pid]);

    again.destroy().unwrap();
    assert!(!dir.exists(), "destroy left {}", dir.display());
    assert!(
        wait_exit(pid, EXIT_WAIT),
        "supervisor {pid} still runs after destroy"
    );
    assert!(env.rt().list().unwrap().iter().all(|m| m.id != id));
    assert!(env.live_supervisors().is_empty());
    assert!(matches!(
        env.rt().attach(&id),
        Err(SandboxError::UnknownSandbox(ref s)) if *s == id
    ));
    env.finish();
}

#[test]
fn ephemeral_sandbox_ends_with_its_handle() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("brief", NO_WORKING_SET);
    let mut sb = env.create(&template);
    let id = sb.id().to_string();
    let dir = sb.dir().to_path_buf();
    let pid = env.track(&mut sb);
    sb.guest_spin(true).unwrap();
    wait_counter_above(&mut sb, 0);
    assert!(env
        .rt()
        .list()
        .unwrap()
        .iter()
        .any(|m| m.id == id && m.ephemeral));

    drop(sb);
    assert!(
        wait_exit(pid, EXIT_WAIT),
        "supervisor {pid} of a dropped ephemeral sandbox still runs"
    );
    // The supervisor clears the store before it exits.
    assert!(!dir.exists(), "{} outlived the sandbox", dir.display());
    assert!(env.rt().list().unwrap().iter().all(|m| m.id != id));
    assert!(matches!(
        env.rt().attach(&id),
        Err(SandboxError::UnknownSandbox(_))
    ));
    env.finish();
}

#[test]
fn ephemeral_sandbox_takes_a_fresh_snapshot_along() {
    let Some(mut env) = TestEnv::new() else {
        return;
    };
    let template = env.template("fresh", NO_WORKING_SET);
    // The flush and the removal race; a few rounds make losing the race near-certain.
    for round in 0..5 {
        let mut sb = env.create(&template);
        let dir = sb.dir().to_path_buf();
        let pid = env.track(&mut sb);
        sb.guest_dirty(8, 0x4652_4553_0000_0000 + round).unwrap();
        let snapshot = sb.snapshot().unwrap();
        assert!(snapshot.dir.is_dir());

        // Dropped right after the snapshot, while it is still being flushed.
        drop(sb);
        assert!(
            wait_exit(pid, EXIT_WAIT),
            "supervisor {pid} of a dropped ephemeral sandbox still runs"
        );
        assert!(
            !dir.exists(),
            "round {round}: {} outlived the sandbox; its snapshot directory holds {:?}",
            dir.display(),
            entries(&snapshot.dir)
        );
        assert!(
            !snapshot.dir.exists(),
            "round {round}: snapshot {} outlived its ephemeral sandbox: {:?}",
            snapshot.id,
            entries(&snapshot.dir)
        );
        assert!(matches!(
            env.rt().create_from_snapshot(&snapshot.id, EPHEMERAL),
            Err(SandboxError::UnknownSnapshot(_))
        ));
    }
    env.finish();
}
