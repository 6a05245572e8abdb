//! Split virtqueues (virtio 1.x section 2.7), with every guest-provided value checked.
//!
//! The guest owns the descriptor table and both rings and may change them at any time,
//! so nothing read from them is trusted: ring geometry is validated when the driver
//! enables a queue (and on restore), the available index may not run ahead of the used
//! index by more than the queue size, and [`parse_chain`] copies a descriptor chain out
//! of guest memory, refusing out-of-range indices, loops, buffers outside guest memory
//! and readable descriptors after writable ones. Devices work only on that copy.
//!
//! Indirect descriptors are refused: no device here offers VIRTIO_F_INDIRECT_DESC, so a
//! driver may not use them. EVENT_IDX is not offered either; interrupt suppression
//! follows VIRTQ_AVAIL_F_NO_INTERRUPT.

use std::sync::atomic::{fence, Ordering};

use virtio_queue::{QueueOwnedT, QueueT};

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryError};

/// Descriptor flag: the chain continues at `next`.
pub const VIRTQ_DESC_F_NEXT: u16 = 1;
/// Descriptor flag: the buffer is device-writable (otherwise device-readable).
pub const VIRTQ_DESC_F_WRITE: u16 = 2;
/// Descriptor flag: the buffer holds a table of indirect descriptors.
pub const VIRTQ_DESC_F_INDIRECT: u16 = 4;
/// Available ring flag: the driver does not want an interrupt for used buffers.
pub const VIRTQ_AVAIL_F_NO_INTERRUPT: u16 = 1;
/// Largest queue size a split virtqueue can have.
pub const MAX_QUEUE_SIZE: u16 = 32768;

const DESCRIPTOR_SIZE: u64 = 16;
const RING_HEADER_SIZE: u64 = 4;
const AVAIL_ELEM_SIZE: u64 = 2;
const USED_ELEM_SIZE: u64 = 8;
/// The event word after each ring (present in memory even without EVENT_IDX).
const RING_EVENT_SIZE: u64 = 2;

/// Why a queue cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The size is zero, not a power of two, or above the device's maximum.
    #[error("Queue size {size} is not a power of two in 1..={max}")]
    BadSize {
        /// The size the driver set.
        size: u16,
        /// The device's maximum for this queue.
        max: u16,
    },
    /// A ring is not aligned as the spec requires.
    #[error("{part} at {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        /// Which part of the queue.
        part: &'static str,
        /// Its guest physical address.
        addr: u64,
        /// The alignment it needs.
        align: u64,
    },
    /// A ring does not lie wholly inside guest memory.
    #[error("{part} at {addr:#x} ({len} bytes) is outside guest memory")]
    OutsideMemory {
        /// Which part of the queue.
        part: &'static str,
        /// Its guest physical address.
        addr: u64,
        /// Its length in bytes.
        len: u64,
    },
    /// The driver's available index is more than a queue's worth ahead of the device.
    #[error("Available index {avail_idx} is more than {size} ahead of {next_avail}")]
    AvailIndex {
        /// The index the driver published.
        avail_idx: u16,
        /// The next entry the device would take.
        next_avail: u16,
        /// The queue size.
        size: u16,
    },
    /// A used element names a descriptor that does not exist.
    #[error("Used descriptor index {head} is not below queue size {size}")]
    UsedHead {
        /// The descriptor index.
        head: u16,
        /// The queue size.
        size: u16,
    },
    /// virtio-queue refused the queue or a ring access.
    #[error("Virtqueue: {0}")]
    Ring(String),
    /// Reading or writing a ring failed.
    #[error("Accessing the {part} failed")]
    Memory {
        /// Which part of the queue.
        part: &'static str,
        /// The guest memory error.
        #[source]
        source: GuestMemoryError,
    },
}

/// Why a descriptor chain was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChainError {
    /// The head index from the available ring is not below the queue size.
    #[error("Chain head {head} is not below queue size {size}")]
    HeadOutOfRange {
        /// The head index.
        head: u16,
        /// The queue size.
        size: u16,
    },
    /// A descriptor's `next` is not below the queue size.
    #[error("Descriptor {index} links to {next}, not below queue size {size}")]
    NextOutOfRange {
        /// The descriptor holding the link.
        index: u16,
        /// The link.
        next: u16,
        /// The queue size.
        size: u16,
    },
    /// The chain has more descriptors than the queue: it loops.
    #[error("Chain from head {head} is longer than queue size {size}")]
    TooLong {
        /// The head index.
        head: u16,
        /// The queue size.
        size: u16,
    },
    /// A descriptor could not be read from the descriptor table.
    #[error("Descriptor {index} cannot be read from the descriptor table")]
    Unreadable {
        /// The descriptor index.
        index: u16,
    },
    /// A buffer does not lie wholly inside guest memory.
    #[error("Descriptor {index} buffer {addr:#x} ({len} bytes) is outside guest memory")]
    OutsideMemory {
        /// The descriptor index.
        index: u16,
        /// The buffer's guest physical address.
        addr: u64,
        /// The buffer's length.
        len: u32,
    },
    /// An indirect descriptor, which no device here negotiates.
    #[error("Descriptor {index} is indirect, which was not negotiated")]
    Indirect {
        /// The descriptor index.
        index: u16,
    },
    /// A device-readable descriptor follows a device-writable one.
    #[error("Descriptor {index} is readable but follows a writable one")]
    ReadableAfterWritable {
        /// The descriptor index.
        index: u16,
    },
    /// The buffers add up to more than a used length can express.
    #[error("Chain from head {head} is longer than 4 GiB in total")]
    TotalTooLong {
        /// The head index.
        head: u16,
    },
}

/// Where the driver put one split virtqueue, and how large it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueLayout {
    /// Number of descriptors (a power of two).
    pub size: u16,
    /// Guest physical address of the descriptor table.
    pub desc_table: u64,
    /// Guest physical address of the available (driver) ring.
    pub avail_ring: u64,
    /// Guest physical address of the used (device) ring.
    pub used_ring: u64,
}

impl QueueLayout {
    /// Checks the size against `max_size` and that the table and both rings are aligned
    /// and lie wholly inside `mem`.
    pub fn validate<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        max_size: u16,
    ) -> Result<(), QueueError> {
        let size = self.size;
        if size == 0 || !size.is_power_of_two() || size > max_size || size > MAX_QUEUE_SIZE {
            return Err(QueueError::BadSize {
                size,
                max: max_size.min(MAX_QUEUE_SIZE),
            });
        }
        let n = u64::from(size);
        let parts = [
            ("descriptor table", self.desc_table, 16, DESCRIPTOR_SIZE * n),
            (
                "available ring",
                self.avail_ring,
                2,
                RING_HEADER_SIZE + AVAIL_ELEM_SIZE * n + RING_EVENT_SIZE,
            ),
            (
                "used ring",
                self.used_ring,
                4,
                RING_HEADER_SIZE + USED_ELEM_SIZE * n + RING_EVENT_SIZE,
            ),
        ];
        for (part, addr, align, len) in parts {
            if addr % align != 0 {
                return Err(QueueError::Misaligned { part, addr, align });
            }
            let fits = addr.checked_add(len).is_some()
                && usize::try_from(len)
                    .is_ok_and(|len| GuestMemoryBackend::check_range(mem, GuestAddress(addr), len));
            if !fits {
                return Err(QueueError::OutsideMemory { part, addr, len });
            }
        }
        Ok(())
    }
}

/// One buffer of a descriptor chain, copied out of the descriptor table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buffer {
    /// Guest physical address (the whole buffer is inside guest memory).
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
    /// Whether the device may write it (otherwise it may only read it).
    pub writable: bool,
}

/// A validated descriptor chain: readable buffers first, then writable ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    /// The head descriptor index, returned to the driver in the used ring.
    pub head: u16,
    /// The buffers in chain order.
    pub buffers: Vec<Buffer>,
}

impl Chain {
    /// The device-writable buffers.
    pub fn writable(&self) -> impl Iterator<Item = &Buffer> {
        self.buffers.iter().filter(|b| b.writable)
    }

    /// The device-readable buffers.
    pub fn readable(&self) -> impl Iterator<Item = &Buffer> {
        self.buffers.iter().filter(|b| !b.writable)
    }
}

/// Reads the chain starting at descriptor `head` of the queue at `layout` out of `mem`.
///
/// A pure function of guest memory and the layout (it never writes), so a fuzzer can
/// drive it with arbitrary bytes. It never panics, and every buffer of a chain it
/// returns lies inside `mem`.
pub fn parse_chain<M: GuestMemoryBackend>(
    mem: &M,
    layout: &QueueLayout,
    head: u16,
) -> Result<Chain, ChainError> {
    let size = layout.size;
    if head >= size {
        return Err(ChainError::HeadOutOfRange { head, size });
    }
    let mut buffers = Vec::new();
    let mut total: u64 = 0;
    let mut index = head;
    let mut seen_writable = false;
    loop {
        if buffers.len() >= usize::from(size) {
            return Err(ChainError::TooLong { head, size });
        }
        let desc = read_descriptor(mem, layout.desc_table, index)
            .ok_or(ChainError::Unreadable { index })?;
        if desc.flags & VIRTQ_DESC_F_INDIRECT != 0 {
            return Err(ChainError::Indirect { index });
        }
        let writable = desc.flags & VIRTQ_DESC_F_WRITE != 0;
        if seen_writable && !writable {
            return Err(ChainError::ReadableAfterWritable { index });
        }
        seen_writable |= writable;
        // An empty buffer must still point into guest memory: vm-memory accepts any
        // address for an empty range, and a device would pass it on. (Found by the
        // virtio_chain fuzz target.)
        let inside = desc.addr.checked_add(u64::from(desc.len)).is_some()
            && usize::try_from(desc.len).is_ok_and(|len| {
                GuestMemoryBackend::check_range(mem, GuestAddress(desc.addr), len.max(1))
            });
        if !inside {
            return Err(ChainError::OutsideMemory {
                index,
                addr: desc.addr,
                len: desc.len,
            });
        }
        total += u64::from(desc.len);
        if total > u64::from(u32::MAX) {
            return Err(ChainError::TotalTooLong { head });
        }
        buffers.push(Buffer {
            addr: GuestAddress(desc.addr),
            len: desc.len,
            writable,
        });
        if desc.flags & VIRTQ_DESC_F_NEXT == 0 {
            return Ok(Chain { head, buffers });
        }
        if desc.next >= size {
            return Err(ChainError::NextOutOfRange {
                index,
                next: desc.next,
                size,
            });
        }
        index = desc.next;
    }
}

struct Descriptor {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

fn read_descriptor<M: GuestMemoryBackend>(mem: &M, table: u64, index: u16) -> Option<Descriptor> {
    let addr = table.checked_add(u64::from(index) * DESCRIPTOR_SIZE)?;
    let mut raw = [0u8; DESCRIPTOR_SIZE as usize];
    mem.read_slice(&mut raw, GuestAddress(addr)).ok()?;
    let (addr, rest) = raw.split_at(8);
    let (len, rest) = rest.split_at(4);
    let (flags, next) = rest.split_at(2);
    Some(Descriptor {
        addr: u64::from_le_bytes(addr.try_into().ok()?),
        len: u32::from_le_bytes(len.try_into().ok()?),
        flags: u16::from_le_bytes(flags.try_into().ok()?),
        next: u16::from_le_bytes(next.try_into().ok()?),
    })
}

/// The device's side of one enabled split virtqueue: ring positions and ring access
/// are rust-vmm's `virtio_queue::Queue`; descriptor chains go through [`parse_chain`],
/// which refuses more than virtio-queue's own iterator does (empty buffers outside
/// memory, readable after writable, indirect tables no device here negotiates).
#[derive(Debug)]
pub struct Queue {
    layout: QueueLayout,
    ring: virtio_queue::Queue,
}

impl Queue {
    /// A queue at `layout` (validated against `mem` and `max_size`) that resumes at
    /// `next_avail` and `next_used` (both 0 for a freshly enabled queue).
    pub fn new<M: GuestMemoryBackend>(
        mem: &M,
        layout: QueueLayout,
        max_size: u16,
        next_avail: u16,
        next_used: u16,
    ) -> Result<Self, QueueError> {
        layout.validate(mem, max_size)?;
        let mut ring = virtio_queue::Queue::new(max_size.min(MAX_QUEUE_SIZE))
            .map_err(|e| QueueError::Ring(e.to_string()))?;
        let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
        ring.set_size(layout.size);
        let (lo, hi) = split(layout.desc_table);
        ring.set_desc_table_address(lo, hi);
        let (lo, hi) = split(layout.avail_ring);
        ring.set_avail_ring_address(lo, hi);
        let (lo, hi) = split(layout.used_ring);
        ring.set_used_ring_address(lo, hi);
        ring.set_next_avail(next_avail);
        ring.set_next_used(next_used);
        ring.set_ready(true);
        if !ring.is_valid(mem) {
            return Err(QueueError::Ring(format!("virtio-queue refuses {layout:?}")));
        }
        Ok(Queue { layout, ring })
    }

    /// Where the queue is.
    pub fn layout(&self) -> QueueLayout {
        self.layout
    }

    /// The next available-ring entry the device will take.
    pub fn next_avail(&self) -> u16 {
        self.ring.next_avail()
    }

    /// The next used-ring entry the device will fill.
    pub fn next_used(&self) -> u16 {
        self.ring.next_used()
    }

    /// Takes the next head index the driver made available, or `None` when the ring is
    /// empty. The index itself is not checked: [`parse_chain`] does that.
    pub fn pop_avail<M: GuestMemoryBackend>(&mut self, mem: &M) -> Result<Option<u16>, QueueError> {
        let next_avail = self.ring.next_avail();
        let size = self.layout.size;
        let mut available = match self.ring.iter(mem) {
            Ok(iter) => iter,
            Err(virtio_queue::Error::InvalidAvailRingIndex) => {
                // The index the driver published is more than a queue's worth ahead.
                let avail_idx = self
                    .ring
                    .avail_idx(mem, Ordering::Acquire)
                    .map(|i| i.0)
                    .unwrap_or_default();
                return Err(QueueError::AvailIndex {
                    avail_idx,
                    next_avail,
                    size,
                });
            }
            Err(e) => return Err(QueueError::Ring(e.to_string())),
        };
        Ok(available.next().map(|chain| chain.head_index()))
    }

    /// Gives back the entry [`Queue::pop_avail`] just took, so the next call takes it
    /// again (a device that found it has nothing to put in the buffer).
    pub fn unpop_avail(&mut self) {
        self.ring.go_to_previous_position();
    }

    /// Returns chain `head` to the driver with `len` bytes written into it.
    pub fn add_used<M: GuestMemoryBackend>(
        &mut self,
        mem: &M,
        head: u16,
        len: u32,
    ) -> Result<(), QueueError> {
        if head >= self.layout.size {
            return Err(QueueError::UsedHead {
                head,
                size: self.layout.size,
            });
        }
        self.ring
            .add_used(mem, head, len)
            .map_err(|e| QueueError::Ring(e.to_string()))
    }

    /// Whether the driver wants an interrupt for buffers used so far: it does unless it
    /// set VIRTQ_AVAIL_F_NO_INTERRUPT (which virtio-queue 0.18 does not look at).
    pub fn wants_interrupt<M: GuestMemoryBackend>(&self, mem: &M) -> Result<bool, QueueError> {
        // The used index store must be ordered before the flags load, or the device
        // could miss a driver that just re-enabled interrupts.
        fence(Ordering::SeqCst);
        let flags: u16 = mem
            .load(GuestAddress(self.layout.avail_ring), Ordering::Acquire)
            .map_err(|source| QueueError::Memory {
                part: "available ring",
                source,
            })?;
        Ok(u16::from_le(flags) & VIRTQ_AVAIL_F_NO_INTERRUPT == 0)
    }

    /// Reads and validates the chain starting at `head`.
    pub fn parse_chain<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        head: u16,
    ) -> Result<Chain, ChainError> {
        parse_chain(mem, &self.layout, head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::test_driver::{memory, Ring, BUF, HIGH_REGION, REGION_SIZE};

    #[test]
    fn an_empty_buffer_outside_memory_is_refused() {
        let mem =
            vm_memory::GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x1_0000)]).unwrap();
        let layout = QueueLayout {
            size: 4,
            desc_table: 0x1000,
            avail_ring: 0x2000,
            used_ring: 0x3000,
        };
        // addr far outside memory, len 0, WRITE.
        let mut desc = [0u8; 16];
        desc[..8].copy_from_slice(&0x300_0000_0000u64.to_le_bytes());
        desc[12..14].copy_from_slice(&VIRTQ_DESC_F_WRITE.to_le_bytes());
        mem.write_slice(&desc, GuestAddress(0x1000)).unwrap();
        assert!(matches!(
            parse_chain(&mem, &layout, 0),
            Err(ChainError::OutsideMemory { .. })
        ));
    }

    const W: u16 = VIRTQ_DESC_F_WRITE;
    const N: u16 = VIRTQ_DESC_F_NEXT;

    fn ring() -> Ring {
        Ring::new(&memory(), 16)
    }

    #[test]
    fn chain_of_readable_then_writable_buffers_is_copied_out() {
        let r = ring();
        r.set_desc(3, BUF, 16, N, 7);
        r.set_desc(7, BUF + 0x100, 32, W | N, 1);
        r.set_desc(1, HIGH_REGION, 64, W, 0);
        let chain = parse_chain(&r.mem, &r.layout, 3).unwrap();
        assert_eq!(chain.head, 3);
        assert_eq!(
            chain.buffers,
            vec![
                Buffer {
                    addr: GuestAddress(BUF),
                    len: 16,
                    writable: false
                },
                Buffer {
                    addr: GuestAddress(BUF + 0x100),
                    len: 32,
                    writable: true
                },
                Buffer {
                    addr: GuestAddress(HIGH_REGION),
                    len: 64,
                    writable: true
                },
            ]
        );
        assert_eq!(chain.readable().count(), 1);
        assert_eq!(chain.writable().map(|b| b.len).sum::<u32>(), 96);
    }

    #[test]
    fn loops_are_refused() {
        let r = ring();
        r.set_desc(0, BUF, 8, W | N, 1);
        r.set_desc(1, BUF, 8, W | N, 0);
        assert_eq!(
            parse_chain(&r.mem, &r.layout, 0),
            Err(ChainError::TooLong { head: 0, size: 16 })
        );
        r.set_desc(5, BUF, 8, W | N, 5);
        assert_eq!(
            parse_chain(&r.mem, &r.layout, 5),
            Err(ChainError::TooLong { head: 5, size: 16 })
        );
    }

    #[test]
    fn a_chain_as_long_as_the_queue_is_accepted() {
        let r = ring();
        for i in 0..16 {
            let last = i == 15;
            r.set_desc(i, BUF, 1, if last { W } else { W | N }, i + 1);
        }
        assert_eq!(parse_chain(&r.mem, &r.layout, 0).unwrap().buffers.len(), 16);
    }

    #[test]
    fn indices_out_of_range_are_refused() {
        let r = ring();
        assert_eq!(
            parse_chain(&r.mem, &r.layout, 16),
            Err(ChainError::HeadOutOfRange { head: 16, size: 16 })
        );
        r.set_desc(2, BUF, 8, W | N, 16);
        assert_eq!(
            parse_chain(&r.mem, &r.layout, 2),
            Err(ChainError::NextOutOfRange {
                index: 2,
                next: 16,
                size: 16
            })
        );
    }

    #[test]
    fn buffers_outside_guest_memory_are_refused() {
        let r = ring();
        let cases = [
            // In the hole between the regions.
            (REGION_SIZE + 0x1000, 8),
            // Starts inside, runs into the hole.
            (REGION_SIZE - 4, 8),
            // Past the end of memory.
            (HIGH_REGION + REGION_SIZE, 1),
            // Oversized length.
            (BUF, u32::MAX),
            // Address + length wraps around.
            (u64::MAX - 2, 8),
        ];
        for (addr, len) in cases {
            r.set_desc(0, addr, len, W, 0);
            assert_eq!(
                parse_chain(&r.mem, &r.layout, 0),
                Err(ChainError::OutsideMemory {
                    index: 0,
                    addr,
                    len
                }),
                "{addr:#x}+{len}"
            );
        }
    }

    #[test]
    fn indirect_and_misordered_descriptors_are_refused() {
        let r = ring();
        r.set_desc(0, BUF, 32, VIRTQ_DESC_F_INDIRECT, 0);
        assert_eq!(
            parse_chain(&r.mem, &r.layout, 0),
            Err(ChainError::Indirect { index: 0 })
        );
        r.set_desc(0, BUF, 8, W | N, 1);
        r.set_desc(1, BUF, 8, 0, 0);
        assert_eq!(
            parse_chain(&r.mem, &r.layout, 0),
            Err(ChainError::ReadableAfterWritable { index: 1 })
        );
    }

    #[test]
    fn chains_longer_than_4_gib_in_total_are_refused() {
        // Buffers may overlap, so the total can exceed guest memory.
        let r = ring();
        r.set_desc(0, 0, REGION_SIZE as u32, W | N, 1);
        for i in 1..15 {
            r.set_desc(i, 0, REGION_SIZE as u32, W | N, i + 1);
        }
        r.set_desc(15, 0, REGION_SIZE as u32, W, 0);
        assert!(parse_chain(&r.mem, &r.layout, 0).is_ok());
        let big = Ring::new(&r.mem, 4096);
        for i in 0..4095 {
            big.set_desc(i, 0, REGION_SIZE as u32, W | N, i + 1);
        }
        big.set_desc(4095, 0, REGION_SIZE as u32, W, 0);
        assert_eq!(
            parse_chain(&big.mem, &big.layout, 0),
            Err(ChainError::TotalTooLong { head: 0 })
        );
    }

    #[test]
    fn descriptor_table_outside_memory_is_unreadable_not_a_panic() {
        let r = ring();
        let layout = QueueLayout {
            desc_table: u64::MAX - 15,
            ..r.layout
        };
        assert_eq!(
            parse_chain(&r.mem, &layout, 1),
            Err(ChainError::Unreadable { index: 1 })
        );
    }

    #[test]
    fn layouts_are_validated() {
        let mem = memory();
        let good = Ring::new(&mem, 16).layout;
        good.validate(&mem, 256).unwrap();
        for size in [0, 3, 512] {
            let l = QueueLayout { size, ..good };
            assert!(matches!(
                l.validate(&mem, 256),
                Err(QueueError::BadSize { .. })
            ));
        }
        let l = QueueLayout {
            desc_table: DESC_MISALIGNED,
            ..good
        };
        assert!(matches!(
            l.validate(&mem, 256),
            Err(QueueError::Misaligned { .. })
        ));
        let l = QueueLayout {
            used_ring: REGION_SIZE - 8,
            ..good
        };
        assert!(matches!(
            l.validate(&mem, 256),
            Err(QueueError::OutsideMemory { .. })
        ));
        let l = QueueLayout {
            avail_ring: u64::MAX - 1,
            ..good
        };
        assert!(matches!(
            l.validate(&mem, 256),
            Err(QueueError::OutsideMemory { .. })
        ));
    }

    const DESC_MISALIGNED: u64 = 0x1008;

    #[test]
    fn rings_are_walked_and_filled_in_order() {
        let mut r = ring();
        let mut q = Queue::new(&r.mem, r.layout, 16, 0, 0).unwrap();
        assert_eq!(q.pop_avail(&r.mem).unwrap(), None);
        r.publish(4);
        r.publish(9);
        assert_eq!(q.pop_avail(&r.mem).unwrap(), Some(4));
        assert_eq!(q.pop_avail(&r.mem).unwrap(), Some(9));
        assert_eq!(q.pop_avail(&r.mem).unwrap(), None);
        q.add_used(&r.mem, 9, 10).unwrap();
        q.add_used(&r.mem, 4, 20).unwrap();
        assert_eq!(r.used_idx(), 2);
        assert_eq!(r.used(0), (9, 10));
        assert_eq!(r.used(1), (4, 20));
        assert!(matches!(
            q.add_used(&r.mem, 16, 0),
            Err(QueueError::UsedHead { head: 16, .. })
        ));
        assert!(q.wants_interrupt(&r.mem).unwrap());
        r.set_avail_flags(VIRTQ_AVAIL_F_NO_INTERRUPT);
        assert!(!q.wants_interrupt(&r.mem).unwrap());
    }

    #[test]
    fn ring_indices_wrap_around() {
        let mut r = ring();
        let mut q = Queue::new(&r.mem, r.layout, 16, u16::MAX, u16::MAX).unwrap();
        r.set_avail_idx(u16::MAX);
        r.publish(2);
        assert_eq!(r.used_idx(), 0);
        assert_eq!(q.pop_avail(&r.mem).unwrap(), Some(2));
        q.add_used(&r.mem, 2, 1).unwrap();
        assert_eq!(r.used_idx(), 0);
        assert_eq!(r.used(u16::MAX), (2, 1));
    }

    #[test]
    fn an_avail_index_too_far_ahead_is_refused() {
        let mut r = ring();
        let mut q = Queue::new(&r.mem, r.layout, 16, 0, 0).unwrap();
        r.set_avail_idx(17);
        assert!(matches!(
            q.pop_avail(&r.mem),
            Err(QueueError::AvailIndex { avail_idx: 17, .. })
        ));
        assert_eq!(q.next_avail(), 0);
    }

    #[test]
    fn random_descriptor_tables_never_yield_a_buffer_outside_memory() {
        use crate::virtio::test_driver::XorShift;
        let r = ring();
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        let (mut ok, mut refused) = (0, 0);
        for round in 0..2000u32 {
            r.set_desc(0, 0, 0, 0, 0);
            rng.scribble(&r.mem, DESC_TABLE, 16 * 16);
            // Bias half the rounds towards plausible descriptors so chains get long.
            if round.is_multiple_of(2) {
                for i in 0..16u16 {
                    let v = rng.next();
                    let addr = (v >> 12) % (2 * REGION_SIZE + HIGH_REGION);
                    let len = (v as u32) % 0x3000;
                    let flags = (v >> 40) as u16 & (N | W);
                    r.set_desc(i, addr, len, flags, (v >> 48) as u16 % 18);
                }
            }
            let head = (rng.next() % 20) as u16;
            match parse_chain(&r.mem, &r.layout, head) {
                Ok(chain) => {
                    ok += 1;
                    assert!(chain.buffers.len() <= 16);
                    for b in &chain.buffers {
                        assert!(GuestMemoryBackend::check_range(
                            &r.mem,
                            b.addr,
                            b.len as usize
                        ));
                    }
                }
                Err(_) => refused += 1,
            }
        }
        assert!(ok > 50 && refused > 50, "ok {ok}, refused {refused}");
    }

    const DESC_TABLE: u64 = crate::virtio::test_driver::DESC;
}
