//! Writes the seed corpora under `seeds/<target>/` from real encodings: a snapshot
//! state taken from the test guest booted under KVM (1 vCPU, 128 MiB, with and without
//! in-kernel irqchip; and re-labelled as a Linux guest with a virtio-rng record; the
//! `-v2` files are the previous format, kept to seed its upgrade path), supervisor frames of each message shape, and a metadata
//! envelope. Regenerate after a format change, from this directory:
//!
//! ```text
//! cargo run --example make_seeds
//! ```

use std::path::Path;
use std::sync::Arc;

use cube_storage::SnapshotDir;
use cube_vmm::persist::state::STATE_KIND;
use cube_vmm::persist::MachineConfig;
use cube_supervisor::protocol::{write_frame, MachineStatus, Source, StatusReport};
use cube_supervisor::protocol::{Request, Response};
use cube_vmm::persist::WorkingSet;
use cube_vmm::persist::SnapshotStats;
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
    machine.snapshot(dir.path())?;
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
    let memory = cube_devices::virtio::VirtioMemory::from_ranges(&[(
        vm_memory::GuestAddress(0),
        1 << 20,
    )])?;
    let transport = cube_devices::virtio::mmio::MmioTransport::new(
        Box::new(cube_devices::virtio::rng::Rng::new()),
        memory,
        Arc::new(NoLine),
    );
    Ok(cube_devices::records::DeviceRecord {
        kind: cube_devices::records::DeviceKind::Rng,
        state: transport.save(),
    })
}

fn frames<T: serde::Serialize>(messages: &[T]) -> Result<Vec<u8>, Error> {
    let mut out = Vec::new();
    for m in messages {
        write_frame(&mut out, m)?;
    }
    Ok(out)
}

fn main() -> Result<(), Error> {
    let seeds = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds");

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
            settings: cube_supervisor::protocol::Settings {
                env: vec![("A".into(), "1".into())],
                memory_mib: Some(256),
                cpu_millis: Some(500),
                pids_max: Some(64),
                lifetime_ms: Some(60_000),
            },
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
            },
            kind: cube_supervisor::records::SnapshotKind::Full,
        },
        Response::Memory(vec![0xab; 64]),
        Response::Digest(vec![0xdead_beef, 0x0123_4567]),
        Response::Error(cube_supervisor::protocol::Failure::bad_state(
            "sandbox is not hibernated",
        )),
    ];
    let frame_seeds = seeds.join("supervisor_frame");
    write(&frame_seeds, "requests.bin", &frames(&requests)?)?;
    write(&frame_seeds, "responses.bin", &frames(&responses)?)?;
    write(&frame_seeds, "adopt.bin", &frames(&requests[..1])?)?;
    write(&frame_seeds, "status.bin", &frames(&responses[1..2])?)?;

    let envelope = cube_storage::encode_envelope("sandbox", br#"{"id":"sb-1","ephemeral":true}"#)?;
    write(&seeds.join("metadata_envelope"), "sandbox.bin", &envelope)?;
    Ok(())
}
