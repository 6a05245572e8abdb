//! `cube bench --scaling`: CubeSandbox's §3.2 and §3.3 on this host, for either
//! engine: creates at concurrency 1 to 64 (p50, p95, throughput), and the memory that
//! 100 and 500 idle sandboxes take (the host's used memory grown, per sandbox, and the
//! proportional set size of their processes), with how many would fit.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cube_core::store::filesystem_name;
use cube_core::templates::{MachineConfig, WorkingSet};
use cube_core::testing::TestGuestControl;
use cube_core::{CreateOptions, Runtime, RuntimeConfig, Sandbox, HOST_TEMPLATE};
use serde::Serialize;

use super::interrupt::remove_on_interrupt;
use super::report::{create_table, failed, progress, progress_done, table, CreateRow, Target};
use super::stats::{percentiles_ms, round2};
use crate::cli_error::{chain, CliError};

/// Concurrency levels of the reference's cold-start table, and a few more.
pub const LEVELS: &[usize] = &[1, 2, 4, 8, 16, 32, 64];
/// Sandbox counts of the density rows.
pub const DENSITY: &[usize] = &[100, 500];

/// What one scaling run measures.
pub struct ScalingPlan {
    /// Concurrency levels.
    pub levels: Vec<usize>,
    /// Sandbox counts for the density rows.
    pub density: Vec<usize>,
}

impl ScalingPlan {
    /// Creates at `concurrency`: at least 20, and four rounds of the level.
    fn creates(concurrency: usize) -> usize {
        (4 * concurrency).max(20)
    }
}

/// The memory of `sandboxes` idle sandboxes.
#[derive(Serialize)]
pub struct DensityRow {
    pub sandboxes: usize,
    /// The host's used memory (MemTotal - MemFree - Buffers - Cached - SReclaimable
    /// + Shmem, the reference's "Used Memory") grown by them, MiB.
    pub used_mib: f64,
    pub used_mib_per_sandbox: f64,
    /// Proportional set size of each sandbox's processes (supervisor, and a jail's
    /// own processes), mean, MiB.
    pub pss_mib_per_sandbox: f64,
    /// How many such sandboxes the host's memory holds: what was free of used memory
    /// before they started, over the per-sandbox growth.
    pub fit_in_host: u64,
}

#[derive(Serialize)]
struct ScalingReport {
    /// "scaling": which report this is (the others have no such key).
    kind: &'static str,
    engine: &'static str,
    guest: &'static str,
    store_filesystem: String,
    host_memory_mib: f64,
    /// Creates at each concurrency level, timed until create returns (a jail's agent
    /// then listens; a VM's vCPUs run).
    create_from_template: Vec<CreateRow>,
    density: Vec<DensityRow>,
    /// Wall time of the whole run.
    elapsed_s: f64,
    targets: Vec<Target>,
}

/// Runs the scaling plan for `engine` ("vm": Cube's test guest, "jail": the host
/// userland) and prints its report.
pub fn run(root: &Path, engine: &str, plan: &ScalingPlan, json: bool) -> Result<(), CliError> {
    let started = Instant::now();
    let max = plan.levels.iter().copied().max().unwrap_or(1);
    progress(&format!(
        "scaling, {engine}: {} levels up to {max}, density {:?} (on 2 cores: ~3 minutes for VMs, seconds for jails)",
        plan.levels.len(),
        plan.density
    ));
    let rt = Runtime::open(RuntimeConfig {
        store_root: root.to_path_buf(),
        pool_size: max + 2,
        network_pool_size: 0,
        supervisor: None,
    })?;
    let template = match engine {
        "vm" => {
            let name = format!("bench-scaling-{}", std::process::id());
            remove_on_interrupt(root, &name)?;
            progress(&format!("building template {name}"));
            rt.build_test_template(&name, MachineConfig::default(), WorkingSet::default(), 0)?;
            Some(name)
        }
        _ => None,
    };
    let name = template.as_deref().unwrap_or(HOST_TEMPLATE);
    let measured = measure(root, &rt, name, engine, plan);
    if let Some(t) = &template {
        let _ = rt.remove_template(t);
    }
    let (rows, density) = measured?;
    progress_done();
    let mut targets = Vec::new();
    if let Some(first) = rows.iter().find(|r| r.concurrency == 1) {
        targets.push(Target::at_most(
            "create_p95_vs_p50_concurrency_1",
            round2(first.p95_ms / first.p50_ms.max(1e-9)),
            3.0,
        ));
    }
    let report = ScalingReport {
        kind: "scaling",
        engine: if engine == "vm" { "vm" } else { "jail" },
        guest: if engine == "vm" {
            "synthetic"
        } else {
            "host userland"
        },
        store_filesystem: filesystem_name(root).unwrap_or_default(),
        host_memory_mib: round2(meminfo_kib("MemTotal:")? / 1024.0),
        create_from_template: rows,
        density,
        elapsed_s: round2(started.elapsed().as_secs_f64()),
        targets,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report).map_err(failed)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

fn measure(
    root: &Path,
    rt: &Runtime,
    template: &str,
    engine: &str,
    plan: &ScalingPlan,
) -> Result<(Vec<CreateRow>, Vec<DensityRow>), CliError> {
    let mut rows = Vec::new();
    for &concurrency in &plan.levels {
        let n = ScalingPlan::creates(concurrency);
        progress(&format!(
            "create from template: concurrency {concurrency}, n {n}"
        ));
        rt.wait_pool_ready();
        rows.push(create_at(rt, template, concurrency, n)?);
    }
    let mut density = Vec::new();
    for &count in &plan.density {
        progress(&format!("memory of {count} idle sandboxes"));
        density.push(density_of(root, template, engine, count)?);
    }
    Ok((rows, density))
}

/// `n` creates of `template`, `concurrency` at a time, each destroyed once made:
/// latency until create returns, throughput over the wall time (destroys included,
/// as the reference's create-then-delete loop).
pub fn create_at(
    rt: &Runtime,
    template: &str,
    concurrency: usize,
    n: usize,
) -> Result<CreateRow, CliError> {
    let wall_start = Instant::now();
    let samples = Mutex::new(Vec::with_capacity(n));
    let failures = Mutex::new(Vec::new());
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..concurrency {
            scope.spawn(|| {
                while next.fetch_add(1, Ordering::Relaxed) < n {
                    let start = Instant::now();
                    match rt.create(template, CreateOptions::new(true)) {
                        Ok(sb) => {
                            let elapsed = start.elapsed();
                            samples
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push(elapsed);
                            let _ = sb.destroy();
                        }
                        Err(e) => failures
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(chain(&e)),
                    }
                }
            });
        }
    });
    let wall = wall_start.elapsed();
    if let Some(e) = failures
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .first()
    {
        return Err(CliError::failed(e.clone()));
    }
    let samples = samples.into_inner().unwrap_or_else(|e| e.into_inner());
    let (p50, p95) = percentiles_ms(&samples);
    Ok(CreateRow {
        concurrency,
        n,
        p50_ms: round2(p50),
        p95_ms: round2(p95),
        throughput_per_s: round2(n as f64 / wall.as_secs_f64().max(1e-9)),
    })
}

/// Starts `count` sandboxes of `template`, lets them settle idle, and measures what
/// they hold; every one is destroyed before returning, on every path.
fn density_of(
    root: &Path,
    template: &str,
    engine: &str,
    count: usize,
) -> Result<DensityRow, CliError> {
    // No pool: idle pooled supervisors would be counted against the sandboxes.
    let rt = Runtime::open(RuntimeConfig {
        store_root: root.to_path_buf(),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: None,
    })?;
    settle();
    let before = used_memory_mib()?;
    let available = meminfo_kib("MemTotal:")? / 1024.0 - before;
    let mut sandboxes: Vec<Sandbox> = Vec::with_capacity(count);
    let result = (|| -> Result<DensityRow, CliError> {
        for i in 0..count {
            let mut sb = rt.create(template, CreateOptions::new(true))?;
            if engine == "vm" {
                sb.guest_wait_working_set()?;
            } else {
                drop(sb.agent()?);
            }
            sandboxes.push(sb);
            if (i + 1) % 50 == 0 {
                progress(&format!("memory of {count} idle sandboxes: {} up", i + 1));
            }
        }
        settle();
        let used = used_memory_mib()? - before;
        let mut pss_kib = 0u64;
        for sb in &mut sandboxes {
            let status = sb.status()?;
            pss_kib += proportional_set_kib(status.pid);
            for pid in status
                .jail
                .iter()
                .flat_map(|j| j.cgroups.first())
                .flat_map(|cg| cgroup_pids(cg))
            {
                pss_kib += proportional_set_kib(pid);
            }
        }
        let per = used / count as f64;
        Ok(DensityRow {
            sandboxes: count,
            used_mib: round2(used),
            used_mib_per_sandbox: round2(per),
            pss_mib_per_sandbox: round2(pss_kib as f64 / 1024.0 / count as f64),
            fit_in_host: if per > 0.0 {
                (available / per) as u64
            } else {
                0
            },
        })
    })();
    progress(&format!("memory of {count} idle sandboxes: destroying"));
    for sb in sandboxes {
        let _ = sb.destroy();
    }
    result
}

/// Lets exited processes and freed memory settle before memory is read.
fn settle() {
    std::thread::sleep(Duration::from_millis(500));
}

/// Processes in the cgroup directory `dir`.
fn cgroup_pids(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// A field of /proc/meminfo, KiB.
fn meminfo_kib(field: &str) -> Result<f64, CliError> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(failed)?;
    Ok(meminfo_field(&text, field))
}

fn meminfo_field(text: &str, field: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// Memory in use that no cache can give back, MiB (the reference's "Used Memory").
pub fn used_memory_mib() -> Result<f64, CliError> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(failed)?;
    let f = |name| meminfo_field(&text, name);
    let kib = f("MemTotal:") - f("MemFree:") - f("Buffers:") - f("Cached:") - f("SReclaimable:")
        + f("Shmem:");
    Ok(kib / 1024.0)
}

/// `Pss` of process `pid`, KiB; 0 for a process gone meanwhile.
pub fn proportional_set_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Pss:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn print_table(r: &ScalingReport) {
    println!(
        "# cube bench --scaling: {} engine ({}), store on {}, {} MiB host memory, {} s\n",
        r.engine, r.guest, r.store_filesystem, r.host_memory_mib, r.elapsed_s
    );
    println!("## Create at concurrency (§3.2)\n");
    create_table(&r.create_from_template);
    println!("\n## Density (§3.3)\n");
    table(
        &[
            "Sandboxes",
            "Used MiB",
            "Used MiB / sandbox",
            "PSS MiB / sandbox",
            "Fit in host",
        ],
        r.density.iter().map(|row| {
            vec![
                row.sandboxes.to_string(),
                row.used_mib.to_string(),
                row.used_mib_per_sandbox.to_string(),
                row.pss_mib_per_sandbox.to_string(),
                row.fit_in_host.to_string(),
            ]
        }),
    );
    for t in &r.targets {
        println!(
            "\ntarget {} {} (limit {}) {}",
            t.name,
            t.value,
            t.limit,
            if t.met { "met" } else { "MISSED" }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_per_level_cover_four_rounds() {
        assert_eq!(ScalingPlan::creates(1), 20);
        assert_eq!(ScalingPlan::creates(8), 32);
        assert_eq!(ScalingPlan::creates(64), 256);
    }

    #[test]
    fn reads_meminfo_fields() {
        let text = "MemTotal:       24683584 kB\nMemFree:        16000000 kB\n";
        assert_eq!(meminfo_field(text, "MemTotal:"), 24683584.0);
        assert_eq!(meminfo_field(text, "Cached:"), 0.0);
    }
}
