//! Percentiles over repeated timings.

use std::time::Duration;

/// p50 and p95 (nearest rank) of `samples` in milliseconds; zeros when empty.
pub fn percentiles_ms(samples: &[Duration]) -> (f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0);
    }
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(|a, b| a.total_cmp(b));
    let rank = |p: f64| {
        let index = ((p * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1;
        ms[index]
    };
    (rank(0.50), rank(0.95))
}

/// Rounds to 0.01.
pub fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let (p50, p95) = percentiles_ms(&samples);
        assert_eq!(p50, 50.0);
        assert_eq!(p95, 95.0);
        assert_eq!(percentiles_ms(&[]), (0.0, 0.0));
        assert_eq!(percentiles_ms(&[Duration::from_millis(7)]), (7.0, 7.0));
    }
}
