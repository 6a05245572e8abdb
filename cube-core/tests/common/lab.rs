//! A little internet on this machine for the sandbox network tests: a network namespace
//! ("outside", 198.51.100.2 and 203.0.113.2, and 198.18.0.2 in a range every sandbox is
//! refused by default) behind a veth whose host end is 198.51.100.1, HTTP servers on
//! both sides, and the host's sandbox network pool, removed at the end when the test
//! made it. Traffic stays on this machine: between the host and a namespace the test
//! owns.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cube_core::testing::{open_pool, pool_config, pool_name};
use cube_core::{Runtime, RuntimeConfig};

/// The host's end of the veth to the outside namespace.
pub const HOST_ADDR: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
/// The outside namespace's address on the veth (its HTTP server listens on port 80).
pub const OUT_ADDR: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
/// A second outside address, routed through [`OUT_ADDR`].
pub const FAR_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
/// An outside address in a range every sandbox is refused by default (198.18.0.0/15,
/// benchmarking), routed to the outside namespace.
pub const DEFAULT_DENIED_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
/// The port of the host's own HTTP server on [`HOST_ADDR`].
pub const HOST_PORT: u16 = 18081;

/// What the lab needs and the host lacks, if anything: root (namespaces, netlink,
/// eBPF) and iproute2.
pub fn missing() -> Option<String> {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        return Some("sandbox networks need root (namespaces, netlink, eBPF)".into());
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("iproute2 (`ip`) is missing".into());
    }
    None
}

pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The outside namespace, its servers, the host's own server and the test pool;
/// all removed on drop.
pub struct Lab {
    ns: String,
    uplink: String,
    /// The host pool's name.
    pub pool: String,
    /// Whether the host's pool existed before the test (then it stays).
    pool_existed: bool,
    servers: Vec<Child>,
    _www: tempfile::TempDir,
    _store: tempfile::TempDir,
    /// A store of the test's own for its runtimes.
    pub store_root: PathBuf,
}

impl Lab {
    /// None (with the reason printed) where the datapath cannot load here.
    pub fn new() -> Option<Lab> {
        let tag = std::process::id() % 100_000;
        let pool = pool_name().unwrap();
        let pool_config = pool_config(&pool);
        let pool_existed = pool_config.bpffs.join("cube-net").join(&pool).exists();
        let www = tempfile::TempDir::new().unwrap();
        std::fs::create_dir(www.path().join("out")).unwrap();
        std::fs::write(www.path().join("out/index.html"), "outside").unwrap();
        std::fs::create_dir(www.path().join("host")).unwrap();
        std::fs::write(www.path().join("host/index.html"), "host").unwrap();
        let store = tempfile::TempDir::new().unwrap();
        let mut lab = Lab {
            ns: format!("cnout{tag}"),
            uplink: format!("cnu{tag}"),
            pool,
            pool_existed,
            servers: Vec::new(),
            store_root: store.path().canonicalize().unwrap(),
            _www: www,
            _store: store,
        };
        ip(&["netns", "add", &lab.ns]);
        ip(&[
            "link",
            "add",
            &lab.uplink,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &lab.ns,
        ]);
        ip(&["addr", "add", "198.51.100.1/24", "dev", &lab.uplink]);
        ip(&["link", "set", &lab.uplink, "up"]);
        ip(&[
            "-n",
            &lab.ns,
            "addr",
            "add",
            "198.51.100.2/24",
            "dev",
            "eth0",
        ]);
        ip(&["-n", &lab.ns, "addr", "add", "203.0.113.2/32", "dev", "lo"]);
        ip(&["-n", &lab.ns, "addr", "add", "198.18.0.2/32", "dev", "lo"]);
        ip(&["-n", &lab.ns, "link", "set", "eth0", "up"]);
        ip(&["-n", &lab.ns, "link", "set", "lo", "up"]);
        ip(&[
            "-n",
            &lab.ns,
            "route",
            "add",
            "default",
            "via",
            "198.51.100.1",
        ]);
        ip(&["route", "add", "203.0.113.0/24", "via", "198.51.100.2"]);
        // Goes with the uplink.
        ip(&["route", "add", "198.18.0.2/32", "via", "198.51.100.2"]);
        let www = lab._www.path().to_path_buf();
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &lab.ns,
                "python3",
                "-m",
                "http.server",
                "80",
            ])
            .arg("--directory")
            .arg(www.join("out"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        lab.servers.push(out);
        let host = Command::new("python3")
            .args([
                "-m",
                "http.server",
                &HOST_PORT.to_string(),
                "--bind",
                "198.51.100.1",
            ])
            .arg("--directory")
            .arg(www.join("host"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        lab.servers.push(host);
        for addr in [(OUT_ADDR, 80), (FAR_ADDR, 80), (HOST_ADDR, HOST_PORT)] {
            wait_for(SocketAddr::from(addr));
        }
        // Opening the pool loads the datapath: the place to learn it cannot load here.
        if let Err(e) = open_pool() {
            println!("skipped: the eBPF datapath cannot load here: {e}");
            return None;
        }
        Some(lab)
    }

    /// A TCP listener inside the outside namespace at [`OUT_ADDR`]:`port`, owned by the
    /// test (a socket keeps the namespace it was made in, whichever thread uses it).
    pub fn listen_outside(&self, port: u16) -> TcpListener {
        let ns = std::fs::File::open(format!("/var/run/netns/{}", self.ns)).unwrap();
        // A thread of its own enters the namespace, so the test's threads stay put.
        std::thread::spawn(move || {
            // SAFETY: setns takes a descriptor this closure owns and a flag; it changes
            // only this thread's network namespace.
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            TcpListener::bind(SocketAddr::from((OUT_ADDR, port))).unwrap()
        })
        .join()
        .unwrap()
    }

    /// A runtime on the lab's store.
    pub fn runtime(&self) -> Runtime {
        Runtime::open(RuntimeConfig {
            store_root: self.store_root.clone(),
            pool_size: 0,
            network_pool_size: 0,
            supervisor: Some(super::supervisor()),
        })
        .unwrap()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for server in &mut self.servers {
            let _ = server.kill();
            let _ = server.wait();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.uplink])
            .status();
        if self.pool_existed {
            return;
        }
        if let Ok((pool, _lock)) = open_pool() {
            let _ = pool.destroy();
        }
        let config = pool_config(&self.pool);
        let _ = std::fs::remove_file(config.run_dir.join(format!("{}.lock", self.pool)));
    }
}

/// Waits until something accepts TCP connections at `addr`.
pub fn wait_for(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        assert!(Instant::now() < deadline, "{addr} never came up");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The host interface `name`'s index, while it exists.
pub fn ifindex(name: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Accepts one connection on `listener`, reads what the peer sends until it shuts its
/// side, and answers `reply`; the thread returns the peer's address and the bytes.
/// It gives up (panicking) when no peer came within `wait`.
pub fn answer_once(
    listener: &TcpListener,
    reply: &'static str,
    wait: Duration,
) -> std::thread::JoinHandle<(SocketAddr, Vec<u8>)> {
    use std::io::{Read, Write};
    let listener = listener.try_clone().unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let deadline = Instant::now() + wait;
        let (mut stream, peer) = loop {
            match listener.accept() {
                Ok(accepted) => break accepted,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "no peer within {wait:?}");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        stream.set_nonblocking(false).unwrap();
        stream.set_read_timeout(Some(wait)).unwrap();
        let mut received = Vec::new();
        stream.read_to_end(&mut received).unwrap();
        stream.write_all(reply.as_bytes()).unwrap();
        (peer, received)
    })
}
