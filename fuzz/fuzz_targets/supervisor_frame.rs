//! Frames arrive from the other end of a supervisor socket, which may be confused or
//! hostile: reading them must never panic nor allocate more than `MAX_FRAME` at once
//! whatever the length prefix says, and a message that decodes must encode to a frame
//! that decodes to the same encoding again.
//!
//! The input is read as a stream of frames, as a connection delivers them, once as
//! requests (the supervisor's side) and once as responses (the library's side).

#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cube_supervisor::protocol::{read_frame, write_frame, MAX_FRAME};
use cube_supervisor::protocol::{Request, Response};
use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Records the largest single allocation made while [`WATCHING`], so the target can
/// check what `read_frame` asked for (and not what its own checks allocate).
struct LargestAllocation;

static WATCHING: AtomicBool = AtomicBool::new(false);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

fn record(size: usize) {
    if WATCHING.load(Ordering::Relaxed) {
        LARGEST.fetch_max(size, Ordering::Relaxed);
    }
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

#[global_allocator]
static ALLOCATOR: LargestAllocation = LargestAllocation;

/// `read_frame`, with its allocations watched.
fn read_watched<T: DeserializeOwned>(stream: &mut &[u8]) -> Option<T> {
    WATCHING.store(true, Ordering::Relaxed);
    let message = read_frame::<T>(stream).ok();
    WATCHING.store(false, Ordering::Relaxed);
    message
}

/// Reads frames of `T` until the stream ends or a frame is refused.
fn read_all<T: Serialize + DeserializeOwned>(data: &[u8]) {
    let mut stream = data;
    while let Some(message) = read_watched::<T>(&mut stream) {
        let mut frame = Vec::new();
        write_frame(&mut frame, &message).expect("a decoded message fits in a frame");
        let again: T = read_frame(&mut frame.as_slice()).expect("a written frame reads back");
        let mut frame_again = Vec::new();
        write_frame(&mut frame_again, &again).expect("a decoded message fits in a frame");
        assert_eq!(
            frame, frame_again,
            "message changed through a frame round trip"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    LARGEST.store(0, Ordering::Relaxed);
    read_all::<Request>(data);
    read_all::<Response>(data);
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(
        largest <= MAX_FRAME as usize,
        "one allocation of {largest} bytes exceeds MAX_FRAME ({MAX_FRAME})"
    );
});
