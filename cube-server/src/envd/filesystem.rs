//! envd's `filesystem.Filesystem` service (stat, make_dir, move, list, remove) on the
//! agent's file requests. Relative paths are taken from the sandbox user's home, as
//! envd takes them.

use cube_agent::protocol::{FileInfo, FileKind};

use super::connect::{Code, RpcError};
use super::proto::{file_type, EntryInfo, Timestamp};

/// The sandbox user's home, where relative paths start.
pub const HOME: &str = "/home/user";

/// A path as the agent needs it: absolute, relative ones under the home directory,
/// `~` expanded.
pub fn resolve(path: &str) -> Result<String, RpcError> {
    if path.contains('\0') {
        return Err(RpcError::new(
            Code::InvalidArgument,
            "Path contains a NUL byte",
        ));
    }
    let p = if path.is_empty() || path == "~" {
        HOME.to_string()
    } else if let Some(rest) = path.strip_prefix("~/") {
        format!("{}/{rest}", HOME)
    } else if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{}/{path}", HOME)
    };
    Ok(p)
}

/// `ls -l`'s mode string, as Go's `FileMode.String` writes it (envd's `permissions`).
fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'L',
        _ => '-',
    });
    for (bit, ch) in [
        (0o400, 'r'),
        (0o200, 'w'),
        (0o100, 'x'),
        (0o040, 'r'),
        (0o020, 'w'),
        (0o010, 'x'),
        (0o004, 'r'),
        (0o002, 'w'),
        (0o001, 'x'),
    ] {
        s.push(if mode & bit != 0 { ch } else { '-' });
    }
    s
}

fn user_name(id: u32) -> String {
    match id {
        0 => "root".into(),
        _ => "user".into(),
    }
}

/// envd's `EntryInfo` for what the agent reported.
pub fn entry_info(info: &FileInfo) -> EntryInfo {
    let name = info
        .path
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or("")
        .to_string();
    let kind = match info.kind {
        FileKind::Dir => file_type::DIRECTORY,
        FileKind::Symlink => file_type::SYMLINK,
        _ => file_type::FILE,
    };
    EntryInfo {
        name,
        kind,
        path: info.path.clone(),
        size: i64::try_from(info.size).unwrap_or(i64::MAX),
        mode: info.mode,
        permissions: permissions(info.kind, info.mode),
        owner: user_name(info.uid),
        group: user_name(info.gid),
        modified_time: Some(Timestamp {
            seconds: info.modified_ns.div_euclid(1_000_000_000),
            nanos: info.modified_ns.rem_euclid(1_000_000_000) as i32,
        }),
        symlink_target: info.symlink_target.clone(),
        metadata: Default::default(),
        is_symlink: info.kind == FileKind::Symlink,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_under_home() {
        assert_eq!(resolve("a/b").unwrap(), "/home/user/a/b");
        assert_eq!(resolve("~/x").unwrap(), "/home/user/x");
        assert_eq!(resolve("").unwrap(), "/home/user");
        assert_eq!(resolve("/etc").unwrap(), "/etc");
        assert!(resolve("a\0b").is_err());
    }

    #[test]
    fn entries_read_like_envd() {
        let e = entry_info(&FileInfo {
            path: "/home/user/d".into(),
            kind: FileKind::Dir,
            size: 4096,
            mode: 0o755,
            uid: 1000,
            gid: 1000,
            modified_ns: 1_500_000_000,
            symlink_target: None,
        });
        assert_eq!(e.name, "d");
        assert_eq!(e.kind, file_type::DIRECTORY);
        assert_eq!(e.permissions, "drwxr-xr-x");
        assert_eq!(e.modified_time.unwrap().nanos, 500_000_000);
    }
}
