//! One container as the shim holds it: its root filesystem mounted from containerd's
//! snapshot, the Cube sandbox it runs in, its main process and its execs.
//!
//! Four roles (see [`Role`]): a container of its own (`ctr run`: a sandbox on its
//! root filesystem), a pod's pause container (the pod's sandbox, on the pause image's
//! root; nothing runs for the pause process), a container of a jail pod (processes in
//! the pod's sandbox, chrooted into its own root filesystem, which the shim shows
//! inside that sandbox: see [`crate::pod_mount`]), and a container of a VM pod (the
//! same in the pod's guest, chrooted into a copy of its root filesystem there: see
//! [`crate::guest_root`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use containerd_shim::protos::types::mount::Mount;
use cube_agent::client::Client;
use cube_core::network::NetnsChoice;
use cube_core::JailStatus;
use cube_core::{CreateOptions, EngineChoice, LimitChange, Runtime, Sandbox, SandboxError};

use crate::guest_root::{Copy, GuestRoot, GuestRootError};
use crate::pod_mount::{PodMount, PodMountError};
use crate::process::{AgentLink, Process, ProcessError};
use crate::spec::{Spec, SpecError};
use crate::vm_container::{VmContainerError, VmTemplate};

/// The bundle directory containerd's snapshot is mounted on.
pub const ROOTFS: &str = "rootfs";
/// Where a checkpoint's Cube snapshot archive goes inside containerd's checkpoint
/// directory.
pub const CHECKPOINT_ARCHIVE: &str = "cube-snapshot.cube";
/// Beside it: the main process's pid in the sandbox, for the restored container to
/// take it back (absent when the main process was not running).
pub const CHECKPOINT_INIT_PID: &str = "cube-init-pid";

/// Why a container operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    /// The bundle's spec is unusable.
    #[error("Bundle spec")]
    Spec(#[from] SpecError),
    /// The root filesystem could not be mounted.
    #[error("Mounting the root filesystem on {0}")]
    Mount(PathBuf, #[source] containerd_shim::Error),
    /// The mount point could not be made.
    #[error("Creating {0}")]
    MountPoint(PathBuf, #[source] std::io::Error),
    /// Cube refused or failed.
    #[error("Cube")]
    Cube(#[from] SandboxError),
    /// A process could not be started or signalled.
    #[error("Process")]
    Process(#[from] ProcessError),
    /// An exec id is unknown.
    #[error("No exec {0}")]
    NoExec(String),
    /// An exec id is in use.
    #[error("Exec {0} exists already")]
    ExecExists(String),
    /// The container's sandbox is gone.
    #[error("The container's sandbox was deleted")]
    Gone,
    /// The operation needs a process, and a pause container runs none.
    #[error("A pod's pause container runs nothing in Cube")]
    Placeholder,
    /// The operation would reach the whole pod, not one container of it.
    #[error("{0} one container of a pod is not supported: its sandbox is the pod's")]
    InPod(&'static str),
    /// The container's pod has no sandbox in this shim.
    #[error("Pod {0} has no sandbox in this shim")]
    NoPod(String),
    /// A bind of the spec could not be made in the container's root.
    #[error("Binding the spec's mounts")]
    Bind(#[from] crate::binds::BindError),
    /// The container's writable layer could not be given to the pod's uid.
    #[error("Giving {0} to the pod's uid")]
    Owner(PathBuf, #[source] std::io::Error),
    /// The container's root could not be shown in its pod's sandbox.
    #[error("Showing the root filesystem in the pod's sandbox")]
    PodMount(#[from] PodMountError),
    /// A checkpoint's files could not be written or read.
    #[error("Checkpoint file {0}")]
    CheckpointFile(PathBuf, #[source] std::io::Error),
    /// A checkpoint names its main process with something else than a pid.
    #[error("Checkpoint file {0} holds no pid")]
    CheckpointPid(PathBuf),
    /// The container cannot run on the VM engine.
    #[error("VM container")]
    Vm(#[from] VmContainerError),
    /// The container's root could not be put in its VM pod's guest.
    #[error("Putting the root filesystem in the pod's guest")]
    GuestRoot(#[from] GuestRootError),
}

/// containerd's snapshot mounted on the bundle's rootfs; unmounted on drop.
struct RootfsMount(PathBuf);

impl RootfsMount {
    fn mount(mounts: &[Mount], target: &Path) -> Result<Option<RootfsMount>, ContainerError> {
        if mounts.is_empty() {
            // The bundle's rootfs is ready as it is (`ctr run --rootfs`).
            return Ok(None);
        }
        std::fs::create_dir_all(target)
            .map_err(|e| ContainerError::MountPoint(target.to_path_buf(), e))?;
        let guard = RootfsMount(target.to_path_buf());
        for m in mounts {
            let fs_type = (!m.type_.is_empty()).then_some(m.type_.as_str());
            let source = (!m.source.is_empty()).then_some(m.source.as_str());
            containerd_shim::mount::mount_rootfs(fs_type, source, &m.options, target)
                .map_err(|e| ContainerError::Mount(target.to_path_buf(), e))?;
        }
        Ok(Some(guard))
    }
}

impl Drop for RootfsMount {
    fn drop(&mut self) {
        if let Some(path) = self.0.to_str() {
            if let Err(e) = containerd_shim::mount::umount_recursive(Some(path), libc::MNT_DETACH) {
                log::warn!("unmounting {path}: {e}");
            }
        }
    }
}

/// A container's sandbox and the agent connection its processes share.
struct SandboxLink {
    /// None for a pause container, and after delete.
    sandbox: Mutex<Option<Sandbox>>,
    agent: Mutex<Option<Arc<Client>>>,
    /// The jail's PID 1 on the host (0 for a pause container).
    jail_pid: u32,
}

impl SandboxLink {
    fn connect(&self) -> Result<Arc<Client>, ProcessError> {
        let sandbox = lock(&self.sandbox);
        let sandbox = sandbox.as_ref().ok_or(ProcessError::SandboxGone)?;
        Ok(Arc::new(sandbox.agent().map_err(ProcessError::Connect)?))
    }
}

impl AgentLink for SandboxLink {
    /// One connection per container, shared by its processes (signals reach only
    /// the execs of the connection they come on).
    fn current(&self) -> Result<Arc<Client>, ProcessError> {
        let mut cached = lock(&self.agent);
        if let Some(c) = cached.as_ref() {
            return Ok(Arc::clone(c));
        }
        let client = self.connect()?;
        *cached = Some(Arc::clone(&client));
        Ok(client)
    }

    fn reconnect(&self, lost: &Arc<Client>) -> Result<Option<Arc<Client>>, ProcessError> {
        let mut cached = lock(&self.agent);
        if let Some(c) = cached.as_ref().filter(|c| !Arc::ptr_eq(c, lost)) {
            return Ok(Some(Arc::clone(c)));
        }
        // Waits for the sandbox's lock: a snapshot under way (the reason connections
        // are dropped) ends first.
        match self.connect() {
            Ok(client) => {
                *cached = Some(Arc::clone(&client));
                Ok(Some(client))
            }
            Err(ProcessError::SandboxGone) => Ok(None),
            // The agent ended with its jail: nobody is there to answer.
            Err(_) if !Path::new(&format!("/proc/{}", self.jail_pid)).exists() => Ok(None),
            Err(e) => {
                cached.take();
                Err(e)
            }
        }
    }
}

/// What a container is to its sandbox.
#[derive(Debug)]
pub enum Role {
    /// A container with a sandbox of its own on its root filesystem.
    Own,
    /// A pod's pause container: it holds the pod's sandbox and runs nothing.
    PodSandbox,
    /// A container of a pod: its processes run in the pod's sandbox, chrooted into
    /// its root filesystem, shown there at the mount's inner path.
    InPod(Mutex<PodMount>),
    /// A container of a VM pod: its processes run in the pod's guest, chrooted into
    /// the copy of its root filesystem there.
    InVmPod(Mutex<GuestRoot>),
}

impl Role {
    /// Whether it is a container of a pod (of either engine).
    pub fn in_pod(&self) -> bool {
        matches!(self, Role::InPod(_) | Role::InVmPod(_))
    }
}

/// One container.
pub struct Container {
    /// Its id.
    pub id: String,
    /// Its bundle.
    pub bundle: PathBuf,
    /// Its main process.
    pub init: Arc<Process>,
    execs: Mutex<HashMap<String, Arc<Process>>>,
    link: Arc<SandboxLink>,
    /// The jail's PID 1 on the host; a VM's supervisor.
    jail_pid: u32,
    /// Whether its sandbox is a VM.
    vm: bool,
    /// The VM template built for it, removed after its sandbox.
    vm_template: Mutex<Option<VmTemplate>>,
    /// Its sandbox's own, the pod's, or its pod's guest.
    role: Role,
    /// Restored from a checkpoint: the main process's pid in the sandbox, running
    /// already, which start takes back instead of running the command.
    restored_init: Option<u32>,
    /// Declared after `link`: the sandbox (its overlay on the rootfs) goes first.
    rootfs: Mutex<Option<RootfsMount>>,
    /// Held through [`Container::destroy`]: a second destroy (a repeated kill, then
    /// the delete) waits for the first to finish before it reports the processes
    /// ended, and so before containerd can shut the shim down under it.
    ending: Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What [`Container::create`] needs besides the runtime.
pub struct CreateRequest<'a> {
    /// Container id.
    pub id: &'a str,
    /// Bundle directory.
    pub bundle: &'a Path,
    /// containerd's snapshot mounts.
    pub rootfs: &'a [Mount],
    /// The main process's FIFOs.
    pub stdio: crate::process::StdioPaths,
    /// A checkpoint directory to restore from (`ctr c restore --live`); empty: none.
    pub checkpoint: &'a str,
    /// The containerd namespace (a label on the sandbox).
    pub namespace: &'a str,
}

impl Container {
    /// Mounts the rootfs and starts the container's Cube sandbox on it (from a
    /// checkpoint or a named snapshot where asked); the main process waits for
    /// [`Container::start`]. For a pod's pause container (`pod_sandbox`), the sandbox
    /// is the pod's, made to host the pod's containers, and the pause process is the
    /// sandbox's PID 1: nothing of the pause image runs.
    pub fn create(
        runtime: &Arc<Runtime>,
        spec: &Spec,
        request: CreateRequest<'_>,
        pod_sandbox: bool,
    ) -> Result<Container, ContainerError> {
        let engine = spec.engine()?;
        let vm = engine == EngineChoice::Vm;
        if vm {
            refuse_for_vm(&request)?;
        }
        let process = spec.process()?.clone();
        let mut init = Process::new("", request.stdio, process)?;
        let target = request.bundle.join(ROOTFS);
        let mut mount = RootfsMount::mount(request.rootfs, &target)?;
        let mut labels = std::collections::BTreeMap::new();
        labels.insert("containerd.id".to_string(), request.id.to_string());
        labels.insert(
            "containerd.namespace".to_string(),
            request.namespace.to_string(),
        );
        if let Some(pod) = spec.pod() {
            labels.insert("kubernetes.pod".to_string(), pod.to_string());
        }
        let limits = spec.limits()?;
        let options = CreateOptions {
            memory_mib: limits.memory_mib,
            cpu_millis: limits.cpu_millis,
            pids_max: limits.pids_max,
            ephemeral: true,
            engine,
            metadata: labels,
            netns: spec.netns(),
            rootfs: Some(target.clone()),
            // A jail's agent needs leave to change roots; a VM's is the guest's root.
            hosts_containers: pod_sandbox && !vm,
            ..CreateOptions::new(true)
        };
        let mut restored_init = None;
        let mut vm_template = None;
        let sandbox = if vm {
            // The guest's root disk is the container's root (the pause image's, for a
            // pod); its shape is the template's (a VM's memory and vCPUs are fixed
            // when it is made). In a pod's network namespace (CNI's), the VM's NIC
            // is spliced to the pod's interface and the guest takes the pod's
            // address; the host's namespace (hostNetwork) cannot hold a guest kernel.
            let netns = match options.netns.clone() {
                NetnsChoice::Host => {
                    log::warn!(
                        "{}: a VM cannot share the host's network namespace; its guest has loopback only",
                        request.id
                    );
                    NetnsChoice::Own
                }
                other => other,
            };
            let options = CreateOptions {
                memory_mib: None,
                cpu_millis: None,
                pids_max: None,
                rootfs: None,
                netns,
                ..options
            };
            match spec.snapshot() {
                Some(snapshot) => runtime.create_from_snapshot(snapshot, options)?,
                None => {
                    let template = {
                        // The root is copied into the template's disk, with the spec's
                        // binds at their places (copies, not shares); everything
                        // mounted there, the root included, is let go after.
                        let _mounted = mount.take().unwrap_or_else(|| RootfsMount(target.clone()));
                        if !pod_sandbox {
                            crate::binds::bind_into(&target, spec.binds())?;
                        }
                        VmTemplate::build(runtime, request.namespace, request.id, &target, &limits)?
                    };
                    let sandbox = runtime.create(template.name(), options)?;
                    vm_template = Some(template);
                    sandbox
                }
            }
        } else if !request.checkpoint.is_empty() {
            let dir = Path::new(request.checkpoint);
            restored_init = read_init_pid(dir)?;
            let archive = dir.join(CHECKPOINT_ARCHIVE);
            let (snapshot, imported) = match runtime.import_snapshot(&archive) {
                Ok(r) => (r.snapshot, true),
                // The snapshot is in this store already (kept by whoever made it).
                Err(SandboxError::Portable(cube_core::PortableError::Exists(id))) => (id, false),
                Err(e) => return Err(e.into()),
            };
            let created = runtime.create_from_snapshot(&snapshot, options);
            if imported {
                // Only the vehicle of the checkpoint: the sandbox has its own copy.
                if let Err(e) = runtime.remove_snapshot(&snapshot) {
                    log::warn!("removing imported snapshot {snapshot}: {e}");
                }
            }
            created?
        } else if let Some(snapshot) = spec.snapshot() {
            runtime.create_from_snapshot(snapshot, options)?
        } else {
            runtime.create(cube_core::HOST_TEMPLATE, options)?
        };
        let mut sandbox = sandbox;
        let status = sandbox.status()?;
        let jail_pid = match status.jail {
            Some(jail) => jail.pid.unwrap_or(0),
            // A VM's processes have no host pids: its supervisor stands for them.
            None => status.pid,
        };
        if pod_sandbox {
            init = Process::placeholder(jail_pid);
        } else if !vm && request.checkpoint.is_empty() {
            // A pod's containers get theirs in join_pod; a restored checkpoint brings
            // its binds back itself (they are external mounts of its image).
            if let Err(e) = crate::binds::bind_into_sandbox(jail_pid, spec.binds()) {
                let _ = sandbox.destroy();
                return Err(e.into());
            }
        }
        Ok(Container {
            id: request.id.to_string(),
            bundle: request.bundle.to_path_buf(),
            init: Arc::new(init),
            execs: Mutex::new(HashMap::new()),
            link: Arc::new(SandboxLink {
                sandbox: Mutex::new(Some(sandbox)),
                agent: Mutex::new(None),
                jail_pid,
            }),
            jail_pid,
            vm,
            vm_template: Mutex::new(vm_template),
            role: if pod_sandbox {
                Role::PodSandbox
            } else {
                Role::Own
            },
            restored_init,
            rootfs: Mutex::new(mount),
            ending: Mutex::new(()),
        })
    }

    /// A container of the pod whose pause container is `pod`: its rootfs mounted on the
    /// host, then shown in the pod's sandbox; its processes will run there.
    pub fn join_pod(
        pod: &Container,
        spec: &Spec,
        request: CreateRequest<'_>,
    ) -> Result<Container, ContainerError> {
        if !matches!(pod.role, Role::PodSandbox) {
            return Err(ContainerError::NoPod(pod.id.clone()));
        }
        if !request.checkpoint.is_empty() {
            return Err(ContainerError::InPod("Restoring"));
        }
        let process = spec.process()?.clone();
        let init = Process::new("", request.stdio, process)?;
        let target = request.bundle.join(ROOTFS);
        let (role, mount) = if pod.vm {
            let root = copy_into_guest(pod, spec, request.rootfs, &target, request.id)?;
            (Role::InVmPod(Mutex::new(root)), None)
        } else {
            // Before the mount: overlayfs takes the root's owner when it is mounted.
            give_upper_dir(request.rootfs, pod.jail_pid)?;
            let mount = RootfsMount::mount(request.rootfs, &target)?;
            crate::binds::bind_into(&target, spec.binds())?;
            let shown = PodMount::attach(pod.jail_pid, &target, request.id)?;
            (Role::InPod(Mutex::new(shown)), mount)
        };
        Ok(Container {
            id: request.id.to_string(),
            bundle: request.bundle.to_path_buf(),
            init: Arc::new(init),
            execs: Mutex::new(HashMap::new()),
            link: Arc::clone(&pod.link),
            jail_pid: pod.jail_pid,
            vm: pod.vm,
            vm_template: Mutex::new(None),
            role,
            restored_init: None,
            rootfs: Mutex::new(mount),
            ending: Mutex::new(()),
        })
    }

    /// Whether it runs on the VM engine.
    pub fn is_vm(&self) -> bool {
        self.vm
    }

    /// The guest's memory of a VM container built from its image (None otherwise).
    pub fn vm_guest_bytes(&self) -> Option<u64> {
        lock(&self.vm_template)
            .as_ref()
            .map(VmTemplate::memory_bytes)
    }

    /// Whether this is a pod's pause container (its "process" runs nothing).
    pub fn is_placeholder(&self) -> bool {
        matches!(self.role, Role::PodSandbox)
    }

    /// Its role.
    pub fn role(&self) -> &Role {
        &self.role
    }

    /// The pid containerd knows the container by before its process starts.
    pub fn created_pid(&self) -> u32 {
        self.jail_pid
    }

    /// The root its processes run in, inside the sandbox (None: the sandbox's own).
    fn process_root(&self) -> Option<String> {
        match &self.role {
            Role::InPod(shown) => Some(lock(shown).inner().to_string()),
            Role::InVmPod(root) => Some(lock(root).inner().to_string()),
            _ => None,
        }
    }

    /// The process `exec_id` names ("" for the main one).
    pub fn process(&self, exec_id: &str) -> Result<Arc<Process>, ContainerError> {
        if exec_id.is_empty() {
            return Ok(Arc::clone(&self.init));
        }
        lock(&self.execs)
            .get(exec_id)
            .cloned()
            .ok_or_else(|| ContainerError::NoExec(exec_id.to_string()))
    }

    /// Adds an exec, not started.
    pub fn add_exec(&self, process: Process) -> Result<(), ContainerError> {
        if self.is_placeholder() {
            return Err(ContainerError::Placeholder);
        }
        let mut execs = lock(&self.execs);
        if execs.contains_key(&process.exec_id) {
            return Err(ContainerError::ExecExists(process.exec_id.clone()));
        }
        execs.insert(process.exec_id.clone(), Arc::new(process));
        Ok(())
    }

    /// Removes an exec.
    pub fn remove_exec(&self, exec_id: &str) -> Option<Arc<Process>> {
        lock(&self.execs).remove(exec_id)
    }

    /// Starts process `exec_id` (takes back the restored main process of a container
    /// restored from a checkpoint); `on_exit` runs when it ends. Returns its host pid.
    pub fn start(
        &self,
        exec_id: &str,
        on_exit: impl FnOnce(&Process, crate::process::Exit) + Send + 'static,
    ) -> Result<u32, ContainerError> {
        let process = self.process(exec_id)?;
        if self.is_placeholder() {
            return Ok(process.start_placeholder());
        }
        let link: Arc<dyn AgentLink> = self.link.clone();
        let jail_pid = self.jail_pid;
        let vm = self.is_vm();
        let host = move |inner| {
            if vm {
                jail_pid
            } else {
                host_pid(jail_pid, inner)
            }
        };
        Ok(match self.restored_init.filter(|_| exec_id.is_empty()) {
            Some(pid) => process.adopt(link, pid, host, on_exit)?,
            None => process.start(link, self.process_root(), vm, host, on_exit)?,
        })
    }

    /// Checkpoints the container into containerd's checkpoint directory `dir`: a Cube
    /// snapshot of the sandbox exported there as a portable archive, with the main
    /// process's pid for the restored container. The container runs on; its
    /// processes' relays connect again (the snapshot drops the agent's connections).
    pub fn checkpoint(
        &self,
        runtime: &Runtime,
        dir: &Path,
    ) -> Result<cube_core::Snapshot, ContainerError> {
        if !matches!(self.role, Role::Own) {
            return Err(ContainerError::InPod("Checkpointing"));
        }
        if self.is_vm() {
            return Err(VmContainerError::Unsupported("Checkpointing").into());
        }
        let before = lock(&self.link.agent).clone();
        let snapshot = self.with_sandbox(|sb| sb.snapshot())?;
        {
            // That connection ended with the snapshot (a relay may have replaced it).
            let mut cached = lock(&self.link.agent);
            if let (Some(c), Some(b)) = (cached.as_ref(), before.as_ref()) {
                if Arc::ptr_eq(c, b) {
                    cached.take();
                }
            }
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| ContainerError::CheckpointFile(dir.to_path_buf(), e))?;
        let exported = runtime.export_snapshot(&snapshot.id, &dir.join(CHECKPOINT_ARCHIVE));
        // The archive is the checkpoint; the store keeps no copy of each one.
        if let Err(e) = runtime.remove_snapshot(&snapshot.id) {
            log::warn!("removing checkpoint snapshot {}: {e}", snapshot.id);
        }
        exported?;
        // Only a snapshot with the processes restores the main process; one of the
        // files alone starts the command again.
        let init = self.init.sandbox_pid();
        if init != 0 && snapshot.kind == cube_core::SnapshotKind::Full {
            let path = dir.join(CHECKPOINT_INIT_PID);
            std::fs::write(&path, init.to_string())
                .map_err(|e| ContainerError::CheckpointFile(path, e))?;
        }
        Ok(snapshot)
    }

    /// Its sandbox's status (its supervisor's pid and memory, the machine's shape).
    pub fn status(&self) -> Result<cube_core::StatusReport, ContainerError> {
        let mut sandbox = lock(&self.link.sandbox);
        match sandbox.as_mut() {
            Some(sb) => Ok(sb.status()?),
            None => Err(ContainerError::Gone),
        }
    }

    /// What its sandbox is made of on the host, where it is a jail.
    pub fn jail(&self) -> Result<Option<JailStatus>, ContainerError> {
        let mut sandbox = lock(&self.link.sandbox);
        match sandbox.as_mut() {
            Some(sb) => Ok(sb.status()?.jail),
            None => Ok(None),
        }
    }

    /// Runs `f` on the sandbox, which must be the container's own (pausing one
    /// container of a pod would freeze the pod): `operation` names what is refused
    /// otherwise.
    pub fn with_own_sandbox<T>(
        &self,
        operation: &'static str,
        f: impl FnOnce(&mut Sandbox) -> Result<T, SandboxError>,
    ) -> Result<T, ContainerError> {
        if !matches!(self.role, Role::Own) {
            return Err(ContainerError::InPod(operation));
        }
        self.with_sandbox(f)
    }

    /// Changes the limits of the container's sandbox: its own, or the pod's for a
    /// pod's pause container. A container of a pod has none of its own to change.
    pub fn set_limits(&self, change: LimitChange) -> Result<(), ContainerError> {
        if self.role.in_pod() {
            return Err(ContainerError::InPod("Changing the resources of"));
        }
        self.with_sandbox(|sb| sb.set_limits(change))
    }

    /// Runs `f` on the sandbox.
    pub fn with_sandbox<T>(
        &self,
        f: impl FnOnce(&mut Sandbox) -> Result<T, SandboxError>,
    ) -> Result<T, ContainerError> {
        let mut sandbox = lock(&self.link.sandbox);
        match sandbox.as_mut() {
            Some(sb) => Ok(f(sb)?),
            None if self.is_placeholder() => Err(ContainerError::Placeholder),
            None => Err(ContainerError::Gone),
        }
    }

    /// Ends the container: its sandbox (every process in it) where the sandbox is its
    /// own or the pod's; for a container of a pod, its processes, and its root taken
    /// out of the pod's sandbox. Then unmounts the rootfs. Idempotent.
    pub fn destroy(&self) -> Result<(), ContainerError> {
        let _ending = lock(&self.ending);
        let result = match &self.role {
            Role::Own | Role::PodSandbox => {
                lock(&self.link.agent).take();
                let sandbox = lock(&self.link.sandbox).take();
                let destroyed = match sandbox {
                    Some(sb) => sb.destroy().map_err(ContainerError::from),
                    None => Ok(()),
                };
                // Its template, now that no sandbox uses it.
                let removed = match lock(&self.vm_template).as_mut() {
                    Some(template) => template.remove().map_err(ContainerError::from),
                    None => Ok(()),
                };
                destroyed.and(removed)
            }
            Role::InPod(shown) => {
                self.kill_processes();
                lock(shown).detach().map_err(ContainerError::from)
            }
            Role::InVmPod(root) => {
                self.kill_processes();
                match self.link.current() {
                    Ok(agent) => lock(root).remove(&agent).map_err(ContainerError::from),
                    // The pod's guest is gone, and the copy with it.
                    Err(ProcessError::SandboxGone) => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
        };
        // Whatever ran in it has ended with it.
        for process in lock(&self.execs)
            .values()
            .chain(std::iter::once(&self.init))
        {
            process.finish(crate::process::Exit {
                status: 128 + libc::SIGKILL as u32,
                at: std::time::SystemTime::now(),
            });
        }
        lock(&self.rootfs).take();
        result
    }
}

impl Container {
    /// The host pids of this container's processes that run.
    pub fn running_pids(&self) -> Vec<u32> {
        lock(&self.execs)
            .values()
            .chain(std::iter::once(&self.init))
            .filter_map(|p| match p.status() {
                (crate::process::Phase::Running, pid, None) if pid != 0 => Some(pid),
                _ => None,
            })
            .collect()
    }

    /// SIGKILL to the process group of every process of this container still running,
    /// waiting (a few seconds at most) for the agent to see them end.
    fn kill_processes(&self) {
        let processes: Vec<Arc<Process>> = lock(&self.execs)
            .values()
            .cloned()
            .chain(std::iter::once(Arc::clone(&self.init)))
            .collect();
        for process in &processes {
            if let Err(e) = process.kill(libc::SIGKILL as u32) {
                log::warn!("killing a process of {}: {e}", self.id);
            }
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        for process in &processes {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            process.wait_timeout(left);
        }
    }
}

/// A VM pod's container's root: `rootfs` mounted on the host at `target`, copied into
/// the pod's guest with the spec's binds, and unmounted again.
fn copy_into_guest(
    pod: &Container,
    spec: &Spec,
    rootfs: &[Mount],
    target: &Path,
    id: &str,
) -> Result<GuestRoot, ContainerError> {
    let copies: Vec<Copy> = spec
        .binds()
        .map(|b| Copy {
            source: PathBuf::from(&b.source),
            destination: b.destination.clone(),
        })
        .collect();
    let _mount = RootfsMount::mount(rootfs, target)?;
    let agent = pod.link.current()?;
    Ok(GuestRoot::install(&agent, target, &copies, id)?)
}

/// Refuses what a VM container cannot do yet (see [`crate::vm_container`]).
fn refuse_for_vm(request: &CreateRequest<'_>) -> Result<(), VmContainerError> {
    if !request.checkpoint.is_empty() {
        return Err(VmContainerError::Unsupported("Restoring a checkpoint"));
    }
    Ok(())
}

/// Gives the top directory of the container's writable layer (the `upperdir` of
/// containerd's overlay) to the uid and gid the pod's sandbox runs as, which the
/// processes of its containers run as too: as in a container with a sandbox of its
/// own, they may then create files in the root directory. The image's files keep
/// their owners.
fn give_upper_dir(mounts: &[Mount], jail_pid: u32) -> Result<(), ContainerError> {
    let Some(upper) = mounts
        .iter()
        .filter(|m| m.type_ == "overlay")
        .flat_map(|m| m.options.iter())
        .find_map(|o| o.strip_prefix("upperdir="))
    else {
        return Ok(());
    };
    let status_path = PathBuf::from(format!("/proc/{jail_pid}/status"));
    let status = std::fs::read_to_string(&status_path)
        .map_err(|e| ContainerError::Owner(status_path.clone(), e))?;
    let id = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|ids| ids.split_whitespace().next())
            .and_then(|id| id.parse::<u32>().ok())
    };
    let (Some(uid), Some(gid)) = (id("Uid:"), id("Gid:")) else {
        return Err(ContainerError::Owner(
            status_path,
            std::io::Error::other("no Uid or Gid line"),
        ));
    };
    std::os::unix::fs::lchown(upper, Some(uid), Some(gid))
        .map_err(|e| ContainerError::Owner(PathBuf::from(upper), e))
}

/// The main process's pid a checkpoint directory records, if any.
fn read_init_pid(dir: &Path) -> Result<Option<u32>, ContainerError> {
    let path = dir.join(CHECKPOINT_INIT_PID);
    match std::fs::read_to_string(&path) {
        Ok(text) => text
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| ContainerError::CheckpointPid(path)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ContainerError::CheckpointFile(path, e)),
    }
}

/// The host pid of the process that is `inner` in the PID namespace of `jail_pid`:
/// the process on the host whose `NSpid` ends in `inner` and that shares the jail's PID
/// namespace. 0 where none is found (it ended already).
pub fn host_pid(jail_pid: u32, inner: u32) -> u32 {
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
    let Some(jail_ns) = ns(&jail_pid.to_string()) else {
        return 0;
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let last = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .and_then(|ids| ids.split_whitespace().last())
            .and_then(|id| id.parse::<u32>().ok());
        if last == Some(inner) && ns(pid).as_ref() == Some(&jail_ns) {
            return pid.parse().unwrap_or(0);
        }
    }
    0
}
