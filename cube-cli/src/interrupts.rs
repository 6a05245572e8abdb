//! Ctrl-C and SIGTERM, taken synchronously by one watcher thread: the commands that
//! must clean up when interrupted (a sandbox to destroy, a half-built template to
//! remove) block both signals in every thread and wait for them on one.

use nix::sys::signal::{SigSet, Signal};

use crate::cli_error::CliError;

/// Blocks SIGINT and SIGTERM in the calling thread and every thread it starts
/// afterwards; returns the set, for the watcher to wait on. Call before any other
/// thread starts, so that only the watcher receives them.
pub fn block() -> Result<SigSet, CliError> {
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals
        .thread_block()
        .map_err(|e| CliError::failed(format!("blocking signals: {e}")))?;
    Ok(signals)
}
