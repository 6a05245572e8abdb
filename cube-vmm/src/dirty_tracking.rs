//! Which mechanism finds the pages a guest wrote, chosen once per process by probing
//! the host, and built for one machine.
//!
//! KVM's dirty log is preferred: it sees exactly the guest's writes at ~0.05 ms per
//! collect. Where it is missing, userfaultfd write-protect with `PAGEMAP_SCAN` sees
//! them too (KVM's writes go through the host page tables), and soft-dirty is the last
//! resort. The VMM's own writes are always ORed in (see `CombinedTracker`).

use std::sync::OnceLock;

use cube_mem::dirty::{
    CombinedTracker, DirtyError, DirtyTracker, DirtyTrackerKind, KvmDirtyLog, SoftDirty,
    TrackerSupport, UffdWriteProtect,
};
use cube_mem::GuestMemory;

use crate::vstate::vm::Vm;

/// Environment variable forcing a mechanism: `kvm`, `uffd` or `soft-dirty`.
pub const TRACKER_ENV: &str = "CUBE_DIRTY_TRACKER";

/// Why no tracker could be set up.
#[derive(Debug, thiserror::Error)]
pub enum TrackingError {
    /// No mechanism works on this host.
    #[error("No dirty-page tracking works on this host (KVM dirty log, userfaultfd write-protect and soft-dirty all failed)")]
    Unsupported,
    /// The forced mechanism is unknown.
    #[error("{TRACKER_ENV}={0:?} is not one of kvm, uffd, soft-dirty")]
    UnknownOverride(String),
    /// The mechanism failed to start.
    #[error("Starting dirty-page tracking")]
    Start(#[from] DirtyError),
}

fn support() -> TrackerSupport {
    static SUPPORT: OnceLock<TrackerSupport> = OnceLock::new();
    *SUPPORT.get_or_init(cube_mem::dirty::probe)
}

/// Probes the host now so that the first machine does not pay for it.
pub fn warm_up() {
    let _ = support();
}

/// The mechanism machines in this process use.
pub fn chosen_kind() -> Result<DirtyTrackerKind, TrackingError> {
    if let Ok(forced) = std::env::var(TRACKER_ENV) {
        return match forced.as_str() {
            "kvm" => Ok(DirtyTrackerKind::KvmDirtyLog),
            "uffd" => Ok(DirtyTrackerKind::UffdWriteProtect),
            "soft-dirty" => Ok(DirtyTrackerKind::SoftDirty),
            other => Err(TrackingError::UnknownOverride(other.to_string())),
        };
    }
    let s = support();
    if s.kvm_dirty_log {
        Ok(DirtyTrackerKind::KvmDirtyLog)
    } else if s.uffd_wp {
        Ok(DirtyTrackerKind::UffdWriteProtect)
    } else if s.soft_dirty {
        Ok(DirtyTrackerKind::SoftDirty)
    } else {
        Err(TrackingError::Unsupported)
    }
}

/// Starts tracking `memory` of `vm` with `kind`, joined with the VMM's own writes
/// (including those made before this call, such as loading the guest).
pub fn start(
    kind: DirtyTrackerKind,
    vm: &Vm,
    memory: &GuestMemory,
) -> Result<CombinedTracker, TrackingError> {
    let mut primary: Box<dyn DirtyTracker + Send> = match kind {
        DirtyTrackerKind::KvmDirtyLog => Box::new(KvmDirtyLog::new(vm.shared_fd(), memory)),
        DirtyTrackerKind::UffdWriteProtect => {
            Box::new(UffdWriteProtect::new(memory).map_err(|e| TrackingError::Start(e.into()))?)
        }
        DirtyTrackerKind::SoftDirty => {
            Box::new(SoftDirty::new(memory).map_err(|e| TrackingError::Start(e.into()))?)
        }
        DirtyTrackerKind::VmmWriteLog => return Err(TrackingError::Unsupported),
    };
    // Only the primary starts: the VMM log must keep the writes made so far.
    primary.start()?;
    Ok(CombinedTracker::new(primary, memory))
}
