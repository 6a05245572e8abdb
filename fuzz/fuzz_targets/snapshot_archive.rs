//! Snapshot archives come from other hosts: reading one must never panic, allocate by a
//! declared length, or accept chunks that do not fit the manifest; whatever the reader
//! accepts whole must be a valid manifest with every chunk inside its file.

#![no_main]

use cube_archive::{ArchiveReader, EntryKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok((mut reader, manifest)) = ArchiveReader::open(data) else {
        return;
    };
    manifest
        .validate()
        .expect("the reader returned an invalid manifest");
    loop {
        match reader.next_chunk() {
            Ok(Some(chunk)) => {
                let entry = &manifest.entries[chunk.entry as usize];
                let EntryKind::File { size, .. } = entry.kind else {
                    panic!("a chunk of a non-file entry was accepted");
                };
                assert!(chunk.offset + chunk.data.len() as u64 <= size);
            }
            Ok(None) => break,
            Err(_) => return,
        }
    }
});
