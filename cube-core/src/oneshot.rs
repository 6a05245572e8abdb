//! One command, or one agent session, in a fresh jail started in this process: what
//! `cube run` and `cube code` use.
//!
//! No supervisor: a one-shot jail is never paused, snapshotted or reattached, and
//! measured end to end an ephemeral API sandbox was 1.4 times slower for one command
//! (the supervisor's start and round trips; `cube bench --engine jail` reports both
//! paths in `run_true`). The jail itself is the one a jail sandbox gets
//! ([`cube_supervisor::jail_spec::JailSpec`], the same agent bound in, the same
//! limits), except that nothing of it is kept: [`OneShotJail::exec`] gives it an
//! in-memory root and no cgroup unless a limit asks for one.
//!
//! ```no_run
//! // no_run: a jail needs root (namespaces, mounts).
//! use cube_core::oneshot::{Exit, OneShotJail, OneShotOptions};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let options = OneShotOptions::new("/var/lib/cube");
//! let mut jail = OneShotJail::exec(&options, &["true".to_string()])?;
//! let exit = jail.wait()?;
//! jail.destroy()?;
//! assert_eq!(exit, Exit::Exited(0));
//! # Ok(())
//! # }
//! ```

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use cube_jail::{Jail, JailConfig, Limits, Stdio};
use cube_supervisor::jail_network::{JailNetwork, JailNetworkError};
use cube_supervisor::jail_spec::{locate_agent, JailSpec, AGENT_ENV, AGENT_PATH};

use crate::network::NetworkOptions;
use crate::ErrorKind;

/// How a one-shot jail's command ended.
pub use cube_jail::JailExit as Exit;

/// The descriptor number the agent's socket gets inside a serving jail.
const AGENT_FD: i32 = 3;

/// Why a one-shot jail could not be started or ended.
#[derive(Debug, thiserror::Error)]
pub enum OneShotError {
    /// Jails need root (namespaces, mounts and cgroups).
    #[error("The jail engine needs root (namespaces, mounts and cgroups)")]
    NotRoot,
    /// The agent binary is missing.
    #[error("The agent binary is missing: {0}")]
    NoAgent(String),
    /// The jail's state directory could not be made.
    #[error("Creating {0}")]
    StateDir(PathBuf, #[source] std::io::Error),
    /// The agent's socket pair could not be made.
    #[error("Creating the agent socket")]
    Socket(#[source] std::io::Error),
    /// The jail could not be started, waited for, stopped or destroyed.
    #[error("The sandbox")]
    Jail(#[from] cube_jail::JailError),
    /// The network could not be attached.
    #[error("Attaching the network")]
    Network(#[from] JailNetworkError),
}

impl OneShotError {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            OneShotError::NotRoot => ErrorKind::HostCannot,
            OneShotError::NoAgent(_) => ErrorKind::NotFound,
            OneShotError::Network(e) => e.kind(),
            OneShotError::StateDir(..) | OneShotError::Socket(_) | OneShotError::Jail(_) => {
                ErrorKind::Internal
            }
        }
    }
}

/// Where a one-shot jail lives and what it may use.
#[derive(Clone, Debug)]
pub struct OneShotOptions {
    /// The store whose `tmp/` holds the jail's state directory.
    pub store_root: PathBuf,
    /// Memory limit of the whole jail, MiB.
    pub memory_mib: Option<u64>,
    /// Most processes and threads at once.
    pub pids_max: Option<u64>,
}

impl OneShotOptions {
    /// No limits, state under `store_root`'s `tmp/`.
    pub fn new(store_root: impl Into<PathBuf>) -> Self {
        OneShotOptions {
            store_root: store_root.into(),
            memory_mib: None,
            pids_max: None,
        }
    }

    /// The jail's configuration: the spec a jail sandbox gets, named after this
    /// process, with these limits and `env`.
    fn config(&self, env: Vec<(String, String)>) -> Result<JailConfig, OneShotError> {
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } != 0 {
            return Err(OneShotError::NotRoot);
        }
        let agent = locate_agent().map_err(OneShotError::NoAgent)?;
        if !agent.is_file() {
            return Err(OneShotError::NoAgent(format!(
                "{} does not exist (set {AGENT_ENV} to the agent's path)",
                agent.display()
            )));
        }
        // The store's scratch directory, made if missing: a one-shot jail needs no more
        // of the store.
        let tmp = cube_storage::Store::tmp_dir_at(&self.store_root);
        std::fs::create_dir_all(&tmp).map_err(|e| OneShotError::StateDir(tmp.clone(), e))?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!("run-{}-{nanos}", std::process::id());
        let state_dir = tmp.join(&name);
        Ok(JailSpec {
            name: &name,
            state_dir: &state_dir,
            agent: &agent,
            tree: None,
            seed: None,
            env,
            limits: Limits {
                memory_bytes: self.memory_mib.map(|m| m << 20),
                cpu_quota: None,
                pids_max: self.pids_max,
            },
        }
        .config())
    }
}

/// A running one-shot jail (with its network, when it has one). Destroy it with
/// [`OneShotJail::destroy`]; dropping it destroys it too.
pub struct OneShotJail {
    jail: Jail,
    state_dir: PathBuf,
    network: Option<JailNetwork>,
}

impl OneShotJail {
    /// Starts `command` as the jail's one command (`cube-agent --exec -- COMMAND`): it
    /// runs on this process's standard streams (a terminal among them stays out of
    /// reach of TIOCSTI: the jail has a session of its own), and the jail ends when it
    /// does, with its status. Nothing of it is kept: its root is a tmpfs, and it gets no
    /// cgroup unless a limit asks for one.
    pub fn exec(options: &OneShotOptions, command: &[String]) -> Result<Self, OneShotError> {
        let mut config = options.config(Vec::new())?;
        config.root = cube_jail::RootSpec::HostUserlandInMemory;
        config.pausable = false;
        config.stdin = Stdio::Inherit;
        config.stdout = Stdio::Inherit;
        config.stderr = Stdio::Inherit;
        let mut argv = vec![AGENT_PATH.to_string(), "--exec".into(), "--".into()];
        argv.extend(command.iter().cloned());
        let state_dir = config.state_dir.clone();
        let jail = Jail::spawn(&config, &argv)?;
        Ok(OneShotJail {
            jail,
            state_dir,
            network: None,
        })
    }

    /// Starts a jail whose agent serves its protocol on one end of a socket pair;
    /// returns the jail, the other end (for [`cube_agent::client::Client::new`]) and,
    /// with `pipe_log`, the read end of the agent's standard error (else it goes where
    /// this process's does).
    pub fn serve(
        options: &OneShotOptions,
        pipe_log: bool,
    ) -> Result<(Self, UnixStream, Option<File>), OneShotError> {
        let mut config = options.config(vec![("RUST_LOG".into(), "warn".into())])?;
        if pipe_log {
            config.stderr = Stdio::Pipe;
        }
        let (ours, theirs) = UnixStream::pair().map_err(OneShotError::Socket)?;
        let mut jail = Jail::spawn_with_fds(
            &config,
            &[AGENT_PATH, "--fd", "3"],
            &[(theirs.as_fd(), AGENT_FD)],
        )?;
        drop(theirs);
        let log = jail.take_stderr();
        let state_dir = config.state_dir.clone();
        Ok((
            OneShotJail {
                jail,
                state_dir,
                network: None,
            },
            ours,
            log,
        ))
    }

    /// Gives the jail a network from the host's pool (a veth into its namespace),
    /// released when the jail is destroyed.
    pub fn attach_network(&mut self, options: &NetworkOptions) -> Result<(), OneShotError> {
        let network = JailNetwork::attach(self.jail.pid(), options, &self.state_dir)?;
        self.network = Some(network);
        Ok(())
    }

    /// The host pid of the jail's init (the agent).
    pub fn pid(&self) -> i32 {
        self.jail.pid()
    }

    /// The jail's state directory.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Kills the jail's init: the kernel takes every process of it along.
    pub fn kill(&mut self) -> Result<(), OneShotError> {
        Ok(self.jail.kill()?)
    }

    /// Waits for the jail's init to end and reaps it.
    pub fn wait(&mut self) -> Result<Exit, OneShotError> {
        Ok(self.jail.wait()?)
    }

    /// Ends the jail (its processes, mounts, cgroup and state), then releases its
    /// network.
    pub fn destroy(self) -> Result<(), OneShotError> {
        let OneShotJail { jail, network, .. } = self;
        let destroyed = jail.destroy();
        // Released on drop; a failure is logged there (the device goes with the
        // jail's namespace regardless).
        drop(network);
        Ok(destroyed?)
    }
}
