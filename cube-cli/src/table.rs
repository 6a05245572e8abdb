//! Output for people: aligned columns, human sizes and ages; and for scripts, the
//! `--json` form.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::cli_error::{chain, CliError};

/// A table printed with each column as wide as its widest cell.
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new(headers: &[&'static str]) -> Self {
        Table {
            headers: headers.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; missing cells print empty.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as text, one line per row, trailing spaces trimmed.
    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate() {
                if i < widths.len() {
                    widths[i] = widths[i].max(cell.chars().count());
                }
            }
        }
        let line = |cells: &mut dyn Iterator<Item = &str>| {
            let mut out = String::new();
            for (i, width) in widths.iter().enumerate() {
                let cell = cells.next().unwrap_or("");
                out.push_str(cell);
                if i + 1 < widths.len() {
                    let pad = width - cell.chars().count().min(*width) + 2;
                    out.push_str(&" ".repeat(pad));
                }
            }
            out.trim_end().to_string()
        };
        let mut text = line(&mut self.headers.iter().copied());
        text.push('\n');
        for row in &self.rows {
            text.push_str(&line(&mut row.iter().map(String::as_str)));
            text.push('\n');
        }
        text
    }

    /// Prints the table to standard output.
    pub fn print(&self) {
        print!("{}", self.render());
    }
}

/// A byte count in binary units: `512 B`, `1.5 KiB`, `3.0 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// How long ago a Unix time was, coarsely: `12s ago`, `5m ago`, `3h ago`, `2d ago`.
pub fn human_age(unix_seconds: u64) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    age_between(unix_seconds, now)
}

fn age_between(then: u64, now: u64) -> String {
    let Some(secs) = now.checked_sub(then) else {
        return "in the future".to_string();
    };
    match secs {
        0..60 => format!("{secs}s ago"),
        60..3600 => format!("{}m ago", secs / 60),
        3600..86400 => format!("{}h ago", secs / 3600),
        _ => format!("{}d ago", secs / 86400),
    }
}

/// `KEY=VALUE,KEY=VALUE`, or `-` for none.
pub fn labels(map: &std::collections::BTreeMap<String, String>) -> String {
    if map.is_empty() {
        return "-".to_string();
    }
    map.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Prints a value as pretty JSON on standard output.
pub fn print_json<T: serde::Serialize + ?Sized>(value: &T) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| CliError::failed(chain(&e)))?;
    println!("{text}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_to_the_widest_cell() {
        let mut t = Table::new(&["ID", "STATE"]);
        t.row(vec!["sb-1".into(), "running".into()]);
        t.row(vec!["sb-123456".into(), "paused".into()]);
        assert_eq!(
            t.render(),
            "ID         STATE\nsb-1       running\nsb-123456  paused\n"
        );
    }

    #[test]
    fn sizes_use_binary_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(1 << 30), "1.0 GiB");
    }

    #[test]
    fn ages_pick_the_coarsest_unit() {
        assert_eq!(age_between(100, 112), "12s ago");
        assert_eq!(age_between(0, 300), "5m ago");
        assert_eq!(age_between(0, 3 * 3600 + 5), "3h ago");
        assert_eq!(age_between(0, 2 * 86400), "2d ago");
        assert_eq!(age_between(10, 5), "in the future");
    }
}
