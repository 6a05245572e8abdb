//! What a killed build leaves mounted inside its tree (debootstrap mounts /proc and
//! /sys there while it runs), found and unmounted so that removing the tree can never
//! reach the host's files through a mount.

use std::path::{Path, PathBuf};

/// Something is still mounted at this path after unmounting everything below a
/// directory.
#[derive(Debug, thiserror::Error)]
#[error("{0} is still mounted")]
pub struct StillMounted(pub PathBuf);

/// Mount points at or below `dir`, deepest first, from /proc/self/mountinfo.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = info
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_mountinfo(p)))
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
pub(crate) fn unescape_mountinfo(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let octal = std::str::from_utf8(&bytes[i + 1..i + 4]).unwrap_or("");
            if let Ok(v) = u8::from_str_radix(octal, 8) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Unmounts (lazily) everything mounted at or below `dir`; fails when something
/// stays mounted, so the caller does not delete through it.
pub fn unmount_all_under(dir: &Path) -> Result<(), StillMounted> {
    for mount in mounts_under(dir) {
        let _ = nix::mount::umount2(&mount, nix::mount::MntFlags::MNT_DETACH);
    }
    match mounts_under(dir).into_iter().next() {
        Some(still) => Err(StillMounted(still)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo("/end\\"), "/end\\");
    }
}
