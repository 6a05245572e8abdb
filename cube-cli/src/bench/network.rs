//! `cube bench --network`: cube-net's benchmark (`cube_net::bench`): attach times
//! from the pool, and TCP latency and throughput through Cube's eBPF NAT against a
//! plain kernel-forwarded veth path in the same run, as ratios.

use serde::Serialize;

use cube_net::bench::{self, BenchConfig, BenchReport, Percentiles, LATENCY_TARGET};

use super::stats::round2;
use super::{failed, progress, Target};
use crate::CliError;

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
    release_veth_ms: Pair,
    attach_tap_ms: Pair,
    plain: PathRow,
    cube: PathRow,
    cube_over_plain: Ratios,
    targets: Vec<Target>,
}

fn path(p: &bench::PathNumbers) -> PathRow {
    PathRow {
        rr_us: p.rr_us.into(),
        crr_us: p.crr_us.into(),
        gbit: round2(p.gbit),
    }
}

fn report(config: &BenchConfig, r: &BenchReport) -> NetworkReport {
    NetworkReport {
        section: "network",
        attaches: config.attaches,
        rounds: config.rounds,
        connects: config.connects,
        bulk_mib: config.bulk_mib,
        attach_pool_prepared_ms: r.attach_prepared_ms.into(),
        attach_veth_into_netns_ms: r.attach_veth_ms.into(),
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
        targets: vec![Target {
            name: "eBPF path TCP round trip p50 / plain veth path",
            value: round3(r.rr_ratio_p50()),
            limit: LATENCY_TARGET,
            met: r.latency_target_met(),
        }],
    }
}

/// Runs the network section and prints it (markdown or JSON).
pub fn run(quick: bool, json: bool) -> Result<(), CliError> {
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
    let r = report(&config, &measured);
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
            "veth into the jail's namespace (jail engine)",
            &r.attach_veth_into_netns_ms,
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
