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

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cube_agent::protocol::ExecRequest;
use cube_core::devices::virtio::block::{Block, BlockOptions};
use cube_core::devices::virtio::device::VirtioDevice;
use cube_core::devices::virtio::rng::Rng;
use cube_core::devices::virtio::vsock::Vsock;
use cube_core::vm_agent::{agent_client, VmAgentError};
use cube_core::vmm::linux_boot::{self, LinuxBootConfig};
use cube_core::vstate::emulation::KernelMode;
use cube_core::vstate::KvmContext;

/// How long the boot may take before the test gives up: a bound on a hang, not a
/// timing assertion (emulated, this boot takes about a minute here).
const BOOT_LIMIT: Duration = Duration::from_secs(900);

fn guest_kernel() -> Option<PathBuf> {
    if !std::path::Path::new("/dev/kvm").exists() {
        println!("skipped: /dev/kvm not present");
        return None;
    }
    let path = match std::env::var_os("CUBE_GUEST_KERNEL") {
        Some(p) => PathBuf::from(p),
        None => {
            PathBuf::from(std::env::var_os("CUBE_HOME").unwrap_or_else(|| "/var/lib/cube".into()))
                .join(cube_core::vm_template::CUBE_GUEST_KERNEL)
                .join("vmlinux")
        }
    };
    if !path.is_file() {
        println!(
            "skipped: no guest kernel at {} (scripts/build-guest-kernel.sh builds it)",
            path.display()
        );
        return None;
    }
    Some(path)
}

/// The console, kept whole for the assertions and the timeline.
#[derive(Clone, Default)]
struct Console(Arc<Mutex<Vec<u8>>>);

impl Write for Console {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Console {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[test]
fn cubes_kernel_boots_from_its_root_disk_and_its_agent_runs_a_command() {
    let Some(kernel) = guest_kernel() else {
        return;
    };
    let agent = match cube_core::supervisor::jail_sandbox::locate_agent() {
        Ok(agent) => agent,
        Err(e) => {
            println!("skipped: no cube-agent binary ({e})");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("tree");
    std::fs::create_dir_all(tree.join("etc")).unwrap();
    std::fs::write(tree.join("etc/marker"), "from the root disk\n").unwrap();
    let image = dir.path().join("rootfs.img");
    cube_core::vm_template::make_root_image(&tree, &agent, &image).unwrap();
    let vsock_dir = dir.path().join("vsock");
    std::fs::create_dir(&vsock_dir).unwrap();
    let devices: Vec<Box<dyn VirtioDevice>> = vec![
        Box::new(Block::open(&image, BlockOptions::default()).unwrap()),
        Box::new(Vsock::new(3, &vsock_dir).unwrap()),
        Box::new(Rng::new()),
    ];
    let mode = cube_core::host_caps::linux_kernel_mode().unwrap_or(KernelMode::Native);
    let config = LinuxBootConfig {
        kernel,
        initrd: None,
        cmdline: cube_core::vm_template::ROOT_DISK_CMDLINE.into(),
        memory_bytes: 256 << 20,
        vcpus: 1,
        cmdline_devices: false,
        kernel_mode: mode,
    };
    let ctx = Arc::new(KvmContext::open().unwrap());
    let console = Console::default();
    let started = Instant::now();
    let vm = linux_boot::boot_with_devices(&ctx, &config, Box::new(console.clone()), devices)
        .unwrap();
    let client = loop {
        if let Some(why) = vm.fatal() {
            panic!("the guest stopped: {why}\nconsole:\n{}", console.text());
        }
        assert!(
            started.elapsed() < BOOT_LIMIT,
            "no agent within {BOOT_LIMIT:?}\nconsole:\n{}",
            console.text()
        );
        match agent_client(&vsock_dir, Duration::from_millis(500)) {
            Ok(client) => break client,
            Err(VmAgentError::NotReady { .. } | VmAgentError::NoSocket(..)) => {}
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
    let text = console.text();
    // The kernel found the disk and the vsock device through the ACPI DSDT and
    // started the agent from the image.
    assert!(text.contains("Run /.cube/cube-agent as init process"), "{text}");
    assert!(text.contains("Linux version 6."), "{text}");
    if mode == KernelMode::Emulated {
        // The kernel's int3 self-test ran through the VMM.
        assert!(assists.breakpoints >= 1, "{assists:?}");
    }
}
