//! A running Linux VM sandbox through the `Sandbox` API, created from a Debian kernel
//! snapshotted mid-boot as a VM template (the kernel `scripts/fetch-kernel.sh`
//! unpacks into the store): snapshots hold only the pages dirtied since their parent,
//! rollback, a clone, and hibernate/wake keep the guest booting (its console goes on),
//! a failed rollback leaves the sandbox as it was; and a sandbox created with a
//! network has a TAP from cube-net's pool behind its NIC, with the datapath program,
//! policy and exposed ports on it, all gone after destroy. That TAP is held by the
//! supervisor's network keeper, a process of its own: the supervisor keeps no
//! capability, and when it is killed (here by its device event loop's allow list, on
//! an injected `openat`) the keeper gives the TAP back.
//!
//! On a PVM host the kernel runs emulated and stops for good about ten seconds after
//! its banner (an instruction KVM cannot emulate), so every check that the guest goes
//! on is made soon after the snapshot point it continues from.

#![allow(clippy::unwrap_used, clippy::expect_used)] // helpers of this test file, not library code

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::linux::{linux_kernel, runtime_with_midboot_template, MEMORY_BYTES, TEMPLATE};
use cube_core::network::{NetworkOptions, NetworkPolicy, PortMapping};
use cube_core::store::{SandboxDir, SnapshotDir};
use cube_core::{CreateOptions, MachineStatus, Sandbox, SandboxError, SnapshotKind};
use cube_supervisor::client::ClientError;
use cube_supervisor::network_keeper::KeeperCall;
use cube_supervisor::protocol::{read_frame, write_frame, Request, Response};
use cube_supervisor::vm_agent::VmAgentError;

/// How long a guest may take to print its next console line here.
const CONSOLE_WAIT: Duration = Duration::from_secs(60);

fn console_len(sb: &Sandbox) -> usize {
    std::fs::read(SandboxDir::new(sb.dir()).console_log())
        .map(|c| c.len())
        .unwrap_or(0)
}

/// Waits until the sandbox's console log is longer than `than` bytes: the guest runs.
fn wait_console_past(sb: &mut Sandbox, than: usize, what: &str) {
    let deadline = Instant::now() + CONSOLE_WAIT;
    while console_len(sb) <= than {
        if let MachineStatus::Failed(why) = sb.status().unwrap().status {
            panic!("{what}: the guest stopped before printing anything more: {why}");
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the console stayed at {than} bytes for {CONSOLE_WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn running(sb: &mut Sandbox) -> bool {
    sb.status().unwrap().status == MachineStatus::Running
}

/// Pages of guest memory that differ between memory files `a` and `b` (their seals,
/// one per snapshot, left out).
fn pages_differing(a: &Path, b: &Path) -> u64 {
    let (mut a, mut b) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert_eq!(a.len(), b.len());
    let guest = a.len() - cube_mem::SEAL_BYTES as usize;
    a.truncate(guest);
    b.truncate(guest);
    a.chunks(4096)
        .zip(b.chunks(4096))
        .filter(|(x, y)| x != y)
        .count() as u64
}

#[test]
fn a_running_linux_vm_sandbox_snapshots_diffs_rolls_back_clones_hibernates_and_wakes() {
    let Some(kernel) = linux_kernel() else { return };
    let root = tempfile::tempdir().unwrap();
    let rt = runtime_with_midboot_template(kernel, root.path());
    let template = rt.store().template(TEMPLATE).unwrap().image();

    let mut sb = rt.create(TEMPLATE, CreateOptions::new(true)).unwrap();
    wait_console_past(&mut sb, 0, "the new sandbox");
    assert!(running(&mut sb));

    // The first snapshot: a diff against the template image it was restored from.
    let first = sb.snapshot().unwrap();
    assert_eq!(first.kind, SnapshotKind::Full);
    let first_memory = SnapshotDir::new(&first.dir).memory();
    assert_eq!(
        std::fs::metadata(&first_memory).unwrap().len(),
        MEMORY_BYTES + cube_mem::SEAL_BYTES
    );
    let first_dir = SnapshotDir::new(&first.dir);
    assert!(first_dir.rootfs().is_file() && first_dir.state().is_file());
    let changed = pages_differing(&template.memory(), &first_memory);
    eprintln!(
        "first snapshot: {} dirty pages, {} bytes written of {MEMORY_BYTES} bytes of memory \
         ({} pages differ from the template); reflinked: {}",
        first.stats.dirty_pages, first.stats.bytes_written, changed, first.stats.reflinked
    );
    assert!(first.stats.dirty_pages > 0);
    // Whole pages, each dirty one at least once: a page the pre-copy took while the
    // guest ran and the guest wrote again before the stop is written twice.
    assert_eq!(first.stats.bytes_written % 4096, 0);
    assert!(first.stats.bytes_written >= first.stats.dirty_pages * 4096);
    assert!(first.stats.bytes_written < MEMORY_BYTES / 4);
    assert!(changed <= first.stats.dirty_pages);
    assert!(running(&mut sb), "the sandbox runs on after its snapshot");

    // The second: a diff against the first (the committed snapshot is the new parent).
    let before = console_len(&sb);
    wait_console_past(&mut sb, before, "after the first snapshot");
    let second = sb.snapshot().unwrap();
    let changed = pages_differing(&first_memory, &SnapshotDir::new(&second.dir).memory());
    eprintln!(
        "second snapshot: {} dirty pages, {} bytes written ({} pages differ from the first)",
        second.stats.dirty_pages, second.stats.bytes_written, changed
    );
    assert!(second.stats.dirty_pages > 0);
    assert!(second.stats.bytes_written < MEMORY_BYTES / 4);
    assert!(changed <= second.stats.dirty_pages);

    // A snapshot that fails half way (its disk cannot be copied: a directory stands
    // where the disk was; the device keeps its open file) leaves no snapshot behind,
    // the earlier ones as they were, and the sandbox running; the next one works.
    let first_image = std::fs::read(&first_memory).unwrap();
    let disk = SandboxDir::new(sb.dir()).rootfs();
    let moved = sb.dir().join("rootfs.img.moved");
    std::fs::rename(&disk, &moved).unwrap();
    std::fs::create_dir(&disk).unwrap();
    let snapshots_before = rt.snapshots(Some(sb.id())).unwrap().len();
    assert!(sb.snapshot().is_err());
    std::fs::remove_dir(&disk).unwrap();
    std::fs::rename(&moved, &disk).unwrap();
    assert_eq!(rt.snapshots(Some(sb.id())).unwrap().len(), snapshots_before);
    let staging_left = std::fs::read_dir(sb.dir())
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().ends_with(".staging")
        })
        .count();
    assert_eq!(
        staging_left, 0,
        "a failed snapshot left its staging directory"
    );
    assert!(std::fs::read(&first_memory).unwrap() == first_image);
    assert!(running(&mut sb));
    let third = sb.snapshot().unwrap();
    assert!(third.stats.dirty_pages > 0);

    // Rollback: the guest goes on from the first snapshot, its console continues.
    let generation = sb.status().unwrap().generation;
    let before = console_len(&sb);
    sb.rollback(&first.id).unwrap();
    assert!(running(&mut sb));
    assert!(sb.status().unwrap().generation > generation);
    assert!(!sb.dir().join("rootfs.img.rollback").exists());
    wait_console_past(&mut sb, before, "after the rollback");

    // A clone of the second snapshot boots on in a sandbox of its own.
    let mut clone = rt
        .create_from_snapshot(&second.id, CreateOptions::new(true))
        .unwrap();
    assert!(running(&mut clone));
    wait_console_past(&mut clone, 0, "the clone");

    // Hibernate: state on disk (memory as a diff), VM gone; wake goes on from there.
    sb.hibernate().unwrap();
    assert_eq!(sb.status().unwrap().status, MachineStatus::Hibernated);
    let image = SandboxDir::new(sb.dir()).hibernation();
    assert!(image.memory().is_file() && image.state().is_file());
    assert!(!SandboxDir::new(sb.dir()).vsock_socket().exists());
    let Err(err) = sb.snapshot() else {
        panic!("a hibernated sandbox took a snapshot");
    };
    assert!(format!("{:?}", err).contains("hibernated"), "{err:?}");
    let before = console_len(&sb);
    sb.wake().unwrap();
    assert!(running(&mut sb));
    wait_console_past(&mut sb, before, "after wake");

    // A rollback to a damaged snapshot fails and leaves the sandbox as it was: running,
    // its disk in place, its agent socket served by the same VM.
    std::fs::write(SnapshotDir::new(&second.dir).state(), b"garbage").unwrap();
    let generation = sb.status().unwrap().generation;
    assert!(sb.rollback(&second.id).is_err());
    assert!(running(&mut sb));
    assert_eq!(sb.status().unwrap().generation, generation);
    assert!(SandboxDir::new(sb.dir()).rootfs().is_file());
    assert!(!sb.dir().join("rootfs.img.rollback").exists());
    let Err(err) = sb.agent() else {
        panic!("an agent answered in a guest that never started one");
    };
    assert!(
        matches!(
            &err,
            SandboxError::VmAgent(_, VmAgentError::NotReady { .. })
        ),
        "the vsock socket is not the VM's any more: {err:?}"
    );

    let dirs = [sb.dir().to_path_buf(), clone.dir().to_path_buf()];
    clone.destroy().unwrap();
    sb.destroy().unwrap();
    for dir in dirs {
        assert!(!dir.exists());
    }
    assert!(!first.dir.exists() && !second.dir.exists() && !third.dir.exists());
}

/// What cube-net holds for the device `name`, from a handle of the test's own.
fn residue(name: &str, index: u32) -> cube_net::Residue {
    let (pool, _lock) = cube_core::testing::open_pool().unwrap();
    pool.residue(name, index).unwrap()
}

fn ifindex(name: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Whether process `pid` holds TAP `name` open (tun's fdinfo names the device).
fn holds_tap(pid: u32, name: &str) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return false;
    };
    fds.filter_map(|e| e.ok()).any(|fd| {
        std::fs::read_to_string(fd.path())
            .is_ok_and(|info| info.lines().any(|l| l == format!("iff:\t{name}")))
    })
}

/// A field of `/proc/PID/status` (or of a thread's, with `pid` a task path).
fn status_field(status_path: &str, name: &str) -> String {
    let status = std::fs::read_to_string(status_path).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| panic!("no {name} in {status_path}"))
}

fn capabilities(status_path: &str, set: &str) -> u64 {
    u64::from_str_radix(&status_field(status_path, set), 16).unwrap()
}

/// The network keeper the supervisor `pid` started (its child running
/// `--network-keeper-fd`).
fn keeper_of(pid: u32) -> Option<u32> {
    std::fs::read_dir("/proc").unwrap().find_map(|entry| {
        let child: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).ok()?;
        let ppid: u32 = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let cmdline = std::fs::read(format!("/proc/{child}/cmdline")).ok()?;
        let keeper = String::from_utf8_lossy(&cmdline).contains("--network-keeper-fd");
        (ppid == pid && keeper).then_some(child)
    })
}

/// The networked VM's supervisor `pid` holds no network capability on any thread (its
/// TAP is open, the rest of the network is its keeper's; it keeps no capability at
/// all) and runs as a uid of its own; the keeper holds the network capabilities only,
/// under a seccomp filter, as root.
fn assert_network_held_apart(pid: u32) -> u32 {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        if common::user_worker(&std::fs::read_to_string(task.join("stat")).unwrap()) {
            continue;
        }
        let status = task.join("status");
        let status = status.to_str().unwrap();
        for set in ["CapEff", "CapPrm", "CapBnd"] {
            let held = capabilities(status, set);
            assert_eq!(held, 0, "supervisor {status} {set} {held:#x}");
        }
        assert_eq!(status_field(status, "Seccomp"), "2", "supervisor {status}");
        let uid: u32 = status_field(status, "Uid")
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            cube_jail::sandbox_uid::RANGE.contains(&uid),
            "supervisor {status} runs as uid {uid}"
        );
    }
    let keeper = keeper_of(pid).expect("the supervisor has a network keeper");
    let status = format!("/proc/{keeper}/status");
    let network = (1 << 12) | (1 << 13) | (1 << 38) | (1 << 39); // net_admin, net_raw, perfmon, bpf
    let held = capabilities(&status, "CapEff");
    assert_eq!(held & !network, 0, "keeper CapEff {held:#x}");
    assert_ne!(held & (1 << 12), 0, "the keeper lacks net_admin: {held:#x}");
    assert_eq!(status_field(&status, "Seccomp"), "2");
    assert_eq!(status_field(&status, "NoNewPrivs"), "1");
    keeper
}

/// The uid process `pid` runs as.
fn uid_of(pid: u32) -> u32 {
    status_field(&format!("/proc/{pid}/status"), "Uid")
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Makes the calling thread what a confined VM supervisor is: `uid`, the supervisors'
/// group, no capability. Raw system calls: the kernel keeps credentials per
/// thread, and only this thread (which ends after its request) changes.
fn become_supervisor(uid: u32) {
    use cube_jail::capabilities::{
        keep_only, keep_permitted_through_uid_switch_in_child, switch_identity_in_child, Identity,
    };
    keep_permitted_through_uid_switch_in_child().unwrap();
    switch_identity_in_child(Identity {
        uid,
        gid: cube_storage::supervisor_group::SUPERVISOR_GID,
    })
    .unwrap();
    keep_only(0).unwrap();
}

#[test]
fn a_linux_vm_sandbox_with_a_network_has_a_pool_tap_behind_its_nic_until_destroyed() {
    let Some(kernel) = linux_kernel() else { return };
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipping: sandbox networks need root (netlink, eBPF)");
        return;
    }
    let pool_name = cube_core::testing::pool_name().unwrap();
    let pool_config = cube_core::testing::pool_config(&pool_name);
    let pool_existed = pool_config.bpffs.join("cube-net").join(&pool_name).exists();
    if let Err(e) = cube_core::testing::open_pool() {
        eprintln!("skipping: the network datapath does not load here: {e}");
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let rt = runtime_with_midboot_template(kernel, root.path());
    let options = CreateOptions {
        network: Some(NetworkOptions {
            policy: NetworkPolicy {
                internet: false,
                allow_out: vec!["192.0.2.0/24".into()],
                deny_out: vec!["192.0.2.128/25".into()],
            },
            expose: vec![PortMapping {
                host_port: 47_801,
                sandbox_port: 8000,
            }],
        }),
        ..CreateOptions::new(true)
    };
    let mut sb = rt.create(TEMPLATE, options).unwrap();
    let report = sb.network().unwrap();
    let tap = report.host_ifname.clone();
    let index = ifindex(&tap).expect("the TAP exists while the sandbox lives");
    eprintln!("sandbox TAP {tap} (ifindex {index})");
    assert!(tap.ends_with('t'), "{tap} is not one of the pool's TAPs");
    let pid = sb.status().unwrap().pid;
    assert!(holds_tap(pid, &tap), "the VMM did not open {tap}");
    let keeper = assert_network_held_apart(pid);
    let live = residue(&tap, index);
    assert!(live.registered);
    assert_eq!(live.exposed_ports, 1);
    // Its own two entries, and the default deny ranges: a VM's TAP gets them too.
    assert_eq!(
        live.policy_entries,
        2 + cube_net::policy::DEFAULT_DENY.len()
    );
    if cube_net::datapath::tcx_supported() {
        assert_eq!(live.programs, 1, "{live:?}");
        assert_eq!(live.pins, 1, "{live:?}");
    }

    // Policy and ports change live on the TAP.
    sb.set_policy(&NetworkPolicy {
        internet: true,
        allow_out: Vec::new(),
        deny_out: vec!["198.18.0.0/15".into()],
    })
    .unwrap();
    sb.expose(PortMapping {
        host_port: 47_802,
        sandbox_port: 22,
    })
    .unwrap();
    let changed = residue(&tap, index);
    // 198.18.0.0/15 is one of the default ranges already.
    assert_eq!(changed.policy_entries, cube_net::policy::DEFAULT_DENY.len());
    assert_eq!(changed.exposed_ports, 2);
    sb.unexpose(47_801).unwrap();
    assert_eq!(residue(&tap, index).exposed_ports, 1);
    assert!(sb.network().unwrap().policy.internet);

    // The library asks the keeper itself, never the supervisor: a supervisor taken
    // over by its guest could otherwise open its own network up. As one (its uid,
    // its one capability), ask the keeper for a port and the whole internet: it
    // answers only root, and nothing changes.
    let uid = uid_of(pid);
    let before = residue(&tap, index);
    for request in [
        Request::Expose(PortMapping {
            host_port: 47_803,
            sandbox_port: 22,
        }),
        Request::SetPolicy(NetworkPolicy {
            internet: false,
            allow_out: vec!["203.0.113.0/24".into()],
            deny_out: Vec::new(),
        }),
    ] {
        let dir = sb.dir().to_path_buf();
        let answered = std::thread::spawn(move || {
            become_supervisor(uid);
            // It owns the socket (its directory's), so it connects.
            let socket = SandboxDir::new(&dir).network_keeper_socket();
            let mut conn = std::os::unix::net::UnixStream::connect(socket).unwrap();
            let call = KeeperCall {
                sandbox: dir,
                request,
            };
            // The keeper may have hung up before the request is written.
            let _ = write_frame(&mut conn, &call);
            read_frame::<Response>(&mut conn)
        })
        .join()
        .unwrap();
        assert!(
            answered.is_err(),
            "the keeper answered its supervisor: {answered:?}"
        );
    }
    let after = residue(&tap, index);
    assert_eq!(
        (after.policy_entries, after.exposed_ports),
        (before.policy_entries, before.exposed_ports)
    );
    assert!(sb.network().unwrap().policy.internet);
    // Nor does its own sandbox's socket, made a link to another keeper's, turn the
    // library's request to that keeper: it holds another sandbox's device, and says
    // so.
    let elsewhere = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(
        SandboxDir::new(sb.dir()).network_keeper_socket(),
        SandboxDir::new(elsewhere.path()).network_keeper_socket(),
    )
    .unwrap();
    let redirected =
        cube_supervisor::network_keeper::ask_keeper(elsewhere.path(), &Request::NetworkStatus);
    assert!(
        matches!(&redirected, Err(ClientError::Remote(f)) if f.message.contains("holds the device of")),
        "{redirected:?}"
    );
    // The supervisor itself no longer relays a network request.
    let relayed = cube_supervisor::client::SupervisorClient::connect(
        &SandboxDir::new(sb.dir()).supervisor_socket(),
    )
    .unwrap()
    .call(&Request::NetworkStatus);
    assert!(
        matches!(relayed, Err(ClientError::Remote(_))),
        "{relayed:?}"
    );

    // The TAP stays the sandbox's across snapshot, rollback and hibernation.
    let snapshot = sb.snapshot().unwrap();
    sb.rollback(&snapshot.id).unwrap();
    assert!(holds_tap(pid, &tap));
    sb.hibernate().unwrap();
    assert_eq!(sb.network().unwrap().host_ifname, tap);
    sb.wake().unwrap();
    assert!(holds_tap(pid, &tap));
    assert_eq!(residue(&tap, index).exposed_ports, 1);

    sb.destroy().unwrap();
    assert!(ifindex(&tap).is_none(), "{tap} outlived its sandbox");
    assert_eq!(residue(&tap, index), cube_net::Residue::default());
    assert!(
        !Path::new(&format!("/proc/{keeper}")).exists() || keeper_of(pid).is_none(),
        "the network keeper outlived its sandbox"
    );

    // A supervisor killed: its keeper hears it gone and gives the TAP back.
    let networked = CreateOptions {
        network: Some(NetworkOptions::default()),
        ..CreateOptions::new(true)
    };
    let mut doomed = rt.create(TEMPLATE, networked).unwrap();
    let tap = doomed.network().unwrap().host_ifname;
    let index = ifindex(&tap).unwrap();
    let pid = doomed.status().unwrap().pid;
    assert_network_held_apart(pid);
    // Code that took the device event loop over (through a virtio queue the guest
    // wrote) opens a file, which the supervisor's other threads may: the loop's allow
    // list kills the supervisor.
    let devices = common::thread_named(pid, "cube-devices");
    assert!(
        common::wait_until(Duration::from_secs(10), || {
            common::seccomp_filters(pid, devices) > common::seccomp_filters(pid, pid as i32)
        }),
        "the device event loop never applied its own filter"
    );
    assert_eq!(
        common::inject_syscall(devices, libc::SYS_openat),
        libc::SIGSYS
    );
    assert!(
        common::wait_until(Duration::from_secs(60), || ifindex(&tap).is_none()),
        "{tap} stayed a minute after its supervisor was killed"
    );
    assert_eq!(residue(&tap, index), cube_net::Residue::default());
    let _ = doomed.destroy();
    // The pool is the host's: remove it only if this test brought it and nobody
    // else (another test run) attached a device meanwhile.
    if !pool_existed {
        if let Ok((pool, _lock)) = cube_core::testing::open_pool() {
            if pool.attached().unwrap().is_empty() {
                pool.destroy().unwrap();
            }
        }
    }
}
