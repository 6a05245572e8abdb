//! Cube's own guest kernel (`scripts/build-guest-kernel.sh`) booted in Cube's VMM the
//! way a VM template boots it: no initramfs, an ext4 root disk made by
//! `make_root_image` with the agent in it, the agent started by the kernel as PID 1,
//! vsock and rng devices found through the ACPI tables. The test then reaches the
//! agent over vsock and runs a command in the guest through it.
//!
//! On PVM hosts the kernel runs emulated (the host probe chooses it), with the VMM
//! finishing the `int3` and `fwait` its emulator gives up on: this boot is the proof
//! that Cube's Linux path works there. Skipped, saying why, without `/dev/kvm`, without
//! the kernel (`CUBE_GUEST_KERNEL` or the store's `kernels/cube-guest/vmlinux`), or
//! without the agent binary.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cube_agent::protocol::ExecRequest;
use cube_storage::TemplateDir;
use cube_supervisor::templates::image_agent;
use cube_supervisor::templates::vm::{make_root_image, ROOT_DISK_CMDLINE};
use cube_supervisor::vm_agent::{agent_client, VmAgentError};
use cube_supervisor::vm_devices::template_devices;
use cube_vmm::linux_vm::{self, LinuxBootConfig};
use cube_vmm::testing::{cube_guest_kernel, Console};
use cube_vmm::vstate::emulation::KernelMode;
use cube_vmm::vstate::KvmContext;

/// How long the boot may take before the test gives up: a bound on a hang, not a
/// timing assertion (emulated, this boot takes about half a minute here).
const BOOT_LIMIT: Duration = Duration::from_secs(900);

#[test]
fn cubes_kernel_boots_from_its_root_disk_and_its_agent_runs_a_command() {
    let Some(kernel) = cube_guest_kernel() else {
        return;
    };
    let agent = match image_agent::locate() {
        Ok(agent) => agent,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("tree");
    std::fs::create_dir_all(tree.join("etc")).unwrap();
    std::fs::write(tree.join("etc/marker"), "from the root disk\n").unwrap();
    let template = TemplateDir::new(dir.path().join("template"));
    std::fs::create_dir_all(template.image().rootfs().parent().unwrap()).unwrap();
    let image = template.image().rootfs();
    make_root_image(&tree, &agent, &image).unwrap();
    let vsock = template.build_vsock_socket();
    // A VM template's devices: root disk, vsock, rng and an unplugged NIC.
    let devices = template_devices(&image, &vsock).unwrap();
    let mode = KernelMode::of_this_host().unwrap_or(KernelMode::Native);
    let config = LinuxBootConfig {
        kernel,
        initrd: None,
        cmdline: ROOT_DISK_CMDLINE.into(),
        memory_bytes: 256 << 20,
        vcpus: 1,
        cmdline_devices: false,
        kernel_mode: mode,
    };
    let ctx = Arc::new(KvmContext::open().unwrap());
    let console = Console::default();
    let started = Instant::now();
    let vm =
        linux_vm::boot_with_devices(&ctx, &config, Box::new(console.clone()), devices).unwrap();
    let client = loop {
        if let Some(why) = vm.fatal() {
            panic!("the guest stopped: {why}\nconsole:\n{}", console.text());
        }
        assert!(
            started.elapsed() < BOOT_LIMIT,
            "no agent within {BOOT_LIMIT:?}\nconsole:\n{}",
            console.text()
        );
        match agent_client(&vsock, Duration::from_millis(500)) {
            Ok(client) => break client,
            // Still booting: the guest's kernel resets a connection to a port nothing
            // listens on yet, or does not answer at all.
            Err(
                VmAgentError::NotReady { .. }
                | VmAgentError::NoSocket(..)
                | VmAgentError::Refused(_),
            ) => {}
            Err(e) => panic!("reaching the agent: {e}"),
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let ready = started.elapsed();
    let out = client
        .exec(ExecRequest {
            // The only program in the image: the agent, asked for its usage.
            argv: vec!["/.cube/cube-agent".into(), "--help".into()],
            env: Vec::new(),
            cwd: Some("/etc".into()),
            user: None,
            stdin: Vec::new(),
            timeout_ms: Some(120_000),
            background: false,
        })
        .unwrap();
    let mut marker = Vec::new();
    client.read_file("/etc/marker", &mut marker).unwrap();
    assert_eq!(marker, b"from the root disk\n");
    let assists = vm.assists();
    println!(
        "{mode:?} kernel: agent ready after {:.1} s, exec answered after {:.1} s; \
         the VMM finished {} int3 and {} fwait",
        ready.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        assists.breakpoints,
        assists.fwaits
    );
    // A process started in the guest printed its usage and exited with 2.
    assert_eq!(out.exit.code, Some(2), "{out:?}");
    let usage = String::from_utf8_lossy(&out.stderr);
    assert!(usage.contains("usage: cube-agent"), "{usage}");
    // The kernel found the disk and the vsock device through the ACPI DSDT and
    // started the agent from the image as PID 1 (`quiet`: the kernel's own lines
    // below warnings stay off the console, the agent's log does not).
    let text = console.text();
    assert!(
        text.contains("cube-agent starting") && text.contains("pid1") && text.contains("true"),
        "{text}"
    );
    assert!(text.contains("listening on vsock"), "{text}");
    if mode == KernelMode::Emulated {
        // The kernel's int3 self-test ran through the VMM.
        assert!(assists.breakpoints >= 1, "{assists:?}");
    }
}
