//! Per-sandbox metrics as E2B reports them (`GET /sandboxes/{id}/metrics`), from
//! [`cube_core::Sandbox::usage`]: CPU use since the previous sample, memory, disk.

use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use crate::error::ApiError;
use crate::lock::lock;
use crate::service::{now_ms, Entry, Service};

/// One sample in E2B's `SandboxMetric` shape. CPU percent is the use since the
/// previous sample of this sandbox (0 on the first).
pub async fn sample(service: &Arc<Service>, entry: &Arc<Entry>) -> Result<Value, ApiError> {
    let id = entry.id.clone();
    let usage = service
        .blocking(move |rt| Ok(rt.attach(&id)?.usage()?))
        .await?;
    let now = Instant::now();
    let cpus = usage.cpus.max(1);
    let cpu_pct = {
        let mut last = lock(&entry.cpu_sample);
        let pct = match (*last, usage.cpu_time_ns) {
            (Some((then, before)), Some(ns)) if now > then => {
                let wall = now.duration_since(then).as_nanos() as f64 * f64::from(cpus);
                (ns.saturating_sub(before) as f64 / wall * 100.0).clamp(0.0, 100.0)
            }
            _ => 0.0,
        };
        if let Some(ns) = usage.cpu_time_ns {
            *last = Some((now, ns));
        }
        pct
    };
    let mem_total = usage
        .memory_limit_bytes
        .unwrap_or_else(|| host_memory_bytes().max(usage.memory_bytes));
    let ms = now_ms();
    Ok(json!({
        "timestamp": crate::envd::json::rfc3339((ms / 1000) as i64, 0),
        "timestampUnix": ms / 1000,
        "cpuCount": cpus,
        "cpuUsedPct": (cpu_pct * 100.0).round() / 100.0,
        "memUsed": usage.memory_bytes,
        "memTotal": mem_total,
        "memCache": usage.memory_cache_bytes,
        "diskUsed": 0,
        "diskTotal": 0,
    }))
}

fn host_memory_bytes() -> u64 {
    // SAFETY: sysinfo fills the zeroed struct it is given.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid, writable sysinfo struct.
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return 0;
    }
    (info.totalram as u64).saturating_mul(u64::from(info.mem_unit))
}
