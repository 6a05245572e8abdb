//! `cubesandbox._native`: the compiled half of the `cubesandbox` Python package.
//!
//! It exposes Cube's public Sandbox API ([`cube_core`]) and the agent client
//! ([`cube_agent::client`]) in plain shapes (strings, bytes, tuples, dicts); the pure
//! Python half (`python/cubesandbox`) builds the E2B-style objects on top. Every
//! blocking call releases the GIL; long waits wake up regularly to run Python's signal
//! handlers, so Ctrl-C interrupts them.

mod agent_connect;
mod code;
mod commands;
mod engine;
mod errors;
mod exec_id;
mod files;
mod interrupt;
mod network;
mod sandbox;
mod text_stream;

use pyo3::prelude::*;

#[pymodule]
mod _native {
    use std::collections::BTreeMap;
    use std::path::PathBuf;
    use std::sync::Arc;

    use pyo3::prelude::*;
    use pyo3::types::PyDict;

    use crate::engine::{self, CreateRequest, EngineName, Origin};
    use crate::errors::{raise, raise_of_kind, sandbox_error};
    use crate::interrupt::seconds;

    #[pymodule_export]
    use crate::commands::Background;
    #[pymodule_export]
    use crate::sandbox::NativeSandbox;

    /// The template used when none is named.
    #[pyfunction]
    fn default_template() -> &'static str {
        engine::default_template()
    }

    /// Creates a sandbox.
    #[pyfunction]
    #[pyo3(signature = (template, engine="auto", envs=None, metadata=None, lifetime=None, store=None, network=false, internet=true, allow_out=None, deny_out=None, expose=None, memory_mib=None, cpu_millis=None, pids_max=None, disk_mib=None, snapshot=None))]
    #[allow(clippy::too_many_arguments)]
    fn create(
        py: Python<'_>,
        template: Option<&str>,
        engine: &str,
        envs: Option<BTreeMap<String, String>>,
        metadata: Option<BTreeMap<String, String>>,
        lifetime: Option<f64>,
        store: Option<PathBuf>,
        network: bool,
        internet: bool,
        allow_out: Option<Vec<String>>,
        deny_out: Option<Vec<String>>,
        expose: Option<Vec<String>>,
        memory_mib: Option<u64>,
        cpu_millis: Option<u32>,
        pids_max: Option<u32>,
        disk_mib: Option<u64>,
        snapshot: Option<String>,
    ) -> PyResult<NativeSandbox> {
        let origin = match (template, snapshot) {
            (Some(_), Some(_)) => {
                return Err(raise(
                    "InvalidArgument",
                    "name a template or a snapshot to create from, not both",
                ))
            }
            (_, Some(id)) => Origin::Snapshot(id),
            (Some(name), None) => Origin::Template(name.to_string()),
            (None, None) => Origin::Template(engine::default_template().to_string()),
        };
        let engine_name = EngineName::parse(engine).ok_or_else(|| {
            raise(
                "InvalidArgument",
                format!("unknown engine {engine:?} (use \"auto\", \"jail\" or \"vm\")"),
            )
        })?;
        let request = CreateRequest {
            engine: engine_name,
            env: envs.unwrap_or_default().into_iter().collect(),
            metadata: metadata.unwrap_or_default(),
            lifetime: seconds("timeout", lifetime)?,
            network: crate::network::options(network, internet, allow_out, deny_out, expose)?,
            memory_mib,
            cpu_millis,
            pids_max,
            disk_mib,
        };
        let (runtime, sandbox) = py
            .detach(|| {
                let runtime = engine::runtime(store)?;
                let sandbox = engine::create(&runtime, &origin, request)?;
                Ok((runtime, sandbox))
            })
            .map_err(sandbox_error)?;
        Ok(NativeSandbox::new(runtime, sandbox))
    }

    /// Attaches to a running sandbox by id.
    #[pyfunction]
    #[pyo3(signature = (id, store=None))]
    fn connect(py: Python<'_>, id: &str, store: Option<PathBuf>) -> PyResult<NativeSandbox> {
        let (runtime, sandbox) = py
            .detach(|| {
                let runtime = engine::runtime(store)?;
                let sandbox = engine::attach(&runtime, id)?;
                Ok((runtime, sandbox))
            })
            .map_err(|e| match e {
                // The record exists but nothing answers: the sandbox is gone.
                cube_core::SandboxError::Supervisor { .. } => raise_of_kind(
                    "SandboxNotFound",
                    format!("sandbox {id} is not running (its supervisor does not answer)"),
                    cube_core::ErrorKind::NotFound,
                ),
                other => sandbox_error(other),
            })?;
        Ok(NativeSandbox::new(Arc::clone(&runtime), sandbox))
    }

    /// The sandboxes in the store, as dicts.
    #[pyfunction]
    #[pyo3(signature = (store=None))]
    fn list_sandboxes<'py>(
        py: Python<'py>,
        store: Option<PathBuf>,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let summaries = py
            .detach(|| {
                let runtime = engine::runtime(store)?;
                engine::list(&runtime)
            })
            .map_err(sandbox_error)?;
        summaries
            .into_iter()
            .map(|s| {
                let d = PyDict::new(py);
                d.set_item("id", s.id)?;
                d.set_item("engine", s.engine)?;
                d.set_item("origin", s.origin)?;
                d.set_item("created_unix", s.created_unix)?;
                d.set_item("metadata", s.metadata)?;
                Ok(d)
            })
            .collect()
    }

    /// Writes snapshot `id` into the archive file `path`; returns what was written.
    #[pyfunction]
    #[pyo3(signature = (id, path, store=None))]
    fn export_snapshot<'py>(
        py: Python<'py>,
        id: &str,
        path: PathBuf,
        store: Option<PathBuf>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let report = py
            .detach(|| {
                let runtime = engine::runtime(store)?;
                engine::export_snapshot(&runtime, id, &path)
            })
            .map_err(sandbox_error)?;
        let d = PyDict::new(py);
        d.set_item("id", &report.snapshot)?;
        d.set_item("archive_bytes", report.archive_bytes)?;
        d.set_item("file_bytes", report.file_bytes)?;
        d.set_item("data_bytes", report.data_bytes)?;
        d.set_item("required_template", report.required_template())?;
        d.set_item("template", report.template)?;
        d.set_item(
            "rootfs",
            report.rootfs.map(|tree| tree.display().to_string()),
        )?;
        Ok(d)
    }

    /// Adds the snapshot in archive `path` to the store; returns it as a dict.
    #[pyfunction]
    #[pyo3(signature = (path, store=None))]
    fn import_snapshot<'py>(
        py: Python<'py>,
        path: PathBuf,
        store: Option<PathBuf>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let imported = py
            .detach(|| {
                let runtime = engine::runtime(store)?;
                engine::import_snapshot(&runtime, &path)
            })
            .map_err(sandbox_error)?;
        let d = PyDict::new(py);
        d.set_item("id", imported.snapshot.id)?;
        d.set_item("kind", imported.snapshot.kind)?;
        d.set_item("sandbox_id", imported.sandbox)?;
        d.set_item("template", imported.template)?;
        d.set_item("archive_bytes", imported.archive_bytes)?;
        Ok(d)
    }
}
