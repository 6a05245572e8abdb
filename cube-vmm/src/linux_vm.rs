//! A Linux guest: booted from a kernel (an ELF `vmlinux` through its PVH entry point
//! or a bzImage through the 64-bit boot protocol, see [`crate::boot`]) with COM1 and
//! virtio devices, or restored from a snapshot; and its snapshots.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cube_mem::dirty::{CombinedTracker, DirtyBitmap, DirtyTracker, DirtyTrackerKind};
use cube_mem::GuestMemory;
use cube_storage::Durability;

use cube_devices::mmio_bus::MmioBus;
use cube_devices::port_io::PortIo;
use cube_devices::records::DeviceRecord;
use cube_devices::serial::LegacyPorts;
use cube_devices::virtio::device::VirtioDevice;
use cube_storage::durable_marker::{self as durability};
use cube_storage::SnapshotDir;

use crate::arch::x86_64::acpi;
use crate::arch::x86_64::layout::{ram_ranges, RamRange};
use crate::boot::{self, bzimage, pvh, LoadError, CMDLINE_ADDR};
use crate::device_manager::{VirtioDevices, VirtioDevicesError};
use crate::dirty_tracking::{self, TrackingError};
use crate::memory::{memory_layout, register_guest_memory};
use crate::persist::state::{self as format, GuestKind, MachineConfig, MachineState};
use crate::persist::SnapshotStats;
use crate::vcpu_runner::{AssistCounts, VcpuHandle, VcpuRunnerError};
use crate::vstate::emulation::KernelMode;
use crate::vstate::vcpu::Vcpu;
use crate::vstate::vm::{Vm, VmConfig};
use crate::vstate::KvmContext;

/// Most vCPUs a Linux guest can have here (xAPIC ids, one MADT entry each).
pub const MAX_LINUX_VCPUS: u8 = 64;
/// Why a kernel could not be booted.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The kernel, initrd or boot information could not be loaded.
    #[error("Loading the kernel")]
    Load(#[from] LoadError),
    /// The machine's shape cannot be booted.
    #[error("Invalid machine: {0}")]
    Config(String),
    /// Guest memory.
    #[error("Guest memory")]
    Memory(#[from] cube_mem::MemoryError),
    /// The memory size cannot be laid out.
    #[error("Guest memory layout")]
    Layout(#[from] crate::arch::x86_64::layout::LayoutError),
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
    /// No dirty-page tracking could be set up.
    #[error("Dirty-page tracking setup")]
    Tracking(#[source] Box<TrackingError>),
    /// Collecting the dirty pages failed.
    #[error("Dirty-page tracking")]
    Dirty(#[source] Box<cube_mem::dirty::DirtyError>),
    /// Writing the memory file failed.
    #[error("Writing the memory file")]
    MemoryFile(#[source] Box<cube_mem::memory_file::MemoryFileError>),
    /// The memory file a snapshot's diff is written against cannot be opened.
    #[error("Opening memory file {0}")]
    Parent(PathBuf, #[source] std::io::Error),
    /// The root disk could not be copied into the snapshot.
    #[error("Copying the root disk into the snapshot")]
    Disk(#[source] Box<cube_storage::CloneError>),
}

// Boxed: these errors are large, and a BootError travels inside SandboxError.
impl From<TrackingError> for BootError {
    fn from(e: TrackingError) -> Self {
        BootError::Tracking(Box::new(e))
    }
}

impl From<cube_mem::dirty::DirtyError> for BootError {
    fn from(e: cube_mem::dirty::DirtyError) -> Self {
        BootError::Dirty(Box::new(e))
    }
}

impl From<cube_mem::memory_file::MemoryFileError> for BootError {
    fn from(e: cube_mem::memory_file::MemoryFileError) -> Self {
        BootError::MemoryFile(Box::new(e))
    }
}

impl From<cube_storage::CloneError> for BootError {
    fn from(e: cube_storage::CloneError) -> Self {
        BootError::Disk(Box::new(e))
    }
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

/// A booting (or booted) Linux guest. Field order is drop order: vCPU threads and
/// the device loop stop before the VM closes, the VM closes before memory is unmapped.
///
/// Its memory is tracked for dirty pages from the start (KVM's dirty log where the
/// host has it, see [`dirty_tracking`], joined with the VMM's own writes), so every
/// snapshot after the first writes only the pages changed since the previous one.
pub struct LinuxVm {
    vcpus: Vec<VcpuHandle>,
    ports: Arc<LegacyPorts>,
    devices: VirtioDevices,
    tracker: CombinedTracker,
    vm: Vm,
    memory: GuestMemory,
    ram: Vec<RamRange>,
    /// The complete memory file that, plus the pages dirtied since, equals guest
    /// memory: the one restored from, then each committed snapshot's. Held open so
    /// that removing that snapshot cannot break later diffs. None after a fresh boot.
    parent: Option<std::fs::File>,
    /// Dirty pages collected by a snapshot not committed yet (or that failed): they
    /// are not safely anywhere but guest memory, so the next snapshot writes them too.
    carry: Option<DirtyBitmap>,
}

/// Sets up dirty-page tracking for `memory` and registers it with `vm` accordingly.
fn track_memory(vm: &Vm, memory: &GuestMemory) -> Result<CombinedTracker, BootError> {
    let kind = dirty_tracking::chosen_kind()?;
    // SAFETY: the caller moves `memory` into a LinuxVm, which drops it after the VM.
    unsafe { register_guest_memory(vm, memory, kind == DirtyTrackerKind::KvmDirtyLog)? };
    Ok(dirty_tracking::start(kind, vm, memory)?)
}

fn open_parent(path: &Path) -> Result<std::fs::File, BootError> {
    std::fs::File::open(path).map_err(|e| BootError::Parent(path.to_path_buf(), e))
}

/// A path through which `file` opens again even after it was unlinked.
fn fd_path(file: &std::fs::File) -> PathBuf {
    use std::os::fd::AsRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

impl LinuxVm {
    /// Why the guest stopped for good, if it did (triple fault, power-off, KVM error).
    pub fn fatal(&self) -> Option<String> {
        self.vcpus.iter().find_map(|v| v.fatal())
    }

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

    /// Guest memory.
    pub fn memory(&self) -> &GuestMemory {
        &self.memory
    }

    /// The guest's virtio devices.
    pub fn devices(&self) -> &VirtioDevices {
        &self.devices
    }

    /// Stops every vCPU at its current instruction.
    pub fn pause(&self) -> Result<(), BootError> {
        for v in &self.vcpus {
            v.request_pause()?;
        }
        for v in &self.vcpus {
            v.wait_parked()?;
        }
        Ok(())
    }

    /// Lets every vCPU run again.
    pub fn resume(&self) -> Result<(), BootError> {
        for v in &self.vcpus {
            v.resume()?;
        }
        Ok(())
    }

    /// Writes a snapshot of the paused guest into the empty directory `dir`: memory
    /// file, vCPU and VM state, COM1's registers and every virtio device's state
    /// (format v4); with `disk`, a copy of that file (the root disk) as
    /// [`SnapshotDir::rootfs`]. The vCPUs must be
    /// paused ([`LinuxVm::pause`]); they stay so.
    ///
    /// The devices are held still meanwhile (their transports locked, so the event
    /// loop serves nothing), so memory, device state and disk are of one instant.
    /// After a restore or a committed snapshot the memory file is a clone of that
    /// parent (a reflink where the filesystem can) with only the pages dirtied since
    /// written over it; after a fresh boot it holds the pages ever written.
    ///
    /// On failure the dirty pages are kept for the next attempt and the parent stays:
    /// nothing is lost and no earlier snapshot is touched. Call
    /// [`LinuxVm::snapshot_committed`] once `dir` has reached its final place.
    ///
    /// The devices' host sides are not in it (a clone gets its own disk copy, TAP and
    /// sockets).
    pub fn snapshot(
        &mut self,
        dir: &Path,
        disk: Option<&Path>,
    ) -> Result<SnapshotStats, BootError> {
        let quiet = self.devices.quiesce();
        // Collected with the devices still: nothing writes guest memory now.
        let mut dirty = self.tracker.collect()?;
        if let Some(carry) = self.carry.take() {
            dirty.or(&carry)?;
        }
        let result = write_snapshot(
            dir,
            disk,
            &dirty,
            &SnapshotParts {
                vcpus: &self.vcpus,
                ports: &self.ports,
                vm: &self.vm,
                memory: &self.memory,
                ram: &self.ram,
                parent: self.parent.as_ref(),
            },
            || Ok(quiet.save()?),
        );
        drop(quiet);
        // Until committed these pages are only in guest memory.
        self.carry = Some(dirty);
        result
    }

    /// Records that the snapshot last written now lives in `dir`: its memory file is
    /// the parent of the next diff, and the pages it holds are no longer pending.
    pub fn snapshot_committed(&mut self, dir: &Path) -> Result<(), BootError> {
        self.parent = Some(open_parent(&SnapshotDir::new(dir).memory())?);
        self.carry = None;
        Ok(())
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
        let memory_path = SnapshotDir::new(dir).memory();
        let memory = GuestMemory::restore_private(memory_layout(&state.ram)?, &memory_path)?;
        let parent = open_parent(&memory_path)?;
        let vm = Vm::new(
            ctx,
            &VmConfig {
                vcpus: state.config.vcpus,
                irqchip: true,
            },
        )?;
        let tracker = track_memory(&vm, &memory)?;
        let mut vcpus = Vec::with_capacity(state.vcpus.len());
        for (index, vcpu_state) in state.vcpus.iter().enumerate() {
            let vcpu = Vcpu::new(&vm, index as u8)?;
            vcpu.configure_cpuid()?;
            vcpu.restore_state(vcpu_state)?;
            vcpus.push(vcpu);
        }
        vm.restore_state(&state.vm)?;
        // After the irqchip: a device's pending interrupt is raised again on restore.
        let mut bus = MmioBus::new();
        let devices = VirtioDevices::restore(
            vm.fd(),
            memory.inner(),
            &mut bus,
            devices,
            &state.devices,
            cloned,
        )?;
        let legacy = Arc::new(match &state.serial {
            Some(serial) => LegacyPorts::restore(vm.shared_fd(), console, serial)
                .map_err(|e| BootError::Snapshot(e.to_string()))?,
            None => LegacyPorts::new(vm.shared_fd(), console),
        });
        let ports: Arc<dyn PortIo> = legacy.clone();
        let bus = Arc::new(bus);
        let handles = vcpus
            .into_iter()
            .map(|v| {
                VcpuHandle::spawn_with_memory(
                    v,
                    Some(Arc::clone(&ports)),
                    Some(Arc::clone(&bus)),
                    Some(memory.inner().clone()),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(LinuxVm {
            vcpus: handles,
            ports: legacy,
            devices,
            tracker,
            vm,
            memory,
            ram: state.ram,
            parent: Some(parent),
            carry: None,
        })
    }
}

/// What a snapshot reads from a [`LinuxVm`] besides its devices.
struct SnapshotParts<'a> {
    vcpus: &'a [VcpuHandle],
    ports: &'a LegacyPorts,
    vm: &'a Vm,
    memory: &'a GuestMemory,
    ram: &'a [RamRange],
    parent: Option<&'a std::fs::File>,
}

/// Writes memory (a diff against `parts.parent` where there is one), disk, and state
/// into `dir`; `devices` saves the (quiesced) devices' state.
fn write_snapshot(
    dir: &Path,
    disk: Option<&Path>,
    dirty: &DirtyBitmap,
    parts: &SnapshotParts<'_>,
    devices: impl FnOnce() -> Result<Vec<DeviceRecord>, BootError>,
) -> Result<SnapshotStats, BootError> {
    let snapshot_err = |e: &dyn std::fmt::Display| BootError::Snapshot(e.to_string());
    let memory_path = SnapshotDir::new(dir).memory();
    let dirty_pages = dirty.count() as u64;
    // Binds the memory file to this snapshot's state.
    let seal = cube_mem::Seal::random().map_err(|e| snapshot_err(&e))?;
    let stats = match parts.parent {
        Some(parent) => {
            let diff = cube_mem::memory_file::write_diff(
                &fd_path(parent),
                &memory_path,
                parts.memory,
                dirty,
                &seal,
                Durability::Deferred,
            )?;
            SnapshotStats {
                dirty_pages,
                bytes_written: diff.bytes_written,
                reflinked: diff.clone_method == cube_storage::CloneMethod::Reflink,
                paused_us: 0,
            }
        }
        None => {
            // Fresh memory: the pages ever written, from the memfd's own extents.
            let written = cube_mem::memory_file::write_full(
                &memory_path,
                parts.memory,
                None,
                &seal,
                Durability::Deferred,
            )?;
            SnapshotStats {
                dirty_pages,
                bytes_written: written.bytes_written,
                reflinked: false,
                paused_us: 0,
            }
        }
    };
    if let Some(disk) = disk {
        cube_storage::clone_file(disk, &SnapshotDir::new(dir).rootfs())?;
    }
    let mut vcpus = Vec::with_capacity(parts.vcpus.len());
    for v in parts.vcpus {
        vcpus.push(v.with_vcpu(|vcpu| vcpu.save_state())??);
    }
    let state = MachineState {
        format_version: format::FORMAT_VERSION,
        config: MachineConfig {
            vcpus: parts.vcpus.len() as u8,
            memory_bytes: parts.ram.iter().map(|r| r.size).sum(),
            irqchip: true,
        },
        ram: parts.ram.to_vec(),
        guest: GuestKind::Linux,
        vm: parts.vm.save_state()?,
        vcpus,
        boot_id: durability::boot_id().map_err(|e| snapshot_err(&e))?,
        devices: devices()?,
        serial: Some(parts.ports.save_serial()),
        memory_seal: Some(seal.0),
    };
    format::write_state(dir, &state).map_err(|e| snapshot_err(&e))?;
    Ok(stats)
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
    let ram = ram_ranges(config.memory_bytes)?;
    let memory = GuestMemory::anonymous(memory_layout(&ram)?)?;
    if config.vcpus == 0 || config.vcpus > MAX_LINUX_VCPUS {
        return Err(BootError::Config(format!(
            "{} vCPUs requested, 1..={MAX_LINUX_VCPUS} supported",
            config.vcpus
        )));
    }
    let vm = Vm::new(
        ctx,
        &VmConfig {
            vcpus: config.vcpus,
            irqchip: true,
        },
    )?;
    let tracker = track_memory(&vm, &memory)?;
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
                let m = boot::load_initrd(&memory, path, ram[0].size)?;
                Some((m.paddr, m.size))
            }
            None => None,
        };
        let cmdline_len = boot::write_cmdline(&memory, &cmdline)?;
        let inputs = bzimage::BootInputs {
            cmdline_addr: CMDLINE_ADDR,
            cmdline_len,
            initrd,
            rsdp,
        };
        bzimage::configure(memory.inner(), &kernel, &ram, &inputs)?
    } else {
        let entry = pvh::load_kernel(&memory, &config.kernel)?;
        let mut modules = Vec::new();
        if let Some(initrd) = &config.initrd {
            modules.push(boot::load_initrd(&memory, initrd, ram[0].size)?);
        }
        pvh::write_start_info(&memory, &ram, &cmdline, &modules, rsdp)?;
        pvh::pvh_registers(entry)
    };

    let vcpu = Vcpu::new(&vm, 0)?;
    vcpu.configure_cpuid_for(config.kernel_mode)?;
    // Keep KVM's reset APIC base (enabled, BSP): the kernel needs its local APIC.
    sregs.apic_base = vcpu
        .fd()
        .get_sregs()
        .map_err(|e| BootError::Config(format!("reading initial sregs: {e}")))?
        .apic_base;
    vcpu.set_initial_registers(&regs, &sregs)?;
    let legacy = Arc::new(LegacyPorts::new(vm.shared_fd(), console));
    let ports: Arc<dyn PortIo> = legacy.clone();
    let bus = Arc::new(bus);
    let mut handles = vec![VcpuHandle::spawn_with_memory(
        vcpu,
        Some(Arc::clone(&ports)),
        Some(Arc::clone(&bus)),
        Some(memory.inner().clone()),
    )?];
    // Application processors start halted in the in-kernel LAPIC (waiting for the
    // INIT/SIPI the kernel sends when it brings them up).
    for index in 1..config.vcpus {
        let ap = Vcpu::new(&vm, index)?;
        ap.configure_cpuid_for(config.kernel_mode)?;
        handles.push(VcpuHandle::spawn_with_memory(
            ap,
            Some(Arc::clone(&ports)),
            Some(Arc::clone(&bus)),
            Some(memory.inner().clone()),
        )?);
    }
    for handle in &handles {
        handle.resume()?;
    }
    Ok(LinuxVm {
        vcpus: handles,
        ports: legacy,
        devices,
        tracker,
        vm,
        memory,
        ram,
        parent: None,
        carry: None,
    })
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
