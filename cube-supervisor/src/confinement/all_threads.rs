//! Giving up capabilities on every thread of this process at once.
//!
//! Capability sets, uids and gids, and no_new_privs belong to threads, not to
//! processes: `capset`, `PR_CAPBSET_DROP` and the raw `setresuid` change only the
//! calling thread. A supervisor confines itself once
//! its sandbox is set up, when vCPU, device and helper threads already run, so each
//! thread must drop them itself. [`restrict_all_threads`] does it the way libcap's psx
//! does: it signals every thread, whose handler applies the prepared sets with raw
//! system calls (async-signal-safe), waits for each to answer, lists the threads again
//! for any started meanwhile, and finally reads every thread's
//! `/proc/self/task/TID/status` to prove the result. Kernel workers that live in the
//! process's thread group (KVM's huge-page recovery thread) run no user code and are
//! left as they are.

use std::collections::BTreeSet;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cube_jail::capabilities::Identity;

/// How long the threads get to answer the signal.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// Times the broadcaster yields the CPU to the signalled threads before it starts
/// checking for exited ones and sleeping.
const ANSWER_YIELDS: u32 = 1000;

/// Rounds of listing threads before giving up on a process that keeps starting them.
const MAX_ROUNDS: usize = 8;

/// Why the capability sets could not be applied to every thread.
#[derive(Debug, thiserror::Error)]
pub enum AllThreadsError {
    /// The thread list or a thread's status could not be read.
    #[error("reading {0}")]
    Proc(String, #[source] std::io::Error),
    /// The handler could not be installed.
    #[error("installing the confinement signal handler")]
    Handler(#[source] std::io::Error),
    /// A system call of the drop failed on some thread.
    #[error("dropping capabilities failed on a thread (errno {0})")]
    Drop(i32),
    /// Threads did not answer the signal in time (blocked it, or stuck in the kernel):
    /// each named with its state and blocked-signal mask.
    #[error("thread(s) did not answer the confinement signal within {ANSWER_TIMEOUT:?}: {0}")]
    NoAnswer(String),
    /// Threads kept appearing faster than they were confined.
    #[error("threads kept starting while the process was being confined")]
    Churn,
    /// A thread's status shows more than was asked for after the drop.
    #[error("thread {tid} still has {field} {found} after the drop")]
    Unconfined {
        /// The thread.
        tid: u32,
        /// The status line (CapEff, CapPrm, CapInh, CapBnd, CapAmb, NoNewPrivs, Uid,
        /// Gid).
        field: &'static str,
        /// What it showed.
        found: String,
    },
}

/// Capabilities to keep (bit N = capability N); everything else goes.
static KEEP: AtomicU64 = AtomicU64::new(0);
/// The highest capability number the kernel knows.
static LAST_CAP: AtomicU32 = AtomicU32::new(0);
/// The identity each thread takes ([`NO_IDENTITY`]: it keeps its own), as uid << 32
/// | gid.
static IDENTITY: AtomicU64 = AtomicU64::new(NO_IDENTITY);
/// [`IDENTITY`] when the threads keep their uid and gid.
const NO_IDENTITY: u64 = u64::MAX;
/// The Landlock ruleset each thread applies to itself (-1: none); see
/// [`super::filesystem`]. The descriptor stays open while a broadcast uses it.
static LANDLOCK: AtomicI32 = AtomicI32::new(-1);
/// Handlers run since the last reset.
static ANSWERED: AtomicUsize = AtomicUsize::new(0);
/// The threads whose handlers ran since the last reset, in order (the first
/// [`MAX_ANSWERS`]; a process with more threads is refused).
static ANSWERS: [AtomicU32; MAX_ANSWERS] = [const { AtomicU32::new(0) }; MAX_ANSWERS];
/// Threads one round can confine.
const MAX_ANSWERS: usize = 1024;
/// The first errno a handler met (0: none).
static FAILED: AtomicI32 = AtomicI32::new(0);
/// One broadcast at a time: the statics above belong to it.
static BROADCAST: Mutex<()> = Mutex::new(());

/// The signal the broadcast uses: a real-time one no other part of Cube uses (the vCPU
/// kick is `SIGRTMIN + 2`).
fn confine_signal() -> libc::c_int {
    libc::SIGRTMIN() + 6
}

extern "C" fn on_confine_signal(_signal: libc::c_int) {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's
    // life; the handler restores it so the interrupted code sees its own errno.
    let errno = unsafe { *libc::__errno_location() };
    if let Err(e) = restrict_this_thread(
        KEEP.load(Ordering::SeqCst),
        LAST_CAP.load(Ordering::SeqCst),
        LANDLOCK.load(Ordering::SeqCst),
        unpack_identity(IDENTITY.load(Ordering::SeqCst)),
    ) {
        let _ = FAILED.compare_exchange(0, e, Ordering::SeqCst, Ordering::SeqCst);
    }
    let slot = ANSWERED.fetch_add(1, Ordering::SeqCst);
    if let Some(answer) = ANSWERS.get(slot) {
        answer.store(gettid(), Ordering::SeqCst);
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

fn pack_identity(identity: Option<Identity>) -> u64 {
    identity.map_or(NO_IDENTITY, |id| {
        u64::from(id.uid) << 32 | u64::from(id.gid)
    })
}

fn unpack_identity(packed: u64) -> Option<Identity> {
    (packed != NO_IDENTITY).then_some(Identity {
        uid: (packed >> 32) as u32,
        gid: packed as u32,
    })
}

/// Sets no_new_privs, enters the Landlock ruleset `landlock` (unless -1), empties the
/// bounding set but for `keep`, takes `identity` if given, clears the ambient and
/// inheritable sets and leaves `keep` as the effective and permitted sets, on the
/// calling thread. Raw system calls only, no allocation: it runs in a signal handler.
fn restrict_this_thread(
    keep: u64,
    last_cap: u32,
    landlock: i32,
    identity: Option<Identity>,
) -> Result<(), i32> {
    use cube_jail::capabilities::{
        keep_bounding_and_clear_ambient, keep_only, keep_permitted_through_uid_switch_in_child,
        set_no_new_privs_in_child, stop_keeping_permitted_in_child, switch_identity_in_child,
    };
    set_no_new_privs_in_child()
        // Landlock asks for no_new_privs (or CAP_SYS_ADMIN), set just before.
        .map_err(|e| e as i32)
        .and_then(|()| enter_landlock(landlock))
        // The bounding set first: dropping from it needs CAP_SETPCAP, which `keep_only`
        // may take away.
        .and_then(|()| keep_bounding_and_clear_ambient(last_cap, keep).map_err(|e| e as i32))
        .and_then(|()| match identity {
            None => Ok(()),
            Some(id) => {
                // Leaving uid 0 empties the permitted set unless asked to keep it (the
                // effective set goes either way: `keep_only` raises it again).
                if keep != 0 {
                    keep_permitted_through_uid_switch_in_child().map_err(|e| e as i32)?;
                }
                switch_identity_in_child(id).map_err(|e| e as i32)
            }
        })
        .and_then(|()| keep_only(keep).map_err(|e| e as i32))
        .and_then(|()| {
            if identity.is_some() && keep != 0 {
                stop_keeping_permitted_in_child().map_err(|e| e as i32)
            } else {
                Ok(())
            }
        })
}

/// Restricts the calling thread to Landlock ruleset `fd` (nothing for -1).
fn enter_landlock(fd: i32) -> Result<(), i32> {
    if fd < 0 {
        return Ok(());
    }
    // SAFETY: landlock_restrict_self takes a ruleset descriptor and flags (0); a bad
    // descriptor is an error, never undefined behaviour.
    let r = unsafe { libc::syscall(libc::SYS_landlock_restrict_self, fd, 0u32) };
    if r == 0 {
        Ok(())
    } else {
        // SAFETY: __errno_location returns this thread's errno slot.
        Err(unsafe { *libc::__errno_location() })
    }
}

/// `PF_USER_WORKER` (include/linux/sched.h, 6.4+): a kernel worker in a user process's
/// thread group, such as KVM's `kvm-nx-lpage-recovery`. It runs only kernel code, makes
/// no system calls and blocks every signal, so there is nothing to confine in it.
const PF_USER_WORKER: u64 = 0x0000_4000;

/// Whether thread `tid` of this process is a kernel worker (see [`PF_USER_WORKER`]).
fn is_kernel_worker(tid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")) else {
        return false;
    };
    // The name may hold spaces and parentheses: the fields start after the last ')'.
    // Then: state, ppid, pgrp, session, tty_nr, tpgid, flags.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(6))
        .and_then(|flags| flags.parse::<u64>().ok())
        .is_some_and(|flags| flags & PF_USER_WORKER != 0)
}

/// The threads of this process that run user code (kernel workers left out).
fn thread_ids() -> Result<BTreeSet<u32>, AllThreadsError> {
    Ok(all_thread_ids()?
        .into_iter()
        .filter(|tid| !is_kernel_worker(*tid))
        .collect())
}

fn all_thread_ids() -> Result<BTreeSet<u32>, AllThreadsError> {
    let dir = std::fs::read_dir("/proc/self/task")
        .map_err(|e| AllThreadsError::Proc("/proc/self/task".into(), e))?;
    let mut tids = BTreeSet::new();
    for entry in dir {
        let entry = entry.map_err(|e| AllThreadsError::Proc("/proc/self/task".into(), e))?;
        if let Some(tid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) {
            tids.insert(tid);
        }
    }
    Ok(tids)
}

fn gettid() -> u32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() as u32 }
}

/// A thread's name, state and blocked signals, for an error message.
fn describe_thread(tid: u32) -> String {
    let status =
        std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap_or_default();
    let field = |name| status_field(&status, name).unwrap_or("?");
    format!(
        "{tid} {} ({}, blocked {})",
        field("Name"),
        field("State"),
        field("SigBlk")
    )
}

fn install_handler() -> Result<(), AllThreadsError> {
    // SAFETY: a zeroed sigaction is a valid starting point; the handler only issues
    // raw system calls and atomic operations (async-signal-safe). SA_RESTART: the
    // threads' interrupted reads and waits carry on.
    let r = unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_confine_signal as *const () as usize;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(confine_signal(), &action, std::ptr::null_mut())
    };
    if r != 0 {
        return Err(AllThreadsError::Handler(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// The threads that have answered since the last reset.
fn answered() -> BTreeSet<u32> {
    let n = ANSWERED.load(Ordering::SeqCst).min(MAX_ANSWERS);
    ANSWERS[..n]
        .iter()
        .map(|a| a.load(Ordering::SeqCst))
        .filter(|tid| *tid != 0)
        .collect()
}

/// Signals `tids` and waits until every one that still exists has answered.
fn signal_and_wait(tids: &BTreeSet<u32>) -> Result<(), AllThreadsError> {
    if tids.len() > MAX_ANSWERS {
        return Err(AllThreadsError::Churn);
    }
    for answer in &ANSWERS {
        answer.store(0, Ordering::SeqCst);
    }
    ANSWERED.store(0, Ordering::SeqCst);
    let pid = std::process::id() as libc::pid_t;
    let mut sent = BTreeSet::new();
    for &tid in tids {
        // SAFETY: tgkill with integer arguments; a thread that has exited gives ESRCH.
        let r =
            unsafe { libc::syscall(libc::SYS_tgkill, pid, tid as libc::pid_t, confine_signal()) };
        if r == 0 {
            sent.insert(tid);
        }
    }
    let deadline = Instant::now() + ANSWER_TIMEOUT;
    let mut yields = 0;
    loop {
        let answered = answered();
        if sent.is_subset(&answered) {
            break;
        }
        // The threads answer within microseconds once they run: give them the CPU
        // first (this is on the create path), and only then look for exited ones
        // and sleep between looks.
        if yields < ANSWER_YIELDS {
            yields += 1;
            std::thread::yield_now();
            continue;
        }
        // Threads that exited before answering will never answer.
        let alive = all_thread_ids()?;
        let waiting: Vec<u32> = sent
            .iter()
            .filter(|t| alive.contains(t) && !answered.contains(t))
            .copied()
            .collect();
        if waiting.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            let named: Vec<String> = waiting.into_iter().map(describe_thread).collect();
            return Err(AllThreadsError::NoAnswer(named.join("; ")));
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    match FAILED.load(Ordering::SeqCst) {
        0 => Ok(()),
        errno => Err(AllThreadsError::Drop(errno)),
    }
}

/// Leaves every thread of this process with the capabilities in `keep` (bit N =
/// capability N) as its effective, permitted and bounding sets, none inheritable or
/// ambient, no_new_privs set, running as `identity` if given (its uid and gid, its gid
/// the only group), and in Landlock ruleset `landlock` if given; then checks every
/// thread's status says so (capabilities, ids and no_new_privs: Landlock shows in no
/// status file).
///
/// A thread that holds no more than `keep` already is not interrupted: it was confined
/// ahead ([`restrict_threads_named`], which gave it no file system at all) or started by
/// a confined thread, whose ruleset it inherited.
pub fn restrict_all_threads(
    keep: u64,
    last_cap: u32,
    landlock: Option<BorrowedFd<'_>>,
    identity: Option<Identity>,
) -> Result<(), AllThreadsError> {
    let _one = BROADCAST.lock().unwrap_or_else(|e| e.into_inner());
    let landlock = landlock.map_or(-1, |fd| fd.as_raw_fd());
    prepare(keep, last_cap, landlock, identity)?;
    // This thread first: threads it starts from now on inherit the sets.
    let result = restrict_this_thread(keep, last_cap, landlock, identity)
        .map_err(AllThreadsError::Drop)
        .and_then(|()| restrict_other_threads(keep, identity));
    LANDLOCK.store(-1, Ordering::SeqCst);
    result
}

/// [`restrict_all_threads`] past the calling thread, with the handler prepared.
fn restrict_other_threads(keep: u64, identity: Option<Identity>) -> Result<(), AllThreadsError> {
    let mut done: BTreeSet<u32> = [gettid()].into();
    for _ in 0..MAX_ROUNDS {
        // A thread not yet confined may have started others since the last listing.
        // One that holds no more than `keep` already (a vCPU thread confined ahead,
        // see `restrict_threads_named`) is not interrupted again.
        let pending: BTreeSet<u32> = thread_ids()?
            .difference(&done)
            .copied()
            .filter(|tid| !already_within(*tid, keep, identity))
            .collect();
        if pending.is_empty() {
            return verify_all_threads(keep, identity);
        }
        signal_and_wait(&pending)?;
        done.extend(pending);
    }
    Err(AllThreadsError::Churn)
}

/// Leaves the threads whose name starts with `prefix` with the capabilities in `keep`,
/// no_new_privs and Landlock ruleset `landlock` if given, as [`restrict_all_threads`]
/// does for all; returns how many. Threads that run no privileged code (vCPU threads)
/// can give up everything while they are idle, before the sandbox they will run is
/// known, so that confining the whole process later need not interrupt them while
/// they run a guest.
pub fn restrict_threads_named(
    prefix: &str,
    keep: u64,
    last_cap: u32,
    landlock: Option<BorrowedFd<'_>>,
    identity: Option<Identity>,
) -> Result<usize, AllThreadsError> {
    let _one = BROADCAST.lock().unwrap_or_else(|e| e.into_inner());
    let landlock = landlock.map_or(-1, |fd| fd.as_raw_fd());
    prepare(keep, last_cap, landlock, identity)?;
    let named: BTreeSet<u32> = thread_ids()?
        .into_iter()
        .filter(|tid| {
            std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
                .is_ok_and(|name| name.starts_with(prefix))
        })
        .collect();
    if named.contains(&gettid()) {
        restrict_this_thread(keep, last_cap, landlock, identity).map_err(AllThreadsError::Drop)?;
    }
    let others: BTreeSet<u32> = named.iter().copied().filter(|t| *t != gettid()).collect();
    let answered = signal_and_wait(&others);
    LANDLOCK.store(-1, Ordering::SeqCst);
    answered?;
    Ok(named.len())
}

/// Sets what the handler applies and installs it.
fn prepare(
    keep: u64,
    last_cap: u32,
    landlock: i32,
    identity: Option<Identity>,
) -> Result<(), AllThreadsError> {
    KEEP.store(keep, Ordering::SeqCst);
    LAST_CAP.store(last_cap, Ordering::SeqCst);
    LANDLOCK.store(landlock, Ordering::SeqCst);
    IDENTITY.store(pack_identity(identity), Ordering::SeqCst);
    FAILED.store(0, Ordering::SeqCst);
    install_handler()
}

/// Whether thread `tid` holds no more than `keep`, with no_new_privs set, as
/// `identity` if given.
fn already_within(tid: u32, keep: u64, identity: Option<Identity>) -> bool {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/status"))
        .is_ok_and(|status| check_status(tid, &status, keep, identity).is_ok())
}

/// The calling thread's permitted capabilities: what it can keep.
pub fn held_capabilities() -> Result<u64, AllThreadsError> {
    let path = "/proc/thread-self/status";
    let status =
        std::fs::read_to_string(path).map_err(|e| AllThreadsError::Proc(path.into(), e))?;
    status_field(&status, "CapPrm")
        .and_then(|v| u64::from_str_radix(v, 16).ok())
        .ok_or_else(|| {
            AllThreadsError::Proc(
                path.into(),
                std::io::Error::new(std::io::ErrorKind::InvalidData, "no CapPrm line"),
            )
        })
}

/// Reads every thread's status and checks it holds no capability beyond `keep`, has
/// no_new_privs set and runs as `identity` if given.
pub fn verify_all_threads(keep: u64, identity: Option<Identity>) -> Result<(), AllThreadsError> {
    for tid in thread_ids()? {
        let path = format!("/proc/self/task/{tid}/status");
        let status = match std::fs::read_to_string(&path) {
            Ok(s) => s,
            Err(e) if thread_exited(&e) => continue,
            Err(e) => return Err(AllThreadsError::Proc(path, e)),
        };
        check_status(tid, &status, keep, identity)?;
    }
    Ok(())
}

/// Whether reading a thread's `/proc` file failed because the thread has exited since
/// the listing: before the open (ENOENT) or between the open and the read (ESRCH,
/// which CI met once: a supervisor refused its sandbox over a thread that had ended).
fn thread_exited(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

/// Checks one thread's `/proc/.../status` text against `keep` and `identity`.
fn check_status(
    tid: u32,
    status: &str,
    keep: u64,
    identity: Option<Identity>,
) -> Result<(), AllThreadsError> {
    let expected: [(&'static str, u64); 5] = [
        ("CapEff", keep),
        ("CapPrm", keep),
        ("CapBnd", keep),
        ("CapInh", 0),
        ("CapAmb", 0),
    ];
    for (field, most) in expected {
        let found = status_field(status, field).unwrap_or("");
        // Less than `keep` is fine (a thread confined further ahead).
        if u64::from_str_radix(found, 16).map_or(true, |set| set & !most != 0) {
            return Err(AllThreadsError::Unconfined {
                tid,
                field,
                found: found.to_string(),
            });
        }
    }
    let nnp = status_field(status, "NoNewPrivs").unwrap_or("");
    if nnp != "1" {
        return Err(AllThreadsError::Unconfined {
            tid,
            field: "NoNewPrivs",
            found: nnp.to_string(),
        });
    }
    if let Some(id) = identity {
        // Real, effective, saved and file-system ids alike.
        for (field, expected) in [("Uid", id.uid), ("Gid", id.gid)] {
            let found = status_field(status, field).unwrap_or("");
            let ids: Vec<&str> = found.split_whitespace().collect();
            if ids.len() != 4 || ids.iter().any(|v| v.parse() != Ok(expected)) {
                return Err(AllThreadsError::Unconfined {
                    tid,
                    field,
                    found: found.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// The value of a `Name:\tvalue` line of a status file.
pub fn status_field<'a>(status: &'a str, name: &str) -> Option<&'a str> {
    status.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key == name).then_some(value.trim())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tvcpu0\nNoNewPrivs:\t1\nSeccomp:\t2\nCapInh:\t0000000000000000\n\
                          CapPrm:\t0000000000003000\nCapEff:\t0000000000003000\n\
                          CapBnd:\t0000000000003000\nCapAmb:\t0000000000000000\n";

    #[test]
    fn a_thread_gone_before_or_during_the_read_counts_as_exited() {
        use std::io::Error;
        assert!(thread_exited(&Error::from_raw_os_error(libc::ENOENT)));
        assert!(thread_exited(&Error::from_raw_os_error(libc::ESRCH)));
        assert!(!thread_exited(&Error::from_raw_os_error(libc::EACCES)));
    }

    #[test]
    fn a_status_matching_the_kept_set_or_less_passes() {
        check_status(7, STATUS, 0x3000, None).unwrap();
        // A thread confined further ahead (a vCPU thread) holds less.
        check_status(7, STATUS, 0x7000, None).unwrap();
        assert_eq!(status_field(STATUS, "Seccomp"), Some("2"));
    }

    #[test]
    fn a_status_with_more_than_was_kept_names_the_field() {
        let err = check_status(7, STATUS, 0x1000, None).unwrap_err();
        assert!(
            matches!(
                err,
                AllThreadsError::Unconfined {
                    tid: 7,
                    field: "CapEff",
                    ..
                }
            ),
            "{err}"
        );
        let nnp_off = STATUS.replace("NoNewPrivs:\t1", "NoNewPrivs:\t0");
        let err = check_status(7, &nnp_off, 0x3000, None).unwrap_err();
        assert!(matches!(
            err,
            AllThreadsError::Unconfined {
                field: "NoNewPrivs",
                ..
            }
        ));
    }

    #[test]
    fn a_status_as_another_uid_or_gid_than_asked_names_the_field() {
        let id = Identity {
            uid: 1_879_048_200,
            gid: 1_879_048_191,
        };
        let ids = "Uid:\t1879048200\t1879048200\t1879048200\t1879048200\n\
                   Gid:\t1879048191\t1879048191\t1879048191\t1879048191\n";
        let as_id = format!("{STATUS}{ids}");
        check_status(7, &as_id, 0x3000, Some(id)).unwrap();
        assert_eq!(unpack_identity(pack_identity(Some(id))), Some(id));
        assert_eq!(unpack_identity(pack_identity(None)), None);
        // A saved uid still 0 could take root back.
        let saved_root = as_id.replace(
            "Uid:\t1879048200\t1879048200\t1879048200\t1879048200",
            "Uid:\t1879048200\t1879048200\t0\t1879048200",
        );
        let err = check_status(7, &saved_root, 0x3000, Some(id)).unwrap_err();
        assert!(
            matches!(err, AllThreadsError::Unconfined { field: "Uid", .. }),
            "{err}"
        );
        let err = check_status(7, STATUS, 0x3000, Some(id)).unwrap_err();
        assert!(
            matches!(err, AllThreadsError::Unconfined { field: "Uid", .. }),
            "{err}"
        );
        let other_gid = as_id.replace("Gid:\t1879048191", "Gid:\t0");
        let err = check_status(7, &other_gid, 0x3000, Some(id)).unwrap_err();
        assert!(
            matches!(err, AllThreadsError::Unconfined { field: "Gid", .. }),
            "{err}"
        );
    }
}
