//! Sandbox networking from Python: the create arguments (`network`, `internet`,
//! `allow_out`, `deny_out`, `expose`) and `sb.network`'s calls, as dicts.

use cube_core::network::{NetworkOptions, NetworkPolicy, NetworkReport, PortMapping};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::raise;

/// The policy the arguments describe; a malformed CIDR raises `InvalidArgument`.
pub fn policy(
    internet: bool,
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
) -> PyResult<NetworkPolicy> {
    let policy = NetworkPolicy {
        internet,
        allow_out: allow_out.unwrap_or_default(),
        deny_out: deny_out.unwrap_or_default(),
    };
    policy
        .to_egress()
        .map_err(|e| raise("InvalidArgument", cube_core::error_report::chain(&e)))?;
    Ok(policy)
}

/// `"PORT"` or `"HOST_PORT:SANDBOX_PORT"`.
pub fn port(text: &str) -> PyResult<PortMapping> {
    text.parse::<PortMapping>()
        .map_err(|e| raise("InvalidArgument", e.to_string()))
}

/// The create options, or None when no argument asks for a network.
pub fn options(
    network: bool,
    internet: bool,
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    expose: Option<Vec<String>>,
) -> PyResult<Option<NetworkOptions>> {
    let wanted = network
        || !internet
        || allow_out.as_ref().is_some_and(|l| !l.is_empty())
        || deny_out.as_ref().is_some_and(|l| !l.is_empty())
        || expose.as_ref().is_some_and(|l| !l.is_empty());
    if !wanted {
        return Ok(None);
    }
    let expose = expose
        .unwrap_or_default()
        .iter()
        .map(|p| port(p))
        .collect::<PyResult<Vec<_>>>()?;
    Ok(Some(NetworkOptions {
        policy: policy(internet, allow_out, deny_out)?,
        expose,
    }))
}

/// A report as a dict (`device`, `internet`, `allow_out`, `deny_out`, `exposed` as
/// `(host_port, sandbox_port)` pairs, `counters`).
pub fn report_dict<'py>(py: Python<'py>, report: &NetworkReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("device", &report.host_ifname)?;
    d.set_item("address", report.guest_addr.to_string())?;
    d.set_item("gateway", report.gateway.to_string())?;
    d.set_item("internet", report.policy.internet)?;
    d.set_item("allow_out", &report.policy.allow_out)?;
    d.set_item("deny_out", &report.policy.deny_out)?;
    let exposed: Vec<(u16, u16)> = report
        .exposed
        .iter()
        .map(|p| (p.host_port, p.sandbox_port))
        .collect();
    d.set_item("exposed", exposed)?;
    let c = PyDict::new(py);
    let k = &report.counters;
    c.set_item("tx_packets", k.tx_packets)?;
    c.set_item("tx_bytes", k.tx_bytes)?;
    c.set_item("rx_packets", k.rx_packets)?;
    c.set_item("rx_bytes", k.rx_bytes)?;
    c.set_item("dropped", k.dropped)?;
    d.set_item("counters", c)?;
    Ok(d)
}
