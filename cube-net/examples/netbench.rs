//! cube-net's benchmark, in network namespaces it builds and removes (tests/lab):
//!
//! - attach: a prepared namespace from the pool (p50/p95), against a veth made on
//!   the create path straight into a namespace the jail already has; release; a
//!   TAP from the pool.
//! - TCP through Cube's datapath (sandbox → eBPF NAT → outside) against a plain veth
//!   path through the same host namespace with kernel forwarding and no NAT:
//!   round-trip latency on one connection, connect+request+close latency, and bulk
//!   throughput (median of seven; ratio: median of the pairwise ratios), each as a
//!   ratio cube/plain measured in the same run,
//!   the two paths measured in alternating slices.
//!
//! Run as root: `cargo run --release -p cube-net --example netbench [-- --quick]`.
//! Prints a table and one JSON line (prefixed `netbench-json:`) for `cube bench`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/lab/mod.rs"]
mod lab;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cube_net::{EgressPolicy, Netns};
use lab::{ip, Lab, PoolGuard, OUT_ADDR};

const RR_PORT: u16 = 7001;
const BULK_PORT: u16 = 7002;
const PLAIN_ADDR: &str = "10.99.0.2";

struct Stats {
    p50: f64,
    p95: f64,
}

fn stats(mut samples: Vec<f64>) -> Stats {
    samples.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    Stats {
        p50: at(0.50),
        p95: at(0.95),
    }
}

/// Echo server for request/response (64-byte messages) and a sink for bulk data.
fn start_servers(out: Netns, stop: Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let mut handles = Vec::new();
    for (port, bulk) in [(RR_PORT, false), (BULK_PORT, true)] {
        let stop = stop.clone();
        let ready = ready_tx.clone();
        let fd = out.fd().try_clone().unwrap();
        handles.push(std::thread::spawn(move || {
            nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let listener = TcpListener::bind(("0.0.0.0", port)).unwrap();
            ready.send(()).unwrap();
            // Blocking accept: polling would add its sleep to every connect. The
            // thread ends with the process.
            while !stop.load(Ordering::Relaxed) {
                let Ok((mut stream, _)) = listener.accept() else {
                    continue;
                };
                stream.set_nonblocking(false).unwrap();
                stream.set_nodelay(true).unwrap();
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; if bulk { 1 << 20 } else { 64 }];
                    loop {
                        if bulk {
                            match stream.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(_) => {}
                            }
                        } else {
                            if stream.read_exact(&mut buf).is_err() {
                                break;
                            }
                            if stream.write_all(&buf).is_err() {
                                break;
                            }
                        }
                    }
                    if bulk {
                        let _ = stream.write_all(b"k");
                    }
                });
            }
        }));
    }
    for _ in 0..2 {
        ready_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    }
    handles
}

/// Round trips of 64 bytes on one connection, in microseconds.
fn round_trips(from: &Netns, rounds: usize) -> Vec<f64> {
    from.run(|| {
        let target = SocketAddr::from((OUT_ADDR, RR_PORT));
        let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(2)).unwrap();
        stream.set_nodelay(true).unwrap();
        let mut buf = [7u8; 64];
        for _ in 0..100 {
            stream.write_all(&buf).unwrap();
            stream.read_exact(&mut buf).unwrap();
        }
        (0..rounds)
            .map(|_| {
                let start = Instant::now();
                stream.write_all(&buf).unwrap();
                stream.read_exact(&mut buf).unwrap();
                start.elapsed().as_secs_f64() * 1e6
            })
            .collect()
    })
    .unwrap()
}

/// A new connection per request, like short HTTP calls, in microseconds.
fn connect_requests(from: &Netns, connects: usize) -> Vec<f64> {
    from.run(|| {
        let target = SocketAddr::from((OUT_ADDR, RR_PORT));
        let mut buf = [7u8; 64];
        (0..connects)
            .map(|_| {
                let start = Instant::now();
                let mut stream =
                    TcpStream::connect_timeout(&target, Duration::from_secs(2)).unwrap();
                stream.set_nodelay(true).unwrap();
                stream.write_all(&buf).unwrap();
                stream.read_exact(&mut buf).unwrap();
                drop(stream);
                start.elapsed().as_secs_f64() * 1e6
            })
            .collect()
    })
    .unwrap()
}

/// Bulk send of `mib` MiB until the server has read it all, in Gbit/s.
fn bulk(from: &Netns, mib: usize) -> f64 {
    from.run(|| {
        let target = SocketAddr::from((OUT_ADDR, BULK_PORT));
        let chunk = vec![0x5au8; 1 << 20];
        let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(2)).unwrap();
        let start = Instant::now();
        for _ in 0..mib {
            stream.write_all(&chunk).unwrap();
        }
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        let mut ack = [0u8; 1];
        stream.read_exact(&mut ack).unwrap();
        (mib as f64 * 8.0 * 1024.0 * 1024.0) / start.elapsed().as_secs_f64() / 1e9
    })
    .unwrap()
}

struct PathNumbers {
    rr: Stats,
    crr: Stats,
    /// Median throughput over the slices.
    gbit: f64,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// Measures both paths in alternating slices, so drift in the host's load (other
/// builds on a shared machine) hits both alike. Also returns the median of the
/// slices' cube/plain throughput ratios, steadier than a ratio of two medians.
fn measure_paths(
    plain: &Netns,
    cube: &Netns,
    rounds: usize,
    connects: usize,
    mib: usize,
) -> (PathNumbers, PathNumbers, f64) {
    const SLICES: usize = 7;
    let (mut plain_rr, mut cube_rr, mut plain_crr, mut cube_crr) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut plain_gbit, mut cube_gbit, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..SLICES {
        plain_rr.extend(round_trips(plain, rounds / SLICES));
        cube_rr.extend(round_trips(cube, rounds / SLICES));
        plain_crr.extend(connect_requests(plain, connects / SLICES));
        cube_crr.extend(connect_requests(cube, connects / SLICES));
        let (p, c) = (bulk(plain, mib), bulk(cube, mib));
        plain_gbit.push(p);
        cube_gbit.push(c);
        ratios.push(c / p);
    }
    (
        PathNumbers {
            rr: stats(plain_rr),
            crr: stats(plain_crr),
            gbit: median(plain_gbit),
        },
        PathNumbers {
            rr: stats(cube_rr),
            crr: stats(cube_crr),
            gbit: median(cube_gbit),
        },
        median(ratios),
    )
}

fn main() {
    let quick = std::env::args().any(|arg| arg == "--quick");
    let (attaches, rounds, connects, bulk_mib) = if quick {
        (30, 2000, 100, 64)
    } else {
        (200, 20000, 1000, 256)
    };
    let Some(mut lab) = Lab::new("bench") else {
        return;
    };

    // The plain path: a namespace on a veth to the host, kernel-forwarded, no NAT.
    lab.add_namespace("plain").unwrap();
    let (host, plain, out) = (lab.name("host"), lab.name("plain"), lab.name("out"));
    ip(&[
        "-n", &host, "link", "add", "plainh", "type", "veth", "peer", "name", "eth0", "netns",
        &plain,
    ])
    .unwrap();
    ip(&["-n", &host, "addr", "add", "10.99.0.1/30", "dev", "plainh"]).unwrap();
    ip(&["-n", &host, "link", "set", "plainh", "up"]).unwrap();
    ip(&[
        "-n",
        &plain,
        "addr",
        "add",
        &format!("{PLAIN_ADDR}/30"),
        "dev",
        "eth0",
    ])
    .unwrap();
    ip(&["-n", &plain, "link", "set", "eth0", "up"]).unwrap();
    ip(&["-n", &plain, "route", "add", "default", "via", "10.99.0.1"]).unwrap();
    ip(&[
        "-n",
        &out,
        "route",
        "add",
        "10.99.0.0/30",
        "via",
        "198.51.100.1",
    ])
    .unwrap();
    lab.netns("host")
        .run(|| std::fs::write("/proc/sys/net/ipv4/ip_forward", "1"))
        .unwrap()
        .unwrap();

    let mut config = lab.pool_config(4, 1);
    config.name = format!("bench-{}", std::process::id());
    let guard = PoolGuard(lab.open_pool(config.clone()));
    let Some(pool) = guard.0.as_ref() else { return };

    // Attach: a prepared namespace from the pool vs a veth made on the create path
    // straight into a namespace the jail already has; release; a TAP from the pool.
    let mut warm = Vec::new();
    let mut cold = Vec::new();
    let mut release = Vec::new();
    let mut tap = Vec::new();
    for i in 0..attaches {
        let start = Instant::now();
        let net = pool.attach_prepared(&EgressPolicy::default()).unwrap();
        warm.push(start.elapsed().as_secs_f64() * 1e3);
        let start = Instant::now();
        pool.release(net).unwrap();
        release.push(start.elapsed().as_secs_f64() * 1e3);
        pool.refill().unwrap();

        let which = format!("a{i}");
        lab.add_namespace(&which).unwrap();
        let target = lab.netns_ref(&which);
        let start = Instant::now();
        let net = pool.attach_veth(&target, &EgressPolicy::default()).unwrap();
        cold.push(start.elapsed().as_secs_f64() * 1e3);
        pool.release(net).unwrap();
        lab.remove_namespace(&which);

        let start = Instant::now();
        let net = pool
            .attach_tap([2, 0, 0, 0, 0, 1], &EgressPolicy::default())
            .unwrap();
        tap.push(start.elapsed().as_secs_f64() * 1e3);
        pool.release(net).unwrap();
    }

    // Throughput and latency: NAT path vs plain path.
    lab.add_namespace("sb").unwrap();
    let sandbox = pool
        .attach_veth(&lab.netns_ref("sb"), &EgressPolicy::default())
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let servers = start_servers(lab.netns("out"), stop.clone());
    let plain_ns = lab.netns("plain");
    let nat_ns = lab.netns("sb");
    if std::env::var_os("NETBENCH_BULK_PAIRS").is_some() {
        // Diagnostic: alternating bulk transfers only, each pair printed.
        for _ in 0..10 {
            let plain = bulk(&plain_ns, bulk_mib);
            let cube = bulk(&nat_ns, bulk_mib);
            println!("bulk plain {plain:6.2} cube {cube:6.2} Gbit/s");
        }
        pool.release(sandbox).unwrap();
        return;
    }
    // Warm both paths once.
    let _ = measure_paths(&plain_ns, &nat_ns, 500, 50, 8);
    let (plain_numbers, nat_numbers, gbit_ratio) =
        measure_paths(&plain_ns, &nat_ns, rounds, connects, bulk_mib);
    stop.store(true, Ordering::Relaxed);
    drop(servers);
    let counters = pool.counters(&sandbox).unwrap();
    pool.release(sandbox).unwrap();

    let warm = stats(warm);
    let cold = stats(cold);
    let release = stats(release);
    let tap = stats(tap);
    println!("cube-net netbench ({attaches} attaches, {rounds} round trips, {connects} connects, {bulk_mib} MiB x7, median)");
    println!(
        "  attach prepared netns    p50 {:8.3} ms  p95 {:8.3} ms",
        warm.p50, warm.p95
    );
    println!(
        "  attach veth into netns   p50 {:8.3} ms  p95 {:8.3} ms  (prepared/into p50 {:.2}x)",
        cold.p50,
        cold.p95,
        warm.p50 / cold.p50
    );
    println!(
        "  release veth             p50 {:8.3} ms  p95 {:8.3} ms",
        release.p50, release.p95
    );
    println!(
        "  attach TAP from pool     p50 {:8.3} ms  p95 {:8.3} ms",
        tap.p50, tap.p95
    );
    println!(
        "  TCP round trip   plain   p50 {:8.1} us  p95 {:8.1} us",
        plain_numbers.rr.p50, plain_numbers.rr.p95
    );
    println!("  TCP round trip   cube    p50 {:8.1} us  p95 {:8.1} us  (cube/plain p50 {:.2}x p95 {:.2}x)", nat_numbers.rr.p50, nat_numbers.rr.p95, nat_numbers.rr.p50 / plain_numbers.rr.p50, nat_numbers.rr.p95 / plain_numbers.rr.p95);
    println!(
        "  connect+request  plain   p50 {:8.1} us  p95 {:8.1} us",
        plain_numbers.crr.p50, plain_numbers.crr.p95
    );
    println!("  connect+request  cube    p50 {:8.1} us  p95 {:8.1} us  (cube/plain p50 {:.2}x p95 {:.2}x)", nat_numbers.crr.p50, nat_numbers.crr.p95, nat_numbers.crr.p50 / plain_numbers.crr.p50, nat_numbers.crr.p95 / plain_numbers.crr.p95);
    println!(
        "  TCP throughput   plain   {:8.2} Gbit/s",
        plain_numbers.gbit
    );
    println!(
        "  TCP throughput   cube    {:8.2} Gbit/s  (cube/plain {:.2}x)",
        nat_numbers.gbit, gbit_ratio
    );
    println!("  sandbox counters: {counters:?}");
    println!(
        "netbench-json: {{\"attach_pool_ms\":{{\"p50\":{:.4},\"p95\":{:.4}}},\"attach_into_netns_ms\":{{\"p50\":{:.4},\"p95\":{:.4}}},\"release_ms\":{{\"p50\":{:.4},\"p95\":{:.4}}},\"attach_tap_ms\":{{\"p50\":{:.4},\"p95\":{:.4}}},\"rr_us\":{{\"plain_p50\":{:.2},\"cube_p50\":{:.2},\"plain_p95\":{:.2},\"cube_p95\":{:.2},\"ratio_p50\":{:.3},\"ratio_p95\":{:.3}}},\"crr_us\":{{\"plain_p50\":{:.2},\"cube_p50\":{:.2},\"ratio_p50\":{:.3},\"ratio_p95\":{:.3}}},\"gbit\":{{\"plain\":{:.3},\"cube\":{:.3},\"ratio\":{:.3}}}}}",
        warm.p50, warm.p95, cold.p50, cold.p95, release.p50, release.p95, tap.p50, tap.p95,
        plain_numbers.rr.p50, nat_numbers.rr.p50, plain_numbers.rr.p95, nat_numbers.rr.p95,
        nat_numbers.rr.p50 / plain_numbers.rr.p50, nat_numbers.rr.p95 / plain_numbers.rr.p95,
        plain_numbers.crr.p50, nat_numbers.crr.p50, nat_numbers.crr.p50 / plain_numbers.crr.p50, nat_numbers.crr.p95 / plain_numbers.crr.p95,
        plain_numbers.gbit, nat_numbers.gbit, gbit_ratio,
    );
}
