//! VM templates of Linux guests: a root filesystem image (`mkfs.ext4 -d` from a tree,
//! with the agent in it), a guest booted on it with the disk, vsock and rng devices,
//! and, once its agent answers over vsock, a snapshot of that guest. Creating a
//! sandbox from the snapshot restores it; nothing boots again.
//!
//! The default guest kernel is Cube's own (`scripts/build-guest-kernel.sh` builds it
//! into the store's `kernels/cube-guest`): it has the virtio drivers built in, so it
//! needs no initramfs; it mounts the image as its root and starts the agent from it
//! as PID 1. Debian's cloud kernel with Cube's initramfs is the fallback.
//!
//! On a PVM host (KVM without VMX/SVM) a kernel that is not PVM-enabled runs emulated
//! ([`KernelMode::Emulated`]): Cube's kernel boots so in tens of seconds, Debian's in
//! about twelve minutes, so the build refuses Debian's default kernel there up front.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cube_agent::image_defaults::{ImageDefaults, IMAGE_DEFAULTS_PATH};
use cube_agent::protocol::UserSpec;
use cube_storage::TemplateDir;
use cube_vmm::host::{KvmKind, KvmProbe};
use cube_vmm::linux_vm::{self, LinuxBootConfig};
use cube_vmm::persist::MachineConfig;
use cube_vmm::vstate::emulation::KernelMode;
use cube_vmm::vstate::KvmContext;

use super::tree::{make_tree, TemplateBuildError, TreeSource};
use crate::error_report::chain as error_chain;
use crate::records::{now_unix, Engine, ProcessDefaults, TemplateMeta, HOST_TEMPLATE};
use crate::vm_agent::{agent_client, VmAgentError};
use crate::vm_devices::template_devices;

/// What a user on a PVM host without Cube's guest kernel is told (by the build and by
/// `cube doctor`).
pub const PVM_STOCK_KERNEL: &str = "KVM on this host is PVM (no VMX/SVM): guest kernel code \
     runs emulated, about a microsecond an instruction, and Debian's stock kernel takes \
     about twelve minutes to boot so. Build Cube's lean guest kernel \
     (scripts/build-guest-kernel.sh) or give a kernel with --kernel; or use --engine jail.";

/// Directories the image must have for a guest that boots from it, with their modes.
const MOUNT_POINTS: [(&str, u32); 4] = [
    ("dev", 0o755),
    ("proc", 0o555),
    ("sys", 0o555),
    ("tmp", 0o1777),
];

/// Where the agent goes inside the image (the jail engine binds it at the same path).
pub const IMAGE_AGENT_PATH: &str = ".cube/cube-agent";
/// The kernel package directory the set-up unpacks Debian's cloud kernel into.
pub const DEBIAN_CLOUD_KERNEL: &str = "kernels/debian-cloud";
/// Where `scripts/build-guest-kernel.sh` puts Cube's guest kernel: `vmlinux` there
/// links to the latest build (`<config hash>/vmlinux`).
pub const CUBE_GUEST_KERNEL: &str = "kernels/cube-guest";
/// The kernel command line of a guest booted from its root disk (no initramfs): the
/// image is the root, the agent is PID 1. `quiet`: every console byte is a port exit
/// and, where the kernel runs emulated, emulated driver code.
pub const ROOT_DISK_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=-1 quiet root=/dev/vda rw rootfstype=ext4 init=/.cube/cube-agent";
/// The kernel command line of a guest booted with Cube's initramfs (the agent is its
/// /init and loads the virtio modules).
const INITRAMFS_CMDLINE: &str =
    "console=ttyS0 earlyprintk=serial,ttyS0 reboot=k panic=-1 cube.root=/dev/vda";
/// The set-up's kernel directory outside any store.
const SYSTEM_KERNELS: &str = "/var/lib/cube";

/// Why a VM template could not be built.
#[derive(Debug, thiserror::Error)]
pub enum VmTemplateError {
    /// A stock kernel cannot boot on this PVM host.
    #[error("{PVM_STOCK_KERNEL}")]
    StockKernelOnPvm,
    /// The host has no usable KVM.
    #[error("No usable /dev/kvm: the vm engine is unavailable here; use --engine jail")]
    NoKvm,
    /// No guest kernel was given and the set-up's is missing.
    #[error(
        "No guest kernel: none given (--kernel) and none at {0} (run scripts/build-guest-kernel.sh)"
    )]
    NoKernel(PathBuf),
    /// The template exists.
    #[error("Template {0} already exists")]
    Exists(String),
    /// The root filesystem tree could not be made.
    #[error("Making the root filesystem tree")]
    Tree(#[source] TemplateBuildError),
    /// `mkfs.ext4` is missing or failed.
    #[error("mkfs.ext4 failed: {0}")]
    Mkfs(String),
    /// A file operation failed.
    #[error("{0}")]
    Io(String, #[source] std::io::Error),
    /// The guest could not be started or snapshotted.
    #[error("Guest")]
    Boot(#[from] linux_vm::BootError),
    /// A device could not be created.
    #[error("Device: {0}")]
    Device(String),
    /// The guest stopped before its agent answered.
    #[error("The guest stopped before its agent answered: {0}")]
    GuestStopped(String),
    /// The agent did not answer in time.
    #[error("The guest's agent did not answer within {0:?} (last console line: {1:?})")]
    Timeout(Duration, String),
    /// The agent did not answer in time on a PVM host, where a kernel that is not
    /// PVM-enabled runs emulated.
    #[error("The guest's agent did not answer within {0:?} (last console line: {1:?}); KVM here is PVM, where a kernel that is not PVM-enabled (CONFIG_PVM_GUEST) runs emulated, slowly: give it more time (--boot-timeout) or use --engine jail")]
    TimeoutOnPvm(Duration, String),
    /// The store failed.
    #[error("Store")]
    Store(#[from] cube_storage::StoreError),
    /// The agent cannot go into an image.
    #[error("The agent")]
    Agent(#[from] super::image_agent::ImageAgentError),
    /// The image's User cannot be resolved in its tree.
    #[error("Resolving the image's User")]
    ImageUser(#[from] super::image_user::ImageUserError),
    /// The template record could not be written.
    #[error("Writing the template record")]
    Metadata(#[from] cube_storage::MetadataError),
}

/// What to build a VM template from.
#[derive(Clone, Debug)]
pub struct VmTemplateSpec {
    /// The root filesystem's contents.
    pub tree: TreeSource,
    /// The guest kernel; None: the set-up's Debian cloud kernel.
    pub kernel: Option<PathBuf>,
    /// The initramfs (Cube's, with the agent as init); None: the set-up's.
    pub initrd: Option<PathBuf>,
    /// The VM's shape.
    pub machine: MachineConfig,
    /// How long the guest may take until its agent answers.
    pub boot_timeout: Duration,
    /// The agent binary to put into the image.
    pub agent: PathBuf,
}

/// A guest kernel the set-up put into a store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DefaultKernel {
    /// The kernel (an ELF vmlinux, or a bzImage).
    pub kernel: PathBuf,
    /// Its initramfs, where it needs one.
    pub initrd: Option<PathBuf>,
    /// Whether it is Cube's own guest kernel (else Debian's stock cloud kernel).
    pub cube: bool,
}

/// Cube's guest kernel (`kernels/cube-guest/vmlinux`) in the store, else in
/// /var/lib/cube; `None` where neither has it.
pub fn cube_guest_kernel(store_root: &Path) -> Option<PathBuf> {
    [store_root, Path::new(SYSTEM_KERNELS)]
        .iter()
        .find_map(|root| cube_kernel_in(root))
}

fn cube_kernel_in(root: &Path) -> Option<PathBuf> {
    Some(root.join(CUBE_GUEST_KERNEL).join("vmlinux")).filter(|p| p.is_file())
}

/// Debian's kernel and Cube's initramfs as the set-up unpacked them into `root`: the
/// ELF vmlinux (PVH entry, nothing to decompress) preferred over the bzImage.
fn debian_kernel_in(root: &Path) -> Option<DefaultKernel> {
    let dir = root.join(DEBIAN_CLOUD_KERNEL);
    let kernel = ["vmlinux", "bzImage"]
        .iter()
        .map(|k| dir.join(k))
        .find(|p| p.is_file())?;
    let initrd = dir.join("initramfs-cube.cpio.gz");
    Some(DefaultKernel {
        kernel,
        initrd: initrd.is_file().then_some(initrd),
        cube: false,
    })
}

/// The default guest kernel: the store's own (Cube's, else Debian's), else
/// /var/lib/cube's (likewise). Cube's needs no initramfs; Debian's comes with Cube's.
pub fn default_kernel(store_root: &Path) -> Result<DefaultKernel, VmTemplateError> {
    for root in [store_root, Path::new(SYSTEM_KERNELS)] {
        if let Some(kernel) = cube_kernel_in(root) {
            return Ok(DefaultKernel {
                kernel,
                initrd: None,
                cube: true,
            });
        }
        if let Some(debian) = debian_kernel_in(root) {
            return Ok(debian);
        }
    }
    Err(VmTemplateError::NoKernel(
        Path::new(SYSTEM_KERNELS).join(CUBE_GUEST_KERNEL),
    ))
}

/// Refuses up front what cannot finish: no KVM, or Debian's stock default kernel on a
/// PVM host (emulated, it takes about twelve minutes to boot). Cube's kernel and a
/// kernel the user gave get their boot, emulated there.
pub fn preflight(kvm: KvmKind, kernel: Option<&DefaultKernel>) -> Result<(), VmTemplateError> {
    match kvm {
        KvmKind::None => Err(VmTemplateError::NoKvm),
        KvmKind::Pvm if kernel.is_some_and(|k| !k.cube) => Err(VmTemplateError::StockKernelOnPvm),
        _ => Ok(()),
    }
}

/// Turns why a guest stopped into the error to report (the vCPU's reason names the
/// instruction KVM could not emulate, where that was it).
pub fn boot_failure(why: &str) -> VmTemplateError {
    VmTemplateError::GuestStopped(why.to_string())
}

/// Bytes of the regular files under `tree` (what the image must hold).
fn tree_bytes(tree: &Path) -> Result<u64, VmTemplateError> {
    let mut total = 0u64;
    let mut stack = vec![tree.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| VmTemplateError::Io(format!("listing {}", dir.display()), e))?;
        for entry in entries.flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.is_dir() {
                stack.push(entry.path());
            } else {
                // Block-rounded: ext4 stores small files in whole blocks.
                total += meta.len().div_ceil(4096) * 4096 + 256;
            }
        }
    }
    Ok(total)
}

/// Puts the agent into `tree` at [`IMAGE_AGENT_PATH`] and makes the ext4 image `image`
/// of it (`mkfs.ext4 -d`), sized to the tree with room to write. Returns its size.
pub fn make_root_image(tree: &Path, agent: &Path, image: &Path) -> Result<u64, VmTemplateError> {
    let target = tree.join(IMAGE_AGENT_PATH);
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| VmTemplateError::Io(format!("creating {}", parent.display()), e))?;
    }
    std::fs::copy(agent, &target)
        .map_err(|e| VmTemplateError::Io(format!("copying the agent {}", agent.display()), e))?;
    std::fs::set_permissions(&target, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .map_err(|e| VmTemplateError::Io(format!("making {} executable", target.display()), e))?;
    // Mount points: a kernel that mounts the image as its root mounts devtmpfs on /dev
    // and opens /dev/console there before it starts the agent, which mounts the rest.
    for (dir, mode) in MOUNT_POINTS {
        let path = tree.join(dir);
        if !path.exists() {
            std::fs::create_dir_all(&path)
                .and_then(|()| {
                    std::fs::set_permissions(
                        &path,
                        std::os::unix::fs::PermissionsExt::from_mode(mode),
                    )
                })
                .map_err(|e| VmTemplateError::Io(format!("creating {}", path.display()), e))?;
        }
    }
    // A quarter more than the files, plus room for the journal and the sandbox's
    // own writes; whole MiB.
    let bytes = tree_bytes(tree)?;
    let mib = (bytes + bytes / 4).div_ceil(1 << 20) + 256;
    let mkfs = run_to_its_end(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L", "cube-root", "-d"])
            .arg(tree)
            .arg(image)
            .arg(format!("{mib}M")),
    )
    .map_err(|e| {
        VmTemplateError::Mkfs(format!("cannot run it ({e}); apt-get install e2fsprogs"))
    })?;
    if let Err(why) = mkfs {
        let _ = std::fs::remove_file(image);
        return Err(VmTemplateError::Mkfs(why));
    }
    Ok(mib << 20)
}

/// Runs `command` through `sh`, which says on standard output whether it succeeded:
/// Ok(Ok(())) where it did, Ok(Err(what it wrote)) where it failed, Err where it
/// could not run. The marker stands in for the exit status where a caller that reaps
/// every child of its own (a containerd shim does, on SIGCHLD) took it first: the
/// wait then fails with ECHILD though the command ran.
fn run_to_its_end(command: &mut Command) -> std::io::Result<Result<(), String>> {
    const DONE: &str = "cube-command-succeeded";
    let program = command.get_program().to_owned();
    let args: Vec<_> = command.get_args().map(|a| a.to_owned()).collect();
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!("\"$0\" \"$@\" 2>&1 && echo {DONE}"))
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut said = String::new();
    if let Some(mut out) = child.stdout.take() {
        std::io::Read::read_to_string(&mut out, &mut said)?;
    }
    let succeeded = said.lines().any(|l| l == DONE);
    let said = said.trim().to_string();
    match child.wait() {
        Ok(status) if status.success() && succeeded => Ok(Ok(())),
        // sh's "command not found".
        Ok(status) if status.code() == Some(127) => {
            Err(std::io::Error::new(std::io::ErrorKind::NotFound, said))
        }
        Ok(status) if said.is_empty() => Ok(Err(format!("it ended with {status}"))),
        Ok(_) => Ok(Err(said)),
        Err(e) if e.raw_os_error() == Some(libc::ECHILD) => match (succeeded, said.is_empty()) {
            (true, _) => Ok(Ok(())),
            (false, true) => Ok(Err("it failed".into())),
            (false, false) => Ok(Err(said)),
        },
        Err(e) => Err(e),
    }
}

/// Writes a container image's Env, WorkingDir and User into `tree` at
/// [`IMAGE_DEFAULTS_PATH`], where the guest's agent takes them at its start. The User
/// is resolved here against the image's own account files (a name the image does not
/// know fails the build, as it would fail the container's start), and its home becomes
/// `HOME` unless the image's Env sets one.
fn write_image_defaults(tree: &Path, defaults: &ProcessDefaults) -> Result<(), VmTemplateError> {
    let path = tree.join(IMAGE_DEFAULTS_PATH.trim_start_matches('/'));
    let mut env = defaults.env.clone();
    let user = match &defaults.user {
        Some(spec) => {
            let user = super::image_user::resolve(tree, spec)?;
            if let Some(home) = user.home.filter(|_| !env.iter().any(|(k, _)| k == "HOME")) {
                env.push(("HOME".into(), home));
            }
            Some(UserSpec {
                uid: user.uid,
                gid: user.gid,
            })
        }
        None => None,
    };
    let file = ImageDefaults {
        env,
        cwd: defaults.cwd.clone(),
        user,
    };
    let bytes = serde_json::to_vec(&file)
        .map_err(|e| VmTemplateError::Io(path.display().to_string(), e.into()))?;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| VmTemplateError::Io(format!("creating {}", parent.display()), e))?;
    }
    std::fs::write(&path, bytes)
        .map_err(|e| VmTemplateError::Io(format!("writing {}", path.display()), e))
}

/// The console of a template's guest: the last line it printed, for error messages,
/// and every line to the build's progress.
struct ConsoleTail(Arc<std::sync::Mutex<(Vec<u8>, String)>>);

impl std::io::Write for ConsoleTail {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut state = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for &b in buf {
            if b == b'\n' {
                let line = String::from_utf8_lossy(&state.0).trim().to_string();
                if !line.is_empty() {
                    state.1 = line;
                }
                state.0.clear();
            } else if state.0.len() < 4096 {
                state.0.push(b);
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Builds VM template `name` in `store`: image, boot, wait for the agent, snapshot.
/// Fails at once with [`VmTemplateError::StockKernelOnPvm`] where that cannot finish.
/// On any failure nothing named `name` is left in the store.
pub fn build(
    store: &cube_storage::Store,
    name: &str,
    spec: &VmTemplateSpec,
    progress: &mut dyn FnMut(&str),
) -> Result<TemplateMeta, VmTemplateError> {
    let dest = store.template_dir(name)?;
    if name == HOST_TEMPLATE || dest.exists() {
        return Err(VmTemplateError::Exists(name.to_string()));
    }
    let kvm = KvmProbe::run().kind;
    if kvm == KvmKind::None {
        return Err(VmTemplateError::NoKvm);
    }
    let (kernel, default_initrd) = match &spec.kernel {
        Some(k) => (k.clone(), None),
        None => {
            let default = default_kernel(store.root())?;
            preflight(kvm, Some(&default))?;
            (default.kernel, default.initrd)
        }
    };
    // After the host checks: where the template cannot be built here, that is the
    // failure to report, whatever the agent.
    super::image_agent::check(&spec.agent)?;
    let initrd = spec.initrd.clone().or(default_initrd);
    let kernel_mode = KernelMode::for_kvm(kvm).unwrap_or(KernelMode::Native);
    let staging = store.stage()?;
    let template = TemplateDir::new(staging.path());
    let tree = template.image_tree();
    let process = make_tree(&tree, &spec.tree, progress).map_err(VmTemplateError::Tree)?;
    if let Some(defaults) = &process {
        write_image_defaults(&tree, defaults)?;
    }
    progress("making the ext4 image");
    let image = template.image().rootfs();
    let image_bytes = make_root_image(&tree, &spec.agent, &image)?;
    std::fs::remove_dir_all(&tree)
        .map_err(|e| VmTemplateError::Io(format!("removing {}", tree.display()), e))?;

    let ctx = KvmContext::open().map_err(|_| VmTemplateError::NoKvm)?;
    // The NIC is unplugged while building: a sandbox with a network gets a TAP behind it.
    let vsock = template.build_vsock_socket();
    let devices = template_devices(&image, &vsock).map_err(VmTemplateError::Device)?;
    let tail = Arc::new(std::sync::Mutex::new((Vec::new(), String::new())));
    // Without an initramfs the kernel mounts the image and starts the agent from it;
    // with Cube's initramfs, earlyprintk shows where a slow or stuck boot is.
    let cmdline = if initrd.is_some() {
        INITRAMFS_CMDLINE
    } else {
        ROOT_DISK_CMDLINE
    };
    let config = LinuxBootConfig {
        kernel,
        initrd,
        cmdline: cmdline.into(),
        memory_bytes: spec.machine.memory_bytes,
        vcpus: spec.machine.vcpus,
        cmdline_devices: false,
        kernel_mode,
    };
    progress("booting the guest");
    let mut vm = linux_vm::boot_with_devices(
        &Arc::new(ctx),
        &config,
        Box::new(ConsoleTail(Arc::clone(&tail))),
        devices,
    )?;
    let started = Instant::now();
    loop {
        if let Some(why) = vm.fatal() {
            return Err(boot_failure(&why));
        }
        match agent_client(&vsock, Duration::from_millis(500)) {
            Ok(client) => {
                drop(client);
                break;
            }
            Err(VmAgentError::NotReady { .. }) => {}
            Err(e) => {
                tracing::debug!("agent not reachable yet: {}", error_chain(&e));
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        if started.elapsed() > spec.boot_timeout {
            let last = tail.lock().unwrap_or_else(|e| e.into_inner()).1.clone();
            return Err(if kvm == KvmKind::Pvm {
                VmTemplateError::TimeoutOnPvm(spec.boot_timeout, last)
            } else {
                VmTemplateError::Timeout(spec.boot_timeout, last)
            });
        }
        let last = tail.lock().unwrap_or_else(|e| e.into_inner()).1.clone();
        progress(&last);
    }
    progress("agent answered; snapshotting");
    vm.pause().map_err(linux_vm::BootError::from)?;
    vm.snapshot(staging.path(), None)?;
    drop(vm);
    let meta = TemplateMeta {
        name: name.to_string(),
        engine: Engine::Vm,
        machine: spec.machine,
        rootfs_bytes: image_bytes,
        created_unix: now_unix(),
        tree: None,
        built_from: Some(spec.tree.describe()),
        process,
    };
    cube_storage::write_atomic(&template.record(), TemplateDir::RECORD_KIND, &meta)?;
    let _ = std::fs::remove_file(&vsock);
    staging.commit(&dest)?;
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_run_to_its_end_says_how_it_went() {
        assert_eq!(run_to_its_end(&mut Command::new("true")).unwrap(), Ok(()));
        let failed = run_to_its_end(Command::new("sh").args(["-c", "echo bad >&2; exit 3"]));
        assert_eq!(failed.unwrap(), Err("bad".to_string()));
        let silent = run_to_its_end(Command::new("sh").args(["-c", "exit 4"]));
        assert!(silent.unwrap().unwrap_err().contains("4"));
        let missing = run_to_its_end(&mut Command::new("cube-no-such-program")).unwrap_err();
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound, "{missing}");
    }

    #[test]
    fn debian_default_kernel_on_pvm_is_refused_up_front_and_cubes_is_not() {
        let debian = DefaultKernel {
            kernel: "vmlinux".into(),
            initrd: Some("initramfs".into()),
            cube: false,
        };
        let cube = DefaultKernel {
            kernel: "vmlinux".into(),
            initrd: None,
            cube: true,
        };
        assert!(matches!(
            preflight(KvmKind::Pvm, Some(&debian)),
            Err(VmTemplateError::StockKernelOnPvm)
        ));
        assert!(preflight(KvmKind::Pvm, Some(&cube)).is_ok());
        // A kernel the user gave.
        assert!(preflight(KvmKind::Pvm, None).is_ok());
        assert!(preflight(KvmKind::Hardware, Some(&debian)).is_ok());
        assert!(matches!(
            preflight(KvmKind::None, None),
            Err(VmTemplateError::NoKvm)
        ));
        let why = "KVM could not emulate a guest instruction (RIP 0xffffffff81000000, \
                   instruction bytes 0f c7 f0; ...)";
        let err = boot_failure(why).to_string();
        assert!(err.contains("RIP 0xffffffff81000000"), "{err}");
        let text = VmTemplateError::StockKernelOnPvm.to_string();
        for needed in [
            "PVM",
            "emulated",
            "scripts/build-guest-kernel.sh",
            "--kernel",
            "--engine jail",
        ] {
            assert!(text.contains(needed), "{needed}: {text}");
        }
    }

    #[test]
    fn cubes_kernel_is_the_default_where_the_store_has_it() {
        let store = tempfile::tempdir().unwrap();
        let debian = store.path().join(DEBIAN_CLOUD_KERNEL);
        std::fs::create_dir_all(&debian).unwrap();
        std::fs::write(debian.join("vmlinux"), b"debian").unwrap();
        std::fs::write(debian.join("initramfs-cube.cpio.gz"), b"cpio").unwrap();
        // The store's own kernel comes before any of /var/lib/cube.
        let found = default_kernel(store.path()).unwrap();
        assert!(!found.cube);
        assert_eq!(found.kernel, debian.join("vmlinux"));
        assert_eq!(found.initrd, Some(debian.join("initramfs-cube.cpio.gz")));
        let cube = store.path().join(CUBE_GUEST_KERNEL);
        std::fs::create_dir_all(cube.join("0123abcd")).unwrap();
        std::fs::write(cube.join("0123abcd/vmlinux"), b"cube").unwrap();
        std::os::unix::fs::symlink("0123abcd/vmlinux", cube.join("vmlinux")).unwrap();
        let found = default_kernel(store.path()).unwrap();
        assert!(found.cube);
        assert_eq!(found.kernel, cube.join("vmlinux"));
        assert_eq!(found.initrd, None);
    }

    #[test]
    fn the_root_image_holds_the_tree_and_the_agent() {
        if Command::new("mkfs.ext4").arg("-V").output().is_err() {
            eprintln!("skipping: mkfs.ext4 is not installed");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("etc")).unwrap();
        std::fs::write(tree.join("etc/marker"), "in-the-image\n").unwrap();
        let agent = dir.path().join("agent");
        std::fs::write(&agent, b"\x7fELF-agent").unwrap();
        let image = dir.path().join("rootfs.img");
        let size = make_root_image(&tree, &agent, &image).unwrap();
        assert_eq!(std::fs::metadata(&image).unwrap().len(), size);
        // Read back with e2fsprogs' own reader, not through a mount.
        let cat = |path: &str| {
            let out = Command::new("debugfs")
                .arg("-R")
                .arg(format!("cat {path}"))
                .arg(&image)
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        assert_eq!(cat("/etc/marker"), "in-the-image\n");
        // The mount points a kernel booting from the image needs.
        let listing = Command::new("debugfs")
            .arg("-R")
            .arg("ls -l /")
            .arg(&image)
            .output()
            .unwrap();
        let listing = String::from_utf8_lossy(&listing.stdout);
        for (dir, mode) in MOUNT_POINTS {
            let line = listing
                .lines()
                .find(|l| l.split_whitespace().last() == Some(dir))
                .unwrap_or_else(|| panic!("no /{dir} in {listing}"));
            assert!(line.contains(&format!("{:o}", 0o40000 | mode)), "{line}");
        }
        assert_eq!(cat(&format!("/{IMAGE_AGENT_PATH}")), "\x7fELF-agent");
        // A failing mkfs (the image path is a directory) leaves a clear error.
        let err = make_root_image(&tree, &agent, dir.path()).unwrap_err();
        assert!(matches!(err, VmTemplateError::Mkfs(_)), "{err}");
    }
}
