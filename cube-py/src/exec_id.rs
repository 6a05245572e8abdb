//! Request ids for execs. The agent keeps a table of running (and unwaited background)
//! execs keyed by request id across all its connections, while every new connection
//! counts its ids from 1: two handles on one sandbox (this process and the CLI, or two
//! `Sandbox.connect`s) would collide ("exec id 2 is already in use"). Exec ids are
//! therefore drawn from a random 62-bit start, unique within this process.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

static NEXT: OnceLock<AtomicU64> = OnceLock::new();

/// An exec id no other connection is likely to use.
pub fn next() -> u64 {
    NEXT.get_or_init(|| {
        // RandomState is seeded from the OS's random source; below 2^62 so the
        // counter never wraps into small ids in practice.
        let seed = RandomState::new().build_hasher().finish() >> 2;
        AtomicU64::new(seed.max(1 << 32))
    })
    .fetch_add(1, Ordering::Relaxed)
}
