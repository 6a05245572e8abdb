//! VM templates of Linux guests: a root filesystem image (`mkfs.ext4 -d` from a tree,
//! with the agent in it), a guest booted on it with the disk, vsock and rng devices,
//! and, once its agent answers over vsock, a snapshot of that guest. Creating a
//! sandbox from the snapshot restores it; nothing boots again.
//!
//! A stock guest kernel needs VMX or SVM. On a PVM host (KVM without either) guest
//! kernel code runs emulated and Debian's kernel stops with KVM's emulation failure
//! early in its boot; only a `CONFIG_PVM_GUEST` kernel gets through. This module says
//! so up front for the known-stock default kernel, and recognises the emulation
//! failure when a given kernel runs into it, instead of waiting out a boot timeout.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cube_storage::TemplateDir;
use cube_vmm::host::{KvmKind, KvmProbe};
use cube_vmm::linux_vm::{self, LinuxBootConfig};
use cube_vmm::persist::MachineConfig;
use cube_vmm::vstate::KvmContext;

use super::tree::{make_tree, TemplateBuildError, TreeSource};
use crate::error_report::chain as error_chain;
use crate::records::{now_unix, Engine, TemplateMeta, HOST_TEMPLATE};
use crate::vm_agent::{agent_client, VmAgentError};
use crate::vm_devices::template_devices;

/// What a user on a PVM host with a stock kernel is told (by the build and by
/// `cube doctor`).
pub const PVM_STOCK_KERNEL: &str = "KVM on this host is PVM (no VMX/SVM): guest kernel code \
     runs emulated, and a stock Linux kernel stops early in its boot with KVM's emulation \
     failure. A Linux VM template needs a PVM-enabled guest kernel (CONFIG_PVM_GUEST, \
     given with --kernel) or a host with VMX/SVM; on this host use --engine jail.";

/// Where the agent goes inside the image (the jail engine binds it at the same path).
pub const IMAGE_AGENT_PATH: &str = ".cube/cube-agent";
/// The kernel package directory the set-up unpacks Debian's cloud kernel into.
pub const DEBIAN_CLOUD_KERNEL: &str = "kernels/debian-cloud";
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
        "No guest kernel: none given (--kernel) and none at {0} (run scripts/fetch-kernel.sh)"
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
    #[error("The guest's agent did not answer within {0:?} (last console line: {1:?}); KVM here is PVM, where a kernel that is not PVM-enabled (CONFIG_PVM_GUEST) runs emulated until KVM's emulation failure stops it; on this host use --engine jail")]
    TimeoutOnPvm(Duration, String),
    /// The store failed.
    #[error("Store")]
    Store(#[from] cube_storage::StoreError),
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

/// The kernel and initramfs the set-up unpacked: in the store's `kernels/debian-cloud`,
/// else in /var/lib/cube's. The ELF vmlinux (PVH entry, no decompression) is
/// preferred over the bzImage.
pub fn default_kernel(store_root: &Path) -> Result<(PathBuf, Option<PathBuf>), VmTemplateError> {
    let dirs = [
        store_root.join(DEBIAN_CLOUD_KERNEL),
        Path::new(SYSTEM_KERNELS).join(DEBIAN_CLOUD_KERNEL),
    ];
    for dir in &dirs {
        let kernel = ["vmlinux", "bzImage"]
            .iter()
            .map(|k| dir.join(k))
            .find(|p| p.is_file());
        if let Some(kernel) = kernel {
            let initrd = dir.join("initramfs-cube.cpio.gz");
            return Ok((kernel, initrd.is_file().then_some(initrd)));
        }
    }
    Err(VmTemplateError::NoKernel(dirs[1].clone()))
}

/// Refuses up front what cannot finish: no KVM, or the known-stock default kernel on
/// a PVM host. A kernel the user gave may be PVM-enabled; it gets its boot, and
/// [`boot_failure`] recognises the emulation failure if it is not.
pub fn preflight(kvm: KvmKind, kernel_given: bool) -> Result<(), VmTemplateError> {
    match kvm {
        KvmKind::None => Err(VmTemplateError::NoKvm),
        KvmKind::Pvm if !kernel_given => Err(VmTemplateError::StockKernelOnPvm),
        _ => Ok(()),
    }
}

/// Turns why a guest stopped into the error to report: on a PVM host KVM's emulation
/// failure means the kernel is not PVM-enabled.
pub fn boot_failure(kvm: KvmKind, why: &str) -> VmTemplateError {
    let emulation = why.contains("could not emulate") || why.contains("emulation failure");
    if kvm == KvmKind::Pvm && emulation {
        VmTemplateError::StockKernelOnPvm
    } else {
        VmTemplateError::GuestStopped(why.to_string())
    }
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
    // A quarter more than the files, plus room for the journal and the sandbox's
    // own writes; whole MiB.
    let bytes = tree_bytes(tree)?;
    let mib = (bytes + bytes / 4).div_ceil(1 << 20) + 256;
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "cube-root", "-d"])
        .arg(tree)
        .arg(image)
        .arg(format!("{mib}M"))
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            VmTemplateError::Mkfs(format!("cannot run it ({e}); apt-get install e2fsprogs"))
        })?;
    if !out.status.success() {
        let _ = std::fs::remove_file(image);
        return Err(VmTemplateError::Mkfs(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(mib << 20)
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
    preflight(kvm, spec.kernel.is_some())?;
    let (kernel, default_initrd) = match &spec.kernel {
        Some(k) => (k.clone(), None),
        None => default_kernel(store.root())?,
    };
    let initrd = spec.initrd.clone().or(default_initrd);
    let staging = store.stage()?;
    let template = TemplateDir::new(staging.path());
    let tree = template.image_tree();
    make_tree(&tree, &spec.tree, progress).map_err(VmTemplateError::Tree)?;
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
    let config = LinuxBootConfig {
        kernel,
        initrd,
        // earlyprintk: the console shows where a slow or stuck boot is from the start.
        cmdline: "console=ttyS0 earlyprintk=serial,ttyS0 reboot=k panic=-1 cube.root=/dev/vda"
            .into(),
        memory_bytes: spec.machine.memory_bytes,
        vcpus: spec.machine.vcpus,
        cmdline_devices: false,
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
            return Err(boot_failure(kvm, &why));
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
    vm.pause()?;
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
    fn a_stock_kernel_on_pvm_is_refused_up_front_and_recognised_when_it_stops() {
        assert!(matches!(
            preflight(KvmKind::Pvm, false),
            Err(VmTemplateError::StockKernelOnPvm)
        ));
        assert!(preflight(KvmKind::Pvm, true).is_ok());
        assert!(preflight(KvmKind::Hardware, false).is_ok());
        assert!(matches!(
            preflight(KvmKind::None, true),
            Err(VmTemplateError::NoKvm)
        ));
        let why = "KVM could not emulate a guest instruction (on PVM hosts ...)";
        assert!(matches!(
            boot_failure(KvmKind::Pvm, why),
            VmTemplateError::StockKernelOnPvm
        ));
        assert!(matches!(
            boot_failure(KvmKind::Hardware, why),
            VmTemplateError::GuestStopped(_)
        ));
        let text = VmTemplateError::StockKernelOnPvm.to_string();
        for needed in [
            "PVM",
            "emulation failure",
            "--kernel",
            "VMX/SVM",
            "--engine jail",
        ] {
            assert!(text.contains(needed), "{needed}: {text}");
        }
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
        assert_eq!(cat(&format!("/{IMAGE_AGENT_PATH}")), "\x7fELF-agent");
        // A failing mkfs (the image path is a directory) leaves a clear error.
        let err = make_root_image(&tree, &agent, dir.path()).unwrap_err();
        assert!(matches!(err, VmTemplateError::Mkfs(_)), "{err}");
    }
}
