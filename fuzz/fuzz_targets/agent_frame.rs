//! Frames on an agent's socket come from both ends, and neither is trusted: the host
//! reads responses that code in the sandbox can forge (in a VM the guest's root can
//! replace the agent), and the agent reads requests from any process of the sandbox
//! that connects to its socket. Reading them must never panic nor allocate more than
//! `MAX_FRAME_LEN` at once whatever a length prefix says; a request the agent cannot
//! decode gets an error reply under the id it could recover; and a message that
//! decodes must encode to a frame that decodes to the same message.
//!
//! The input is read as a stream of frames, as a connection delivers them, once as
//! requests (the agent's side: `decode_request`) and once as responses (the host's
//! side).

#![no_main]

use cube_agent::frame::{encode_frame, read_frame, MAX_FRAME_LEN};
use cube_agent::protocol::{decode_request, Response};
use cube_fuzz::allocation_watch::{self, watched, LargestAllocation};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOCATOR: LargestAllocation = LargestAllocation;

/// The frame bodies of `data` until the stream ends or a frame is refused (an
/// oversized one is skipped by the reader, as the agent does, and reading goes on).
fn bodies(data: &[u8]) -> Vec<Vec<u8>> {
    let mut stream = data;
    let mut out = Vec::new();
    loop {
        let mut body = Vec::new();
        match watched(|| read_frame(&mut stream, &mut body)) {
            Ok(true) => out.push(body),
            Ok(false) => return out,
            Err(cube_agent::frame::FrameError::Oversized { .. }) => {}
            Err(_) => return out,
        }
    }
}

fuzz_target!(|data: &[u8]| {
    allocation_watch::reset();
    for body in bodies(data) {
        // The agent's side.
        match watched(|| decode_request(&body)) {
            Ok(request) => {
                let frame = encode_frame(&request).expect("a decoded request fits in a frame");
                let again = decode_request(&frame[4..]).expect("an encoded request decodes");
                assert_eq!(again, request, "request changed through a frame round trip");
            }
            Err(e) => {
                // The reply the agent sends; under an id it recovered, if any.
                let _ = e.reply_id();
                let reply = e.to_reply();
                assert!(!reply.message.is_empty());
            }
        }
        // The host's side.
        if let Ok(response) = watched(|| postcard::from_bytes::<Response>(&body)) {
            let frame = encode_frame(&response).expect("a decoded response fits in a frame");
            let again: Response =
                postcard::from_bytes(&frame[4..]).expect("an encoded response decodes");
            assert_eq!(
                again, response,
                "response changed through a frame round trip"
            );
        }
    }
    let largest = allocation_watch::largest();
    assert!(
        largest <= MAX_FRAME_LEN as usize,
        "one allocation of {largest} bytes exceeds MAX_FRAME_LEN ({MAX_FRAME_LEN})"
    );
});
