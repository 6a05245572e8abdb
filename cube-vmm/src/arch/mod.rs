//! What depends on the guest's architecture (x86_64 only, for now).

pub mod x86_64;
