//! The whole Linux VM path through the public API, with Cube's own guest kernel: a VM
//! template built through the supervisor layer (image, boot, agent over vsock,
//! snapshot), a sandbox created from it, a command, a Python cell and files through
//! its agent, then snapshot / rollback / clone / hibernate / wake of the live guest,
//! its agent answering after each; and a sandbox with a network (a TAP from the
//! host's pool behind the guest's NIC) reaching a listener in a namespace the test
//! owns (`common::lab`), refused where the default egress policy refuses, after a
//! clone, a rollback and the clone's hibernation and wake too, and leaving nothing of
//! its TAP once destroyed.
//!
//! On PVM hosts the guest kernel runs emulated (the host probe chooses it): slow, but
//! this is the proof that the Linux path works there. Skipped, saying why, without
//! `/dev/kvm`, without Cube's guest kernel (`scripts/build-guest-kernel.sh`), without
//! the host's Debian Python (`/usr/bin/python3`, copied into the image with the
//! libraries it links), without `mkfs.ext4`, or without a statically linked agent
//! (`scripts/build-static.sh`, run by set-up). The network part is skipped, saying
//! why, without root or iproute2, or where the pool's eBPF datapath cannot load.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::net::{IpAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::lab::{
    self, answer_once, ifindex, Lab, DEFAULT_DENIED_ADDR, FAR_ADDR, HOST_ADDR, HOST_PORT, OUT_ADDR,
};
use cube_agent::client::Client;
use cube_agent::protocol::{ExecRequest, Language};
use cube_core::network::NetworkOptions;
use cube_core::templates::{image_agent, MachineConfig, TreeSource, VmTemplateSpec};
use cube_core::testing::open_pool;
use cube_core::{CreateOptions, Engine, ErrorKind, Runtime, RuntimeConfig, Sandbox};
use cube_vmm::testing::cube_guest_kernel;

/// The Python the image carries: Debian's, whose standard library is under /usr/lib.
const PYTHON: &str = "/usr/bin/python3";
/// Programs the image carries besides Python (with the libraries they link).
const PROGRAMS: [&str; 4] = ["/bin/sh", "/bin/cat", "/bin/ls", "/bin/uname"];
/// Guest RAM: small, so every snapshot writes little.
const GUEST_MEMORY: u64 = 256 << 20;
/// A bound on a hung boot, not a timing assertion (emulated, the template's boot
/// takes about half a minute here).
const BOOT_LIMIT: Duration = Duration::from_secs(900);

/// The shared libraries `binary` links, as `ldd` resolves them (the dynamic loader
/// included).
fn linked_libraries(binary: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd").arg(binary).output().unwrap();
    assert!(out.status.success(), "ldd {}", binary.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
            // "/lib64/ld-linux-x86-64.so.2 (0x...)"; the vDSO has no file.
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

/// Copies `from` to the same path under `tree`, following links (the image needs the
/// files, and Debian's /bin is a link to /usr/bin).
fn copy_into(tree: &Path, from: &Path) {
    let to = tree.join(from.strip_prefix("/").unwrap());
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(from, &to).unwrap_or_else(|e| panic!("copying {}: {e}", from.display()));
}

/// A root tree with the host's Python and a few programs, their libraries, and
/// Python's standard library (less its test suite).
fn python_tree(tree: &Path) {
    let python = std::fs::canonicalize(PYTHON).unwrap();
    let mut files = BTreeSet::new();
    for program in PROGRAMS.iter().map(PathBuf::from).chain([python.clone()]) {
        files.extend(linked_libraries(&program));
        files.insert(program);
    }
    for file in &files {
        copy_into(tree, file);
    }
    // `python3` on the agent's PATH.
    let link = tree.join("usr/bin/python3");
    if !link.exists() {
        std::os::unix::fs::symlink(python.file_name().unwrap(), link).unwrap();
    }
    let version = python.file_name().unwrap().to_str().unwrap().to_string();
    let stdlib = Path::new("/usr/lib").join(&version);
    // Into usr/lib, which must exist: `cp -a` would otherwise make the library
    // directory usr/lib itself.
    std::fs::create_dir_all(tree.join("usr/lib")).unwrap();
    let status = Command::new("cp")
        .arg("-a")
        .arg(&stdlib)
        .arg(tree.join("usr/lib"))
        .status()
        .unwrap();
    assert!(status.success(), "copying {}", stdlib.display());
    let _ = std::fs::remove_dir_all(tree.join("usr/lib").join(&version).join("test"));
    for dir in ["root", "home/user"] {
        std::fs::create_dir_all(tree.join(dir)).unwrap();
    }
}

/// Whatever this test needs and the host lacks, said once.
fn missing() -> Option<String> {
    if !Path::new(PYTHON).is_file() {
        return Some(format!(
            "no Debian Python at {PYTHON} to put into the image"
        ));
    }
    if Command::new("mkfs.ext4").arg("-V").output().is_err() {
        return Some("mkfs.ext4 is not installed (e2fsprogs)".into());
    }
    if Command::new("ldd").arg("--version").output().is_err() {
        return Some("ldd is not installed (libc-bin)".into());
    }
    image_agent::locate().err().map(|e| e.to_string())
}

/// Runs `argv` in the sandbox; returns standard output, asserting success.
fn exec(sandbox: &Sandbox, argv: &[&str]) -> String {
    let agent = agent_of(sandbox);
    let out = agent
        .exec(ExecRequest {
            argv: argv.iter().map(|a| a.to_string()).collect(),
            env: Vec::new(),
            cwd: Some("/root".into()),
            user: None,
            stdin: Vec::new(),
            timeout_ms: Some(300_000),
            background: false,
        })
        .unwrap();
    assert_eq!(
        out.exit.code,
        Some(0),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The value of the Python expression `code` in context `main`.
fn python(sandbox: &Sandbox, code: &str) -> Option<String> {
    let agent = agent_of(sandbox);
    let result = agent
        .run_code("main", code, Some(Duration::from_secs(300)))
        .unwrap();
    assert!(result.error.is_none(), "{code}: {result:?}");
    result.value
}

fn read(sandbox: &Sandbox, path: &str) -> String {
    let mut out = Vec::new();
    agent_of(sandbox).read_file(path, &mut out).unwrap();
    String::from_utf8(out).unwrap()
}

fn write(sandbox: &Sandbox, path: &str, text: &str) {
    agent_of(sandbox)
        .write_file(path, &mut text.as_bytes())
        .unwrap();
}

/// Prints how long `what` took: the scenario's timeline, for the note.
fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let value = f();
    println!("{what}: {:.2} s", started.elapsed().as_secs_f64());
    value
}

#[test]
fn a_linux_vm_template_serves_sandboxes_through_their_whole_life() {
    let Some(kernel) = cube_guest_kernel() else {
        return;
    };
    if let Some(reason) = missing() {
        println!("skipped: {reason}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("tree");
    python_tree(&tree);
    let rt = Runtime::open(RuntimeConfig {
        store_root: dir.path().join("store"),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: Some(common::supervisor()),
    })
    .unwrap();
    let spec = VmTemplateSpec {
        tree: TreeSource::Directory(tree),
        kernel: Some(kernel),
        initrd: None,
        machine: MachineConfig {
            vcpus: 1,
            memory_bytes: GUEST_MEMORY,
            irqchip: true,
        },
        boot_timeout: BOOT_LIMIT,
        agent: image_agent::locate().unwrap(),
    };
    let meta = timed("template build (image, boot to agent, snapshot)", || {
        rt.build_vm_template("linux", &spec, &mut |_| {})
    })
    .unwrap();
    assert_eq!(meta.engine, Engine::Vm);

    let mut sandbox = timed("create from the template", || {
        rt.create("linux", CreateOptions::new(true))
    })
    .unwrap();
    assert_eq!(sandbox.engine(), Engine::Vm);
    let uname = timed("exec uname", || exec(&sandbox, &["uname", "-r"]));
    assert!(uname.trim_end().ends_with("-cube"), "{uname}");
    timed("python context", || {
        agent_of(&sandbox)
            .create_context("main", Language::Python, Some("/root"))
            .unwrap()
    });
    let value = timed("python cell", || python(&sandbox, "x = 6 * 7\nx"));
    assert_eq!(value.as_deref(), Some("42"));
    write(&sandbox, "/root/notes", "v1\n");
    assert_eq!(exec(&sandbox, &["cat", "/root/notes"]), "v1\n");

    // Snapshot, then change the file and the interpreter's state.
    let snapshot = timed("snapshot", || sandbox.snapshot()).unwrap();
    write(&sandbox, "/root/notes", "v2\n");
    python(&sandbox, "x = 0");
    assert_eq!(read(&sandbox, "/root/notes"), "v2\n");

    // Rollback: the file and the interpreter are as they were at the snapshot.
    timed("rollback", || sandbox.rollback(&snapshot.id)).unwrap();
    assert_eq!(read(&sandbox, "/root/notes"), "v1\n");
    assert_eq!(python(&sandbox, "x").as_deref(), Some("42"));

    // Clone: a second guest with the same state, apart from the first.
    let clones = timed("clone", || {
        rt.clone_sandbox(&mut sandbox, 1, 1, CreateOptions::new(true))
    })
    .unwrap();
    let clone = &clones[0];
    assert_ne!(clone.id(), sandbox.id());
    assert_eq!(read(clone, "/root/notes"), "v1\n");
    assert_eq!(python(clone, "x").as_deref(), Some("42"));
    write(clone, "/root/notes", "clone\n");
    assert_eq!(read(&sandbox, "/root/notes"), "v1\n");

    // Hibernate and wake: memory written out and released, then restored.
    timed("hibernate", || sandbox.hibernate()).unwrap();
    timed("wake", || sandbox.wake()).unwrap();
    assert_eq!(read(&sandbox, "/root/notes"), "v1\n");
    assert_eq!(python(&sandbox, "x + 1").as_deref(), Some("43"));
    assert_eq!(exec(&sandbox, &["ls", "/root"]), "notes\n");

    for clone in clones {
        clone.destroy().unwrap();
    }
    sandbox.destroy().unwrap();

    match lab::missing() {
        Some(reason) => println!("skipped: guest networking: {reason}"),
        None => {
            if let Some(lab) = Lab::new() {
                guest_networking(&rt, &lab);
            }
        }
    }
}

/// Clones of the networked sandbox's snapshot made one after another, each asked to
/// answer.
const CLONES_AFTER_TRAFFIC: usize = 6;

/// The port of the test's own listener in the outside namespace.
const LISTENER_PORT: u16 = 7000;
/// A bound on one exchange with an emulated guest, not a timing assertion.
const EXCHANGE_LIMIT: Duration = Duration::from_secs(300);

/// Defines `probe(addr, port, data, timeout)` in the guest's Python context "net":
/// connects, sends `data`, half-closes, and returns "LOCAL_ADDR REPLY", or "refused
/// ERROR" when no connection came about.
const PROBE: &str = r#"
import socket

def probe(addr, port, data, timeout):
    try:
        with socket.create_connection((addr, port), timeout=timeout) as s:
            s.sendall(data.encode())
            s.shutdown(socket.SHUT_WR)
            chunks = []
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
            return s.getsockname()[0] + " " + b"".join(chunks).decode(errors="replace")
    except OSError as e:
        return "refused " + type(e).__name__
"#;

/// A client of `sandbox`'s agent. A just restored emulated guest may take longer than
/// the connect timeout to accept: it is asked again (each time printed) up to
/// [`EXCHANGE_LIMIT`], a bound on a hung guest, not a timing assertion; past it the
/// test fails with the end of the guest's console. Any other failure fails it at once:
/// a connection the guest resets (it took one for a stale connection of its own when
/// the device numbered host ports from the same start after every restore) is a bug.
fn agent_of(sandbox: &Sandbox) -> Client {
    let started = Instant::now();
    loop {
        match sandbox.agent() {
            Ok(client) => return client,
            Err(e) => {
                let why = common::error_chain(&e);
                assert_eq!(e.kind(), ErrorKind::Timeout, "{why}");
                if started.elapsed() >= EXCHANGE_LIMIT {
                    let console =
                        std::fs::read(sandbox.dir().join("console.log")).unwrap_or_default();
                    let tail = &console[console.len().saturating_sub(4096)..];
                    panic!(
                        "{why}\nthe guest's console ends with:\n{}",
                        String::from_utf8_lossy(tail)
                    );
                }
                println!("agent not reached yet: {why}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// What `probe` printed in the guest of `agent` for a connection to `addr`:`port`
/// sending `data`, waiting at most `timeout_s` for it to be accepted.
fn probe(agent: &Client, addr: impl Into<IpAddr>, port: u16, data: &str, timeout_s: u32) -> String {
    let code = format!(
        "print(probe({:?}, {port}, {data:?}, {timeout_s}), end='')",
        addr.into().to_string()
    );
    let result = agent.run_code("net", &code, Some(EXCHANGE_LIMIT)).unwrap();
    assert!(result.error.is_none(), "{code}: {result:?}");
    result.stdout
}

/// The guest sends a token to the test's listener in the outside namespace and reads
/// its answer: the bytes arrive both ways, from the sandbox's address inside and
/// source-NATed to the host's address on the way to the namespace outside.
fn reaches_the_listener(agent: &Client, listener: &TcpListener, token: &'static str) {
    let answered = answer_once(listener, "answer from outside", EXCHANGE_LIMIT);
    let inside = probe(agent, OUT_ADDR, LISTENER_PORT, token, 60);
    let (peer, received) = answered.join().unwrap();
    assert_eq!(inside, "169.254.0.2 answer from outside");
    assert_eq!(received, token.as_bytes());
    assert_eq!(peer.ip(), IpAddr::from(HOST_ADDR), "not source-NATed");
}

/// A sandbox created from the template with a network: its guest (whose agent gave
/// its NIC the sandbox address at the template's boot, kept by every snapshot: all
/// sandboxes have the same address) moves packets through the pool's TAP under the
/// default egress policy, as does a clone of it (a new TAP behind the same guest
/// state), the sandbox rolled back to the clone's snapshot (the same TAP behind a
/// restored guest) and the clone hibernated and woken after its traffic; destroyed,
/// neither leaves its TAP or datapath state.
fn guest_networking(rt: &Runtime, lab: &Lab) {
    let listener = lab.listen_outside(LISTENER_PORT);
    let networked = || CreateOptions {
        network: Some(NetworkOptions::default()),
        ..CreateOptions::new(true)
    };
    let mut sandbox = timed("net: create with a network", || {
        rt.create("linux", networked())
    })
    .unwrap();
    let report = sandbox.network().unwrap();
    assert_eq!(report.guest_addr.to_string(), "169.254.0.2");
    let tap = report.host_ifname;
    let tap_index = ifindex(&tap).expect("the TAP exists while attached");
    let agent = agent_of(&sandbox);
    timed("net: python context with the probe", || {
        agent
            .create_context("net", Language::Python, Some("/root"))
            .unwrap();
        let defined = agent.run_code("net", PROBE, Some(EXCHANGE_LIMIT)).unwrap();
        assert!(defined.error.is_none(), "{defined:?}");
    });
    timed("net: reach the outside listener", || {
        reaches_the_listener(&agent, &listener, "token from the guest")
    });
    // Another outside address through NAT, then what the default policy refuses: the
    // host's own address and a reserved range (both served, so only the policy stops
    // them).
    let get = "GET / HTTP/1.0\r\n\r\n";
    let far = timed("net: reach an outside HTTP server", || {
        probe(&agent, FAR_ADDR, 80, get, 60)
    });
    assert!(
        far.starts_with("169.254.0.2 HTTP/1.0 200") && far.ends_with("outside"),
        "{far}"
    );
    let host = timed("net: the host refused", || {
        probe(&agent, HOST_ADDR, HOST_PORT, get, 3)
    });
    assert!(host.starts_with("refused "), "the host reached: {host}");
    let denied = timed("net: a default-denied range refused", || {
        probe(&agent, DEFAULT_DENIED_ADDR, 80, get, 3)
    });
    assert!(
        denied.starts_with("refused "),
        "a default-deny range reached: {denied}"
    );
    drop(agent);
    let counters = sandbox.network().unwrap().counters;
    assert!(
        counters.tx_packets > 0 && counters.rx_bytes > 0,
        "{counters:?}"
    );
    assert!(counters.dropped > 0, "{counters:?}");

    // A clone: the same guest state (address, route, the probe) behind a new TAP.
    let snapshot = timed("net: snapshot", || sandbox.snapshot()).unwrap();
    let mut clone = timed("net: clone with a network", || {
        rt.create_from_snapshot(&snapshot.id, networked())
    })
    .unwrap();
    let clone_tap = clone.network().unwrap().host_ifname;
    assert_ne!(clone_tap, tap);
    let clone_index = ifindex(&clone_tap).expect("the clone's TAP exists");
    timed("net: the clone reaches the listener", || {
        reaches_the_listener(&agent_of(&clone), &listener, "token from the clone")
    });
    // More clones of the snapshot taken after traffic, one at a time: each answers its
    // agent (one in about eight did not, before a restore kept the interrupt of the
    // vsock device's transport-reset event).
    for n in 0..CLONES_AFTER_TRAFFIC {
        let more = timed(&format!("net: clone {n} answers"), || {
            let more = rt.create_from_snapshot(&snapshot.id, CreateOptions::new(true))?;
            let agent = agent_of(&more);
            let result = agent
                .run_code("net", "probe.__name__", Some(EXCHANGE_LIMIT))
                .unwrap();
            assert_eq!(result.value.as_deref(), Some("'probe'"), "{result:?}");
            Ok::<_, cube_core::SandboxError>(more)
        })
        .unwrap();
        more.destroy().unwrap();
    }

    // Rollback: a guest restored from the snapshot behind the sandbox's own TAP.
    timed("net: rollback", || sandbox.rollback(&snapshot.id)).unwrap();
    assert_eq!(sandbox.network().unwrap().host_ifname, tap);
    timed("net: reach the listener after rollback", || {
        reaches_the_listener(&agent_of(&sandbox), &listener, "token after rollback")
    });

    // Hibernate and wake the clone, which carried traffic: its guest answers and
    // reaches the listener again behind its own TAP.
    timed("net: hibernate the clone", || clone.hibernate()).unwrap();
    timed("net: wake the clone", || clone.wake()).unwrap();
    assert_eq!(clone.network().unwrap().host_ifname, clone_tap);
    timed("net: the woken clone reaches the listener", || {
        reaches_the_listener(&agent_of(&clone), &listener, "token after wake")
    });

    // Destroyed, neither leaves its TAP or anything of it in the datapath.
    clone.destroy().unwrap();
    sandbox.destroy().unwrap();
    let (pool, lock) = open_pool().unwrap();
    drop(lock);
    for (name, index) in [(tap, tap_index), (clone_tap, clone_index)] {
        assert!(ifindex(&name).is_none(), "{name} left on the host");
        assert_eq!(
            pool.residue(&name, index).unwrap(),
            cube_net::Residue::default(),
            "{name}"
        );
    }
}
