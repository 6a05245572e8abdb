//! Descriptor chains a guest hands a virtio device: whatever the descriptor table and
//! rings hold, `parse_chain` must never panic, and every buffer of a chain it accepts
//! must lie wholly inside guest memory, in order (readable before writable), with the
//! chain no longer than the queue.
#![no_main]

use cube_devices::virtio::queue::{parse_chain, QueueLayout};
use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// Two small RAM regions with a gap between them, like RAM around the MMIO hole.
const LOW: (u64, usize) = (0, 0x1_0000);
const HIGH: (u64, usize) = (0x3_0000, 0x1_0000);

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[
        (GuestAddress(LOW.0), LOW.1),
        (GuestAddress(HIGH.0), HIGH.1),
    ]) else {
        return;
    };
    // The rest of the input is the low region's contents: descriptor table and rings.
    let body = &data[8..];
    let _ = mem.write_slice(&body[..body.len().min(LOW.1)], GuestAddress(0));
    let size = 1u16 << (data[0] % 9);
    let head = u16::from_le_bytes([data[1], data[2]]);
    // Table and rings anywhere, aligned or not, inside memory or not: the parser checks.
    let at = |b: u8| u64::from(b) * 0x400;
    let layout = QueueLayout {
        size,
        desc_table: at(data[3]),
        avail_ring: at(data[4]),
        used_ring: at(data[5]),
    };
    if let Ok(chain) = parse_chain(&mem, &layout, head) {
        assert!(chain.buffers.len() <= usize::from(size));
        let mut seen_writable = false;
        for buffer in &chain.buffers {
            let end = buffer.addr.0.checked_add(u64::from(buffer.len)).expect("no wrap");
            let inside = [LOW, HIGH]
                .iter()
                .any(|(start, len)| buffer.addr.0 >= *start && end <= start + *len as u64);
            assert!(inside, "buffer {buffer:?} outside guest memory");
            assert!(mem.check_range(buffer.addr, buffer.len as usize) || buffer.len == 0);
            assert!(!(seen_writable && !buffer.writable), "readable after writable");
            seen_writable |= buffer.writable;
        }
    }
});
