//! The agent binary: the sandbox's init, serving the host over a unix socket
//! (`--listen PATH`), a listening socket the host bound for it (`--listen-fd N`: the
//! socket's path can then lie outside the sandbox's root, where any host process
//! reaches it) or an already connected stream (`--fd N`); or, with `--exec -- CMD...`,
//! the init of a sandbox that runs one command and ends with it.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use cube_agent::init;
use cube_agent::reaper::Reaper;
use cube_agent::server::{Agent, AgentConfig};

const USAGE: &str = "usage: cube-agent (--listen <unix socket path> | --listen-fd <N> | --fd <N> \
                     | --vsock <port> [--modules <list>]) [--grace-ms <ms>] [--lifeline-fd <N>]\n       \
                     cube-agent --exec -- <command> [<argument>...]";

/// The vsock port the agent serves in a microVM when started without arguments.
const VM_AGENT_PORT: u32 = 1024;
/// The module list Cube's initramfs carries.
const VM_MODULE_LIST: &str = "/lib/modules/cube/modules.order";

enum Mode {
    Listen(PathBuf),
    ListenFd(RawFd),
    Fd(RawFd),
    /// Inside a microVM: listen on this vsock port.
    Vsock(u32),
    /// Run this command as the sandbox's only job and exit with its status.
    Exec(Vec<std::ffi::OsString>),
}

struct Args {
    mode: Mode,
    grace: Duration,
    /// Kernel modules to load first (a VM's initramfs lists its virtio drivers).
    modules: Option<PathBuf>,
    /// The read end of a pipe whose write end only the host holds: when it reads as
    /// closed, the host is gone and the agent shuts the sandbox down.
    lifeline: Option<RawFd>,
}

fn parse_args() -> Result<Args, String> {
    let mut mode = None;
    let mut grace = Duration::from_secs(2);
    let mut modules = None;
    let mut lifeline = None;
    let mut exec = None;
    let mut raw = std::env::args_os().skip(1);
    let mut before_exec = Vec::new();
    for arg in raw.by_ref() {
        if arg == "--exec" {
            // Everything after `--exec --` is the command, bytes as given.
            let rest: Vec<_> = raw.by_ref().collect();
            let command = match rest.split_first() {
                Some((dashes, command)) if dashes == "--" => command.to_vec(),
                _ => rest,
            };
            if command.is_empty() {
                return Err(format!("--exec needs a command\n{USAGE}"));
            }
            exec = Some(command);
            break;
        }
        before_exec.push(
            arg.into_string()
                .map_err(|a| format!("argument {a:?} is not UTF-8"))?,
        );
    }
    let mut args = before_exec.into_iter();
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--listen" => mode = Some(Mode::Listen(PathBuf::from(value()?))),
            "--fd" | "--listen-fd" => {
                let v = value()?;
                let fd: RawFd = v.parse().map_err(|_| format!("bad fd {v}"))?;
                if fd < 0 {
                    return Err(format!("bad fd {v}"));
                }
                mode = Some(if arg == "--fd" {
                    Mode::Fd(fd)
                } else {
                    Mode::ListenFd(fd)
                });
            }
            "--vsock" => {
                let v = value()?;
                mode = Some(Mode::Vsock(v.parse().map_err(|_| format!("bad port {v}"))?));
            }
            "--modules" => modules = Some(PathBuf::from(value()?)),
            "--lifeline-fd" => {
                let v = value()?;
                let fd: RawFd = v.parse().map_err(|_| format!("bad fd {v}"))?;
                if fd < 0 {
                    return Err(format!("bad fd {v}"));
                }
                lifeline = Some(fd);
            }
            "--grace-ms" => {
                let v = value()?;
                grace = Duration::from_millis(v.parse().map_err(|_| format!("bad grace {v}"))?);
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if let Some(command) = exec {
        if mode.is_some() {
            return Err(format!("--exec runs without a host channel\n{USAGE}"));
        }
        mode = Some(Mode::Exec(command));
    }
    // PID 1 of a microVM started from Cube's initramfs (scripts/build-initramfs.sh)
    // gets no arguments: serve vsock and load the initramfs's virtio modules.
    if mode.is_none() && cube_agent::init::is_pid1() {
        let list = PathBuf::from(VM_MODULE_LIST);
        if list.exists() {
            modules = modules.or(Some(list));
        }
        mode = Some(Mode::Vsock(VM_AGENT_PORT));
    }
    Ok(Args {
        mode: mode.ok_or(USAGE)?,
        grace,
        modules,
        lifeline,
    })
}

fn main() -> ExitCode {
    // First, before anything of the host's reaches this process's memory.
    if let Err(e) = init::forbid_inspection() {
        return fail(&e);
    }
    // Before any process is started: nothing it starts inherits a capability.
    if let Err(e) = init::keep_capabilities_to_itself() {
        return fail(&e);
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    if let Mode::Exec(command) = &args.mode {
        return exec_one(command);
    }
    // Before any thread starts, so every thread inherits the mask.
    let signals = match init::block_termination_signals() {
        Ok(s) => s,
        Err(e) => return fail(&e),
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // A log line that cannot be written is dropped: by default the subscriber
        // reports it with `eprintln!`, which panics when stderr fails too (a VM's
        // console whose UART the kernel could not set up), killing PID 1.
        .log_internal_errors(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    if !init::is_pid1() {
        if let Err(e) = init::become_subreaper() {
            tracing::warn!(error = %e, "orphans will not be reaped by the agent");
        }
    }
    let reaper = match Reaper::all() {
        Ok(r) => r,
        Err(e) => return fail(&e),
    };
    let mut env: Vec<(String, String)> = std::env::vars().collect();
    let mut default_user = None;
    // PID 1 on vsock: a microVM's init, which owns the guest's kernel filesystems,
    // its image's defaults, its random state and the NIC.
    let vm_init = matches!(args.mode, Mode::Vsock(_)) && init::is_pid1();
    if vm_init {
        // A VM built from a container image: its Env, WorkingDir and User.
        let path = std::path::Path::new(cube_agent::image_defaults::IMAGE_DEFAULTS_PATH);
        match cube_agent::image_defaults::ImageDefaults::load(path) {
            Ok(Some(defaults)) => {
                if let Err(e) = defaults.enter_working_dir() {
                    return fail(&e);
                }
                env = defaults.environment(env);
                default_user = defaults.user;
            }
            Ok(None) => {}
            Err(e) => return fail(&e),
        }
    }
    let agent = Agent::new(AgentConfig {
        reaper,
        env,
        default_user,
        vm_init,
    });
    if let Err(e) = init::spawn_signal_thread(signals, agent.clone(), args.grace) {
        return fail(&e);
    }
    if let Some(fd) = args.lifeline {
        let fd = match take_host_fd(fd) {
            Ok(fd) => fd,
            Err(code) => return code,
        };
        if let Err(e) = watch_lifeline(fd, agent.clone(), args.grace) {
            return fail(&e);
        }
    }
    tracing::info!(pid1 = init::is_pid1(), "cube-agent starting");
    if vm_init {
        if let Err(e) = cube_agent::vm_init::mount_kernel_filesystems() {
            return fail(&e);
        }
    }
    if let Some(list) = &args.modules {
        match cube_agent::vm_init::load_modules(list) {
            Ok(n) => tracing::info!(loaded = n, "kernel modules loaded"),
            Err(e) => return fail(&e),
        }
    }
    if vm_init {
        // A sandbox without a network still runs: its NIC just has nothing behind it.
        match cube_agent::vm_init::configure_network() {
            Ok(nic) => tracing::info!(nic, "network configured"),
            Err(e) => tracing::warn!(error = %e, "configuring the network failed"),
        }
    }
    if vm_init {
        // Clones of one VM snapshot must not share the kernel's random state.
        let _ = cube_agent::reseed::spawn_watcher();
    }
    match args.mode {
        Mode::Vsock(port) => {
            let listener = match cube_agent::transport::vsock::VsockListener::bind(port) {
                Ok(l) => l,
                Err(e) => return fail(&e),
            };
            tracing::info!(port, "listening on vsock");
            loop {
                match listener.accept() {
                    Ok(stream) => serve_in_thread(&agent, stream),
                    Err(e) => tracing::warn!(error = %e, "vsock accept failed"),
                }
            }
        }
        Mode::Fd(fd) => {
            let fd = match take_host_fd(fd) {
                Ok(fd) => fd,
                Err(code) => return code,
            };
            let stream = UnixStream::from(fd);
            let result = agent.serve(stream);
            init::shutdown(&agent, nix::sys::signal::Signal::SIGTERM, args.grace);
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
        Mode::Listen(path) => {
            // A socket left by an earlier run would make bind fail.
            if std::fs::symlink_metadata(&path)
                .map(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                .unwrap_or(false)
            {
                let _ = std::fs::remove_file(&path);
            }
            let listener = match UnixListener::bind(&path) {
                Ok(l) => l,
                Err(e) => return fail(&e),
            };
            serve_listener(&agent, &listener)
        }
        Mode::ListenFd(fd) => {
            let fd = match take_host_fd(fd) {
                Ok(fd) => fd,
                Err(code) => return code,
            };
            serve_listener(&agent, &UnixListener::from(fd))
        }
        Mode::Exec(command) => exec_one(&command),
    }
}

/// `--exec`: runs one command as init and exits with its status. No tracing, no
/// threads: the command's streams are the agent's own, and the only thing the host
/// reads back is the exit status.
fn exec_one(command: &[std::ffi::OsString]) -> ExitCode {
    if !init::is_pid1() {
        // Outside a PID namespace (tests), orphans still come back to us.
        let _ = init::become_subreaper();
    }
    match cube_agent::one_command::run(command) {
        Ok(status) => ExitCode::from(status),
        Err(e) => {
            let code = e.exit_status();
            let _ = fail(&e);
            ExitCode::from(code)
        }
    }
}

/// Takes ownership of a descriptor the host passed, made close-on-exec: the host
/// channel must not leak into the commands the agent runs, which could read or forge
/// its frames.
fn take_host_fd(fd: RawFd) -> Result<OwnedFd, ExitCode> {
    // SAFETY: F_GETFD only inspects the descriptor table entry for `fd`.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        eprintln!("fd {fd} is not open");
        return Err(ExitCode::from(2));
    }
    // SAFETY: F_SETFD on a descriptor checked open above; no memory involved.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
        eprintln!("fd {fd}: cannot set close-on-exec");
        return Err(ExitCode::from(2));
    }
    // SAFETY: the fd was handed to this process for the agent's exclusive use, is open
    // (checked above) and nothing else in this process owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Shuts the sandbox down once `fd` reads as closed: the host that held its write end
/// is gone (a supervisor killed outright leaves no one to stop its jail otherwise).
fn watch_lifeline(fd: OwnedFd, agent: Agent, grace: Duration) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("lifeline".into())
        .spawn(move || {
            let mut pipe = std::fs::File::from(fd);
            let mut buf = [0u8; 64];
            loop {
                match std::io::Read::read(&mut pipe, &mut buf) {
                    Ok(0) => break,
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "lifeline unreadable");
                        break;
                    }
                }
            }
            tracing::warn!("the host is gone: shutting down");
            init::shutdown(&agent, nix::sys::signal::Signal::SIGTERM, grace);
            std::process::exit(0);
        })
        .map(drop)
}

/// Serves each connection on its own thread, for as long as the listener lives.
fn serve_listener(agent: &Agent, listener: &UnixListener) -> ExitCode {
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => serve_in_thread(agent, stream),
            // Not a listening socket: no later accept can succeed either.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL | libc::EBADF | libc::ENOTSOCK)
                ) =>
            {
                return fail(&e);
            }
            Err(e) => tracing::warn!(error = %e, "accept failed"),
        }
    }
    ExitCode::SUCCESS
}

/// Serves one connection on its own thread.
fn serve_in_thread<T: cube_agent::transport::Transport>(agent: &Agent, stream: T) {
    let agent = agent.clone();
    let spawned = std::thread::Builder::new()
        .name("connection".into())
        .spawn(move || {
            if let Err(e) = agent.serve(stream) {
                tracing::warn!(error = %e, "connection ended");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no thread for a connection");
    }
}

fn fail(err: &dyn std::error::Error) -> ExitCode {
    let mut msg = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    eprintln!("cube-agent: {msg}");
    ExitCode::FAILURE
}
