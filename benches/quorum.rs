//! Benchmarks of the pure quorum engine.
fn main() {}
