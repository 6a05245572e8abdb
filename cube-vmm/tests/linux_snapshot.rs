//! A Linux guest snapshotted mid-boot and restored into a new VM as a clone: the
//! restored kernel keeps booting from where it stopped (vCPU, irqchip, clock and
//! memory state came back), its virtio device states came back through the snapshot,
//! and the clone's rng moved to a new generation.

#![allow(clippy::unwrap_used)] // helpers of this test file, not library code

use std::sync::Arc;
use std::time::{Duration, Instant};

use cube_devices::virtio::device::VirtioDevice;
use cube_devices::virtio::mmio::regs;
use cube_devices::virtio::rng::Rng;
use cube_vmm::linux_vm::{self, LinuxBootConfig, LinuxVm};
use cube_vmm::testing::{linux_kernel as kernel, wait_for, Console, TEST_CMDLINE};
use cube_vmm::vstate::KvmContext;

fn rng_generation(vm: &LinuxVm) -> u32 {
    let device = &vm.devices().devices()[0];
    let mut data = [0u8; 4];
    device.slot.lock().read(regs::CONFIG, &mut data);
    u32::from_le_bytes(data)
}

/// A 1-vCPU guest with an entropy device, booted from `kernel` until it prints its
/// banner.
fn boot_until_printing(
    ctx: &Arc<KvmContext>,
    kernel: std::path::PathBuf,
    memory_bytes: u64,
) -> (LinuxVm, Console) {
    let config = LinuxBootConfig {
        kernel,
        initrd: None,
        cmdline: TEST_CMDLINE.into(),
        memory_bytes,
        vcpus: 1,
        cmdline_devices: false,
        kernel_mode: cube_vmm::vstate::emulation::KernelMode::Native,
    };
    let console = Console::default();
    let devices: Vec<Box<dyn VirtioDevice>> = vec![Box::new(Rng::new())];
    let vm = linux_vm::boot_with_devices(ctx, &config, Box::new(console.clone()), devices).unwrap();
    wait_for(&vm, &console, "Linux version", Duration::from_secs(120)).unwrap();
    (vm, console)
}

/// A clone restored from `dir` with a fresh entropy device, paused.
fn restore_clone(ctx: &Arc<KvmContext>, dir: &std::path::Path) -> (LinuxVm, Console) {
    let console = Console::default();
    let devices: Vec<Box<dyn VirtioDevice>> = vec![Box::new(Rng::new())];
    let vm = LinuxVm::restore(ctx, dir, Box::new(console.clone()), devices, true).unwrap();
    (vm, console)
}

#[test]
fn a_linux_guest_snapshotted_mid_boot_keeps_booting_as_a_restored_clone() {
    let Some(kernel) = kernel() else { return };
    let ctx = Arc::new(KvmContext::open().unwrap());
    let (mut vm, first) = boot_until_printing(&ctx, kernel, 256 << 20);
    vm.pause().unwrap();
    let dir = tempfile::tempdir().unwrap();
    vm.snapshot(dir.path(), None).unwrap();
    let printed_before = first.text();
    drop(vm);
    assert!(
        !printed_before.contains("Memory:"),
        "the snapshot came too late to prove anything:\n{printed_before}"
    );

    // The test-guest machine refuses it with a clear error.
    #[cfg(feature = "test-guest")]
    {
        let err = cube_vmm::test_guest::machine::Machine::restore(&ctx, dir.path())
            .err()
            .unwrap();
        assert!(err.to_string().contains("Linux guest"), "{err}");
    }

    let (mut clone, second) = restore_clone(&ctx, dir.path());
    assert_ne!(rng_generation(&clone), 0, "the clone's rng moved on");
    clone.resume().unwrap();
    // Printed only after the snapshot point: the kernel went on from where it was.
    wait_for(&clone, &second, "Memory:", Duration::from_secs(180)).unwrap();
    assert!(!second.contains("Linux version"));
}

/// Guest memory, region after region: the layout of a memory file.
fn guest_memory(vm: &LinuxVm) -> Vec<u8> {
    use vm_memory::Bytes;
    let memory = vm.memory();
    let mut out = vec![0u8; memory.total_size() as usize];
    let mut offset = 0;
    for region in memory.regions() {
        memory
            .inner()
            .read_slice(&mut out[offset..offset + region.size], region.guest_addr)
            .unwrap();
        offset += region.size;
    }
    out
}

fn pages_differing(a: &[u8], b: &[u8]) -> usize {
    a.chunks(4096)
        .zip(b.chunks(4096))
        .filter(|(x, y)| x != y)
        .count()
}

#[test]
fn a_running_linux_guest_snapshots_as_diffs_and_a_failed_snapshot_loses_no_page() {
    let Some(kernel) = kernel() else { return };
    let ctx = Arc::new(KvmContext::open().unwrap());
    let memory_bytes = 256u64 << 20;
    let (mut vm, console) = boot_until_printing(&ctx, kernel, memory_bytes);
    let root = tempfile::tempdir().unwrap();
    let first = root.path().join("first");
    std::fs::create_dir(&first).unwrap();
    vm.pause().unwrap();
    vm.snapshot(&first, None).unwrap();
    vm.snapshot_committed(&first).unwrap();
    let first_file = std::fs::read(first.join("memory.bin")).unwrap();
    // Guest memory, without the seal page after it.
    let guest_part = |mut image: Vec<u8>| {
        assert_eq!(image.len() as u64, memory_bytes + cube_mem::SEAL_BYTES);
        image.truncate(memory_bytes as usize);
        image
    };
    let first_image = guest_part(first_file.clone());

    // The guest runs on; a snapshot fails half way (its directory is unusable).
    vm.resume().unwrap();
    std::thread::sleep(Duration::from_millis(700));
    vm.pause().unwrap();
    assert!(vm.snapshot(&root.path().join("missing/dir"), None).is_err());
    // The pages it collected were not written anywhere: the next diff has them.
    vm.resume().unwrap();
    std::thread::sleep(Duration::from_millis(700));
    vm.pause().unwrap();
    let second = root.path().join("second");
    std::fs::create_dir(&second).unwrap();
    let stats = vm.snapshot(&second, None).unwrap();
    vm.snapshot_committed(&second).unwrap();
    let second_image = guest_part(std::fs::read(second.join("memory.bin")).unwrap());
    let live = guest_memory(&vm);
    let printed = console.text();
    assert!(
        vm.fatal().is_none() && !printed.contains("Memory:"),
        "the guest went too far for the test to prove anything:\n{printed}"
    );
    eprintln!(
        "diff snapshot: {} dirty pages, {} bytes written of {} bytes of memory; {} pages differ from the parent",
        stats.dirty_pages,
        stats.bytes_written,
        memory_bytes,
        pages_differing(&first_image, &second_image)
    );
    // The diff image is exactly guest memory, though only the dirty pages were written.
    assert_eq!(second_image.len() as u64, memory_bytes);
    assert!(second_image == live, "the diff image lost guest writes");
    assert!(stats.dirty_pages > 0, "a booting kernel wrote nothing?");
    assert_eq!(stats.bytes_written, stats.dirty_pages * 4096);
    assert!(stats.bytes_written < memory_bytes / 4, "{stats:?}");
    assert!(pages_differing(&first_image, &second_image) as u64 <= stats.dirty_pages);
    // The parent image was never written.
    assert!(std::fs::read(first.join("memory.bin")).unwrap() == first_file);

    // And it restores into a guest that keeps booting from there.
    drop(vm);
    let (mut clone, clone_console) = restore_clone(&ctx, &second);
    clone.resume().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while clone_console.is_empty() {
        assert!(
            clone.fatal().is_none() || !clone_console.is_empty(),
            "{:?}",
            clone.fatal()
        );
        assert!(Instant::now() < deadline, "the clone printed nothing");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the console of `vm` has printed more than `before` bytes.
fn prints_on(vm: &LinuxVm, console: &Console, before: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while console.text().len() <= before {
        assert!(vm.fatal().is_none(), "{what}: {:?}", vm.fatal());
        assert!(Instant::now() < deadline, "{what} printed nothing more");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_running_linux_guest_is_snapshotted_live_and_every_later_write_is_tracked() {
    let Some(kernel) = kernel() else { return };
    let ctx = Arc::new(KvmContext::open().unwrap());
    let memory_bytes = 256u64 << 20;
    let (mut vm, _console) = boot_until_printing(&ctx, kernel, memory_bytes);
    let root = tempfile::tempdir().unwrap();
    let dir = |name: &str| {
        let dir = root.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        dir
    };
    let image = |dir: &std::path::Path| {
        let mut image = std::fs::read(dir.join("memory.bin")).unwrap();
        image.truncate(memory_bytes as usize);
        image
    };
    // A parent to diff against (memory in a memfd: the live copy write-protects).
    let parent = dir("parent");
    vm.pause().unwrap();
    vm.snapshot(&parent, None).unwrap();
    vm.snapshot_committed(&parent).unwrap();
    vm.resume().unwrap();
    std::thread::sleep(Duration::from_millis(500));

    // Taken while the kernel boots on: the vCPUs were stopped, and run again after.
    let live = dir("live");
    let stats = vm.snapshot(&live, None).unwrap();
    assert!(vm.is_running(), "a live snapshot leaves the guest running");
    assert!(stats.paused_us > 0, "{stats:?}");
    vm.snapshot_committed(&live).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // Every page that differs from the live snapshot now was written after its
    // instant and is in the next diff: the snapshot missed none of the writes
    // before it, and the tracking none after.
    vm.pause().unwrap();
    let after = dir("after");
    let next = vm.snapshot(&after, None).unwrap();
    let now = guest_memory(&vm);
    assert!(image(&after) == now, "the stopped diff lost guest writes");
    let changed = pages_differing(&image(&live), &now) as u64;
    eprintln!(
        "live snapshot: paused {} us, {} dirty pages; {changed} pages changed after it, {} tracked",
        stats.paused_us, stats.dirty_pages, next.dirty_pages
    );
    assert!(changed <= next.dirty_pages, "{changed} > {next:?}");
    drop(vm);

    // The live snapshot restores into a guest that boots on; that guest's memory comes
    // from a file (it cannot be write-protected), so its own live snapshot is
    // pre-copied while it runs, and restores too.
    let (mut clone, clone_console) = restore_clone(&ctx, &live);
    assert_ne!(rng_generation(&clone), 0, "the clone's rng moved on");
    clone.resume().unwrap();
    prints_on(&clone, &clone_console, 0, "the clone of the live snapshot");
    let second_live = dir("second-live");
    let stats = clone.snapshot(&second_live, None).unwrap();
    assert!(clone.is_running());
    assert!(stats.bytes_written > 0, "{stats:?}");
    drop(clone);
    let (mut last, last_console) = restore_clone(&ctx, &second_live);
    last.resume().unwrap();
    prints_on(
        &last,
        &last_console,
        0,
        "the clone of the pre-copied snapshot",
    );
}
