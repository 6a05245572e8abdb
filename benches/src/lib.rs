//! Criterion benches of the sandbox lifecycle live in `benches/`; this library is empty on purpose.
