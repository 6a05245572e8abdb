//! cube-net's benchmark, in network namespaces it builds and removes (tests/lab):
//!
//! - attach: a prepared namespace from the pool (p50/p95), against a veth made on
//!   the create path straight into a namespace the jail already has; release; a
//!   TAP from the pool.
//! - TCP through Cube's datapath (sandbox → eBPF NAT → outside) against a plain veth
//!   path through the same host namespace with kernel forwarding and no NAT:
//!   round-trip latency on one connection, connect+request+close latency, and bulk
//!   throughput, each as a ratio nat/plain measured in the same run.
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

struct PathNumbers {
    rr: Stats,
    crr: Stats,
    gbit: f64,
}

/// Runs the TCP measurements from inside namespace `from` to the outside server.
fn measure_path(from: &Netns, rounds: usize, connects: usize, bulk_mib: usize) -> PathNumbers {
    from.run(|| {
        let rr_target = SocketAddr::from((OUT_ADDR, RR_PORT));
        let bulk_target = SocketAddr::from((OUT_ADDR, BULK_PORT));
        // Round trips on one connection.
        let mut stream = TcpStream::connect_timeout(&rr_target, Duration::from_secs(2)).unwrap();
        stream.set_nodelay(true).unwrap();
        let mut buf = [7u8; 64];
        for _ in 0..200 {
            stream.write_all(&buf).unwrap();
            stream.read_exact(&mut buf).unwrap();
        }
        let mut rr = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let start = Instant::now();
            stream.write_all(&buf).unwrap();
            stream.read_exact(&mut buf).unwrap();
            rr.push(start.elapsed().as_secs_f64() * 1e6);
        }
        drop(stream);
        // A new connection per request, like short HTTP calls.
        let mut crr = Vec::with_capacity(connects);
        for _ in 0..connects {
            let start = Instant::now();
            let mut stream =
                TcpStream::connect_timeout(&rr_target, Duration::from_secs(2)).unwrap();
            stream.set_nodelay(true).unwrap();
            stream.write_all(&buf).unwrap();
            stream.read_exact(&mut buf).unwrap();
            drop(stream);
            crr.push(start.elapsed().as_secs_f64() * 1e6);
        }
        // Bulk: best of three.
        let chunk = vec![0x5au8; 1 << 20];
        let mut best = 0f64;
        for _ in 0..3 {
            let mut stream =
                TcpStream::connect_timeout(&bulk_target, Duration::from_secs(2)).unwrap();
            let start = Instant::now();
            for _ in 0..bulk_mib {
                stream.write_all(&chunk).unwrap();
            }
            stream.shutdown(std::net::Shutdown::Write).unwrap();
            let mut ack = [0u8; 1];
            stream.read_exact(&mut ack).unwrap();
            let gbit =
                (bulk_mib as f64 * 8.0 * 1024.0 * 1024.0) / start.elapsed().as_secs_f64() / 1e9;
            best = best.max(gbit);
        }
        PathNumbers {
            rr: stats(rr),
            crr: stats(crr),
            gbit: best,
        }
    })
    .unwrap()
}

fn main() {
    let quick = std::env::args().any(|arg| arg == "--quick");
    let (attaches, rounds, connects, bulk_mib) = if quick {
        (30, 2000, 100, 64)
    } else {
        (200, 20000, 1000, 512)
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
    // Warm both paths once, then alternate so drift in host load hits both alike.
    let _ = measure_path(&plain_ns, 100, 10, 8);
    let _ = measure_path(&nat_ns, 100, 10, 8);
    let plain_numbers = measure_path(&plain_ns, rounds, connects, bulk_mib);
    let nat_numbers = measure_path(&nat_ns, rounds, connects, bulk_mib);
    stop.store(true, Ordering::Relaxed);
    drop(servers);
    let counters = pool.counters(&sandbox).unwrap();
    pool.release(sandbox).unwrap();

    let warm = stats(warm);
    let cold = stats(cold);
    let release = stats(release);
    let tap = stats(tap);
    println!("cube-net netbench ({attaches} attaches, {rounds} round trips, {connects} connects, {bulk_mib} MiB x3)");
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
        nat_numbers.gbit,
        nat_numbers.gbit / plain_numbers.gbit
    );
    println!("  sandbox counters: {counters:?}");
    println!(
        "netbench-json: {{\"attach_pool_ms\":{{\"p50\":{:.4},\"p95\":{:.4}}},\"attach_into_netns_ms\":{{\"p50\":{:.4},\"p95\":{:.4}}},\"release_ms\":{{\"p50\":{:.4},\"p95\":{:.4}}},\"attach_tap_ms\":{{\"p50\":{:.4},\"p95\":{:.4}}},\"rr_us\":{{\"plain_p50\":{:.2},\"cube_p50\":{:.2},\"plain_p95\":{:.2},\"cube_p95\":{:.2},\"ratio_p50\":{:.3},\"ratio_p95\":{:.3}}},\"crr_us\":{{\"plain_p50\":{:.2},\"cube_p50\":{:.2},\"ratio_p50\":{:.3},\"ratio_p95\":{:.3}}},\"gbit\":{{\"plain\":{:.3},\"cube\":{:.3},\"ratio\":{:.3}}}}}",
        warm.p50, warm.p95, cold.p50, cold.p95, release.p50, release.p95, tap.p50, tap.p95,
        plain_numbers.rr.p50, nat_numbers.rr.p50, plain_numbers.rr.p95, nat_numbers.rr.p95,
        nat_numbers.rr.p50 / plain_numbers.rr.p50, nat_numbers.rr.p95 / plain_numbers.rr.p95,
        plain_numbers.crr.p50, nat_numbers.crr.p50, nat_numbers.crr.p50 / plain_numbers.crr.p50, nat_numbers.crr.p95 / plain_numbers.crr.p95,
        plain_numbers.gbit, nat_numbers.gbit, nat_numbers.gbit / plain_numbers.gbit,
    );
}
