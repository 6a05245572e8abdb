//! The largest single allocation made while a target watches: how a target checks
//! that a parser asked for no more memory at once than its limit allows, whatever a
//! length prefix says (and not what the target's own checks allocate).
//!
//! A target installs [`LargestAllocation`] as its global allocator, calls [`reset`]
//! per input, runs the parser under [`watched`], and reads [`largest`].

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The system allocator, recording the largest allocation made while watched.
pub struct LargestAllocation;

static WATCHING: AtomicBool = AtomicBool::new(false);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

fn record(size: usize) {
    if WATCHING.load(Ordering::Relaxed) {
        LARGEST.fetch_max(size, Ordering::Relaxed);
    }
}

/// Forgets the largest allocation seen so far.
pub fn reset() {
    LARGEST.store(0, Ordering::Relaxed);
}

/// The largest allocation made under [`watched`] since the last [`reset`].
pub fn largest() -> usize {
    LARGEST.load(Ordering::Relaxed)
}

/// Runs `f` with its allocations watched.
pub fn watched<T>(f: impl FnOnce() -> T) -> T {
    WATCHING.store(true, Ordering::Relaxed);
    let out = f();
    WATCHING.store(false, Ordering::Relaxed);
    out
}

// SAFETY: every call is forwarded unchanged to the system allocator; the only addition
// is an atomic update of a statistic.
unsafe impl GlobalAlloc for LargestAllocation {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: the caller's contract for `alloc` is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size);
        // SAFETY: as for `alloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as for `alloc`.
        unsafe { System.dealloc(ptr, layout) }
    }
}
