//! The user a container image's config names (`User`: `name`, `uid`, `name:group`,
//! `uid:gid`, ...), resolved to numbers against the image's own `/etc/passwd` and
//! `/etc/group`, as container runtimes do when they start the image's processes: a
//! name must be in the image, a bare uid need not be (its group is then 0), and the
//! user's home directory comes along for `HOME`.
//!
//! The files are read inside the image's tree with `openat2(RESOLVE_IN_ROOT)`: the
//! image is untrusted, and a symlinked `/etc/passwd` must not read the host's.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::Path;

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

/// The most bytes of `/etc/passwd` or `/etc/group` read.
const MAX_BYTES: u64 = 4 << 20;

/// Why an image's user could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ImageUserError {
    /// The user is named, and the image's `/etc/passwd` has no such entry.
    #[error("the image's user {0:?} is not in its /etc/passwd")]
    NoSuchUser(String),
    /// The group is named, and the image's `/etc/group` has no such entry.
    #[error("the image's group {0:?} is not in its /etc/group")]
    NoSuchGroup(String),
    /// The `User` field is empty on one side of its `:`, or has more than one `:`.
    #[error("the image's User {0:?} is not `user` or `user:group`")]
    Malformed(String),
    /// The image's file could not be opened or read.
    #[error("reading the image's {0}")]
    Read(&'static str, #[source] std::io::Error),
    /// The image's file is larger than any account file should be.
    #[error("the image's {0} holds more than {MAX_BYTES} bytes")]
    TooLarge(&'static str),
}

/// An image's user, in numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageUser {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Home directory from the user's passwd entry, where it has one.
    pub home: Option<String>,
}

/// Resolves `user` (the image config's `User`) against the image tree at `root`.
pub fn resolve(root: &Path, user: &str) -> Result<ImageUser, ImageUserError> {
    let malformed = || ImageUserError::Malformed(user.to_string());
    let (name, group) = match user.split_once(':') {
        Some((_, g)) if g.is_empty() || g.contains(':') => return Err(malformed()),
        Some((n, g)) => (n, Some(g)),
        None => (user, None),
    };
    if name.is_empty() {
        return Err(malformed());
    }
    let passwd = read_in_root(root, "etc/passwd")?.unwrap_or_default();
    let entry = passwd
        .lines()
        .filter_map(PasswdEntry::parse)
        .find(|e| match name.parse::<u32>() {
            Ok(uid) => e.uid == uid,
            Err(_) => e.name == name,
        });
    let (uid, mut gid, home) = match (entry, name.parse::<u32>()) {
        (Some(e), _) => (e.uid, e.gid, Some(e.home.to_string())),
        (None, Ok(uid)) => (uid, 0, None),
        (None, Err(_)) => return Err(ImageUserError::NoSuchUser(name.to_string())),
    };
    if let Some(group) = group {
        gid = match group.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => {
                let groups = read_in_root(root, "etc/group")?.unwrap_or_default();
                groups
                    .lines()
                    .filter_map(group_entry)
                    .find(|(n, _)| *n == group)
                    .map(|(_, gid)| gid)
                    .ok_or_else(|| ImageUserError::NoSuchGroup(group.to_string()))?
            }
        };
    }
    let home = home.filter(|h| h.starts_with('/'));
    Ok(ImageUser { uid, gid, home })
}

/// One line of `/etc/passwd`: `name:password:uid:gid:gecos:home:shell`.
struct PasswdEntry<'a> {
    name: &'a str,
    uid: u32,
    gid: u32,
    home: &'a str,
}

impl<'a> PasswdEntry<'a> {
    /// The entry on `line`; None for comments and lines that are not one.
    fn parse(line: &'a str) -> Option<PasswdEntry<'a>> {
        let mut fields = line.split(':');
        let name = fields
            .next()
            .filter(|n| !n.is_empty() && !n.starts_with('#'))?;
        let _password = fields.next()?;
        let uid = fields.next()?.parse().ok()?;
        let gid = fields.next()?.parse().ok()?;
        let _gecos = fields.next()?;
        let home = fields.next()?;
        Some(PasswdEntry {
            name,
            uid,
            gid,
            home,
        })
    }
}

/// One line of `/etc/group` (`name:password:gid:members`): its name and gid.
fn group_entry(line: &str) -> Option<(&str, u32)> {
    let mut fields = line.split(':');
    let name = fields
        .next()
        .filter(|n| !n.is_empty() && !n.starts_with('#'))?;
    let _password = fields.next()?;
    let gid = fields.next()?.parse().ok()?;
    Some((name, gid))
}

/// The text of `rel` inside the tree at `root`, every symlink on the way resolved
/// inside it; None where there is no such file.
fn read_in_root(root: &Path, rel: &'static str) -> Result<Option<String>, ImageUserError> {
    let read = |e: std::io::Error| ImageUserError::Read(rel, e);
    let dir = std::fs::File::open(root).map_err(read)?;
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOCTTY | OFlag::O_NONBLOCK)
        .mode(Mode::empty())
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd: OwnedFd = match nix::fcntl::openat2(&dir, rel, how) {
        Ok(fd) => fd,
        Err(nix::errno::Errno::ENOENT) => return Ok(None),
        Err(e) => return Err(read(e.into())),
    };
    let file = std::fs::File::from(fd);
    if !file.metadata().map_err(read)?.is_file() {
        return Err(read(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a regular file",
        )));
    }
    let mut bytes = Vec::new();
    file.take(MAX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read)?;
    if bytes.len() as u64 > MAX_BYTES {
        return Err(ImageUserError::TooLarge(rel));
    }
    Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
                          # a comment\n\
                          broken line\n\
                          app:x:1000:1001:The app:/home/app:/bin/sh\n\
                          nohome:x:1002:1002::relative:/bin/sh\n";
    const GROUP: &str = "root:x:0:\nstaff:x:50:app\napp:x:1001:\n";

    fn image() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("etc")).unwrap();
        std::fs::write(dir.path().join("etc/passwd"), PASSWD).unwrap();
        std::fs::write(dir.path().join("etc/group"), GROUP).unwrap();
        dir
    }

    fn user(uid: u32, gid: u32, home: Option<&str>) -> ImageUser {
        ImageUser {
            uid,
            gid,
            home: home.map(str::to_string),
        }
    }

    #[test]
    fn names_and_numbers_resolve_as_container_runtimes_do() {
        let dir = image();
        let root = dir.path();
        for (spec, expected) in [
            ("app", user(1000, 1001, Some("/home/app"))),
            ("1000", user(1000, 1001, Some("/home/app"))),
            ("app:staff", user(1000, 50, Some("/home/app"))),
            ("app:7", user(1000, 7, Some("/home/app"))),
            ("4242", user(4242, 0, None)),
            ("4242:staff", user(4242, 50, None)),
            ("root", user(0, 0, Some("/root"))),
            ("nohome", user(1002, 1002, None)),
        ] {
            assert_eq!(resolve(root, spec).unwrap(), expected, "{spec}");
        }
    }

    #[test]
    fn unknown_or_malformed_users_are_refused_by_name() {
        let dir = image();
        let root = dir.path();
        for (spec, expected) in [
            ("ghost", "user \"ghost\" is not in its /etc/passwd"),
            ("app:ghosts", "group \"ghosts\" is not in its /etc/group"),
            (":50", "is not `user` or `user:group`"),
            ("app:", "is not `user` or `user:group`"),
            ("a:b:c", "is not `user` or `user:group`"),
        ] {
            let err = resolve(root, spec).unwrap_err().to_string();
            assert!(err.contains(expected), "{spec}: {err}");
        }
        // No account files at all: numbers still resolve, names cannot.
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(resolve(empty.path(), "7:8").unwrap(), user(7, 8, None));
        assert!(resolve(empty.path(), "app").is_err());
    }

    #[test]
    fn a_symlinked_passwd_is_read_inside_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::create_dir_all(root.join("usr/lib")).unwrap();
        std::fs::write(root.join("usr/lib/passwd"), PASSWD).unwrap();
        // Absolute: from the image's root, not the host's /usr/lib.
        std::os::unix::fs::symlink("/usr/lib/passwd", root.join("etc/passwd")).unwrap();
        assert_eq!(resolve(root, "app").unwrap().uid, 1000);
        // A link climbing out of the image stays in it (here it leads back to itself):
        // the host's /etc/passwd, which has root, is never read.
        std::fs::remove_file(root.join("etc/passwd")).unwrap();
        std::os::unix::fs::symlink("../../../../../etc/passwd", root.join("etc/passwd")).unwrap();
        assert!(resolve(root, "root").is_err());
    }
}
