//! A snapshot's state file comes from disk, where anything can be written: decoding
//! it must never panic, and whatever `decode` accepts must survive `encode` then
//! `decode` unchanged (the restore path re-reads what the snapshot path wrote).
//!
//! The same bytes are tried three ways: as a whole state file (envelope first), as a
//! bare payload, and as the payload of a valid envelope, which gets random payloads
//! past the checksum that a mutated file rarely passes.

#![no_main]

use cube_vmm::persist::state::{decode, decode_file_bytes, encode, STATE_KIND};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_file_bytes(data);

    let direct = decode(data);
    if let Ok(state) = &direct {
        let bytes = encode(state).expect("a decoded state encodes");
        let again = decode(&bytes).expect("a re-encoded state decodes");
        assert_eq!(&again, state, "state changed through encode and decode");
    }

    if let Ok(file) = cube_storage::encode_envelope(STATE_KIND, data) {
        let via_file = decode_file_bytes(&file);
        assert_eq!(
            via_file.is_ok(),
            direct.is_ok(),
            "the envelope changed whether the payload decodes"
        );
    }
});
