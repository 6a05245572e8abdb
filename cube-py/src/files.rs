//! Files in the sandbox, through its agent.

use cube_agent::client::Client;
use cube_agent::protocol::{FileInfo, FileKind};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::agent_error;

/// A file's bytes.
pub fn read<'py>(py: Python<'py>, client: &Client, path: &str) -> PyResult<Bound<'py, PyBytes>> {
    let mut data = Vec::new();
    py.detach(|| client.read_file(path, &mut data))
        .map_err(agent_error)?;
    Ok(PyBytes::new(py, &data))
}

/// Writes `data` to `path` (parents created); returns the bytes written.
pub fn write(py: Python<'_>, client: &Client, path: &str, data: &[u8]) -> PyResult<u64> {
    py.detach(|| client.write_file(path, &mut &data[..]))
        .map_err(agent_error)
}

/// A path's metadata as a dict.
pub fn info<'py>(py: Python<'py>, f: FileInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let name = f
        .path
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_string();
    d.set_item("name", name)?;
    d.set_item("path", f.path)?;
    d.set_item(
        "type",
        match f.kind {
            FileKind::File => "file",
            FileKind::Dir => "dir",
            FileKind::Symlink => "symlink",
            FileKind::Other => "other",
        },
    )?;
    d.set_item("size", f.size)?;
    d.set_item("mode", f.mode)?;
    d.set_item("uid", f.uid)?;
    d.set_item("gid", f.gid)?;
    d.set_item("modified_ns", f.modified_ns)?;
    d.set_item("symlink_target", f.symlink_target)?;
    Ok(d)
}

/// The entries of a directory, `depth` levels down.
pub fn list<'py>(
    py: Python<'py>,
    client: &Client,
    path: &str,
    depth: u32,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    let entries = py
        .detach(|| client.list_dir(path, depth))
        .map_err(agent_error)?;
    entries.into_iter().map(|f| info(py, f)).collect()
}

/// A path's metadata (links not followed).
pub fn stat<'py>(py: Python<'py>, client: &Client, path: &str) -> PyResult<Bound<'py, PyDict>> {
    let f = py.detach(|| client.stat(path)).map_err(agent_error)?;
    info(py, f)
}
