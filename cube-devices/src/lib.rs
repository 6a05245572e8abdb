//! Cube's emulated devices: what a guest reaches through MMIO and port I/O, kept apart
//! from the vCPU loop so each can be tested against real guest memory on its own.
//!
//! - [`virtio`]: virtio queues and the virtio-mmio transport, with block, net
//!   (behind a TAP), vsock and rng devices.
//! - [`serial`]: COM1 (and the i8042 reset and ACPI sleep ports) on the port-I/O bus
//!   ([`port_io`]).
//! - [`mmio_bus`]: the MMIO bus vCPU exits are dispatched on.
//! - [`event_loop`]: the thread that serves queue notifications, sockets and TAPs.
//! - [`records`]: the devices' saved state as a snapshot stores it.
//!
//! This crate knows nothing of sandboxes or supervisors: a device is given its files
//! and descriptors by whoever builds the machine.

pub mod event_loop;
pub mod mmio_bus;
pub mod port_io;
pub mod records;
pub mod serial;
pub mod thread_confinement;
pub mod virtio;
