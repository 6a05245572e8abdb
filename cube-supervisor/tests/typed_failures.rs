//! The supervisor binary, spoken to over its protocol: the requests it refuses come
//! back as failures of a kind (a bad argument, a host that cannot, a snapshot that
//! cannot be restored, an operation the guest does not offer), not as bare messages,
//! so that callers in other processes can tell them apart.

#![allow(clippy::unwrap_used)] // test code

use std::path::{Path, PathBuf};

use cube_supervisor::client::{ClientError, SupervisorClient};
use cube_supervisor::network::NetworkOptions;
use cube_supervisor::pool::spawn_supervisor_with_scratch;
use cube_supervisor::protocol::{ErrorKind, Request, Settings, Source, PROTOCOL_VERSION};
use cube_supervisor::server::WarmFor;
use cube_vmm::persist::{MachineConfig, WorkingSet};

const SUPERVISOR: &str = env!("CARGO_BIN_EXE_cube-supervisor");

/// Starts a supervisor (warmed for `warm_for`) and asks it to adopt `source` with
/// `settings` in `dir` at protocol `version`; returns the failure it answered with.
fn refused(
    warm_for: WarmFor,
    version: u32,
    dir: &Path,
    source: Source,
    settings: Settings,
) -> cube_supervisor::protocol::Failure {
    let idle = spawn_supervisor_with_scratch(Path::new(SUPERVISOR), None, warm_for).unwrap();
    let mut client = SupervisorClient::from_stream(idle.stream).unwrap();
    let answer = client.call_ok(&Request::Adopt {
        version,
        id: "sb-typedfailure".into(),
        dir: dir.to_path_buf(),
        source,
        ephemeral: true,
        settings,
    });
    match answer {
        Err(ClientError::Remote(failure)) => failure,
        other => panic!("the supervisor did not refuse: {other:?}"),
    }
}

fn kvm() -> bool {
    Path::new("/dev/kvm").exists()
}

#[test]
fn a_client_of_another_protocol_version_is_refused_as_a_bad_argument() {
    let dir = tempfile::tempdir().unwrap();
    let failure = refused(
        WarmFor::Jail,
        PROTOCOL_VERSION + 1,
        dir.path(),
        Source::Jail { layer: None },
        Settings::default(),
    );
    assert_eq!(failure.kind, ErrorKind::InvalidArgument, "{failure}");
    assert!(failure.message.contains("protocol version"), "{failure}");
}

#[test]
fn the_test_guest_refuses_a_network_as_unsupported_and_a_host_without_kvm_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let settings = Settings {
        network: Some(NetworkOptions::default()),
        ..Settings::default()
    };
    let source = Source::BootTestGuest {
        config: MachineConfig {
            vcpus: 1,
            memory_bytes: 128 << 20,
            irqchip: true,
        },
        working_set: WorkingSet::default(),
    };
    let failure = refused(WarmFor::Vm, PROTOCOL_VERSION, dir.path(), source, settings);
    // Without KVM the supervisor stops at the host; with it, at the guest.
    let expected = if kvm() {
        ErrorKind::Unsupported
    } else {
        ErrorKind::HostCannot
    };
    assert_eq!(failure.kind, expected, "{failure}");
}

#[test]
fn a_snapshot_that_is_not_one_is_a_snapshot_failure() {
    let dir = tempfile::tempdir().unwrap();
    let not_a_snapshot: PathBuf = dir.path().join("empty");
    std::fs::create_dir(&not_a_snapshot).unwrap();
    let failure = refused(
        WarmFor::Vm,
        PROTOCOL_VERSION,
        dir.path(),
        Source::Snapshot(not_a_snapshot),
        Settings::default(),
    );
    let expected = if kvm() {
        ErrorKind::SnapshotFailed
    } else {
        ErrorKind::HostCannot
    };
    assert_eq!(failure.kind, expected, "{failure}");
}
