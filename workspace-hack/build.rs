// A build script, empty: cargo considers a crate's build-dependencies (here, features
// of crates that proc-macros and build scripts use) only where it has one.
fn main() {}
