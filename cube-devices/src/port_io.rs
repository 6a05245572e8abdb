//! The port-I/O bus a vCPU's `in`/`out` exits reach (x86's legacy I/O space).

/// A device bus for port I/O, called on the vCPU thread that made the access.
pub trait PortIo: Send + Sync {
    /// Fills `data` with what port `port` returns.
    fn read(&self, port: u16, data: &mut [u8]);
    /// Delivers `data` written to port `port`.
    fn write(&self, port: u16, data: &[u8]);

    /// Why the guest asked the machine to stop (a reset or power-off through a port),
    /// once it has; the vCPU then stops as for a triple fault.
    fn stop_requested(&self) -> Option<String> {
        None
    }
}
