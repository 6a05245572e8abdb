//! A jail's tree that is itself an overlay mount (a container's root filesystem as
//! containerd's overlayfs snapshotter mounts it), used through its layers.
//!
//! The jail lays its own overlay over the tree it is given. Over an overlay, a file a
//! process maps into memory (every program's text) names the lower overlay's mount,
//! which is outside the jail's mount namespace: CRIU cannot dump such a mapping ("Can't
//! lookup mount"), so the sandbox could not be checkpointed. The jail's overlay takes
//! the tree's own layers instead (its upper directory, then its lower ones): the same
//! files, one overlay deep.

use std::path::{Path, PathBuf};

use crate::templates::mounts::unescape_mountinfo;

/// The trees a jail lays its overlay over for `tree`, topmost first: the layers of the
/// overlay mounted at `tree` where it is one, else `tree` itself.
pub fn jail_lowers(tree: &Path) -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .ok()
        .and_then(|info| overlay_layers(&info, tree))
        .filter(|layers| layers.iter().all(|l| l.is_dir()))
        .unwrap_or_else(|| vec![tree.to_path_buf()])
}

/// The layers of the overlay that `mountinfo` shows mounted at `tree` (the last mount
/// there, the one seen), topmost first; None where that is no overlay, only part of
/// one, or one with data-only layers (whose files are not all in the merged tree).
fn overlay_layers(mountinfo: &str, tree: &Path) -> Option<Vec<PathBuf>> {
    let line = mountinfo.lines().rfind(|line| {
        line.split(' ')
            .nth(4)
            .is_some_and(|p| Path::new(&unescape_mountinfo(p)) == tree)
    })?;
    let (mount, filesystem) = line.split_once(" - ")?;
    if mount.split(' ').nth(3) != Some("/") {
        return None;
    }
    let mut fields = filesystem.split(' ');
    if fields.next() != Some("overlay") {
        return None;
    }
    let options = fields.nth(1)?;
    let mut upper = None;
    let mut lower = Vec::new();
    for option in options.split(',') {
        if let Some(dirs) = option.strip_prefix("lowerdir=") {
            for dir in dirs.split(':') {
                if dir.is_empty() {
                    // `a::b`: data-only layers follow.
                    return None;
                }
                lower.push(dir);
            }
        } else if let Some(dir) = option.strip_prefix("lowerdir+=") {
            lower.push(dir);
        } else if let Some(dir) = option.strip_prefix("upperdir=") {
            upper = Some(dir);
        } else if option.starts_with("datadir+=") {
            return None;
        }
    }
    if lower.is_empty() {
        return None;
    }
    let layers: Vec<PathBuf> = upper
        .into_iter()
        .chain(lower)
        .map(|d| PathBuf::from(unescape_mountinfo(d)))
        .collect();
    // A path with a separator overlayfs escaped is not read plainly: the tree is used
    // as it is.
    if layers.iter().any(|l| l.to_string_lossy().contains('\\')) {
        return None;
    }
    Some(layers)
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "\
22 1 259:1 / / rw,relatime - xfs /dev/vda1 rw
61 22 0:96 / /run/c/rootfs rw,relatime - overlay overlay rw,lowerdir=/s/2/fs:/s/1/fs,upperdir=/s/3/fs,workdir=/s/3/work,uuid=on
62 22 0:97 / /run/d/rootfs rw,relatime - overlay overlay rw,lowerdir+=/s/1/fs,lowerdir+=/s/0/fs
63 22 0:98 / /run/e/rootfs rw,relatime - overlay overlay rw,lowerdir=/s/1/fs::/s/9/fs
64 22 259:1 /srv /run/f/rootfs rw,relatime - xfs /dev/vda1 rw
65 22 0:99 / /run/g/a\\040b rw,relatime - overlay overlay rw,lowerdir=/s/a\\040b/fs
";

    #[test]
    fn an_overlay_mount_is_read_as_its_layers_topmost_first() {
        let layers = |p: &str| overlay_layers(INFO, Path::new(p));
        let paths = |v: &[&str]| Some(v.iter().map(PathBuf::from).collect::<Vec<_>>());
        assert_eq!(
            layers("/run/c/rootfs"),
            paths(&["/s/3/fs", "/s/2/fs", "/s/1/fs"])
        );
        assert_eq!(layers("/run/d/rootfs"), paths(&["/s/1/fs", "/s/0/fs"]));
        assert_eq!(layers("/run/g/a b"), paths(&["/s/a b/fs"]));
        // Data-only layers, another filesystem, no mount at all: the tree itself.
        assert_eq!(layers("/run/e/rootfs"), None);
        assert_eq!(layers("/run/f/rootfs"), None);
        assert_eq!(layers("/run/none"), None);
        assert_eq!(
            jail_lowers(Path::new("/nonexistent/tree")),
            [PathBuf::from("/nonexistent/tree")]
        );
    }
}
