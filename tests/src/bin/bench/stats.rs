//! Order statistics for benchmark samples.
//!
//! These machines are noisy (two shared cores; medians move 10-20 % between runs), so the
//! benchmark never reports a mean: every figure is a median over interleaved rounds, and
//! latency figures are percentiles of one round's samples first. Percentiles use the
//! nearest-rank method on a sorted copy, which needs no interpolation rule to argue about
//! and always returns a value that was actually measured.

use std::time::Duration;

/// Nearest-rank percentiles: the same function the in-guest probe uses
/// (`qemu_harness::load`), so a percentile means the same on both sides.
pub use qemu_harness::load::percentile;

/// The median of `samples` (the 50th percentile); `None` when empty.
pub fn median(samples: &[f64]) -> Option<f64> {
    percentile(samples, 50.0)
}

/// Milliseconds in a duration, as a float.
pub fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_by_nearest_rank() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[]), None);
    }
}
