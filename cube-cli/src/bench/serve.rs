//! `cube bench --serve`: `cube serve`'s overhead on a create, measured against the
//! library's create in the same run (jail engine, host template, pooled supervisors on
//! both sides): each round times one library create and one create through the HTTP
//! API (`POST /v2/sandboxes`, as the SDKs send it, answered 201), alternating, so both
//! see the same host load. Then 50 creates through the API at once, all of which must
//! succeed.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cube_core::{CreateOptions, Runtime, RuntimeConfig, HOST_TEMPLATE};
use cube_server::config::{CliOverrides, FileConfig, ServeConfig};
use cube_server::http_client;
use serde::Serialize;

use super::stats::{percentiles_ms, round2};
use super::{failed, progress, Target};
use crate::cli_error::CliError;

/// The overhead target: the API's p50 at most this much above the library's.
const OVERHEAD_TARGET_MS: f64 = 2.0;

/// Creates sent at once.
const CONCURRENT: usize = 50;

const KEY: &str = "cube-bench-serve-key-0123456789";

#[derive(Serialize)]
struct Pair {
    p50: f64,
    p95: f64,
}

#[derive(Serialize)]
struct ServeReport {
    section: &'static str,
    n: usize,
    library_create_ms: Pair,
    http_create_ms: Pair,
    overhead_p50_ms: f64,
    overhead_p95_ms: f64,
    concurrent_creates: usize,
    concurrent_succeeded: usize,
    concurrent_wall_ms: f64,
    concurrent_create_ms: Pair,
    targets: Vec<Target>,
}

/// The server, run on its own async runtime until dropped.
struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(root: &Path) -> Result<Server, CliError> {
        let config = ServeConfig::resolve(
            FileConfig {
                max_concurrent_creates: Some(CONCURRENT + 4),
                max_sandboxes: Some(CONCURRENT + 16),
                pool_size: Some(4),
                ..FileConfig::default()
            },
            CliOverrides {
                listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
                api_keys: vec![KEY.into()],
                store: Some(root.to_path_buf()),
                ..CliOverrides::default()
            },
        )
        .map_err(failed)?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            let result = rt.block_on(cube_server::serve_with(
                config,
                async {
                    let _ = stop_rx.await;
                },
                move |b| {
                    let _ = addr_tx.send(Ok(b.main));
                },
            ));
            if let Err(e) = result {
                eprintln!("bench: cube serve: {}", cube_server::error::error_chain(&e));
            }
        });
        let addr: Result<SocketAddr, ()> = addr_rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or(Err(()));
        let addr = addr.map_err(|()| CliError::failed("cube serve did not start"))?;
        Ok(Server {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    fn call(&self, method: &str, path: &str, body: &str) -> Result<http_client::Answer, CliError> {
        http_client::request(
            self.addr,
            method,
            path,
            &[("X-API-KEY", KEY), ("Content-Type", "application/json")],
            body.as_bytes(),
        )
        .map_err(failed)
    }

    /// Creates a sandbox through the API; its E2B id.
    fn create(&self) -> Result<String, CliError> {
        let a = self.call(
            "POST",
            "/v2/sandboxes",
            r#"{"templateID":"base","timeout":300}"#,
        )?;
        if a.status != 201 {
            return Err(CliError::failed(format!(
                "create through the API answered {}: {}",
                a.status,
                String::from_utf8_lossy(&a.body)
            )));
        }
        a.json()["sandboxID"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| CliError::failed("create answered no sandboxID"))
    }

    fn kill(&self, id: &str) {
        let _ = self.call("DELETE", &format!("/sandboxes/{id}"), "");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runs the bench on store `root`.
pub fn run(root: &Path, quick: bool, json: bool) -> Result<(), CliError> {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        return Err(CliError::unsupported(
            "the serve bench needs root (jail sandboxes: namespaces, mounts, cgroups)",
        ));
    }
    let n = if quick { 20 } else { 60 };
    progress("serve: starting cube serve and a library runtime on the same store");
    let server = Server::start(root)?;
    let rt = Runtime::open(RuntimeConfig {
        store_root: root.to_path_buf(),
        pool_size: 4,
        network_pool_size: 0,
        supervisor: None,
    })
    .map_err(CliError::from)?;
    rt.wait_pool_ready();
    // Warm both paths (first-use costs: page cache, the server's first connection).
    for _ in 0..3 {
        rt.create(HOST_TEMPLATE, CreateOptions::new(false))
            .map_err(CliError::from)?
            .destroy()
            .map_err(CliError::from)?;
        let id = server.create()?;
        server.kill(&id);
    }
    progress(&format!(
        "serve: {n} creates each, library and HTTP API, alternating"
    ));
    let mut lib = Vec::with_capacity(n);
    let mut http = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let sb = rt
            .create(HOST_TEMPLATE, CreateOptions::new(false))
            .map_err(CliError::from)?;
        lib.push(t.elapsed());
        sb.destroy().map_err(CliError::from)?;
        // Let the pool refill before the other side's turn, as it did before this one.
        std::thread::sleep(Duration::from_millis(30));
        let t = Instant::now();
        let id = server.create()?;
        http.push(t.elapsed());
        server.kill(&id);
        std::thread::sleep(Duration::from_millis(30));
    }
    progress(&format!(
        "serve: {CONCURRENT} creates through the API at once"
    ));
    let server = Arc::new(server);
    let start = Instant::now();
    let handles: Vec<_> = (0..CONCURRENT)
        .map(|_| {
            let server = Arc::clone(&server);
            std::thread::spawn(move || {
                let t = Instant::now();
                server.create().map(|id| (id, t.elapsed()))
            })
        })
        .collect();
    let mut ok = Vec::new();
    let mut errors = Vec::new();
    for h in handles {
        match h.join() {
            Ok(Ok(r)) => ok.push(r),
            Ok(Err(e)) => errors.push(e.message),
            Err(_) => errors.push("a client thread panicked".into()),
        }
    }
    let wall = start.elapsed();
    for (id, _) in &ok {
        server.kill(id);
    }
    let (lib50, lib95) = percentiles_ms(&lib);
    let (http50, http95) = percentiles_ms(&http);
    let times: Vec<Duration> = ok.iter().map(|(_, d)| *d).collect();
    let (c50, c95) = percentiles_ms(&times);
    let overhead = round2(http50 - lib50);
    let report = ServeReport {
        section: "serve",
        n,
        library_create_ms: Pair {
            p50: round2(lib50),
            p95: round2(lib95),
        },
        http_create_ms: Pair {
            p50: round2(http50),
            p95: round2(http95),
        },
        overhead_p50_ms: overhead,
        overhead_p95_ms: round2(http95 - lib95),
        concurrent_creates: CONCURRENT,
        concurrent_succeeded: ok.len(),
        concurrent_wall_ms: round2(wall.as_secs_f64() * 1e3),
        concurrent_create_ms: Pair {
            p50: round2(c50),
            p95: round2(c95),
        },
        targets: vec![
            Target {
                name: "serve create overhead p50 ms (HTTP - library)",
                value: overhead,
                limit: OVERHEAD_TARGET_MS,
                met: overhead <= OVERHEAD_TARGET_MS,
            },
            Target {
                name: "concurrent API creates that failed",
                value: errors.len() as f64,
                limit: 0.0,
                met: errors.is_empty(),
            },
        ],
    };
    super::progress_done();
    if json {
        println!("{}", serde_json::to_string_pretty(&report).map_err(failed)?);
    } else {
        println!("# cube bench --serve (jail engine, host template, n={n})\n");
        println!("| create | p50 ms | p95 ms |\n|---|---|---|");
        println!(
            "| library (`Runtime::create`) | {} | {} |",
            report.library_create_ms.p50, report.library_create_ms.p95
        );
        println!(
            "| HTTP API (`POST /v2/sandboxes` -> 201) | {} | {} |",
            report.http_create_ms.p50, report.http_create_ms.p95
        );
        println!(
            "| overhead | {} | {} |",
            report.overhead_p50_ms, report.overhead_p95_ms
        );
        println!(
            "\n{CONCURRENT} concurrent API creates: {} succeeded in {} ms (each p50 {} ms, p95 {} ms)",
            report.concurrent_succeeded, report.concurrent_wall_ms, report.concurrent_create_ms.p50, report.concurrent_create_ms.p95
        );
        for t in &report.targets {
            println!(
                "{}: {} (limit {}) {}",
                t.name,
                t.value,
                t.limit,
                if t.met { "met" } else { "MISSED" }
            );
        }
    }
    if !errors.is_empty() {
        return Err(CliError::failed(format!(
            "{} of {CONCURRENT} concurrent creates failed; the first: {}",
            errors.len(),
            errors[0]
        )));
    }
    Ok(())
}
