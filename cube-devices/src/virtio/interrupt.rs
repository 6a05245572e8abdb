//! How a virtio device tells the guest that it used buffers.
//!
//! virtio-mmio has one interrupt per device, with an InterruptStatus register saying
//! why it fired. [`VirtioInterrupt`] keeps that register and drives an
//! [`InterruptLine`]: a KVM irq line ([`KvmIrqLine`], level-triggered, lowered once the
//! driver acknowledged every cause) or an irqfd ([`IrqFdLine`], edge).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use kvm_ioctls::VmFd;
use vmm_sys_util::eventfd::EventFd;

/// InterruptStatus bit: the device used buffers in at least one queue.
pub const INTERRUPT_USED_BUFFER: u32 = 1;
/// InterruptStatus bit: the device configuration changed.
pub const INTERRUPT_CONFIG_CHANGE: u32 = 2;

/// Why an interrupt could not be delivered.
#[derive(Debug, thiserror::Error)]
pub enum InterruptError {
    /// `KVM_IRQ_LINE` failed.
    #[error("Setting KVM irq line {gsi} to {level} failed")]
    IrqLine {
        /// The guest interrupt line.
        gsi: u32,
        /// The level that was being set.
        level: bool,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Writing the irqfd failed.
    #[error("Signalling the irqfd failed")]
    IrqFd(#[source] std::io::Error),
}

/// One interrupt line into the guest.
pub trait InterruptLine: Send + Sync {
    /// Asserts the line (level-triggered) or sends one edge.
    fn raise(&self) -> Result<(), InterruptError>;
    /// Deasserts a level-triggered line; an edge-triggered line does nothing.
    fn lower(&self) -> Result<(), InterruptError>;
}

/// A guest interrupt line driven with `KVM_IRQ_LINE` on a VM with an in-kernel irqchip.
pub struct KvmIrqLine {
    vm: Arc<VmFd>,
    gsi: u32,
}

impl KvmIrqLine {
    /// A line for global system interrupt `gsi` of `vm`.
    pub fn new(vm: Arc<VmFd>, gsi: u32) -> Self {
        KvmIrqLine { vm, gsi }
    }

    fn set(&self, level: bool) -> Result<(), InterruptError> {
        self.vm
            .set_irq_line(self.gsi, level)
            .map_err(|source| InterruptError::IrqLine {
                gsi: self.gsi,
                level,
                source,
            })
    }
}

impl InterruptLine for KvmIrqLine {
    fn raise(&self) -> Result<(), InterruptError> {
        self.set(true)
    }

    fn lower(&self) -> Result<(), InterruptError> {
        self.set(false)
    }
}

/// An edge-triggered line through an eventfd registered with `KVM_IRQFD`.
pub struct IrqFdLine {
    event: EventFd,
}

impl IrqFdLine {
    /// A line that signals `event` (register it with `VmFd::register_irqfd`).
    pub fn new(event: EventFd) -> Self {
        IrqFdLine { event }
    }

    /// The eventfd this line signals.
    pub fn event(&self) -> &EventFd {
        &self.event
    }
}

impl InterruptLine for IrqFdLine {
    fn raise(&self) -> Result<(), InterruptError> {
        self.event.write(1).map_err(InterruptError::IrqFd)
    }

    fn lower(&self) -> Result<(), InterruptError> {
        Ok(())
    }
}

/// A virtio-mmio device's interrupt: the InterruptStatus register plus its line.
pub struct VirtioInterrupt {
    status: AtomicU32,
    line: Arc<dyn InterruptLine>,
}

impl VirtioInterrupt {
    /// An interrupt with no cause pending, driving `line`.
    pub fn new(line: Arc<dyn InterruptLine>) -> Self {
        VirtioInterrupt {
            status: AtomicU32::new(0),
            line,
        }
    }

    /// Records that buffers were used and raises the line.
    pub fn signal_used_buffer(&self) -> Result<(), InterruptError> {
        self.signal(INTERRUPT_USED_BUFFER)
    }

    /// Records that the configuration changed and raises the line.
    pub fn signal_config_change(&self) -> Result<(), InterruptError> {
        self.signal(INTERRUPT_CONFIG_CHANGE)
    }

    fn signal(&self, cause: u32) -> Result<(), InterruptError> {
        self.status.fetch_or(cause, Ordering::SeqCst);
        self.line.raise()
    }

    /// The InterruptStatus register.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// Clears the causes in `bits` (an InterruptACK write); lowers the line once none
    /// is left.
    pub fn acknowledge(&self, bits: u32) -> Result<(), InterruptError> {
        let before = self.status.fetch_and(!bits, Ordering::SeqCst);
        if before & !bits == 0 {
            self.line.lower()?;
        }
        Ok(())
    }

    /// Sets the InterruptStatus register, re-raising the line when a cause is pending
    /// (used on restore and reset).
    pub fn set_status(&self, bits: u32) -> Result<(), InterruptError> {
        let bits = bits & (INTERRUPT_USED_BUFFER | INTERRUPT_CONFIG_CHANGE);
        self.status.store(bits, Ordering::SeqCst);
        if bits == 0 {
            self.line.lower()
        } else {
            self.line.raise()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::test_driver::RecordingLine;

    #[test]
    fn status_bits_and_line_follow_signal_and_ack() {
        let line = Arc::new(RecordingLine::default());
        let irq = VirtioInterrupt::new(line.clone());
        irq.signal_used_buffer().unwrap();
        irq.signal_config_change().unwrap();
        assert_eq!(irq.status(), 3);
        assert!(line.asserted());
        irq.acknowledge(INTERRUPT_USED_BUFFER).unwrap();
        assert_eq!(irq.status(), INTERRUPT_CONFIG_CHANGE);
        assert!(line.asserted(), "a cause is still pending");
        irq.acknowledge(INTERRUPT_CONFIG_CHANGE).unwrap();
        assert_eq!(irq.status(), 0);
        assert!(!line.asserted());
    }

    #[test]
    fn irqfd_line_signals_its_eventfd() {
        let event = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let line = IrqFdLine::new(event.try_clone().unwrap());
        line.raise().unwrap();
        line.raise().unwrap();
        assert_eq!(event.read().unwrap(), 2);
    }

    #[test]
    fn kvm_irq_line_drives_a_real_irqchip() {
        let kvm = match kvm_ioctls::Kvm::new() {
            Ok(kvm) => kvm,
            Err(e) => {
                println!("skipped: /dev/kvm unavailable: {e}");
                return;
            }
        };
        let vm = Arc::new(kvm.create_vm().unwrap());
        vm.create_irq_chip().unwrap();
        let line = KvmIrqLine::new(vm, 5);
        line.raise().unwrap();
        line.lower().unwrap();
    }
}
