//! A supervisor's confinement on a whole multi-threaded process: every thread (those
//! blocked in the kernel, those started later) ends with the profile's capabilities,
//! no_new_privs and the seccomp filters, blocked reads carry on, and a forbidden system
//! call kills the process with SIGSYS. A VM supervisor also loses the host's files
//! (Landlock), on its old threads too, but its own sandbox directory (where a
//! snapshot is lent to it, read-only) and its store's snapshots (listed and removed,
//! never read, altered or added to); and TCP; and runs as a uid of its own, which may
//! remove only the snapshots it staged. A networked VM's network keeper loses all but
//! its sandbox's network record (removed) and its pool's lock file and bpffs pins.
//!
//! Confinement cannot be undone, so each profile runs in a child: this test binary run
//! again with `CUBE_CONFINE_CHILD` naming the profile and the forbidden call to make.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use cube_storage::durable_marker::{make_durable_through, marked_durable, PendingFlush};
use cube_supervisor::confinement::all_threads::{
    held_capabilities, status_field, verify_all_threads,
};
use cube_supervisor::confinement::{confine, filesystem, identity, Profile};
use cube_supervisor::jail_network::pool_config;

const CHILD: &str = "CUBE_CONFINE_CHILD";
/// `STORE:HOST`, two directories the parent made for the child.
const DIRS: &str = "CUBE_CONFINE_DIRS";

/// The network pool of a networked child, as the parent made it on the host: its lock
/// file and its bpffs pin directory (`None` where bpffs is not mounted). Removed when
/// dropped, the test failing too (the child dies confined).
struct TestPool {
    name: String,
    made: Vec<std::path::PathBuf>,
}

impl TestPool {
    fn make() -> Option<TestPool> {
        let name = format!("cf{:x}", std::process::id() & 0xff_ffff);
        let paths = filesystem::PoolPaths::of(&pool_config(&name));
        let mut made = Vec::new();
        // Parents first, each recorded only when this test made it.
        let run_dir = paths.lock_file.parent().unwrap().to_path_buf();
        let parents = [run_dir, paths.pin_dir.parent().unwrap().to_path_buf()];
        for dir in parents.iter().chain([&paths.pin_dir]) {
            if !dir.exists() {
                if let Err(e) = std::fs::create_dir(dir) {
                    eprintln!(
                        "network-keeper skipped: making {} ({e}): no bpffs?",
                        dir.display()
                    );
                    drop(TestPool { name, made });
                    return None;
                }
                made.push(dir.clone());
            }
        }
        std::fs::write(&paths.lock_file, "").unwrap();
        made.push(paths.lock_file);
        Some(TestPool { name, made })
    }
}

impl Drop for TestPool {
    fn drop(&mut self) {
        for path in self.made.iter().rev() {
            let _ = std::fs::remove_file(path).or_else(|_| std::fs::remove_dir(path));
        }
    }
}

/// Runs this test binary again as the child confined to `spec` (`profile:call`).
fn run_child(spec: &str) -> std::process::Output {
    run_child_with(spec, None)
}

/// Like [`run_child`], with the child's network pool `pool`.
fn run_child_with(spec: &str, pool: Option<&TestPool>) -> std::process::Output {
    let store = tempfile::TempDir::new().unwrap();
    let host = tempfile::TempDir::new().unwrap();
    // A store as the child's sandbox finds it: its own directory, another sandbox's
    // with a disk, a template, and the shared areas.
    // Among the snapshots: one the child's sandbox was cloned from, and one it
    // staged before it was confined and the library has since moved into place.
    // The store's areas as the library makes them (shared with the supervisors'
    // group).
    cube_storage::Store::open(store.path()).unwrap();
    for dir in [
        "sandboxes/own",
        "sandboxes/other",
        "sandboxes/other-empty",
        "snapshots/origin-empty",
        "templates/base",
        "snapshots/origin",
        "snapshots/moved",
        "tmp",
    ] {
        std::fs::create_dir_all(store.path().join(dir)).unwrap();
    }
    std::fs::write(store.path().join("sandboxes/other/rootfs.img"), "disk").unwrap();
    std::fs::write(store.path().join("sandboxes/own/rootfs.img"), "disk").unwrap();
    std::fs::write(store.path().join("sandboxes/own/network"), "cubet0").unwrap();
    std::fs::write(store.path().join("snapshots/origin/memory.bin"), "origin").unwrap();
    std::fs::write(store.path().join("templates/base/rootfs.img"), "base").unwrap();
    // The snapshot it was cloned from, lent to it for a rollback (by the library,
    // after its confinement in life).
    cube_storage::lent_snapshot::lend(
        &cube_storage::SnapshotDir::new(store.path().join("snapshots/origin")),
        &cube_storage::SandboxDir::new(store.path().join("sandboxes/own")).rollback_source(),
    )
    .unwrap();
    let mut command = Command::new(std::env::current_exe().unwrap());
    if let Some(pool) = pool {
        command.env("CUBE_NET_POOL", &pool.name);
    }
    command
        .args([
            "--exact",
            "confinement_reaches_every_thread_and_a_forbidden_call_kills_the_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, spec)
        .env(
            DIRS,
            format!("{}:{}", store.path().display(), host.path().display()),
        )
        .output()
        .unwrap()
}

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn profile_named(name: &str) -> Profile {
    match name {
        "vm" => Profile::Vm,
        "network-keeper" => Profile::NetworkKeeper,
        "jail" => Profile::Jail,
        other => panic!("unknown profile {other}"),
    }
}

/// Calls the forbidden system call `name` with harmless arguments (were the filter
/// missing, each would fail or do nothing).
fn forbidden(name: &str) -> libc::c_long {
    let nul = std::ptr::null::<libc::c_char>();
    // SAFETY: every call passes null pointers or zeros, which the kernel checks; none
    // of them changes anything with these arguments.
    unsafe {
        match name {
            "mount" => libc::syscall(libc::SYS_mount, nul, nul, nul, 0, nul),
            "execve" => libc::syscall(libc::SYS_execve, c"/nonexistent".as_ptr(), nul, nul),
            "fork" => libc::syscall(libc::SYS_clone, libc::SIGCHLD as libc::c_ulong, 0, 0, 0, 0),
            "x32" => libc::syscall(libc::SYS_getpid | 0x4000_0000),
            other => panic!("no call {other}"),
        }
    }
}

/// The child: starts threads in the states a supervisor's threads are in, confines
/// itself, checks every thread, then makes the forbidden call.
fn child(spec: &str) {
    let (profile, call) = spec.split_once(':').unwrap();
    let profile = profile_named(profile);
    let (mut reader, mut writer) = std::io::pipe().unwrap();
    let blocked = std::thread::spawn(move || {
        let mut byte = [0u8; 1];
        reader.read_exact(&mut byte).unwrap();
        // Confined while it waited: what it may still read.
        (byte[0], std::fs::read("/etc/passwd").map_err(|e| e.kind()))
    });
    let sleeper = std::thread::spawn(|| {
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    // The store this supervisor's sandbox lies in, and a host directory outside it (as
    // /etc is), both made by the parent (which removes them: this process dies
    // confined).
    let dirs = std::env::var(DIRS).unwrap();
    let (store, host) = dirs.split_once(':').unwrap();
    let (store, host) = (std::path::Path::new(store), std::path::Path::new(host));
    let own = store.join("sandboxes/own");
    std::fs::write(host.join("host-file"), "host").unwrap();
    std::thread::sleep(Duration::from_millis(50));
    // The snapshot staged before, opened for its flush while it could be.
    let moved = store.join("snapshots/moved");
    let marker = PendingFlush::stage(&moved).unwrap();
    let held = held_capabilities().unwrap();
    let identity = if profile == Profile::Vm {
        identity::vm_identity().unwrap()
    } else {
        None
    };
    if let Some(id) = identity {
        // Staged by this supervisor, so its uid's.
        identity::give_own_dir(&moved, id).unwrap();
    }
    confine(profile, &own).unwrap();

    // A thread started after the confinement inherits it.
    let late = std::thread::spawn(|| std::fs::read_to_string("/proc/thread-self/status").unwrap())
        .join()
        .unwrap();
    let filtered = if profile == Profile::Jail { "0" } else { "2" };
    assert_eq!(status_field(&late, "Seccomp"), Some(filtered));
    verify_all_threads(profile.kept(held), identity).unwrap();
    if root() {
        // A VM supervisor started as root runs as a uid of its own; the others stay
        // root.
        let uid = status_field(&late, "Uid").unwrap().to_string();
        let expected = identity.map_or(0, |id| id.uid);
        assert_eq!(uid, vec![expected.to_string(); 4].join("\t"));
        assert_eq!(identity.is_some(), profile == Profile::Vm);
        if let Some(id) = identity {
            assert!(cube_jail::sandbox_uid::RANGE.contains(&id.uid), "{id:?}");
            use std::os::unix::fs::MetadataExt;
            assert_eq!(std::fs::metadata(&own).unwrap().uid(), id.uid);
        }
    }
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let status = std::fs::read_to_string(task.unwrap().path().join("status")).unwrap();
        assert_eq!(status_field(&status, "Seccomp"), Some(filtered), "{status}");
    }
    // The blocked read was interrupted by the confinement signal and carried on.
    writer.write_all(b"x").unwrap();
    let (byte, host_read_by_old_thread) = blocked.join().unwrap();
    assert_eq!(byte, b'x');
    sleeper.join().unwrap();
    let landlocked = profile != Profile::Jail && filesystem::kernel_abi().is_some();
    if profile == Profile::NetworkKeeper {
        keeper_reach(store, host, &own, host_read_by_old_thread);
    } else {
        supervisor_reach(profile, store, host, marker, host_read_by_old_thread);
        if identity.is_some() {
            removal_reach(store);
        }
    }
    if landlocked {
        // uid 0 writes most sysctls with no capability; /proc is read-only to it now.
        // (Its own value: were the confinement missing, nothing would change.)
        let pattern = std::fs::read("/proc/sys/kernel/core_pattern").unwrap();
        let write = std::fs::write("/proc/sys/kernel/core_pattern", &pattern);
        assert_eq!(
            write.map_err(|e| e.kind()),
            Err(std::io::ErrorKind::PermissionDenied),
            "a sysctl written"
        );
    }
    if landlocked && filesystem::signals_scoped() {
        // uid 0 may signal any root process; a confined VM supervisor only its own.
        // SAFETY: signal 0 only checks permission; the parent is this test's runner.
        let r = unsafe { libc::kill(libc::getppid(), 0) };
        assert_eq!(
            (r, std::io::Error::last_os_error().raw_os_error()),
            (-1, Some(libc::EPERM))
        );
    }
    // Allowed work goes on: threads, named (by prctl: /proc is read-only to a VM).
    let name = std::thread::Builder::new()
        .name("named-late".into())
        .spawn(|| std::fs::read_to_string("/proc/thread-self/comm").unwrap())
        .unwrap()
        .join()
        .unwrap();
    assert_eq!(name.trim(), "named-late");
    if profile == Profile::Jail {
        // A jail supervisor starts CRIU and jails after its confinement; CRIU needs to
        // be under no seccomp filter (see `syscall_filter`).
        assert!(Command::new("true").status().unwrap().success());
        let criu_view = Command::new("grep")
            .args(["^Seccomp:", "/proc/self/status"])
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&criu_view.stdout).trim(),
            "Seccomp:\t0"
        );
    }
    if let Some(id) = identity {
        // Ending on its own, it removes its directory and the snapshots its uid owns
        // (found without reading their records, which it may not), no other.
        let store = cube_storage::Store::open(store).unwrap();
        store.remove_sandbox_files_of_uid("own", id.uid).unwrap();
        assert!(!moved.exists() && !own.exists());
        assert!(store
            .snapshot_dir("origin")
            .unwrap()
            .join("memory.bin")
            .exists());
    } else if profile == Profile::Jail {
        std::fs::remove_dir_all(&moved).unwrap();
        std::fs::remove_dir_all(&own).unwrap();
    }
    println!("confined");
    std::io::stdout().flush().unwrap();
    let r = forbidden(call);
    println!("survived {call}: {r}");
    std::process::exit(0);
}

/// What a confined VM or jail supervisor reaches of its store and the host: a VM's
/// only its own directory (read-write) and snapshots (listed and removed), where the
/// kernel has Landlock; a jail's all of it.
fn supervisor_reach(
    profile: Profile,
    store: &std::path::Path,
    host: &std::path::Path,
    marker: PendingFlush,
    host_read_by_old_thread: Result<Vec<u8>, std::io::ErrorKind>,
) {
    let own = store.join("sandboxes/own");
    let moved = store.join("snapshots/moved");
    // Its sandbox's directory stays its own: files made, renamed, read, removed.
    let made = own.join("made");
    std::fs::write(&made, "memory").unwrap();
    std::fs::rename(&made, own.join("renamed")).unwrap();
    assert_eq!(
        std::fs::read_to_string(own.join("renamed")).unwrap(),
        "memory"
    );
    std::fs::remove_file(own.join("renamed")).unwrap();
    std::fs::create_dir(own.join("dir")).unwrap();
    // A snapshot is staged in its own directory (the library moves it into place);
    // the one moved is synced and marked durable through what was opened while it
    // was staged; the one it rolls back to is read where it is lent, and cloned (a
    // rollback's disk).
    let staging = own.join("snap.staging");
    std::fs::create_dir(&staging).unwrap();
    std::fs::write(staging.join("memory.bin"), "memory").unwrap();
    PendingFlush::stage(&staging).unwrap();
    make_durable_through(&moved, "boot", marker).unwrap();
    if profile == Profile::Jail {
        assert!(marked_durable(&moved, "boot"));
    } else {
        // It may not read the marker back where the snapshot lies; it was written.
        assert!(std::fs::metadata(moved.join("durable")).unwrap().len() > 0);
    }
    let lent = cube_storage::SandboxDir::new(&own).rollback_source();
    assert_eq!(
        std::fs::read_to_string(lent.join("memory.bin")).unwrap(),
        "origin"
    );
    cube_storage::clone_file(&lent.join("memory.bin"), &own.join("memory.bin")).unwrap();
    std::fs::write(own.join("memory.bin"), "its own copy").unwrap();
    let origin = store.join("snapshots/origin");
    let base = store.join("templates/base/rootfs.img");
    if root() && profile == Profile::Vm {
        // Lent read-only: as its uid, not the file's owner, it neither writes the
        // snapshot through the link (a clone mapping it would see the write) nor
        // makes it writable.
        use std::os::unix::fs::PermissionsExt;
        let lent_memory = lent.join("memory.bin");
        assert_eq!(
            std::fs::write(&lent_memory, "changed").map_err(|e| e.kind()),
            Err(std::io::ErrorKind::PermissionDenied)
        );
        let chmod = std::fs::set_permissions(&lent_memory, std::fs::Permissions::from_mode(0o666));
        assert_eq!(chmod.map_err(|e| e.raw_os_error()), Err(Some(libc::EPERM)));
    }
    // The host's files: out of reach of a VM supervisor without a network, from any of
    // its threads, where the kernel has Landlock; the others keep them (they mount,
    // pin namespaces and run CRIU on host paths).
    let landlocked = profile != Profile::Jail && filesystem::kernel_abi().is_some();
    let denied = |r: Result<(), std::io::ErrorKind>| match r {
        Err(std::io::ErrorKind::PermissionDenied) => true,
        Ok(()) => false,
        Err(other) => panic!("{profile:?}: unexpected error {other:?}"),
    };
    let results = [
        (
            "old thread reads /etc/passwd",
            host_read_by_old_thread.map(drop),
        ),
        (
            "reads /etc/passwd",
            std::fs::read("/etc/passwd").map(drop).map_err(|e| e.kind()),
        ),
        (
            "writes a host file",
            std::fs::write(host.join("host-file"), "changed").map_err(|e| e.kind()),
        ),
        (
            "makes a host file",
            std::fs::write(host.join("new"), "x").map_err(|e| e.kind()),
        ),
        (
            "reads another sandbox's disk",
            std::fs::read(store.join("sandboxes/other/rootfs.img"))
                .map(drop)
                .map_err(|e| e.kind()),
        ),
        (
            "writes another sandbox's disk",
            std::fs::write(store.join("sandboxes/other/rootfs.img"), "x").map_err(|e| e.kind()),
        ),
        (
            "makes a file in another sandbox",
            std::fs::write(store.join("sandboxes/other/new"), "x").map_err(|e| e.kind()),
        ),
        (
            "reads a snapshot",
            std::fs::read(origin.join("memory.bin"))
                .map(drop)
                .map_err(|e| e.kind()),
        ),
        (
            "reads a snapshot it staged itself",
            std::fs::read(moved.join("durable"))
                .map(drop)
                .map_err(|e| e.kind()),
        ),
        (
            "reads a template",
            std::fs::read(&base).map(drop).map_err(|e| e.kind()),
        ),
        (
            "writes a template",
            std::fs::write(&base, "changed").map_err(|e| e.kind()),
        ),
        (
            "moves a staged snapshot among the snapshots",
            std::fs::rename(&staging, store.join("snapshots/new")).map_err(|e| e.kind()),
        ),
        (
            "makes a directory among the snapshots",
            std::fs::create_dir(store.join("snapshots/made")).map_err(|e| e.kind()),
        ),
        (
            "writes a snapshot",
            std::fs::write(origin.join("memory.bin"), "changed").map_err(|e| e.kind()),
        ),
        (
            "makes a file in a snapshot",
            std::fs::write(origin.join("state.bin"), "x").map_err(|e| e.kind()),
        ),
        (
            "makes a directory in a snapshot",
            std::fs::create_dir(origin.join("layer")).map_err(|e| e.kind()),
        ),
        (
            "writes scratch space",
            std::fs::write(store.join("tmp/import"), "x").map_err(|e| e.kind()),
        ),
        (
            "binds a TCP port",
            std::net::TcpListener::bind("127.0.0.1:0")
                .map(drop)
                .map_err(|e| e.kind()),
        ),
    ];
    for (what, result) in results {
        assert_eq!(denied(result), landlocked, "{profile:?} {what}");
    }
    // A host disk: uid 0 (a jail's) reads one, Landlock keeps a VM's out of all of
    // /dev but a few harmless devices.
    if let Some(disk) = host_block_device() {
        let opened = std::fs::File::open(&disk).map(drop).map_err(|e| e.kind());
        assert_eq!(denied(opened), landlocked, "{profile:?} opens {disk:?}");
    }
}

/// A block device of this host (a disk, a loop device), if it has one.
fn host_block_device() -> Option<std::path::PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    std::fs::read_dir("/sys/class/block")
        .ok()?
        .flatten()
        .map(|e| std::path::Path::new("/dev").join(e.file_name()))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.file_type().is_block_device()))
}

/// What a VM supervisor running as its own uid may remove of the store: only what its
/// uid owns. Landlock alone allows removal of every snapshot and of every emptied
/// sandbox directory; the shared areas' sticky bit keeps other owners' entries.
fn removal_reach(store: &std::path::Path) {
    let denied = |what: &str, r: std::io::Result<()>| {
        assert_eq!(
            r.map_err(|e| e.kind()),
            Err(std::io::ErrorKind::PermissionDenied),
            "vm {what}"
        );
    };
    let origin = store.join("snapshots/origin");
    denied(
        "removes a file of a snapshot another uid wrote",
        std::fs::remove_file(origin.join("memory.bin")),
    );
    let empty = store.join("snapshots/origin-empty");
    denied(
        "removes another uid's emptied snapshot directory",
        std::fs::remove_dir(&empty),
    );
    denied(
        "removes another sandbox's emptied directory",
        std::fs::remove_dir(store.join("sandboxes/other-empty")),
    );
    assert!(origin.join("memory.bin").exists() && empty.exists());
}

/// What a confined network keeper reaches: its sandbox's network record (removed),
/// its pool's lock file and pins, nothing else of the store or the host.
fn keeper_reach(
    store: &std::path::Path,
    host: &std::path::Path,
    own: &std::path::Path,
    host_read_by_old_thread: Result<Vec<u8>, std::io::ErrorKind>,
) {
    if filesystem::kernel_abi().is_none() {
        return;
    }
    let denied = |what: &str, r: std::io::Result<()>| {
        assert_eq!(
            r.map_err(|e| e.kind()),
            Err(std::io::ErrorKind::PermissionDenied),
            "network keeper {what}"
        );
    };
    denied(
        "old thread reads /etc/passwd",
        host_read_by_old_thread
            .map(drop)
            .map_err(std::io::Error::from),
    );
    denied("reads /etc/passwd", std::fs::read("/etc/passwd").map(drop));
    denied(
        "writes a host file",
        std::fs::write(host.join("host-file"), "changed"),
    );
    denied(
        "makes a file in its sandbox",
        std::fs::write(own.join("made"), "x"),
    );
    denied(
        "reads its sandbox's disk",
        std::fs::read(own.join("rootfs.img")).map(drop),
    );
    denied(
        "reads a template",
        std::fs::read(store.join("templates/base/rootfs.img")).map(drop),
    );
    denied(
        "reads a snapshot",
        std::fs::read(store.join("snapshots/origin/memory.bin")).map(drop),
    );
    denied(
        "binds a TCP port",
        std::net::TcpListener::bind("127.0.0.1:0").map(drop),
    );
    // Its device's record goes with the device.
    std::fs::remove_file(own.join("network")).unwrap();
    // Its pool: the lock taken around releasing its TAP, the TAP's link pin removed
    // with it; nothing else of the pool's run directory.
    let pool = filesystem::PoolPaths::of_host_pool().unwrap();
    let lock = std::fs::OpenOptions::new()
        .write(true)
        .open(&pool.lock_file)
        .unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    let pin = pool.pin_dir.join("links");
    std::fs::create_dir(&pin).unwrap();
    std::fs::remove_dir(&pin).unwrap();
    denied(
        "makes a file beside the pool's lock",
        std::fs::write(pool.lock_file.with_extension("other"), "x"),
    );
}

#[test]
fn confinement_reaches_every_thread_and_a_forbidden_call_kills_the_process() {
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
        return;
    }
    if !root() {
        eprintln!("skipped: confining a supervisor needs root (capabilities to drop)");
        return;
    }
    let cases = [
        ("vm", "mount"),
        ("vm", "execve"),
        ("vm", "fork"),
        ("vm", "x32"),
        ("network-keeper", "execve"),
        ("network-keeper", "mount"),
    ];
    let pool = TestPool::make();
    for (profile, call) in cases {
        if profile == "network-keeper" && pool.is_none() {
            continue;
        }
        let out = run_child_with(&format!("{profile}:{call}"), pool.as_ref());
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("confined"),
            "{profile}: the child did not confine itself: {out:?}"
        );
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGSYS),
            "{profile}: {call} did not kill the process: {stdout}"
        );
    }
    drop(pool);
    // The jail profile: capabilities and no_new_privs, no filter (CRIU runs under it).
    let out = run_child("jail:x32");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("confined") && stdout.contains("survived x32") && out.status.success(),
        "jail: {out:?}"
    );
}
