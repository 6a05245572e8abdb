//! `cube serve` reads Connect calls from the network: the framing headers
//! (content type, encodings, timeout), enveloped or plain bodies, gzip, and envd's
//! messages in either codec; and E2B sandbox host names. None of it may panic or
//! allocate past the message limit, and a binary message that decodes must encode to
//! bytes that decode to the same message.
//!
//! Input: header lines (`name: value`) up to the first NUL byte, then the body; the
//! header block's first line doubles as a Host header.

#![no_main]

use cube_server::envd::connect::{call_shape, decode, encode, request_message, Codec, MAX_MESSAGE};
use cube_server::envd::proto;
use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;

/// Decodes `message` as `M` with `codec`; a binary one must round-trip.
fn check<M>(codec: Codec, message: &[u8])
where
    M: prost::Message + Default + serde::Serialize + serde::de::DeserializeOwned + PartialEq,
{
    let Ok(decoded) = decode::<M>(codec, message) else {
        return;
    };
    let bytes = encode(codec, &decoded);
    if codec == Codec::Proto {
        let again: M = decode(codec, &bytes).expect("an encoded message decodes");
        assert!(again == decoded, "message changed through the binary codec");
    } else {
        // JSON accepts more spellings than it writes: what it writes must read.
        decode::<M>(codec, &bytes).expect("written JSON reads back");
    }
}

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|b| *b == 0).unwrap_or(data.len());
    let (head, body) = data.split_at(split);
    let body = body.get(1..).unwrap_or_default();
    let head = String::from_utf8_lossy(head);
    let mut headers = HeaderMap::new();
    for line in head.lines() {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.trim().as_bytes()),
            HeaderValue::from_str(value.trim()),
        ) else {
            continue;
        };
        headers.append(name, value);
    }
    if let Some(first) = head.lines().next() {
        if let Some((port, id)) = cube_server::ids::parse_sandbox_host(first) {
            assert!(
                id.starts_with("sb-"),
                "{first:?} routed to {id:?} on {port}"
            );
        }
    }
    let Ok(shape) = call_shape(&headers) else {
        return;
    };
    let Ok(message) = request_message(&shape, body) else {
        return;
    };
    assert!(
        message.len() <= MAX_MESSAGE,
        "a {} byte message passed",
        message.len()
    );
    check::<proto::StartRequest>(shape.codec, &message);
    check::<proto::SendInputRequest>(shape.codec, &message);
    check::<proto::ListDirRequest>(shape.codec, &message);
    check::<proto::MoveRequest>(shape.codec, &message);
    check::<proto::WatchRequest>(shape.codec, &message);
    check::<proto::SendSignalRequest>(shape.codec, &message);
});
