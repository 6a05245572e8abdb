//! What every part of `cube bench` shares: the rows and targets its reports are made
//! of, how they print as markdown tables, and how it shows progress and failures.

use serde::Serialize;

use crate::cli_error::{chain, CliError};

#[derive(Serialize)]
pub struct CreateRow {
    pub concurrency: usize,
    pub n: usize,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub throughput_per_s: f64,
}

#[derive(Serialize)]
pub struct CloneRow {
    pub n: usize,
    pub concurrency: usize,
    /// How many times the clone was made; `wall_ms` is their median.
    pub samples: usize,
    pub wall_ms: f64,
    pub per_clone_ms: f64,
}

#[derive(Serialize)]
pub struct Target {
    pub name: &'static str,
    pub value: f64,
    pub limit: f64,
    pub met: bool,
}

impl Target {
    /// A target met when `value` is at most `limit`.
    pub fn at_most(name: &'static str, value: f64, limit: f64) -> Target {
        Target {
            name,
            value,
            limit,
            met: value <= limit,
        }
    }
}

/// A failure of a benchmark step.
pub fn failed(e: impl std::error::Error) -> CliError {
    CliError::failed(chain(&e))
}

/// The bench's phases: a spinner on a terminal, `bench: ...` lines otherwise.
static PHASES: std::sync::OnceLock<crate::progress::Phases> = std::sync::OnceLock::new();

/// Shows the phase the bench is in.
pub fn progress(message: &str) {
    PHASES
        .get_or_init(|| crate::progress::Phases::new("bench"))
        .phase(message);
}

/// Clears the spinner before the report is printed.
pub fn progress_done() {
    if let Some(p) = PHASES.get() {
        p.finish();
    }
}

/// Prints the create rows as a markdown table.
pub fn create_table(rows: &[CreateRow]) {
    table(
        &["Concurrency", "n", "p50 ms", "p95 ms", "Throughput /s"],
        rows.iter().map(|row| {
            vec![
                row.concurrency.to_string(),
                row.n.to_string(),
                row.p50_ms.to_string(),
                row.p95_ms.to_string(),
                row.throughput_per_s.to_string(),
            ]
        }),
    );
}

/// Prints a markdown table.
pub fn table(headers: &[&str], rows: impl Iterator<Item = Vec<String>>) {
    println!("| {} |", headers.join(" | "));
    println!("|{}", "---|".repeat(headers.len()));
    for row in rows {
        println!("| {} |", row.join(" | "));
    }
}
