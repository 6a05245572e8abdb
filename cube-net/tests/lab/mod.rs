//! A little internet made of network namespaces on this machine, for cube-net's
//! tests and bench: a "host" namespace where the pool lives, an "out" namespace
//! beyond the host's uplink (198.51.100.2, and 203.0.113.2 behind it), and sandbox
//! namespaces. Nothing leaves these namespaces; all of them go on drop.

#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use cube_net::{Netns, NetnsRef, Pool, PoolConfig};

/// The host's address on its uplink.
pub const HOST_ADDR: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
/// The outside server's address on the uplink's network.
pub const OUT_ADDR: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
/// A second outside address, routed through OUT_ADDR.
pub const FAR_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);

pub struct Lab {
    tag: String,
    namespaces: Vec<String>,
    stop: Arc<AtomicBool>,
    servers: Vec<JoinHandle<()>>,
}

pub fn ip(args: &[&str]) -> io::Result<()> {
    let output = Command::new("ip").args(args).output()?;
    if output.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    }
}

impl Lab {
    /// Builds host and out; `None` (after saying why) where the host cannot.
    pub fn new(tag: &str) -> Option<Self> {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipping: cube-net tests need root (CAP_NET_ADMIN, CAP_BPF)");
            return None;
        }
        if Command::new("ip").arg("-V").output().is_err() {
            eprintln!("skipping: the `ip` tool (iproute2) is missing");
            return None;
        }
        let mut lab = Self {
            tag: format!("cn{}{tag}", std::process::id() % 100000),
            namespaces: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
            servers: Vec::new(),
        };
        if let Err(error) = lab.add_namespace("host") {
            eprintln!("skipping: cannot create a network namespace: {error}");
            return None;
        }
        lab.add_namespace("out").unwrap();
        let host = lab.name("host");
        let out = lab.name("out");
        ip(&[
            "-n", &host, "link", "add", "up0", "type", "veth", "peer", "name", "out0", "netns",
            &out,
        ])
        .unwrap();
        ip(&["-n", &host, "addr", "add", "198.51.100.1/24", "dev", "up0"]).unwrap();
        ip(&["-n", &host, "link", "set", "up0", "up"]).unwrap();
        ip(&[
            "-n",
            &host,
            "route",
            "add",
            "default",
            "via",
            "198.51.100.2",
        ])
        .unwrap();
        ip(&["-n", &out, "addr", "add", "198.51.100.2/24", "dev", "out0"]).unwrap();
        ip(&["-n", &out, "addr", "add", "203.0.113.2/32", "dev", "lo"]).unwrap();
        ip(&["-n", &out, "link", "set", "out0", "up"]).unwrap();
        Some(lab)
    }

    pub fn name(&self, which: &str) -> String {
        format!("{}-{which}", self.tag)
    }

    pub fn path(&self, which: &str) -> PathBuf {
        PathBuf::from(format!("/run/netns/{}", self.name(which)))
    }

    pub fn netns_ref(&self, which: &str) -> NetnsRef {
        NetnsRef::Path(self.path(which))
    }

    pub fn netns(&self, which: &str) -> Netns {
        self.netns_ref(which).open().unwrap()
    }

    /// Adds an empty namespace with lo up.
    pub fn add_namespace(&mut self, which: &str) -> io::Result<()> {
        let name = self.name(which);
        ip(&["netns", "add", &name])?;
        self.namespaces.push(name.clone());
        ip(&["-n", &name, "link", "set", "lo", "up"])
    }

    /// Removes a namespace early (a sandbox that died).
    pub fn remove_namespace(&mut self, which: &str) {
        let name = self.name(which);
        self.namespaces.retain(|existing| *existing != name);
        ip(&["netns", "del", &name]).unwrap();
    }

    /// Runs `ip -n <which> ARGS` and returns stdout.
    pub fn ip_output(&self, which: &str, args: &[&str]) -> String {
        let output = Command::new("ip")
            .arg("-n")
            .arg(self.name(which))
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// A pool config private to this lab.
    pub fn pool_config(&self, veths: usize, taps: usize) -> PoolConfig {
        PoolConfig {
            name: format!("test-{}", self.tag),
            prefix: "cn".to_string(),
            veths,
            taps,
            ..PoolConfig::default()
        }
    }

    /// Opens a pool in the host namespace; `None` (after saying why) without eBPF.
    pub fn open_pool(&self, config: PoolConfig) -> Option<Pool> {
        match self.netns("host").run(|| Pool::open(config)).unwrap() {
            Ok(pool) => Some(pool),
            Err(error) => {
                let mut chain = format!("{error}");
                let mut source = std::error::Error::source(&error);
                while let Some(cause) = source {
                    chain.push_str(&format!(": {cause}"));
                    source = cause.source();
                }
                if chain.contains("Operation not permitted")
                    || chain.contains("Function not implemented")
                {
                    eprintln!("skipping: eBPF or tc unavailable here: {chain}");
                    None
                } else {
                    panic!("open pool: {chain}");
                }
            }
        }
    }

    /// Serves HTTP on 0.0.0.0:port in namespace `which`; answers `<body> <peer>`.
    pub fn serve_http(&mut self, which: &str, port: u16, body: &str) {
        let netns = self.netns(which);
        let stop = self.stop.clone();
        let body = body.to_string();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let handle = std::thread::spawn(move || {
            nix::sched::setns(netns.fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let listener = TcpListener::bind(("0.0.0.0", port)).unwrap();
            listener.set_nonblocking(true).unwrap();
            ready_tx.send(()).unwrap();
            while !stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut stream, peer)) => {
                        stream.set_nonblocking(false).unwrap();
                        stream
                            .set_read_timeout(Some(Duration::from_secs(2)))
                            .unwrap();
                        let mut request = Vec::new();
                        let mut buf = [0u8; 1024];
                        while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                            match stream.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => request.extend_from_slice(&buf[..n]),
                            }
                        }
                        let text = format!("{body} {peer}");
                        let _ = write!(
                            stream,
                            "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{text}",
                            text.len()
                        );
                    }
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(_) => break,
                }
            }
        });
        ready_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        self.servers.push(handle);
    }

    /// GETs `/` from addr:port inside namespace `which`; the body or why not.
    pub fn http_get(&self, which: &str, addr: Ipv4Addr, port: u16) -> io::Result<String> {
        self.netns(which)
            .run(move || -> io::Result<String> {
                let target = SocketAddr::V4(SocketAddrV4::new(addr, port));
                let mut stream = TcpStream::connect_timeout(&target, Duration::from_millis(700))?;
                stream.set_read_timeout(Some(Duration::from_secs(2)))?;
                write!(stream, "GET / HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
                let mut response = String::new();
                stream.read_to_string(&mut response)?;
                match response.split_once("\r\n\r\n") {
                    Some((head, body)) if head.starts_with("HTTP/1.0 200") => Ok(body.to_string()),
                    _ => Err(io::Error::other(format!("bad response {response:?}"))),
                }
            })
            .unwrap()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for server in self.servers.drain(..) {
            let _ = server.join();
        }
        for name in self.namespaces.drain(..) {
            let _ = ip(&["netns", "del", &name]);
        }
    }
}

/// Destroys a pool when a test ends, panicking or not.
pub struct PoolGuard(pub Option<Pool>);

impl PoolGuard {
    pub fn pool(&self) -> &Pool {
        self.0.as_ref().unwrap()
    }
}

impl Drop for PoolGuard {
    fn drop(&mut self) {
        if let Some(pool) = self.0.take() {
            if let Err(error) = pool.destroy() {
                eprintln!("destroy pool: {error}");
            }
        }
    }
}
