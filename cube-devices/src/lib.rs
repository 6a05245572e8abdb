//! Emulated devices that a guest reaches through MMIO, kept independent of the vCPU
//! loop so each can be tested against real guest memory on its own.

pub mod event_loop;
pub mod virtio;
