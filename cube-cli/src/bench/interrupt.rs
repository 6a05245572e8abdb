//! Templates a bench run made, removed when it is interrupted.

use std::path::Path;

use crate::cli_error::CliError;

/// On Ctrl-C or SIGTERM, removes the templates this run made (`prefix` and
/// `prefix-*`) and exits 130. Its sandboxes are ephemeral: they end with this process.
///
/// Must run before any other thread starts, so that every thread inherits the blocked
/// signals and only the watcher receives them.
pub fn remove_on_interrupt(root: &Path, prefix: &str) -> Result<(), CliError> {
    let signals = crate::interrupts::block()?;
    let templates = root.join("templates");
    let prefix = prefix.to_string();
    std::thread::Builder::new()
        .name("interrupt".into())
        .spawn(move || {
            if signals.wait().is_err() {
                return;
            }
            eprintln!("bench: interrupted, removing its templates");
            if let Ok(entries) = std::fs::read_dir(&templates) {
                for entry in entries.flatten() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    if name == prefix || name.starts_with(&format!("{prefix}-")) {
                        let _ = std::fs::remove_dir_all(entry.path());
                    }
                }
            }
            std::process::exit(130);
        })
        .map_err(|e| CliError::failed(format!("starting the interrupt watcher: {e}")))?;
    Ok(())
}
