//! What a confined VM supervisor may still reach of the host's file system, with
//! Landlock: a VM supervisor runs as a uid of its own once confined, which still
//! reads what any user may (world-readable files, such as another sandbox's console
//! log or a template's tree), and a network keeper stays uid 0, which owns most of
//! the host's files, so without more a keeper could read `/etc/shadow` or the host's
//! disks and rewrite `/etc/passwd` as their owner. Landlock takes that away without a mount namespace (which a process can no
//! longer enter once it runs threads):
//!
//! - a VM supervisor without a network may read and write only its own sandbox's
//!   directory (where its snapshots are staged, for the library to move into place,
//!   and where the library lends it the one it rolls back to), list and remove the
//!   store's snapshots (its uid removes only its own) but neither read, alter nor add
//!   to them, remove its own directory, and read `/proc`, `/sys` and the few
//!   devices of [`DEVICES`] (what it already opened, such as `/dev/kvm`, stays
//!   open; a host disk under `/dev` is not read). Other sandboxes' directories (their disks, memory
//!   images, consoles) and the store's scratch space are out of its reach. It may bind or
//!   connect no TCP port, reach no abstract unix socket made outside it and, where the
//!   kernel scopes signals correctly, signal no process but its own threads (uid 0 may
//!   otherwise signal every root process);
//! - a VM supervisor with a network gets the same: its TAP stays open from before,
//!   and its network keeper ([`crate::network_keeper`]) changes and releases it;
//! - a network keeper reaches its sandbox's network record (which it removes with
//!   the device), read-only `/proc`, `/sys` and [`DEVICES`], and the two parts of the
//!   host's network pool it works on: the pool's lock file (taken while it releases
//!   its TAP) and the pool's pins in bpffs (the TAP's link pin goes with the TAP);
//!   nothing of the store;
//! - vCPU threads built ahead, before their sandbox is known, get no file system at
//!   all: guest code and device emulation use descriptors opened before.
//!
//! A ruleset is built here, once, and applied on each thread by the confinement
//! broadcast ([`super::all_threads`]): Landlock, like capabilities, binds the calling
//! thread only. Where the kernel has no Landlock, nothing is built and the supervisor
//! goes on under its other confinement; `cube doctor` says which.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use cube_storage::Store;
use landlock::{
    path_beneath_rules, Access, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, Erratum,
    PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetError, Scope, ABI,
};

/// The newest Landlock ABI whose rights Cube has tested and asks for; older kernels
/// enforce what they know of it.
const TESTED_ABI: ABI = ABI::V7;

/// Read-only parts of the host a confined VM supervisor still reads: threads' status
/// (confinement checks, memory figures). Read-only matters: uid 0 may write most
/// sysctls (`kernel.core_pattern` among them) with no capability at all. (Its own
/// `/proc/PID` cannot be made writable: Landlock ties a rule to an inode, and procfs
/// makes new ones for a process's directory.)
const READ_ONLY: &[&str] = &["/proc", "/sys"];

/// The devices a confined supervisor may still open, read-only: none of them holds
/// anything of the host's. The rest of `/dev` (its disks above all, which
/// uid 0 would read) is out of reach; devices opened before the
/// confinement (`/dev/kvm`, a TAP) stay open.
pub const DEVICES: &[&str] = &["/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"];

/// [`READ_ONLY`] and the [`DEVICES`] this host has, for their rules.
fn read_only_paths() -> Vec<&'static str> {
    READ_ONLY
        .iter()
        .chain(DEVICES.iter().filter(|d| Path::new(d).exists()))
        .copied()
        .collect()
}

/// Why a file-system ruleset could not be built.
#[derive(Debug, thiserror::Error)]
pub enum FilesystemError {
    /// A directory of the store the supervisor works in could not be opened for its
    /// rule.
    #[error("opening {0} for the file-system rule")]
    Store(PathBuf, #[source] landlock::PathFdError),
    /// The kernel refused the ruleset.
    #[error("building the Landlock ruleset")]
    Ruleset(#[from] RulesetError),
    /// The network pool's name is unusable.
    #[error("naming the network pool")]
    PoolName(#[source] crate::jail_network::JailNetworkError),
    /// A part of the network pool could not be opened for its rule.
    #[error("opening {0} for the file-system rule")]
    Pool(PathBuf, #[source] std::io::Error),
}

/// The parts of the host's network pool a networked VM supervisor still works on
/// once confined.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolPaths {
    /// The pool's lock file, taken around releasing a device.
    pub lock_file: PathBuf,
    /// Where the pool's maps, programs and links are pinned in bpffs.
    pub pin_dir: PathBuf,
}

impl PoolPaths {
    /// The host pool's (`$CUBE_NET_POOL`, else the default one).
    pub fn of_host_pool() -> Result<PoolPaths, FilesystemError> {
        let name = crate::jail_network::pool_name().map_err(FilesystemError::PoolName)?;
        Ok(Self::of(&crate::jail_network::pool_config(&name)))
    }

    /// Those of the pool `config` describes.
    pub fn of(config: &cube_net::PoolConfig) -> PoolPaths {
        PoolPaths {
            lock_file: crate::jail_network::PoolLock::path(config),
            pin_dir: config.pin_dir(),
        }
    }

    /// Adds its rules to `created`: the lock file read and written (never truncated,
    /// replaced or removed), everything beneath the pin directory. The lock file is
    /// made if it is missing, so that its rule has a file to name (the confined
    /// supervisor could not make it); the descriptor that opened it names it.
    fn add_rules(
        &self,
        created: landlock::RulesetCreated,
    ) -> Result<landlock::RulesetCreated, FilesystemError> {
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.lock_file)
            .map_err(|e| FilesystemError::Pool(self.lock_file.clone(), e))?;
        let pins = PathFd::new(&self.pin_dir)
            .map_err(|e| FilesystemError::Pool(self.pin_dir.clone(), std::io::Error::other(e)))?;
        Ok(created
            .add_rule(PathBeneath::new(
                lock,
                AccessFs::ReadFile | AccessFs::WriteFile,
            ))?
            .add_rule(PathBeneath::new(pins, AccessFs::from_all(TESTED_ABI)))?)
    }
}

/// The Landlock ABI of the running kernel (`None`: no Landlock, or not enabled).
pub fn kernel_abi() -> Option<u32> {
    // SAFETY: the version query passes no attribute (null, size 0) and only returns a
    // number.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            1u32, // LANDLOCK_CREATE_RULESET_VERSION
        )
    };
    u32::try_from(v).ok().filter(|v| *v > 0)
}

/// Whether a confined VM supervisor's signals are scoped to its own process: Landlock
/// ABI 6 with erratum 2 fixed. Before the fix, a thread could not signal its own
/// process's threads in another domain (the vCPU kick would fail), so signals are
/// scoped only where the kernel says the fix is in.
pub fn signals_scoped() -> bool {
    kernel_abi().is_some_and(|abi| abi >= 6)
        && Erratum::current().contains(Erratum::ScopedSignalHandling)
}

/// A ruleset that handles every file-system right Cube knows, with the scopes the
/// kernel gets right, and no TCP.
fn base() -> Result<landlock::RulesetCreated, RulesetError> {
    let mut scopes: BitFlags<Scope> = Scope::AbstractUnixSocket.into();
    if signals_scoped() {
        scopes |= Scope::Signal;
    }
    Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(TESTED_ABI))?
        .handle_access(AccessNet::from_all(TESTED_ABI))?
        .scope(scopes)?
        .create()
}

/// The ruleset of a VM supervisor whose sandbox directory is `sandbox_dir`: the parts
/// of its store [`store_rules`] names and read-only `/proc`, `/sys` and [`DEVICES`];
/// nothing else. `None` where the kernel has no Landlock.
pub fn vm_rules(sandbox_dir: &Path) -> Result<Option<OwnedFd>, FilesystemError> {
    if kernel_abi().is_none() {
        return Ok(None);
    }
    let mut created = base()?;
    for (path, access) in store_rules(sandbox_dir) {
        let fd = PathFd::new(&path).map_err(|e| FilesystemError::Store(path.clone(), e))?;
        created = created.add_rule(PathBeneath::new(fd, access))?;
    }
    let created = created.add_rules(path_beneath_rules(
        read_only_paths(),
        AccessFs::from_read(TESTED_ABI),
    ))?;
    Ok(created.into())
}

/// The ruleset of the network keeper of the VM sandbox in `sandbox_dir`: removing
/// files there (its network record), the parts of its `pool` [`PoolPaths`] names and
/// read-only `/proc`, `/sys` and [`DEVICES`]; nothing else. `None` where the kernel
/// has no Landlock.
pub fn keeper_rules(
    sandbox_dir: &Path,
    pool: &PoolPaths,
) -> Result<Option<OwnedFd>, FilesystemError> {
    if kernel_abi().is_none() {
        return Ok(None);
    }
    let fd = PathFd::new(sandbox_dir)
        .map_err(|e| FilesystemError::Store(sandbox_dir.to_path_buf(), e))?;
    let created = base()?.add_rule(PathBeneath::new(fd, AccessFs::RemoveFile))?;
    let created = pool.add_rules(created)?.add_rules(path_beneath_rules(
        read_only_paths(),
        AccessFs::from_read(TESTED_ABI),
    ))?;
    Ok(created.into())
}

/// What a VM supervisor may do where in the store holding `sandbox_dir`: everything in
/// its own directory, where it stages its snapshots and where the library lends it
/// the one it rolls back to ([`cube_storage::lent_snapshot`]); list and remove
/// snapshots, as it removes those its uid staged when it ends on its own (a
/// lifetime's end, its creator gone), found by their directories' owner; and remove
/// its own, emptied, directory. It opens no snapshot's or template's file: the
/// library moves a staged snapshot into place, and the supervisor keeps the parent
/// of its next diff and syncs the snapshot through descriptors opened while it was
/// staged ([`cube_storage::durable_marker::PendingFlush`]). Landlock grants removal
/// only as a right beneath a directory; the store's sticky, shared snapshots area
/// leaves it only what its uid owns. The store's scratch space is not reached (the
/// library verifies imports there). A directory outside a store's layout is all it
/// gets.
fn store_rules(sandbox_dir: &Path) -> Vec<(PathBuf, BitFlags<AccessFs>)> {
    let all = AccessFs::from_all(TESTED_ABI);
    let mut rules = vec![(sandbox_dir.to_path_buf(), all)];
    if let Some(root) = store_root_of(sandbox_dir) {
        let areas = Store::areas_at(root);
        rules.extend([
            (
                areas.snapshots,
                AccessFs::ReadDir | AccessFs::RemoveFile | AccessFs::RemoveDir,
            ),
            (areas.sandboxes, AccessFs::RemoveDir.into()),
        ]);
    }
    rules
}

/// The ruleset of threads that need no file system at all (vCPU threads built ahead).
/// `None` where the kernel has no Landlock.
pub fn no_files() -> Result<Option<OwnedFd>, FilesystemError> {
    if kernel_abi().is_none() {
        return Ok(None);
    }
    Ok(base()?.into())
}

/// The root of the store holding sandbox directory `dir` (`<store>/sandboxes/<id>`);
/// `None` for a directory outside a store's layout.
pub fn store_root_of(dir: &Path) -> Option<&Path> {
    let sandboxes = dir.parent()?;
    let root = sandboxes.parent()?;
    (Store::areas_at(root).sandboxes == sandboxes).then_some(root)
}

/// What a supervisor's file-system confinement covers, for [`describe`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// A VM supervisor without a network.
    Vm,
    /// The network keeper of a VM with a device from the host's network pool.
    NetworkKeeper,
    /// A jail supervisor: not confined to parts of the file system.
    Jail,
}

/// The file-system confinement of a profile in words, for `cube doctor`.
pub fn describe(reach: Reach) -> String {
    let reached = match reach {
        Reach::Jail => return "the host's, as uid 0 with the capabilities kept".into(),
        Reach::Vm => {
            "read-write in its own sandbox directory only (a snapshot it rolls back to is \
             lent there), the store's snapshots listed and (those its uid owns) removed \
             but not read or written, no templates, read-only /proc /sys /dev/null \
             /dev/zero /dev/random /dev/urandom"
        }
        Reach::NetworkKeeper => {
            "its sandbox's network record removed, its network pool's lock file and bpffs \
             pins, read-only /proc /sys /dev/null /dev/zero /dev/random /dev/urandom, \
             nothing of the store"
        }
    };
    match kernel_abi() {
        None => if reach == Reach::Vm {
            "what its uid and the supervisors' group may reach (this kernel has no Landlock)"
        } else {
            "the host's, as uid 0 with the capabilities kept (this kernel has no Landlock)"
        }
        .to_string(),
        Some(abi) => format!(
            "Landlock (ABI {abi}): {reached}, no TCP, {}",
            if signals_scoped() {
                "signals to its own threads only"
            } else {
                "signals not scoped (this kernel's scoping is not fixed: Landlock erratum 2)"
            }
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_is_found_from_a_sandbox_directory() {
        assert_eq!(
            store_root_of(Path::new("/var/lib/cube/sandboxes/sb-1")),
            Some(Path::new("/var/lib/cube"))
        );
        assert_eq!(store_root_of(Path::new("/tmp/x/sb")), None);
        assert_eq!(store_root_of(Path::new("/sandboxes")), None);
        assert_eq!(store_root_of(Path::new("/")), None);
    }

    #[test]
    fn a_sandbox_writes_its_own_directory_only_and_lists_or_removes_snapshots() {
        let rules = store_rules(Path::new("/s/sandboxes/sb-1"));
        let all = AccessFs::from_all(TESTED_ABI);
        let of = |p: &str| {
            rules
                .iter()
                .find(|(path, _)| path == Path::new(p))
                .map(|(_, access)| *access)
        };
        assert_eq!(of("/s/sandboxes/sb-1"), Some(all));
        assert_eq!(
            of("/s/snapshots"),
            Some(AccessFs::ReadDir | AccessFs::RemoveFile | AccessFs::RemoveDir)
        );
        assert_eq!(of("/s/tmp"), None);
        assert_eq!(of("/s/templates"), None);
        assert_eq!(of("/s/sandboxes"), Some(AccessFs::RemoveDir.into()));
        assert_eq!(rules.len(), 3, "{rules:?}");
        assert_eq!(store_rules(Path::new("/x/sb")).len(), 1);
    }

    #[test]
    fn a_store_that_cannot_be_opened_is_an_error() {
        if kernel_abi().is_none() {
            eprintln!("skipped: this kernel has no Landlock");
            return;
        }
        let e = vm_rules(Path::new("/nonexistent/store/sandboxes/sb-1")).unwrap_err();
        assert!(matches!(e, FilesystemError::Store(..)), "{e:?}");
    }

    #[test]
    fn a_pool_that_is_not_there_is_an_error_that_names_it() {
        if kernel_abi().is_none() {
            eprintln!("skipped: this kernel has no Landlock");
            return;
        }
        let sandbox = tempfile::TempDir::new().unwrap();
        let pool = PoolPaths {
            lock_file: sandbox.path().join("pool.lock"),
            pin_dir: PathBuf::from("/nonexistent/bpffs/cube-net/p"),
        };
        let e = keeper_rules(sandbox.path(), &pool).unwrap_err();
        assert!(
            matches!(&e, FilesystemError::Pool(path, _) if path == &pool.pin_dir),
            "{e:?}"
        );
    }
}
