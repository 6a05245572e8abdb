//! What a jail with Cube's agent is made of, as one spec for every path that starts
//! one: the supervisor's jail sandboxes, and the one-shot jails of `cube run` and
//! `cube code`, which run in the caller's process (no supervisor: one fewer process
//! and round trip on a path measured end to end).

use std::path::{Path, PathBuf};

use cube_jail::{JailConfig, Limits, ReadOnlyBind};

/// Where the agent binary appears inside the jail.
pub const AGENT_PATH: &str = "/.cube/cube-agent";
/// Environment variable naming the agent binary.
pub const AGENT_ENV: &str = "CUBE_AGENT";
/// File name of the agent binary.
pub const AGENT_BIN: &str = "cube-agent";

/// Processes and threads a jail sandbox may have at once when its creator names no
/// limit, on hosts with a pids cgroup controller: a fork bomb stops here instead of
/// filling the host's PID space, and interpreters, builds and test runners stay far
/// below it.
pub const DEFAULT_PIDS_MAX: u32 = cube_jail::DEFAULT_PIDS_MAX as u32;
/// Memory of a jail sandbox whose creator names no limit, MiB, on hosts with a memory
/// cgroup controller; its tmpfs count, and each is this big at most.
pub const DEFAULT_MEMORY_MIB: u64 = cube_jail::DEFAULT_MEMORY_BYTES >> 20;
/// CPU of a jail sandbox whose creator names no limit, in thousandths of a core, on
/// hosts with a cpu cgroup controller.
pub const DEFAULT_CPU_MILLIS: u32 = (cube_jail::DEFAULT_CPU_QUOTA * 1000.0) as u32;
/// What a jail sandbox's writable root may hold when its creator names no limit, MiB,
/// on a store with project quotas.
pub const DEFAULT_DISK_MIB: u64 = cube_jail::DEFAULT_DISK_BYTES >> 20;

/// Finds the agent binary: `$CUBE_AGENT`, else next to the running executable or one
/// directory up (where cargo puts binaries for test executables).
pub fn locate_agent() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os(AGENT_ENV) {
        return Ok(PathBuf::from(path));
    }
    let not_found = || {
        format!("cannot find the `{AGENT_BIN}` binary (set {AGENT_ENV} or install it next to `cube-supervisor`)")
    };
    let exe = std::env::current_exe().map_err(|_| not_found())?;
    let dir = exe.parent().ok_or_else(not_found)?;
    [dir.join(AGENT_BIN), dir.join("..").join(AGENT_BIN)]
        .into_iter()
        .find(|c| c.is_file())
        .ok_or_else(not_found)
}

/// A jail whose init is Cube's agent.
pub struct JailSpec<'a> {
    /// The jail's name (its cgroup's, where it has one).
    pub name: &'a str,
    /// Its state directory (mount points, writable layer).
    pub state_dir: &'a Path,
    /// The agent binary, bound read-only at [`AGENT_PATH`].
    pub agent: &'a Path,
    /// A built template's tree, read-only under an overlay root; None: the host's
    /// userland.
    pub tree: Option<&'a Path>,
    /// A layer to start on instead of an empty one (a copy of a snapshot's).
    pub seed: Option<PathBuf>,
    /// Environment of every process in the jail, after the jail's own.
    pub env: Vec<(String, String)>,
    /// Its cgroup limits (none: no cgroup, unless the jail must be pausable).
    pub limits: Limits,
}

impl JailSpec<'_> {
    /// The jail's configuration; the caller picks its standard streams and, for a
    /// jail that is never paused or kept, its in-memory root.
    pub fn config(self) -> JailConfig {
        let mut config = JailConfig::new(self.name, self.state_dir);
        if let Some(tree) = self.tree {
            // The template's own userland only: its python3 and pip, not the host's.
            // A tree that is an overlay mount goes in by its layers (see overlay_tree).
            config.root = cube_jail::RootSpec::Overlay {
                lower: crate::overlay_tree::jail_lowers(tree),
                host_userland: false,
            };
        }
        config.binds.push(ReadOnlyBind {
            source: self.agent.to_path_buf(),
            target: PathBuf::from(AGENT_PATH),
        });
        config.env.extend(self.env);
        config.limits = self.limits;
        config.seed_layer = self.seed;
        config
    }
}
