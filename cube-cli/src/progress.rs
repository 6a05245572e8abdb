//! Progress for long work (large copies, bench phases, template builds), drawn on
//! standard error only when it is a terminal, so pipes and logs stay clean.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Whether progress is drawn at all: standard error is a terminal and `CUBE_PROGRESS`
/// is not `0`.
pub fn enabled() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("CUBE_PROGRESS").is_none_or(|v| v != "0")
}

fn target() -> ProgressDrawTarget {
    if enabled() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

/// A bar for `total` bytes (a copy): bytes done, rate and time left.
pub fn bytes(total: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), target());
    if let Ok(style) = ProgressStyle::with_template(
        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(message.to_string());
    bar
}

/// A bar for `total` steps of work whose size is unknown up front in bytes.
pub fn steps(total: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), target());
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(message.to_string());
    bar
}

/// One phase of a multi-phase job (a bench, a template build). Without a terminal,
/// each phase is one `PREFIX: message` line on standard error, as a log would want.
pub struct Phases {
    prefix: &'static str,
    spinner: Option<ProgressBar>,
}

impl Phases {
    /// Phases whose lines start with `prefix`.
    pub fn new(prefix: &'static str) -> Self {
        let spinner = enabled().then(|| {
            let s = ProgressBar::new_spinner();
            if let Ok(style) = ProgressStyle::with_template("{spinner} {prefix}: {msg} {elapsed}") {
                s.set_style(style);
            }
            s.set_prefix(prefix);
            s.enable_steady_tick(Duration::from_millis(120));
            s
        });
        Phases { prefix, spinner }
    }

    /// Starts the next phase; the previous one is finished.
    pub fn phase(&self, message: &str) {
        match &self.spinner {
            Some(s) => {
                if !s.message().is_empty() {
                    s.println(format!("  {}: {} done", self.prefix, s.message()));
                }
                s.set_message(message.to_string());
                s.reset_elapsed();
            }
            None => eprintln!("{}: {message}", self.prefix),
        }
    }

    /// Ends the last phase and clears the spinner (for phases kept in a static,
    /// which are never dropped).
    pub fn finish(&self) {
        if let Some(s) = &self.spinner {
            if !s.message().is_empty() {
                s.println(format!("  {}: {} done", self.prefix, s.message()));
            }
            s.finish_and_clear();
        }
    }

    /// Prints a line above the spinner (or on standard error without one).
    pub fn note(&self, line: &str) {
        match &self.spinner {
            Some(s) => s.println(format!("{}: {line}", self.prefix)),
            None => eprintln!("{}: {line}", self.prefix),
        }
    }
}

impl Drop for Phases {
    fn drop(&mut self) {
        if let Some(s) = &self.spinner {
            s.finish_and_clear();
        }
    }
}
