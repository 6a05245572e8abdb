//! containerd's task service over the shim's containers: each call checked, carried out
//! on the container's Cube sandbox, and announced to containerd as a task event.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use containerd_shim::api::{
    CheckpointTaskRequest, CloseIORequest, ConnectRequest, ConnectResponse, CreateTaskRequest,
    CreateTaskResponse, DeleteRequest, DeleteResponse, Empty, ExecProcessRequest, KillRequest,
    PauseRequest, PidsRequest, PidsResponse, ResizePtyRequest, ResumeRequest, ShutdownRequest,
    StartRequest, StartResponse, StateRequest, StateResponse, StatsRequest, StatsResponse, Status,
    UpdateTaskRequest, WaitRequest, WaitResponse,
};
use containerd_shim::protos::events::task::{
    TaskCheckpointed, TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO,
    TaskPaused, TaskResumed, TaskStart,
};
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::MessageDyn;
use containerd_shim::protos::topics;
use containerd_shim::protos::ttrpc::{self, Code};
use containerd_shim::protos::types::task::ProcessInfo;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{Context, ExitSignal, Task, TtrpcContext};
use cube_agent::protocol::TerminalSize;
use cube_core::Runtime;

use crate::calls_in_flight::CallsInFlight;
use crate::container::{Container, ContainerError, CreateRequest, CHECKPOINT_ARCHIVE};
use crate::process::{Exit, Phase, Process, StdioPaths};
use crate::resources::Resources;
use crate::spec::{ProcessSpec, Spec};

/// Where events go, and in which containerd namespace.
#[derive(Clone)]
pub struct Events {
    publisher: Arc<RemotePublisher>,
    namespace: String,
}

impl Events {
    /// Events through `publisher` into `namespace`.
    pub fn new(publisher: RemotePublisher, namespace: &str) -> Events {
        Events {
            publisher: Arc::new(publisher),
            namespace: namespace.to_string(),
        }
    }

    fn send(&self, topic: &str, event: Box<dyn MessageDyn>) {
        if let Err(e) = self
            .publisher
            .publish(Context::default(), topic, &self.namespace, event)
        {
            log::warn!("publishing {topic}: {e}");
        }
    }
}

/// The task service.
pub struct Service {
    runtime: Arc<Runtime>,
    containers: Mutex<HashMap<String, Arc<Container>>>,
    events: Events,
    namespace: String,
    exit: Arc<ExitSignal>,
    /// The calls being answered, which the shim's exit waits for.
    calls: Arc<CallsInFlight>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn status(code: Code, message: impl std::fmt::Display) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, message.to_string()))
}

fn failed(e: ContainerError) -> ttrpc::Error {
    let code = match &e {
        ContainerError::NoExec(_) => Code::NOT_FOUND,
        ContainerError::ExecExists(_) => Code::ALREADY_EXISTS,
        ContainerError::Placeholder | ContainerError::Gone | ContainerError::NoPod(_) => {
            Code::FAILED_PRECONDITION
        }
        ContainerError::InPod(_) => Code::UNIMPLEMENTED,
        _ => Code::INTERNAL,
    };
    status(code, cube_core::error_report::chain(&e))
}

fn timestamp(at: SystemTime) -> Timestamp {
    let d = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
        ..Default::default()
    }
}

impl Service {
    /// A service holding no container yet.
    pub fn new(
        runtime: Arc<Runtime>,
        events: Events,
        namespace: &str,
        exit: Arc<ExitSignal>,
        calls: Arc<CallsInFlight>,
    ) -> Service {
        Service {
            runtime,
            containers: Mutex::new(HashMap::new()),
            events,
            namespace: namespace.to_string(),
            exit,
            calls,
        }
    }

    fn container(&self, id: &str) -> ttrpc::Result<Arc<Container>> {
        lock(&self.containers)
            .get(id)
            .cloned()
            .ok_or_else(|| status(Code::NOT_FOUND, format!("no container {id}")))
    }

    /// What publishes a process's exit.
    fn exit_announcer(&self, container: &str) -> impl FnOnce(&Process, Exit) + Send + 'static {
        let events = self.events.clone();
        let container = container.to_string();
        move |process: &Process, exit: Exit| {
            let (_, pid, _) = process.status();
            let id = if process.exec_id.is_empty() {
                container.clone()
            } else {
                process.exec_id.clone()
            };
            events.send(
                topics::TASK_EXIT_EVENT_TOPIC,
                Box::new(TaskExit {
                    container_id: container,
                    id,
                    pid,
                    exit_status: exit.status,
                    exited_at: Some(timestamp(exit.at)).into(),
                    ..Default::default()
                }),
            );
        }
    }
}

impl Task for Service {
    fn create(
        &self,
        _ctx: &TtrpcContext,
        req: CreateTaskRequest,
    ) -> ttrpc::Result<CreateTaskResponse> {
        let _call = self.calls.enter();
        let bundle = Path::new(&req.bundle);
        let spec = Spec::read(bundle).map_err(|e| failed(e.into()))?;
        let request = CreateRequest {
            id: &req.id,
            bundle,
            rootfs: &req.rootfs,
            stdio: StdioPaths {
                stdin: req.stdin.clone(),
                stdout: req.stdout.clone(),
                stderr: req.stderr.clone(),
                terminal: req.terminal,
            },
            checkpoint: &req.checkpoint,
            namespace: &self.namespace,
        };
        let container = match spec.pod() {
            // The pause container: the pod's sandbox.
            _ if spec.is_pod_sandbox() => {
                Container::create(&self.runtime, &spec, request, true).map_err(failed)?
            }
            // A container of a pod: processes in the pod's sandbox.
            Some(pod) => {
                let pod = self.container(pod).map_err(|_| {
                    status(
                        Code::FAILED_PRECONDITION,
                        format!("pod {pod} has no sandbox in this shim"),
                    )
                })?;
                Container::join_pod(&pod, &spec, request).map_err(failed)?
            }
            None => Container::create(&self.runtime, &spec, request, false).map_err(failed)?,
        };
        let pid = container.created_pid();
        lock(&self.containers).insert(req.id.clone(), Arc::new(container));
        self.events.send(
            topics::TASK_CREATE_EVENT_TOPIC,
            Box::new(TaskCreate {
                container_id: req.id.clone(),
                bundle: req.bundle.clone(),
                rootfs: req.rootfs.clone(),
                io: Some(TaskIO {
                    stdin: req.stdin.clone(),
                    stdout: req.stdout.clone(),
                    stderr: req.stderr.clone(),
                    terminal: req.terminal,
                    ..Default::default()
                })
                .into(),
                checkpoint: req.checkpoint.clone(),
                pid,
                ..Default::default()
            }),
        );
        Ok(CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    fn start(&self, _ctx: &TtrpcContext, req: StartRequest) -> ttrpc::Result<StartResponse> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        let pid = container
            .start(&req.exec_id, self.exit_announcer(&req.id))
            .map_err(failed)?;
        if req.exec_id.is_empty() {
            self.events.send(
                topics::TASK_START_EVENT_TOPIC,
                Box::new(TaskStart {
                    container_id: req.id.clone(),
                    pid,
                    ..Default::default()
                }),
            );
        } else {
            self.events.send(
                topics::TASK_EXEC_STARTED_EVENT_TOPIC,
                Box::new(TaskExecStarted {
                    container_id: req.id.clone(),
                    exec_id: req.exec_id.clone(),
                    pid,
                    ..Default::default()
                }),
            );
        }
        Ok(StartResponse {
            pid,
            ..Default::default()
        })
    }

    fn state(&self, _ctx: &TtrpcContext, req: StateRequest) -> ttrpc::Result<StateResponse> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        let process = container.process(&req.exec_id).map_err(failed)?;
        let (phase, pid, exit) = process.status();
        let st = match phase {
            Phase::Created => Status::CREATED,
            Phase::Running => Status::RUNNING,
            Phase::Stopped => Status::STOPPED,
        };
        Ok(StateResponse {
            id: req.id.clone(),
            bundle: container.bundle.display().to_string(),
            pid: if pid == 0 {
                container.created_pid()
            } else {
                pid
            },
            status: st.into(),
            stdin: process.stdio.stdin.clone(),
            stdout: process.stdio.stdout.clone(),
            stderr: process.stdio.stderr.clone(),
            terminal: process.stdio.terminal,
            exit_status: exit.map_or(0, |e| e.status),
            exited_at: exit.map(|e| timestamp(e.at)).into(),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        })
    }

    fn wait(&self, _ctx: &TtrpcContext, req: WaitRequest) -> ttrpc::Result<WaitResponse> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        let process = container.process(&req.exec_id).map_err(failed)?;
        let exit = process.wait();
        Ok(WaitResponse {
            exit_status: exit.status,
            exited_at: Some(timestamp(exit.at)).into(),
            ..Default::default()
        })
    }

    fn kill(&self, _ctx: &TtrpcContext, req: KillRequest) -> ttrpc::Result<Empty> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        if req.exec_id.is_empty() && container.is_placeholder() {
            // The pod ends: its sandbox, with whatever still runs in it, and the pause
            // "process" with it. That happens once this call has returned, as a
            // process dies after its signal: the pause process's end answers
            // containerd's Wait, which makes containerd delete the task and shut
            // this shim down, and a shutdown closes the connection at once, before an
            // answer still to be written (StopPodSandbox failed with "ttrpc: closed"
            // when the sandbox's removal ended it inside this call). The thread waits
            // for `returned` to drop, at the end of this call.
            let (returned, has_returned) = std::sync::mpsc::channel::<()>();
            let announce = self.exit_announcer(&req.id);
            let signal = req.signal;
            let spawned = std::thread::Builder::new()
                .name("pod-end".into())
                .spawn(move || {
                    let _ = has_returned.recv();
                    if let Err(e) = container.destroy() {
                        log::warn!("removing the pod's sandbox: {e}");
                    }
                    // A placeholder has no process to signal: this records its end.
                    if let Err(e) = container.init.kill(signal) {
                        log::warn!("ending the pod's pause process: {e}");
                    }
                    announce(&container.init, container.init.wait());
                });
            if let Err(e) = spawned {
                return Err(status(Code::INTERNAL, format!("ending the pod: {e}")));
            }
            drop(returned);
            return Ok(Empty::new());
        }
        let process = container.process(&req.exec_id).map_err(failed)?;
        process.kill(req.signal).map_err(|e| failed(e.into()))?;
        Ok(Empty::new())
    }

    fn delete(&self, _ctx: &TtrpcContext, req: DeleteRequest) -> ttrpc::Result<DeleteResponse> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        if !req.exec_id.is_empty() {
            let process = container
                .remove_exec(&req.exec_id)
                .ok_or_else(|| status(Code::NOT_FOUND, format!("no exec {}", req.exec_id)))?;
            let (_, pid, exit) = process.status();
            return Ok(DeleteResponse {
                pid,
                exit_status: exit.map_or(0, |e| e.status),
                exited_at: exit.map(|e| timestamp(e.at)).into(),
                ..Default::default()
            });
        }
        container.destroy().map_err(failed)?;
        lock(&self.containers).remove(&req.id);
        let (_, pid, exit) = container.init.status();
        let exit = exit.unwrap_or(Exit {
            status: 128 + libc::SIGKILL as u32,
            at: SystemTime::now(),
        });
        self.events.send(
            topics::TASK_DELETE_EVENT_TOPIC,
            Box::new(TaskDelete {
                container_id: req.id.clone(),
                pid,
                exit_status: exit.status,
                exited_at: Some(timestamp(exit.at)).into(),
                ..Default::default()
            }),
        );
        Ok(DeleteResponse {
            pid,
            exit_status: exit.status,
            exited_at: Some(timestamp(exit.at)).into(),
            ..Default::default()
        })
    }

    fn pids(&self, _ctx: &TtrpcContext, req: PidsRequest) -> ttrpc::Result<PidsResponse> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        let pids = match (container.role(), container.jail().map_err(failed)?) {
            // A container of a pod: its own processes, not the pod's.
            (role, _) if role.in_pod() => container.running_pids(),
            (_, Some(jail)) => crate::stats::pids(&jail.cgroups),
            (_, None) => vec![container.created_pid()],
        };
        Ok(PidsResponse {
            processes: pids
                .into_iter()
                .map(|pid| ProcessInfo {
                    pid,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
    }

    fn pause(&self, _ctx: &TtrpcContext, req: PauseRequest) -> ttrpc::Result<Empty> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        container
            .with_own_sandbox("Pausing", |sb| sb.pause())
            .map_err(failed)?;
        self.events.send(
            topics::TASK_PAUSED_EVENT_TOPIC,
            Box::new(TaskPaused {
                container_id: req.id.clone(),
                ..Default::default()
            }),
        );
        Ok(Empty::new())
    }

    fn resume(&self, _ctx: &TtrpcContext, req: ResumeRequest) -> ttrpc::Result<Empty> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        container
            .with_own_sandbox("Resuming", |sb| sb.resume())
            .map_err(failed)?;
        self.events.send(
            topics::TASK_RESUMED_EVENT_TOPIC,
            Box::new(TaskResumed {
                container_id: req.id.clone(),
                ..Default::default()
            }),
        );
        Ok(Empty::new())
    }

    fn checkpoint(&self, _ctx: &TtrpcContext, req: CheckpointTaskRequest) -> ttrpc::Result<Empty> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        let archive = Path::new(&req.path).join(CHECKPOINT_ARCHIVE);
        let snapshot = container
            .checkpoint(&self.runtime, Path::new(&req.path))
            .map_err(failed)?;
        match &snapshot.fallback {
            None => log::info!(
                "checkpoint of {}: Cube snapshot {} ({}) exported to {}",
                req.id,
                snapshot.id,
                snapshot.kind,
                archive.display()
            ),
            // The restored container starts its command again on the files.
            Some(why) => log::warn!(
                "checkpoint of {}: Cube snapshot {} holds the files only ({why}); exported to {}",
                req.id,
                snapshot.id,
                archive.display()
            ),
        }
        self.events.send(
            topics::TASK_CHECKPOINTED_EVENT_TOPIC,
            Box::new(TaskCheckpointed {
                container_id: req.id.clone(),
                checkpoint: req.path.clone(),
                ..Default::default()
            }),
        );
        Ok(Empty::new())
    }

    fn exec(&self, _ctx: &TtrpcContext, req: ExecProcessRequest) -> ttrpc::Result<Empty> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        let spec = req
            .spec
            .as_ref()
            .ok_or_else(|| status(Code::INVALID_ARGUMENT, "the exec has no process spec"))?;
        let process = ProcessSpec::from_json(&spec.value).map_err(|e| failed(e.into()))?;
        let process = Process::new(
            &req.exec_id,
            StdioPaths {
                stdin: req.stdin.clone(),
                stdout: req.stdout.clone(),
                stderr: req.stderr.clone(),
                terminal: req.terminal,
            },
            process,
        )
        .map_err(|e| failed(e.into()))?;
        container.add_exec(process).map_err(failed)?;
        self.events.send(
            topics::TASK_EXEC_ADDED_EVENT_TOPIC,
            Box::new(TaskExecAdded {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                ..Default::default()
            }),
        );
        Ok(Empty::new())
    }

    fn resize_pty(&self, _ctx: &TtrpcContext, req: ResizePtyRequest) -> ttrpc::Result<Empty> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        let process = container.process(&req.exec_id).map_err(failed)?;
        let size = TerminalSize {
            rows: u16::try_from(req.height).unwrap_or(u16::MAX),
            cols: u16::try_from(req.width).unwrap_or(u16::MAX),
        };
        process.resize(size).map_err(|e| failed(e.into()))?;
        Ok(Empty::new())
    }

    fn close_io(&self, _ctx: &TtrpcContext, req: CloseIORequest) -> ttrpc::Result<Empty> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        let process = container.process(&req.exec_id).map_err(failed)?;
        if req.stdin {
            process.close_input();
        }
        Ok(Empty::new())
    }

    fn update(&self, _ctx: &TtrpcContext, req: UpdateTaskRequest) -> ttrpc::Result<Empty> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        let resources = req
            .resources
            .as_ref()
            .ok_or_else(|| status(Code::INVALID_ARGUMENT, "Update without resources"))?;
        let change = Resources::from_any(&resources.type_url, &resources.value)
            .and_then(|r| r.limits())
            .map_err(|e| status(Code::INVALID_ARGUMENT, e))?;
        container.set_limits(change).map_err(failed)?;
        Ok(Empty::new())
    }

    fn stats(&self, _ctx: &TtrpcContext, req: StatsRequest) -> ttrpc::Result<StatsResponse> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        let metrics = if container.is_vm() {
            let report = container.status().map_err(failed)?;
            let guest = report
                .config
                .map(|c| c.memory_bytes)
                .or_else(|| container.vm_guest_bytes())
                .unwrap_or(0);
            crate::stats::vm_metrics(
                report.pid,
                report.rss_kib * 1024,
                guest,
                container.running_pids().len() as u64,
            )
        } else {
            // A container of a pod reads the pod's use: they share one sandbox.
            let jail = container
                .jail()
                .map_err(failed)?
                .ok_or_else(|| status(Code::FAILED_PRECONDITION, "the sandbox was deleted"))?;
            crate::stats::metrics(&jail.cgroups)
        };
        let any = containerd_shim::util::convert_to_any(Box::new(metrics))
            .map_err(|e| status(Code::INTERNAL, e))?;
        Ok(StatsResponse {
            stats: Some(any).into(),
            ..Default::default()
        })
    }

    fn connect(&self, _ctx: &TtrpcContext, req: ConnectRequest) -> ttrpc::Result<ConnectResponse> {
        let _call = self.calls.enter();
        let container = self.container(&req.id)?;
        let (_, pid, _) = container.init.status();
        Ok(ConnectResponse {
            shim_pid: std::process::id(),
            task_pid: if pid == 0 {
                container.created_pid()
            } else {
                pid
            },
            ..Default::default()
        })
    }

    fn shutdown(&self, _ctx: &TtrpcContext, _req: ShutdownRequest) -> ttrpc::Result<Empty> {
        // Counted too: the shim's exit waits for this answer as for the others.
        let _call = self.calls.enter();
        if lock(&self.containers).is_empty() {
            self.exit.signal();
        }
        Ok(Empty::new())
    }
}
