//! `cube run` and `cube code`: one command, or one code cell, in a fresh sandbox whose
//! PID 1 is Cube's agent; the sandbox is destroyed when the command ends, fails or is
//! interrupted, so nothing (process, mount, cgroup, file) outlives the invocation.
//!
//! The jail gets the agent binary bound read-only inside. For `cube run` the agent is
//! started as `cube-agent --exec -- CMD...`: init of the sandbox, it runs the
//! command on the standard streams this process was given (so output arrives as it is
//! written, stdin of any size or a terminal works, and nothing is copied on the way) and
//! exits with the command's status, which ends the sandbox. For `cube code` it gets one
//! end of a socket pair at fd 3 and serves the agent protocol; this process talks to it
//! over the other end. Each invocation is a new sandbox: nothing, not even a `cube
//! code` variable, carries over to the next one.
//!
//! They start their jail in this process ([`cube_core::oneshot`]) rather than through
//! the Sandbox API: an ephemeral API sandbox measured 1.4 times slower end to end on
//! the CI hosts (the supervisor start and its round trips; `cube bench --engine jail`
//! reports both paths in `run_true`), and a one-shot command gains nothing from a
//! supervisor. The jail is the one a jail sandbox gets (the same spec, agent and
//! limits). `cube sandbox exec` and `cube sandbox code` are the API's way to run a
//! command or a cell.
//!
//! With `--network` (or any policy flag, or `cube run --expose`) the jail gets a
//! device from the host's `cube-net` pool, as an API sandbox does, attached once its
//! agent answers and released when it is destroyed, on Ctrl-C too.

use std::io::{Read, Write};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use cube_agent::client::{Client, ClientError};
use cube_agent::protocol::{ErrorCode, ExecRequest, ExitInfo, Language, RequestBody, ResponseBody};
use cube_core::network::{NetworkOptions, PortMapping};
use cube_core::oneshot::{Exit, OneShotError, OneShotJail, OneShotOptions, Stdio};
use cube_core::EngineChoice;

use crate::cli_error::{chain, CliError, EXIT_INTERRUPTED, EXIT_TIMEOUT};
use crate::net_cmd::{NetworkArgs, PolicyArgs};
use crate::store_cmd::store_root;
use crate::terminal::{Resizer, SandboxTerminal};

/// How long past `--timeout` this process waits for the agent's own timeout report
/// before giving up on it (the sandbox is destroyed either way).
const TIMEOUT_GRACE: Duration = Duration::from_secs(5);

/// Largest standard input `cube sandbox exec` forwards to a command (it travels in one
/// agent message).
const MAX_STDIN: u64 = 3 << 20;

/// Which engine runs the sandbox.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Engine {
    /// The template's engine (the default template, host, is a jail).
    #[default]
    Auto,
    /// Linux namespaces, cgroups and seccomp around the host's userland.
    Jail,
    /// A KVM guest.
    Vm,
}

impl From<Engine> for EngineChoice {
    fn from(e: Engine) -> EngineChoice {
        match e {
            Engine::Auto => EngineChoice::Auto,
            Engine::Jail => EngineChoice::Jail,
            Engine::Vm => EngineChoice::Vm,
        }
    }
}

/// Options shared by `cube run` and `cube code`.
#[derive(Args, Debug)]
pub struct SandboxArgs {
    /// Engine to run the sandbox with.
    #[arg(long, value_enum, default_value_t = Engine::Auto)]
    engine: Engine,
    /// Kill the command after this many seconds and exit 124.
    #[arg(long, value_name = "S")]
    timeout: Option<f64>,
    /// Memory limit of the whole sandbox, MiB, its files included (its root, /tmp and
    /// /dev/shm are memory) [default: 2048 where the host has a memory cgroup
    /// controller].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    memory_mib: Option<u64>,
    /// CPU limit in thousandths of a core [default: 1000 where the host has a cpu
    /// cgroup controller].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    cpu_millis: Option<u32>,
    /// Most processes and threads alive at once in the sandbox; a fork bomb stops
    /// there [default: 4096 where the host has a pids cgroup controller].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pids_max: Option<u64>,
    /// What the sandbox's files may take, MiB; past it writes fail with ENOSPC inside
    /// [default: 4096 on a store with project quotas (a networked run's root is on
    /// disk), else the memory limit: a `cube run` root is memory].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    disk_mib: Option<u64>,
    /// Give the sandbox a network (NAT through the host; private ranges and the host
    /// refused unless allowed). Implied by the other network flags. Without it the
    /// sandbox has loopback only.
    #[arg(long)]
    network: bool,
    #[command(flatten)]
    policy: PolicyArgs,
}

/// `cube run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    sandbox: SandboxArgs,
    /// Serve a sandbox port on the host's addresses (not 127.0.0.1) while the
    /// command runs; repeatable. Implies --network.
    #[arg(long = "expose", value_name = "PORT[:SANDBOX_PORT]", value_parser = crate::net_cmd::parse_port)]
    expose: Vec<PortMapping>,
    /// The command and its arguments (after `--`); looked up in the sandbox's PATH.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

/// Languages of `cube code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CodeLanguage {
    /// Python 3.
    Python,
    /// Bash.
    Bash,
}

impl From<CodeLanguage> for Language {
    fn from(l: CodeLanguage) -> Language {
        match l {
            CodeLanguage::Python => Language::Python,
            CodeLanguage::Bash => Language::Bash,
        }
    }
}

/// `cube code`.
#[derive(Args, Debug)]
pub struct CodeArgs {
    #[command(flatten)]
    sandbox: SandboxArgs,
    /// Language of the cell.
    #[arg(long, value_enum, default_value_t = CodeLanguage::Python)]
    language: CodeLanguage,
    /// The code to run, or `-` to read it from standard input.
    code: String,
}

/// Runs `cube run`; returns the command's exit code.
pub fn run(store: Option<&Path>, args: &RunArgs) -> Result<u8, CliError> {
    check_engine(args.sandbox.engine)?;
    let timeout = timeout(&args.sandbox)?;
    let network = network_options(&args.sandbox, &args.expose)?;
    if network.is_some() {
        // The device goes into the jail's namespace once the jail runs, so the command
        // must wait for it: it goes through the agent protocol, as a `cube code` cell
        // does.
        return run_networked(store, args, timeout, network);
    }
    let options = oneshot_options(store, &args.sandbox)?;
    // The command writes straight to our streams, pipes and files as they are. A
    // terminal among them is replaced by one of the sandbox's own (see
    // `terminal`): the host's must not be reachable by TIOCSTI or have its
    // settings changed.
    let mut terminal = SandboxTerminal::open()?;
    let stream = |n: usize| match terminal.as_ref().and_then(|t| t.stream(n)) {
        Some(fd) => Stdio::Fd(fd),
        None => Stdio::Inherit,
    };
    let streams = [stream(0), stream(1), stream(2)];
    let resizer = terminal
        .as_ref()
        .map(SandboxTerminal::resizer)
        .transpose()?;
    // A closed stderr must not kill this process (SIGPIPE) before it destroys the
    // sandbox; what it writes there is best effort.
    // SAFETY: installs no handler; no memory effects.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let watch = Watch::start(timeout, resizer)?;
    {
        // Held across the spawn: an interrupt meanwhile waits, then kills the jail.
        let mut slot = watch.lock();
        // Nothing of a `cube run` sandbox is kept: its root needs no disk.
        let jail = OneShotJail::exec(&options, &args.command, streams)
            .map_err(|e| oneshot_error("creating the sandbox", e))?;
        slot.jail = Some(jail);
        if slot.outcome.is_some() {
            slot.kill();
        }
    }
    if let Some(terminal) = terminal.as_mut() {
        terminal.start()?;
    }
    let waited = watch.wait_for_init();
    let (exit, destroyed) = {
        let mut slot = watch.lock();
        match slot.jail.take() {
            Some(mut jail) => {
                let exit = jail.wait();
                let destroyed = jail.destroy();
                (exit, destroyed)
            }
            None => return Err(CliError::failed("the sandbox disappeared")),
        }
    };
    let outcome = watch.lock().outcome;
    // Its last output copied and the host terminal's settings back before anything
    // else is printed.
    if let Some(terminal) = terminal {
        terminal.finish();
    }
    destroyed.map_err(|e| CliError::failed(format!("destroying the sandbox: {}", chain(&e))))?;
    waited?;
    match outcome {
        Some(Outcome::Interrupted) => {
            let _ = writeln!(
                std::io::stderr(),
                "cube: interrupted, the sandbox was destroyed"
            );
            Ok(EXIT_INTERRUPTED)
        }
        Some(Outcome::TimedOut) => {
            let _ = writeln!(
                std::io::stderr(),
                "cube: the command ran out of time, the sandbox was destroyed"
            );
            Ok(EXIT_TIMEOUT)
        }
        None => match exit
            .map_err(|e| CliError::failed(format!("waiting for the sandbox: {}", chain(&e))))?
        {
            Exit::Exited(code) => Ok((code & 0xff) as u8),
            Exit::Signaled(sig) => Ok((128 + (sig & 0x7f)) as u8),
        },
    }
}

/// Why the sandbox of `cube run` was ended from outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Ctrl-C or SIGTERM.
    Interrupted,
    /// `--timeout` passed.
    TimedOut,
}

/// The running sandbox of `cube run`, shared with the thread that ends it on an
/// interrupt or at the deadline.
#[derive(Default)]
struct Slot {
    jail: Option<OneShotJail>,
    outcome: Option<Outcome>,
}

impl Slot {
    /// Kills the sandbox's init (the kernel takes every process of it along); the
    /// main thread, waiting for init, then reaps and destroys it.
    fn kill(&mut self) {
        if let Some(jail) = self.jail.as_mut() {
            if let Err(e) = jail.kill() {
                let _ = writeln!(
                    std::io::stderr(),
                    "cube: stopping the sandbox: {}",
                    chain(&e)
                );
            }
        }
    }
}

/// The watcher of `cube run`: a thread that takes SIGINT and SIGTERM (blocked in every
/// other thread) and the deadline, records why, and kills the sandbox; with a terminal
/// of the sandbox's own it also takes SIGWINCH and passes the new window size on.
struct Watch {
    slot: Arc<Mutex<Slot>>,
}

impl Watch {
    /// Starts the watcher. Must run before any other thread starts, so that every
    /// thread inherits the blocked signals and only the watcher receives them.
    fn start(timeout: Option<Duration>, resizer: Option<Resizer>) -> Result<Watch, CliError> {
        let mut signals = crate::interrupts::block()?;
        if resizer.is_some() {
            let mut winch = nix::sys::signal::SigSet::empty();
            winch.add(nix::sys::signal::Signal::SIGWINCH);
            winch
                .thread_block()
                .map_err(|e| CliError::failed(format!("blocking signals: {e}")))?;
            signals.add(nix::sys::signal::Signal::SIGWINCH);
        }
        let slot = Arc::new(Mutex::new(Slot::default()));
        let shared = Arc::clone(&slot);
        let deadline = timeout.map(|t| Instant::now() + t);
        std::thread::Builder::new()
            .name("watch".into())
            .spawn(move || {
                let outcome = loop {
                    match wait_signal_until(&signals, deadline) {
                        Some(libc::SIGWINCH) => {
                            if let Some(resizer) = &resizer {
                                resizer.resize();
                            }
                        }
                        Some(_) => break Outcome::Interrupted,
                        None => break Outcome::TimedOut,
                    }
                };
                let mut slot = shared.lock().unwrap_or_else(PoisonError::into_inner);
                slot.outcome.get_or_insert(outcome);
                slot.kill();
            })
            .map_err(|e| CliError::failed(format!("starting the watcher thread: {e}")))?;
        Ok(Watch { slot })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Blocks until the sandbox's init has ended, without reaping it: until it is
    /// reaped (under the lock) its pid cannot be reused, so a kill from the watcher
    /// meanwhile can only reach it.
    fn wait_for_init(&self) -> Result<(), CliError> {
        let Some(pid) = self.lock().jail.as_ref().map(OneShotJail::pid) else {
            return Ok(());
        };
        loop {
            // SAFETY: `info` is a live, zeroed siginfo_t that waitid fills in; `pid` is
            // our own unreaped child.
            let rc = unsafe {
                let mut info: libc::siginfo_t = std::mem::zeroed();
                libc::waitid(
                    libc::P_PID,
                    pid as libc::id_t,
                    &mut info,
                    libc::WEXITED | libc::WNOWAIT,
                )
            };
            if rc == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(CliError::failed(format!("waiting for the sandbox: {e}")));
            }
        }
    }
}

/// Waits for one of `signals` until `deadline` (for ever without one); the signal, or
/// None when the deadline passed first.
fn wait_signal_until(
    signals: &nix::sys::signal::SigSet,
    deadline: Option<Instant>,
) -> Option<libc::c_int> {
    loop {
        let Some(deadline) = deadline else {
            return signals.wait().ok().map(|s| s as libc::c_int);
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let ts = libc::timespec {
            tv_sec: left.as_secs() as libc::time_t,
            tv_nsec: left.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `signals` is a valid sigset and `ts` a live timespec; a null siginfo
        // pointer is allowed.
        let sig = unsafe { libc::sigtimedwait(signals.as_ref(), std::ptr::null_mut(), &ts) };
        if sig > 0 {
            return Some(sig);
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EAGAIN) => return None,
            _ => continue,
        }
    }
}

/// `cube run` with a network: the agent serves the protocol, the device is attached,
/// then the command runs with its output streamed back.
fn run_networked(
    store: Option<&Path>,
    args: &RunArgs,
    timeout: Option<Duration>,
    network: Option<NetworkOptions>,
) -> Result<u8, CliError> {
    let stdin = forwarded_stdin()?;
    let session = Session::start(store, &args.sandbox, network)?;
    let result = stream_exec(&session.client, &args.command, timeout, stdin);
    let destroyed = session.finish();
    let code = result?;
    destroyed?;
    Ok(code)
}

/// Runs `cube code`; exits 1 when the cell raised an error.
pub fn code(store: Option<&Path>, args: &CodeArgs) -> Result<u8, CliError> {
    check_engine(args.sandbox.engine)?;
    let timeout = timeout(&args.sandbox)?;
    let code = read_code(&args.code)?;
    let network = network_options(&args.sandbox, &[])?;
    let session = Session::start(store, &args.sandbox, network)?;
    let result = run_cell(
        &session.client,
        "main",
        args.language.into(),
        &code,
        timeout,
    );
    let destroyed = session.finish();
    let code = result?;
    destroyed?;
    Ok(code)
}

/// The code argument, or standard input for `-`.
pub fn read_code(arg: &str) -> Result<String, CliError> {
    if arg != "-" {
        return Ok(arg.to_string());
    }
    let mut s = String::new();
    std::io::stdin()
        .read_to_string(&mut s)
        .map_err(|e| CliError::failed(format!("reading the code from stdin: {e}")))?;
    Ok(s)
}

fn check_engine(engine: Engine) -> Result<(), CliError> {
    match engine {
        Engine::Auto | Engine::Jail => Ok(()),
        Engine::Vm => Err(CliError::unsupported(
            "the vm engine cannot run commands yet on this host: there is no \
             agent-capable guest yet",
        )
        .hint("use --engine jail (or leave --engine at auto)")),
    }
}

/// The network the flags ask for; None: loopback only. Checked before anything
/// starts.
fn network_options(
    args: &SandboxArgs,
    expose: &[PortMapping],
) -> Result<Option<NetworkOptions>, CliError> {
    NetworkArgs {
        network: args.network,
        policy: args.policy.clone(),
        expose: expose.to_vec(),
    }
    .options()
}

fn timeout(args: &SandboxArgs) -> Result<Option<Duration>, CliError> {
    parse_timeout(args.timeout)
}

/// A `--timeout` value: positive, finite seconds.
pub fn parse_timeout(seconds: Option<f64>) -> Result<Option<Duration>, CliError> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(CliError::usage(format!(
            "--timeout must be a positive number of seconds, not {s}"
        ))),
    }
}

/// Standard input to hand the command: all of it when it is a pipe or a file (the
/// agent takes stdin as one message, so a terminal, which never ends, is not read).
pub fn forwarded_stdin() -> Result<Vec<u8>, CliError> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::metadata("/proc/self/fd/0") else {
        return Ok(Vec::new());
    };
    let kind = meta.file_type();
    if !(kind.is_fifo() || kind.is_file()) {
        return Ok(Vec::new());
    }
    let mut data = Vec::new();
    std::io::stdin()
        .take(MAX_STDIN + 1)
        .read_to_end(&mut data)
        .map_err(|e| CliError::failed(format!("reading standard input: {e}")))?;
    if data.len() as u64 > MAX_STDIN {
        return Err(CliError::failed(format!(
            "standard input is larger than the {} MiB a command can be given",
            MAX_STDIN >> 20
        )));
    }
    Ok(data)
}

/// Where the jail of one invocation lives (the store's `tmp`) and the limits asked
/// for.
fn oneshot_options(store: Option<&Path>, args: &SandboxArgs) -> Result<OneShotOptions, CliError> {
    Ok(OneShotOptions {
        memory_mib: args.memory_mib,
        cpu_millis: args.cpu_millis,
        pids_max: args.pids_max,
        disk_mib: args.disk_mib,
        ..OneShotOptions::new(store_root(store)?)
    })
}

/// A one-shot jail that could not be started or ended, with the advice its kind gets.
fn oneshot_error(doing: &str, e: OneShotError) -> CliError {
    let message = format!("{doing}: {}", chain(&e));
    match e {
        OneShotError::NotRoot => CliError::of_kind(e.kind(), message).hint("run cube as root"),
        OneShotError::NoAgent(_) => CliError::of_kind(e.kind(), message)
            .hint("build it (cargo build -p cube-agent) or set CUBE_AGENT to its path"),
        _ => CliError::of_kind(e.kind(), message),
    }
}

/// The running sandbox: shared with the interrupt watcher, which destroys it on Ctrl-C.
type SharedJail = Arc<Mutex<Option<OneShotJail>>>;

/// One sandbox with its agent connected. Dropping it destroys the sandbox.
struct Session {
    jail: SharedJail,
    client: Client,
}

impl Session {
    fn start(
        store: Option<&Path>,
        args: &SandboxArgs,
        network: Option<NetworkOptions>,
    ) -> Result<Session, CliError> {
        let jail: SharedJail = Arc::new(Mutex::new(None));
        // Before any other thread exists, so the mask holds in all of them.
        destroy_on_interrupt(Arc::clone(&jail))?;
        // A closed stdout (`cube code ... | head`) must end in a clean destroy, not in
        // death by SIGPIPE.
        // SAFETY: installs no handler; no memory effects.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let options = oneshot_options(store, args)?;
        let ours = {
            // Held across the spawn: an interrupt meanwhile waits, then destroys it.
            let mut slot = jail.lock().unwrap_or_else(PoisonError::into_inner);
            let (spawned, ours, log) = OneShotJail::serve(&options, true)
                .map_err(|e| oneshot_error("creating the sandbox", e))?;
            if let Some(log) = log {
                forward_agent_log(log);
            }
            *slot = Some(spawned);
            ours
        };
        let client = match Client::new(ours) {
            Ok(c) => c,
            Err(e) => {
                let _ = destroy(&jail);
                return Err(CliError::failed(format!(
                    "the sandbox's agent did not answer: {}",
                    chain(&e)
                )));
            }
        };
        if let Some(options) = network {
            let mut slot = jail.lock().unwrap_or_else(PoisonError::into_inner);
            let attached = match slot.as_mut() {
                Some(running) => running
                    .attach_network(&options)
                    .map_err(|e| oneshot_error("attaching the network", e)),
                None => Ok(()),
            };
            drop(slot);
            if let Err(e) = attached {
                let _ = destroy(&jail);
                return Err(e);
            }
        }
        Ok(Session { jail, client })
    }

    /// Destroys the sandbox and reports whether everything went.
    fn finish(self) -> Result<(), CliError> {
        destroy(&self.jail)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // After `finish` this finds nothing left to do.
        if let Err(e) = destroy(&self.jail) {
            eprintln!("cube: {}", e.message);
        }
    }
}

/// Runs `argv` to its end, streaming its output; returns its exit code.
pub fn stream_exec(
    client: &Client,
    argv: &[String],
    timeout: Option<Duration>,
    stdin: Vec<u8>,
) -> Result<u8, CliError> {
    let req = ExecRequest {
        argv: argv.to_vec(),
        timeout_ms: timeout.map(|t| t.as_millis().clamp(1, u64::MAX.into()) as u64),
        stdin,
        ..ExecRequest::default()
    };
    let mut call = client.start(RequestBody::Exec(req)).map_err(agent_error)?;
    let deadline = timeout.map(|t| Instant::now() + t + TIMEOUT_GRACE);
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    loop {
        let next = match deadline {
            Some(d) => call.recv_timeout(d.saturating_duration_since(Instant::now())),
            None => call.recv(),
        };
        let body = match next {
            Ok(Some(body)) => body,
            Ok(None) => return Err(CliError::failed("the agent gave no exit status")),
            Err(ClientError::Timeout) => return Ok(EXIT_TIMEOUT),
            Err(e) => return Err(agent_error(e)),
        };
        match body {
            ResponseBody::Started { .. } => {}
            ResponseBody::Stdout(b) => {
                if stdout.write_all(&b).and_then(|()| stdout.flush()).is_err() {
                    // Nobody reads our output any more: end as a shell pipeline would.
                    return Ok(128 + libc::SIGPIPE as u8);
                }
            }
            ResponseBody::Stderr(b) => {
                let _ = stderr.write_all(&b);
            }
            ResponseBody::Exited(exit) => return Ok(exit_code(&exit)),
            ResponseBody::Error(e) => return Ok(not_started(&argv[0], &e)),
            other => {
                return Err(CliError::failed(format!(
                    "unexpected answer from the agent: {other:?}"
                )))
            }
        }
    }
}

/// Says why the agent did not start `program`; the exit code a shell gives then (127
/// not found, 126 not runnable, 1 otherwise).
pub fn not_started(program: &str, e: &cube_agent::protocol::ErrorReply) -> u8 {
    eprintln!("cube: cannot run {program}: {}", e.message);
    match e.code {
        ErrorCode::NotFound => 127,
        ErrorCode::PermissionDenied => 126,
        _ => 1,
    }
}

/// Runs one cell in context `context` (made if missing) and prints what it produced;
/// 1 when it raised.
pub fn run_cell(
    client: &Client,
    context: &str,
    language: Language,
    code: &str,
    timeout: Option<Duration>,
) -> Result<u8, CliError> {
    let contexts = client.list_contexts().map_err(agent_error)?;
    match contexts.iter().find(|c| c.name == context) {
        Some(c) if c.language != language => {
            return Err(CliError::failed(format!(
                "context {context} runs {:?}, not {language:?}",
                c.language
            )))
        }
        Some(_) => {}
        None => client
            .create_context(context, language, None)
            .map_err(agent_error)?,
    }
    let r = client
        .run_code(context, code, timeout)
        .map_err(agent_error)?;
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    let _ = stdout.write_all(r.stdout.as_bytes());
    let _ = stderr.write_all(r.stderr.as_bytes());
    if let Some(v) = &r.value {
        let _ = writeln!(stdout, "{v}");
    }
    let _ = stdout.flush();
    if r.timed_out {
        eprintln!("cube: the cell ran out of time");
        return Ok(EXIT_TIMEOUT);
    }
    if let Some(e) = &r.error {
        if e.traceback.is_empty() {
            eprintln!("{}: {}", e.name, e.value);
        } else {
            eprint!("{}", e.traceback);
            if !e.traceback.ends_with('\n') {
                eprintln!();
            }
        }
        return Ok(1);
    }
    Ok(match r.exit_status {
        Some(s) if s != 0 => (s & 0xff) as u8,
        _ => 0,
    })
}

/// Destroys the sandbox, holding the lock throughout so an interrupt arriving meanwhile
/// waits for the destroy instead of exiting under it.
fn destroy(jail: &SharedJail) -> Result<(), CliError> {
    let mut slot = jail.lock().unwrap_or_else(PoisonError::into_inner);
    match slot.take() {
        Some(running) => running
            .destroy()
            .map_err(|e| oneshot_error("destroying the sandbox", e)),
        None => Ok(()),
    }
}

/// On Ctrl-C or SIGTERM, destroys the sandbox and exits 130. Must run before any other
/// thread starts, so that every thread inherits the blocked signals and only the
/// watcher receives them.
fn destroy_on_interrupt(jail: SharedJail) -> Result<(), CliError> {
    let signals = crate::interrupts::block()?;
    std::thread::Builder::new()
        .name("interrupt".into())
        .spawn(move || {
            if signals.wait().is_err() {
                return;
            }
            eprintln!("cube: interrupted, destroying the sandbox");
            // The lock stays held until the exit, so the main thread, whose every path
            // after the spawn goes through `destroy`, cannot end the process first with
            // another code (or report the agent's death as an error).
            let mut slot = jail.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(running) = slot.take() {
                if let Err(e) = running.destroy() {
                    eprintln!("cube: destroying the sandbox: {}", chain(&e));
                }
            }
            std::process::exit(i32::from(EXIT_INTERRUPTED));
        })
        .map_err(|e| CliError::failed(format!("starting the interrupt watcher: {e}")))?;
    Ok(())
}

/// Copies the agent's own diagnostics to our stderr, marked as its; ends with the
/// sandbox.
fn forward_agent_log(log: std::fs::File) {
    let spawned = std::thread::Builder::new()
        .name("agent-log".into())
        .spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(log).lines() {
                let Ok(line) = line else { break };
                eprintln!("cube-agent: {line}");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "the agent's diagnostics will not be shown");
    }
}

/// The shell's convention: the exit code, or 128 + the signal that killed it; 124 when
/// the agent's timeout killed it.
pub fn exit_code(exit: &ExitInfo) -> u8 {
    if exit.timed_out {
        return EXIT_TIMEOUT;
    }
    match (exit.code, exit.signal) {
        (Some(c), _) => (c & 0xff) as u8,
        (None, Some(s)) => (128 + (s & 0x7f)) as u8,
        (None, None) => 1,
    }
}

/// A failed exchange with a sandbox's agent.
pub fn agent_error(e: ClientError) -> CliError {
    CliError::failed(format!("talking to the sandbox's agent: {}", chain(&e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell() {
        let e = |code, signal, timed_out| ExitInfo {
            code,
            signal,
            timed_out,
        };
        assert_eq!(exit_code(&e(Some(3), None, false)), 3);
        assert_eq!(exit_code(&e(None, Some(9), false)), 137);
        assert_eq!(exit_code(&e(None, Some(9), true)), 124);
        assert_eq!(exit_code(&e(Some(256), None, false)), 0);
    }

    #[test]
    fn timeouts_must_be_positive_and_finite() {
        assert!(matches!(parse_timeout(Some(0.5)), Ok(Some(_))));
        assert!(matches!(parse_timeout(None), Ok(None)));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(parse_timeout(Some(bad)).is_err());
        }
    }

    #[test]
    fn the_vm_engine_is_refused_with_a_pointer_to_jail() {
        let e = check_engine(Engine::Vm).err().unwrap();
        assert!(e.message.contains("vm engine cannot run commands"));
        assert!(e.hint.unwrap().contains("--engine jail"));
        assert!(check_engine(Engine::Auto).is_ok());
    }
}
