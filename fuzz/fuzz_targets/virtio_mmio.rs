//! A guest's register accesses to a virtio-mmio window (device configuration writes
//! included) and the rings in its memory: for the rng, block and vsock devices,
//! any sequence of reads and writes must never panic, and whatever state the
//! transport reaches must be saved and restored into a fresh device unchanged (the
//! snapshot path must never write a state the restore path refuses).
//!
//! Input: byte 0 picks the device; the next 4 KiB are the start of guest memory
//! (descriptor tables, rings, buffers); the rest is a list of 7-byte accesses:
//! offset (u16), width selector, value (u32).
#![no_main]

use std::sync::{Arc, OnceLock};

use cube_devices::virtio::block::{Block, BlockOptions};
use cube_devices::virtio::device::VirtioDevice;
use cube_devices::virtio::interrupt::{InterruptError, InterruptLine};
use cube_devices::virtio::mmio::MmioTransport;
use cube_devices::virtio::rng::Rng;
use cube_devices::virtio::vsock::Vsock;
use cube_devices::virtio::VirtioMemory;
use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress};

const MEMORY: usize = 0x2_0000;
const PREFIX: usize = 4096;

struct NoLine;

impl InterruptLine for NoLine {
    fn raise(&self) -> Result<(), InterruptError> {
        Ok(())
    }
    fn lower(&self) -> Result<(), InterruptError> {
        Ok(())
    }
}

/// A scratch directory (disk image, vsock socket) for the whole run.
fn scratch() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a scratch directory");
        std::fs::write(dir.path().join("disk.img"), vec![0u8; 64 * 512]).expect("a disk image");
        dir
    })
}

fn device(kind: u8) -> Box<dyn VirtioDevice> {
    let dir = scratch().path();
    match kind % 3 {
        0 => Box::new(Rng::new()),
        1 => Box::new(
            Block::open(
                &dir.join("disk.img"),
                BlockOptions {
                    read_only: true,
                    id: "fuzz".into(),
                },
            )
            .expect("the disk opens"),
        ),
        _ => Box::new(Vsock::new(3, &dir.join("vsock.sock")).expect("the vsock device starts")),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let (prefix, ops) = rest.split_at(rest.len().min(PREFIX));
    let Ok(mem) = VirtioMemory::from_ranges(&[(GuestAddress(0), MEMORY)]) else {
        return;
    };
    let _ = mem.write_slice(prefix, GuestAddress(0));
    let mut transport = MmioTransport::new(device(kind), mem.clone(), Arc::new(NoLine));
    for op in ops.chunks_exact(7) {
        let offset = u64::from(u16::from_le_bytes([op[0], op[1]])) & 0x1fff;
        let len = [4usize, 4, 4, 1, 2, 8, 0, 3][usize::from(op[2] % 8)];
        let mut bytes = [op[3], op[4], op[5], op[6], 0, 0, 0, 0];
        if op[2] & 0x80 != 0 {
            transport.read(offset, &mut bytes[..len]);
        } else {
            transport.write(offset, &bytes[..len]);
        }
    }
    let state = transport.save();
    drop(transport);
    let restored = MmioTransport::restore(device(kind), mem, Arc::new(NoLine), &state)
        .expect("a state the transport saved restores");
    assert_eq!(restored.save().status, state.status);
    assert_eq!(restored.save().queues, state.queues);
});
