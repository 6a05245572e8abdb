//! The priority pool refills start supervisors at, and the way back to normal once a
//! supervisor holds a sandbox.

/// The nice value pool refills start supervisors at: on a host with few cores, a
/// supervisor warming up (exec, KVM, a VM or jail started ahead) competes with the
/// creates the pool serves, and should lose. [`normal_priority`] undoes it once the
/// supervisor holds a sandbox.
pub const REFILL_NICE: i32 = 10;

/// Puts every thread of process `pid` back at nice 0 (the pool started it at
/// [`REFILL_NICE`]; a thread's nice value is its own, so each is set).
pub fn normal_priority(pid: u32) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return;
    };
    for task in tasks.flatten() {
        if let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<u32>().ok())
        {
            // SAFETY: setpriority takes integers only.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, 0) };
        }
    }
}
