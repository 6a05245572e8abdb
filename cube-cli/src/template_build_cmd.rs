//! `cube template build`: a jail template from Debian packages or a directory, or a VM
//! template (a booted guest's snapshot).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use std::time::Duration;

use clap::{Args, ValueEnum};
use cube_core::host::KernelMode;
use cube_core::templates::{
    image_agent, DebianRootfs, MachineConfig, TreeSource, VmTemplateSpec, BASE_PACKAGES,
    DEFAULT_MIRROR, DEFAULT_SUITE,
};
use cube_core::{ErrorKind, Runtime};

use crate::build_progress::BuildProgress;
use crate::cli_error::CliError;

/// Default `--boot-timeout` where the guest kernel runs natively.
const NATIVE_BOOT_TIMEOUT_S: u64 = 120;
/// Default `--boot-timeout` where the guest kernel runs emulated (PVM hosts).
const EMULATED_BOOT_TIMEOUT_S: u64 = 900;

/// The engine a template is built for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum BuildEngine {
    /// A standalone root filesystem tree the jail engine runs on.
    #[default]
    Jail,
    /// A booted Linux guest with the agent, snapshotted.
    Vm,
}

/// `cube template build`.
#[derive(Args, Debug)]
pub struct BuildArgs {
    /// Template name.
    pub name: String,
    /// Engine the template is for.
    #[arg(long, value_enum, default_value_t = BuildEngine::Jail)]
    pub engine: BuildEngine,
    /// Use this directory as the root filesystem instead of building one from Debian
    /// packages.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["suite", "packages", "debian"])]
    pub from: Option<PathBuf>,
    /// Use a container image as the root filesystem: an OCI image layout (directory or
    /// tar) or a `docker save` archive. Its layers are applied in order (gzip or plain
    /// tars, whiteouts honoured, every blob's SHA-256 checked); its Env and WorkingDir
    /// become the defaults of the sandboxes' processes.
    ///
    /// Example: cube template build app --from-oci app.tar
    #[arg(long, value_name = "ARCHIVE", conflicts_with_all = ["from", "suite", "packages", "debian"])]
    pub from_oci: Option<PathBuf>,
    /// Debian suite of the tree.
    #[arg(long, value_name = "S", default_value = DEFAULT_SUITE)]
    pub suite: String,
    /// Debian mirror.
    #[arg(long, value_name = "URL", default_value = DEFAULT_MIRROR)]
    pub mirror: String,
    /// Packages on top of python3, python3-pip and ca-certificates (comma-separated).
    #[arg(long, value_name = "A,B", value_delimiter = ',')]
    pub packages: Vec<String>,
    /// Same as --packages (the VM engine's spelling).
    #[arg(long, value_name = "PKGS", value_delimiter = ',')]
    pub debian: Vec<String>,
    /// Guest kernel for --engine vm (default: the store's kernels/cube-guest, else
    /// kernels/debian-cloud).
    #[arg(long, value_name = "PATH")]
    pub kernel: Option<PathBuf>,
    /// Guest initramfs for --engine vm (default: none for Cube's kernel, Cube's
    /// initramfs for Debian's).
    #[arg(long, value_name = "PATH")]
    pub initrd: Option<PathBuf>,
    /// Seconds to wait for the guest's agent (--engine vm; default 120, or 900 where
    /// the guest kernel runs emulated).
    #[arg(long, value_name = "S")]
    pub boot_timeout: Option<u64>,
    /// Guest memory in MiB (--engine vm); every sandbox of the template has it.
    #[arg(long, value_name = "MIB", default_value_t = 512)]
    pub memory_mib: u64,
}

impl BuildArgs {
    /// Where the root filesystem comes from.
    pub fn tree_source(&self) -> TreeSource {
        if let Some(image) = &self.from_oci {
            return TreeSource::Oci(image.clone());
        }
        match &self.from {
            Some(dir) => TreeSource::Directory(dir.clone()),
            None => {
                let mut packages: Vec<String> =
                    BASE_PACKAGES.iter().map(|p| p.to_string()).collect();
                for p in self.packages.iter().chain(&self.debian) {
                    if !p.is_empty() && !packages.contains(p) {
                        packages.push(p.clone());
                    }
                }
                TreeSource::Debian(DebianRootfs {
                    suite: self.suite.clone(),
                    mirror: self.mirror.clone(),
                    packages,
                })
            }
        }
    }
}

/// Set by SIGINT/SIGTERM while a build runs: the build's own child got the signal
/// too, fails, and the build cleans up before `cube` exits.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Catches SIGINT and SIGTERM for its lifetime, so an interrupted build removes what
/// it made instead of dying with it half-made.
struct InterruptGuard;

impl InterruptGuard {
    fn install() -> InterruptGuard {
        for sig in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
            unsafe { libc::signal(sig, note_interrupt as *const () as libc::sighandler_t) };
        }
        InterruptGuard
    }
}

impl Drop for InterruptGuard {
    fn drop(&mut self) {
        for sig in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: restoring the default disposition.
            unsafe { libc::signal(sig, libc::SIG_DFL) };
        }
    }
}

/// Runs `cube template build`.
pub fn run(rt: &Runtime, args: &BuildArgs, store: Option<&Path>) -> Result<(), CliError> {
    let _ = store;
    match args.engine {
        BuildEngine::Jail => build_jail(rt, args),
        BuildEngine::Vm => build_vm(rt, args),
    }
}

fn build_jail(rt: &Runtime, args: &BuildArgs) -> Result<(), CliError> {
    let source = args.tree_source();
    let guard = InterruptGuard::install();
    let progress = BuildProgress::start(&format!("building template {}", args.name));
    let result = rt.build_jail_template(&args.name, &source, &mut |line| progress.line(line));
    progress.finish();
    drop(guard);
    match result {
        Ok(meta) => {
            println!("{}", meta.name);
            Ok(())
        }
        Err(_) if INTERRUPTED.load(Ordering::SeqCst) => Err(CliError::failed(format!(
            "building template {} was interrupted; nothing was kept",
            args.name
        ))),
        Err(e) => {
            let mut err = CliError::from(e);
            if matches!(source, TreeSource::Debian(_)) {
                err = err.hint(
                    "needs debootstrap and the Debian mirror; --from DIR uses a directory instead",
                );
            }
            Err(err)
        }
    }
}

/// `cube template build --engine vm`: a Linux guest booted on an ext4 image of the
/// tree, snapshotted once its agent answers; on a host where that cannot finish, says
/// why at once.
fn build_vm(rt: &Runtime, args: &BuildArgs) -> Result<(), CliError> {
    // A missing static agent is reported only if the host could build the template at
    // all: where it cannot (a stock kernel on PVM), that is what the user must hear.
    let located = image_agent::locate();
    let agent = located
        .as_ref()
        .map_or_else(|_| PathBuf::new(), Clone::clone);
    let spec = VmTemplateSpec {
        tree: args.tree_source(),
        kernel: args.kernel.clone(),
        initrd: args.initrd.clone(),
        machine: MachineConfig {
            vcpus: 1,
            memory_bytes: args.memory_mib << 20,
            irqchip: true,
        },
        boot_timeout: Duration::from_secs(args.boot_timeout.unwrap_or(
            // An emulated kernel takes a minute or two to boot here; a native one,
            // about a second.
            match KernelMode::of_this_host() {
                Some(KernelMode::Emulated) => EMULATED_BOOT_TIMEOUT_S,
                _ => NATIVE_BOOT_TIMEOUT_S,
            },
        )),
        agent,
    };
    let progress = BuildProgress::start(&format!("building VM template {}", args.name));
    let result = rt.build_vm_template(&args.name, &spec, &mut |line| progress.line(line));
    progress.finish();
    match result {
        Ok(meta) => {
            println!("{}", meta.name);
            Ok(())
        }
        Err(e) if e.kind() == ErrorKind::HostCannot => {
            Err(CliError::from(e).hint(format!("cube template build {} --engine jail", args.name)))
        }
        Err(e) => match located {
            Err(missing) => Err(CliError::failed(missing.to_string())),
            Ok(_) => Err(e.into()),
        },
    }
}
