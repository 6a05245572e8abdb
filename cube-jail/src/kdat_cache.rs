//! Where CRIU keeps what it learnt about the kernel between runs.
//!
//! Every criu run starts by probing the kernel ("kerndat": the vDSO layout, pagemap,
//! netlink, a veth pair it makes and removes, ...): ~100 ms on the 2-core PVM hosts
//! this project is measured on, more than a small sandbox's whole dump. CRIU skips the
//! probe when it finds the result of an earlier run in `/run/criu.kdat`, a file it only
//! writes on a tmpfs, so that a reboot (perhaps into another kernel) throws it away.
//! Hosts whose `/run` is no tmpfs (these containers' root filesystem) never get the
//! file and pay the probe on every dump and restore.
//!
//! There, Cube keeps a small tmpfs of its own at [`CACHE_DIR`] (it goes away on reboot,
//! as a tmpfs `/run` would) and criu runs in a private mount namespace with that tmpfs
//! bound on `/run`: the first run writes the cache, the following ones load it. Where
//! `/run` is a tmpfs already, nothing is mounted. Nothing else of `/run` is hidden from
//! criu that it uses with Cube's options (its iptables lock file is only taken when it
//! dumps or locks a network namespace, which [`crate::checkpoint`] never has it do).

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;
use std::sync::OnceLock;

use nix::sys::statfs::{statfs, TMPFS_MAGIC};

/// The tmpfs Cube keeps for CRIU's cache where the host's `/run` is no tmpfs.
pub const CACHE_DIR: &str = "/run/cube/criu";
/// Serialises the mount between supervisors starting at the same moment.
const LOCK_FILE: &str = "/run/cube/criu.lock";
/// The cache is one small file (under 1 KiB with CRIU 4.1).
const TMPFS_OPTIONS: &str = "size=256k,mode=0700";

/// How criu processes reach the kernel-feature cache on this host.
#[derive(Debug)]
pub(crate) struct KdatCache {
    /// The tmpfs to bind on `/run` in criu's mount namespace; None where `/run` is a
    /// tmpfs already, or where the tmpfs could not be made (criu then probes each run).
    bind: Option<CString>,
}

/// Prepared once per process: a statfs, and at most one mount per boot host-wide.
pub(crate) fn get() -> &'static KdatCache {
    static CACHE: OnceLock<KdatCache> = OnceLock::new();
    CACHE.get_or_init(|| {
        if is_tmpfs(Path::new("/run")) {
            return KdatCache { bind: None };
        }
        match mount_cache_dir() {
            Ok(()) => KdatCache {
                bind: CString::new(CACHE_DIR).ok(),
            },
            Err(e) => {
                tracing::warn!(
                    "no tmpfs for CRIU's kernel-feature cache at {CACHE_DIR} ({e}): every dump and restore probes the kernel"
                );
                KdatCache { bind: None }
            }
        }
    })
}

fn is_tmpfs(path: &Path) -> bool {
    statfs(path).is_ok_and(|s| s.filesystem_type() == TMPFS_MAGIC)
}

/// Makes [`CACHE_DIR`] a tmpfs unless it is one already.
fn mount_cache_dir() -> io::Result<()> {
    let dir = Path::new(CACHE_DIR);
    if let Some(parent) = dir.parent() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(parent)?;
    }
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let lock = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LOCK_FILE)?;
    // SAFETY: flock on a descriptor this function owns; released when it is closed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if is_tmpfs(dir) {
        return Ok(());
    }
    nix::mount::mount(
        Some("cube-criu"),
        dir,
        Some("tmpfs"),
        nix::mount::MsFlags::MS_NOSUID
            | nix::mount::MsFlags::MS_NODEV
            | nix::mount::MsFlags::MS_NOEXEC,
        Some(TMPFS_OPTIONS),
    )
    .map_err(io::Error::from)
}

impl KdatCache {
    /// In the forked criu child, before exec, once it is in a private mount namespace:
    /// binds the cache tmpfs on `/run` where one is needed. Async-signal-safe: one
    /// mount call on memory prepared beforehand.
    pub(crate) fn bind_in_child(&self) -> io::Result<()> {
        let Some(dir) = &self.bind else {
            return Ok(());
        };
        let none = std::ptr::null();
        // SAFETY: both paths are NUL-terminated strings that outlive the call; the
        // other arguments are null where mount(2) allows it.
        let r = unsafe {
            libc::mount(
                dir.as_ptr(),
                c"/run".as_ptr(),
                none,
                libc::MS_BIND,
                none.cast(),
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}
