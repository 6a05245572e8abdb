//! The microVM monitor: guest layout, vCPU threads, devices and the machine that ties
//! them to guest memory.

pub mod acpi;
pub mod bzimage_boot;
pub mod control_device;
pub mod dirty_tracking;
pub mod layout;
pub mod linux_boot;
pub mod machine;
pub mod mmio_bus;
pub mod serial;
pub mod vcpu_runner;
pub mod virtio_devices;
