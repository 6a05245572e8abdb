//! Cube's control device: a one-page MMIO window through which a guest tells the VMM
//! it has nothing to do, so its vCPU sleeps in the host instead of spinning.
//!
//! It is the test guest's stand-in for `hlt`, which CPL3 code cannot execute.

use crate::arch::x86_64::layout::{CONTROL_DEVICE_ADDR, CONTROL_DEVICE_SIZE};

/// Offset of the register whose write parks the vCPU until the doorbell rings.
pub const IDLE_REGISTER: u64 = 0;

/// What the vCPU thread does after an access to the control device.
#[derive(Debug, PartialEq, Eq)]
pub enum ControlAction {
    /// Re-enter the guest.
    Continue,
    /// Sleep until the doorbell rings (or the vCPU is paused or stopped).
    Idle,
}

/// Decodes a guest write at `addr`; `None` when the address is not the control device.
pub fn decode_write(addr: u64) -> Option<ControlAction> {
    let offset = addr.checked_sub(CONTROL_DEVICE_ADDR)?;
    if offset >= CONTROL_DEVICE_SIZE {
        return None;
    }
    Some(if offset == IDLE_REGISTER {
        ControlAction::Idle
    } else {
        ControlAction::Continue
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_register_parks() {
        assert_eq!(decode_write(CONTROL_DEVICE_ADDR), Some(ControlAction::Idle));
        assert_eq!(
            decode_write(CONTROL_DEVICE_ADDR + 8),
            Some(ControlAction::Continue)
        );
        assert_eq!(
            decode_write(CONTROL_DEVICE_ADDR + CONTROL_DEVICE_SIZE),
            None
        );
        assert_eq!(decode_write(0), None);
    }
}
