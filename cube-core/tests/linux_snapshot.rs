//! A Linux guest snapshotted mid-boot and restored into a new VM as a clone: the
//! restored kernel keeps booting from where it stopped (vCPU, irqchip, clock and
//! memory state came back), its virtio device states came back through the snapshot,
//! and the clone's rng moved to a new generation.

#![allow(clippy::unwrap_used)] // helpers of this test file, not library code

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cube_core::devices::virtio::device::VirtioDevice;
use cube_core::devices::virtio::mmio::regs;
use cube_core::devices::virtio::rng::Rng;
use cube_core::vmm::linux_boot::{self, LinuxBootConfig, LinuxVm};
use cube_core::vstate::KvmContext;

/// The kernel `scripts/fetch-kernel.sh` unpacks into the store.
fn kernel() -> Option<PathBuf> {
    let path =
        PathBuf::from(std::env::var_os("CUBE_HOME").unwrap_or_else(|| "/var/lib/cube".into()))
            .join("kernels/debian-cloud/vmlinux");
    if !std::path::Path::new("/dev/kvm").exists() {
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

fn wait_for(vm: &LinuxVm, console: &Console, text: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !console.0.lock().unwrap().contains(text) {
        if let Some(reason) = vm.fatal() {
            panic!(
                "VM stopped before {text:?}: {reason}\n{}",
                console.0.lock().unwrap()
            );
        }
        assert!(
            Instant::now() < deadline,
            "no {text:?} within {limit:?}:\n{}",
            console.0.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn rng_generation(vm: &LinuxVm) -> u32 {
    let device = &vm.devices().devices()[0];
    let mut data = [0u8; 4];
    device.slot.lock().read(regs::CONFIG, &mut data);
    u32::from_le_bytes(data)
}

#[test]
fn a_linux_guest_snapshotted_mid_boot_keeps_booting_as_a_restored_clone() {
    let Some(kernel) = kernel() else { return };
    let ctx = Arc::new(KvmContext::open().unwrap());
    let config = LinuxBootConfig {
        kernel,
        initrd: None,
        cmdline: "console=ttyS0 earlyprintk=serial,ttyS0 reboot=k panic=-1 nokaslr".into(),
        memory_bytes: 256 << 20,
        vcpus: 1,
        cmdline_devices: false,
    };
    let first = Console::default();
    let devices: Vec<Box<dyn VirtioDevice>> = vec![Box::new(Rng::new())];
    let mut vm =
        linux_boot::boot_with_devices(&ctx, &config, Box::new(first.clone()), devices).unwrap();
    wait_for(&vm, &first, "Linux version", Duration::from_secs(120));
    vm.pause().unwrap();
    let dir = tempfile::tempdir().unwrap();
    vm.snapshot(dir.path(), None).unwrap();
    let printed_before = first.0.lock().unwrap().clone();
    drop(vm);
    assert!(
        !printed_before.contains("Memory:"),
        "the snapshot came too late to prove anything:\n{printed_before}"
    );

    // The test-guest machine refuses it with a clear error.
    let err = cube_core::vmm::machine::Machine::restore(&ctx, dir.path())
        .err()
        .unwrap();
    assert!(err.to_string().contains("Linux guest"), "{err}");

    let second = Console::default();
    let devices: Vec<Box<dyn VirtioDevice>> = vec![Box::new(Rng::new())];
    let clone =
        LinuxVm::restore(&ctx, dir.path(), Box::new(second.clone()), devices, true).unwrap();
    assert_ne!(rng_generation(&clone), 0, "the clone's rng moved on");
    clone.resume().unwrap();
    // Printed only after the snapshot point: the kernel went on from where it was.
    wait_for(&clone, &second, "Memory:", Duration::from_secs(180));
    assert!(!second.0.lock().unwrap().contains("Linux version"));
}
