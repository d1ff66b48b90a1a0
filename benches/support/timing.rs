//! The one timing loop the benches share.

use std::time::{Duration, Instant};

/// Runs `f` once to warm up, then until `budget` passes; returns the seconds one call takes.
pub fn time(budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut n = 0u32;
    while start.elapsed() < budget {
        f();
        n += 1;
    }
    start.elapsed().as_secs_f64() / f64::from(n)
}
