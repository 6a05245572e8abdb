//! A host uid of each sandbox's own.
//!
//! The kernel keeps some limits per user: inotify instances and watches, POSIX message
//! queue bytes, user namespaces, locked memory. Sandboxes that all ran as the host's
//! `nobody` shared them with each other and with every host process running as
//! `nobody`: 128 `inotify_init` calls in one sandbox made them fail in every other.
//! Each sandbox therefore runs as a uid (and gid) no other live sandbox and no host
//! account uses, leased here from [`RANGE`].
//!
//! A lease is a lock file `/run/cube/uids/<uid>` held with `flock` by the process that
//! holds the sandbox (a supervisor, `cube run`): the kernel drops the lock when that
//! process dies, however it dies, so a killed holder leaks nothing; `/run` is a tmpfs,
//! so nothing outlives a reboot either. Leasing picks random uids of the range (16 M of
//! them) until one is free.
//!
//! Files a sandbox writes are owned by its uid. A layer that moves to a sandbox with
//! another uid (a rollback or clone of the files alone, a wake) is given to the new uid
//! first ([`give_tree`]). A sandbox restored with its processes by CRIU keeps the uid
//! they were dumped with (CRIU restores credentials): a clone of a running sandbox
//! shares its source's uid, and so its per-user limits. It shares the lease too
//! (every holder holds the lock file shared), so the uid stays leased until the last
//! of them is gone: no new sandbox is given it while a clone still runs as it.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::capabilities::Identity;

/// Host uids (and gids) sandboxes run as: below 2^31 (some tools read ids as signed),
/// far above any account's and the usual subordinate-id ranges (100000 up).
pub const RANGE: Range<u32> = 0x7000_0000..0x7100_0000;

/// The uid every sandbox used before leases, still found in older layers.
pub const LEGACY_UID: u32 = 65534;

/// Where the lease lock files live.
pub const LEASE_DIR: &str = "/run/cube/uids";

/// How many random uids a lease tries before giving up (a nearly full range).
const ATTEMPTS: usize = 64;

/// Errors of leasing a uid and handing a tree to it.
#[derive(Debug, thiserror::Error)]
pub enum SandboxUidError {
    /// The lease directory or a lock file could not be made or locked.
    #[error("cannot lease a uid at {path}")]
    Lease {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Every uid tried was taken.
    #[error("no free sandbox uid after {ATTEMPTS} tries")]
    Exhausted,
    /// The kernel gave no random bytes.
    #[error("cannot pick a random uid")]
    Random(#[source] io::Error),
    /// A file of a tree could not be given to the sandbox's uid.
    #[error("cannot give {path} to the sandbox's uid")]
    Give {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

type Result<T> = std::result::Result<T, SandboxUidError>;

/// A uid this process holds for one sandbox; released on drop (or when the process
/// dies).
#[derive(Debug)]
pub struct UidLease {
    uid: u32,
    path: PathBuf,
    file: File,
}

impl UidLease {
    /// Leases a free uid of [`RANGE`], and removes a few lock files their holders
    /// left (see [`sweep_released`]).
    pub fn acquire() -> Result<UidLease> {
        ensure_dir()?;
        let guard = Guard::take()?;
        for _ in 0..ATTEMPTS {
            let uid = RANGE.start + random_u32()? % (RANGE.end - RANGE.start);
            if let Some(lease) = Self::try_lock(uid, Hold::Alone)? {
                sweep(SWEEP_LOOKS, &guard);
                return Ok(lease);
            }
        }
        Err(SandboxUidError::Exhausted)
    }

    /// Leases `uid` itself (the uid a restored sandbox's processes run as), shared
    /// with whoever holds it already (a clone restored by CRIU runs as its source's
    /// uid: the uid stays leased until both are gone, so that no new sandbox gets it
    /// meanwhile); None outside [`RANGE`].
    pub fn claim(uid: u32) -> Result<Option<UidLease>> {
        if !RANGE.contains(&uid) {
            return Ok(None);
        }
        ensure_dir()?;
        let _guard = Guard::take()?;
        Self::try_lock(uid, Hold::Shared)
    }

    /// Locks `uid`'s file, shared in the end either way; `Hold::Alone` only if no
    /// other process holds it. Called with the [`Guard`] held.
    fn try_lock(uid: u32, hold: Hold) -> Result<Option<UidLease>> {
        let path = Path::new(LEASE_DIR).join(uid.to_string());
        let err = |source| SandboxUidError::Lease {
            path: path.clone(),
            source,
        };
        let file = open_lock_file(&path).map_err(err)?;
        let first = match hold {
            Hold::Alone => libc::LOCK_EX,
            Hold::Shared => libc::LOCK_SH,
        };
        if !flock(&file, first | libc::LOCK_NB).map_err(err)? {
            return Ok(None);
        }
        // A holder that released (and unlinked) the file between our open and our
        // lock leaves us locking a file no one else will find: try again elsewhere.
        let same = match (file.metadata(), fs::symlink_metadata(&path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        };
        if !same {
            return Ok(None);
        }
        // Every holder holds it shared, so that a clone can share it; the exclusive
        // lock proved no one held it. (The conversion is not atomic: the guard keeps
        // everyone who could take it exclusively meanwhile out.)
        if hold == Hold::Alone && !flock(&file, libc::LOCK_SH | libc::LOCK_NB).map_err(err)? {
            return Ok(None);
        }
        Ok(Some(UidLease { uid, path, file }))
    }

    /// The leased uid.
    pub fn uid(&self) -> u32 {
        self.uid
    }

    /// The sandbox identity: the leased uid, and a gid of the same number.
    pub fn identity(&self) -> Identity {
        Identity {
            uid: self.uid,
            gid: self.uid,
        }
    }
}

impl Drop for UidLease {
    fn drop(&mut self) {
        let _guard = Guard::take();
        // The last holder unlinks the file while it holds it alone: whoever opens the
        // name next makes a new file. Another holder keeps it (and the uid leased).
        if flock(&self.file, libc::LOCK_EX | libc::LOCK_NB).unwrap_or(false) {
            let _ = fs::remove_file(&self.path);
        }
        // SAFETY: unlocks a descriptor this lease owns (closing it would too).
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// How a lease holds its uid's lock file.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// Only if no other process holds it (a new sandbox's).
    Alone,
    /// Beside whoever holds it (a restored sandbox's).
    Shared,
}

/// Opens (making it if need be) the lock file at `path`, not through a symlink.
fn open_lock_file(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
}

/// `flock(file, operation)`: whether the lock was taken (false: another holds it,
/// with `LOCK_NB`).
fn flock(file: &File, operation: libc::c_int) -> io::Result<bool> {
    // SAFETY: flock on a descriptor the caller holds; no memory is involved.
    if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Ok(false);
    }
    Err(e)
}

/// The lock that serializes whatever decides whether a uid is held (a lease taken,
/// shared, released or swept): a lock file's conversion between shared and exclusive
/// is not atomic, and a release or a sweep unlinks the file. Taken again on a thread
/// that holds it (a sweep releases leases), it is the same hold.
struct Guard {
    /// The locked file, for the outermost hold on this thread (closing it unlocks).
    _file: Option<File>,
}

/// The guard's lock file in [`LEASE_DIR`] (not a number: never taken for a lease).
const GUARD_FILE: &str = ".guard";

thread_local! {
    /// How many holds of the guard this thread has.
    static GUARD_HOLDS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

impl Guard {
    fn take() -> Result<Guard> {
        if GUARD_HOLDS.get() > 0 {
            GUARD_HOLDS.set(GUARD_HOLDS.get() + 1);
            return Ok(Guard { _file: None });
        }
        let path = Path::new(LEASE_DIR).join(GUARD_FILE);
        let err = |source| SandboxUidError::Lease {
            path: path.clone(),
            source,
        };
        let file = open_lock_file(&path).map_err(err)?;
        flock(&file, libc::LOCK_EX).map_err(err)?;
        GUARD_HOLDS.set(1);
        Ok(Guard { _file: Some(file) })
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        GUARD_HOLDS.set(GUARD_HOLDS.get().saturating_sub(1));
    }
}

/// Lock files [`UidLease::acquire`] looks at for released ones, each time: bounded,
/// and more than one, so that files left behind never pile up faster than they go.
const SWEEP_LOOKS: usize = 32;

/// Removes lock files of [`LEASE_DIR`] that no process holds, looking at `looks` of
/// them at most; returns how many it removed. A holder unlinks its file when it
/// releases the lease, but one that can no longer (a VM supervisor, confined to its
/// own files once it runs as its leased uid) leaves the file unlocked when it exits.
/// Each is removed while locked here, as a holder does: a process that opened it
/// meanwhile finds the name gone or another file behind it and tries another uid.
pub fn sweep_released(looks: usize) -> usize {
    match Guard::take() {
        Ok(guard) => sweep(looks, &guard),
        Err(_) => 0,
    }
}

/// [`sweep_released`] with the guard held.
fn sweep(looks: usize, _guard: &Guard) -> usize {
    let Ok(entries) = fs::read_dir(LEASE_DIR) else {
        return 0;
    };
    let uids: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .collect();
    if uids.is_empty() {
        return 0;
    }
    // From a random place: the listing's order is the same each time, and looking
    // always at its head would leave files further on (past `looks` held leases)
    // for ever. So each file is reached, and files left behind settle at about one
    // for every `looks` leases held.
    let start = random_u32().map_or(0, |r| r as usize % uids.len());
    let mut removed = 0;
    for &uid in uids.iter().cycle().skip(start).take(looks.min(uids.len())) {
        // Taking the lock alone is what proves no process holds it; the release
        // unlinks the file.
        if let Ok(Some(lease)) = UidLease::try_lock(uid, Hold::Alone) {
            drop(lease);
            removed += 1;
        }
    }
    removed
}

/// Whether `uid` is one sandboxes run as (leased, or the legacy `nobody`).
pub fn is_sandbox_uid(uid: u32) -> bool {
    RANGE.contains(&uid) || uid == LEGACY_UID
}

fn ensure_dir() -> Result<()> {
    let dir = Path::new(LEASE_DIR);
    if dir.is_dir() {
        return Ok(());
    }
    use std::os::unix::fs::DirBuilderExt;
    match fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(SandboxUidError::Lease {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

fn random_u32() -> Result<u32> {
    let mut bytes = [0u8; 4];
    cube_storage::fill_random(&mut bytes).map_err(SandboxUidError::Random)?;
    Ok(u32::from_ne_bytes(bytes))
}

/// Gives every entry of the tree `root` (itself included) that a sandbox owns (see
/// [`is_sandbox_uid`]) to `identity`, without following symlinks: a layer that moves
/// to a sandbox with another uid. Entries of other owners (root's mount points) keep
/// theirs. The tree must not be in use by a running sandbox. Returns how many entries
/// changed owner.
pub fn give_tree(root: &Path, identity: Identity) -> Result<u64> {
    walk_giving(root, |meta| {
        if !is_sandbox_uid(meta.uid()) || meta.uid() == identity.uid {
            return None;
        }
        // A group of the sandbox's own goes along; any other group stays.
        let gid = if is_sandbox_uid(meta.gid()) {
            identity.gid
        } else {
            meta.gid()
        };
        Some(Identity {
            uid: identity.uid,
            gid,
        })
    })
}

/// Gives the directory `root` and everything in it to `identity`, without following
/// symlinks: a VM supervisor's sandbox directory, which it goes on writing once it is
/// no longer root. A file with more than one link keeps its owner: its other names
/// lie outside the directory (a template's or snapshot's file linked in), which the
/// supervisor must not come to own. Returns how many entries changed owner.
pub fn give_whole_tree(root: &Path, identity: Identity) -> Result<u64> {
    walk_giving(root, |meta| {
        let linked_elsewhere = !meta.is_dir() && meta.nlink() > 1;
        let given = (meta.uid(), meta.gid()) == (identity.uid, identity.gid);
        (!linked_elsewhere && !given).then_some(identity)
    })
}

/// Walks the tree `root` (itself included, no symlink followed) and gives each entry
/// to the owner `to` chooses for it, if any; the setuid and setgid bits chown clears
/// are put back. Returns how many entries changed owner.
fn walk_giving(root: &Path, to: impl Fn(&fs::Metadata) -> Option<Identity>) -> Result<u64> {
    let mut changed = 0;
    let mut pending = vec![root.to_path_buf()];
    while let Some(path) = pending.pop() {
        let give_err = |source| SandboxUidError::Give {
            path: path.clone(),
            source,
        };
        let meta = fs::symlink_metadata(&path).map_err(give_err)?;
        if meta.is_dir() {
            for entry in fs::read_dir(&path).map_err(give_err)? {
                pending.push(entry.map_err(give_err)?.path());
            }
        }
        let Some(owner) = to(&meta) else {
            continue;
        };
        std::os::unix::fs::lchown(&path, Some(owner.uid), Some(owner.gid)).map_err(give_err)?;
        if !meta.file_type().is_symlink() && meta.mode() & 0o6000 != 0 {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&path, fs::Permissions::from_mode(meta.mode() & 0o7777))
                .map_err(give_err)?;
        }
        changed += 1;
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> bool {
        // SAFETY: geteuid has no failure mode.
        let root = unsafe { libc::geteuid() } == 0;
        if !root {
            println!("skipped: leases live under /run and chown needs root");
        }
        root
    }

    #[test]
    fn leases_are_exclusive_and_released_on_drop() {
        if !root() {
            return;
        }
        let a = UidLease::acquire().unwrap();
        assert!(RANGE.contains(&a.uid()));
        assert_eq!(a.identity().gid, a.uid());
        let b = UidLease::acquire().unwrap();
        assert_ne!(a.uid(), b.uid());
        // Held by `a` (flock is per open file, so even this process is refused).
        let guard = Guard::take().unwrap();
        assert!(UidLease::try_lock(a.uid(), Hold::Alone).unwrap().is_none());
        drop(guard);
        let uid = a.uid();
        drop(a);
        assert!(!Path::new(LEASE_DIR).join(uid.to_string()).exists());
        let again = UidLease::claim(uid).unwrap().unwrap();
        assert_eq!(again.uid(), uid);
        assert!(UidLease::claim(LEGACY_UID).unwrap().is_none());
    }

    #[test]
    fn a_shared_uid_stays_leased_until_its_last_holder_lets_it_go() {
        if !root() {
            return;
        }
        // A sandbox, and a clone of it restored by CRIU with its uid.
        let source = UidLease::acquire().unwrap();
        let uid = source.uid();
        let clone = UidLease::claim(uid)
            .unwrap()
            .expect("shared with its source");
        let file = Path::new(LEASE_DIR).join(uid.to_string());
        drop(source);
        // The clone still runs as it: no new sandbox may have it.
        assert!(
            file.exists(),
            "the source's release unlinked a shared lease"
        );
        let guard = Guard::take().unwrap();
        assert!(UidLease::try_lock(uid, Hold::Alone).unwrap().is_none());
        drop(guard);
        sweep_released(usize::MAX);
        assert!(file.exists(), "a sweep removed a held lease");
        drop(clone);
        assert!(!file.exists(), "the last holder left its file");
    }

    #[test]
    fn a_lock_file_left_unheld_is_swept_and_a_held_one_stays() {
        if !root() {
            return;
        }
        let held = UidLease::acquire().unwrap();
        // What a holder that could not unlink its file leaves when it exits: the
        // file, unlocked.
        let left = loop {
            let uid = RANGE.start + random_u32().unwrap() % (RANGE.end - RANGE.start);
            let path = Path::new(LEASE_DIR).join(uid.to_string());
            if !path.exists() {
                fs::write(&path, "").unwrap();
                break path;
            }
        };
        sweep_released(usize::MAX);
        assert!(!left.exists(), "an unheld lock file stayed");
        assert!(Path::new(LEASE_DIR).join(held.uid().to_string()).exists());
    }

    #[test]
    fn a_tree_goes_to_the_new_uid_except_what_others_own() {
        if !root() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let tree = tmp.path().join("layer");
        fs::create_dir_all(tree.join("home/user/sub")).unwrap();
        fs::write(tree.join("home/user/sub/f"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", tree.join("home/user/link")).unwrap();
        let old = RANGE.start + 5;
        for p in [
            "home/user",
            "home/user/sub",
            "home/user/sub/f",
            "home/user/link",
        ] {
            std::os::unix::fs::lchown(tree.join(p), Some(old), Some(old)).unwrap();
        }
        let new = Identity {
            uid: RANGE.start + 6,
            gid: RANGE.start + 6,
        };
        assert_eq!(give_tree(&tree, new).unwrap(), 4);
        for p in [
            "home/user",
            "home/user/sub",
            "home/user/sub/f",
            "home/user/link",
        ] {
            let m = fs::symlink_metadata(tree.join(p)).unwrap();
            assert_eq!((m.uid(), m.gid()), (new.uid, new.gid), "{p}");
        }
        // root's directories stay root's; the link's target was not touched.
        assert_eq!(fs::metadata(tree.join("home")).unwrap().uid(), 0);
        assert_eq!(fs::metadata("/etc/passwd").unwrap().uid(), 0);
    }
}
