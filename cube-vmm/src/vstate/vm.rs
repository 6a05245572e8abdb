//! A KVM virtual machine: its memory slots, in-kernel interrupt controllers and clock,
//! and the VM-wide state a snapshot saves.

use std::fmt;
use std::sync::Arc;

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_config, kvm_pit_state2, kvm_userspace_memory_region,
    KVM_CLOCK_REALTIME, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};

use super::context::KvmContext;
use super::kvm_bytes;

/// Where KVM puts the three-page TSS that Intel VMX needs for real-mode guests: just
/// below the 4 GiB boundary, out of the way of guest RAM and the usual MMIO holes.
const TSS_ADDRESS: usize = 0xfffb_d000;
/// The one-page identity-map table VMX uses for unpaged protected mode, right below
/// the TSS.
const IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;
/// Guest memory slots must be aligned to and sized in host pages.
const PAGE_SIZE: u64 = 4096;

/// Errors creating a VM or moving its state.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// The VM would have no vCPUs or more than KVM allows.
    #[error("Invalid vCPU count {vcpus} (KVM allows 1..={max})")]
    VcpuCount {
        /// The count asked for.
        vcpus: u8,
        /// KVM's limit (`KVM_CAP_MAX_VCPUS`).
        max: usize,
    },
    /// A memory slot's guest address, host address or size is not page-aligned, or
    /// its size is zero.
    #[error("Memory slot {slot} is not page-aligned or is empty")]
    UnalignedSlot {
        /// The slot asked for.
        slot: u32,
    },
    /// A saved VM state has interrupt-controller state exactly when this VM lacks an
    /// in-kernel irqchip, or the other way round.
    #[error("State {} irqchip state but VM has {} irqchip", if *.state { "has" } else { "lacks" }, if *.vm { "an" } else { "no" })]
    IrqchipMismatch {
        /// Whether the state carries irqchip state.
        state: bool,
        /// Whether this VM has an in-kernel irqchip.
        vm: bool,
    },
    /// A saved interrupt-controller entry names the wrong chip for its place.
    #[error("Irqchip state for chip {expected} names chip {found}")]
    WrongChip {
        /// The chip id this entry must have.
        expected: u32,
        /// The chip id it has.
        found: u32,
    },
    /// A KVM ioctl on the VM failed.
    #[error("{ioctl} failed")]
    Ioctl {
        /// The ioctl that failed.
        ioctl: &'static str,
        /// The error KVM returned.
        #[source]
        source: kvm_ioctls::Error,
    },
}

fn ioctl(ioctl: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Ioctl { ioctl, source }
}

/// How to build a VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmConfig {
    /// Number of vCPUs (their indices and APIC ids are `0..vcpus`).
    pub vcpus: u8,
    /// Whether KVM emulates the PIC, IOAPIC, LAPICs and PIT in the kernel.
    pub irqchip: bool,
}

/// A KVM virtual machine.
#[derive(Debug)]
pub struct Vm {
    /// Shared with the dirty-page tracker, which reads the dirty log through it.
    fd: Arc<VmFd>,
    ctx: Arc<KvmContext>,
    config: VmConfig,
}

impl Vm {
    /// Creates a VM: sets the TSS and identity-map addresses (which must precede vCPU
    /// creation) and, when `config.irqchip`, creates the in-kernel irqchip and a PIT.
    pub fn new(ctx: &Arc<KvmContext>, config: &VmConfig) -> Result<Self, VmError> {
        let max = ctx.kvm().get_max_vcpus();
        if config.vcpus == 0 || usize::from(config.vcpus) > max {
            return Err(VmError::VcpuCount {
                vcpus: config.vcpus,
                max,
            });
        }
        let fd = ctx.kvm().create_vm().map_err(ioctl("KVM_CREATE_VM"))?;
        fd.set_tss_address(TSS_ADDRESS)
            .map_err(ioctl("KVM_SET_TSS_ADDR"))?;
        fd.set_identity_map_address(IDENTITY_MAP_ADDRESS)
            .map_err(ioctl("KVM_SET_IDENTITY_MAP_ADDR"))?;
        if config.irqchip {
            fd.create_irq_chip().map_err(ioctl("KVM_CREATE_IRQCHIP"))?;
            // A dummy speaker port keeps writes to port 0x61, which PIT calibration
            // code makes, from exiting to userspace.
            let pit = kvm_pit_config {
                flags: KVM_PIT_SPEAKER_DUMMY,
                ..Default::default()
            };
            fd.create_pit2(pit).map_err(ioctl("KVM_CREATE_PIT2"))?;
        }
        Ok(Self {
            fd: Arc::new(fd),
            ctx: Arc::clone(ctx),
            config: *config,
        })
    }

    /// The KVM VM file descriptor (for dirty logs, irqfds, ioeventfds).
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// The VM file descriptor, shared (for the dirty-page tracker).
    pub fn shared_fd(&self) -> Arc<VmFd> {
        Arc::clone(&self.fd)
    }

    /// The context this VM was created from.
    pub fn context(&self) -> &Arc<KvmContext> {
        &self.ctx
    }

    /// How this VM was built.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// Maps `size` bytes of this process's memory at `host_addr` into the guest at
    /// `guest_addr` as memory slot `slot` (replacing what the slot held), with KVM
    /// dirty-page logging when `log_dirty`.
    ///
    /// This is `unsafe` rather than taking an owning memory type because the guest
    /// memory types live in `cube-mem`, which this layer must not tie itself to; the
    /// caller keeps the mapping alive, which is the one thing KVM cannot check.
    ///
    /// # Safety
    ///
    /// `host_addr..host_addr + size` must be a mapping of this process that stays
    /// mapped, and is not handed to anything that relies on the guest not writing it,
    /// until the slot is removed ([`Vm::remove_memory_slot`]) or this `Vm` is dropped:
    /// the guest (and KVM on its behalf) reads and writes it at any time.
    pub unsafe fn register_memory_slot(
        &self,
        slot: u32,
        guest_addr: u64,
        host_addr: u64,
        size: u64,
        log_dirty: bool,
    ) -> Result<(), VmError> {
        if size == 0 || !(guest_addr | host_addr | size).is_multiple_of(PAGE_SIZE) {
            return Err(VmError::UnalignedSlot { slot });
        }
        let region = kvm_userspace_memory_region {
            slot,
            flags: if log_dirty {
                KVM_MEM_LOG_DIRTY_PAGES
            } else {
                0
            },
            guest_phys_addr: guest_addr,
            memory_size: size,
            userspace_addr: host_addr,
        };
        // SAFETY: the caller guarantees the host range stays mapped for as long as the
        // slot exists (this function's contract); KVM checks the rest (overlaps,
        // slot limits).
        unsafe { self.fd.set_user_memory_region(region) }
            .map_err(ioctl("KVM_SET_USER_MEMORY_REGION"))
    }

    /// Removes memory slot `slot`; the guest loses access to its memory at once.
    pub fn remove_memory_slot(&self, slot: u32) -> Result<(), VmError> {
        let region = kvm_userspace_memory_region {
            slot,
            ..Default::default()
        };
        // SAFETY: a zero-sized region deletes the slot; KVM touches no host memory.
        unsafe { self.fd.set_user_memory_region(region) }
            .map_err(ioctl("KVM_SET_USER_MEMORY_REGION"))
    }

    /// Saves the VM-wide state: the KVM clock and, with an in-kernel irqchip, the PICs,
    /// the IOAPIC and the PIT. vCPUs should be stopped, or the clock keeps moving under
    /// a running guest.
    pub fn save_state(&self) -> Result<VmState, VmError> {
        let clock = self.fd.get_clock().map_err(ioctl("KVM_GET_CLOCK"))?;
        let irqchip = if self.config.irqchip {
            Some(IrqchipState {
                pic_master: self.get_irqchip(KVM_IRQCHIP_PIC_MASTER)?,
                pic_slave: self.get_irqchip(KVM_IRQCHIP_PIC_SLAVE)?,
                ioapic: self.get_irqchip(KVM_IRQCHIP_IOAPIC)?,
                pit: self.fd.get_pit2().map_err(ioctl("KVM_GET_PIT2"))?,
            })
        } else {
            None
        };
        Ok(VmState { clock, irqchip })
    }

    fn get_irqchip(&self, chip_id: u32) -> Result<IrqChip, VmError> {
        let mut chip = kvm_irqchip {
            chip_id,
            ..Default::default()
        };
        self.fd
            .get_irqchip(&mut chip)
            .map_err(ioctl("KVM_GET_IRQCHIP"))?;
        Ok(IrqChip(chip))
    }

    /// Restores a state saved by [`Vm::save_state`] into this VM, which must have been
    /// built with the same `irqchip` setting.
    ///
    /// Order as in Firecracker: PIT, clock, PIC master, PIC slave, IOAPIC.
    ///
    /// The clock: `KVM_CLOCK_TSC_STABLE` and `KVM_CLOCK_HOST_TSC` describe the host at
    /// save time and `KVM_SET_CLOCK` does not take them (older kernels refuse any flag).
    /// `KVM_CLOCK_REALTIME`, where the kernel takes it, is kept: KVM then advances the
    /// guest clock by the wall-clock time since the save, so a guest woken from a
    /// snapshot does not see its time stand still for as long as it was saved.
    pub fn restore_state(&self, state: &VmState) -> Result<(), VmError> {
        state.validate()?;
        if state.irqchip.is_some() != self.config.irqchip {
            return Err(VmError::IrqchipMismatch {
                state: state.irqchip.is_some(),
                vm: self.config.irqchip,
            });
        }
        if let Some(chips) = &state.irqchip {
            self.fd
                .set_pit2(&chips.pit)
                .map_err(ioctl("KVM_SET_PIT2"))?;
        }
        let mut clock = state.clock;
        clock.flags &= if self.ctx.clock_realtime() {
            KVM_CLOCK_REALTIME
        } else {
            0
        };
        self.fd.set_clock(&clock).map_err(ioctl("KVM_SET_CLOCK"))?;
        if let Some(chips) = &state.irqchip {
            for chip in [&chips.pic_master, &chips.pic_slave, &chips.ioapic] {
                self.fd
                    .set_irqchip(&chip.0)
                    .map_err(ioctl("KVM_SET_IRQCHIP"))?;
            }
        }
        Ok(())
    }
}

/// The VM-wide KVM state of a snapshot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VmState {
    /// The KVM clock (`KVM_GET_CLOCK`), flags as KVM returned them.
    #[serde(with = "kvm_bytes")]
    pub clock: kvm_clock_data,
    /// In-kernel interrupt controllers and PIT; `None` for a VM without irqchip.
    pub irqchip: Option<IrqchipState>,
}

impl VmState {
    /// Checks what can be checked without KVM: each irqchip entry names its own chip.
    /// Restoring calls this; a state read from a file can be checked before that.
    pub fn validate(&self) -> Result<(), VmError> {
        if let Some(chips) = &self.irqchip {
            for (chip, expected) in [
                (&chips.pic_master, KVM_IRQCHIP_PIC_MASTER),
                (&chips.pic_slave, KVM_IRQCHIP_PIC_SLAVE),
                (&chips.ioapic, KVM_IRQCHIP_IOAPIC),
            ] {
                if chip.0.chip_id != expected {
                    return Err(VmError::WrongChip {
                        expected,
                        found: chip.0.chip_id,
                    });
                }
            }
        }
        Ok(())
    }
}

/// The in-kernel interrupt controllers and PIT of a VM.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IrqchipState {
    /// The master 8259 PIC.
    pub pic_master: IrqChip,
    /// The slave 8259 PIC.
    pub pic_slave: IrqChip,
    /// The IOAPIC.
    pub ioapic: IrqChip,
    /// The 8254 PIT (`KVM_GET_PIT2`).
    #[serde(with = "kvm_bytes")]
    pub pit: kvm_pit_state2,
}

/// One in-kernel interrupt controller's state (`KVM_GET_IRQCHIP`).
///
/// A newtype because `kvm_irqchip` holds a union: kvm-bindings gives it neither
/// `PartialEq` nor a `Debug` that shows its contents. The field is private so that
/// every `IrqChip` comes from KVM or from exactly 520 deserialised bytes: safe code
/// can build a `kvm_irqchip` whose union is only partly initialised, which
/// [`IrqChip::bytes`] must never read.
#[derive(Clone, Copy, Serialize, Deserialize)]
#[serde(transparent)]
pub struct IrqChip(#[serde(with = "kvm_bytes")] kvm_irqchip);

impl IrqChip {
    /// The chip's `kvm_irqchip`, as `KVM_SET_IRQCHIP` takes it.
    pub fn raw(&self) -> &kvm_irqchip {
        &self.0
    }

    /// The controller's register bytes (the 512-byte union).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `dummy` spans the whole union, and every byte of it is initialised: an
        // `IrqChip` is only built here, zeroed (`Default`) and then written by KVM, or
        // transmuted from exactly 520 bytes by the deserialiser; later writes through
        // the union's PIC/IOAPIC variants cannot uninitialise bytes, as those types have
        // no padding (kvm-bindings derives zerocopy's `IntoBytes` for them). Reading
        // `c_char`s as `u8`s is a same-size, same-alignment cast.
        unsafe {
            std::slice::from_raw_parts(
                self.0.chip.dummy.as_ptr().cast::<u8>(),
                self.0.chip.dummy.len(),
            )
        }
    }
}

impl PartialEq for IrqChip {
    fn eq(&self, other: &Self) -> bool {
        self.0.chip_id == other.0.chip_id && self.bytes() == other.bytes()
    }
}

impl fmt::Debug for IrqChip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("IrqChip");
        s.field("chip_id", &self.0.chip_id);
        let chip = &self.0.chip;
        match self.0.chip_id {
            KVM_IRQCHIP_PIC_MASTER | KVM_IRQCHIP_PIC_SLAVE => {
                // SAFETY: every byte of the union is initialised (see `bytes`), and any
                // bit pattern is a valid `kvm_pic_state` (integers only).
                let pic = unsafe { &chip.pic };
                s.field("pic", pic)
            }
            KVM_IRQCHIP_IOAPIC => {
                // SAFETY: as above, for `kvm_ioapic_state` (integers and unions of them).
                let ioapic = unsafe { &chip.ioapic };
                s.field("ioapic", ioapic)
            }
            _ => s.field("bytes", &self.bytes()),
        };
        s.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::test_context;

    fn pit_without_load_times(mut pit: kvm_pit_state2) -> kvm_pit_state2 {
        for channel in &mut pit.channels {
            channel.count_load_time = 0;
        }
        pit
    }

    #[test]
    fn state_round_trips_into_fresh_vm_with_irqchip() {
        let Some(ctx) = test_context() else { return };
        let config = VmConfig {
            vcpus: 2,
            irqchip: true,
        };
        let vm = Vm::new(&ctx, &config).unwrap();
        // Give the IOAPIC and PIT something to remember: an unmasked redirection entry
        // and a raised line, and a PIT channel counting.
        vm.fd().set_irq_line(4, true).unwrap();
        let mut state = vm.save_state().unwrap();
        let chips = state.irqchip.as_mut().unwrap();
        // SAFETY: test-only poke at the IOAPIC variant of a chip read from KVM.
        unsafe {
            chips.ioapic.0.chip.ioapic.redirtbl[4].bits = 0x0000_0000_0000_0031;
            chips.ioapic.0.chip.ioapic.id = 0x0100_0000;
            chips.pic_master.0.chip.pic.imr = 0xe5;
        }
        chips.pit.channels[0].count = 0x1234;
        chips.pit.channels[0].mode = 2;
        vm.restore_state(&state).unwrap();
        let saved = vm.save_state().unwrap();

        let fresh = Vm::new(&ctx, &config).unwrap();
        fresh.restore_state(&saved).unwrap();
        let again = fresh.save_state().unwrap();

        let (a, b) = (
            saved.irqchip.as_ref().unwrap(),
            again.irqchip.as_ref().unwrap(),
        );
        assert_eq!(a.pic_master, b.pic_master);
        assert_eq!(a.pic_slave, b.pic_slave);
        assert_eq!(a.ioapic, b.ioapic);
        // SAFETY: reading the IOAPIC variant of a chip read from KVM.
        assert_eq!(unsafe { b.ioapic.0.chip.ioapic.redirtbl[4].bits }, 0x31);
        // SAFETY: reading the PIC variant of a chip read from KVM.
        assert_eq!(unsafe { b.pic_master.0.chip.pic.imr }, 0xe5);
        // KVM_SET_PIT2 reloads each channel's count, stamping it with the host time of
        // the restore, so count_load_time legitimately differs; the rest must not.
        assert_eq!(pit_without_load_times(a.pit), pit_without_load_times(b.pit));
        assert_eq!(b.pit.channels[0].count, 0x1234);
        assert_clock_follows(&saved.clock, &again.clock);
    }

    /// The restored clock continues from the saved one: never earlier, and only ahead
    /// by the time that passed (generous bound: test hosts are slow and shared).
    fn assert_clock_follows(saved: &kvm_clock_data, restored: &kvm_clock_data) {
        assert!(restored.clock >= saved.clock, "{restored:?} < {saved:?}");
        assert!(
            restored.clock - saved.clock < 5_000_000_000,
            "clock jumped {} ns",
            restored.clock - saved.clock
        );
    }

    #[test]
    fn state_round_trips_into_fresh_vm_without_irqchip() {
        let Some(ctx) = test_context() else { return };
        let config = VmConfig {
            vcpus: 1,
            irqchip: false,
        };
        let vm = Vm::new(&ctx, &config).unwrap();
        let mut state = vm.save_state().unwrap();
        assert!(state.irqchip.is_none());
        // A clock well ahead of a fresh VM's proves the value is carried over.
        state.clock.clock += 3_600_000_000_000;
        vm.restore_state(&state).unwrap();
        let saved = vm.save_state().unwrap();
        assert!(saved.clock.clock >= state.clock.clock);

        let fresh = Vm::new(&ctx, &config).unwrap();
        fresh.restore_state(&saved).unwrap();
        let again = fresh.save_state().unwrap();
        assert_clock_follows(&saved.clock, &again.clock);
    }

    #[test]
    fn state_survives_postcard() {
        let Some(ctx) = test_context() else { return };
        for irqchip in [true, false] {
            let vm = Vm::new(&ctx, &VmConfig { vcpus: 1, irqchip }).unwrap();
            let state = vm.save_state().unwrap();
            let bytes = postcard::to_allocvec(&state).unwrap();
            let back: VmState = postcard::from_bytes(&bytes).unwrap();
            assert_eq!(back, state);
            vm.restore_state(&back).unwrap();
        }
    }

    #[test]
    fn mismatched_or_tampered_state_is_rejected() {
        let Some(ctx) = test_context() else { return };
        let with = Vm::new(
            &ctx,
            &VmConfig {
                vcpus: 1,
                irqchip: true,
            },
        )
        .unwrap();
        let without = Vm::new(
            &ctx,
            &VmConfig {
                vcpus: 1,
                irqchip: false,
            },
        )
        .unwrap();
        let state = with.save_state().unwrap();
        assert!(matches!(
            without.restore_state(&state),
            Err(VmError::IrqchipMismatch {
                state: true,
                vm: false
            })
        ));
        assert!(matches!(
            with.restore_state(&without.save_state().unwrap()),
            Err(VmError::IrqchipMismatch {
                state: false,
                vm: true
            })
        ));

        let mut swapped = state.clone();
        let chips = swapped.irqchip.as_mut().unwrap();
        std::mem::swap(&mut chips.pic_master, &mut chips.ioapic);
        assert!(matches!(
            swapped.validate(),
            Err(VmError::WrongChip {
                expected: 0,
                found: 2
            })
        ));
        assert!(with.restore_state(&swapped).is_err());

        // A truncated PIT record in an otherwise well-formed file.
        let mut bytes = postcard::to_allocvec(&state).unwrap();
        let pit_len = std::mem::size_of::<kvm_pit_state2>();
        // The PIT comes last: a one-byte varint length (112 < 128), then its bytes.
        let len_at = bytes.len() - pit_len - 1;
        assert_eq!(usize::from(bytes[len_at]), pit_len);
        bytes[len_at] -= 1;
        bytes.pop();
        assert!(postcard::from_bytes::<VmState>(&bytes).is_err());
    }

    #[test]
    fn bad_config_and_slots_are_rejected() {
        let Some(ctx) = test_context() else { return };
        assert!(matches!(
            Vm::new(
                &ctx,
                &VmConfig {
                    vcpus: 0,
                    irqchip: false
                }
            ),
            Err(VmError::VcpuCount { vcpus: 0, .. })
        ));
        let vm = Vm::new(
            &ctx,
            &VmConfig {
                vcpus: 1,
                irqchip: false,
            },
        )
        .unwrap();
        let mut page = vec![0u8; 2 * PAGE_SIZE as usize];
        let misaligned = page.as_mut_ptr() as u64 + 1;
        // SAFETY: rejected before KVM sees it.
        let err = unsafe { vm.register_memory_slot(0, 0, misaligned, PAGE_SIZE, false) };
        assert!(matches!(err, Err(VmError::UnalignedSlot { slot: 0 })));
    }

    #[test]
    fn memory_slot_registers_logs_and_removes() {
        let Some(ctx) = test_context() else { return };
        let vm = Vm::new(
            &ctx,
            &VmConfig {
                vcpus: 1,
                irqchip: false,
            },
        )
        .unwrap();
        let size = 16 * PAGE_SIZE as usize;
        // SAFETY: a fresh anonymous mapping, unmapped only after the VM is dropped.
        let mem = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(mem, libc::MAP_FAILED);
        // SAFETY: `mem` outlives the slot: it is unmapped after `vm` is dropped.
        unsafe { vm.register_memory_slot(1, 0x10_0000, mem as u64, size as u64, true) }.unwrap();
        let bitmap = vm.fd().get_dirty_log(1, size).unwrap();
        assert_eq!(bitmap.iter().map(|w| w.count_ones()).sum::<u32>(), 0);
        vm.remove_memory_slot(1).unwrap();
        assert!(vm.fd().get_dirty_log(1, size).is_err(), "slot is gone");
        drop(vm);
        // SAFETY: unmapping what we mapped above; no VM references it any more.
        assert_eq!(unsafe { libc::munmap(mem, size) }, 0);
    }
}
