//! What the Linux VM sandbox tests share: a runtime whose store holds a template made
//! of Debian's kernel, booted with a VM template's devices and snapshotted right after
//! its banner. (The kernel lookup and console capture are the VMM's test helpers,
//! shared with its own tests.)

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cube_core::store::TemplateDir;
use cube_core::templates::MachineConfig;
use cube_core::{Engine, Runtime, RuntimeConfig, TemplateMeta};
use cube_supervisor::vm_devices::template_devices;
use cube_vmm::linux_vm::{self, LinuxBootConfig};
use cube_vmm::testing::{wait_for, Console, TEST_CMDLINE};
use cube_vmm::vstate::KvmContext;

pub use cube_vmm::testing::linux_kernel;

/// Guest RAM of the template.
pub const MEMORY_BYTES: u64 = 256 << 20;
/// The template's root disk, bytes.
pub const DISK_BYTES: u64 = 16 << 20;
/// The template's name.
pub const TEMPLATE: &str = "midboot";

/// A runtime on a fresh store under `root` holding template [`TEMPLATE`]: `kernel`
/// with a VM template's devices (its disk included in the snapshot), snapshotted as
/// soon as it printed its banner.
pub fn runtime_with_midboot_template(kernel: PathBuf, root: &Path) -> Runtime {
    // Searched by others, as `/var/lib` is: a confined VM supervisor reaches its
    // sandbox's directory by path, with no capability (under a directory closed to it,
    // it would keep `dac_read_search`).
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711)).unwrap();
    let rt = Runtime::open(RuntimeConfig {
        store_root: root.join("store"),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: Some(super::supervisor()),
    })
    .unwrap();
    let build = TemplateDir::new(root.join("build"));
    std::fs::create_dir(&build).unwrap();
    let disk = build.image().rootfs();
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(DISK_BYTES)
        .unwrap();
    let console = Console::default();
    let machine = MachineConfig {
        vcpus: 1,
        memory_bytes: MEMORY_BYTES,
        irqchip: true,
    };
    let mut vm = linux_vm::boot_with_devices(
        &Arc::new(KvmContext::open().unwrap()),
        &LinuxBootConfig {
            kernel,
            initrd: None,
            cmdline: TEST_CMDLINE.into(),
            memory_bytes: machine.memory_bytes,
            vcpus: machine.vcpus,
            cmdline_devices: false,
            kernel_mode: cube_vmm::vstate::emulation::KernelMode::Native,
        },
        Box::new(console.clone()),
        template_devices(&disk, &build.build_vsock_socket()).unwrap(),
    )
    .unwrap();
    wait_for(&vm, &console, "Linux version", Duration::from_secs(120)).unwrap();
    vm.pause().unwrap();
    let template = rt.store().template(TEMPLATE).unwrap();
    std::fs::create_dir(&template).unwrap();
    vm.snapshot(&template, Some(&disk)).unwrap();
    drop(vm);
    let meta = TemplateMeta {
        name: TEMPLATE.into(),
        engine: Engine::Vm,
        machine,
        rootfs_bytes: DISK_BYTES,
        created_unix: 0,
        tree: None,
        built_from: None,
        process: None,
    };
    cube_storage::write_atomic(&template.record(), TemplateDir::RECORD_KIND, &meta).unwrap();
    rt
}
