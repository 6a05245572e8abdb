//! `cube sandbox cp`, `cube sandbox ls ID PATH` and `cube sandbox cat`: files in and
//! out of a sandbox through its agent, streamed one chunk at a time (a 1 GiB file
//! never sits whole in memory).

use std::fs::File;
use std::io::{self, Write};
use std::path::PathBuf;

use cube_agent::client::{Client, ClientError};
use cube_agent::protocol::{ErrorCode, FileInfo, FileKind};
use cube_core::Runtime;

use crate::cli_error::{chain, CliError};
use crate::progress;
use crate::table::{human_bytes, Table};

/// One side of a copy: a local path, standard input/output (`-`), or `ID:/path`.
#[derive(Debug, PartialEq, Eq)]
pub enum Location {
    /// A path on the host.
    Local(PathBuf),
    /// Standard input (as a source) or output (as a destination).
    Stdio,
    /// A path inside a sandbox.
    Sandbox {
        /// Sandbox id.
        id: String,
        /// Absolute path inside it.
        path: String,
    },
}

impl Location {
    /// Parses `-`, `ID:/path` (text before the first `:` holding no `/`) or a local
    /// path; a local path with a colon is written `./a:b`.
    pub fn parse(arg: &str) -> Result<Location, CliError> {
        if arg == "-" {
            return Ok(Location::Stdio);
        }
        match arg.split_once(':') {
            Some((id, path)) if !id.is_empty() && !id.contains('/') => {
                if !path.starts_with('/') {
                    return Err(CliError::usage(format!(
                        "{arg:?}: the path inside a sandbox must be absolute ({id}:/{path})"
                    )));
                }
                Ok(Location::Sandbox {
                    id: id.to_string(),
                    path: path.to_string(),
                })
            }
            _ => Ok(Location::Local(PathBuf::from(arg))),
        }
    }
}

/// What went wrong talking to the agent, with the exit code its error class means.
pub fn agent_failure(what: &str, e: ClientError) -> CliError {
    match &e {
        ClientError::Agent(reply) if reply.code == ErrorCode::NotFound => {
            CliError::not_found(format!("{what}: {}", reply.message))
        }
        _ => CliError::failed(format!("{what}: {}", chain(&e))),
    }
}

fn agent(rt: &Runtime, id: &str) -> Result<Client, CliError> {
    Ok(rt.attach(id)?.agent()?)
}

fn base_name(path: &str) -> Option<&str> {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|s| !s.is_empty())
}

/// `cube sandbox cp SRC DST`; returns the bytes copied.
pub fn copy(rt: &Runtime, src: &str, dst: &str) -> Result<u64, CliError> {
    match (Location::parse(src)?, Location::parse(dst)?) {
        (Location::Sandbox { .. }, Location::Sandbox { .. }) => Err(CliError::usage(
            "both sides are inside sandboxes: copy to the host first",
        )),
        (Location::Sandbox { id, path }, to) => download(rt, &id, &path, to),
        (from, Location::Sandbox { id, path }) => upload(rt, from, &id, &path),
        _ => Err(
            CliError::usage("neither side is inside a sandbox: write one as ID:/path")
                .hint("list sandbox ids with `cube sandbox ls`"),
        ),
    }
}

fn upload(rt: &Runtime, from: Location, id: &str, path: &str) -> Result<u64, CliError> {
    let client = agent(rt, id)?;
    match from {
        Location::Stdio => client
            .write_file(path, &mut io::stdin().lock())
            .map_err(|e| agent_failure(&format!("writing {id}:{path}"), e)),
        Location::Local(local) => {
            let file = File::open(&local).map_err(|e| {
                let err = CliError::failed(format!("opening {}: {e}", local.display()));
                if e.kind() == io::ErrorKind::NotFound {
                    err.with_code(3)
                } else {
                    err
                }
            })?;
            let meta = file
                .metadata()
                .map_err(|e| CliError::failed(format!("reading {}: {e}", local.display())))?;
            if meta.is_dir() {
                return Err(CliError::usage(format!(
                    "{} is a directory: cp copies one file",
                    local.display()
                )));
            }
            // A destination that is a directory (or ends in /) gets the source's name.
            let mut target = path.to_string();
            let is_dir = path.ends_with('/')
                || matches!(
                    client.stat(path),
                    Ok(FileInfo {
                        kind: FileKind::Dir,
                        ..
                    })
                );
            if is_dir {
                let name = local
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                target = format!("{}/{name}", path.trim_end_matches('/'));
            }
            let bar = progress::bytes(meta.len(), &format!("{id}:{target}"));
            let result = client.write_file(&target, &mut bar.wrap_read(file));
            bar.finish_and_clear();
            result.map_err(|e| agent_failure(&format!("writing {id}:{target}"), e))
        }
        Location::Sandbox { .. } => Err(CliError::usage("copy between sandboxes")),
    }
}

fn download(rt: &Runtime, id: &str, path: &str, to: Location) -> Result<u64, CliError> {
    let client = agent(rt, id)?;
    let what = format!("reading {id}:{path}");
    let info = client.stat(path).map_err(|e| agent_failure(&what, e))?;
    if info.kind == FileKind::Dir {
        return Err(
            CliError::usage(format!("{id}:{path} is a directory: cp copies one file"))
                .hint(format!("list it with `cube sandbox ls {id} {path}`")),
        );
    }
    match to {
        Location::Stdio => {
            let stdout = io::stdout();
            let mut out = stdout.lock();
            let n = client
                .read_file(path, &mut out)
                .map_err(|e| agent_failure(&what, e))?;
            out.flush()
                .map_err(|e| CliError::failed(format!("writing standard output: {e}")))?;
            Ok(n)
        }
        Location::Local(mut local) => {
            if local.is_dir() {
                local.push(base_name(path).unwrap_or("file"));
            }
            // Written beside the destination and renamed into place when complete, so
            // an interrupted copy never leaves half a file under the real name.
            let partial = partial_path(&local);
            let file = File::create(&partial)
                .map_err(|e| CliError::failed(format!("creating {}: {e}", partial.display())))?;
            let bar = progress::bytes(info.size, &local.display().to_string());
            let mut out = io::BufWriter::with_capacity(1 << 20, bar.wrap_write(file));
            let result = client
                .read_file(path, &mut out)
                .map_err(|e| agent_failure(&what, e))
                .and_then(|n| {
                    out.flush().map_err(|e| {
                        CliError::failed(format!("writing {}: {e}", partial.display()))
                    })?;
                    std::fs::rename(&partial, &local).map_err(|e| {
                        CliError::failed(format!("renaming into {}: {e}", local.display()))
                    })?;
                    Ok(n)
                });
            bar.finish_and_clear();
            if result.is_err() {
                let _ = std::fs::remove_file(&partial);
            }
            result
        }
        Location::Sandbox { .. } => Err(CliError::usage("copy between sandboxes")),
    }
}

/// `DIR/.NAME.cube-partial-PID` for `DIR/NAME`.
fn partial_path(dest: &std::path::Path) -> PathBuf {
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    dest.with_file_name(format!(".{name}.cube-partial-{}", std::process::id()))
}

/// `cube sandbox cat ID PATH`: the file on standard output.
pub fn cat(rt: &Runtime, id: &str, path: &str) -> Result<(), CliError> {
    let client = agent(rt, id)?;
    let stdout = io::stdout();
    let mut out = stdout.lock();
    client
        .read_file(path, &mut out)
        .map_err(|e| agent_failure(&format!("reading {id}:{path}"), e))?;
    out.flush()
        .map_err(|e| CliError::failed(format!("writing standard output: {e}")))
}

fn kind_name(kind: FileKind) -> &'static str {
    match kind {
        FileKind::File => "file",
        FileKind::Dir => "dir",
        FileKind::Symlink => "link",
        FileKind::Other => "other",
    }
}

/// `cube sandbox ls ID PATH`: a directory's entries to `depth` levels.
pub fn list(rt: &Runtime, id: &str, path: &str, depth: u32, json: bool) -> Result<(), CliError> {
    if depth == 0 {
        return Err(CliError::usage("--depth must be at least 1"));
    }
    let client = agent(rt, id)?;
    let entries = client
        .list_dir(path, depth)
        .map_err(|e| agent_failure(&format!("listing {id}:{path}"), e))?;
    if json {
        let v: Vec<serde_json::Value> = entries
            .iter()
            .map(|e| {
                serde_json::json!({
                    "path": e.path,
                    "kind": kind_name(e.kind),
                    "size": e.size,
                    "mode": format!("{:04o}", e.mode),
                    "uid": e.uid,
                    "gid": e.gid,
                    "modified_ns": e.modified_ns,
                    "symlink_target": e.symlink_target,
                })
            })
            .collect();
        crate::table::print_json(&v)?;
        return Ok(());
    }
    let mut table = Table::new(&["MODE", "KIND", "SIZE", "MODIFIED", "PATH"]);
    for e in entries {
        let modified =
            crate::table::human_age(u64::try_from(e.modified_ns / 1_000_000_000).unwrap_or(0));
        let name = match &e.symlink_target {
            Some(t) => format!("{} -> {t}", e.path),
            None => e.path.clone(),
        };
        let size = if e.kind == FileKind::Dir {
            "-".to_string()
        } else {
            human_bytes(e.size)
        };
        table.row(vec![
            format!("{:04o}", e.mode),
            kind_name(e.kind).into(),
            size,
            modified,
            name,
        ]);
    }
    table.print();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse_sandbox_paths_stdio_and_local_paths() {
        assert_eq!(
            Location::parse("sb-0123:/tmp/a").ok(),
            Some(Location::Sandbox {
                id: "sb-0123".into(),
                path: "/tmp/a".into()
            })
        );
        assert_eq!(Location::parse("-").ok(), Some(Location::Stdio));
        assert_eq!(
            Location::parse("./a:b").ok(),
            Some(Location::Local("./a:b".into()))
        );
        assert_eq!(
            Location::parse("/x/y").ok(),
            Some(Location::Local("/x/y".into()))
        );
        let relative = Location::parse("sb-1:tmp/a").err().map(|e| e.code);
        assert_eq!(relative, Some(2));
    }

    #[test]
    fn partial_downloads_sit_beside_the_destination_hidden() {
        let p = partial_path(std::path::Path::new("/data/out.bin"));
        assert_eq!(p.parent(), Some(std::path::Path::new("/data")));
        let name = p
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        assert!(name.starts_with(".out.bin.cube-partial-"), "{name}");
    }

    #[test]
    fn base_names_ignore_trailing_slashes() {
        assert_eq!(base_name("/tmp/a.txt"), Some("a.txt"));
        assert_eq!(base_name("/tmp/dir/"), Some("dir"));
        assert_eq!(base_name("/"), None);
    }
}
