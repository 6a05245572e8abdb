//! cube-net's benchmark (see `cube_net::bench`): attach times from the pool, and TCP
//! through Cube's datapath against a plain kernel-forwarded veth path, in
//! namespaces it builds and removes. `cube bench --network` runs the same code.
//!
//! Run as root: `cargo run --release -p cube-net --example netbench [-- --quick]`.

use cube_net::bench::{self, BenchConfig, LATENCY_TARGET};

fn main() -> std::process::ExitCode {
    let quick = std::env::args().any(|arg| arg == "--quick");
    let config = if quick {
        BenchConfig::quick()
    } else {
        BenchConfig::full()
    };
    let r = match bench::run(&config) {
        Ok(r) => r,
        Err(e) => {
            let mut text = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                text.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            eprintln!("netbench: {text}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let line = |what: &str, p: bench::Percentiles, unit: &str| {
        println!(
            "  {what:<24} p50 {:8.3} {unit}  p95 {:8.3} {unit}",
            p.p50, p.p95
        )
    };
    println!(
        "cube-net netbench ({} attaches, {} round trips, {} connects, {} MiB x7)",
        config.attaches, config.rounds, config.connects, config.bulk_mib
    );
    line("attach prepared netns", r.attach_prepared_ms, "ms");
    line("attach veth into netns", r.attach_veth_ms, "ms");
    line("release veth", r.release_ms, "ms");
    line("attach TAP from pool", r.attach_tap_ms, "ms");
    line("TCP round trip plain", r.plain.rr_us, "us");
    line("TCP round trip cube", r.cube.rr_us, "us");
    line("connect+request plain", r.plain.crr_us, "us");
    line("connect+request cube", r.cube.crr_us, "us");
    println!(
        "  round trip cube/plain p50 {:.2}x p95 {:.2}x (target {LATENCY_TARGET}x: {}); connect+request p50 {:.2}x",
        r.rr_ratio_p50(),
        r.rr_ratio_p95(),
        if r.latency_target_met() { "met" } else { "missed" },
        r.crr_ratio_p50()
    );
    println!(
        "  throughput plain {:.2} Gbit/s, cube {:.2} Gbit/s (cube/plain {:.2}x)",
        r.plain.gbit, r.cube.gbit, r.gbit_ratio
    );
    std::process::ExitCode::SUCCESS
}
