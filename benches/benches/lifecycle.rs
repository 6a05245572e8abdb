//! Criterion benches of the sandbox lifecycle (being written).
fn main() {}
