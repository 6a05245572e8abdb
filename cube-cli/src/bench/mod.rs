//! `cube bench`: CubeSandbox's benchmark tables, reproduced on this host with Cube's
//! test guest, next to floors measured in the same run.

mod html_report;
mod interrupt;
mod jail;
mod linux_guest;
mod network;
mod report;
mod scaling;
mod serve;
mod stats;

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use cube_core::store::{filesystem_name, flushed_in_this_boot, supports_reflink};
use cube_core::templates::{MachineConfig, WorkingSet};
use cube_core::testing::{floor, max_dirty_mib, TestGuestControl};
use cube_core::{CreateOptions, Runtime, RuntimeConfig, Sandbox};

use crate::cli_error::CliError;
use crate::store_cmd::store_root;
use interrupt::remove_on_interrupt;
use report::{create_table, failed, progress, progress_done, table, CloneRow, CreateRow, Target};
use stats::{percentiles_ms, round2};

/// Options of `cube bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Fewer repeats and sizes: finishes within about a minute on 2 cores.
    #[arg(long)]
    quick: bool,
    /// Print JSON instead of markdown tables.
    #[arg(long)]
    json: bool,
    /// Engine to measure.
    #[arg(long, default_value = "vm", value_parser = ["vm", "jail"])]
    engine: String,
    /// Measure networking instead: attach times from the pool, and TCP through
    /// Cube's eBPF NAT against a plain veth path, in namespaces of its own.
    #[arg(long)]
    network: bool,
    /// Measure `cube serve` instead: creates through its HTTP API against library
    /// creates in the same run (p50/p95, the overhead), and 50 API creates at once.
    #[arg(long)]
    serve: bool,
    /// Guest memory in MiB (the reference spec is 2 GiB).
    #[arg(long, default_value_t = 2048)]
    memory_mib: u64,
    /// vCPUs (the reference spec is 2).
    #[arg(long, default_value_t = 2)]
    vcpus: u8,
    /// Guest of the vm engine: Cube's synthetic test guest, or Linux with the agent
    /// (skipped, with the reason recorded, where no Linux guest can run).
    #[arg(long, default_value = "test", value_parser = ["test", "linux"])]
    guest: String,
    /// Guest kernel for --guest linux (a PVM-enabled one on PVM hosts).
    #[arg(long, value_name = "PATH")]
    kernel: Option<std::path::PathBuf>,
    /// Measure scaling instead (CubeSandbox's §3.2 and §3.3) for --engine: creates at
    /// concurrency 1 to 64 and the memory of 100 and 500 idle sandboxes. Not part of
    /// --quick: a few minutes on a 2-core host (3 for the VM engine, 15 s for jails here).
    #[arg(long)]
    scaling: bool,
    /// Concurrency levels for --scaling (each at least 1).
    #[arg(
        long,
        value_delimiter = ',',
        default_values_t = scaling::LEVELS.to_vec(),
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    levels: Vec<usize>,
    /// Sandbox counts of the density rows for --scaling (0: none).
    #[arg(long, value_delimiter = ',', default_values_t = scaling::DENSITY.to_vec())]
    density: Vec<usize>,
    /// Write an HTML page of charts into DIR (index.html, openable offline) from the
    /// JSON reports of earlier runs: the --input files, else every *.json in DIR.
    /// Runs no benchmark.
    #[arg(long, value_name = "DIR")]
    report: Option<std::path::PathBuf>,
    /// A `cube bench --json` report for --report (repeatable).
    #[arg(long, value_name = "FILE", requires = "report")]
    input: Vec<std::path::PathBuf>,
}

#[derive(Serialize)]
struct SizeRow {
    memory_mib: u64,
    n: usize,
    p50_ms: f64,
    p95_ms: f64,
}

/// Creates timed from each snapshot of the dirty-memory series: a create is ~5 ms on
/// this host, and with 5 the largest-against-clean median ratio read 0.53-2.1 across
/// runs.
const CREATES_PER_SNAPSHOT: usize = 15;

#[derive(Serialize)]
struct SnapshotRow {
    dirty_mib: u64,
    /// p50 over `snapshot_n` snapshots, each after the same pages were dirtied again.
    snapshot_ms: f64,
    snapshot_n: usize,
    /// How long the sandbox was stopped for the snapshot, p50 (see
    /// [`Report::source_paused_means`]).
    source_paused_ms: f64,
    /// p50 over [`CREATES_PER_SNAPSHOT`] creates.
    create_from_snapshot_ms: f64,
    create_from_snapshot_p95_ms: f64,
    dirty_pages: u64,
}

#[derive(Serialize)]
struct Report {
    guest: &'static str,
    engine: String,
    vcpus: u8,
    memory_mib: u64,
    store_filesystem: String,
    reflink: bool,
    create_from_template: Vec<CreateRow>,
    /// Create latency against guest size: restore maps memory lazily, so it is flat.
    create_vs_guest_size: Vec<SizeRow>,
    snapshot_vs_dirty: Vec<SnapshotRow>,
    /// What `source_paused_ms` counts for this engine.
    source_paused_means: &'static str,
    rollback_ms: f64,
    rollback_p95_ms: f64,
    clone: Vec<CloneRow>,
    pause_ms: f64,
    pause_p95_ms: f64,
    resume_ms: f64,
    resume_p95_ms: f64,
    hibernate_ms: f64,
    wake_ms: f64,
    memory_overhead_mib_per_sandbox: f64,
    memory_overhead_sandboxes: usize,
    memory_pss_mib_per_sandbox: f64,
    floor_kvm_vm_ms: f64,
    floor_kvm_vm_p95_ms: f64,
    floor_write_mib_per_s: f64,
    targets: Vec<Target>,
}

struct Plan {
    create: Vec<(usize, usize)>,
    dirty_mib: Vec<u64>,
    repeats: usize,
    clones: Vec<(usize, usize)>,
    density: usize,
}

pub fn run(store: Option<&Path>, args: &BenchArgs) -> Result<(), CliError> {
    if let Some(dir) = &args.report {
        return html_report::run(dir, &args.input);
    }
    let root = store_root(store)?;
    if args.scaling {
        let plan = scaling::ScalingPlan {
            levels: args.levels.clone(),
            density: args.density.iter().copied().filter(|n| *n > 0).collect(),
        };
        return scaling::run(&root, &args.engine, &plan, args.json);
    }
    if args.network {
        return network::run(&root, args.quick, args.json);
    }
    if args.serve {
        return serve::run(&root, args.quick, args.json);
    }
    if args.engine == "jail" {
        return jail::run(&root, if args.quick { 10 } else { 30 }, args.json);
    }
    if args.guest == "linux" {
        let repeats = if args.quick { 5 } else { 20 };
        return linux_guest::run(&root, repeats, args.json, args.kernel.as_deref());
    }
    let plan = if args.quick {
        Plan {
            create: vec![(1, 10), (2, 10)],
            dirty_mib: vec![0, 100, 1024],
            repeats: 5,
            clones: vec![(1, 1), (10, 2)],
            density: 20,
        }
    } else {
        Plan {
            create: vec![(1, 20), (2, 40), (4, 40)],
            dirty_mib: vec![0, 10, 50, 100, 200, 500, 800, 1024],
            repeats: 10,
            clones: vec![(1, 1), (20, 2), (20, 4)],
            density: 50,
        }
    };
    let template = format!("bench-{}", std::process::id());
    remove_on_interrupt(&root, &template)?;
    let max_concurrency = plan.create.iter().map(|c| c.0).max().unwrap_or(1);
    let rt = Runtime::open(RuntimeConfig {
        store_root: root.clone(),
        pool_size: max_concurrency + 2,
        network_pool_size: 0,
        supervisor: None,
    })
    .map_err(CliError::from)?;
    let machine = MachineConfig {
        vcpus: args.vcpus,
        memory_bytes: args.memory_mib << 20,
        irqchip: true,
    };
    progress(&format!("building template {template}"));
    rt.build_test_template(&template, machine, WorkingSet::default(), 1 << 30)
        .map_err(CliError::from)?;
    let result = run_plan(&rt, &template, machine, &plan, args);
    let _ = rt.remove_template(&template);
    progress_done();
    let report = result?;
    if args.json {
        let text = serde_json::to_string_pretty(&report).map_err(failed)?;
        println!("{text}");
    } else {
        print_markdown(&report);
    }
    Ok(())
}

fn timed<T>(
    f: impl FnOnce() -> Result<T, cube_core::SandboxError>,
) -> Result<(Duration, T), CliError> {
    let start = Instant::now();
    let value = f().map_err(CliError::from)?;
    Ok((start.elapsed(), value))
}

/// Timed sequential writes of the largest snapshot's size, for the write floor.
const FLOOR_WRITES: usize = 3;

/// Snapshots taken of each dirty size; the row is their median.
const SNAPSHOTS_PER_SIZE: usize = 3;

/// Sequential write of `source` into the store's scratch directory, MiB/s.
fn write_floor(store: &Path, source: &[u8]) -> Result<f64, CliError> {
    floor::sequential_write(&cube_core::store::Store::tmp_dir_at(store), source)
        .map_err(CliError::failed)
}

fn ephemeral() -> CreateOptions {
    CreateOptions::new(true)
}

fn run_plan(
    rt: &Runtime,
    template: &str,
    machine: MachineConfig,
    plan: &Plan,
    args: &BenchArgs,
) -> Result<Report, CliError> {
    let store = rt.store().root().to_path_buf();
    let template_memory = rt
        .store()
        .template(template)
        .map_err(failed)?
        .image()
        .memory();

    progress("floors");
    let mut floor_vm = Vec::new();
    for _ in 0..plan.repeats * 2 {
        floor_vm.push(
            floor::bare_vm(&template_memory, machine.vcpus, machine.irqchip)
                .map_err(CliError::unsupported)?,
        );
    }
    let (floor_vm_p50, floor_vm_p95) = percentiles_ms(&floor_vm);

    let mut create_rows = Vec::new();
    for &(concurrency, n) in &plan.create {
        progress(&format!(
            "create from template: concurrency {concurrency}, n {n}"
        ));
        rt.wait_pool_ready();
        create_rows.push(scaling::create_at(rt, template, concurrency, n)?);
    }

    let mut size_rows = Vec::new();
    for memory_mib in [256u64, 4096] {
        progress(&format!("create from a {memory_mib} MiB template"));
        let name = format!("{template}-{memory_mib}");
        let shape = MachineConfig {
            memory_bytes: memory_mib << 20,
            ..machine
        };
        rt.build_test_template(&name, shape, WorkingSet::default(), 0)
            .map_err(CliError::from)?;
        let mut samples = Vec::new();
        let result = (|| {
            for _ in 0..plan.repeats {
                rt.wait_pool_ready();
                let (elapsed, sb) = timed(|| rt.create(&name, ephemeral()))?;
                samples.push(elapsed);
                let _ = sb.destroy();
            }
            Ok::<_, CliError>(())
        })();
        let _ = rt.remove_template(&name);
        result?;
        let (p50, p95) = percentiles_ms(&samples);
        size_rows.push(SizeRow {
            memory_mib,
            n: samples.len(),
            p50_ms: round2(p50),
            p95_ms: round2(p95),
        });
    }

    // The test guest dirties pages above 64 MiB and below the MMIO hole: a small guest
    // gets its largest possible size instead of sizes it cannot hold.
    let dirty_area_mib = max_dirty_mib(&machine);
    let mut dirty_sizes: Vec<u64> = plan
        .dirty_mib
        .iter()
        .copied()
        .filter(|m| *m <= dirty_area_mib)
        .collect();
    if dirty_sizes.len() < plan.dirty_mib.len() {
        dirty_sizes.push(dirty_area_mib);
    }
    let largest_dirty = dirty_sizes.iter().copied().max().unwrap_or(0);
    // The write floor is measured right after the largest snapshot, writing as much
    // as it does, from the same settled filesystem and warmed memory: measured once at
    // the run's start it swung several-fold between runs (475-2706 MiB/s), with the
    // state of the host's memory, which made the ratio noise.
    let mut floor_write = None;
    let mut snapshot_rows = Vec::new();
    for &mib in &dirty_sizes {
        progress(&format!("snapshot with {mib} MiB dirty"));
        let mut sb = rt.create(template, ephemeral()).map_err(CliError::from)?;
        let result = (|| {
            sb.guest_wait_working_set().map_err(CliError::from)?;
            let with_floor = mib == largest_dirty && mib > 0;
            // Made (and touched) before the snapshot: allocating a GiB costs the host's
            // first touch, which must not fall between the warm-up and the snapshot.
            let source = if with_floor {
                floor::write_source(mib as usize)
            } else {
                Vec::new()
            };
            // One snapshot was one sample, and the largest swung 186-327 ms across
            // runs of an otherwise quiet host: each size is snapshotted several times
            // (the same pages dirtied again before each) and the row is the median.
            let mut times = Vec::with_capacity(SNAPSHOTS_PER_SIZE);
            let mut paused = Vec::with_capacity(SNAPSHOTS_PER_SIZE);
            let mut dirty_pages = 0;
            let mut first = None;
            for _ in 0..SNAPSHOTS_PER_SIZE {
                if mib > 0 {
                    sb.guest_dirty(mib, 0x1000).map_err(CliError::from)?;
                }
                if with_floor {
                    // An untimed write of the same size first, for the snapshot and the
                    // floor after it alike: on a nested host the first touch of memory
                    // the host has not backed yet costs far more than the copy (1 GiB:
                    // the snapshot took 3.6 s cold, 0.2-0.8 s after this write; the
                    // floor measured cold swung between 300 and 2700 MiB/s, warm 6-8
                    // GiB/s), and that is the host's cost, not the snapshot's.
                    write_floor(&store, &source)?;
                }
                floor::settle_filesystem(&store).map_err(CliError::failed)?;
                let (snap_time, snap) = timed(|| sb.snapshot())?;
                // The snapshot's background flush would compete with the restore (and
                // the next sample) for the disk; the reference times them apart too.
                wait_durable(&snap.dir)?;
                times.push(snap_time);
                paused.push(Duration::from_micros(snap.stats.paused_us));
                dirty_pages = snap.stats.dirty_pages;
                first.get_or_insert(snap.id);
            }
            let (snap_ms, _) = percentiles_ms(&times);
            let (paused_ms, _) = percentiles_ms(&paused);
            if with_floor {
                // After the snapshots, the median of three, each after an untimed write
                // of its own: memory freed a few seconds earlier may have been handed
                // back to the host by then (free page reporting), and its first touch
                // made one floor run here read 904 MiB/s against 5900-6400 in others.
                let mut speeds = Vec::with_capacity(FLOOR_WRITES);
                for _ in 0..FLOOR_WRITES {
                    write_floor(&store, &source)?;
                    speeds.push(write_floor(&store, &source)?);
                }
                speeds.sort_by(f64::total_cmp);
                floor_write = speeds.get(FLOOR_WRITES / 2).copied();
            }
            // Let go before the creates: the pool starts supervisors meanwhile, and a
            // process holding a GiB is slower to fork (creates from the largest
            // snapshot read 2.0-2.3x the clean ones with it held, ~1 without).
            drop(source);
            // Creates from the first snapshot, a clone of the template's memory file as
            // a user's first snapshot is. A create is a few ms: one sample is as much
            // noise as signal, so the largest-against-clean ratio compares medians.
            let first = first.ok_or_else(|| CliError::failed("no snapshot was taken"))?;
            let mut creates = Vec::with_capacity(CREATES_PER_SNAPSHOT);
            for _ in 0..CREATES_PER_SNAPSHOT {
                rt.wait_pool_ready();
                let (create_time, clone) = timed(|| rt.create_from_snapshot(&first, ephemeral()))?;
                let _ = clone.destroy();
                creates.push(create_time);
            }
            let (create_p50, create_p95) = percentiles_ms(&creates);
            Ok::<_, CliError>(SnapshotRow {
                dirty_mib: mib,
                snapshot_ms: round2(snap_ms),
                snapshot_n: times.len(),
                source_paused_ms: round2(paused_ms),
                create_from_snapshot_ms: round2(create_p50),
                create_from_snapshot_p95_ms: round2(create_p95),
                dirty_pages,
            })
        })();
        let _ = sb.destroy();
        snapshot_rows.push(result?);
    }

    let floor_write = match floor_write {
        Some(f) => f,
        None => write_floor(&store, &floor::write_source(256))?,
    };

    progress("rollback, pause, resume, hibernate, wake");
    let mut sb = rt.create(template, ephemeral()).map_err(CliError::from)?;
    let lifecycle = lifecycle(&mut sb, plan.repeats);
    let _ = sb.destroy();
    let lifecycle = lifecycle?;

    let mut clone_rows = Vec::new();
    for &(n, concurrency) in &plan.clones {
        progress(&format!("clone n {n}, concurrency {concurrency}"));
        // A single clone is a few ms: one sample made its bar (CI: 282 ms once, 11 to
        // 17 ms otherwise), so it is repeated and the row is the median.
        let samples = if n == 1 { plan.repeats } else { 1 };
        let mut source = rt.create(template, ephemeral()).map_err(CliError::from)?;
        let walls: Result<Vec<Duration>, CliError> = (0..samples)
            .map(|_| {
                rt.wait_pool_ready();
                let (wall, clones) =
                    timed(|| rt.clone_sandbox(&mut source, n, concurrency, ephemeral()))?;
                for c in clones {
                    let _ = c.destroy();
                }
                Ok(wall)
            })
            .collect();
        let _ = source.destroy();
        let (wall_ms, _) = percentiles_ms(&walls?);
        clone_rows.push(CloneRow {
            n,
            concurrency,
            samples,
            wall_ms: round2(wall_ms),
            per_clone_ms: round2(wall_ms / n as f64),
        });
    }

    progress(&format!(
        "memory overhead of {} idle sandboxes",
        plan.density
    ));
    let (overhead, pss) = memory_overhead(&store, template, plan.density)?;

    let clean = snapshot_rows.first();
    let largest = snapshot_rows.last();
    let create_p50 = create_rows.first().map(|r| r.p50_ms).unwrap_or(0.0);
    let mut targets = vec![
        Target::at_most(
            "create_p50_vs_floor_kvm_vm",
            create_p50 / floor_vm_p50.max(1e-9),
            2.0,
        ),
        Target::at_most(
            "snapshot_clean_ms",
            clean.map(|r| r.snapshot_ms).unwrap_or(0.0),
            15.0,
        ),
        Target::at_most("rollback_ms", lifecycle.rollback.0, 20.0),
        Target::at_most(
            "clone_single_ms",
            clone_rows.first().map(|r| r.wall_ms).unwrap_or(0.0),
            25.0,
        ),
        Target::at_most("pause_ms", lifecycle.pause.0, 5.0),
        Target::at_most("resume_ms", lifecycle.resume.0, 5.0),
        Target::at_most("memory_overhead_mib_per_sandbox", overhead, 10.0),
    ];
    if let (Some(clean), Some(largest)) = (clean, largest) {
        if largest.dirty_mib > clean.dirty_mib {
            let per_mib = (largest.snapshot_ms - clean.snapshot_ms)
                / (largest.dirty_mib - clean.dirty_mib) as f64;
            let floor_per_mib = 1e3 / floor_write;
            targets.push(Target::at_most(
                "snapshot_ms_per_dirty_mib_vs_floor_write",
                per_mib / floor_per_mib,
                1.5,
            ));
            targets.push(Target::at_most(
                "create_from_snapshot_largest_dirty_vs_clean",
                largest.create_from_snapshot_ms / clean.create_from_snapshot_ms.max(1e-9),
                1.3,
            ));
        }
    }
    for t in &mut targets {
        t.value = round2(t.value);
    }
    let fs = filesystem_name(&store).unwrap_or_default();
    Ok(Report {
        guest: "synthetic",
        engine: args.engine.clone(),
        vcpus: machine.vcpus,
        memory_mib: machine.memory_bytes >> 20,
        store_filesystem: fs,
        reflink: supports_reflink(&store).unwrap_or(false),
        create_from_template: create_rows,
        create_vs_guest_size: size_rows,
        snapshot_vs_dirty: snapshot_rows,
        source_paused_means: "vCPUs stopped: the dirty set, vCPU/VM state and the disk \
            clone, and then either the dirty pages write-protected (memory in a memfd: it \
            is copied after they continue) or the pages dirtied since the last pre-copy \
            round written (memory restored from a file, as every sandbox's: the pending \
            pages are copied while the guest runs first)",
        rollback_ms: lifecycle.rollback.0,
        rollback_p95_ms: lifecycle.rollback.1,
        clone: clone_rows,
        pause_ms: lifecycle.pause.0,
        pause_p95_ms: lifecycle.pause.1,
        resume_ms: lifecycle.resume.0,
        resume_p95_ms: lifecycle.resume.1,
        hibernate_ms: lifecycle.hibernate.0,
        wake_ms: lifecycle.wake.0,
        memory_overhead_mib_per_sandbox: round2(overhead),
        memory_overhead_sandboxes: plan.density,
        memory_pss_mib_per_sandbox: round2(pss),
        floor_kvm_vm_ms: round2(floor_vm_p50),
        floor_kvm_vm_p95_ms: round2(floor_vm_p95),
        floor_write_mib_per_s: round2(floor_write),
        targets,
    })
}

/// Waits (bounded) until the snapshot in `dir` has been flushed to disk.
fn wait_durable(dir: &Path) -> Result<(), CliError> {
    let start = Instant::now();
    while !flushed_in_this_boot(dir) {
        if start.elapsed() > Duration::from_secs(120) {
            return Err(CliError::failed(format!(
                "snapshot {} was not flushed within 120 s",
                dir.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

struct Lifecycle {
    rollback: (f64, f64),
    pause: (f64, f64),
    resume: (f64, f64),
    hibernate: (f64, f64),
    wake: (f64, f64),
}

fn lifecycle(sb: &mut Sandbox, repeats: usize) -> Result<Lifecycle, CliError> {
    sb.guest_wait_working_set().map_err(CliError::from)?;
    let snap = sb.snapshot().map_err(CliError::from)?;
    let (mut rollback, mut pause, mut resume, mut hibernate, mut wake) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..repeats {
        sb.guest_dirty(10, i as u64).map_err(CliError::from)?;
        rollback.push(timed(|| sb.rollback(&snap.id))?.0);
        sb.guest_wait_working_set().map_err(CliError::from)?;
        pause.push(timed(|| sb.pause())?.0);
        resume.push(timed(|| sb.resume())?.0);
    }
    for _ in 0..repeats.min(5) {
        hibernate.push(timed(|| sb.hibernate())?.0);
        wake.push(timed(|| sb.wake())?.0);
        sb.guest_wait_working_set().map_err(CliError::from)?;
    }
    let p = |v: &[Duration]| {
        let (a, b) = percentiles_ms(v);
        (round2(a), round2(b))
    };
    Ok(Lifecycle {
        rollback: p(&rollback),
        pause: p(&pause),
        resume: p(&resume),
        hibernate: p(&hibernate),
        wake: p(&wake),
    })
}

/// Per idle sandbox: the host's used memory grown by `count` sandboxes, divided by
/// `count` (the reference's method, which other processes on the host disturb), and the
/// mean proportional set size of their supervisors (guest pages they wrote, their share
/// of the template's page cache, the process itself; not KVM's kernel memory).
fn memory_overhead(store: &Path, template: &str, count: usize) -> Result<(f64, f64), CliError> {
    // No pool here: idle pooled supervisors would be counted against the sandboxes.
    let rt = Runtime::open(RuntimeConfig {
        store_root: store.to_path_buf(),
        pool_size: 0,
        network_pool_size: 0,
        supervisor: None,
    })
    .map_err(CliError::from)?;
    std::thread::sleep(Duration::from_millis(200));
    let before = scaling::used_memory_mib()?;
    let mut sandboxes = Vec::with_capacity(count);
    let result = (|| -> Result<(f64, f64), CliError> {
        for _ in 0..count {
            let mut sb = rt.create(template, ephemeral()).map_err(CliError::from)?;
            sb.guest_wait_working_set().map_err(CliError::from)?;
            sandboxes.push(sb);
        }
        std::thread::sleep(Duration::from_millis(500));
        let used = scaling::used_memory_mib()?;
        let mut pss_kib = 0u64;
        for sb in &mut sandboxes {
            let pid = sb.status().map_err(CliError::from)?.pid;
            pss_kib += scaling::proportional_set_kib(pid);
        }
        Ok((used, pss_kib as f64 / 1024.0))
    })();
    for sb in sandboxes {
        let _ = sb.destroy();
    }
    let (after, pss_mib) = result?;
    Ok(((after - before) / count as f64, pss_mib / count as f64))
}

fn print_markdown(r: &Report) {
    println!(
        "# cube bench: {} engine, {} guest, {} vCPU / {} MiB, store on {} (reflink: {})\n",
        r.engine, r.guest, r.vcpus, r.memory_mib, r.store_filesystem, r.reflink
    );
    println!(
        "Floors measured in this run: bare KVM VM p50 {} ms (p95 {}), sequential write {} MiB/s\n",
        r.floor_kvm_vm_ms, r.floor_kvm_vm_p95_ms, r.floor_write_mib_per_s
    );
    println!("## Create sandbox from template\n");
    create_table(&r.create_from_template);
    println!("\n## Create vs guest size\n");
    table(
        &["Guest MiB", "n", "p50 ms", "p95 ms"],
        r.create_vs_guest_size.iter().map(|row| {
            vec![
                row.memory_mib.to_string(),
                row.n.to_string(),
                row.p50_ms.to_string(),
                row.p95_ms.to_string(),
            ]
        }),
    );
    println!("\n## Snapshot vs dirty size\n");
    table(
        &[
            "Dirty MiB",
            "Dirty pages",
            "Snapshot ms",
            "Source paused ms",
            "Create from snapshot p50 ms",
            "p95 ms",
        ],
        r.snapshot_vs_dirty.iter().map(|row| {
            vec![
                row.dirty_mib.to_string(),
                row.dirty_pages.to_string(),
                row.snapshot_ms.to_string(),
                row.source_paused_ms.to_string(),
                row.create_from_snapshot_ms.to_string(),
                row.create_from_snapshot_p95_ms.to_string(),
            ]
        }),
    );
    println!("\nSource paused: {}", r.source_paused_means);
    println!("\n## Clone\n");
    table(
        &["n", "Concurrency", "Wall ms", "Per clone ms"],
        r.clone.iter().map(|row| {
            vec![
                row.n.to_string(),
                row.concurrency.to_string(),
                row.wall_ms.to_string(),
                row.per_clone_ms.to_string(),
            ]
        }),
    );
    println!("\n## Lifecycle (p50 / p95 ms)\n");
    println!("| Operation | p50 | p95 |\n|---|---|---|");
    println!("| rollback | {} | {} |", r.rollback_ms, r.rollback_p95_ms);
    println!(
        "| pause (in memory) | {} | {} |",
        r.pause_ms, r.pause_p95_ms
    );
    println!("| resume | {} | {} |", r.resume_ms, r.resume_p95_ms);
    println!("| hibernate (CubeSandbox's pause) | {} | |", r.hibernate_ms);
    println!("| wake | {} | |", r.wake_ms);
    println!(
        "\nMemory per idle sandbox over {} sandboxes: {} MiB of host memory used, {} MiB PSS of its supervisor\n",
        r.memory_overhead_sandboxes, r.memory_overhead_mib_per_sandbox, r.memory_pss_mib_per_sandbox
    );
    println!("## Targets\n\n| Target | Value | Limit | Met |\n|---|---|---|---|");
    for t in &r.targets {
        println!(
            "| {} | {} | {} | {} |",
            t.name,
            t.value,
            t.limit,
            if t.met { "yes" } else { "no" }
        );
    }
}
