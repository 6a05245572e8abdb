//! The shim's life: `start` (spawn or reuse the pod's shim process), serving the task
//! service, and `delete` (clean up after a shim that died).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use containerd_shim::api::DeleteResponse;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{Config, ExitSignal, Flags, Shim, StartOpts};
use cube_core::{Runtime, RuntimeConfig};

use crate::calls_in_flight::CallsInFlight;
use crate::container::ROOTFS;
use crate::service::{Events, Service};
use crate::spec::Spec;

/// How long the shim's exit waits for the task calls being answered.
const CALLS_DRAIN_LIMIT: Duration = Duration::from_secs(10);

/// How long the shim's exit waits, once no call is being answered, for the last
/// answers to be written.
const ANSWER_WRITE_GRACE: Duration = Duration::from_millis(50);

/// The shim.
pub struct CubeShim {
    exit: Arc<ExitSignal>,
    /// The task calls being answered: the exit waits for them.
    calls: Arc<CallsInFlight>,
    namespace: String,
    bundle: String,
}

/// Blocks SIGCHLD and SIGPIPE in the `start` process, which has nothing left to do but
/// print the address and exit.
///
/// Why: containerd_shim hooks both (signal-hook) and, on its way out, drops the hook's
/// socket pair read end first. A SIGCHLD in that moment (the process spawned for a
/// second container of a pod exits at once: the pod's shim serves it) has the handler
/// write to a socket without a reader: the write raises SIGPIPE, whose handler writes
/// again, forever. The `start` process spun at full CPU and containerd, waiting for
/// it, never finished the CreateContainer (seen in `cube-shim --test cri`). Blocked,
/// they stay pending until the process exits.
fn quiet_signals_for_exit() {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGCHLD);
    set.add(Signal::SIGPIPE);
    if let Err(e) = set.thread_block() {
        log::warn!("blocking SIGCHLD and SIGPIPE before exit: {e}");
    }
}

impl Shim for CubeShim {
    type T = Service;

    fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        CubeShim {
            exit: Arc::new(ExitSignal::default()),
            calls: Arc::default(),
            namespace: args.namespace.clone(),
            bundle: args.bundle.clone(),
        }
    }

    fn start_shim(&mut self, opts: StartOpts) -> containerd_shim::Result<String> {
        // containerd runs `start` in the bundle: the containers of one pod share the
        // shim of its sandbox id.
        let grouping = Spec::read(Path::new("."))
            .ok()
            .and_then(|s| s.pod().map(str::to_string))
            .unwrap_or_else(|| opts.id.clone());
        let (_, address) = containerd_shim::spawn(opts, &grouping, Vec::new())?;
        containerd_shim::util::write_address(&address)?;
        quiet_signals_for_exit();
        Ok(address)
    }

    fn delete_shim(&mut self) -> containerd_shim::Result<DeleteResponse> {
        // The shim that held this container is gone, and its ephemeral sandbox with
        // it; what may be left is the rootfs mount.
        let bundle = if self.bundle.is_empty() {
            std::env::current_dir().unwrap_or_default()
        } else {
            self.bundle.clone().into()
        };
        if let Some(rootfs) = bundle.join(ROOTFS).to_str() {
            let _ = containerd_shim::mount::umount_recursive(Some(rootfs), libc::MNT_DETACH);
        }
        let now = containerd_shim::util::timestamp()?;
        Ok(DeleteResponse {
            exit_status: 128 + libc::SIGKILL as u32,
            exited_at: Some(now).into(),
            ..Default::default()
        })
    }

    fn wait(&mut self) {
        self.exit.wait();
        // Once this returns the ttrpc server closes its connections at once: the calls
        // still being answered (Shutdown's own among them) finish first, for a
        // bounded time, since a blocking call must not keep the shim alive.
        if !self.calls.wait_idle(CALLS_DRAIN_LIMIT) {
            log::warn!(
                "exiting with {} task calls unanswered after {CALLS_DRAIN_LIMIT:?}",
                self.calls.count()
            );
        }
        // The server writes an answer from another thread after its handler has
        // returned, and says nothing when it has: this leaves it the time to.
        std::thread::sleep(ANSWER_WRITE_GRACE);
    }

    fn create_task_service(&self, publisher: RemotePublisher) -> Service {
        let runtime = match open_runtime() {
            Ok(rt) => rt,
            Err(e) => {
                log::error!(
                    "opening Cube's store: {}",
                    cube_core::error_report::chain(&e)
                );
                std::process::exit(1);
            }
        };
        Service::new(
            Arc::new(runtime),
            Events::new(publisher, &self.namespace),
            &self.namespace,
            Arc::clone(&self.exit),
            Arc::clone(&self.calls),
        )
    }
}

/// Cube's runtime on the store `CUBE_HOME` names (the default store otherwise); no
/// supervisor pool: one shim holds one pod.
fn open_runtime() -> Result<Runtime, cube_core::SandboxError> {
    let mut config = RuntimeConfig::new()?;
    if let Some(home) = std::env::var_os("CUBE_HOME") {
        config.store_root = home.into();
    }
    config.pool_size = 0;
    config.network_pool_size = 0;
    Runtime::open(config)
}
