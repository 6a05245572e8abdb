//! Metadata envelopes come from disk, where anything can be written: decoding must
//! never panic or allocate by a declared length, and whatever it accepts must be
//! exactly what the encoder produces for that payload (one encoding per payload).

#![no_main]

use libfuzzer_sys::fuzz_target;

const KIND: &str = "sandbox";

fuzz_target!(|data: &[u8]| {
    if let Ok(payload) = cube_storage::decode_envelope(data, KIND) {
        let reencoded = cube_storage::encode_envelope(KIND, payload).expect("KIND is a valid kind");
        assert_eq!(reencoded, data, "accepted envelope is not canonical");
    }
});
