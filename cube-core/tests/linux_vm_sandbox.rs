//! A Linux guest snapshotted mid-boot (with a VM template's devices: root disk, vsock,
//! entropy) stored as a VM template, and a sandbox created from it through the
//! supervisor: restored, never booted; its status is reported, and its agent, which
//! has not started yet in that guest, is a clear "not ready" error, not a hang.

#![allow(clippy::unwrap_used)] // helpers of this test file, not library code

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cube_core::sandbox::metadata::{TemplateMeta, TEMPLATE_META, TEMPLATE_META_KIND};
use cube_core::snapshot::format::ROOTFS_FILE;
use cube_core::snapshot::MachineConfig;
use cube_core::supervisor::linux_sandbox::template_devices;
use cube_core::supervisor::protocol::MachineStatus;
use cube_core::vm_agent::VmAgentError;
use cube_core::vmm::linux_boot::{self, LinuxBootConfig};
use cube_core::vstate::KvmContext;
use cube_core::{CreateOptions, Engine, Runtime, RuntimeConfig, SandboxError};

fn kernel() -> Option<PathBuf> {
    let path =
        PathBuf::from(std::env::var_os("CUBE_HOME").unwrap_or_else(|| "/var/lib/cube".into()))
            .join("kernels/debian-cloud/vmlinux");
    if !Path::new("/dev/kvm").exists() {
        eprintln!("skipping: /dev/kvm not present");
        return None;
    }
    if !path.is_file() {
        eprintln!(
            "skipping: no guest kernel at {} (scripts/fetch-kernel.sh)",
            path.display()
        );
        return None;
    }
    Some(path)
}

#[derive(Clone, Default)]
struct Console(Arc<Mutex<String>>);

impl Write for Console {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap()
            .push_str(&String::from_utf8_lossy(buf));
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_linux_template_snapshot_restores_as_a_sandbox_whose_agent_is_not_ready() {
    let Some(kernel) = kernel() else { return };
    let root = tempfile::tempdir().unwrap();
    let store_root = root.path().join("store");
    let rt = Runtime::open(RuntimeConfig {
        store_root: store_root.clone(),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: Some(PathBuf::from(env!("CARGO_BIN_EXE_cube-supervisor"))),
    })
    .unwrap();

    // Boot with the template devices until the kernel has printed its banner, then
    // snapshot into a template directory as `cube template build --engine vm` does.
    let build = root.path().join("build");
    std::fs::create_dir(&build).unwrap();
    let disk = build.join(ROOTFS_FILE);
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let console = Console::default();
    let machine = MachineConfig {
        vcpus: 1,
        memory_bytes: 256 << 20,
        irqchip: true,
    };
    let mut vm = linux_boot::boot_with_devices(
        &Arc::new(KvmContext::open().unwrap()),
        &LinuxBootConfig {
            kernel,
            initrd: None,
            cmdline: "console=ttyS0 earlyprintk=serial,ttyS0 reboot=k panic=-1 nokaslr".into(),
            memory_bytes: machine.memory_bytes,
            vcpus: machine.vcpus,
            cmdline_devices: false,
            kernel_mode: cube_core::vstate::emulation::KernelMode::Native,
        },
        Box::new(console.clone()),
        template_devices(&disk, &build).unwrap(),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !console.0.lock().unwrap().contains("Linux version") {
        assert!(vm.fatal().is_none(), "{:?}", vm.fatal());
        assert!(Instant::now() < deadline, "no banner in 120 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let template = rt.store().template_dir("midboot").unwrap();
    std::fs::create_dir(&template).unwrap();
    vm.pause().unwrap();
    vm.snapshot(&template, None).unwrap();
    drop(vm);
    std::fs::copy(&disk, template.join(ROOTFS_FILE)).unwrap();
    let meta = TemplateMeta {
        name: "midboot".into(),
        engine: Engine::Vm,
        machine,
        rootfs_bytes: 16 << 20,
        created_unix: 0,
        tree: None,
        built_from: None,
    };
    cube_storage::write_atomic(&template.join(TEMPLATE_META), TEMPLATE_META_KIND, &meta).unwrap();

    let mut sandbox = rt.create("midboot", CreateOptions::new(true)).unwrap();
    assert_eq!(sandbox.engine(), Engine::Vm);
    let dir = sandbox.dir().to_path_buf();
    assert!(dir.join("vsock.sock").exists());
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
    assert!(dir.join("console.log").exists());
    sandbox.destroy().unwrap();
    assert!(!dir.exists());
}
