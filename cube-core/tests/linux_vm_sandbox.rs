//! A Linux guest snapshotted mid-boot (with a VM template's devices: root disk, vsock,
//! entropy) stored as a VM template, and a sandbox created from it through the
//! supervisor: restored, never booted; its status is reported, and its agent, which
//! has not started yet in that guest, is a clear "not ready" error, not a hang.

#![allow(clippy::unwrap_used)] // helpers of this test file, not library code

mod common;

use std::time::{Duration, Instant};

use common::linux::{linux_kernel, runtime_with_midboot_template, TEMPLATE};
use cube_core::store::SandboxDir;
use cube_core::{CreateOptions, Engine, MachineStatus, SandboxError};
use cube_supervisor::vm_agent::VmAgentError;

#[test]
fn a_linux_template_snapshot_restores_as_a_sandbox_whose_agent_is_not_ready() {
    let Some(kernel) = linux_kernel() else { return };
    let root = tempfile::tempdir().unwrap();
    // Booted with the template devices until the kernel printed its banner, then
    // snapshotted into a template directory as `cube template build --engine vm` does.
    let rt = runtime_with_midboot_template(kernel, root.path());

    let mut sandbox = rt.create(TEMPLATE, CreateOptions::new(true)).unwrap();
    assert_eq!(sandbox.engine(), Engine::Vm);
    let dir = sandbox.dir().to_path_buf();
    assert!(SandboxDir::new(&dir).vsock_socket().exists());
    let status = sandbox.status().unwrap();
    assert_eq!(status.engine, Engine::Vm);
    // Still booting under emulation here, or stopped by it on a PVM host: either is
    // reported, never hidden.
    assert!(
        matches!(
            status.status,
            MachineStatus::Running | MachineStatus::Failed(_)
        ),
        "{:?}",
        status.status
    );
    let started = Instant::now();
    let Err(err) = sandbox.agent() else {
        panic!("an agent answered in a guest that never started one");
    };
    assert!(
        matches!(
            &err,
            SandboxError::VmAgent(_, VmAgentError::NotReady { .. })
        ),
        "{err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    sandbox.pause().unwrap();
    assert_eq!(sandbox.status().unwrap().status, MachineStatus::Paused);
    sandbox.resume().unwrap();
    // The restored guest's console continues in the sandbox's log.
    assert!(SandboxDir::new(&dir).console_log().exists());
    sandbox.destroy().unwrap();
    assert!(!dir.exists());
}
