//! Helpers for Cube's own tests, benchmarks and test-guest commands (hidden: not an
//! API, and free to change): the synthetic test guest's controls, the floors that
//! benchmarks compare against, and the host checks tests skip on.

pub mod floor;

use std::path::PathBuf;

use cube_supervisor::protocol::{Request, Response};
use cube_vmm::persist::MachineConfig;

use crate::{Sandbox, SandboxError};

pub use cube_net::bench as net_bench;
pub use cube_supervisor::jail_network::{open_pool, pool_config, pool_name};
pub use cube_vmm::persist::state::read_state;
pub use cube_vmm::test_guest::mailbox::{self, Mode as GuestMode};
pub use cube_vmm::testing::{cube_guest_kernel, linux_kernel};

/// What only a test-guest sandbox does: the host drives Cube's synthetic guest through
/// its mailbox and reads its memory. Other sandboxes refuse these with
/// [`crate::ErrorKind::Unsupported`].
pub trait TestGuestControl {
    /// Has the test guest dirty `mib` MiB of memory, the first page holding `pattern`
    /// and each next page one more.
    fn guest_dirty(&mut self, mib: u64, pattern: u64) -> Result<(), SandboxError>;

    /// Makes the test guest spin on its counter (true) or idle (false).
    fn guest_spin(&mut self, spin: bool) -> Result<(), SandboxError>;

    /// Waits until the test guest has touched its working set after its last start.
    fn guest_wait_working_set(&mut self) -> Result<(), SandboxError>;

    /// Reads `len` bytes of guest memory at guest-physical `addr`.
    fn read_memory(&mut self, addr: u64, len: u32) -> Result<Vec<u8>, SandboxError>;

    /// CRC32 of each RAM region.
    fn memory_digest(&mut self) -> Result<Vec<u32>, SandboxError>;
}

impl TestGuestControl for Sandbox {
    fn guest_dirty(&mut self, mib: u64, pattern: u64) -> Result<(), SandboxError> {
        self.call_ok(&Request::GuestDirty { mib, pattern })
    }

    fn guest_spin(&mut self, spin: bool) -> Result<(), SandboxError> {
        self.call_ok(&Request::GuestMode { spin })
    }

    fn guest_wait_working_set(&mut self) -> Result<(), SandboxError> {
        self.call_ok(&Request::GuestWaitWorkingSet)
    }

    fn read_memory(&mut self, addr: u64, len: u32) -> Result<Vec<u8>, SandboxError> {
        match self.call(&Request::ReadMemory { addr, len })? {
            Response::Memory(m) => Ok(m),
            other => Err(self.unexpected(other)),
        }
    }

    fn memory_digest(&mut self) -> Result<Vec<u32>, SandboxError> {
        match self.call(&Request::MemoryDigest)? {
            Response::Digest(d) => Ok(d),
            other => Err(self.unexpected(other)),
        }
    }
}

/// The most MiB the test guest can dirty in a machine of this shape: its dirty area
/// starts at 64 MiB and ends at the top of RAM or the MMIO hole.
pub fn max_dirty_mib(machine: &MachineConfig) -> u64 {
    let top = machine
        .memory_bytes
        .min(cube_vmm::arch::x86_64::layout::MMIO_HOLE_START);
    (top >> 20).saturating_sub(mailbox::DIRTY_AREA_ADDR >> 20)
}

/// The supervisor binary, found as a [`crate::Runtime`] finds it (`$CUBE_SUPERVISOR`,
/// else next to the running executable or one directory up, where cargo puts the
/// workspace's binaries for test executables).
pub fn supervisor_binary() -> Result<PathBuf, SandboxError> {
    Ok(cube_supervisor::pool::locate_supervisor()?)
}

/// The statically linked agent beside the supervisor's build
/// (`target/static/<profile>/cube-agent`, made by `scripts/build-static.sh`, which the
/// set-up runs): roots that are not the host's carry no C library for another build.
pub fn static_agent() -> Option<PathBuf> {
    let supervisor = supervisor_binary().ok()?.canonicalize().ok()?;
    let bins = supervisor.parent()?;
    let built = bins
        .parent()?
        .join("static")
        .join(bins.file_name()?)
        .join("cube-agent");
    built.is_file().then_some(built)
}

/// Container images written by tests (OCI layouts, `docker save` archives).
pub use cube_supervisor::templates::oci::test_image as oci_image;

/// Whether a cgroup hierarchy is readable here (jails need one).
pub fn cgroups_readable() -> bool {
    cube_jail::CgroupLayout::detect().is_ok()
}

/// Whether the host's cgroups offer `controller` (`memory`, `pids`, `cpu`).
pub fn cgroup_controller(controller: &str) -> bool {
    cube_jail::CgroupLayout::detect().is_ok_and(|l| l.provider(controller).is_some())
}

/// Whether a working CRIU is installed (full-state jail snapshots).
pub fn criu_works() -> bool {
    cube_jail::Criu::probe().is_ok()
}
