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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cube_storage::SandboxDir;
use cube_vmm::persist::state::{read_state, GuestKind};
use cube_vmm::persist::MachineConfig;
use cube_vmm::test_guest::Machine;
use cube_vmm::vstate::KvmContext;

use crate::backend::{dispatch, SandboxBackend};
use crate::confinement::{confine, Profile};
use crate::error_report::chain as error_chain;
use crate::jail_sandbox::{JailSandbox, PrespawnedJail};
use crate::linux_sandbox::LinuxSandbox;
use crate::network::NetnsChoice;
use crate::protocol::{
    read_frame, write_frame, ErrorKind, Failure, ProtocolError, Request, Response, Settings,
    Source, PROTOCOL_VERSION,
};
use crate::test_guest_sandbox::{retire, TestGuestSandbox};

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

/// The sandbox a supervisor holds, of either engine.
type Held = Box<dyn SandboxBackend>;

struct State {
    sandbox: Mutex<Held>,
    /// Set under the lock once the sandbox is destroyed. Requests on other connections
    /// that come before the process exits are refused: the backend has nothing left
    /// to serve them with (a jail without processes reads as hibernated, and a wake
    /// would start one on a layer that is gone).
    destroyed: AtomicBool,
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
    /// A jail that starts from a snapshot or a template tree follows, which a jail
    /// started ahead on the host template cannot serve: the process only.
    JailFromImage,
}

impl std::str::FromStr for WarmFor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "any" => Ok(WarmFor::Any),
            "vm" => Ok(WarmFor::Vm),
            "jail" => Ok(WarmFor::Jail),
            "jail-from-image" => Ok(WarmFor::JailFromImage),
            other => Err(format!(
                "unknown warm-up {other:?} (any, vm, jail or jail-from-image)"
            )),
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
    let kvm = matches!(warm_for, WarmFor::Any | WarmFor::Vm).then(open_kvm);
    let scratch = scratch.filter(|_| matches!(warm_for, WarmFor::Any | WarmFor::Jail));
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
            cube_vmm::dirty_tracking::warm_up();
            let ctx = Arc::new(ctx);
            let shell = match Machine::shell(&ctx, MachineConfig::default()) {
                Ok(m) => {
                    // Off the create path: the sandbox's confinement then skips them.
                    if let Err(e) = crate::confinement::confine_vcpu_threads() {
                        tracing::warn!("confining the vCPU threads ahead: {}", error_chain(&e));
                    }
                    Some(m)
                }
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
    // A pool refill started this supervisor behind the creates; now it is one.
    crate::priority::normal_priority(std::process::id());
    let Request::Adopt {
        version,
        id,
        dir,
        source,
        ephemeral,
        settings,
    } = request
    else {
        reply(
            &mut writer,
            &Response::Error(Failure::invalid("expected Adopt")),
        )?;
        return Err(ServerError::NotAdopted);
    };
    if version != PROTOCOL_VERSION {
        reply(
            &mut writer,
            &Response::Error(Failure::invalid(format!(
                "protocol version {version} not supported (supervisor speaks {PROTOCOL_VERSION})"
            ))),
        )?;
        return Err(ServerError::NotAdopted);
    }
    let lifetime = settings.lifetime_ms.map(std::time::Duration::from_millis);
    let mut spare = None;
    let adopted = adopt(warm, &id, &dir, source, *settings, &mut spare);
    let mut held = match adopted {
        Ok(h) => h,
        Err(failure) => {
            retire(spare);
            reply(&mut writer, &Response::Error(failure))?;
            return Ok(());
        }
    };
    // Before anyone hears the sandbox is ready: it never serves unconfined.
    let confined = confine_for(held.as_ref());
    // The VM built ahead and not used goes only now: a thread tearing it down while
    // the threads are confined held the confinement up until the teardown's system
    // calls returned (up to 20 ms of a jail create here), and one started now runs
    // confined.
    retire(spare);
    if let Err(failure) = confined {
        held.destroy();
        join_retired_jails();
        reply(&mut writer, &Response::Error(failure))?;
        return Ok(());
    }
    let socket_path = SandboxDir::new(&dir).supervisor_socket();
    let _ = std::fs::remove_file(&socket_path);
    let listener =
        UnixListener::bind(&socket_path).map_err(|e| ServerError::Bind(socket_path.clone(), e))?;
    let state = Arc::new(State {
        sandbox: Mutex::new(held),
        destroyed: AtomicBool::new(false),
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
                remove_files(&s);
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
        // Nobody will call destroy for an ephemeral sandbox whose creator went away:
        // leave nothing behind in the store (a Destroy removed it already).
        remove_files(&state);
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
        let socket = SandboxDir::new(state.lock().dir()).supervisor_socket();
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
                let malformed = Failure::invalid(format!("malformed request: {e}"));
                let _ = reply(writer, &Response::Error(malformed));
                continue;
            }
            Err(_) => return false,
        };
        if matches!(request, Request::Destroy) {
            // The whole job is done here, directory and snapshots included, before the
            // answer: a caller killed after asking leaves no record of a sandbox that
            // is gone (the caller's own removal then finds nothing to do).
            destroy(state);
            remove_files(state);
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

/// Becomes the sandbox `source` describes, using what was warmed up where it fits; a
/// VM built ahead that it does not use is left in `spare`, for the caller to retire
/// once the supervisor is confined.
fn adopt(
    warm: Warm,
    id: &str,
    dir: &Path,
    source: Source,
    settings: Settings,
    spare: &mut Option<Machine>,
) -> Result<Held, Failure> {
    let jail_source = match &source {
        Source::Jail { layer } => Some((None, layer.clone())),
        Source::JailOverlay { tree, layer } => Some((Some(tree.clone()), layer.clone())),
        _ => None,
    };
    if let Some((tree, layer)) = jail_source {
        *spare = warm.kvm.and_then(Result::ok).and_then(|(_, shell)| shell);
        // The jail started ahead is on the host template, with an empty layer, no
        // CPU controller, and its own network namespace.
        let fits = tree.is_none()
            && layer.is_none()
            && settings.cpu_millis.is_none()
            && settings.cwd.is_none()
            && settings.netns == NetnsChoice::Own;
        let sandbox = match warm.jail {
            Some(ready) if fits => JailSandbox::adopt(id, dir, ready, settings)?,
            other => {
                retire_jail(other);
                JailSandbox::start(id, dir, tree, layer.as_deref(), settings)?
            }
        };
        return Ok(Box::new(sandbox));
    }
    retire_jail(warm.jail);
    let (ctx, shell) = warm.kvm.unwrap_or_else(open_kvm).map_err(|why| {
        Failure::new(
            ErrorKind::HostCannot,
            format!("the vm engine needs KVM, which this host lacks: {why}"),
        )
    })?;
    if let Source::Snapshot(snapshot) = &source {
        let state = read_state(snapshot)
            .map_err(|e| Failure::new(ErrorKind::SnapshotFailed, error_chain(&e)))?;
        if state.guest == GuestKind::Linux {
            // The pre-built shell is shaped for the test guest.
            *spare = shell;
            return Ok(Box::new(LinuxSandbox::restore(
                &ctx, dir, snapshot, &settings,
            )?));
        }
    }
    if settings.network.is_some() {
        *spare = shell;
        return Err(Failure::unsupported(
            "Cube's test guest has no network device: networks are for Linux VM and jail \
             sandboxes",
        ));
    }
    let sandbox = TestGuestSandbox::start(ctx, id, dir, &source, shell)?;
    Ok(Box::new(sandbox))
}

/// Drops what the sandbox's engine no longer needs (see [`crate::confinement`]).
fn confine_for(held: &dyn SandboxBackend) -> Result<(), Failure> {
    let profile = held.confinement();
    if profile != Profile::Jail {
        // A jail started ahead and retired for this VM is torn down with root's
        // capabilities: let it finish before they go.
        let start = std::time::Instant::now();
        join_retired_jails();
        tracing::debug!(waited = ?start.elapsed(), "retired jails joined");
    }
    confine(profile, held.dir()).map_err(|e| {
        Failure::new(
            ErrorKind::HostCannot,
            format!("confining the supervisor: {}", error_chain(&e)),
        )
    })
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

fn destroy(state: &State) {
    {
        let mut sandbox = state.lock();
        sandbox.destroy();
        state.destroyed.store(true, Ordering::SeqCst);
    }
    join_retired_jails();
}

/// Removes the sandbox's directory (its socket with it) and the snapshots it owns
/// from the store it lies in (a directory outside a store's layout is left alone),
/// when it ends without a library present.
fn remove_files(state: &State) {
    let dir = state.lock().dir().to_path_buf();
    let (Some(root), Some(id)) = (
        crate::confinement::filesystem::store_root_of(&dir),
        dir.file_name().and_then(|n| n.to_str()),
    ) else {
        return;
    };
    match cube_storage::Store::open(root) {
        Ok(store) => {
            // A confined VM supervisor reads no snapshot's record: the snapshots its
            // uid owns are those it staged.
            let removed = match crate::confinement::identity::running_as_own_uid() {
                Some(uid) => store.remove_sandbox_files_of_uid(id, uid),
                None => store.remove_sandbox_files(id),
            };
            if let Err(e) = removed {
                tracing::warn!("removing sandbox {id}: {}", error_chain(&e));
            }
        }
        Err(e) => tracing::warn!("opening store {}: {e}", root.display()),
    }
}

fn handle(state: &State, request: Request) -> Response {
    let mut sandbox = state.lock();
    if state.destroyed.load(Ordering::SeqCst) {
        let id = sandbox
            .dir()
            .file_name()
            .unwrap_or_default()
            .to_string_lossy();
        return Response::Error(Failure::new(
            ErrorKind::NotFound,
            format!("sandbox {id} was destroyed"),
        ));
    }
    match dispatch(sandbox.as_mut(), request) {
        Ok(response) => response,
        Err(failure) => Response::Error(failure),
    }
}
