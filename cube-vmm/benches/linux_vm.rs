//! Criterion benches of a Linux guest's snapshot (Debian's cloud kernel, 256 MiB, one
//! vCPU, stopped just after its banner), next to the floor it is judged against in
//! the same run: writing the guest's whole memory image, which is what every Linux
//! snapshot cost before they became diffs.
//!
//! ```text
//! scripts/fetch-kernel.sh                       # once: the kernel into the store
//! cargo bench -p cube-vmm --bench linux_vm -- --quick
//! ```
//!
//! The images are written under `$CUBE_BENCH_STORE` (CI points it at a
//! reflink-capable XFS mount), else the system temporary directory. Each diff snapshot
//! is taken after the VMM wrote [`DIRTY_PAGES`] pages of the (paused) guest's memory,
//! off the clock; the guest never runs again, so what is written there is never read.

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode};
use vm_memory::{Bytes, GuestAddress};

use cube_devices::virtio::device::VirtioDevice;
use cube_devices::virtio::rng::Rng;
use cube_vmm::linux_vm::{self, LinuxBootConfig, LinuxVm};
use cube_vmm::testing::{linux_kernel, wait_for, Console, TEST_CMDLINE};
use cube_vmm::vstate::KvmContext;

/// Directory the images' temporary directory is created in, when set.
const STORE_ENV: &str = "CUBE_BENCH_STORE";
/// Guest RAM.
const MEMORY_BYTES: u64 = 256 << 20;
/// Pages written into guest memory before each timed diff snapshot (1 MiB).
const DIRTY_PAGES: u64 = 256;
/// Where those pages are, in guest physical memory (above what the kernel touched).
const DIRTY_AT: u64 = 192 << 20;

/// Boots the kernel until its banner and pauses it there.
fn paused_guest(kernel: PathBuf) -> LinuxVm {
    let ctx = Arc::new(KvmContext::open().unwrap_or_else(|e| panic!("opening KVM: {e}")));
    let console = Console::default();
    let devices: Vec<Box<dyn VirtioDevice>> = vec![Box::new(Rng::new())];
    let config = LinuxBootConfig {
        kernel,
        initrd: None,
        cmdline: TEST_CMDLINE.into(),
        memory_bytes: MEMORY_BYTES,
        vcpus: 1,
        cmdline_devices: false,
        kernel_mode: cube_vmm::vstate::emulation::KernelMode::Native,
    };
    let mut vm = linux_vm::boot_with_devices(&ctx, &config, Box::new(console.clone()), devices)
        .unwrap_or_else(|e| panic!("booting: {e}"));
    wait_for(&vm, &console, "Linux version", Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("the guest's banner: {e}"));
    vm.pause().unwrap_or_else(|e| panic!("pausing: {e}"));
    vm
}

fn main() {
    let Some(kernel) = linux_kernel() else { return };
    let base = std::env::var_os(STORE_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(&base)
        .unwrap_or_else(|e| panic!("a temporary directory in {}: {e}", base.display()));
    let mut vm = paused_guest(kernel);
    // The parent image every diff starts from: the first snapshot after boot.
    let mut parent = dir.path().join("parent");
    std::fs::create_dir(&parent).unwrap_or_else(|e| panic!("{e}"));
    vm.snapshot(&parent, None)
        .and_then(|_| Ok(vm.snapshot_committed(&parent)?))
        .unwrap_or_else(|e| panic!("first snapshot: {e}"));

    let mut criterion = Criterion::default().configure_from_args();
    let mut group = criterion.benchmark_group("linux_guest_256mib");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(4));
    let mut round = 0u64;
    let mut full_times = Vec::new();
    let mut diff_times = Vec::new();
    group.bench_function("floor_full_memory_image", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                round += 1;
                let image = dir.path().join(format!("full-{round}"));
                let start = Instant::now();
                let written = cube_mem::memory_file::write_full(
                    &image,
                    vm.memory(),
                    None,
                    &cube_mem::Seal([0; 16]),
                    cube_storage::Durability::Deferred,
                );
                let took = start.elapsed();
                total += took;
                full_times.push(took);
                black_box(written.unwrap_or_else(|e| panic!("full image: {e}")));
                let _ = std::fs::remove_file(&image);
            }
            total
        });
    });
    group.bench_function(format!("diff_snapshot_{DIRTY_PAGES}_dirty_pages"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                round += 1;
                let page = vec![round as u8; 4096];
                for n in 0..DIRTY_PAGES {
                    vm.memory()
                        .inner()
                        .write_slice(&page, GuestAddress(DIRTY_AT + n * 4096))
                        .unwrap_or_else(|e| panic!("dirtying: {e}"));
                }
                let next = dir.path().join(format!("snap-{round}"));
                std::fs::create_dir(&next).unwrap_or_else(|e| panic!("{e}"));
                let start = Instant::now();
                let stats = vm.snapshot(&next, None);
                let took = start.elapsed();
                total += took;
                diff_times.push(took);
                let stats = stats.unwrap_or_else(|e| panic!("diff snapshot: {e}"));
                assert_eq!(stats.dirty_pages, DIRTY_PAGES);
                vm.snapshot_committed(&next)
                    .unwrap_or_else(|e| panic!("commit: {e}"));
                let _ = std::fs::remove_dir_all(&parent);
                parent = next;
            }
            total
        });
    });
    group.finish();
    criterion.final_summary();
    let (full, diff) = (percentiles(&mut full_times), percentiles(&mut diff_times));
    println!(
        "linux guest 256 MiB, {DIRTY_PAGES} dirty pages, images in {}: full image p50 {:?} \
         p95 {:?}; diff snapshot p50 {:?} p95 {:?}; diff/full at p50 {:.2}x",
        base.display(),
        full.0,
        full.1,
        diff.0,
        diff.1,
        diff.0.as_secs_f64() / full.0.as_secs_f64().max(f64::MIN_POSITIVE)
    );
}

/// p50 and p95 of `times` (zero when empty).
fn percentiles(times: &mut [Duration]) -> (Duration, Duration) {
    times.sort();
    let at = |q: f64| {
        times
            .get(((times.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or_default()
    };
    (at(0.5), at(0.95))
}
