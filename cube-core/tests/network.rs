//! Jail sandbox networks through the Sandbox API, in a little internet the test
//! builds from a network namespace on this machine (`common::lab`: "outside",
//! 198.51.100.2 and 203.0.113.2, behind a veth whose host end is 198.51.100.1): NAT to an outside
//! HTTP server, a denied CIDR and the host's own address refused, a live policy
//! change, a port exposed from a sandbox reachable from the host, two sandboxes kept
//! apart unless allowed, and nothing left of a sandbox's network after destroy.
//!
//! The sandboxes use the host's pool (one datapath per host: a second pool's
//! programs on the same uplinks would see the first one's traffic); the test removes
//! it at the end when it was not there before.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::lab::{
    self, ifindex, Lab, DEFAULT_DENIED_ADDR, FAR_ADDR, HOST_ADDR, HOST_PORT, OUT_ADDR,
};
use cube_agent::client::Client;
use cube_agent::protocol::{ExecRequest, RequestBody};
use cube_core::network::{NetworkOptions, NetworkPolicy, PortMapping};
use cube_core::testing::open_pool;
use cube_core::{CreateOptions, Runtime, RuntimeConfig, HOST_TEMPLATE};

fn skip() -> bool {
    if let Some(reason) = lab::missing() {
        eprintln!("skipping: {reason}");
        return true;
    }
    if cube_jail::CgroupLayout::detect().is_err() {
        eprintln!("skipping: no cgroup hierarchy is readable");
        return true;
    }
    if !common::supervisor().with_file_name("cube-agent").is_file() {
        panic!("cube-agent is missing: cargo build -p cube-agent first");
    }
    false
}

/// GET `http://addr:port/` from inside the sandbox; the body, or why it failed.
fn get_inside(agent: &Client, addr: Ipv4Addr, port: u16) -> Result<String, String> {
    let script = "import sys, urllib.request\n\
        print(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode(), end='')";
    let out = agent
        .exec(ExecRequest {
            argv: vec![
                "python3".into(),
                "-c".into(),
                script.into(),
                format!("http://{addr}:{port}/"),
            ],
            timeout_ms: Some(10_000),
            ..ExecRequest::default()
        })
        .unwrap();
    if out.exit.code == Some(0) {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// GET `/` at `addr` from the host; the status line.
fn get_from_host(addr: SocketAddr) -> std::io::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok(answer.lines().next().unwrap_or_default().to_string())
}

fn with_network(policy: NetworkPolicy, expose: Vec<PortMapping>) -> CreateOptions {
    CreateOptions {
        network: Some(NetworkOptions { policy, expose }),
        ..CreateOptions::default()
    }
}

/// Like [`with_network`], ephemeral: a test that fails midway leaves no sandbox
/// running (its supervisor ends with the test's connection).
fn ephemeral_with_network(policy: NetworkPolicy, expose: Vec<PortMapping>) -> CreateOptions {
    CreateOptions {
        ephemeral: true,
        ..with_network(policy, expose)
    }
}

/// The tests share the host's pool and the lab's names and ports: one at a time.
static LAB: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn jail_sandboxes_reach_out_through_nat_under_live_policy_expose_ports_and_leave_nothing() {
    if skip() {
        return;
    }
    let _one_at_a_time = LAB.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::new() else { return };
    let rt = lab.runtime();

    // A sandbox without a network has loopback only, as before.
    let mut plain = rt.create(HOST_TEMPLATE, CreateOptions::default()).unwrap();
    assert!(get_inside(&plain.agent().unwrap(), OUT_ADDR, 80).is_err());
    assert!(plain.network().is_err(), "no network, no report");
    plain.destroy().unwrap();

    // NAT to the outside; a denied CIDR and the host's own address refused.
    let denying = NetworkPolicy {
        deny_out: vec!["203.0.113.0/24".into()],
        ..NetworkPolicy::default()
    };
    let mut a = rt
        .create(HOST_TEMPLATE, with_network(denying, Vec::new()))
        .unwrap();
    let agent_a = a.agent().unwrap();
    assert_eq!(get_inside(&agent_a, OUT_ADDR, 80).unwrap(), "outside");
    assert!(
        get_inside(&agent_a, FAR_ADDR, 80).is_err(),
        "denied CIDR reached"
    );
    assert!(
        get_inside(&agent_a, HOST_ADDR, HOST_PORT).is_err(),
        "the host reached"
    );
    // The default deny list is in force besides the sandbox's own entries, and the
    // report shows it.
    assert!(
        get_inside(&agent_a, DEFAULT_DENIED_ADDR, 80).is_err(),
        "a default-deny range reached"
    );
    let report = a.network().unwrap();
    for cidr in [
        "203.0.113.0/24",
        "198.18.0.0/15",
        "169.254.0.0/16",
        "10.0.0.0/8",
    ] {
        assert!(
            report.deny_in_force.iter().any(|c| c == cidr),
            "{cidr} not in force: {report:?}"
        );
    }
    assert!(report.counters.tx_packets >= 4, "{report:?}");
    assert!(report.counters.rx_bytes > 0, "{report:?}");
    assert!(report.counters.dropped > 0, "{report:?}");

    // Live policy changes: lift the deny; then offline; then the host exactly.
    a.set_policy(&NetworkPolicy::default()).unwrap();
    assert_eq!(get_inside(&agent_a, FAR_ADDR, 80).unwrap(), "outside");
    // A default range is lifted by an allow entry for it.
    a.set_policy(&NetworkPolicy {
        allow_out: vec!["198.18.0.0/15".into()],
        ..NetworkPolicy::default()
    })
    .unwrap();
    assert_eq!(
        get_inside(&agent_a, DEFAULT_DENIED_ADDR, 80).unwrap(),
        "outside"
    );
    a.set_policy(&NetworkPolicy {
        internet: false,
        ..NetworkPolicy::default()
    })
    .unwrap();
    assert!(
        get_inside(&agent_a, OUT_ADDR, 80).is_err(),
        "offline reached out"
    );
    assert!(a
        .set_policy(&NetworkPolicy {
            allow_out: vec!["not-a-cidr".into()],
            ..NetworkPolicy::default()
        })
        .is_err());

    // A port exposed from sandbox b, reachable from the host.
    let port = 18000 + (std::process::id() % 900) as u16;
    let mut b = rt
        .create(
            HOST_TEMPLATE,
            with_network(
                NetworkPolicy::default(),
                vec![PortMapping {
                    host_port: port,
                    sandbox_port: 8000,
                }],
            ),
        )
        .unwrap();
    let agent_b = b.agent().unwrap();
    let _server = agent_b
        .start(RequestBody::Exec(ExecRequest {
            argv: [
                "python3",
                "-m",
                "http.server",
                "8000",
                "--directory",
                "/tmp",
            ]
            .map(String::from)
            .to_vec(),
            ..ExecRequest::default()
        }))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while get_inside(&agent_b, Ipv4Addr::LOCALHOST, 8000).is_err() {
        assert!(Instant::now() < deadline, "the server in b never came up");
        std::thread::sleep(Duration::from_millis(100));
    }
    let exposed = SocketAddr::from((HOST_ADDR, port));
    let status = get_from_host(exposed).unwrap();
    assert!(status.contains(" 200 "), "{status}");

    // Sandboxes are apart: a reaches b's port only once its policy allows the host.
    a.set_policy(&NetworkPolicy::default()).unwrap();
    assert!(
        get_inside(&agent_a, HOST_ADDR, port).is_err(),
        "a reached b"
    );
    a.set_policy(&NetworkPolicy {
        allow_out: vec![format!("{HOST_ADDR}/32")],
        ..NetworkPolicy::default()
    })
    .unwrap();
    assert!(
        get_inside(&agent_a, HOST_ADDR, port).is_ok(),
        "allowed, yet refused"
    );

    // Unexpose, expose again live.
    b.unexpose(port).unwrap();
    assert!(
        get_from_host(exposed).is_err(),
        "withdrawn port still served"
    );
    b.expose(PortMapping {
        host_port: port,
        sandbox_port: 8000,
    })
    .unwrap();
    assert!(get_from_host(exposed).unwrap().contains(" 200 "));
    assert!(b.unexpose(port + 1).is_err(), "a port never exposed");

    // After destroy nothing of either network is left.
    let (pool, lock) = open_pool().unwrap();
    drop(lock);
    for sandbox in [a, b] {
        let name = {
            let mut sandbox = sandbox;
            let name = sandbox.network().unwrap().host_ifname;
            let index = ifindex(&name).expect("the host end exists while attached");
            sandbox.destroy().unwrap();
            (name, index)
        };
        assert!(ifindex(&name.0).is_none(), "{} left on the host", name.0);
        let residue = pool.residue(&name.0, name.1).unwrap();
        assert_eq!(residue, cube_net::Residue::default(), "{}", name.0);
    }
    assert!(get_from_host(exposed).is_err(), "port served after destroy");
    drop(agent_a);
    drop(agent_b);

    // A killed supervisor: removing the stale sandbox releases its device by the
    // name recorded in its directory.
    let mut c = rt
        .create(
            HOST_TEMPLATE,
            with_network(NetworkPolicy::default(), Vec::new()),
        )
        .unwrap();
    let id = c.id().to_string();
    let name = c.network().unwrap().host_ifname;
    let index = ifindex(&name).unwrap();
    let status = c.status().unwrap();
    let jail = status.jail.clone().unwrap();
    drop(c);
    // SAFETY: signals a process this test started (through the runtime).
    unsafe { libc::kill(status.pid as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while rt.attach(&id).is_ok() {
        assert!(Instant::now() < deadline, "the supervisor did not die");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The jail ends with its supervisor (the agent's lifeline), and its namespace with
    // it may already have taken the device; removing the stale sandbox releases
    // whatever is left either way.
    rt.remove_stale(&id).unwrap();
    assert!(
        ifindex(&name).is_none(),
        "{name} left after removing the stale sandbox"
    );
    let (pool, lock) = open_pool().unwrap();
    drop(lock);
    assert_eq!(
        pool.residue(&name, index).unwrap(),
        cube_net::Residue::default()
    );
    // The orphaned jail is this test's to end: its agent, then its cgroups.
    if let Some(pid) = jail.pid {
        // SAFETY: the jail's init, started by this test's sandbox.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    for dir in jail.cgroups.iter().rev() {
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::remove_dir(dir).is_err() && dir.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

fn pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

fn parent(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Gone, or a zombie waiting for its reaper.
fn ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

/// Host ends of the pool's veths on the host now.
fn pool_devices(pool: &str) -> std::collections::BTreeSet<String> {
    std::fs::read_dir("/sys/class/net")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| {
            n.strip_prefix(pool)
                .and_then(|r| r.strip_suffix('h'))
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect()
}

/// Waits until a device of the pool appears that is not in `known`.
fn new_device(pool: &str, known: &std::collections::BTreeSet<String>) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(d) = pool_devices(pool).difference(known).next() {
            return d.clone();
        }
        assert!(Instant::now() < deadline, "no device was attached ahead");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Interface names inside the sandbox.
fn interfaces_inside(agent: &Client) -> String {
    let out = agent
        .exec(ExecRequest {
            argv: [
                "python3",
                "-c",
                "import socket; print(sorted(n for _, n in socket.if_nameindex()))",
            ]
            .map(String::from)
            .to_vec(),
            timeout_ms: Some(10_000),
            ..ExecRequest::default()
        })
        .unwrap();
    assert_eq!(out.exit.code, Some(0));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn wait_gone(name: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while ifindex(name).is_some() {
        assert!(Instant::now() < deadline, "{name} stayed on the host");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn pooled_supervisors_attach_ahead_plain_creates_stay_offline_and_a_killed_one_is_reclaimed() {
    use cube_supervisor::client::SupervisorClient;
    use cube_supervisor::pool::spawn_supervisor_warm;
    use cube_supervisor::protocol::{Request, Source};
    use cube_supervisor::server::WarmFor;

    if skip() {
        return;
    }
    let _one_at_a_time = LAB.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::new() else { return };
    let before = pool_devices(&lab.pool);
    let rt = Runtime::open(RuntimeConfig {
        store_root: lab.store_root.clone(),
        pool_size: 1,
        network_pool_size: 1,
        supervisor: Some(common::supervisor()),
    })
    .unwrap();

    // The first networked create starts the networked pool (and attaches on its own
    // path); the next ones find a device attached ahead.
    rt.create(
        HOST_TEMPLATE,
        ephemeral_with_network(NetworkPolicy::default(), Vec::new()),
    )
    .unwrap()
    .destroy()
    .unwrap();
    rt.wait_pool_ready();
    let ahead = new_device(&lab.pool, &before);

    let denying = NetworkPolicy {
        deny_out: vec!["203.0.113.0/24".into()],
        ..NetworkPolicy::default()
    };
    let mut a = rt
        .create(HOST_TEMPLATE, ephemeral_with_network(denying, Vec::new()))
        .unwrap();
    let report = a.network().unwrap();
    assert_eq!(report.host_ifname, ahead, "not the device attached ahead");
    assert_eq!(report.counters.tx_packets, 0, "{report:?}");
    let agent_a = a.agent().unwrap();
    assert_eq!(get_inside(&agent_a, OUT_ADDR, 80).unwrap(), "outside");
    assert!(
        get_inside(&agent_a, FAR_ADDR, 80).is_err(),
        "denied CIDR reached"
    );
    assert!(
        get_inside(&agent_a, HOST_ADDR, HOST_PORT).is_err(),
        "the host reached"
    );
    a.set_policy(&NetworkPolicy::default()).unwrap();
    assert_eq!(get_inside(&agent_a, FAR_ADDR, 80).unwrap(), "outside");

    // A create without a network, meanwhile, has loopback only.
    let plain = rt.create(HOST_TEMPLATE, CreateOptions::new(true)).unwrap();
    let agent_plain = plain.agent().unwrap();
    assert_eq!(interfaces_inside(&agent_plain), "['lo']");
    assert!(get_inside(&agent_plain, OUT_ADDR, 80).is_err());
    drop(agent_plain);
    plain.destroy().unwrap();

    // Destroy leaves nothing of the device attached ahead.
    drop(agent_a);
    let index = ifindex(&ahead).unwrap();
    a.destroy().unwrap();
    assert!(ifindex(&ahead).is_none(), "{ahead} left on the host");
    let (pool, lock) = open_pool().unwrap();
    drop(lock);
    assert_eq!(
        pool.residue(&ahead, index).unwrap(),
        cube_net::Residue::default()
    );

    // A pooled supervisor killed with its device attached ahead: the jail ends with
    // it, the device with the jail's namespace, and the next pool open (a rebuild)
    // clears its datapath entries.
    rt.wait_pool_ready();
    let ahead = new_device(&lab.pool, &before);
    let index = ifindex(&ahead).unwrap();
    let marker = format!("--scratch {}", lab.store_root.join("tmp").display());
    let supervisor = pids()
        .into_iter()
        .find(|p| {
            let line = cmdline(*p);
            line.contains(&marker) && line.contains("--network")
        })
        .expect("a networked pooled supervisor runs");
    let agent = pids()
        .into_iter()
        .find(|p| parent(*p) == Some(supervisor) && cmdline(*p).contains("cube-agent"))
        .expect("its jail runs");
    let cgroups: Vec<PathBuf> = std::fs::read_to_string(format!("/proc/{agent}/cgroup"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once(':')?;
            let (ctrl, path) = rest.split_once(':')?;
            let hierarchy = match ctrl {
                "" => "unified".to_string(),
                c => c.trim_start_matches("name=").to_string(),
            };
            Some(
                Path::new("/sys/fs/cgroup")
                    .join(hierarchy)
                    .join(path.trim_start_matches('/')),
            )
        })
        .filter(|p| p.to_string_lossy().contains("pool-"))
        .collect();
    drop(rt);
    // SAFETY: signals a supervisor this test's runtime started; no memory effects.
    assert_eq!(unsafe { libc::kill(supervisor as i32, libc::SIGKILL) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ended(agent) {
        assert!(
            Instant::now() < deadline,
            "the jail outlived its supervisor"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_gone(&ahead);
    let (pool, lock) = open_pool().unwrap();
    drop(lock);
    assert_eq!(
        pool.residue(&ahead, index).unwrap(),
        cube_net::Residue::default(),
        "{ahead}: the rebuild left datapath state"
    );
    for cg in &cgroups {
        let deadline = Instant::now() + Duration::from_secs(5);
        while cg.exists() && std::fs::remove_dir(cg).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    // A supervisor that attached ahead, asked for a sandbox without a network: the
    // device goes before the sandbox is handed over.
    let scratch = lab.store_root.join("tmp");
    std::fs::create_dir_all(&scratch).unwrap();
    let known = pool_devices(&lab.pool);
    let idle =
        spawn_supervisor_warm(&common::supervisor(), Some(&scratch), WarmFor::Jail, true).unwrap();
    let ahead = new_device(&lab.pool, &known);
    let index = ifindex(&ahead).unwrap();
    let dir = lab.store_root.join("by-hand");
    std::fs::create_dir(&dir).unwrap();
    let mut client = SupervisorClient::from_stream(idle.stream).unwrap();
    client
        .call_ok(&Request::Adopt {
            version: cube_supervisor::protocol::PROTOCOL_VERSION,
            id: "sb-byhand".into(),
            dir: dir.clone(),
            source: Source::Jail { layer: None },
            ephemeral: true,
            settings: Box::default(),
        })
        .unwrap();
    assert!(ifindex(&ahead).is_none(), "{ahead} still on the host");
    let agent = Client::new(
        cube_core::connect_jail_agent(&cube_core::store::SandboxDir::new(&dir).agent_socket())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(interfaces_inside(&agent), "['lo']");
    drop(agent);
    client.call_ok(&Request::Destroy).unwrap();
    let (pool, lock) = open_pool().unwrap();
    drop(lock);
    assert_eq!(
        pool.residue(&ahead, index).unwrap(),
        cube_net::Residue::default()
    );
}

#[test]
fn networked_jails_take_full_state_snapshots_and_come_back_with_their_network() {
    use cube_agent::protocol::Language;
    use cube_core::SnapshotKind;

    if skip() {
        return;
    }
    if let Err(e) = cube_jail::Criu::probe() {
        eprintln!("skipping: no working CRIU: {e}");
        return;
    }
    let _one_at_a_time = LAB.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::new() else { return };
    let rt = lab.runtime();
    let port = 18000 + (std::process::id() % 900) as u16;
    let mut sb = rt
        .create(
            HOST_TEMPLATE,
            ephemeral_with_network(
                NetworkPolicy {
                    deny_out: vec!["203.0.113.0/24".into()],
                    ..NetworkPolicy::default()
                },
                vec![PortMapping {
                    host_port: port,
                    sandbox_port: 8000,
                }],
            ),
        )
        .unwrap();
    let py = |sb: &cube_core::Sandbox, code: &str| -> String {
        let agent = sb.agent().unwrap();
        if !agent
            .list_contexts()
            .unwrap()
            .iter()
            .any(|c| c.name == "py")
        {
            agent.create_context("py", Language::Python, None).unwrap();
        }
        let r = agent
            .run_code("py", code, Some(Duration::from_secs(30)))
            .unwrap();
        assert!(r.error.is_none(), "{code}: {:?}", r.error);
        r.value.unwrap_or_default()
    };
    // State only a process holds: an interpreter variable. (No inet socket: CRIU
    // 4.1.1 cannot read SO_PASSCRED of one on Linux 6.16 and later, network or not.)
    py(&sb, "state = 'before'");
    let exposed = SocketAddr::from((HOST_ADDR, port));

    let snap = sb.snapshot().unwrap();
    assert_eq!(snap.kind, SnapshotKind::Full, "{:?}", snap.fallback);
    // Running on, with a new device under the same policy and ports.
    let agent = sb.agent().unwrap();
    assert_eq!(get_inside(&agent, OUT_ADDR, 80).unwrap(), "outside");
    assert!(
        get_inside(&agent, FAR_ADDR, 80).is_err(),
        "denied CIDR reached"
    );
    drop(agent);

    // Rollback restores the processes (variable and server) and the network.
    py(&sb, "state = 'after'");
    sb.rollback(&snap.id).unwrap();
    assert_eq!(py(&sb, "state"), "'before'");
    let agent = sb.agent().unwrap();
    assert_eq!(get_inside(&agent, OUT_ADDR, 80).unwrap(), "outside");
    assert!(
        get_inside(&agent, FAR_ADDR, 80).is_err(),
        "denied CIDR reached"
    );
    drop(agent);

    // Hibernate with the processes; wake with the network and its exposed port.
    sb.hibernate().unwrap();
    sb.wake().unwrap();
    assert_eq!(py(&sb, "state"), "'before'");
    py(
        &sb,
        "import http.server, threading\n\
         srv = http.server.HTTPServer(('0.0.0.0', 8000), http.server.SimpleHTTPRequestHandler)\n\
         threading.Thread(target=srv.serve_forever, daemon=True).start()",
    );
    assert!(get_from_host(exposed).unwrap().contains(" 200 "));
    let name = sb.network().unwrap().host_ifname;
    let index = ifindex(&name).unwrap();

    // A clone of the snapshot with a network of its own (no ports: they are the
    // first sandbox's).
    let mut clone = rt
        .create_from_snapshot(
            &snap.id,
            ephemeral_with_network(NetworkPolicy::default(), Vec::new()),
        )
        .unwrap();
    assert_eq!(py(&clone, "state"), "'before'");
    assert_eq!(
        get_inside(&clone.agent().unwrap(), FAR_ADDR, 80).unwrap(),
        "outside"
    );
    let clone_name = clone.network().unwrap().host_ifname;
    let clone_index = ifindex(&clone_name).unwrap();
    clone.destroy().unwrap();
    sb.destroy().unwrap();
    let (pool, lock) = open_pool().unwrap();
    drop(lock);
    for (name, index) in [(name, index), (clone_name, clone_index)] {
        assert!(ifindex(&name).is_none(), "{name} left on the host");
        assert_eq!(
            pool.residue(&name, index).unwrap(),
            cube_net::Residue::default()
        );
    }
}

/// A VM supervisor runs as a uid of its own and owns its sandbox's directory: one
/// taken over could record another sandbox's device there, or link its record to the
/// other's, for the library to release when it removes the stale sandbox. Only a
/// record root wrote is honoured (the test above has the library release one).
#[test]
fn a_network_record_cube_did_not_write_releases_no_device() {
    if skip() {
        return;
    }
    let _one_at_a_time = LAB.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::new() else { return };
    let rt = lab.runtime();
    let mut other = rt
        .create(
            HOST_TEMPLATE,
            with_network(NetworkPolicy::default(), Vec::new()),
        )
        .unwrap();
    let name = other.network().unwrap().host_ifname;
    let other_dir = cube_storage::SandboxDir::new(rt.store().sandbox_dir(other.id()).unwrap());

    let tmp = tempfile::tempdir().unwrap();
    let stale = tmp.path().join("sb-stale");
    std::fs::create_dir(&stale).unwrap();
    let record = cube_storage::SandboxDir::new(&stale).network_record();
    std::fs::write(&record, &name).unwrap();
    let supervisor_uid = cube_jail::sandbox_uid::RANGE.start + 7;
    std::os::unix::fs::lchown(&record, Some(supervisor_uid), None).unwrap();
    cube_supervisor::jail_network::release_recorded(&stale).unwrap();
    assert!(
        ifindex(&name).is_some(),
        "a record another uid wrote released {name}"
    );
    std::fs::remove_file(&record).unwrap();
    std::os::unix::fs::symlink(other_dir.network_record(), &record).unwrap();
    cube_supervisor::jail_network::release_recorded(&stale).unwrap();
    assert!(
        ifindex(&name).is_some(),
        "a record linked to another sandbox's released {name}"
    );
    // A FIFO in the record's place does not hang the library waiting for a writer.
    std::fs::remove_file(&record).unwrap();
    let c_record = std::ffi::CString::new(record.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mkfifo reads the NUL-terminated path during the call only.
    assert_eq!(unsafe { libc::mkfifo(c_record.as_ptr(), 0o600) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let fifo_dir = stale.clone();
    std::thread::spawn(move || {
        let _ = tx.send(cube_supervisor::jail_network::release_recorded(&fifo_dir).is_ok());
    });
    assert!(
        rx.recv_timeout(Duration::from_secs(10))
            .expect("a FIFO network record hung the release"),
        "a FIFO network record failed the release"
    );

    assert_eq!(
        get_inside(&other.agent().unwrap(), OUT_ADDR, 80).unwrap(),
        "outside"
    );
    other.destroy().unwrap();
}
