//! A spinner that shows the line a template build printed last (debootstrap's
//! "Retrieving ...", "Unpacking ..."), on a terminal only; elsewhere it stays silent so
//! logs and pipes get the result alone.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// Widest message shown next to the spinner.
const MAX_MESSAGE: usize = 100;

/// Progress of one build.
pub struct BuildProgress {
    bar: Option<ProgressBar>,
}

impl BuildProgress {
    /// Starts the spinner with `what` as its prefix (when stderr is a terminal).
    pub fn start(what: &str) -> BuildProgress {
        if !std::io::stderr().is_terminal() {
            return BuildProgress { bar: None };
        }
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner} {prefix} [{elapsed}] {wide_msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_prefix(what.to_string());
        bar.enable_steady_tick(Duration::from_millis(120));
        BuildProgress { bar: Some(bar) }
    }

    /// Shows one line of the build's output.
    pub fn line(&self, line: &str) {
        if let Some(bar) = &self.bar {
            let line = line.trim();
            if line.is_empty() {
                return;
            }
            let shown: String = line.chars().take(MAX_MESSAGE).collect();
            bar.set_message(shown);
        }
    }

    /// Removes the spinner (the caller prints the outcome).
    pub fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}
