//! `NativeSandbox`: one sandbox as the Python layer sees it, with its lifecycle
//! operations and a cached connection to its agent.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use cube_agent::client::Client;
use cube_agent::protocol::ExecRequest;
use cube_core::{Runtime, Sandbox, SandboxError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::code::{self, Cell};
use crate::commands::{self, Background, Callbacks, Outcome};
use crate::engine;
use crate::errors::{agent_error, raise, sandbox_error};
use crate::files;
use crate::interrupt::seconds;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One sandbox. Lifecycle calls are serialised on its handle; agent calls share one
/// connection and may run concurrently from many threads.
#[pyclass(module = "cubesandbox._native", name = "NativeSandbox", frozen)]
pub struct NativeSandbox {
    id: String,
    engine: String,
    runtime: Arc<Runtime>,
    /// `None` once killed.
    handle: Mutex<Option<Sandbox>>,
    /// The agent connection, opened on first use and dropped when the sandbox's
    /// processes may have been replaced (rollback, hibernate, wake).
    agent: Mutex<Option<Arc<Client>>>,
}

impl NativeSandbox {
    /// Wraps a sandbox handle.
    pub fn new(runtime: Arc<Runtime>, sandbox: Sandbox) -> Self {
        NativeSandbox {
            id: sandbox.id().to_string(),
            engine: engine::engine_of(&sandbox),
            runtime,
            handle: Mutex::new(Some(sandbox)),
            agent: Mutex::new(None),
        }
    }

    /// Runs `f` on the handle with the GIL released.
    fn with_handle<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Sandbox) -> Result<T, SandboxError> + Send,
    ) -> PyResult<T> {
        let result = py.detach(|| {
            let mut handle = lock(&self.handle);
            handle.as_mut().map(f)
        });
        match result {
            Some(r) => r.map_err(sandbox_error),
            None => Err(self.killed()),
        }
    }

    fn killed(&self) -> PyErr {
        raise(
            "SandboxNotFound",
            format!("sandbox {} was killed through this handle", self.id),
        )
    }

    /// The agent connection, opening it when there is none.
    fn client(&self, py: Python<'_>) -> PyResult<Arc<Client>> {
        if let Some(c) = lock(&self.agent).as_ref() {
            return Ok(Arc::clone(c));
        }
        let socket = self.with_handle(py, |sb| Ok(engine::agent_socket(sb)))?;
        let Some(socket) = socket else {
            return Err(raise(
                "EngineUnavailable",
                format!(
                    "sandbox {} runs on the {} engine, which has no agent to run code, \
                     commands or files yet (use engine=\"jail\")",
                    self.id, self.engine
                ),
            ));
        };
        let client = Arc::new(crate::agent_connect::connect(py, socket)?);
        let mut cached = lock(&self.agent);
        Ok(Arc::clone(cached.get_or_insert(client)))
    }

    fn forget_agent(&self) {
        lock(&self.agent).take();
    }

    /// Runs an agent operation; a lost connection is forgotten so the next call opens
    /// a new one.
    fn with_agent<T>(&self, py: Python<'_>, f: impl FnOnce(&Client) -> PyResult<T>) -> PyResult<T> {
        let client = self.client(py)?;
        let result = f(&client);
        if let Err(e) = &result {
            let lost = Python::attach(|py| {
                e.get_type(py)
                    .name()
                    .is_ok_and(|n| n == crate::errors::CONNECTION_LOST)
            });
            if lost {
                self.forget_agent();
            }
        }
        result
    }
}

fn exec_request(
    argv: Vec<String>,
    envs: Option<BTreeMap<String, String>>,
    cwd: Option<String>,
    stdin: Option<Vec<u8>>,
    timeout: Option<f64>,
) -> PyResult<ExecRequest> {
    if argv.is_empty() {
        return Err(raise("InvalidArgument", "the command is empty"));
    }
    Ok(ExecRequest {
        argv,
        env: envs.unwrap_or_default().into_iter().collect(),
        cwd,
        user: None,
        stdin: stdin.unwrap_or_default(),
        timeout_ms: seconds("timeout", timeout)?.map(|t| t.as_millis() as u64),
        background: false,
    })
}

#[pymethods]
impl NativeSandbox {
    /// The sandbox id.
    #[getter]
    fn id(&self) -> &str {
        &self.id
    }

    /// `jail` or `vm`.
    #[getter]
    fn engine(&self) -> &str {
        &self.engine
    }

    /// Takes a snapshot; returns `(id, kind)`, kind `full` or `filesystem`.
    fn snapshot(&self, py: Python<'_>) -> PyResult<(String, String)> {
        // A full jail snapshot ends the agent's connections (CRIU cannot save them).
        self.forget_agent();
        let s = self.with_handle(py, engine::snapshot)?;
        Ok((s.id, s.kind.to_string()))
    }

    /// Puts the sandbox back to one of its snapshots.
    fn rollback(&self, py: Python<'_>, snapshot: String) -> PyResult<()> {
        self.forget_agent();
        self.with_handle(py, |sb| sb.rollback(&snapshot))
    }

    /// Changes the running sandbox's limits (jail): each one given replaces the
    /// sandbox's, the others stay.
    #[pyo3(signature = (memory_mib=None, cpu_millis=None, pids_max=None))]
    fn set_limits(
        &self,
        py: Python<'_>,
        memory_mib: Option<u64>,
        cpu_millis: Option<u32>,
        pids_max: Option<u32>,
    ) -> PyResult<()> {
        self.with_handle(py, |sb| {
            sb.set_limits(cube_core::LimitChange {
                memory_mib,
                cpu_millis,
                pids_max,
            })
        })
    }

    /// Freezes the sandbox's processes; memory stays.
    fn pause(&self, py: Python<'_>) -> PyResult<()> {
        self.with_handle(py, |sb| sb.pause())
    }

    /// Continues after `pause`.
    fn resume(&self, py: Python<'_>) -> PyResult<()> {
        self.with_handle(py, |sb| sb.resume())
    }

    /// Writes the sandbox's state out and frees its memory.
    fn hibernate(&self, py: Python<'_>) -> PyResult<()> {
        self.forget_agent();
        self.with_handle(py, |sb| sb.hibernate())
    }

    /// Restores after `hibernate`.
    fn wake(&self, py: Python<'_>) -> PyResult<()> {
        self.forget_agent();
        self.with_handle(py, |sb| sb.wake())
    }

    /// The sandbox's network as a dict (device, policy, exposed ports, counters).
    fn network_status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let report = self.with_handle(py, |sb| sb.network())?;
        crate::network::report_dict(py, &report)
    }

    /// Replaces the sandbox's egress policy.
    #[pyo3(signature = (internet=true, allow_out=None, deny_out=None))]
    fn set_policy(
        &self,
        py: Python<'_>,
        internet: bool,
        allow_out: Option<Vec<String>>,
        deny_out: Option<Vec<String>>,
    ) -> PyResult<()> {
        let policy = crate::network::policy(internet, allow_out, deny_out)?;
        self.with_handle(py, |sb| sb.set_policy(&policy))
    }

    /// Serves sandbox port `sandbox_port` at `host_port` on the host's addresses.
    fn expose(&self, py: Python<'_>, host_port: u16, sandbox_port: u16) -> PyResult<()> {
        let port = crate::network::port(&format!("{host_port}:{sandbox_port}"))?;
        self.with_handle(py, |sb| sb.expose(port))
    }

    /// Withdraws exposed host port `host_port`.
    fn unexpose(&self, py: Python<'_>, host_port: u16) -> PyResult<()> {
        self.with_handle(py, |sb| sb.unexpose(host_port))
    }

    /// Destroys the sandbox; false when this handle had already killed it.
    fn kill(&self, py: Python<'_>) -> PyResult<bool> {
        self.forget_agent();
        let taken = py.detach(|| lock(&self.handle).take());
        match taken {
            Some(sb) => py
                .detach(|| sb.destroy())
                .map(|()| true)
                .map_err(sandbox_error),
            None => Ok(false),
        }
    }

    /// Snapshots this sandbox and starts `n` new sandboxes from the snapshot.
    fn clone(&self, py: Python<'_>, n: usize) -> PyResult<Vec<NativeSandbox>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let runtime = Arc::clone(&self.runtime);
        // Cloning snapshots this sandbox, which ends its agent connections.
        self.forget_agent();
        let clones = self.with_handle(py, |sb| engine::clone_sandbox(&runtime, sb, n))?;
        Ok(clones
            .into_iter()
            .map(|c| NativeSandbox::new(Arc::clone(&self.runtime), c))
            .collect())
    }

    /// Runs a code cell; returns its outcome as a dict.
    #[pyo3(signature = (code, language="python", context=None, timeout=None))]
    fn run_code(
        &self,
        py: Python<'_>,
        code: &str,
        language: &str,
        context: Option<&str>,
        timeout: Option<f64>,
    ) -> PyResult<Py<PyDict>> {
        let lang = code::language(language)?;
        let cell = Cell {
            context: context.unwrap_or(code::default_context(lang)),
            language: lang,
            create_missing: context.is_none(),
            code,
            timeout: seconds("timeout", timeout)?,
        };
        self.with_agent(py, |client| code::run(py, client, &cell))
    }

    /// Starts a named interpreter context.
    #[pyo3(signature = (name, language="python", cwd=None))]
    fn create_context(
        &self,
        py: Python<'_>,
        name: &str,
        language: &str,
        cwd: Option<&str>,
    ) -> PyResult<()> {
        let lang = code::language(language)?;
        self.with_agent(py, |client| {
            py.detach(|| client.create_context(name, lang, cwd))
                .map_err(agent_error)
        })
    }

    /// Stops a named interpreter context.
    fn delete_context(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        self.with_agent(py, |client| {
            py.detach(|| client.delete_context(name))
                .map_err(agent_error)
        })
    }

    /// Runs a process to its end; returns `(stdout, stderr, exit_code, signal,
    /// timed_out)`.
    #[pyo3(signature = (argv, envs=None, cwd=None, stdin=None, timeout=None, on_stdout=None, on_stderr=None))]
    #[allow(clippy::too_many_arguments)]
    fn exec(
        &self,
        py: Python<'_>,
        argv: Vec<String>,
        envs: Option<BTreeMap<String, String>>,
        cwd: Option<String>,
        stdin: Option<Vec<u8>>,
        timeout: Option<f64>,
        on_stdout: Option<Py<PyAny>>,
        on_stderr: Option<Py<PyAny>>,
    ) -> PyResult<Outcome> {
        let req = exec_request(argv, envs, cwd, stdin, timeout)?;
        let callbacks = Callbacks {
            on_stdout,
            on_stderr,
        };
        self.with_agent(py, |client| commands::run(py, client, req, &callbacks))
    }

    /// Starts a process in the background.
    #[pyo3(signature = (argv, envs=None, cwd=None, stdin=None, timeout=None, on_stdout=None, on_stderr=None))]
    #[allow(clippy::too_many_arguments)]
    fn spawn(
        &self,
        py: Python<'_>,
        argv: Vec<String>,
        envs: Option<BTreeMap<String, String>>,
        cwd: Option<String>,
        stdin: Option<Vec<u8>>,
        timeout: Option<f64>,
        on_stdout: Option<Py<PyAny>>,
        on_stderr: Option<Py<PyAny>>,
    ) -> PyResult<Background> {
        let req = exec_request(argv, envs, cwd, stdin, timeout)?;
        let callbacks = Callbacks {
            on_stdout,
            on_stderr,
        };
        let client = self.client(py)?;
        commands::start(py, client, req, callbacks)
    }

    /// A file's bytes.
    fn read_file<'py>(&self, py: Python<'py>, path: &str) -> PyResult<Bound<'py, PyBytes>> {
        self.with_agent(py, |client| files::read(py, client, path))
    }

    /// Writes a file (parents created); returns the bytes written.
    fn write_file(&self, py: Python<'_>, path: &str, data: Vec<u8>) -> PyResult<u64> {
        self.with_agent(py, |client| files::write(py, client, path, &data))
    }

    /// Entries of a directory, `depth` levels down.
    #[pyo3(signature = (path, depth=1))]
    fn list_dir<'py>(
        &self,
        py: Python<'py>,
        path: &str,
        depth: u32,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.with_agent(py, |client| files::list(py, client, path, depth))
    }

    /// A path's metadata.
    fn stat<'py>(&self, py: Python<'py>, path: &str) -> PyResult<Bound<'py, PyDict>> {
        self.with_agent(py, |client| files::stat(py, client, path))
    }

    /// Whether a path exists.
    fn exists(&self, py: Python<'_>, path: &str) -> PyResult<bool> {
        self.with_agent(py, |client| {
            py.detach(|| client.exists(path)).map_err(agent_error)
        })
    }

    /// Creates a directory (with its parents).
    fn make_dir(&self, py: Python<'_>, path: &str) -> PyResult<()> {
        self.with_agent(py, |client| {
            py.detach(|| client.make_dir(path, true))
                .map_err(agent_error)
        })
    }

    /// Removes a path (a directory with its contents).
    fn remove(&self, py: Python<'_>, path: &str) -> PyResult<()> {
        self.with_agent(py, |client| {
            py.detach(|| client.remove(path, true)).map_err(agent_error)
        })
    }

    /// Renames a path.
    fn rename(&self, py: Python<'_>, old: &str, new: &str) -> PyResult<()> {
        self.with_agent(py, |client| {
            py.detach(|| client.rename(old, new)).map_err(agent_error)
        })
    }
}
