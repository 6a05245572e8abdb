//! Giving up root: the capability bounding set, ambient set, the switch to the sandbox's
//! unprivileged uid/gid, and no_new_privs.
//!
//! The functions named `*_in_child` run in the freshly cloned sandbox process before
//! `execve`, where the parent may have had other threads: they only issue raw system
//! calls, never allocate, and report failures as an [`Errno`].

use std::fs;

use nix::errno::Errno;

/// Errors from the parent-side preparation of the privilege drop.
#[derive(Debug, thiserror::Error)]
pub enum CapabilityError {
    /// `/proc/sys/kernel/cap_last_cap` could not be read.
    #[error("cannot read /proc/sys/kernel/cap_last_cap")]
    LastCap(#[source] std::io::Error),
    /// `/proc/sys/kernel/cap_last_cap` did not hold a small number.
    #[error("malformed cap_last_cap: {0:?}")]
    MalformedLastCap(String),
    /// uid or gid 0 was asked for: a sandbox never runs as root.
    #[error("sandbox processes may not run as uid or gid 0")]
    RootIdentity,
}

/// The identity sandbox processes run as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Real, effective and saved uid.
    pub uid: u32,
    /// Real, effective and saved gid, and the only supplementary group.
    pub gid: u32,
}

impl Identity {
    /// Refuses root.
    pub fn validate(&self) -> Result<(), CapabilityError> {
        if self.uid == 0 || self.gid == 0 {
            return Err(CapabilityError::RootIdentity);
        }
        Ok(())
    }
}

/// The highest capability number the running kernel knows.
pub fn last_cap() -> Result<u32, CapabilityError> {
    let text =
        fs::read_to_string("/proc/sys/kernel/cap_last_cap").map_err(CapabilityError::LastCap)?;
    text.trim()
        .parse::<u32>()
        .ok()
        .filter(|n| *n < 64)
        .ok_or(CapabilityError::MalformedLastCap(text))
}

/// Drops every capability up to `last_cap` but those in `keep` (bit N = capability N)
/// from the calling thread's bounding set, and empties its ambient set. Raw system
/// calls only: safe in a forked child or a signal handler. Needs CAP_SETPCAP.
pub fn keep_bounding_and_clear_ambient(last_cap: u32, keep: u64) -> Result<(), Errno> {
    for cap in 0..=last_cap.min(63) {
        if keep & (1 << cap) != 0 {
            continue;
        }
        // SAFETY: prctl with integer arguments only; no memory is passed.
        let r = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        if r != 0 {
            return Err(Errno::last());
        }
    }
    // SAFETY: integer-only prctl.
    let r = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if r != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Sets the supplementary groups to `gid` alone, then gid, then uid. Leaving uid 0
/// clears the effective and permitted capability sets (no SECBIT_KEEP_CAPS is set).
pub fn switch_identity_in_child(id: Identity) -> Result<(), Errno> {
    // Raw syscalls: glibc's setgroups/set*id wrappers broadcast the change to every
    // thread it believes exists (a signal protocol under a lock); in a child cloned from
    // a multi-threaded parent those threads do not exist and the wrapper hangs.
    let groups = [id.gid as libc::gid_t];
    // SAFETY: `groups` is a live one-element array and its length is passed.
    if unsafe { libc::syscall(libc::SYS_setgroups, 1, groups.as_ptr()) } != 0 {
        return Err(Errno::last());
    }
    // SAFETY: integer arguments only.
    if unsafe { libc::syscall(libc::SYS_setresgid, id.gid, id.gid, id.gid) } != 0 {
        return Err(Errno::last());
    }
    // SAFETY: integer arguments only.
    if unsafe { libc::syscall(libc::SYS_setresuid, id.uid, id.uid, id.uid) } != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// Clears the effective, permitted and inheritable sets explicitly, so that nothing is
/// left even if the uid switch kept something.
pub fn clear_sets_in_child() -> Result<(), Errno> {
    keep_only(0)
}

/// Leaves the calling thread `keep` (bit N = capability N) as its effective and
/// permitted sets and an empty inheritable set. `keep` must be within the permitted
/// set. Raw system call only: safe in a forked child or a signal handler.
pub fn keep_only(keep: u64) -> Result<(), Errno> {
    set_sets(keep, 0)
}

/// capset: `keep` effective and permitted, `inheritable` inheritable.
fn set_sets(keep: u64, inheritable: u64) -> Result<(), Errno> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let (low, high) = (keep as u32, (keep >> 32) as u32);
    let (inh_low, inh_high) = (inheritable as u32, (inheritable >> 32) as u32);
    let data = [
        CapData {
            effective: low,
            permitted: low,
            inheritable: inh_low,
        },
        CapData {
            effective: high,
            permitted: high,
            inheritable: inh_high,
        },
    ];
    // SAFETY: header and data are live, correctly laid out (version 3 takes two data
    // elements) and outlive the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    };
    if r != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Capability number of CAP_SYS_CHROOT.
pub const CAP_SYS_CHROOT: u32 = 18;

/// Asks the kernel to keep the permitted set through the coming switch away from uid 0
/// (`SECBIT_KEEP_CAPS`; the effective set is still cleared). Raw system call only.
pub fn keep_permitted_through_uid_switch_in_child() -> Result<(), Errno> {
    // SAFETY: integer-only prctl.
    if unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) } != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// After a uid switch that kept the permitted set: leaves the calling thread `keep`
/// (bit N = capability N) as its effective, permitted, inheritable and ambient sets,
/// so that exactly those survive the coming exec as a non-root uid, and turns
/// `SECBIT_KEEP_CAPS` off again. `keep` must be within the permitted and bounding sets.
/// Raw system calls only: safe in a forked child.
pub fn keep_through_exec_in_child(keep: u64) -> Result<(), Errno> {
    set_sets(keep, keep)?;
    for cap in 0..64u32 {
        if keep & (1 << cap) == 0 {
            continue;
        }
        // SAFETY: integer-only prctl.
        let r = unsafe {
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong,
                cap as libc::c_ulong,
                0,
                0,
            )
        };
        if r != 0 {
            return Err(Errno::last());
        }
    }
    stop_keeping_permitted_in_child()
}

/// Turns `SECBIT_KEEP_CAPS` off again after the uid switch it was set for (see
/// [`keep_permitted_through_uid_switch_in_child`]). Raw system call only.
pub fn stop_keeping_permitted_in_child() -> Result<(), Errno> {
    // SAFETY: integer-only prctl.
    if unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0) } != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Sets no_new_privs: execve can no longer grant privileges (setuid bits, file
/// capabilities), and seccomp filters may be installed without CAP_SYS_ADMIN.
pub fn set_no_new_privs_in_child() -> Result<(), Errno> {
    // SAFETY: integer-only prctl.
    let r = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    if r != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_last_cap() {
        let n = last_cap().unwrap();
        assert!(
            n >= 36,
            "CAP_BLOCK_SUSPEND (36) exists since Linux 3.5, got {n}"
        );
    }

    #[test]
    fn refuses_root_identity() {
        assert!(Identity { uid: 0, gid: 1 }.validate().is_err());
        assert!(Identity { uid: 1, gid: 0 }.validate().is_err());
        assert!(Identity {
            uid: 65534,
            gid: 65534
        }
        .validate()
        .is_ok());
    }
}
