//! Writes the seed corpora under `seeds/<target>/` from real encodings: a snapshot
//! state taken from the test guest booted under KVM (1 vCPU, 128 MiB, with and without
//! in-kernel irqchip; and re-labelled as a Linux guest with a virtio-rng record; the
//! `-v2` files are the previous format, kept to seed its upgrade path), supervisor frames of each message shape, a metadata
//! envelope, a small snapshot archive, network policies (JSON and CLI lines), and Connect
//! calls of `cube serve` in each codec and framing. Regenerate after a format change, from this directory:
//!
//! ```text
//! cargo run --example make_seeds
//! ```

use std::path::Path;
use std::sync::Arc;

use cube_storage::SnapshotDir;
use cube_supervisor::protocol::{write_frame, MachineStatus, Source, StatusReport};
use cube_supervisor::protocol::{Request, Response};
use cube_vmm::persist::state::STATE_KIND;
use cube_vmm::persist::MachineConfig;
use cube_vmm::persist::SnapshotStats;
use cube_vmm::persist::WorkingSet;
use cube_vmm::test_guest::Machine;
use cube_vmm::vstate::KvmContext;

type Error = Box<dyn std::error::Error>;

fn write(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), Error> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(name), bytes)?;
    println!("{} ({} bytes)", dir.join(name).display(), bytes.len());
    Ok(())
}

/// The state file of a snapshot of the freshly booted test guest.
fn state_file(ctx: &Arc<KvmContext>, irqchip: bool) -> Result<Vec<u8>, Error> {
    let config = MachineConfig {
        vcpus: 1,
        memory_bytes: 128 << 20,
        irqchip,
    };
    let working_set = WorkingSet {
        read_bytes: 1 << 20,
        write_bytes: 1 << 20,
    };
    let mut machine = Machine::boot_test_guest(ctx, config, working_set)?;
    machine.wait_working_set()?;
    let dir = tempfile::tempdir()?;
    machine.snapshot(dir.path(), None)?;
    drop(machine);
    Ok(std::fs::read(SnapshotDir::new(dir.path()).state())?)
}

/// The saved state of a fresh virtio-rng behind its transport.
fn rng_record() -> Result<cube_devices::records::DeviceRecord, Error> {
    use cube_devices::virtio::interrupt::{InterruptError, InterruptLine};
    struct NoLine;
    impl InterruptLine for NoLine {
        fn raise(&self) -> Result<(), InterruptError> {
            Ok(())
        }
        fn lower(&self) -> Result<(), InterruptError> {
            Ok(())
        }
    }
    let memory =
        cube_devices::virtio::VirtioMemory::from_ranges(&[(vm_memory::GuestAddress(0), 1 << 20)])?;
    let transport = cube_devices::virtio::mmio::MmioTransport::new(
        Box::new(cube_devices::virtio::rng::Rng::new()),
        memory,
        Arc::new(NoLine),
    );
    Ok(cube_devices::records::DeviceRecord {
        kind: cube_devices::records::DeviceKind::Rng,
        state: transport.save()?,
    })
}

fn frames<T: serde::Serialize>(messages: &[T]) -> Result<Vec<u8>, Error> {
    let mut out = Vec::new();
    for m in messages {
        write_frame(&mut out, m)?;
    }
    Ok(out)
}

/// `messages` as agent protocol frames, one after another.
fn agent_frames<T: serde::Serialize>(messages: &[T]) -> Result<Vec<u8>, Error> {
    let mut out = Vec::new();
    for m in messages {
        out.extend(cube_agent::frame::encode_frame(m)?);
    }
    Ok(out)
}

/// Frames of the agent protocol: a session's requests (an exec with input, one on a
/// terminal and its resize, a streamed write, an attach, a VM pod container's root set
/// up and taken away), the answers an agent gives,
/// a frame whose prefix announces more than the limit, and a request of an unknown kind.
fn agent_seeds(dir: &Path) -> Result<(), Error> {
    use cube_agent::protocol::{
        ErrorCode, ErrorReply, ExecRequest, ExitInfo, Request, RequestBody, Response, ResponseBody,
        TerminalSize, PROTOCOL_VERSION, REQUEST_KINDS,
    };
    let exec = ExecRequest {
        argv: vec!["sh".into(), "-c".into(), "cat; exit 3".into()],
        env: vec![("GREETING".into(), "hi".into())],
        cwd: Some("/tmp".into()),
        stdin: b"input".to_vec(),
        timeout_ms: Some(1000),
        ..ExecRequest::default()
    };
    let bodies = [
        RequestBody::Hello {
            protocol: PROTOCOL_VERSION,
        },
        RequestBody::Exec(exec.clone()),
        RequestBody::ExecInTerminal {
            root: Some("/.cube-containers/c1".into()),
            size: TerminalSize { rows: 33, cols: 77 },
            exec: ExecRequest {
                stdin: Vec::new(),
                ..exec
            },
        },
        RequestBody::ResizeTerminal {
            exec_id: 2,
            size: TerminalSize::default(),
        },
        RequestBody::StdinWrite {
            exec_id: 2,
            data: b"typed\n".to_vec(),
        },
        RequestBody::WriteStart {
            path: "/home/user/f".into(),
            mode: Some(0o600),
            append: false,
            create_parents: true,
        },
        RequestBody::WriteChunk { data: vec![7; 64] },
        RequestBody::WriteEnd { sync: true },
        RequestBody::Attach { pid: 42 },
        RequestBody::InstallRoot {
            archive: "/.cube-containers/c1.tar".into(),
            root: "/.cube-containers/c1".into(),
        },
        RequestBody::RemoveRoot {
            root: "/.cube-containers/c1".into(),
        },
        RequestBody::ConfigureNic(cube_agent::protocol::NicSettings {
            mac: [0x0a, 0x58, 10, 88, 0, 5],
            mtu: 1450,
            address: [10, 88, 0, 5],
            prefix_len: 16,
            gateway: Some([10, 88, 0, 1]),
        }),
    ];
    let requests: Vec<Request> = bodies
        .into_iter()
        .zip(1u64..)
        .map(|(body, id)| Request { id, body })
        .collect();
    let answers = [
        ResponseBody::Hello {
            protocol: PROTOCOL_VERSION,
            agent: "0.1.0".into(),
        },
        ResponseBody::Started { pid: 42 },
        ResponseBody::Stdout(b"33 77\r\n".to_vec()),
        ResponseBody::Stderr(b"oops\n".to_vec()),
        ResponseBody::Exited(ExitInfo {
            code: Some(3),
            signal: None,
            timed_out: false,
        }),
        ResponseBody::Written { size: 64 },
        ResponseBody::Error(ErrorReply::new(
            ErrorCode::NotRunning,
            "exec 2 has no terminal",
        )),
    ];
    let responses: Vec<Response> = answers
        .into_iter()
        .zip(1u64..)
        .map(|(body, id)| Response { id, body })
        .collect();
    write(dir, "requests.bin", &agent_frames(&requests)?)?;
    write(dir, "responses.bin", &agent_frames(&responses)?)?;
    // 5 MiB announced, 16 bytes given: skipped (or refused as truncated), never allocated.
    let mut oversized = (5u32 << 20).to_le_bytes().to_vec();
    oversized.extend([9u8; 16]);
    write(dir, "oversized.bin", &oversized)?;
    // Request id 77 of a kind this protocol does not know.
    let mut unknown = postcard::to_allocvec(&77u64)?;
    unknown.extend(postcard::to_allocvec(&(REQUEST_KINDS + 4))?);
    let mut frame = (unknown.len() as u32).to_le_bytes().to_vec();
    frame.extend(unknown);
    write(dir, "unknown.bin", &frame)?;
    Ok(())
}

/// A small snapshot archive: a directory, a file with a data chunk past a hole, a
/// symlink, an opaque-directory marker.
fn archive_seed() -> Result<Vec<u8>, Error> {
    use std::os::unix::fs::FileExt;
    let tree = tempfile::tempdir()?;
    std::fs::create_dir(tree.path().join("layer"))?;
    let memory = std::fs::File::create(tree.path().join("layer/pages.img"))?;
    memory.set_len(3 << 20)?;
    memory.write_all_at(b"x = 41 and some page bytes", 2 << 20)?;
    std::fs::write(tree.path().join("snapshot.meta"), b"{\"id\":\"snap-1\"}")?;
    std::os::unix::fs::symlink("/tmp", tree.path().join("layer/tmp"))?;
    let mut out = Vec::new();
    cube_archive::pack(
        tree.path(),
        &mut out,
        &cube_archive::PackOptions {
            properties: [("snapshot".to_string(), "snap-1".to_string())].into(),
            base: &|_| None,
        },
    )?;
    Ok(out)
}

/// Seeds of the network-policy target: the service's JSON and the CLI's lines.
fn network_policy_seeds(dir: &Path) -> Result<(), Error> {
    use cube_supervisor::network::{NetworkOptions, NetworkPolicy, PortMapping};
    let options = NetworkOptions {
        policy: NetworkPolicy {
            internet: false,
            allow_out: vec!["10.1.0.0/16".into(), "192.0.2.7/32".into()],
            deny_out: vec!["203.0.113.0/24".into()],
        },
        expose: vec![PortMapping {
            host_port: 8080,
            sandbox_port: 80,
        }],
    };
    write(dir, "options.json", &serde_json::to_vec(&options)?)?;
    write(
        dir,
        "default.json",
        &serde_json::to_vec(&NetworkOptions::default())?,
    )?;
    write(
        dir,
        "lines.txt",
        b"10.0.0.0/8\n 169.254.169.254/32\n0.0.0.0/0\n8080:80\n22\n",
    )?;
    Ok(())
}

/// Seeds of the Connect target: header lines, a NUL, the body; each codec and framing.
fn connect_seeds(dir: &Path) -> Result<(), Error> {
    use cube_server::envd::connect::{encode, envelope, Codec};
    use cube_server::envd::proto::{ListDirRequest, ProcessConfig, StartRequest};
    use std::io::Write;
    let start = StartRequest {
        process: Some(ProcessConfig {
            cmd: "/bin/sh".into(),
            args: vec!["-c".into(), "echo hi".into()],
            envs: [("A".to_string(), "1".to_string())].into(),
            cwd: Some("/home/user".into()),
        }),
        tag: Some("t".into()),
        ..Default::default()
    };
    let list = ListDirRequest {
        path: "/home/user".into(),
        depth: 2,
    };
    let seed = |head: &str, body: &[u8]| {
        let mut out = head.as_bytes().to_vec();
        out.push(0);
        out.extend_from_slice(body);
        out
    };
    let host = "49983-0123456789abcdef.e2b.local";
    write(
        dir,
        "unary-proto.bin",
        &seed(
            &format!("{host}\ncontent-type: application/proto\n"),
            &encode(Codec::Proto, &start),
        ),
    )?;
    write(
        dir,
        "unary-json.bin",
        &seed(
            "content-type: application/json\n",
            &encode(Codec::Json, &list),
        ),
    )?;
    write(
        dir,
        "stream-json.bin",
        &seed(
            "content-type: application/connect+json\nconnect-timeout-ms: 5000\n",
            &envelope(0, &encode(Codec::Json, &start)),
        ),
    )?;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&encode(Codec::Proto, &start))?;
    let mut body = envelope(1, &gz.finish()?).to_vec();
    body.extend_from_slice(&envelope(2, b"{}"));
    write(
        dir,
        "stream-proto-gzip.bin",
        &seed(
            "content-type: application/connect+proto\nconnect-content-encoding: gzip\n",
            &body,
        ),
    )?;
    Ok(())
}

fn main() -> Result<(), Error> {
    let seeds = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds");
    network_policy_seeds(&seeds.join("network_policy"))?;
    connect_seeds(&seeds.join("connect_request"))?;
    write(
        &seeds.join("snapshot_archive"),
        "small-tree.bin",
        &archive_seed()?,
    )?;

    let snapshot_seeds = seeds.join("snapshot_state");
    if Path::new("/dev/kvm").exists() {
        let ctx = Arc::new(KvmContext::open()?);
        for (irqchip, name) in [(true, "irqchip"), (false, "no-irqchip")] {
            let file = state_file(&ctx, irqchip)?;
            // A seed the decoder refuses would start the fuzzer at the first check.
            cube_vmm::persist::state::decode_file_bytes(&file)?;
            let payload = cube_storage::decode_envelope(&file, STATE_KIND)?;
            write(&snapshot_seeds, &format!("file-1vcpu-{name}.bin"), &file)?;
            write(
                &snapshot_seeds,
                &format!("payload-1vcpu-{name}.bin"),
                payload,
            )?;
        }
        // A Linux guest's state with a virtio device record (the shape LinuxVm writes;
        // the test guest's KVM state stands in for the kernel's).
        let file = state_file(&ctx, true)?;
        let mut state = cube_vmm::persist::state::decode_file_bytes(&file)?;
        state.guest = cube_vmm::persist::GuestKind::Linux;
        state.devices = vec![rng_record()?];
        let payload = cube_vmm::persist::state::encode(&state)?;
        cube_vmm::persist::state::decode(&payload)?;
        write(&snapshot_seeds, "payload-linux-rng.bin", &payload)?;
        write(
            &snapshot_seeds,
            "file-linux-rng.bin",
            &cube_storage::encode_envelope(STATE_KIND, &payload)?,
        )?;
    } else {
        println!("skipped: /dev/kvm not present (no snapshot state seeds)");
    }
    let garbage = cube_storage::encode_envelope(STATE_KIND, b"\x02garbage payload")?;
    write(&snapshot_seeds, "file-garbage-payload.bin", &garbage)?;

    let config = MachineConfig::default();
    let requests = [
        Request::Adopt {
            version: cube_supervisor::protocol::PROTOCOL_VERSION,
            id: "sb-0123456789abcdef".into(),
            dir: "/var/lib/cube/sandboxes/sb-0123456789abcdef".into(),
            source: Source::Snapshot("/var/lib/cube/templates/base".into()),
            ephemeral: true,
            settings: Default::default(),
        },
        Request::Adopt {
            version: cube_supervisor::protocol::PROTOCOL_VERSION,
            id: "sb-0123456789abcdee".into(),
            dir: "/var/lib/cube/sandboxes/sb-0123456789abcdee".into(),
            source: Source::Jail { layer: None },
            ephemeral: false,
            settings: Box::new(cube_supervisor::protocol::Settings {
                env: vec![("A".into(), "1".into())],
                memory_mib: Some(256),
                cpu_millis: Some(500),
                pids_max: Some(64),
                lifetime_ms: Some(60_000),
                disk_mib: Some(512),
                network: Some(cube_supervisor::network::NetworkOptions::default()),
                netns: cube_supervisor::network::NetnsChoice::Join("/var/run/netns/pod".into()),
                ..Default::default()
            }),
        },
        Request::Adopt {
            version: cube_supervisor::protocol::PROTOCOL_VERSION,
            id: "sb-1".into(),
            dir: "/tmp/sb-1".into(),
            source: Source::BootTestGuest {
                config,
                working_set: WorkingSet::default(),
            },
            ephemeral: false,
            settings: Default::default(),
        },
        Request::Status,
        Request::Pause,
        Request::Resume,
        Request::Snapshot {
            staging: "/tmp/s.staging".into(),
            dest: "/tmp/s".into(),
        },
        Request::SnapshotCommitted {
            dest: "/tmp/s".into(),
        },
        Request::Rollback {
            snapshot: "/tmp/s".into(),
        },
        Request::Hibernate,
        Request::Wake,
        Request::GuestDirty {
            mib: 16,
            pattern: 0x1000,
        },
        Request::GuestMode { spin: true },
        Request::GuestWaitWorkingSet,
        Request::ReadMemory {
            addr: 0x10000,
            len: 4096,
        },
        Request::MemoryDigest,
        Request::NetworkStatus,
        Request::SetPolicy(cube_supervisor::network::NetworkPolicy {
            internet: false,
            allow_out: vec!["10.1.0.0/16".into()],
            deny_out: vec!["203.0.113.0/24".into()],
        }),
        Request::Expose(cube_supervisor::network::PortMapping {
            host_port: 8080,
            sandbox_port: 80,
        }),
        Request::Unexpose { host_port: 8080 },
        Request::SetLimits(cube_supervisor::protocol::LimitChange {
            memory_mib: Some(4096),
            cpu_millis: None,
            pids_max: Some(512),
        }),
        Request::Destroy,
    ];
    let responses = [
        Response::Ok,
        Response::Status(StatusReport {
            status: MachineStatus::Running,
            pid: 4242,
            counter: 123_456,
            generation: 3,
            guest_error: false,
            config: Some(config),
            rss_kib: 20_480,
            engine: cube_supervisor::records::Engine::Vm,
            jail: None,
        }),
        Response::Status(StatusReport {
            status: MachineStatus::Failed("emulation failure".into()),
            pid: 1,
            counter: 0,
            generation: 0,
            guest_error: true,
            config: None,
            rss_kib: 0,
            engine: cube_supervisor::records::Engine::Jail,
            jail: None,
        }),
        Response::Snapshot {
            stats: SnapshotStats {
                dirty_pages: 4096,
                bytes_written: 16 << 20,
                reflinked: true,
                paused_us: 2_000,
            },
            kind: cube_supervisor::records::SnapshotKind::Full,
            fallback: None,
        },
        Response::Memory(vec![0xab; 64]),
        Response::Digest(vec![0xdead_beef, 0x0123_4567]),
        Response::Network(cube_supervisor::network::NetworkReport {
            host_ifname: "cube-v3".into(),
            guest_addr: std::net::Ipv4Addr::new(10, 240, 0, 2),
            gateway: std::net::Ipv4Addr::new(169, 254, 0, 1),
            policy: cube_supervisor::network::NetworkPolicy::default(),
            allow_in_force: Vec::new(),
            deny_in_force: vec!["10.0.0.0/8".into(), "169.254.0.0/16".into()],
            exposed: vec![cube_supervisor::network::PortMapping {
                host_port: 8080,
                sandbox_port: 80,
            }],
            counters: Default::default(),
        }),
        Response::Error(cube_supervisor::protocol::Failure::bad_state(
            "sandbox is not hibernated",
        )),
    ];
    let frame_seeds = seeds.join("supervisor_frame");
    write(&frame_seeds, "requests.bin", &frames(&requests)?)?;
    write(&frame_seeds, "responses.bin", &frames(&responses)?)?;
    write(&frame_seeds, "adopt.bin", &frames(&requests[..1])?)?;
    write(&frame_seeds, "status.bin", &frames(&responses[1..2])?)?;

    agent_seeds(&seeds.join("agent_frame"))?;

    let envelope = cube_storage::encode_envelope("sandbox", br#"{"id":"sb-1","ephemeral":true}"#)?;
    write(&seeds.join("metadata_envelope"), "sandbox.bin", &envelope)?;
    Ok(())
}
