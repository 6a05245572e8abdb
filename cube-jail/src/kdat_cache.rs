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
//! `/run` is a tmpfs already, nothing is mounted. Of the rest of `/run`, criu only
//! opens iptables' lock file (`xtables.lock`, at every restore, though Cube's restores
//! run no iptables): the tmpfs holds an empty one, without which criu would mount a
//! tmpfs of its own on `/run` in yet another mount namespace each time.
//!
//! The same tmpfs lists the CRIU binaries that passed `criu check` since boot
//! (`checked`): each supervisor finds its CRIU once ([`crate::Criu::probe`]), and the
//! check costs ~100 ms, which a clone's new supervisor would otherwise pay on its
//! create path.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::sync::OnceLock;

use nix::sys::statfs::{statfs, TMPFS_MAGIC};

use crate::criu_version::{parse_version, CriuVersion};

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
    if !is_tmpfs(dir) {
        nix::mount::mount(
            Some("cube-criu"),
            dir,
            Some("tmpfs"),
            nix::mount::MsFlags::MS_NOSUID
                | nix::mount::MsFlags::MS_NODEV
                | nix::mount::MsFlags::MS_NOEXEC,
            Some(TMPFS_OPTIONS),
        )
        .map_err(io::Error::from)?;
    }
    // CRIU's restore takes iptables' lock file from /run; where it finds none it
    // mounts a tmpfs of its own there first (a mount namespace and a mount per
    // restore).
    fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(Path::new(CACHE_DIR).join("xtables.lock"))?;
    Ok(())
}

/// Where the CRIU binaries that passed `criu check` since boot are listed, one per
/// line: `<dev>:<ino>:<size>:<mtime ns> <version>` (a rebuilt or replaced binary has
/// another key).
const CHECKED: &str = "checked";

/// The key of the binary at `path`: changes when the file does.
fn binary_key(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(path).ok()?;
    Some(format!(
        "{}:{}:{}:{}",
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime() as i128 * 1_000_000_000 + i128::from(m.mtime_nsec())
    ))
}

/// The version of the CRIU at `path` if it passed `criu check` since the host
/// booted (the list lives on a tmpfs: [`CACHE_DIR`], or `/run`'s own where `/run` is
/// one).
pub(crate) fn checked_version(path: &Path) -> Option<CriuVersion> {
    let key = binary_key(path)?;
    let text = fs::read_to_string(Path::new(CACHE_DIR).join(CHECKED)).ok()?;
    text.lines().find_map(|line| {
        let (k, version) = line.split_once(' ')?;
        (k == key)
            .then(|| parse_version(&format!("Version: {version}")))
            .flatten()
    })
}

/// Lists the CRIU at `path` as checked; best effort (without the list, the next
/// process checks again).
pub(crate) fn record_checked(path: &Path, version: CriuVersion) {
    let Some(key) = binary_key(path) else { return };
    // The directory is a tmpfs of Cube's, or a directory on a tmpfs /run.
    if get().bind.is_none() && !is_tmpfs(Path::new("/run")) {
        return;
    }
    let dir = Path::new(CACHE_DIR);
    if fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .is_err()
    {
        return;
    }
    let line = format!("{key} {version}\n");
    let written = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(dir.join(CHECKED))
        .and_then(|mut f| io::Write::write_all(&mut f, line.as_bytes()));
    if let Err(e) = written {
        tracing::debug!("not recording the CRIU check: {e}");
    }
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
