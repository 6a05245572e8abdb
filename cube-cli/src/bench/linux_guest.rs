//! `cube bench --guest linux`: the microVM engine with a Linux guest and its agent:
//! a VM template built once (boot, agent answers, snapshot), then sandboxes created
//! from it (restore, no boot) timed until their agent answers, and a command round
//! trip over vsock, and a snapshot of the running sandbox (live: its vCPUs and devices
//! stop only to take the state and the dirty set). Where no Linux guest can run (a PVM host with a stock kernel, no
//! KVM) it records the skip and the reason; it never makes numbers up.
//!
//! On a PVM host Cube's guest kernel runs emulated (its CPL0 code, about 1.6 µs an
//! instruction): the figures are labelled `kernel: "emulated"`, and the guest is the
//! one the Linux VM tests boot there (1 vCPU, 256 MiB; a bigger one spends minutes
//! initialising its memory map, emulated). On a VMX/SVM host the same command boots
//! the kernel natively, with 2 vCPUs and 2 GiB.

use std::path::Path;
use std::time::{Duration, Instant};

use cube_core::host::{HostCapabilities, KvmKind};
use cube_core::templates::{
    cube_guest_kernel, image_agent, MachineConfig, TreeSource, VmTemplateSpec, PVM_STOCK_KERNEL,
};
use cube_core::{CreateOptions, Runtime, RuntimeConfig};
use serde::Serialize;

use super::report::progress;
use super::stats::{percentiles_ms, round2};
use crate::cli_error::{chain, CliError};

/// What `--guest linux` reports.
#[derive(Serialize)]
struct LinuxReport {
    guest: &'static str,
    engine: &'static str,
    kvm: KvmKind,
    /// How the guest kernel ran: "native" (VMX/SVM) or "emulated" (PVM host).
    kernel: &'static str,
    /// The guest measured.
    vcpus: u8,
    memory_mib: u64,
    skipped: bool,
    /// Why nothing was measured (present when skipped).
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    create_to_agent_ready: Option<Latency>,
    #[serde(skip_serializing_if = "Option::is_none")]
    exec_true_roundtrip: Option<Latency>,
    /// A snapshot of a sandbox just created, its agent having run a command, to the
    /// snapshot recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    snapshot: Option<Latency>,
    /// How long that snapshot stopped the sandbox's vCPUs and devices.
    #[serde(skip_serializing_if = "Option::is_none")]
    snapshot_source_paused: Option<Latency>,
}

/// The samples [`measure`] takes, one of each per repeat.
#[derive(Default)]
struct Samples {
    ready: Vec<Duration>,
    exec: Vec<Duration>,
    snapshot: Vec<Duration>,
    paused: Vec<Duration>,
}

#[derive(Serialize)]
struct Latency {
    n: usize,
    p50_ms: f64,
    p95_ms: f64,
}

fn latency(samples: &[Duration]) -> Latency {
    let (p50, p95) = percentiles_ms(samples);
    Latency {
        n: samples.len(),
        p50_ms: round2(p50),
        p95_ms: round2(p95),
    }
}

/// Runs the Linux-guest measurements, or records why they cannot run here.
pub fn run(root: &Path, repeats: usize, json: bool, kernel: Option<&Path>) -> Result<(), CliError> {
    let kvm = HostCapabilities::probe().kvm;
    let skip = match (kvm, kernel) {
        (KvmKind::None, _) => Some("no usable /dev/kvm".to_string()),
        (KvmKind::Pvm, None) if cube_guest_kernel(root).is_none() => {
            Some(PVM_STOCK_KERNEL.to_string())
        }
        _ => None,
    };
    let emulated = kvm == KvmKind::Pvm;
    let machine = if emulated {
        MachineConfig {
            vcpus: 1,
            memory_bytes: 256 << 20,
            irqchip: true,
        }
    } else {
        MachineConfig {
            vcpus: 2,
            memory_bytes: 2048 << 20,
            irqchip: true,
        }
    };
    // A bound on a hung boot: emulated, the template's boot takes half a minute to a
    // few minutes on a busy host.
    let boot_timeout = Duration::from_secs(if emulated { 900 } else { 300 });
    let mut report = LinuxReport {
        guest: "linux",
        engine: "vm",
        kvm,
        kernel: if emulated { "emulated" } else { "native" },
        vcpus: machine.vcpus,
        memory_mib: machine.memory_bytes >> 20,
        skipped: skip.is_some(),
        reason: skip,
        create_to_agent_ready: None,
        exec_true_roundtrip: None,
        snapshot: None,
        snapshot_source_paused: None,
    };
    if !report.skipped {
        let samples = measure(root, repeats, kernel, machine, boot_timeout)?;
        report.create_to_agent_ready = Some(latency(&samples.ready));
        report.exec_true_roundtrip = Some(latency(&samples.exec));
        report.snapshot = Some(latency(&samples.snapshot));
        report.snapshot_source_paused = Some(latency(&samples.paused));
    }
    print(&report, json)
}

fn measure(
    root: &Path,
    repeats: usize,
    kernel: Option<&Path>,
    machine: MachineConfig,
    boot_timeout: Duration,
) -> Result<Samples, CliError> {
    let rt = Runtime::open(RuntimeConfig {
        store_root: root.to_path_buf(),
        pool_size: 2,
        network_pool_size: 0,
        supervisor: None,
    })
    .map_err(CliError::from)?;
    let agent = image_agent::locate().map_err(|e| CliError::failed(e.to_string()))?;
    let empty = tempfile_dir(root)?;
    let name = format!("bench-linux-{}", std::process::id());
    progress(&format!("building Linux VM template {name}"));
    let spec = VmTemplateSpec {
        tree: TreeSource::Directory(empty.clone()),
        kernel: kernel.map(Path::to_path_buf),
        initrd: None,
        machine,
        boot_timeout,
        agent,
    };
    let built = rt.build_vm_template(&name, &spec, &mut |_| {});
    let _ = std::fs::remove_dir_all(&empty);
    built.map_err(CliError::from)?;
    let result = (|| {
        let mut samples = Samples::default();
        for _ in 0..repeats {
            let start = Instant::now();
            let mut sandbox = rt.create(&name, CreateOptions::new(true))?;
            let client = sandbox.agent()?;
            samples.ready.push(start.elapsed());
            let t = Instant::now();
            client
                .exec(cube_agent::protocol::ExecRequest {
                    argv: vec!["/bin/true".into()],
                    env: Vec::new(),
                    cwd: None,
                    user: None,
                    stdin: Vec::new(),
                    timeout_ms: None,
                    background: false,
                })
                .map_err(|e| cube_core::SandboxError::Agent(sandbox.id().to_string(), e))?;
            samples.exec.push(t.elapsed());
            drop(client);
            let t = Instant::now();
            let snapshot = sandbox.snapshot()?;
            samples.snapshot.push(t.elapsed());
            samples
                .paused
                .push(Duration::from_micros(snapshot.stats.paused_us));
            // Its snapshots go with it.
            sandbox.destroy()?;
        }
        Ok::<_, cube_core::SandboxError>(samples)
    })();
    let _ = rt.remove_template(&name);
    result.map_err(CliError::from)
}

/// The static busybox (Debian's busybox-static, which set-up installs): the one program
/// the measured image holds, as `/bin/true`, so the exec round trip runs a real program.
const BUSYBOX: &str = "/bin/busybox";

/// The tree of the measured template, in the store's scratch area: busybox as
/// `/bin/true`, and the agent the image build adds.
fn tempfile_dir(root: &Path) -> Result<std::path::PathBuf, CliError> {
    let dir = cube_core::store::Store::tmp_dir_at(root)
        .join(format!("bench-linux-tree-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| CliError::failed(chain(&e)))?;
    std::fs::copy(BUSYBOX, bin.join("busybox")).map_err(|e| {
        CliError::failed(format!(
            "{BUSYBOX} (install busybox-static; the image runs it as /bin/true): {}",
            chain(&e)
        ))
    })?;
    std::os::unix::fs::symlink("busybox", bin.join("true"))
        .map_err(|e| CliError::failed(chain(&e)))?;
    Ok(dir)
}

fn print(report: &LinuxReport, json: bool) -> Result<(), CliError> {
    if json {
        let text = serde_json::to_string_pretty(report).map_err(|e| CliError::failed(chain(&e)))?;
        println!("{text}");
        return Ok(());
    }
    println!(
        "## microVM engine, Linux guest (kernel {}, {} vCPU, {} MiB)",
        report.kernel, report.vcpus, report.memory_mib
    );
    if report.kernel == "emulated" {
        println!("(PVM host: the guest kernel's own code is emulated; not native speed)");
    }
    if let Some(reason) = &report.reason {
        println!("skipped: {reason}");
        return Ok(());
    }
    println!("| operation | n | p50 ms | p95 ms |");
    println!("|---|---|---|---|");
    for (what, l) in [
        ("create to agent ready", &report.create_to_agent_ready),
        ("exec `true` round trip", &report.exec_true_roundtrip),
        ("snapshot (live)", &report.snapshot),
        (
            "  of which the sandbox was stopped",
            &report.snapshot_source_paused,
        ),
    ] {
        if let Some(l) = l {
            println!("| {what} | {} | {} | {} |", l.n, l.p50_ms, l.p95_ms);
        }
    }
    Ok(())
}
