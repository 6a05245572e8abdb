//! How much memory this supervisor holds, for status reports.

/// Resident memory of this process, KiB.
pub fn own_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|pages| pages * 4)
        .unwrap_or(0)
}
