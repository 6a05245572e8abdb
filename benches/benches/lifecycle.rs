//! Criterion benches of the sandbox lifecycle on the reference spec (2 vCPU, 2 GiB,
//! in-kernel irqchip, synthetic test guest), next to the floor they are judged
//! against, measured in the same run: a bare KVM VM with Cube's memslot shape.
//!
//! Run (the supervisor binary is not built by `cargo bench` of this package):
//!
//! ```text
//! cargo build --release -p cube-supervisor --bins
//! cargo bench -p cube-benches                 # full run
//! cargo bench -p cube-benches -- --quick      # about a minute on 2 cores
//! ```
//!
//! The supervisor is `$CUBE_SUPERVISOR`, else `target/release/cube-supervisor`, which
//! `cube_core::testing::supervisor_binary` finds one directory above the bench
//! executable (`target/release/deps/`). The store is a fresh temporary directory under
//! `$CUBE_BENCH_STORE` (CI points it at a reflink-capable XFS mount), else under the
//! system temporary directory; it is removed at the end.
//!
//! Only the operation named by a bench is timed: dirtying guest memory before a
//! snapshot or rollback, waiting for the guest to settle afterwards, destroying
//! sandboxes and removing snapshots all happen off the clock.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, SamplingMode};

use cube_core::error_report::chain;
use cube_core::store::{filesystem_name, flushed_in_this_boot, SandboxDir};
use cube_core::templates::{MachineConfig, WorkingSet};
use cube_core::testing::floor::BareVm;
use cube_core::testing::{supervisor_binary, TestGuestControl};
use cube_core::{CreateOptions, Runtime, RuntimeConfig, Sandbox};

/// Directory the store's temporary directory is created in, when set.
const STORE_ENV: &str = "CUBE_BENCH_STORE";
/// MiB the guest dirties before each timed dirty snapshot and rollback.
const DIRTY_MIB: u64 = 16;
/// Longest wait for a snapshot's background flush.
const DURABLE_TIMEOUT: Duration = Duration::from_secs(120);
/// Every sandbox here ends with its handle, even if the bench panics.
const EPHEMERAL: CreateOptions = CreateOptions::new(true);

/// A bench cannot go on after a failed operation: stop with the whole error chain.
fn check<T, E: std::error::Error>(what: &str, result: Result<T, E>) -> T {
    match result {
        Ok(v) => v,
        Err(e) => panic!("{what} failed: {}", chain(&e)),
    }
}

/// A sandbox that is destroyed when the bench leaves its scope, panics included.
struct Live(Option<Sandbox>);

impl Live {
    fn get(&mut self) -> &mut Sandbox {
        match self.0.as_mut() {
            Some(sb) => sb,
            None => unreachable!("a Live sandbox is only emptied by drop"),
        }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        if let Some(sb) = self.0.take() {
            let id = sb.id().to_string();
            if let Err(e) = sb.destroy() {
                eprintln!("destroying sandbox {id}: {}", chain(&e));
            }
        }
    }
}

/// The store, the runtime and the template every bench starts from.
///
/// Field order is drop order: the runtime (and its idle supervisors) goes before the
/// store directory is removed.
struct Fixture {
    rt: Runtime,
    template: String,
    machine: MachineConfig,
    _store: tempfile::TempDir,
}

impl Fixture {
    fn open(supervisor: PathBuf) -> Fixture {
        let base = std::env::var_os(STORE_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let store = check(
            "creating the bench store",
            tempfile::Builder::new()
                .prefix("cube-bench-")
                .tempdir_in(&base),
        );
        let rt = check(
            "opening the runtime",
            Runtime::open(RuntimeConfig {
                store_root: store.path().to_path_buf(),
                pool_size: 2,
                network_pool_size: 0,
                supervisor: Some(supervisor),
            }),
        );
        let machine = MachineConfig::default();
        let template = format!("bench-{}", std::process::id());
        check(
            "building the test template",
            rt.build_test_template(&template, machine, WorkingSet::default(), 0),
        );
        wait_durable(&check("template dir", rt.store().template_dir(&template)));
        eprintln!(
            "store: {} ({}, reflink: {})",
            store.path().display(),
            filesystem_name(store.path()).unwrap_or_default(),
            rt.store().supports_reflink().unwrap_or(false)
        );
        Fixture {
            rt,
            template,
            machine,
            _store: store,
        }
    }

    /// A sandbox from the template whose guest has settled.
    fn settled_sandbox(&self) -> Live {
        let mut sb = Live(Some(check(
            "create",
            self.rt.create(&self.template, EPHEMERAL),
        )));
        check(
            "waiting for the working set",
            sb.get().guest_wait_working_set(),
        );
        sb
    }

    fn template_memory(&self) -> PathBuf {
        check("template dir", self.rt.store().template(&self.template))
            .image()
            .memory()
    }

    /// Removes a snapshot once its background flush is done.
    fn remove_snapshot(&self, id: &str) {
        let dir = check("snapshot dir", self.rt.store().snapshot_dir(id));
        wait_durable(&dir);
        check("removing a snapshot", self.rt.store().remove_snapshot(id));
    }

    fn snapshots(&self) -> HashSet<String> {
        check("listing snapshots", self.rt.store().list_snapshots())
            .into_iter()
            .collect()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Err(e) = self.rt.remove_template(&self.template) {
            eprintln!("removing template {}: {}", self.template, chain(&e));
        }
    }
}

/// Waits until the background flush of the snapshot (or hibernation image) in `dir`
/// has finished, so it neither competes with the next timed operation for the disk nor
/// races the removal of the directory.
fn wait_durable(dir: &Path) {
    let start = Instant::now();
    while !flushed_in_this_boot(dir) {
        if start.elapsed() > DURABLE_TIMEOUT {
            panic!(
                "{} was not flushed within {DURABLE_TIMEOUT:?}",
                dir.display()
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Runs `op` and says how long it took.
fn timed<T>(op: impl FnOnce() -> T) -> (Duration, T) {
    let start = Instant::now();
    let value = op();
    (start.elapsed(), value)
}

fn bench_floor(group: &mut BenchmarkGroup<'_, WallTime>, fx: &Fixture) {
    let floor = BareVm::open(&fx.template_memory(), fx.machine.vcpus, fx.machine.irqchip)
        .unwrap_or_else(|e| panic!("the bare VM floor: {e}"));
    group.bench_function("floor_bare_kvm_vm", |b| {
        b.iter(|| {
            if let Err(e) = floor.cycle() {
                panic!("bare KVM VM failed: {e}");
            }
        });
    });
}

fn bench_create(group: &mut BenchmarkGroup<'_, WallTime>, fx: &Fixture) {
    group.bench_function("create_from_template", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                // Steady state: the pool has a supervisor ready, as between bursts.
                fx.rt.wait_pool_ready();
                let (took, created) = timed(|| fx.rt.create(&fx.template, EPHEMERAL));
                total += took;
                drop(Live(Some(check("create", created))));
            }
            total
        });
    });
}

fn bench_snapshot(group: &mut BenchmarkGroup<'_, WallTime>, fx: &Fixture) {
    let mut live = fx.settled_sandbox();
    let sb = live.get();
    // The first snapshot carries the guest's start-up writes; the benches start clean.
    let first = check("snapshot", sb.snapshot());
    fx.remove_snapshot(&first.id);

    group.bench_function("snapshot_clean", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let (took, snap) = timed(|| sb.snapshot());
                total += took;
                fx.remove_snapshot(&check("snapshot", snap).id);
            }
            total
        });
    });

    let mut pattern = 0u64;
    group.bench_function(format!("snapshot_{DIRTY_MIB}mib_dirty"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                pattern += 1;
                check("guest dirty", sb.guest_dirty(DIRTY_MIB, pattern));
                let (took, snap) = timed(|| sb.snapshot());
                total += took;
                fx.remove_snapshot(&check("snapshot", snap).id);
            }
            total
        });
    });
}

fn bench_rollback(group: &mut BenchmarkGroup<'_, WallTime>, fx: &Fixture) {
    let mut live = fx.settled_sandbox();
    let sb = live.get();
    let base = check("snapshot", sb.snapshot());
    wait_durable(&base.dir);
    let mut pattern = 0u64;
    group.bench_function(format!("rollback_after_{DIRTY_MIB}mib_dirty"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                pattern += 1;
                check("guest dirty", sb.guest_dirty(DIRTY_MIB, pattern));
                let (took, rolled) = timed(|| sb.rollback(&base.id));
                total += took;
                check("rollback", rolled);
                // The restored guest touches its working set again: let it finish.
                check("waiting for the working set", sb.guest_wait_working_set());
            }
            total
        });
    });
}

fn bench_clone(group: &mut BenchmarkGroup<'_, WallTime>, fx: &Fixture) {
    let mut live = fx.settled_sandbox();
    let source = live.get();
    group.bench_function("clone_1", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                fx.rt.wait_pool_ready();
                let before = fx.snapshots();
                let (took, cloned) = timed(|| fx.rt.clone_sandbox(source, 1, 1, EPHEMERAL));
                total += took;
                drop(
                    check("clone", cloned)
                        .into_iter()
                        .map(|c| Live(Some(c)))
                        .collect::<Vec<_>>(),
                );
                // clone_sandbox does not name the snapshot it took: it is the new one.
                for id in fx.snapshots().difference(&before) {
                    fx.remove_snapshot(id);
                }
            }
            total
        });
    });
}

fn bench_pause_resume(group: &mut BenchmarkGroup<'_, WallTime>, fx: &Fixture) {
    let mut live = fx.settled_sandbox();
    let sb = live.get();
    group.bench_function("pause_resume", |b| {
        b.iter(|| {
            check("pause", sb.pause());
            check("resume", sb.resume());
        });
    });
}

fn bench_hibernate_wake(group: &mut BenchmarkGroup<'_, WallTime>, fx: &Fixture) {
    let mut live = fx.settled_sandbox();
    let sb = live.get();
    group.bench_function("hibernate_wake", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let (took, done) = timed(|| sb.hibernate().and_then(|()| sb.wake()));
                total += took;
                check("hibernate and wake", done);
                wait_durable(&SandboxDir::new(sb.dir()).hibernation());
                check("waiting for the working set", sb.guest_wait_working_set());
            }
            total
        });
    });
}

fn main() {
    if !Path::new("/dev/kvm").exists() {
        println!("skipped: /dev/kvm not present");
        return;
    }
    let supervisor = match supervisor_binary() {
        Ok(path) => path,
        Err(e) => {
            eprintln!(
                "{}\nbuild it first: cargo build --release -p cube-core --bins \
                 (or set CUBE_SUPERVISOR)",
                chain(&e)
            );
            std::process::exit(2);
        }
    };
    let mut criterion = Criterion::default().configure_from_args();
    {
        let fx = Fixture::open(supervisor);
        let mut group = criterion.benchmark_group("sandbox_2vcpu_2gib");
        // Every operation takes milliseconds and sets up for longer: few, equal samples.
        // In --quick mode criterion stops at measurement_time (plus one doubling).
        group
            .sample_size(10)
            .sampling_mode(SamplingMode::Flat)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(4));
        bench_floor(&mut group, &fx);
        bench_create(&mut group, &fx);
        bench_snapshot(&mut group, &fx);
        bench_rollback(&mut group, &fx);
        bench_clone(&mut group, &fx);
        bench_pause_resume(&mut group, &fx);
        bench_hibernate_wake(&mut group, &fx);
        group.finish();
    }
    criterion.final_summary();
}
