//! `cube bench --network`: cube-net's benchmark (`cube_net::bench`, through
//! `cube_core::testing`): attach times
//! from the pool, and TCP latency and throughput through Cube's eBPF NAT against a
//! plain kernel-forwarded veth path in the same run, as ratios.

use serde::Serialize;

use std::path::Path;

use cube_core::testing::net_bench::{
    self as bench, BenchConfig, BenchReport, Percentiles, LATENCY_TARGET,
};
use cube_core::testing::{open_pool, pool_config, pool_name};

use super::report::{failed, progress, Target};
use super::stats::{percentiles_ms, round2};
use crate::cli_error::CliError;

#[derive(Serialize)]
struct Pair {
    p50: f64,
    p95: f64,
}

impl From<Percentiles> for Pair {
    fn from(p: Percentiles) -> Self {
        Pair {
            p50: round3(p.p50),
            p95: round3(p.p95),
        }
    }
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

#[derive(Serialize)]
struct PathRow {
    rr_us: Pair,
    crr_us: Pair,
    gbit: f64,
}

#[derive(Serialize)]
struct Ratios {
    rr_p50: f64,
    rr_p95: f64,
    crr_p50: f64,
    gbit: f64,
}

#[derive(Serialize)]
struct NetworkReport {
    section: &'static str,
    attaches: usize,
    rounds: usize,
    connects: usize,
    bulk_mib: usize,
    attach_pool_prepared_ms: Pair,
    attach_veth_into_netns_ms: Pair,
    /// A veth attached ahead (deny-everything) put into service: what a networked
    /// create from a pooled supervisor still does.
    activate_attached_ahead_ms: Pair,
    release_veth_ms: Pair,
    attach_tap_ms: Pair,
    plain: PathRow,
    cube: PathRow,
    cube_over_plain: Ratios,
    /// Jail sandbox creates through the Sandbox API (pooled supervisors; a create
    /// returns once the sandbox's agent listens), with and without a network,
    /// alternating; None where jails cannot run.
    sandbox_create: Option<CreateRows>,
    targets: Vec<Target>,
}

#[derive(Serialize)]
struct CreateRows {
    n: usize,
    without_network_ms: Pair,
    with_network_ms: Pair,
    /// with/without at p50.
    ratio_p50: f64,
    /// with/without at p95.
    ratio_p95: f64,
}

/// Creates (and destroys) `n` jail sandboxes with a network and `n` without,
/// alternating, through a pooled runtime on `root`.
fn sandbox_creates(root: &Path, n: usize) -> Result<CreateRows, CliError> {
    use cube_core::network::NetworkOptions;
    use cube_core::{CreateOptions, Runtime, RuntimeConfig, HOST_TEMPLATE};
    use std::time::{Duration, Instant};

    let rt = Runtime::open(RuntimeConfig {
        store_root: root.to_path_buf(),
        pool_size: 2,
        network_pool_size: 2,
        supervisor: None,
    })?;
    let networked = CreateOptions {
        network: Some(NetworkOptions::default()),
        ..CreateOptions::new(true)
    };
    let (mut plain, mut with) = (Vec::new(), Vec::new());
    // One of each first: the pool's first open loads the datapath.
    for round in 0..=n {
        for (options, samples) in [
            (CreateOptions::new(true), &mut plain),
            (networked.clone(), &mut with),
        ] {
            rt.wait_pool_ready();
            let start = Instant::now();
            let sb = rt.create(HOST_TEMPLATE, options)?;
            let took: Duration = start.elapsed();
            sb.destroy()?;
            if round > 0 {
                samples.push(took);
            }
        }
    }
    let (p50, p95) = percentiles_ms(&plain);
    let (np50, np95) = percentiles_ms(&with);
    Ok(CreateRows {
        n,
        without_network_ms: Pair {
            p50: round3(p50),
            p95: round3(p95),
        },
        with_network_ms: Pair {
            p50: round3(np50),
            p95: round3(np95),
        },
        ratio_p50: round3(np50 / p50),
        ratio_p95: round3(np95 / p95),
    })
}

fn path(p: &bench::PathNumbers) -> PathRow {
    PathRow {
        rr_us: p.rr_us.into(),
        crr_us: p.crr_us.into(),
        gbit: round2(p.gbit),
    }
}

fn report(
    config: &BenchConfig,
    r: &BenchReport,
    sandbox_create: Option<CreateRows>,
) -> NetworkReport {
    NetworkReport {
        section: "network",
        attaches: config.attaches,
        rounds: config.rounds,
        connects: config.connects,
        bulk_mib: config.bulk_mib,
        attach_pool_prepared_ms: r.attach_prepared_ms.into(),
        attach_veth_into_netns_ms: r.attach_veth_ms.into(),
        activate_attached_ahead_ms: r.activate_ms.into(),
        release_veth_ms: r.release_ms.into(),
        attach_tap_ms: r.attach_tap_ms.into(),
        plain: path(&r.plain),
        cube: path(&r.cube),
        cube_over_plain: Ratios {
            rr_p50: round3(r.rr_ratio_p50()),
            rr_p95: round3(r.rr_ratio_p95()),
            crr_p50: round3(r.crr_ratio_p50()),
            gbit: round3(r.gbit_ratio),
        },
        sandbox_create,
        targets: vec![Target {
            name: "eBPF path TCP round trip p50 / plain veth path",
            value: round3(r.rr_ratio_p50()),
            limit: LATENCY_TARGET,
            met: r.latency_target_met(),
        }],
    }
}

/// Runs the network section and prints it (markdown or JSON).
pub fn run(root: &Path, quick: bool, json: bool) -> Result<(), CliError> {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        return Err(CliError::unsupported(
            "the network bench needs root (namespaces, netlink, eBPF)",
        ));
    }
    let config = if quick {
        BenchConfig::quick()
    } else {
        BenchConfig::full()
    };
    progress("network: attach times, then TCP through Cube's NAT and a plain veth path");
    let measured = bench::run(&config).map_err(failed)?;
    progress("network: jail sandbox creates with and without a network");
    let pool = pool_name().map_err(failed)?;
    let pool_existed = pool_config(&pool)
        .bpffs
        .join("cube-net")
        .join(&pool)
        .exists();
    let creates = sandbox_creates(root, if quick { 10 } else { 30 });
    // The host's pool stays only where it was before.
    if !pool_existed {
        if let Ok((pool, _lock)) = open_pool() {
            let _ = pool.destroy();
        }
    }
    let creates = match creates {
        Ok(rows) => Some(rows),
        Err(e) => {
            progress(&format!("network: skipping sandbox creates: {}", e.message));
            None
        }
    };
    let r = report(&config, &measured, creates);
    if json {
        let text = serde_json::to_string_pretty(&r).map_err(failed)?;
        println!("{text}");
        return Ok(());
    }
    println!(
        "# cube bench --network ({} attaches, {} round trips, {} connects, {} MiB x7)\n",
        r.attaches, r.rounds, r.connects, r.bulk_mib
    );
    println!("| attach | p50 ms | p95 ms |\n|---|---|---|");
    for (what, p) in [
        (
            "prepared namespace from the pool",
            &r.attach_pool_prepared_ms,
        ),
        (
            "veth into the jail's namespace (jail engine; pooled supervisors do it ahead)",
            &r.attach_veth_into_netns_ms,
        ),
        (
            "put a veth attached ahead into service (on the create path)",
            &r.activate_attached_ahead_ms,
        ),
        ("release a veth", &r.release_veth_ms),
        ("TAP from the pool (VM engine)", &r.attach_tap_ms),
    ] {
        println!("| {what} | {} | {} |", p.p50, p.p95);
    }
    println!("\n| TCP | plain veth | Cube eBPF NAT | cube/plain |\n|---|---|---|---|");
    println!(
        "| round trip p50 / p95 us | {} / {} | {} / {} | {} / {} |",
        r.plain.rr_us.p50,
        r.plain.rr_us.p95,
        r.cube.rr_us.p50,
        r.cube.rr_us.p95,
        r.cube_over_plain.rr_p50,
        r.cube_over_plain.rr_p95
    );
    println!(
        "| connect+request p50 us | {} | {} | {} |",
        r.plain.crr_us.p50, r.cube.crr_us.p50, r.cube_over_plain.crr_p50
    );
    println!(
        "| throughput Gbit/s | {} | {} | {} |",
        r.plain.gbit, r.cube.gbit, r.cube_over_plain.gbit
    );
    if let Some(c) = &r.sandbox_create {
        println!(
            "\n| jail sandbox create to agent ready (pooled, n={}) | p50 ms | p95 ms |\n|---|---|---|\n| without a network | {} | {} |\n| with a network | {} | {} |\n\nwith/without p50: {}, p95: {}",
            c.n,
            c.without_network_ms.p50,
            c.without_network_ms.p95,
            c.with_network_ms.p50,
            c.with_network_ms.p95,
            c.ratio_p50,
            c.ratio_p95
        );
    }
    for t in &r.targets {
        println!(
            "\n{}: {} (limit {}) {}",
            t.name,
            t.value,
            t.limit,
            if t.met { "met" } else { "MISSED" }
        );
    }
    Ok(())
}
