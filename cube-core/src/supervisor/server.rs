//! The supervisor: the process that holds one sandbox, a VM or a jail.
//!
//! It starts idle and pre-warmed with a connection to whoever spawned it: where
//! `/dev/kvm` opens, KVM is open, CPUID and MSR lists queried and a VM pre-built; where
//! the host can run jails and the spawner named a scratch directory, a host-template
//! jail already runs with its agent. A host without KVM still gets supervisors, which
//! serve jail sandboxes. It becomes a sandbox on its first request, then also listens
//! on a unix socket in the sandbox's directory so any process can reattach. A crash
//! stays inside this one sandbox.

use std::io::{BufReader, BufWriter, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::jail_sandbox::{JailSandbox, PrespawnedJail};
use super::linux_sandbox::LinuxSandbox;
use super::protocol::{
    read_frame, write_frame, MachineStatus, ProtocolError, Request, Response, Settings, Source,
    StatusReport, MAX_FRAME, PROTOCOL_VERSION,
};
use crate::error_report::chain as error_chain;
use crate::sandbox::metadata::{
    now_unix, Engine, SnapshotKind, SnapshotMeta, SNAPSHOT_META, SNAPSHOT_META_KIND,
};
use crate::snapshot::durability::{boot_id, make_durable};
use crate::snapshot::format::ROOTFS_FILE;
use crate::snapshot::MachineConfig;
use crate::test_guest::mailbox::field;
use crate::test_guest::Mode;
use crate::vmm::machine::SnapshotStats;
use crate::vmm::machine::{Machine, MachineError};
use crate::vstate::KvmContext;
use cube_storage::Durability;

/// The socket a supervisor listens on, inside its sandbox directory.
pub const SOCKET_FILE: &str = "supervisor.sock";
/// The hibernation image inside a sandbox directory.
pub const HIBERNATE_DIR: &str = "hibernate";

/// Why the supervisor could not serve.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The control connection failed.
    #[error("Control connection")]
    Protocol(#[from] ProtocolError),
    /// The sandbox socket could not be bound.
    #[error("Binding {0}")]
    Bind(PathBuf, #[source] std::io::Error),
    /// The first request was not an adoption.
    #[error("Expected an Adopt request first")]
    NotAdopted,
}

struct Sandbox {
    ctx: Arc<KvmContext>,
    id: String,
    dir: PathBuf,
    /// Background flushes of snapshots this sandbox wrote; joined before its files go.
    flushes: Vec<std::thread::JoinHandle<()>>,
    machine: Option<Machine>,
    hibernated: bool,
}

/// The sandbox a supervisor holds, of either engine.
enum Held {
    Vm(Sandbox),
    Jail(JailSandbox),
    Linux(LinuxSandbox),
}

impl Held {
    fn handle(&mut self, request: Request) -> Result<Response, String> {
        match self {
            Held::Vm(sandbox) => dispatch(sandbox, request),
            Held::Jail(sandbox) => sandbox.handle(request),
            Held::Linux(sandbox) => sandbox.handle(request),
        }
    }

    fn dir(&self) -> &Path {
        match self {
            Held::Vm(sandbox) => &sandbox.dir,
            Held::Jail(sandbox) => sandbox.dir(),
            Held::Linux(sandbox) => sandbox.dir(),
        }
    }

    fn destroy(&mut self) {
        match self {
            Held::Vm(sandbox) => {
                // Dropping the machine stops the vCPUs, closes the VM and unmaps memory.
                sandbox.machine = None;
                // A flush still writing into a snapshot directory would race its removal.
                for flush in std::mem::take(&mut sandbox.flushes) {
                    let _ = flush.join();
                }
            }
            Held::Jail(sandbox) => sandbox.destroy(),
            Held::Linux(sandbox) => sandbox.destroy(),
        }
    }
}

struct State {
    sandbox: Mutex<Held>,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Held> {
        self.sandbox.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What a supervisor prepares before its first request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WarmFor {
    /// Either engine (a pooled supervisor): KVM where it opens, and a jail ahead of
    /// time where a scratch directory was given.
    #[default]
    Any,
    /// A VM sandbox follows: open KVM and pre-build a VM.
    Vm,
    /// A jail sandbox follows: nothing to warm (KVM stays closed).
    Jail,
}

impl std::str::FromStr for WarmFor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "any" => Ok(WarmFor::Any),
            "vm" => Ok(WarmFor::Vm),
            "jail" => Ok(WarmFor::Jail),
            other => Err(format!("unknown warm-up {other:?} (any, vm or jail)")),
        }
    }
}

/// KVM and a pre-built VM, or why KVM cannot be used here.
type WarmKvm = Result<(Arc<KvmContext>, Option<Machine>), String>;

/// What a supervisor prepared before anyone asked for a sandbox.
struct Warm {
    /// None: not tried (opened on demand if a VM is asked for after all).
    kvm: Option<WarmKvm>,
    /// A host-template jail with its agent already running.
    jail: Option<PrespawnedJail>,
}

fn warm_up(scratch: Option<&Path>, warm_for: WarmFor, network: bool) -> Warm {
    let kvm = (warm_for != WarmFor::Jail).then(open_kvm);
    let scratch = scratch.filter(|_| warm_for != WarmFor::Vm);
    let mut jail = scratch.and_then(|dir| match PrespawnedJail::start(dir) {
        Ok(j) => Some(j),
        Err(e) => {
            tracing::debug!("no jail started ahead: {e}");
            None
        }
    });
    if let Some(jail) = jail.as_mut().filter(|_| network) {
        // Where it fails, a networked create attaches on its own path as it would
        // without this supervisor.
        if let Err(e) = jail.attach_standby_network() {
            tracing::warn!("no network attached ahead: {}", error_chain(&e));
        }
    }
    Warm { kvm, jail }
}

fn open_kvm() -> WarmKvm {
    match KvmContext::open() {
        Ok(ctx) => {
            // Probe and build a VM while idle in the pool, not on the create path.
            crate::vmm::dirty_tracking::warm_up();
            let ctx = Arc::new(ctx);
            let shell = match Machine::shell(&ctx, MachineConfig::default()) {
                Ok(m) => Some(m),
                Err(e) => {
                    tracing::warn!("pre-building a VM: {}", error_chain(&e));
                    None
                }
            };
            Ok((ctx, shell))
        }
        // A host without KVM still runs jail sandboxes: say why only if a VM is asked for.
        Err(e) => Err(error_chain(&e)),
    }
}

/// Runs a supervisor whose spawner holds the other end of `control`. Returns when the
/// sandbox is destroyed (or the spawner went away before adopting it). With
/// `scratch` (a directory on the store's filesystem), a jail is started ahead of time
/// there; `warm_for` says which engine to prepare for.
///
/// With `network`, the jail started ahead also gets a network device ahead (see
/// [`super::jail_network::JailNetwork::standby`]), for a networked create.
pub fn run(
    control: UnixStream,
    scratch: Option<&Path>,
    warm_for: WarmFor,
    network: bool,
) -> Result<(), ServerError> {
    let mut reader = BufReader::new(control.try_clone().map_err(ProtocolError::Io)?);
    let mut writer = BufWriter::new(control);
    let warm = warm_up(scratch, warm_for, network);
    // Warm: the pool hands this supervisor out only after this message.
    reply(&mut writer, &Response::Ok)?;
    let request: Request = match read_frame(&mut reader) {
        Ok(r) => r,
        // The spawner went away without using us: nothing to clean up.
        Err(ProtocolError::Closed) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let Request::Adopt {
        version,
        id,
        dir,
        source,
        ephemeral,
        settings,
    } = request
    else {
        reply(&mut writer, &Response::Error("expected Adopt".into()))?;
        return Err(ServerError::NotAdopted);
    };
    if version != PROTOCOL_VERSION {
        reply(
            &mut writer,
            &Response::Error(format!(
                "protocol version {version} not supported (supervisor speaks {PROTOCOL_VERSION})"
            )),
        )?;
        return Err(ServerError::NotAdopted);
    }
    let lifetime = settings.lifetime_ms.map(std::time::Duration::from_millis);
    let held = match adopt(warm, &id, &dir, source, settings) {
        Ok(h) => h,
        Err(message) => {
            reply(&mut writer, &Response::Error(message))?;
            return Ok(());
        }
    };
    let socket_path = dir.join(SOCKET_FILE);
    let _ = std::fs::remove_file(&socket_path);
    let listener =
        UnixListener::bind(&socket_path).map_err(|e| ServerError::Bind(socket_path.clone(), e))?;
    let state = Arc::new(State {
        sandbox: Mutex::new(held),
    });
    tracing::info!(sandbox = %id, "adopted");
    reply(&mut writer, &Response::Ok)?;

    if let Some(lifetime) = lifetime {
        let s = Arc::clone(&state);
        let sandbox = id.clone();
        std::thread::Builder::new()
            .name("lifetime".into())
            .spawn(move || {
                std::thread::sleep(lifetime);
                tracing::info!(sandbox = %sandbox, "lifetime over: destroying");
                destroy(&s);
                let _ = std::fs::remove_file(s.lock().dir().join(SOCKET_FILE));
                remove_files(&s, &sandbox);
                std::process::exit(0);
            })
            .map_err(|e| ServerError::Bind(socket_path.clone(), e))?;
    }

    let accept_state = Arc::clone(&state);
    std::thread::Builder::new()
        .name("accept".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                let s = Arc::clone(&accept_state);
                let _ = std::thread::Builder::new()
                    .name("client".into())
                    .spawn(move || serve_client(&s, stream));
            }
        })
        .map_err(|e| ServerError::Bind(socket_path.clone(), e))?;

    // The spawner's connection: when it closes, an ephemeral sandbox goes with it.
    let closed_by_destroy = serve_stream(&state, &mut reader, &mut writer);
    if ephemeral || closed_by_destroy {
        destroy(&state);
        let _ = std::fs::remove_file(&socket_path);
        if !closed_by_destroy {
            // Nobody will call destroy for an ephemeral sandbox whose creator went
            // away: leave nothing behind in the store.
            remove_files(&state, &id);
        }
        std::process::exit(0);
    }
    // A persistent sandbox outlives its creator: keep serving other clients.
    loop {
        std::thread::park();
    }
}

fn serve_client(state: &State, stream: UnixStream) {
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut writer = BufWriter::new(stream);
    if serve_stream(state, &mut reader, &mut writer) {
        destroy(state);
        let socket = state.lock().dir().join(SOCKET_FILE);
        let _ = std::fs::remove_file(socket);
        std::process::exit(0);
    }
}

/// Serves requests until the stream closes; returns true if the sandbox was destroyed.
fn serve_stream(
    state: &State,
    reader: &mut BufReader<UnixStream>,
    writer: &mut BufWriter<UnixStream>,
) -> bool {
    loop {
        let request: Request = match read_frame(reader) {
            Ok(r) => r,
            Err(ProtocolError::Closed) => return false,
            Err(ProtocolError::Decode(e)) => {
                let _ = reply(writer, &Response::Error(format!("malformed request: {e}")));
                continue;
            }
            Err(_) => return false,
        };
        if matches!(request, Request::Destroy) {
            destroy(state);
            let _ = reply(writer, &Response::Ok);
            return true;
        }
        let response = handle(state, request);
        if reply(writer, &response).is_err() {
            return false;
        }
    }
}

fn reply(writer: &mut BufWriter<UnixStream>, response: &Response) -> Result<(), ProtocolError> {
    write_frame(writer, response)?;
    writer.flush()?;
    Ok(())
}

/// Becomes the sandbox `source` describes, using what was warmed up where it fits.
fn adopt(
    warm: Warm,
    id: &str,
    dir: &Path,
    source: Source,
    settings: Settings,
) -> Result<Held, String> {
    let jail_source = match &source {
        Source::Jail { layer } => Some((None, layer.clone())),
        Source::JailOverlay { tree, layer } => Some((Some(tree.clone()), layer.clone())),
        _ => None,
    };
    if let Some((tree, layer)) = jail_source {
        retire(warm.kvm.and_then(Result::ok).and_then(|(_, shell)| shell));
        // The jail started ahead is on the host template, with an empty layer and no
        // CPU controller.
        let fits = tree.is_none()
            && layer.is_none()
            && settings.cpu_millis.is_none()
            && settings.netns == crate::sandbox::network::NetnsChoice::Own;
        let sandbox = match warm.jail {
            Some(ready) if fits => JailSandbox::adopt(id, dir, ready, settings)?,
            other => {
                retire_jail(other);
                JailSandbox::start(id, dir, tree, layer.as_deref(), settings)?
            }
        };
        return Ok(Held::Jail(sandbox));
    }
    retire_jail(warm.jail);
    let (ctx, shell) = warm
        .kvm
        .unwrap_or_else(open_kvm)
        .map_err(|why| format!("the vm engine needs KVM, which this host lacks: {why}"))?;
    if let Source::Snapshot(snapshot) = &source {
        let state = crate::snapshot::format::read_state(snapshot).map_err(|e| error_chain(&e))?;
        if state.guest == crate::snapshot::format::GuestKind::Linux {
            // The pre-built shell is shaped for the test guest.
            retire(shell);
            return Ok(Held::Linux(LinuxSandbox::restore(
                &ctx, dir, snapshot, &settings,
            )?));
        }
    }
    if settings.network.is_some() {
        retire(shell);
        return Err(
            "Cube's test guest has no network device: networks are for Linux VM and jail \
             sandboxes"
                .into(),
        );
    }
    let machine = start_machine(&ctx, &source, shell)?;
    Ok(Held::Vm(Sandbox {
        ctx,
        id: id.to_string(),
        flushes: Vec::new(),
        dir: dir.to_path_buf(),
        machine: Some(machine),
        hibernated: false,
    }))
}

/// Teardowns of unneeded pre-started jails still under way; joined before the
/// supervisor exits, so that none leaves its directory or cgroups behind.
static RETIRING_JAILS: Mutex<Vec<std::thread::JoinHandle<()>>> = Mutex::new(Vec::new());

/// Tears an unneeded pre-started jail down off the request path.
fn retire_jail(jail: Option<PrespawnedJail>) {
    if let Some(jail) = jail {
        let spawned = std::thread::Builder::new()
            .name("retire-jail".into())
            .spawn(move || drop(jail));
        match spawned {
            Ok(handle) => RETIRING_JAILS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(handle),
            // The jail was dropped (destroyed) with the closure.
            Err(e) => tracing::warn!("retiring a jail inline: {e}"),
        }
    }
}

fn join_retired_jails() {
    let handles = std::mem::take(&mut *RETIRING_JAILS.lock().unwrap_or_else(|e| e.into_inner()));
    for handle in handles {
        let _ = handle.join();
    }
}

fn start_machine(
    ctx: &Arc<KvmContext>,
    source: &Source,
    shell: Option<Machine>,
) -> Result<Machine, String> {
    let fail = |e: MachineError| error_chain(&e);
    match source {
        Source::Jail { .. } | Source::JailOverlay { .. } => {
            Err("a jail source cannot start a VM".into())
        }
        Source::Snapshot(dir) => {
            let state = crate::snapshot::format::read_state(dir).map_err(|e| error_chain(&e))?;
            if let Some(mut shell) = shell {
                match shell.load_in_place(dir, state) {
                    Ok(true) => return Ok(shell),
                    // Another shape: the shell is of no use.
                    Ok(false) => retire(Some(shell)),
                    Err(e) => {
                        tracing::warn!("loading into the pre-built VM: {}", error_chain(&e));
                        retire(Some(shell));
                    }
                }
            }
            Machine::restore(ctx, dir).map_err(fail)
        }
        Source::BootTestGuest {
            config,
            working_set,
        } => {
            retire(shell);
            Machine::boot_test_guest(ctx, *config, *working_set).map_err(fail)
        }
    }
}

fn destroy(state: &State) {
    state.lock().destroy();
    join_retired_jails();
}

fn remove_files(state: &State, id: &str) {
    let dir = state.lock().dir().to_path_buf();
    let Some(root) = dir.parent().and_then(|p| p.parent()) else {
        return;
    };
    match cube_storage::Store::open(root) {
        Ok(store) => {
            if let Err(e) = crate::sandbox::remove_sandbox_files(&store, id, &dir) {
                tracing::warn!("removing sandbox {id}: {e}");
            }
        }
        Err(e) => tracing::warn!("opening store {}: {e}", root.display()),
    }
}

/// Tears a replaced machine down off the request path: closing a VM and unmapping
/// its memory takes milliseconds the caller need not wait for.
fn retire(machine: Option<Machine>) {
    if let Some(machine) = machine {
        let spawned = std::thread::Builder::new()
            .name("retire".into())
            .spawn(move || drop(machine));
        // If no thread can be started the machine was dropped with the closure.
        if let Err(e) = spawned {
            tracing::warn!("retiring a machine inline: {e}");
        }
    }
}

fn handle(state: &State, request: Request) -> Response {
    let mut sandbox = state.lock();
    match sandbox.handle(request) {
        Ok(response) => response,
        Err(message) => Response::Error(message),
    }
}

fn machine(sandbox: &mut Sandbox) -> Result<&mut Machine, String> {
    if sandbox.hibernated {
        return Err("sandbox is hibernated: wake it first".into());
    }
    sandbox
        .machine
        .as_mut()
        .ok_or_else(|| "sandbox has no running machine".to_string())
}

fn dispatch(sandbox: &mut Sandbox, request: Request) -> Result<Response, String> {
    let fail = |e: MachineError| error_chain(&e);
    match request {
        Request::Adopt { .. } => Err("already adopted".into()),
        Request::Destroy => Ok(Response::Ok),
        Request::Status => Ok(Response::Status(status(sandbox))),
        Request::Pause => {
            machine(sandbox)?.pause().map_err(fail)?;
            Ok(Response::Ok)
        }
        Request::Resume => {
            machine(sandbox)?.resume().map_err(fail)?;
            Ok(Response::Ok)
        }
        Request::Snapshot { staging, dest } => {
            let dir = sandbox.dir.clone();
            let id = sandbox.id.clone();
            let m = machine(sandbox)?;
            let stats = write_snapshot(m, &id, &dir, &staging, &dest)?;
            sandbox.track_flush(flush_in_background(dest));
            Ok(Response::Snapshot {
                stats,
                kind: SnapshotKind::Full,
                fallback: None,
            })
        }
        Request::Rollback { snapshot } => {
            // Validate before touching anything: a bad snapshot leaves the sandbox as is.
            let state =
                crate::snapshot::format::read_state(&snapshot).map_err(|e| error_chain(&e))?;
            let staged_rootfs = stage_rootfs(&snapshot, &sandbox.dir)?;
            let in_place = match sandbox.machine.as_mut() {
                Some(m) if !sandbox.hibernated => match m.load_in_place(&snapshot, state) {
                    Ok(done) => done,
                    Err(e) => {
                        // Half-restored: discard it and build a fresh machine below.
                        tracing::warn!(
                            "rollback in place failed, restoring anew: {}",
                            error_chain(&e)
                        );
                        retire(sandbox.machine.take());
                        false
                    }
                },
                _ => false,
            };
            if !in_place {
                let restored = Machine::restore(&sandbox.ctx, &snapshot).map_err(fail)?;
                retire(sandbox.machine.replace(restored));
            }
            if let Some(staged) = staged_rootfs {
                std::fs::rename(&staged, sandbox.dir.join(ROOTFS_FILE))
                    .map_err(|e| format!("replacing rootfs: {e}"))?;
            }
            sandbox.hibernated = false;
            Ok(Response::Ok)
        }
        Request::Hibernate => {
            let dir = sandbox.dir.clone();
            let m = machine(sandbox)?;
            let image = dir.join(HIBERNATE_DIR);
            let staging = dir.join("hibernate.staging");
            let old = dir.join("hibernate.old");
            let _ = std::fs::remove_dir_all(&staging);
            let _ = std::fs::remove_dir_all(&old);
            // The rootfs stays where it is: only memory and CPU state leave.
            std::fs::create_dir(&staging)
                .map_err(|e| format!("creating {}: {e}", staging.display()))?;
            if let Err(e) = m.snapshot(&staging) {
                let _ = std::fs::remove_dir_all(&staging);
                return Err(error_chain(&e));
            }
            if image.exists() {
                std::fs::rename(&image, &old).map_err(|e| format!("moving old image: {e}"))?;
            }
            std::fs::rename(&staging, &image).map_err(|e| format!("committing image: {e}"))?;
            let _ = std::fs::remove_dir_all(&old);
            m.snapshot_committed(&image).map_err(|e| error_chain(&e))?;
            sandbox.machine = None;
            sandbox.track_flush(flush_in_background(image));
            sandbox.hibernated = true;
            Ok(Response::Ok)
        }
        Request::Wake => {
            if !sandbox.hibernated {
                return Err("sandbox is not hibernated".into());
            }
            let image = sandbox.dir.join(HIBERNATE_DIR);
            let m = Machine::restore(&sandbox.ctx, &image).map_err(fail)?;
            sandbox.machine = Some(m);
            sandbox.hibernated = false;
            Ok(Response::Ok)
        }
        Request::GuestDirty { mib, pattern } => {
            machine(sandbox)?.guest_dirty(mib, pattern).map_err(fail)?;
            Ok(Response::Ok)
        }
        Request::GuestMode { spin } => {
            let mode = if spin { Mode::Spin } else { Mode::Idle };
            machine(sandbox)?.guest_set_mode(mode).map_err(fail)?;
            Ok(Response::Ok)
        }
        Request::GuestWaitWorkingSet => {
            machine(sandbox)?.wait_working_set().map_err(fail)?;
            Ok(Response::Ok)
        }
        Request::ReadMemory { addr, len } => {
            if len > MAX_FRAME / 2 {
                return Err(format!("read of {len} bytes exceeds {}", MAX_FRAME / 2));
            }
            let m = machine(sandbox)?;
            let mut buf = vec![0u8; len as usize];
            m.memory()
                .inner()
                .read_slice(&mut buf, GuestAddress(addr))
                .map_err(|e| format!("reading guest memory at {addr:#x}: {e}"))?;
            Ok(Response::Memory(buf))
        }
        Request::MemoryDigest => {
            let m = machine(sandbox)?;
            let mut digests = Vec::new();
            let mut chunk = vec![0u8; 1 << 20];
            for region in m.memory().inner().iter() {
                let mut hasher = crc32fast::Hasher::new();
                let start = region.start_addr().0;
                let len = region.len();
                let mut offset = 0;
                while offset < len {
                    let n = (len - offset).min(chunk.len() as u64) as usize;
                    m.memory()
                        .inner()
                        .read_slice(&mut chunk[..n], GuestAddress(start + offset))
                        .map_err(|e| format!("reading guest memory: {e}"))?;
                    hasher.update(&chunk[..n]);
                    offset += n as u64;
                }
                digests.push(hasher.finalize());
            }
            Ok(Response::Digest(digests))
        }
        Request::NetworkStatus
        | Request::SetPolicy(_)
        | Request::Expose(_)
        | Request::Unexpose { .. } => Err("Cube's test guest has no network device".into()),
    }
}

/// Resident memory of this process, KiB.
pub(crate) fn own_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|pages| pages * 4)
        .unwrap_or(0)
}

fn status(sandbox: &Sandbox) -> StatusReport {
    let rss_kib = own_rss_kib();
    let pid = std::process::id();
    match &sandbox.machine {
        Some(m) => {
            let mb = m.mailbox();
            StatusReport {
                status: match m.fatal() {
                    Some(reason) => MachineStatus::Failed(reason),
                    None if m.is_running() => MachineStatus::Running,
                    None => MachineStatus::Paused,
                },
                pid,
                counter: mb.counter().unwrap_or(0),
                generation: mb.read(field::ACK_GENERATION).unwrap_or(0),
                guest_error: mb.read(field::ERROR).unwrap_or(0) != 0,
                config: Some(m.config()),
                rss_kib,
                engine: Engine::Vm,
                jail: None,
            }
        }
        None => StatusReport {
            status: MachineStatus::Hibernated,
            pid,
            counter: 0,
            generation: 0,
            guest_error: false,
            config: None,
            rss_kib,
            engine: Engine::Vm,
            jail: None,
        },
    }
}

/// Snapshot into `staging` with the rootfs and metadata, move the directory to `dest`,
/// and make it durable in the background.
fn write_snapshot(
    m: &mut Machine,
    sandbox_id: &str,
    sandbox_dir: &Path,
    staging: &Path,
    dest: &Path,
) -> Result<SnapshotStats, String> {
    let snapshot_id = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| format!("{} has no snapshot id", dest.display()))?;
    if dest.exists() {
        return Err(format!("{} already exists", dest.display()));
    }
    std::fs::create_dir(staging).map_err(|e| format!("creating {}: {e}", staging.display()))?;
    let was_running = m.is_running();
    let result = (|| {
        // Memory, vCPUs and disk must be taken at the same instant.
        m.pause().map_err(|e| error_chain(&e))?;
        let stats = m.snapshot(staging).map_err(|e| error_chain(&e))?;
        let rootfs = sandbox_dir.join(ROOTFS_FILE);
        if rootfs.exists() {
            cube_storage::clone_file(&rootfs, &staging.join(ROOTFS_FILE))
                .map_err(|e| error_chain(&e))?;
        }
        if was_running {
            m.resume().map_err(|e| error_chain(&e))?;
        }
        let meta = SnapshotMeta {
            id: snapshot_id,
            sandbox: sandbox_id.to_string(),
            created_unix: now_unix(),
            stats,
            kind: SnapshotKind::Full,
            engine: Engine::Vm,
            fallback: None,
            template: None,
        };
        let meta_bytes = serde_json::to_vec(&meta).map_err(|e| e.to_string())?;
        cube_storage::write_atomic_bytes_with(
            &staging.join(SNAPSHOT_META),
            SNAPSHOT_META_KIND,
            &meta_bytes,
            Durability::Deferred,
        )
        .map_err(|e| error_chain(&e))?;
        std::fs::rename(staging, dest).map_err(|e| format!("committing snapshot: {e}"))?;
        Ok(stats)
    })();
    match result {
        Ok(stats) => {
            m.snapshot_committed(dest).map_err(|e| error_chain(&e))?;
            Ok(stats)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(staging);
            if was_running {
                let _ = m.resume();
            }
            Err(e)
        }
    }
}

/// Syncs a finished snapshot to disk and marks it durable, off the request path.
pub(super) fn flush_in_background(dir: PathBuf) -> Option<std::thread::JoinHandle<()>> {
    let boot = match boot_id() {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!("snapshot {} stays unflushed: {e}", dir.display());
            return None;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("flush".into())
        .spawn(move || {
            if let Err(e) = make_durable(&dir, &boot) {
                tracing::warn!("flushing snapshot {}: {e}", dir.display());
            }
        });
    match spawned {
        Ok(handle) => Some(handle),
        Err(e) => {
            tracing::warn!("cannot start a flush thread: {e}");
            None
        }
    }
}

impl Sandbox {
    fn track_flush(&mut self, flush: Option<std::thread::JoinHandle<()>>) {
        self.flushes.retain(|f| !f.is_finished());
        self.flushes.extend(flush);
    }
}

/// Clones the snapshot's rootfs next to the sandbox's, ready to be renamed over it.
fn stage_rootfs(snapshot: &Path, sandbox_dir: &Path) -> Result<Option<PathBuf>, String> {
    let src = snapshot.join(ROOTFS_FILE);
    if !src.exists() {
        return Ok(None);
    }
    let tmp = sandbox_dir.join("rootfs.img.rollback");
    let _ = std::fs::remove_file(&tmp);
    cube_storage::clone_file(&src, &tmp).map_err(|e| error_chain(&e))?;
    Ok(Some(tmp))
}
