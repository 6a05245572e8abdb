//! Frames arrive from the other end of a supervisor socket, which may be confused or
//! hostile: reading them must never panic nor allocate more than `MAX_FRAME` at once
//! whatever the length prefix says, and a message that decodes must encode to a frame
//! that decodes to the same encoding again.
//!
//! The input is read as a stream of frames, as a connection delivers them, once as
//! requests (the supervisor's side) and once as responses (the library's side).

#![no_main]

use cube_fuzz::allocation_watch::{self, watched, LargestAllocation};
use cube_supervisor::protocol::{read_frame, write_frame, MAX_FRAME};
use cube_supervisor::protocol::{Request, Response};
use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;
use serde::Serialize;

#[global_allocator]
static ALLOCATOR: LargestAllocation = LargestAllocation;

/// `read_frame`, with its allocations watched.
fn read_watched<T: DeserializeOwned>(stream: &mut &[u8]) -> Option<T> {
    watched(|| read_frame::<T>(stream).ok())
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
    allocation_watch::reset();
    read_all::<Request>(data);
    read_all::<Response>(data);
    let largest = allocation_watch::largest();
    assert!(
        largest <= MAX_FRAME as usize,
        "one allocation of {largest} bytes exceeds MAX_FRAME ({MAX_FRAME})"
    );
});
