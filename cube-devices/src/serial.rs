//! The legacy COM1 serial port (a 16550 UART from vm-superio) and the port-I/O bus it
//! sits on: what a Linux guest's console writes reaches the host here. The same bus
//! decodes the i8042's reset command and the ACPI sleep registers (the VMM's FADT
//! points the guest at [`SLEEP_CONTROL_PORT`]), so a guest can reset or power off.

use std::io::Write;
use std::sync::{Arc, Mutex};

use kvm_ioctls::VmFd;
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};

use crate::port_io::PortIo;
use crate::records::SerialRecord;

/// Why the serial port could not be restored.
#[derive(Debug, thiserror::Error)]
pub enum SerialError {
    /// vm-superio refused the saved registers.
    #[error("Restoring COM1 failed: {0}")]
    Restore(String),
}

/// First I/O port of COM1, the console UART.
pub const COM1_BASE: u16 = 0x3f8;
/// I/O ports COM1 decodes.
pub const COM1_PORTS: u16 = 8;
/// COM1's interrupt line (ISA IRQ 4, the same GSI on the IO-APIC); the VMM's DSDT
/// names it for the guest.
pub const COM1_IRQ: u32 = 4;

/// Raises COM1's interrupt line on the in-kernel interrupt controller.
pub struct IrqLine {
    vm: Arc<VmFd>,
}

impl Trigger for IrqLine {
    type E = kvm_ioctls::Error;

    fn trigger(&self) -> Result<(), Self::E> {
        // An edge: the PIC latches it, the IOAPIC routes it as ISA IRQ 4.
        self.vm.set_irq_line(COM1_IRQ, true)?;
        self.vm.set_irq_line(COM1_IRQ, false)
    }
}

/// The hardware-reduced sleep control register (one byte of port I/O): the guest
/// powers off by writing SLP_EN with SLP_TYP = [`S5_SLEEP_TYPE`].
pub const SLEEP_CONTROL_PORT: u16 = 0x3c0;
/// The sleep status register (reads as zero).
pub const SLEEP_STATUS_PORT: u16 = 0x3c1;
/// The SLP_TYP value the DSDT's `\_S5` names for soft-off.
pub const S5_SLEEP_TYPE: u8 = 5;

/// The i8042 keyboard controller's data port.
pub const I8042_DATA: u16 = 0x60;
/// The i8042 keyboard controller's command/status port.
pub const I8042_COMMAND: u16 = 0x64;
/// The i8042 command that pulses the CPU reset line (Linux's `reboot=k`).
const I8042_RESET: u8 = 0xfe;

/// The legacy port-I/O bus of a microVM: COM1, and just enough of the i8042 for a
/// guest to reset the machine (other ports read as all ones, as on a real bus with no
/// device).
pub struct LegacyPorts {
    com1: Mutex<Serial<IrqLine, NoEvents, Box<dyn Write + Send>>>,
    reset_requested: std::sync::atomic::AtomicBool,
    poweroff_requested: std::sync::atomic::AtomicBool,
}

impl LegacyPorts {
    /// A bus whose COM1 writes to `console` and interrupts through `vm`'s irqchip.
    pub fn new(vm: Arc<VmFd>, console: Box<dyn Write + Send>) -> Self {
        LegacyPorts {
            com1: Mutex::new(Serial::new(IrqLine { vm }, console)),
            reset_requested: std::sync::atomic::AtomicBool::new(false),
            poweroff_requested: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Like [`LegacyPorts::new`], with COM1's registers as `state` saved them.
    pub fn restore(
        vm: Arc<VmFd>,
        console: Box<dyn Write + Send>,
        state: &SerialRecord,
    ) -> Result<Self, SerialError> {
        let state = SerialState {
            baud_divisor_low: state.baud_divisor_low,
            baud_divisor_high: state.baud_divisor_high,
            interrupt_enable: state.interrupt_enable,
            interrupt_identification: state.interrupt_identification,
            line_control: state.line_control,
            line_status: state.line_status,
            modem_control: state.modem_control,
            modem_status: state.modem_status,
            scratch: state.scratch,
            in_buffer: state.in_buffer.clone(),
        };
        let com1 = Serial::from_state(&state, IrqLine { vm }, NoEvents, console)
            .map_err(|e| SerialError::Restore(format!("{e:?}")))?;
        Ok(LegacyPorts {
            com1: Mutex::new(com1),
            reset_requested: std::sync::atomic::AtomicBool::new(false),
            poweroff_requested: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// COM1's registers, for a snapshot.
    pub fn save_serial(&self) -> SerialRecord {
        let s = self.com1.lock().unwrap_or_else(|e| e.into_inner()).state();
        SerialRecord {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }

    fn com1_offset(port: u16) -> Option<u8> {
        port.checked_sub(COM1_BASE)
            .filter(|o| *o < COM1_PORTS)
            .map(|o| o as u8)
    }
}

impl PortIo for LegacyPorts {
    fn read(&self, port: u16, data: &mut [u8]) {
        match (Self::com1_offset(port), data.len()) {
            (Some(offset), 1) => {
                let mut com1 = self.com1.lock().unwrap_or_else(|e| e.into_inner());
                data[0] = com1.read(offset);
            }
            // An i8042 with empty buffers: the guest's probe sees a controller that
            // never has data, and its reset command is taken.
            (None, 1) if port == I8042_DATA || port == I8042_COMMAND => data[0] = 0,
            // The ACPI sleep registers: nothing pending, never asleep.
            (None, 1) if port == SLEEP_CONTROL_PORT || port == SLEEP_STATUS_PORT => data[0] = 0,
            _ => data.fill(0xff),
        }
    }

    fn write(&self, port: u16, data: &[u8]) {
        if port == I8042_COMMAND && data == [I8042_RESET] {
            self.reset_requested
                .store(true, std::sync::atomic::Ordering::SeqCst);
            return;
        }
        if let (SLEEP_CONTROL_PORT, [value]) = (port, data) {
            // SLP_EN (bit 5) with SLP_TYP (bits 2..4) = soft-off.
            if value & 0x20 != 0 && (value >> 2) & 0x7 == S5_SLEEP_TYPE {
                self.poweroff_requested
                    .store(true, std::sync::atomic::Ordering::SeqCst);
            }
            return;
        }
        if let (Some(offset), [value]) = (Self::com1_offset(port), data) {
            let mut com1 = self.com1.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(e) = com1.write(offset, *value) {
                tracing::debug!("COM1 write: {e:?}");
            }
        }
    }

    fn stop_requested(&self) -> Option<String> {
        if self
            .poweroff_requested
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Some("guest powered off (ACPI S5)".to_string());
        }
        self.reset_requested
            .load(std::sync::atomic::Ordering::SeqCst)
            .then(|| "guest reset the machine through the i8042 controller".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A console writer the test can read back.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn com1_writes_reach_the_console_and_other_ports_float() {
        if !std::path::Path::new("/dev/kvm").exists() {
            eprintln!("skipped: /dev/kvm not present");
            return;
        }
        let kvm = kvm_ioctls::Kvm::new().unwrap();
        let vm = kvm.create_vm().unwrap();
        vm.create_irq_chip().unwrap();
        let captured = Captured::default();
        let ports = LegacyPorts::new(Arc::new(vm), Box::new(captured.clone()));
        for byte in b"ok\n" {
            ports.write(COM1_BASE, &[*byte]);
        }
        assert_eq!(captured.0.lock().unwrap().as_slice(), b"ok\n");
        // Line status: transmitter empty, as a polling driver expects.
        let mut lsr = [0u8];
        ports.read(COM1_BASE + 5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0);
        // No device answers elsewhere; wide accesses to COM1 are not decoded either.
        let mut nothing = [0u8; 2];
        ports.read(0x80, &mut nothing);
        assert_eq!(nothing, [0xff, 0xff]);
        ports.read(COM1_BASE, &mut nothing);
        assert_eq!(nothing, [0xff, 0xff]);
        // The i8042: an idle controller, and a reset the vCPU loop reports.
        let mut status = [0xffu8];
        ports.read(I8042_COMMAND, &mut status);
        assert_eq!(status, [0]);
        assert_eq!(ports.stop_requested(), None);
        ports.write(I8042_COMMAND, &[0xaa]);
        assert_eq!(ports.stop_requested(), None);
        // ACPI soft-off: SLP_TYP 5 with SLP_EN; other sleep states are ignored.
        ports.write(SLEEP_CONTROL_PORT, &[(3 << 2) | 0x20]);
        assert_eq!(ports.stop_requested(), None);
        ports.write(SLEEP_CONTROL_PORT, &[(5 << 2) | 0x20]);
        assert!(ports.stop_requested().unwrap().contains("powered off"));
        let ports = LegacyPorts::new(
            Arc::new(kvm_ioctls::Kvm::new().unwrap().create_vm().unwrap()),
            Box::new(Captured::default()),
        );
        ports.write(I8042_COMMAND, &[0xfe]);
        assert!(ports.stop_requested().unwrap().contains("reset"));
    }

    #[test]
    fn com1_registers_survive_save_and_restore() {
        if !std::path::Path::new("/dev/kvm").exists() {
            eprintln!("skipped: /dev/kvm not present");
            return;
        }
        let vm = Arc::new(kvm_ioctls::Kvm::new().unwrap().create_vm().unwrap());
        vm.create_irq_chip().unwrap();
        let ports = LegacyPorts::new(vm.clone(), Box::new(Captured::default()));
        // Scratch register, line control (8N1 with DLAB clear) and interrupt enable.
        ports.write(COM1_BASE + 7, &[0x5a]);
        ports.write(COM1_BASE + 3, &[0x03]);
        ports.write(COM1_BASE + 1, &[0x01]);
        let saved = ports.save_serial();
        assert_eq!(saved.scratch, 0x5a);
        let restored =
            LegacyPorts::restore(vm.clone(), Box::new(Captured::default()), &saved).unwrap();
        let mut byte = [0u8];
        restored.read(COM1_BASE + 7, &mut byte);
        assert_eq!(byte, [0x5a]);
        restored.read(COM1_BASE + 1, &mut byte);
        assert_eq!(byte, [0x01]);
        assert_eq!(restored.save_serial(), saved);
        // A receive FIFO larger than the UART's is refused.
        let mut too_full = saved;
        too_full.in_buffer = vec![0; 65];
        assert!(LegacyPorts::restore(vm, Box::new(Captured::default()), &too_full).is_err());
    }
}
