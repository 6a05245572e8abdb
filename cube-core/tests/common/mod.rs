//! What the integration tests share: a private store and runtime per test, the KVM
//! check, guest-memory and file readers, and the accounting that proves a test left no
//! supervisor process and no sandbox directory behind.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code, unused_imports)]
// These helpers run only inside tests, where a failed step should fail the test on
// the spot (clippy's allow-expect-in-tests does not reach functions outside #[test]).
#![allow(clippy::expect_used, clippy::unwrap_used)]

pub mod engines;
pub mod lab;
pub mod linux;
pub mod workload;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use cube_core::templates::MachineConfig;
pub use cube_core::templates::WorkingSet;
pub use cube_core::testing::mailbox::{field, DIRTY_AREA_ADDR, MAILBOX_ADDR};
pub use cube_core::testing::TestGuestControl;
pub use cube_core::SandboxError;
pub use cube_core::{CreateOptions, Runtime, RuntimeConfig, Sandbox, Snapshot};
pub use cube_core::{MachineStatus, StatusReport};

/// Guest page size.
pub const PAGE: u64 = 4096;
/// Guest RAM of every test machine: the smallest Cube accepts, to keep the suite fast.
pub const GUEST_MEMORY: u64 = 128 << 20;
/// Largest read the supervisor serves in one request.
pub const READ_CHUNK: u64 = 512 << 10;
/// How long a supervisor may take to exit once it has been told to.
pub const EXIT_WAIT: Duration = Duration::from_secs(10);
/// Guest-physical address of the test guest's page tables (PML4, PDPT, first PD).
pub const PAGE_TABLES_ADDR: u64 = 0x10_0000;
/// Guest-physical address of the page directory that maps the first GiB.
pub const PD0_ADDR: u64 = 0x10_2000;

/// The supervisor binary the runtimes under test start: the workspace's
/// (`target/<profile>/cube-supervisor`, which `cargo test --workspace` builds), or
/// `$CUBE_SUPERVISOR`.
pub fn supervisor() -> PathBuf {
    cube_core::testing::supervisor_binary()
        .expect("the cube-supervisor binary (build it: cargo build -p cube-supervisor)")
}

/// The machine every test template uses.
pub fn machine() -> MachineConfig {
    MachineConfig {
        vcpus: 2,
        memory_bytes: GUEST_MEMORY,
        irqchip: true,
    }
}

/// A working set the guest touches after each start: none, so that a restored guest
/// writes nothing but its mailbox.
pub const NO_WORKING_SET: WorkingSet = WorkingSet {
    read_bytes: 0,
    write_bytes: 0,
};

/// A small working set, so restores exercise the guest's working-set pass cheaply.
pub const SMALL_WORKING_SET: WorkingSet = WorkingSet {
    read_bytes: 1 << 20,
    write_bytes: 256 << 10,
};

/// Whether the host has KVM; prints the skip line when it does not.
pub fn kvm_present() -> bool {
    if Path::new("/dev/kvm").exists() {
        true
    } else {
        eprintln!("skipped: /dev/kvm not present");
        false
    }
}

/// Creation options for a sandbox that ends with its handle.
pub const EPHEMERAL: CreateOptions = CreateOptions::new(true);
/// Creation options for a sandbox that outlives its handle.
pub const PERSISTENT: CreateOptions = CreateOptions::new(false);

/// One test's world: its own store, a runtime on it, and the supervisors it started.
pub struct TestEnv {
    dir: tempfile::TempDir,
    root: PathBuf,
    rt: Option<Runtime>,
    supervisor: PathBuf,
    pids: Vec<u32>,
}

impl TestEnv {
    /// A fresh store and runtime, or `None` (after printing why) on a host without KVM.
    pub fn new() -> Option<TestEnv> {
        if !kvm_present() {
            return None;
        }
        let dir = tempfile::TempDir::new().expect("temp dir");
        let root = dir.path().canonicalize().expect("canonical temp dir");
        let supervisor = supervisor();
        let mut env = TestEnv {
            dir,
            root,
            rt: None,
            supervisor,
            pids: Vec::new(),
        };
        env.open_runtime();
        Some(env)
    }

    fn open_runtime(&mut self) {
        let rt = Runtime::open(RuntimeConfig {
            store_root: self.root.clone(),
            pool_size: 0,
            network_pool_size: 0,
            supervisor: Some(self.supervisor.clone()),
        })
        .expect("open runtime");
        self.rt = Some(rt);
    }

    /// The runtime.
    pub fn rt(&self) -> &Runtime {
        self.rt.as_ref().expect("runtime is open")
    }

    /// Drops the runtime (as a process that exits would) and opens a new one on the
    /// same store.
    pub fn reopen_runtime(&mut self) {
        self.rt = None;
        self.open_runtime();
    }

    /// Drops the runtime without opening another.
    pub fn close_runtime(&mut self) {
        self.rt = None;
    }

    /// The store root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Builds the test-guest template `name` (2 vCPUs, 128 MiB, irqchip, no disk).
    pub fn template(&self, name: &str, working_set: WorkingSet) -> String {
        self.rt()
            .build_test_template(name, machine(), working_set, 0)
            .expect("build template");
        name.to_string()
    }

    /// Creates an ephemeral sandbox from template `template` and tracks its supervisor.
    pub fn create(&mut self, template: &str) -> Sandbox {
        self.create_with(template, EPHEMERAL)
    }

    /// Creates a sandbox from template `template` and tracks its supervisor.
    pub fn create_with(&mut self, template: &str, options: CreateOptions) -> Sandbox {
        let mut sb = self.rt().create(template, options).expect("create sandbox");
        self.track(&mut sb);
        sb
    }

    /// Creates an ephemeral sandbox from snapshot `id` and tracks its supervisor.
    pub fn create_from_snapshot(&mut self, id: &str) -> Sandbox {
        let mut sb = self
            .rt()
            .create_from_snapshot(id, EPHEMERAL)
            .expect("create from snapshot");
        self.track(&mut sb);
        sb
    }

    /// Records the supervisor of `sb` so that [`TestEnv::finish`] checks it exited.
    pub fn track(&mut self, sb: &mut Sandbox) -> u32 {
        let pid = sb.status().expect("status").pid;
        if !self.pids.contains(&pid) {
            self.pids.push(pid);
        }
        pid
    }

    /// Live supervisor processes tied to this test's store.
    pub fn live_supervisors(&self) -> Vec<u32> {
        let mut pids = supervisors_of_store(&self.supervisor, &self.root);
        pids.sort_unstable();
        pids
    }

    /// Asserts that the test left nothing behind: every supervisor it tracked and
    /// every supervisor tied to its store has exited, and the store holds no sandbox
    /// directory and no staging debris.
    pub fn finish(mut self) {
        self.rt = None;
        for &pid in &self.pids {
            assert!(
                wait_exit(pid, EXIT_WAIT),
                "supervisor {pid} of this test is still running"
            );
        }
        let deadline = Instant::now() + EXIT_WAIT;
        loop {
            let left = supervisors_of_store(&self.supervisor, &self.root);
            if left.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "supervisors still tied to {}: {left:?}",
                self.root.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let sandboxes = entries(&self.root.join("sandboxes"));
        assert!(
            sandboxes.is_empty(),
            "sandbox directories left in the store: {sandboxes:?}"
        );
        let tmp = entries(&self.root.join("tmp"));
        assert!(tmp.is_empty(), "debris left in the store's tmp: {tmp:?}");
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        // A failed test must not leave VMs running: end the supervisors it started
        // (only those, by pid). A passing test has already checked they are gone.
        if !std::thread::panicking() {
            return;
        }
        self.rt = None;
        let mut pids: HashSet<u32> = self.pids.iter().copied().collect();
        pids.extend(supervisors_of_store(&self.supervisor, &self.root));
        for pid in pids {
            if pid_alive(pid) && is_supervisor(pid, &self.supervisor) {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        }
    }
}

/// Names in directory `dir` (empty when it does not exist).
pub fn entries(dir: &Path) -> Vec<String> {
    match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .map(|e| {
                e.expect("dir entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Whether process `pid` exists and has not exited (a zombie has exited: supervisors
/// are re-parented to whatever reaps orphans here, which may be slow to).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or("X");
    !matches!(state, "Z" | "X")
}

/// Whether the thread whose `/proc/.../stat` line is `stat` is a kernel worker in its
/// thread group (PF_USER_WORKER: KVM's huge-page recovery), which runs no user code
/// and so holds what its process was started with.
pub fn user_worker(stat: &str) -> bool {
    let flags: u64 = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(6)?.parse().ok())
        .unwrap_or(0);
    flags & 0x4000 != 0
}

/// Waits until process `pid` has exited; false if it still runs after `timeout`.
pub fn wait_exit(pid: u32, timeout: Duration) -> bool {
    wait_until(timeout, || !pid_alive(pid))
}

/// Polls `condition` every few milliseconds until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn is_supervisor(pid: u32, exe: &Path) -> bool {
    let Ok(link) = std::fs::read_link(format!("/proc/{pid}/exe")) else {
        return false;
    };
    let exe = exe.canonicalize().unwrap_or_else(|_| exe.to_path_buf());
    // A binary rebuilt while the process runs reads as "<path> (deleted)".
    link.to_string_lossy()
        .starts_with(exe.to_string_lossy().as_ref())
}

/// Inodes of the unix sockets bound to a path under `root`.
fn sockets_under(root: &Path) -> HashSet<u64> {
    let root = root.to_string_lossy();
    let table = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let path = cols.get(7)?;
            if !path.starts_with(root.as_ref()) {
                return None;
            }
            cols.get(6)?.parse().ok()
        })
        .collect()
}

/// Live supervisor processes tied to the store at `root`: they map or hold open a
/// file there, or listen on a socket there.
pub fn supervisors_of_store(exe: &Path, root: &Path) -> Vec<u32> {
    let sockets = sockets_under(root);
    let root_str = root.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if !pid_alive(pid) || !is_supervisor(pid, exe) {
            continue;
        }
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
        let mut tied = maps.contains(&root_str);
        if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
            for fd in fds.flatten() {
                let Ok(target) = std::fs::read_link(fd.path()) else {
                    continue;
                };
                let target = target.to_string_lossy().into_owned();
                let socket_inode = target
                    .strip_prefix("socket:[")
                    .and_then(|s| s.strip_suffix(']'))
                    .and_then(|s| s.parse::<u64>().ok());
                if target.starts_with(&root_str)
                    || socket_inode.is_some_and(|i| sockets.contains(&i))
                {
                    tied = true;
                }
            }
        }
        if tied {
            found.push(pid);
        }
    }
    found
}

/// Reads `len` bytes of guest memory at `addr`, in requests the supervisor accepts.
pub fn read_guest(sb: &mut Sandbox, addr: u64, len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len as usize);
    let mut offset = 0;
    while offset < len {
        let n = (len - offset).min(READ_CHUNK);
        let chunk = sb
            .read_memory(addr + offset, n as u32)
            .expect("read guest memory");
        assert_eq!(chunk.len() as u64, n, "short read at {:#x}", addr + offset);
        out.extend_from_slice(&chunk);
        offset += n;
    }
    out
}

/// The little-endian u64 at `offset` of `bytes`.
pub fn u64_at(bytes: &[u8], offset: u64) -> u64 {
    let o = offset as usize;
    u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"))
}

/// The first word of each page of `bytes`: what the guest's dirty command writes.
pub fn page_words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(PAGE as usize)
        .map(|p| u64::from_le_bytes(p[..8].try_into().expect("8 bytes")))
        .collect()
}

/// The first words of `pages` pages of the guest's dirty area.
pub fn dirty_area_words(sb: &mut Sandbox, pages: u64) -> Vec<u64> {
    page_words(&read_guest(sb, DIRTY_AREA_ADDR, pages * PAGE))
}

/// What the guest's dirty command writes into the first `pages` pages: `pattern + i`.
pub fn pattern_words(pattern: u64, pages: u64) -> Vec<u64> {
    (0..pages).map(|i| pattern.wrapping_add(i)).collect()
}

/// Reads `len` bytes of file `path` at `offset`.
pub fn read_file_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path).expect("open file");
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, offset).expect("read file");
    buf
}

/// The little-endian u64 at `offset` of file `path`.
pub fn file_u64(path: &Path, offset: u64) -> u64 {
    u64_at(&read_file_at(path, offset, 8), 0)
}

/// A snapshot's memory file (guest RAM from address 0: test machines have one region).
pub fn memory_file(snapshot: &Snapshot) -> PathBuf {
    snapshot.dir.join("memory.bin")
}

/// Guest RAM as snapshot `snapshot`'s memory file holds it (without the seal page after
/// it, see [`cube_mem::memory_seal`]).
pub fn guest_image(snapshot: &Snapshot) -> Vec<u8> {
    let mut image = std::fs::read(memory_file(snapshot)).expect("read memory file");
    let guest = image.len() as u64 - cube_mem::SEAL_BYTES;
    image.truncate(guest as usize);
    image
}

/// The test guest's counter as the mailbox shows it.
pub fn counter(sb: &mut Sandbox) -> u64 {
    sb.status().expect("status").counter
}

/// Waits until the guest's counter passes `above`; returns the counter then.
pub fn wait_counter_above(sb: &mut Sandbox, above: u64) -> u64 {
    let mut last = 0;
    let grew = wait_until(Duration::from_secs(10), || {
        last = counter(sb);
        last > above
    });
    assert!(
        grew,
        "guest counter stuck at {last}, expected more than {above}"
    );
    last
}

/// An error and all its sources, as one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Pages (index from guest address 0) where `a` and `b` differ.
pub fn differing_pages(a: &[u8], b: &[u8]) -> Vec<u64> {
    assert_eq!(a.len(), b.len(), "images of different sizes");
    a.chunks_exact(PAGE as usize)
        .zip(b.chunks_exact(PAGE as usize))
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, _)| i as u64)
        .collect()
}

/// True (after saying why) where jails cannot run: not root, or no readable cgroup
/// hierarchy.
pub fn skip_jail() -> bool {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: jails need root (namespaces, mounts, cgroups)");
        return true;
    }
    if cube_jail::CgroupLayout::detect().is_err() {
        eprintln!("skipped: no cgroup hierarchy is readable");
        return true;
    }
    false
}

/// Runs `script` with `/bin/sh -c` through the agent: exit code, stdout, stderr.
pub fn sh(client: &cube_agent::client::Client, script: &str) -> (i32, String, String) {
    let out = client
        .exec(cube_agent::protocol::ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            ..cube_agent::protocol::ExecRequest::default()
        })
        .unwrap();
    (
        out.exit.code.unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// True (after saying why) where full-state jail tests cannot run: not root, no
/// readable cgroup hierarchy, no working CRIU, or no python3 on the host template.
pub fn skip_full_jail() -> bool {
    if skip_jail() {
        return true;
    }
    if let Err(e) = cube_jail::Criu::probe() {
        eprintln!("skipped: no working CRIU: {e}");
        return true;
    }
    if !Path::new("/usr/bin/python3").exists() {
        eprintln!("skipped: no /usr/bin/python3 on the host template");
        return true;
    }
    false
}

/// The value of the last expression of `code` in the agent's Python context "py"
/// (made on first use).
pub fn py(client: &cube_agent::client::Client, code: &str) -> String {
    if !client
        .list_contexts()
        .unwrap()
        .iter()
        .any(|c| c.name == "py")
    {
        client
            .create_context("py", cube_agent::protocol::Language::Python, None)
            .unwrap();
    }
    let r = client
        .run_code("py", code, Some(Duration::from_secs(30)))
        .unwrap();
    assert!(r.error.is_none(), "{code}: {:?}", r.error);
    r.value.unwrap_or_default()
}

/// Waits for the background flush of the snapshot (or hibernation checkpoint) in `dir`
/// to leave its marker.
pub fn wait_flushed(dir: &Path) {
    // The marker is made empty while the snapshot is staged and written by the flush.
    let boot = cube_storage::durable_marker::boot_id().unwrap();
    for _ in 0..1000 {
        if cube_storage::durable_marker::marked_durable(dir, &boot) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("snapshot {} was never flushed", dir.display());
}

/// What a handle racing a destroy got: its status, then its wake.
pub type RaceSeen = (
    Result<MachineStatus, SandboxError>,
    Result<(), SandboxError>,
);

/// Destroys `sb` while three other handles of it (attached through `rt`) ask for its
/// status and then wake it, starting 0, 2 and 4 ms in; returns what each got.
pub fn race_a_destroy(rt: &Runtime, sb: Sandbox) -> Vec<RaceSeen> {
    let id = sb.id().to_string();
    let mut others: Vec<Sandbox> = (0..3).map(|_| rt.attach(&id).unwrap()).collect();
    std::thread::scope(|s| {
        let racers: Vec<_> = others
            .iter_mut()
            .enumerate()
            .map(|(i, other)| {
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(i as u64 * 2));
                    (other.status().map(|st| st.status), other.wake())
                })
            })
            .collect();
        sb.destroy().unwrap();
        racers.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

/// The id of process `pid`'s thread named `name`.
pub fn thread_named(pid: u32, name: &str) -> i32 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .find_map(|task| {
            let task = task.ok()?;
            let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
            (comm.trim() == name).then(|| task.file_name().to_str()?.parse().ok())?
        })
        .unwrap_or_else(|| panic!("process {pid} has no thread {name}"))
}

/// Whether process `pid` may write no core file (its soft and hard limits are 0).
fn no_core_files(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/limits")).is_ok_and(|limits| {
        limits.lines().any(|l| {
            l.strip_prefix("Max core file size")
                .is_some_and(|rest| rest.split_whitespace().take(2).all(|v| v == "0"))
        })
    })
}

/// Makes the thread `pid` (a thread of a process, stopped in a system call) call
/// `nr` with zero arguments, as code running in it would; returns the signal that
/// ended the process.
pub fn inject_syscall(pid: i32, nr: libc::c_long) -> i32 {
    // SAFETY: plain ptrace/waitpid calls on a process this test owns (a supervisor it
    // started); `regs` is a live, correctly sized user_regs_struct for GETREGS/SETREGS.
    unsafe {
        // No core file of a VM's memory. A confined VM supervisor set its own limit to
        // 0; another uid's process takes CAP_SYS_RESOURCE to change, which a host's
        // root may lack.
        if !no_core_files(pid) {
            let none = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            assert_eq!(
                libc::prlimit(pid, libc::RLIMIT_CORE, &none, std::ptr::null_mut()),
                0
            );
        }
        assert_eq!(libc::ptrace(libc::PTRACE_SEIZE, pid, 0, 0), 0, "seize");
        // Stopped where a system call returns (`syscall`, 0f 05, lies just before): a
        // thread caught running its own code is let go and caught again.
        let mut status = 0;
        let mut regs: libc::user_regs_struct = std::mem::zeroed();
        for attempt in 0.. {
            assert_eq!(
                libc::ptrace(libc::PTRACE_INTERRUPT, pid, 0, 0),
                0,
                "interrupt"
            );
            assert_eq!(libc::waitpid(pid, &mut status, libc::__WALL), pid);
            assert!(libc::WIFSTOPPED(status), "status {status:#x}");
            assert_eq!(libc::ptrace(libc::PTRACE_GETREGS, pid, 0, &mut regs), 0);
            let word = libc::ptrace(libc::PTRACE_PEEKTEXT, pid, regs.rip - 2, 0);
            if word & 0xffff == 0x050f {
                break;
            }
            assert!(
                attempt < 1000,
                "thread {pid} never stopped in a system call"
            );
            assert_eq!(libc::ptrace(libc::PTRACE_CONT, pid, 0, 0), 0);
            std::thread::sleep(Duration::from_millis(1));
        }
        regs.rip -= 2;
        regs.rax = nr as u64;
        // No restart of the interrupted call on the way back.
        regs.orig_rax = u64::MAX;
        regs.rdi = 0;
        regs.rsi = 0;
        regs.rdx = 0;
        regs.r10 = 0;
        regs.r8 = 0;
        regs.r9 = 0;
        assert_eq!(libc::ptrace(libc::PTRACE_SETREGS, pid, 0, &regs), 0);
        assert_eq!(libc::ptrace(libc::PTRACE_CONT, pid, 0, 0), 0);
        // Were the call allowed, the thread would just go on: give up after a while.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match libc::waitpid(pid, &mut status, libc::__WALL | libc::WNOHANG) {
                0 => {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "system call {nr} did not end the process"
                    );
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                waited => assert_eq!(waited, pid),
            }
            if libc::WIFSIGNALED(status) {
                return libc::WTERMSIG(status);
            }
            assert!(
                !libc::WIFEXITED(status),
                "exited with {}",
                libc::WEXITSTATUS(status)
            );
            // Another stop (a signal on its way): let it through.
            let sig = if libc::WIFSTOPPED(status) {
                libc::WSTOPSIG(status)
            } else {
                0
            };
            let pass = if sig == libc::SIGTRAP || sig == libc::SIGSTOP {
                0
            } else {
                sig
            };
            libc::ptrace(libc::PTRACE_CONT, pid, 0, pass as libc::c_long);
        }
    }
}

/// How many seccomp filters thread `tid` of process `pid` is under.
pub fn seccomp_filters(pid: u32, tid: i32) -> u32 {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("Seccomp_filters:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}
