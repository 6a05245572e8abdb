//! A Linux guest: booted from a kernel (an ELF `vmlinux` through its PVH entry point
//! or a bzImage through the 64-bit boot protocol, see [`crate::boot`]) with COM1 and
//! virtio devices, or restored from a snapshot; and its snapshots.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cube_devices::mmio_bus::MmioBus;
use cube_devices::port_io::PortIo;
use cube_devices::serial::LegacyPorts;
use cube_devices::virtio::device::VirtioDevice;

use crate::arch::x86_64::acpi;
use crate::boot::{self, bzimage, pvh, LoadError, CMDLINE_ADDR};
use crate::device_manager::{Quiesced, VirtioDevices, VirtioDevicesError};
use crate::microvm::{MicroVm, MicroVmBuilder, MicroVmError};
use crate::persist::snapshot_writer::{AfterSnapshot, GuestRecords, SnapshotGuest};
use crate::persist::state::{self as format, GuestKind, MachineConfig};
use crate::persist::SnapshotStats;
use crate::vcpu_runner::{AssistCounts, VcpuHandle, VcpuRunnerError};
use crate::vstate::emulation::KernelMode;
use crate::vstate::vcpu::Vcpu;
use crate::vstate::KvmContext;

/// Most vCPUs a Linux guest can have here (xAPIC ids, one MADT entry each).
pub const MAX_LINUX_VCPUS: u8 = 64;
/// Why a Linux guest could not be booted, restored or snapshotted.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The microVM under the guest failed.
    #[error(transparent)]
    Machine(#[from] MicroVmError),
    /// The kernel, initrd or boot information could not be loaded.
    #[error("Loading the kernel")]
    Load(#[from] LoadError),
    /// The machine's shape cannot be booted.
    #[error("Invalid machine: {0}")]
    Config(String),
    /// KVM VM.
    #[error("KVM VM")]
    Vm(#[from] crate::vstate::vm::VmError),
    /// KVM vCPU.
    #[error("KVM vCPU")]
    Vcpu(#[from] crate::vstate::vcpu::VcpuError),
    /// vCPU thread.
    #[error("vCPU thread")]
    Runner(#[from] VcpuRunnerError),
    /// Virtio devices.
    #[error("Virtio devices")]
    Devices(#[from] VirtioDevicesError),
    /// A snapshot could not be written or read.
    #[error("Snapshot: {0}")]
    Snapshot(String),
    /// A snapshot's state file is unusable.
    #[error("Snapshot state")]
    State(#[source] Box<format::FormatError>),
}

/// What to boot.
#[derive(Clone, Debug)]
pub struct LinuxBootConfig {
    /// An ELF `vmlinux` with a PVH entry, or a bzImage.
    pub kernel: PathBuf,
    /// An initramfs, if any.
    pub initrd: Option<PathBuf>,
    /// The kernel command line.
    pub cmdline: String,
    /// Guest RAM in bytes.
    pub memory_bytes: u64,
    /// Number of vCPUs (the kernel learns them from the ACPI MADT).
    pub vcpus: u8,
    /// Also announce the virtio devices with `virtio_mmio.device=` entries on the
    /// command line, for kernels built with `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES` but
    /// without ACPI. Off by default: a kernel that has both would find every device
    /// twice (once per table) and fail the second probe.
    pub cmdline_devices: bool,
    /// How the kernel's own code runs: [`KernelMode::Emulated`] (a kernel that is not
    /// PVM-enabled on a PVM host) adds CPUID masks and command-line switches (see
    /// [`crate::vstate::emulation`]); [`KernelMode::for_kvm`] chooses.
    pub kernel_mode: KernelMode,
}

/// A Linux guest's own part of its machine: COM1 and the other legacy ports, and
/// the virtio devices with their event loop.
pub struct LinuxGuest {
    ports: Arc<LegacyPorts>,
    devices: VirtioDevices,
}

impl SnapshotGuest for LinuxGuest {
    type Still<'a> = Quiesced<'a>;

    fn hold_still(&self) -> Quiesced<'_> {
        self.devices.quiesce()
    }

    fn records(&self, still: &Quiesced<'_>) -> Result<GuestRecords, MicroVmError> {
        Ok(GuestRecords {
            kind: GuestKind::Linux,
            devices: still
                .save()
                .map_err(|e| MicroVmError::Devices(Box::new(e)))?,
            serial: Some(self.ports.save_serial()),
        })
    }
}

/// A booting (or booted) Linux guest: a [`MicroVm`] with COM1 and virtio devices.
///
/// Its memory is tracked for dirty pages from the start (KVM's dirty log where the
/// host has it, see [`crate::dirty_tracking`], joined with the VMM's own writes), so
/// every snapshot after the first writes only the pages changed since the previous one.
pub type LinuxVm = MicroVm<LinuxGuest>;

impl MicroVm<LinuxGuest> {
    /// The instructions the VMM finished for the guest's kernel, all vCPUs together
    /// (see [`crate::vstate::emulation`]).
    pub fn assists(&self) -> AssistCounts {
        self.vcpus
            .iter()
            .map(VcpuHandle::assists)
            .fold(AssistCounts::default(), |a, b| AssistCounts {
                breakpoints: a.breakpoints + b.breakpoints,
                fwaits: a.fwaits + b.fwaits,
            })
    }

    /// The guest's virtio devices.
    pub fn devices(&self) -> &VirtioDevices {
        &self.guest.devices
    }

    /// Writes a snapshot of the guest into the empty directory `dir`: memory file,
    /// vCPU and VM state, COM1's registers and every virtio device's state (format
    /// v4); with `disk`, a copy of that file (the root disk) as
    /// [`cube_storage::SnapshotDir::rootfs`].
    ///
    /// A running guest's vCPUs stop, and its devices are held still (their transports
    /// locked, so the event loop serves nothing), only while the dirty set, the vCPU,
    /// VM and device state and the disk copy are taken: memory is copied after they
    /// continue, as of that instant (a live snapshot, see
    /// [`crate::persist::snapshot_writer`]); `paused_us` in the result says for how
    /// long. A paused guest stays paused and held still while everything is written.
    /// After a restore or a committed snapshot the memory file is a clone of that
    /// parent (a reflink where the filesystem can) with only the pages dirtied since
    /// written over it; after a fresh boot it holds the pages ever written.
    ///
    /// On failure the dirty pages are kept for the next attempt and the parent stays:
    /// nothing is lost and no earlier snapshot is touched. Call
    /// [`MicroVm::snapshot_committed`] once `dir` has reached its final place.
    ///
    /// The devices' host sides are not in it (a clone gets its own disk copy, TAP and
    /// sockets).
    pub fn snapshot(
        &mut self,
        dir: &Path,
        disk: Option<&Path>,
    ) -> Result<SnapshotStats, BootError> {
        Ok(self.snapshot_running(dir, disk, AfterSnapshot::Continue)?)
    }

    /// Writes the guest's last snapshot into `dir`, as [`Self::snapshot`] does, and
    /// leaves it stopped with its devices (a hibernation image): a running guest's
    /// dirty pages are pre-copied while it runs, and it stops only for the rest and its
    /// state. On failure it runs on as before, and the dirty pages are kept.
    pub fn final_snapshot(
        &mut self,
        dir: &Path,
        disk: Option<&Path>,
    ) -> Result<SnapshotStats, BootError> {
        Ok(self.snapshot_running(dir, disk, AfterSnapshot::Stop)?)
    }

    /// Restores the Linux snapshot in `dir` into a new VM, paused. `devices` must be
    /// the same kinds in the same order as when it was taken (with their own host
    /// sides); where `cloned`, they are told so (the rng moves to a new generation, the
    /// vsock device resets the guest's connections).
    pub fn restore(
        ctx: &Arc<KvmContext>,
        dir: &Path,
        console: Box<dyn Write + Send>,
        devices: Vec<Box<dyn VirtioDevice>>,
        cloned: bool,
    ) -> Result<LinuxVm, BootError> {
        let state = format::read_state(dir).map_err(|e| BootError::State(Box::new(e)))?;
        if state.guest != GuestKind::Linux {
            return Err(BootError::Snapshot(
                "the snapshot holds Cube's test guest, not a Linux guest".into(),
            ));
        }
        let builder = MicroVmBuilder::restored(ctx, &state, dir)?;
        let mut vcpus = Vec::with_capacity(state.vcpus.len());
        for (index, vcpu_state) in state.vcpus.iter().enumerate() {
            let vcpu = Vcpu::new(builder.vm(), index as u8)?;
            vcpu.configure_cpuid()?;
            vcpu.restore_state(vcpu_state)?;
            vcpus.push(vcpu);
        }
        builder.vm().restore_state(&state.vm)?;
        // After the irqchip: a device's pending interrupt is raised again on restore.
        let mut bus = MmioBus::new();
        let devices = VirtioDevices::restore(
            builder.vm().fd(),
            builder.memory().inner(),
            &mut bus,
            devices,
            &state.devices,
            cloned,
        )?;
        let vm = builder.vm();
        let legacy = Arc::new(match &state.serial {
            Some(serial) => LegacyPorts::restore(vm.shared_fd(), console, serial)
                .map_err(|e| BootError::Snapshot(e.to_string()))?,
            None => LegacyPorts::new(vm.shared_fd(), console),
        });
        let handles = spawn_vcpus(vcpus, &legacy, bus, &builder)?;
        let guest = LinuxGuest {
            ports: legacy,
            devices,
        };
        Ok(builder.build(handles, guest, false))
    }
}

/// Starts a thread for each of `vcpus`, with port I/O going to `ports` and MMIO to
/// `bus`. They stay parked until resumed.
fn spawn_vcpus(
    vcpus: Vec<Vcpu>,
    ports: &Arc<LegacyPorts>,
    bus: MmioBus,
    builder: &MicroVmBuilder,
) -> Result<Vec<VcpuHandle>, BootError> {
    let ports: Arc<dyn PortIo> = ports.clone();
    let bus = Arc::new(bus);
    let handles = vcpus
        .into_iter()
        .map(|v| {
            VcpuHandle::spawn_with_memory(
                v,
                Some(Arc::clone(&ports)),
                Some(Arc::clone(&bus)),
                Some(builder.memory().inner().clone()),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(handles)
}

/// Boots `config`; the serial console goes to `console`.
pub fn boot(
    ctx: &Arc<KvmContext>,
    config: &LinuxBootConfig,
    console: Box<dyn Write + Send>,
) -> Result<LinuxVm, BootError> {
    boot_with_devices(ctx, config, console, Vec::new())
}

/// Boots `config` with the virtio `devices` (announced to the kernel in its ACPI
/// tables, and on its command line where [`LinuxBootConfig::cmdline_devices`] asks);
/// the serial console goes to `console`.
pub fn boot_with_devices(
    ctx: &Arc<KvmContext>,
    config: &LinuxBootConfig,
    console: Box<dyn Write + Send>,
    devices: Vec<Box<dyn VirtioDevice>>,
) -> Result<LinuxVm, BootError> {
    if config.vcpus == 0 || config.vcpus > MAX_LINUX_VCPUS {
        return Err(BootError::Config(format!(
            "{} vCPUs requested, 1..={MAX_LINUX_VCPUS} supported",
            config.vcpus
        )));
    }
    let builder = MicroVmBuilder::fresh(
        ctx,
        MachineConfig {
            vcpus: config.vcpus,
            memory_bytes: config.memory_bytes,
            irqchip: true,
        },
    )?;
    let (vm, memory, ram) = (builder.vm(), builder.memory(), builder.ram());
    let bzimage = bzimage::is_bzimage(&config.kernel)
        .map_err(|e| LoadError::OpenKernel(config.kernel.clone(), e))?;
    let mut bus = MmioBus::new();
    let devices = VirtioDevices::attach(vm.fd(), memory.inner(), &mut bus, devices)?;
    let cmdline = with_switches(&config.cmdline, config.kernel_mode.cmdline_switches());
    let cmdline = if config.cmdline_devices {
        with_device_entries(&cmdline, &devices)
    } else {
        cmdline
    };
    let device_info: Vec<acpi::MmioDeviceInfo> = devices
        .devices()
        .iter()
        .map(|d| acpi::MmioDeviceInfo {
            base: d.base,
            irq: d.irq,
        })
        .collect();
    let rsdp = acpi::write_tables(memory.inner(), config.vcpus, &device_info)
        .map_err(|e| LoadError::BootParams(e.to_string()))?;
    let (regs, mut sregs) = if bzimage {
        let kernel = bzimage::load(memory.inner(), &config.kernel)?;
        let initrd = match &config.initrd {
            Some(path) => {
                let m = boot::load_initrd(memory, path, ram[0].size)?;
                Some((m.paddr, m.size))
            }
            None => None,
        };
        let cmdline_len = boot::write_cmdline(memory, &cmdline)?;
        let inputs = bzimage::BootInputs {
            cmdline_addr: CMDLINE_ADDR,
            cmdline_len,
            initrd,
            rsdp,
        };
        bzimage::configure(memory.inner(), &kernel, ram, &inputs)?
    } else {
        let entry = pvh::load_kernel(memory, &config.kernel)?;
        let mut modules = Vec::new();
        if let Some(initrd) = &config.initrd {
            modules.push(boot::load_initrd(memory, initrd, ram[0].size)?);
        }
        pvh::write_start_info(memory, ram, &cmdline, &modules, rsdp)?;
        pvh::pvh_registers(entry)
    };

    let vcpu = Vcpu::new(vm, 0)?;
    vcpu.configure_cpuid_for(config.kernel_mode)?;
    // Keep KVM's reset APIC base (enabled, BSP): the kernel needs its local APIC.
    sregs.apic_base = vcpu
        .fd()
        .get_sregs()
        .map_err(|e| BootError::Config(format!("reading initial sregs: {e}")))?
        .apic_base;
    vcpu.set_initial_registers(&regs, &sregs)?;
    let mut vcpus = vec![vcpu];
    // Application processors start halted in the in-kernel LAPIC (waiting for the
    // INIT/SIPI the kernel sends when it brings them up).
    for index in 1..config.vcpus {
        let ap = Vcpu::new(vm, index)?;
        ap.configure_cpuid_for(config.kernel_mode)?;
        vcpus.push(ap);
    }
    let legacy = Arc::new(LegacyPorts::new(vm.shared_fd(), console));
    let handles = spawn_vcpus(vcpus, &legacy, bus, &builder)?;
    let guest = LinuxGuest {
        ports: legacy,
        devices,
    };
    let mut machine = builder.build(handles, guest, false);
    machine.resume()?;
    Ok(machine)
}

/// `cmdline` followed by those of `switches` it does not already have (a switch the
/// user set, with any value, is left as the user set it).
fn with_switches(cmdline: &str, switches: &str) -> String {
    let name = |word: &str| word.split('=').next().unwrap_or(word).to_string();
    let present: Vec<String> = cmdline.split_whitespace().map(name).collect();
    let mut out = cmdline.trim_end().to_string();
    for switch in switches.split_whitespace() {
        if !present.contains(&name(switch)) {
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(switch);
        }
    }
    out
}

/// The user's command line followed by one `virtio_mmio.device=` entry per device.
fn with_device_entries(cmdline: &str, devices: &VirtioDevices) -> String {
    let entries = devices.cmdline();
    match (cmdline.trim().is_empty(), entries.is_empty()) {
        (_, true) => cmdline.to_string(),
        (true, false) => entries,
        (false, false) => format!("{} {entries}", cmdline.trim_end()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_are_appended_unless_the_user_set_them() {
        assert_eq!(
            with_switches("console=ttyS0 ", "noxsave clearcpuid=popcnt"),
            "console=ttyS0 noxsave clearcpuid=popcnt"
        );
        // The user's own value wins; only the missing switch is added.
        assert_eq!(
            with_switches("clearcpuid=popcnt,pku quiet", "noxsave clearcpuid=popcnt"),
            "clearcpuid=popcnt,pku quiet noxsave"
        );
        assert_eq!(with_switches("", "noxsave"), "noxsave");
        assert_eq!(with_switches("a b", ""), "a b");
        assert_eq!(
            with_switches("console=ttyS0", KernelMode::Native.cmdline_switches()),
            "console=ttyS0"
        );
    }
}
