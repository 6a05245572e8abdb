//! cube-net's benchmark as a library, for `cube bench --network` and the `netbench`
//! example. It builds its own little internet from network namespaces and removes
//! it again: a "host" namespace where a private pool lives, an "out" namespace
//! beyond the host's uplink (198.51.100.2, an echo and a sink server), a sandbox
//! namespace on Cube's datapath (eBPF source NAT), and a "plain" namespace on a veth
//! the kernel forwards without NAT (the floor).
//!
//! Measured, both paths in alternating slices so drift in the host's load hits both
//! alike: attach times from the pool (a prepared namespace, a veth made straight into
//! an existing namespace as the jail engine does, release, a TAP); TCP round trips of
//! 64 bytes on one connection; connect+request+close; bulk throughput. The latency
//! round trips run the client and the echo server on one CPU ([`pin_to_one_cpu`]).

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::netlink::{NetlinkError, Rtnl};
use crate::netns::{Netns, NetnsError, NetnsRef};
use crate::policy::EgressPolicy;
use crate::pool::{Pool, PoolConfig, PoolError};

const HOST_ADDR: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const OUT_ADDR: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
const PLAIN_HOST_ADDR: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
const PLAIN_ADDR: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 2);
const ECHO_PORT: u16 = 7001;
const SINK_PORT: u16 = 7002;
/// An echo server whose connections run on the round-trip client's CPU.
const PINNED_ECHO_PORT: u16 = 7003;

/// What a benchmark server does with a connection.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Service {
    /// Echoes 64-byte messages.
    Echo,
    /// Echoes 64-byte messages on the CPU the round-trip client is pinned to.
    PinnedEcho,
    /// Reads everything, then answers one byte.
    Sink,
}
const SLICES: usize = 7;
/// The target: Cube's path within this factor of the plain path's round-trip p50.
pub const LATENCY_TARGET: f64 = 1.2;

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A namespace could not be made or entered.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// Configuring a device failed.
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    /// The pool failed.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// Traffic or a state file failed.
    #[error("{0}")]
    Io(&'static str, #[source] io::Error),
    /// A server did not start.
    #[error("the benchmark's servers did not start")]
    Servers,
}

type Result<T> = std::result::Result<T, BenchError>;

/// How much to measure.
#[derive(Debug, Clone, Copy)]
pub struct BenchConfig {
    /// Attaches of each kind.
    pub attaches: usize,
    /// Round trips per path.
    pub rounds: usize,
    /// Connect+request per path.
    pub connects: usize,
    /// MiB per bulk transfer (one per slice and path).
    pub bulk_mib: usize,
}

impl BenchConfig {
    /// A few seconds (CI).
    pub fn quick() -> Self {
        BenchConfig {
            attaches: 30,
            rounds: 2000,
            connects: 100,
            bulk_mib: 64,
        }
    }

    /// The full run.
    pub fn full() -> Self {
        BenchConfig {
            attaches: 200,
            rounds: 20000,
            connects: 1000,
            bulk_mib: 256,
        }
    }
}

/// Median and 95th percentile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
}

impl Percentiles {
    /// Of `samples` (zero when empty).
    pub fn of(mut samples: Vec<f64>) -> Self {
        if samples.is_empty() {
            return Percentiles { p50: 0.0, p95: 0.0 };
        }
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
        Percentiles {
            p50: at(0.50),
            p95: at(0.95),
        }
    }
}

/// One path's TCP numbers.
#[derive(Debug, Clone, Copy)]
pub struct PathNumbers {
    /// Round trip of 64 bytes on one connection, µs.
    pub rr_us: Percentiles,
    /// Connect, 64-byte request and answer, close, µs.
    pub crr_us: Percentiles,
    /// Bulk throughput, Gbit/s (median of the slices).
    pub gbit: f64,
}

/// What the benchmark measured.
#[derive(Debug, Clone, Copy)]
pub struct BenchReport {
    /// Attaching a prepared namespace from the pool, ms.
    pub attach_prepared_ms: Percentiles,
    /// Attaching a veth made straight into an existing namespace (the jail engine's
    /// path), ms.
    pub attach_veth_ms: Percentiles,
    /// Putting a veth attached ahead of time (deny-everything policy) into service:
    /// the policy written, counters reset (what is left on a create path), ms.
    pub activate_ms: Percentiles,
    /// Releasing a veth, ms.
    pub release_ms: Percentiles,
    /// Attaching a TAP from the pool, ms.
    pub attach_tap_ms: Percentiles,
    /// The plain, kernel-forwarded path.
    pub plain: PathNumbers,
    /// Cube's eBPF NAT path.
    pub cube: PathNumbers,
    /// Median of the slices' cube/plain throughput ratios.
    pub gbit_ratio: f64,
}

impl BenchReport {
    /// Cube/plain round-trip latency at p50.
    pub fn rr_ratio_p50(&self) -> f64 {
        self.cube.rr_us.p50 / self.plain.rr_us.p50
    }

    /// Cube/plain round-trip latency at p95.
    pub fn rr_ratio_p95(&self) -> f64 {
        self.cube.rr_us.p95 / self.plain.rr_us.p95
    }

    /// Cube/plain connect+request latency at p50.
    pub fn crr_ratio_p50(&self) -> f64 {
        self.cube.crr_us.p50 / self.plain.crr_us.p50
    }

    /// Whether Cube's path is within [`LATENCY_TARGET`] of the plain path's
    /// round-trip p50.
    pub fn latency_target_met(&self) -> bool {
        self.rr_ratio_p50() <= LATENCY_TARGET
    }
}

/// Namespaces pinned under one directory, removed on drop.
struct Namespaces {
    dir: PathBuf,
    pins: Vec<PathBuf>,
}

impl Namespaces {
    fn new(dir: PathBuf) -> Result<Self> {
        std::fs::create_dir_all(&dir)
            .map_err(|e| BenchError::Io("creating the pin directory", e))?;
        Ok(Namespaces {
            dir,
            pins: Vec::new(),
        })
    }

    fn add(&mut self, name: &str) -> Result<(Netns, PathBuf)> {
        let pin = self.dir.join(name);
        let netns = Netns::create_pinned(&pin)?;
        self.pins.push(pin.clone());
        netns.run(|| -> Result<()> {
            let mut rtnl = Rtnl::open()?;
            let lo = rtnl.link("lo")?;
            rtnl.set_up(lo.index, true)?;
            Ok(())
        })??;
        Ok((netns, pin))
    }

    fn remove(&mut self, pin: &Path) {
        let _ = Netns::remove_pin(pin);
        self.pins.retain(|p| p != pin);
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for pin in std::mem::take(&mut self.pins) {
            let _ = Netns::remove_pin(&pin);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Makes veth `host_end` in `host` with its peer `peer` in `other`, addresses both
/// ends and routes `other` by default through `host`.
fn wire(
    host: &Netns,
    other: &Netns,
    (host_end, host_addr): (&str, Ipv4Addr),
    (peer, peer_addr): (&str, Ipv4Addr),
    prefix: u8,
) -> Result<()> {
    let fd = other.fd().as_raw_fd();
    host.run(|| -> Result<()> {
        let mut rtnl = Rtnl::open()?;
        rtnl.add_veth(host_end, peer, Some(fd))?;
        let link = rtnl.link(host_end)?;
        rtnl.add_address(link.index, host_addr, prefix)?;
        rtnl.set_up(link.index, true)?;
        Ok(())
    })??;
    other.run(|| -> Result<()> {
        let mut rtnl = Rtnl::open()?;
        let link = rtnl.link(peer)?;
        rtnl.add_address(link.index, peer_addr, prefix)?;
        rtnl.set_up(link.index, true)?;
        rtnl.add_default_route(link.index, host_addr)?;
        Ok(())
    })??;
    Ok(())
}

/// Echo (64-byte messages) and sink servers in `out`; stopped on drop.
struct Servers {
    stop: Arc<AtomicBool>,
    out: Netns,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Servers {
    fn start(out: Netns) -> Result<Servers> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let mut threads = Vec::new();
        let services = [
            (ECHO_PORT, Service::Echo),
            (SINK_PORT, Service::Sink),
            (PINNED_ECHO_PORT, Service::PinnedEcho),
        ];
        for (port, service) in services {
            let stop = Arc::clone(&stop);
            let ready = ready_tx.clone();
            let fd = out
                .fd()
                .try_clone()
                .map_err(|e| BenchError::Io("duplicating a namespace handle", e))?;
            threads.push(std::thread::spawn(move || {
                let listener = nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET)
                    .ok()
                    .and_then(|()| TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).ok());
                let _ = ready.send(listener.is_some());
                let Some(listener) = listener else { return };
                // Blocking accept (polling would add its sleep to every connect);
                // Servers::drop wakes it with one last connection.
                for stream in listener.incoming() {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    std::thread::spawn(move || serve(stream, service));
                }
            }));
        }
        let servers = Servers { stop, out, threads };
        for _ in 0..services.len() {
            match ready_rx.recv_timeout(Duration::from_secs(5)) {
                Ok(true) => {}
                _ => return Err(BenchError::Servers),
            }
        }
        Ok(servers)
    }
}

fn serve(mut stream: TcpStream, service: Service) {
    if service == Service::PinnedEcho {
        pin_to_one_cpu();
    }
    let sink = service == Service::Sink;
    let _ = stream.set_nodelay(true);
    let mut buf = vec![0u8; if sink { 1 << 20 } else { 64 }];
    loop {
        if sink {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        } else if stream.read_exact(&mut buf).is_err() || stream.write_all(&buf).is_err() {
            break;
        }
    }
    if sink {
        let _ = stream.write_all(b"k");
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.out.run(|| {
            for port in [ECHO_PORT, SINK_PORT, PINNED_ECHO_PORT] {
                let _ = TcpStream::connect((Ipv4Addr::LOCALHOST, port));
            }
        });
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Keeps the calling thread on the first CPU it may use. The round trips put the
/// client and its echo server there: a wake-up across CPUs costs tens of µs on
/// these VMs and falls on either path at random, so unpinned the round-trip p50 of
/// both paths flipped between about 5 and 60 µs from run to run; scheduler noise,
/// not the datapath's cost, which is what the two paths are compared on.
fn pin_to_one_cpu() {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    let me = nix::unistd::Pid::from_raw(0);
    let Ok(allowed) = sched_getaffinity(me) else {
        return;
    };
    if let Some(cpu) = (0..CpuSet::count()).find(|&c| allowed.is_set(c).unwrap_or(false)) {
        let mut one = CpuSet::new();
        if one.set(cpu).is_ok() {
            let _ = sched_setaffinity(me, &one);
        }
    }
}

fn micros(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e6
}

fn connect(port: u16) -> io::Result<TcpStream> {
    let stream =
        TcpStream::connect_timeout(&SocketAddr::from((OUT_ADDR, port)), Duration::from_secs(2))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    Ok(stream)
}

fn traffic<T: Send>(from: &Netns, work: impl FnOnce() -> io::Result<T> + Send) -> Result<T> {
    from.run(work)?
        .map_err(|e| BenchError::Io("TCP traffic", e))
}

/// Round trips of 64 bytes on one connection, µs.
fn round_trips(from: &Netns, rounds: usize) -> Result<Vec<f64>> {
    traffic(from, || {
        pin_to_one_cpu();
        let mut stream = connect(PINNED_ECHO_PORT)?;
        let mut buf = [7u8; 64];
        for _ in 0..50 {
            stream.write_all(&buf)?;
            stream.read_exact(&mut buf)?;
        }
        (0..rounds)
            .map(|_| {
                let start = Instant::now();
                stream.write_all(&buf)?;
                stream.read_exact(&mut buf)?;
                Ok(micros(start))
            })
            .collect()
    })
}

/// A new connection per request, like short HTTP calls, µs.
fn connect_requests(from: &Netns, connects: usize) -> Result<Vec<f64>> {
    traffic(from, || {
        let mut buf = [7u8; 64];
        (0..connects)
            .map(|_| {
                let start = Instant::now();
                let mut stream = connect(ECHO_PORT)?;
                stream.write_all(&buf)?;
                stream.read_exact(&mut buf)?;
                drop(stream);
                Ok(micros(start))
            })
            .collect()
    })
}

/// Sends `mib` MiB until the server has read it all; Gbit/s.
fn bulk(from: &Netns, mib: usize) -> Result<f64> {
    traffic(from, || {
        let chunk = vec![0x5au8; 1 << 20];
        let mut stream = connect(SINK_PORT)?;
        let start = Instant::now();
        for _ in 0..mib {
            stream.write_all(&chunk)?;
        }
        stream.shutdown(std::net::Shutdown::Write)?;
        let mut ack = [0u8; 1];
        stream.read_exact(&mut ack)?;
        Ok((mib as f64 * 8.0 * f64::from(1u32 << 20)) / start.elapsed().as_secs_f64() / 1e9)
    })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Both paths in alternating slices; also the median of the slices' throughput
/// ratios, steadier than a ratio of two medians.
fn measure_paths(
    plain: &Netns,
    cube: &Netns,
    config: &BenchConfig,
) -> Result<(PathNumbers, PathNumbers, f64)> {
    let (mut plain_rr, mut cube_rr, mut plain_crr, mut cube_crr) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut plain_gbit, mut cube_gbit, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..SLICES {
        plain_rr.extend(round_trips(plain, config.rounds / SLICES)?);
        cube_rr.extend(round_trips(cube, config.rounds / SLICES)?);
        plain_crr.extend(connect_requests(plain, config.connects / SLICES)?);
        cube_crr.extend(connect_requests(cube, config.connects / SLICES)?);
        let (p, c) = (bulk(plain, config.bulk_mib)?, bulk(cube, config.bulk_mib)?);
        plain_gbit.push(p);
        cube_gbit.push(c);
        ratios.push(c / p);
    }
    Ok((
        PathNumbers {
            rr_us: Percentiles::of(plain_rr),
            crr_us: Percentiles::of(plain_crr),
            gbit: median(plain_gbit),
        },
        PathNumbers {
            rr_us: Percentiles::of(cube_rr),
            crr_us: Percentiles::of(cube_crr),
            gbit: median(cube_gbit),
        },
        median(ratios),
    ))
}

/// Destroys the benchmark's pool however the run ends.
struct PoolGuard(Option<Pool>);

impl Drop for PoolGuard {
    fn drop(&mut self) {
        if let Some(pool) = self.0.take() {
            if let Err(e) = pool.destroy() {
                tracing::warn!("removing the benchmark's pool: {e}");
            }
        }
    }
}

/// Runs the benchmark in namespaces and a pool of its own (root, eBPF and tcx or
/// clsact needed); everything it made is gone when it returns.
pub fn run(config: &BenchConfig) -> Result<BenchReport> {
    let tag = format!("bench-{}", std::process::id());
    let mut namespaces = Namespaces::new(PathBuf::from("/run/cube-net").join(format!("{tag}-ns")))?;
    let (host, _) = namespaces.add("host")?;
    let (out, _) = namespaces.add("out")?;
    let (plain, _) = namespaces.add("plain")?;
    let (sandbox_ns, sandbox_pin) = namespaces.add("sandbox")?;
    wire(&host, &out, ("up0", HOST_ADDR), ("out0", OUT_ADDR), 24)?;
    wire(
        &host,
        &plain,
        ("plainh", PLAIN_HOST_ADDR),
        ("eth0", PLAIN_ADDR),
        30,
    )?;
    host.run(|| std::fs::write("/proc/sys/net/ipv4/ip_forward", "1"))?
        .map_err(|e| BenchError::Io("enabling forwarding", e))?;

    let pool_config = PoolConfig {
        name: tag.clone(),
        prefix: "cb".to_string(),
        veths: 4,
        taps: 1,
        ..PoolConfig::default()
    };
    let guard = PoolGuard(Some(host.run(|| Pool::open(pool_config))??));
    let pool = guard.0.as_ref().ok_or(BenchError::Servers)?;

    let policy = EgressPolicy::default();
    let (mut prepared, mut into, mut activate, mut release, mut tap) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..config.attaches {
        let start = Instant::now();
        let net = pool.attach_prepared(&policy)?;
        prepared.push(micros(start) / 1e3);
        let start = Instant::now();
        pool.release(net)?;
        release.push(micros(start) / 1e3);
        pool.refill()?;

        let (_, pin) = namespaces.add(&format!("a{i}"))?;
        let start = Instant::now();
        // Attached ahead of time, as a pooled jail supervisor does, then put into
        // service as a create does.
        let net = pool.attach_veth(&NetnsRef::Path(pin.clone()), &EgressPolicy::offline())?;
        into.push(micros(start) / 1e3);
        let start = Instant::now();
        pool.activate(&net, &policy)?;
        activate.push(micros(start) / 1e3);
        pool.release(net)?;
        namespaces.remove(&pin);

        let start = Instant::now();
        let net = pool.attach_tap([2, 0, 0, 0, 0, 1], &policy)?;
        tap.push(micros(start) / 1e3);
        pool.release(net)?;
    }

    let sandbox = pool.attach_veth(&NetnsRef::Path(sandbox_pin), &policy)?;
    let measured = (|| {
        let _servers = Servers::start(NetnsRef::Path(namespaces.dir.join("out")).open()?)?;
        // Warm both paths once.
        let warm = BenchConfig {
            attaches: 0,
            rounds: 7 * 70,
            connects: 7 * 7,
            bulk_mib: 8,
        };
        measure_paths(&plain, &sandbox_ns, &warm)?;
        measure_paths(&plain, &sandbox_ns, config)
    })();
    pool.release(sandbox)?;
    let (plain_numbers, cube_numbers, gbit_ratio) = measured?;
    drop(guard);
    drop(namespaces);
    Ok(BenchReport {
        attach_prepared_ms: Percentiles::of(prepared),
        attach_veth_ms: Percentiles::of(into),
        activate_ms: Percentiles::of(activate),
        release_ms: Percentiles::of(release),
        attach_tap_ms: Percentiles::of(tap),
        plain: plain_numbers,
        cube: cube_numbers,
        gbit_ratio,
    })
}
