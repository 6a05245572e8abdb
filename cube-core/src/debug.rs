//! Booting a kernel in Cube's VMM by hand, for `cube debug boot`: no sandbox, no
//! supervisor, just a Linux VM with the devices asked for and a console, to see how
//! far a kernel gets on this host.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use cube_devices::virtio::block::{Block, BlockOptions};
use cube_devices::virtio::device::VirtioDevice;
use cube_devices::virtio::rng::Rng;
use cube_devices::virtio::vsock::Vsock;
use cube_storage::SandboxDir;
pub use cube_vmm::linux_vm::LinuxBootConfig;
use cube_vmm::linux_vm::{self, BootError, LinuxVm};
pub use cube_vmm::vcpu_runner::AssistCounts;
use cube_vmm::vstate::{KvmContext, VstateError};

/// The guest context id of the vsock device ([`BootOptions::vsock_dir`]).
pub const DEBUG_GUEST_CID: u64 = 3;

/// Why a debug boot could not start.
#[derive(Debug, thiserror::Error)]
pub enum DebugError {
    /// This host has no usable KVM.
    #[error("KVM")]
    NoKvm(#[source] VstateError),
    /// A device could not be created.
    #[error("Device: {0}")]
    Device(String),
    /// The kernel could not be booted.
    #[error("Booting")]
    Boot(#[from] BootError),
}

impl DebugError {
    /// What kind of failure this is: no KVM is the host's.
    pub fn kind(&self) -> crate::ErrorKind {
        match self {
            DebugError::NoKvm(_) => crate::ErrorKind::HostCannot,
            DebugError::Device(_) | DebugError::Boot(_) => crate::ErrorKind::Internal,
        }
    }
}

/// What to boot, and with which devices.
#[derive(Clone, Debug)]
pub struct BootOptions {
    /// The kernel, initrd, command line and machine shape.
    pub config: LinuxBootConfig,
    /// A virtio-blk disk backed by this image.
    pub disk: Option<PathBuf>,
    /// A virtio-vsock device (guest CID [`DEBUG_GUEST_CID`]) whose host side is
    /// `vsock.sock` in this directory.
    pub vsock_dir: Option<PathBuf>,
    /// A virtio-rng device.
    pub rng: bool,
}

/// A booting VM.
pub struct DebugVm {
    vm: LinuxVm,
}

impl DebugVm {
    /// Why the guest stopped for good, if it did.
    pub fn fatal(&self) -> Option<String> {
        self.vm.fatal()
    }

    /// The instructions the VMM finished for the guest's kernel where KVM's emulator
    /// gave up on them (see [`cube_vmm::vstate::emulation`]).
    pub fn assists(&self) -> AssistCounts {
        self.vm.assists()
    }
}

/// Boots `options`, the serial console going to `console`. The devices come in a fixed
/// order: disk, vsock, rng.
pub fn boot(options: &BootOptions, console: Box<dyn Write + Send>) -> Result<DebugVm, DebugError> {
    let device = |e: &dyn std::error::Error| DebugError::Device(crate::error_report::chain(e));
    let mut devices: Vec<Box<dyn VirtioDevice>> = Vec::new();
    if let Some(image) = &options.disk {
        let block = BlockOptions {
            read_only: false,
            id: "cube-debug".into(),
        };
        devices.push(Box::new(Block::open(image, block).map_err(|e| device(&e))?));
    }
    if let Some(dir) = &options.vsock_dir {
        let socket = SandboxDir::new(dir).vsock_socket();
        devices.push(Box::new(
            Vsock::new(DEBUG_GUEST_CID, &socket).map_err(|e| device(&e))?,
        ));
    }
    if options.rng {
        devices.push(Box::new(Rng::new()));
    }
    let ctx = Arc::new(KvmContext::open().map_err(DebugError::NoKvm)?);
    let vm = linux_vm::boot_with_devices(&ctx, &options.config, console, devices)?;
    Ok(DebugVm { vm })
}
