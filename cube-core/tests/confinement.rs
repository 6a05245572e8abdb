//! Each sandbox's supervisor confines itself once the sandbox is set up: on every one
//! of its threads, the capabilities of its profile only, no_new_privs and (for a VM)
//! seccomp and a uid of its own; the
//! sandbox works as before (snapshot, rollback, its snapshot marked durable); a forbidden system call made in a
//! supervisor (injected with ptrace, as code that took it over would make it) kills
//! that supervisor alone, and the host's other sandboxes go on; and a VM supervisor's
//! vCPU threads may make only the calls of their allow list (an `openat`, which its
//! other threads may make, kills it there).

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::engines::Suite;
use common::*;
use cube_core::host::SupervisorProfile;

/// What this test holds, and so what the supervisors it starts held before they gave
/// it up.
fn held() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    u64::from_str_radix(field(&status, "CapPrm"), 16).unwrap()
}

fn field<'a>(status: &'a str, name: &str) -> &'a str {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no {name} in {status}"))
}

/// Asserts every thread of process `pid` is confined to `profile`; returns how many
/// threads it has.
fn assert_confined(pid: u32, profile: SupervisorProfile) -> usize {
    let keep = profile.kept(held());
    let mut threads = 0;
    let mut thread_uid = None;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let (Ok(status), Ok(stat)) = (
            std::fs::read_to_string(task.join("status")),
            std::fs::read_to_string(task.join("stat")),
        ) else {
            continue; // exited meanwhile
        };
        if user_worker(&stat) {
            continue;
        }
        let name = field(&status, "Name").to_string();
        // A jail supervisor has no filter: CRIU, which it starts, must have none.
        let seccomp = if profile == SupervisorProfile::Jail {
            "0"
        } else {
            "2"
        };
        assert_eq!(
            field(&status, "Seccomp"),
            seccomp,
            "{profile:?} thread {name}"
        );
        assert_eq!(
            field(&status, "NoNewPrivs"),
            "1",
            "{profile:?} thread {name}"
        );
        for set in ["CapEff", "CapPrm", "CapBnd"] {
            let found = u64::from_str_radix(field(&status, set), 16).unwrap();
            // No more than the profile keeps (vCPU threads built ahead keep none).
            assert_eq!(
                found & !keep,
                0,
                "{profile:?} thread {name}: {set} {found:#x}"
            );
        }
        assert_eq!(field(&status, "CapInh"), "0000000000000000");
        // A VM supervisor runs as a uid of its own (real, effective, saved and
        // file-system alike), on every thread; a jail supervisor stays root.
        let ids = |line| {
            let ids: Vec<u32> = field(&status, line)
                .split_whitespace()
                .map(|v| v.parse().unwrap())
                .collect();
            assert!(ids.iter().all(|v| *v == ids[0]), "{name}: {line} {ids:?}");
            ids[0]
        };
        let (uid, gid) = (ids("Uid"), ids("Gid"));
        if profile == SupervisorProfile::Vm {
            assert!(
                cube_jail::sandbox_uid::RANGE.contains(&uid),
                "VM thread {name} runs as uid {uid}"
            );
            assert_eq!(
                gid,
                cube_storage::supervisor_group::SUPERVISOR_GID,
                "{name}"
            );
            assert_eq!(
                *thread_uid.get_or_insert(uid),
                uid,
                "{name}: one uid per process"
            );
        } else {
            assert_eq!((uid, gid), (0, 0), "jail thread {name}");
        }
        threads += 1;
    }
    threads
}

#[test]
fn supervisors_are_confined_and_a_forbidden_call_kills_only_its_own() {
    let (Some(vm), Some(jail)) = (Suite::vm(), Suite::jail()) else {
        eprintln!("skipped: needs both engines (KVM and full-state jails)");
        return;
    };
    let (mut vsb, v1) = vm.create(1);
    let (mut jsb, j1) = jail.create(1);
    let vpid = vsb.status().unwrap().pid;
    let jpid = jsb.status().unwrap().pid;
    let vthreads = assert_confined(vpid, SupervisorProfile::Vm);
    let jthreads = assert_confined(jpid, SupervisorProfile::Jail);
    assert!(
        vthreads >= 2,
        "a VM supervisor runs vCPU and device threads"
    );
    eprintln!("vm supervisor: {vthreads} threads confined; jail supervisor: {jthreads}");

    // Confined, both still do their work: snapshot, change, roll back.
    let vsnap = vsb.snapshot().unwrap();
    let jsnap = jsb.snapshot().unwrap();
    let v2 = vm.set(&mut vsb, Some(&v1), 2);
    let j2 = jail.set(&mut jsb, Some(&j1), 2);
    v2.check(&mut vsb, "vm, changed");
    j2.check(&mut jsb, "jail, changed");
    vsb.rollback(&vsnap.id).unwrap();
    jsb.rollback(&jsnap.id).unwrap();
    v1.check(&mut vsb, "vm, rolled back while confined");
    j1.check(&mut jsb, "jail, rolled back while confined");
    // The snapshot was moved into place by the library, and the confined VM
    // supervisor, which may not write there, still marked it durable once flushed.
    let boot = cube_storage::durable_marker::boot_id().unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || {
            cube_storage::durable_marker::marked_durable(&vsnap.dir, &boot)
        }),
        "the confined VM supervisor's snapshot was never marked durable"
    );
    assert!(
        std::fs::read_dir(vm.rt.store().sandbox_dir(vsb.id()).unwrap())
            .unwrap()
            .all(|e| !e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".staging")),
        "staging left in the sandbox's directory"
    );
    // The confined VM supervisor read the snapshot it rolled back to where the
    // library lent it (it may not read the store's snapshots), and the loan is over:
    // the snapshot's files are root's and the supervisors' group's, read-only to it.
    let lent = cube_storage::SandboxDir::new(vm.rt.store().sandbox_dir(vsb.id()).unwrap())
        .rollback_source();
    assert!(!lent.exists(), "the lent snapshot was not taken back");
    {
        use std::os::unix::fs::MetadataExt;
        let memory =
            std::fs::metadata(cube_storage::SnapshotDir::new(&vsnap.dir).memory()).unwrap();
        assert_eq!(
            (memory.uid(), memory.gid(), memory.mode() & 0o7777),
            (
                0,
                cube_storage::supervisor_group::SUPERVISOR_GID,
                cube_storage::lent_snapshot::LENT_FILE_MODE
            )
        );
    }
    // Threads started by the rollback are confined too.
    assert_confined(vpid, SupervisorProfile::Vm);
    assert_confined(jsb.status().unwrap().pid, SupervisorProfile::Jail);

    // Code that took a vCPU thread over (through a device model bug an exit reached)
    // tries to open a file, which the rest of the VM supervisor may do: its vCPU
    // threads' allow list kills the supervisor.
    let (mut doomed, _) = vm.create(3);
    let doomed_pid = doomed.status().unwrap().pid;
    // A pause kicks every vCPU out of the guest: each has passed an exit since the
    // confinement, where it applies its list.
    doomed.pause().unwrap();
    doomed.resume().unwrap();
    let vcpu = thread_named(doomed_pid, "vcpu0");
    assert_eq!(inject_syscall(vcpu, libc::SYS_openat), libc::SIGSYS);
    assert!(wait_until(Duration::from_secs(10), || !pid_alive(
        doomed_pid
    )));
    let doomed_id = doomed.id().to_string();
    drop(doomed);
    vm.rt.remove_stale(&doomed_id).unwrap();

    // Code that took the VM supervisor over tries to mount: the supervisor dies.
    let vid = vsb.id().to_string();
    assert_eq!(inject_syscall(vpid as i32, libc::SYS_mount), libc::SIGSYS);
    assert!(wait_until(Duration::from_secs(10), || !pid_alive(vpid)));
    assert!(vsb.status().is_err(), "the VM sandbox's supervisor is gone");
    // The host's other sandbox goes on.
    j1.check(&mut jsb, "jail, after the VM supervisor was killed");
    jsb.snapshot().unwrap();

    vm.rt.remove_stale(&vid).unwrap();
    assert!(vm.leftovers(&vid, &[]).is_empty());
    drop(vsb);
    jsb.destroy().unwrap();
}

/// What a VM supervisor's uid, owner of its sandbox's directory, could put there once
/// taken over: a symbolic link owned by that uid at `path`, to `target`.
fn plant_link(path: &std::path::Path, target: &std::path::Path) {
    use std::os::unix::fs::MetadataExt;
    let owner = std::fs::metadata(path.parent().unwrap()).unwrap().uid();
    let _ = std::fs::remove_file(path);
    std::os::unix::fs::symlink(target, path).unwrap();
    std::os::unix::fs::lchown(path, Some(owner), None).unwrap();
}

#[test]
fn links_a_vm_supervisor_plants_in_its_directory_lead_the_library_nowhere() {
    let (Some(vm), Some(jail)) = (Suite::vm(), Suite::jail()) else {
        eprintln!("skipped: needs both engines (KVM and full-state jails)");
        return;
    };
    let (vsb, _) = vm.create(1);
    let (mut jsb, j1) = jail.create(1);
    let vdir = cube_storage::SandboxDir::new(vm.rt.store().sandbox_dir(vsb.id()).unwrap());
    let jdir = cube_storage::SandboxDir::new(jail.rt.store().sandbox_dir(jsb.id()).unwrap());

    // A record that calls the VM sandbox a jail, and an agent link into the other
    // sandbox's jail beside it: the library must not take the link, which no jail
    // supervisor made, to reach the other sandbox's agent.
    let mut record: serde_json::Value =
        cube_storage::read_verified(&vdir.record(), cube_storage::SandboxDir::RECORD_KIND).unwrap();
    record["engine"] = "jail".into();
    cube_storage::write_atomic(
        &vdir.record(),
        cube_storage::SandboxDir::RECORD_KIND,
        &record,
    )
    .unwrap();
    plant_link(
        &vdir.agent_socket(),
        &std::fs::read_link(jdir.agent_socket()).unwrap(),
    );
    let forged = vm.rt.attach(vsb.id()).unwrap();
    let err = forged
        .agent()
        .err()
        .expect("the planted agent link was taken");
    assert!(
        error_chain(&err).contains("not by a jail supervisor"),
        "{}",
        error_chain(&err)
    );

    // The vsock device's socket replaced with a link to another listener (another
    // sandbox's device, a host socket): the library does not connect to it.
    let tmp = tempfile::tempdir().unwrap();
    let elsewhere = tmp.path().join("elsewhere.sock");
    let listener = std::os::unix::net::UnixListener::bind(&elsewhere).unwrap();
    listener.set_nonblocking(true).unwrap();
    plant_link(&vdir.vsock_socket(), &elsewhere);
    let err = vsb
        .agent()
        .err()
        .expect("the planted vsock link was followed");
    assert!(
        error_chain(&err).contains("symbolic link"),
        "{}",
        error_chain(&err)
    );
    assert_eq!(
        listener.accept().unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock,
        "the library connected through the planted vsock link"
    );

    // The supervisor's socket replaced with a link to the other sandbox's
    // supervisor: attaching refuses rather than drive the other sandbox.
    plant_link(&vdir.supervisor_socket(), &jdir.supervisor_socket());
    let err = vm
        .rt
        .attach(vsb.id())
        .err()
        .expect("attached through the planted supervisor link");
    assert!(
        error_chain(&err).contains("symbolic link"),
        "{}",
        error_chain(&err)
    );

    // Nothing reached the other sandbox, which goes on; the VM sandbox's own
    // connection still drives it.
    j1.check(&mut jsb, "jail, beside the planted links");
    vsb.destroy().unwrap();
    jsb.destroy().unwrap();
}
