//! virtio-rng (virtio spec 5.4): an entropy source for the guest.
//!
//! One queue; every chain's device-writable buffers are filled from the host's
//! `getrandom(2)` and returned with the number of bytes written. Readable buffers are
//! never written, so a chain without a writable buffer completes with length 0.
//!
//! Clones: the device itself holds no random state (every byte comes fresh from the
//! host's `getrandom`), so two VMs restored from one snapshot never get the same bytes
//! from it. What a clone must also learn is *that* it is a clone, so the guest can
//! reseed its own generator: the device keeps a generation counter (Cube's stand-in
//! for a VM generation ID) as its 8-byte configuration space, bumps it by a random
//! amount whenever a VM is restored as a clone, and raises a configuration-change
//! interrupt.

use serde::{Deserialize, Serialize};
use vm_memory::Bytes;

use super::device::{copy_config, ActiveQueues, DeviceError, VirtioDevice};
use super::device_state::{DeviceKind, DeviceStateError, Persist};
use super::queue::{Chain, ChainError, Queue};
use super::{VirtioMemory, VIRTIO_F_VERSION_1, VIRTIO_ID_RNG};

/// Size of the one request queue.
pub const RNG_QUEUE_SIZE: u16 = 256;
/// Most bytes served for one request, so one guest request cannot hold the vCPU for long.
pub const MAX_BYTES_PER_REQUEST: usize = 1 << 20;

const QUEUE_SIZES: [u16; 1] = [RNG_QUEUE_SIZE];
const CHUNK: usize = 4096;

/// The virtio entropy device.
#[derive(Default)]
pub struct Rng {
    active: Option<ActiveQueues>,
    generation: u64,
}

impl Rng {
    /// A device waiting for a driver.
    pub fn new() -> Self {
        Rng::default()
    }

    /// The VM generation counter: changes each time the VM is restored as a clone.
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        copy_config(&self.generation.to_le_bytes(), offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn active_queues(&mut self) -> &mut Option<ActiveQueues> {
        &mut self.active
    }

    fn process_queue(&mut self, index: u16) -> Result<(), DeviceError> {
        let active = self.active.as_mut().ok_or(DeviceError::NotActivated)?;
        let queue = active
            .queues
            .get_mut(usize::from(index))
            .ok_or(DeviceError::NoSuchQueue(index))?;
        let mem = &active.memory;
        let mut used_any = false;
        // Buffers already used are signalled even when a later one fails.
        let served = serve_available(mem, queue, index, &mut used_any);
        if used_any
            && queue
                .wants_interrupt(mem)
                .map_err(|source| DeviceError::Queue { index, source })?
        {
            active
                .interrupt
                .signal_used_buffer()
                .map_err(DeviceError::Interrupt)?;
        }
        served
    }

    fn queues(&self) -> &[Queue] {
        self.active.as_ref().map_or(&[], |a| a.queues.as_slice())
    }

    fn on_clone(&mut self) -> Result<(), DeviceError> {
        // A random step (never 0): clones of one snapshot get different generations,
        // so none can mistake another's for its own.
        let mut step = [0u8; 8];
        getrandom(&mut step).map_err(DeviceError::Entropy)?;
        self.generation = self.generation.wrapping_add(u64::from_le_bytes(step) | 1);
        Ok(())
    }
}

/// Device state in a snapshot: the VM generation counter the guest knows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// See [`Rng::generation`].
    pub generation: u64,
}

impl Persist for Rng {
    type State = RngState;
    const KIND: DeviceKind = DeviceKind::Rng;
    const VERSION: u16 = 1;

    fn save(&self) -> Result<RngState, DeviceStateError> {
        Ok(RngState {
            generation: self.generation,
        })
    }

    fn restore(&mut self, saved: RngState) -> Result<(), DeviceStateError> {
        self.generation = saved.generation;
        Ok(())
    }
}

/// Serves every chain the driver made available in `queue`, setting `used_any` once a
/// chain went back to the driver.
fn serve_available(
    mem: &VirtioMemory,
    queue: &mut Queue,
    index: u16,
    used_any: &mut bool,
) -> Result<(), DeviceError> {
    let queue_err = |source| DeviceError::Queue { index, source };
    while let Some(head) = queue.pop_avail(mem).map_err(queue_err)? {
        let (len, failure) = match queue.parse_chain(mem, head) {
            Ok(chain) => fill_chain(mem, &chain),
            Err(ChainError::HeadOutOfRange { .. }) => {
                // No descriptor to give back: the entry is consumed and dropped.
                tracing::warn!(head, "virtio-rng: available ring names no descriptor");
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "virtio-rng: malformed descriptor chain refused");
                (0, None)
            }
        };
        queue.add_used(mem, head, len).map_err(queue_err)?;
        *used_any = true;
        if let Some(e) = failure {
            return Err(e);
        }
    }
    Ok(())
}

/// Fills the writable buffers of `chain` (up to [`MAX_BYTES_PER_REQUEST`]) and returns
/// how many bytes were written, and the error that stopped it early, if one did.
fn fill_chain(mem: &VirtioMemory, chain: &Chain) -> (u32, Option<DeviceError>) {
    let mut written = 0usize;
    for buffer in chain.writable() {
        let want = (buffer.len as usize).min(MAX_BYTES_PER_REQUEST - written);
        if let Err(e) = fill_guest(mem, buffer.addr, want) {
            return (len_u32(written), Some(e));
        }
        written += want;
        if written == MAX_BYTES_PER_REQUEST {
            break;
        }
    }
    (len_u32(written), None)
}

/// `written` never exceeds [`MAX_BYTES_PER_REQUEST`], far below `u32::MAX`.
fn len_u32(written: usize) -> u32 {
    u32::try_from(written).unwrap_or(u32::MAX)
}

/// Writes `len` random bytes at `addr` (a range already checked to be guest memory).
fn fill_guest(
    mem: &VirtioMemory,
    addr: vm_memory::GuestAddress,
    len: usize,
) -> Result<(), DeviceError> {
    let mut chunk = [0u8; CHUNK];
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(CHUNK);
        let bytes = &mut chunk[..n];
        getrandom(bytes).map_err(DeviceError::Entropy)?;
        let at = addr.0 + done as u64;
        mem.write_slice(bytes, vm_memory::GuestAddress(at))
            .map_err(|source| DeviceError::GuestWrite { addr: at, source })?;
        done += n;
    }
    Ok(())
}

/// Fills `buf` from the kernel's CSPRNG, retrying short reads and interruptions.
fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0usize;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: `rest` is a valid, writable buffer of `rest.len()` bytes for the
        // duration of the call; getrandom writes at most that many bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        filled += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::interrupt::INTERRUPT_USED_BUFFER;
    use crate::virtio::mmio::regs;
    use crate::virtio::queue::{
        VIRTQ_AVAIL_F_NO_INTERRUPT, VIRTQ_DESC_F_NEXT as N, VIRTQ_DESC_F_WRITE as W,
    };
    use crate::virtio::test_driver::{memory, Driver, Ring, BUF, HIGH_REGION, REGION_SIZE};
    use vm_memory::GuestAddress;

    fn running() -> (Driver, Ring) {
        let mem = memory();
        let mut driver = Driver::new(Box::new(Rng::new()), &mem);
        let ring = Ring::new(&mem, 16);
        driver.bring_up(&ring);
        (driver, ring)
    }

    /// Serves one writable 256-byte buffer at `addr` through descriptor `desc` and
    /// checks it came back, in the next used entry, full of random bytes.
    fn serve_good_request(driver: &mut Driver, ring: &mut Ring, desc: u16, addr: u64) {
        let before = ring.used_idx();
        ring.mem
            .write_slice(&[0u8; 256], GuestAddress(addr))
            .unwrap();
        ring.set_desc(desc, addr, 256, W, 0);
        ring.publish(desc);
        driver.notify(0);
        assert_eq!(ring.used_idx(), before.wrapping_add(1));
        assert_eq!(ring.used(before), (u32::from(desc), 256));
        let data = ring.read_buf(addr, 256);
        assert!(data.iter().any(|b| *b != 0), "buffer was not filled");
    }

    #[test]
    fn a_request_is_filled_with_random_bytes_and_interrupts() {
        let (mut driver, mut ring) = running();
        assert_eq!(driver.read32(regs::DEVICE_ID), VIRTIO_ID_RNG);
        serve_good_request(&mut driver, &mut ring, 0, BUF);
        assert_eq!(driver.line.raises(), 1);
        assert_eq!(driver.read32(regs::INTERRUPT_STATUS), INTERRUPT_USED_BUFFER);
        driver.write32(regs::INTERRUPT_ACK, INTERRUPT_USED_BUFFER);
        assert_eq!(driver.read32(regs::INTERRUPT_STATUS), 0);
        assert!(!driver.line.asserted());
        // Two requests get different bytes.
        let first = ring.read_buf(BUF, 256);
        serve_good_request(&mut driver, &mut ring, 1, BUF + 0x1000);
        assert_ne!(first, ring.read_buf(BUF + 0x1000, 256));
    }

    #[test]
    fn every_writable_buffer_of_a_chain_is_filled_and_readable_ones_are_not() {
        let (mut driver, mut ring) = running();
        let readable = [0x5Au8; 64];
        ring.mem.write_slice(&readable, GuestAddress(BUF)).unwrap();
        ring.set_desc(0, BUF, 64, N, 1);
        ring.set_desc(1, BUF + 0x100, 100, W | N, 2);
        ring.set_desc(2, HIGH_REGION + 0x100, 300, W, 0);
        ring.publish(0);
        driver.notify(0);
        assert_eq!(ring.used(0), (0, 400));
        assert_eq!(ring.read_buf(BUF, 64), readable.to_vec());
        assert!(ring.read_buf(BUF + 0x100, 100).iter().any(|b| *b != 0));
        assert!(ring
            .read_buf(HIGH_REGION + 0x100, 300)
            .iter()
            .any(|b| *b != 0));
    }

    #[test]
    fn a_chain_without_writable_buffers_completes_empty_and_untouched() {
        let (mut driver, mut ring) = running();
        let readable = [0x77u8; 128];
        ring.mem.write_slice(&readable, GuestAddress(BUF)).unwrap();
        ring.set_desc(0, BUF, 128, 0, 0);
        ring.publish(0);
        driver.notify(0);
        assert_eq!(ring.used_idx(), 1);
        assert_eq!(ring.used(0), (0, 0));
        assert_eq!(ring.read_buf(BUF, 128), readable.to_vec());
        serve_good_request(&mut driver, &mut ring, 1, BUF + 0x1000);
    }

    #[test]
    fn malformed_chains_are_refused_and_the_device_keeps_working() {
        let (mut driver, mut ring) = running();
        // (descriptors to write, head) for each malformed chain.
        let loop_chain: &[(u16, u64, u32, u16, u16)] =
            &[(0, BUF, 8, W | N, 1), (1, BUF, 8, W | N, 0)];
        let next_out_of_range: &[_] = &[(2, BUF, 8, W | N, 99)];
        let in_the_hole: &[_] = &[(3, REGION_SIZE + 0x100, 8, W, 0)];
        let oversized: &[_] = &[(4, BUF, u32::MAX, W, 0)];
        let readable_after_writable: &[_] = &[(5, BUF, 8, W | N, 6), (6, BUF, 8, 0, 0)];
        let indirect: &[_] = &[(7, BUF, 16, crate::virtio::queue::VIRTQ_DESC_F_INDIRECT, 0)];
        let cases = [
            (loop_chain, 0u16),
            (next_out_of_range, 2),
            (in_the_hole, 3),
            (oversized, 4),
            (readable_after_writable, 5),
            (indirect, 7),
        ];
        let mut used = 0u16;
        for (descs, head) in cases {
            ring.mem.write_slice(&[0u8; 8], GuestAddress(BUF)).unwrap();
            for &(i, addr, len, flags, next) in descs {
                ring.set_desc(i, addr, len, flags, next);
            }
            ring.publish(head);
            driver.notify(0);
            // Given back empty, nothing written.
            assert_eq!(ring.used_idx(), used + 1, "head {head}");
            assert_eq!(ring.used(used), (u32::from(head), 0));
            assert_eq!(ring.read_buf(BUF, 8), vec![0u8; 8]);
            used += 1;
            serve_good_request(&mut driver, &mut ring, 10, BUF + 0x1000);
            used += 1;
        }
        // A head index past the queue has no descriptor to give back: it is dropped.
        ring.publish(16);
        driver.notify(0);
        assert_eq!(ring.used_idx(), used);
        serve_good_request(&mut driver, &mut ring, 11, BUF + 0x2000);
        assert!(driver.transport.is_activated());
    }

    #[test]
    fn a_runaway_avail_index_is_refused_without_a_panic() {
        let (mut driver, mut ring) = running();
        ring.set_avail_idx(1000);
        driver.notify(0);
        assert_eq!(ring.used_idx(), 0);
        // Once the driver puts the index back, requests are served again.
        ring.set_avail_idx(0);
        serve_good_request(&mut driver, &mut ring, 0, BUF);
    }

    #[test]
    fn no_interrupt_when_the_driver_suppresses_it() {
        let (mut driver, mut ring) = running();
        ring.set_avail_flags(VIRTQ_AVAIL_F_NO_INTERRUPT);
        serve_good_request(&mut driver, &mut ring, 0, BUF);
        assert_eq!(driver.line.raises(), 0);
        ring.set_avail_flags(0);
        serve_good_request(&mut driver, &mut ring, 0, BUF);
        assert_eq!(driver.line.raises(), 1);
    }

    #[test]
    fn notifications_for_absent_queues_are_ignored() {
        let (mut driver, mut ring) = running();
        ring.set_desc(0, BUF, 8, W, 0);
        ring.publish(0);
        driver.notify(1);
        driver.notify(u32::MAX);
        assert_eq!(ring.used_idx(), 0);
        driver.notify(0);
        assert_eq!(ring.used_idx(), 1);
    }

    #[test]
    fn a_request_is_capped() {
        let (mut driver, mut ring) = running();
        // Sixteen overlapping 1 MiB buffers: only the first MiB is served.
        for i in 0..16 {
            ring.set_desc(
                i,
                0,
                REGION_SIZE as u32,
                if i == 15 { W } else { W | N },
                i + 1,
            );
        }
        ring.publish(0);
        driver.notify(0);
        assert_eq!(ring.used(0), (0, MAX_BYTES_PER_REQUEST as u32));
    }

    fn dirty(mem: &VirtioMemory, addr: u64) -> bool {
        use vm_memory::bitmap::Bitmap;
        use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
        let region = mem.find_region(GuestAddress(addr)).unwrap();
        let offset = addr - region.start_addr().0;
        region.bitmap().dirty_at(offset as usize)
    }

    #[test]
    fn device_writes_are_recorded_for_snapshots() {
        let (mut driver, mut ring) = running();
        let addr = HIGH_REGION + 0x8000;
        assert!(!dirty(&ring.mem, addr));
        assert!(!dirty(&ring.mem, ring.layout.used_ring));
        ring.set_desc(0, addr, 100, W, 0);
        ring.publish(0);
        driver.notify(0);
        assert_eq!(ring.used(0), (0, 100));
        assert!(dirty(&ring.mem, addr), "random bytes not in the write log");
        assert!(
            dirty(&ring.mem, ring.layout.used_ring),
            "used ring not in the write log"
        );
        assert!(!dirty(&ring.mem, addr + 0x1000));
    }

    #[test]
    fn foreign_state_is_refused() {
        use crate::virtio::device_state::{DeviceStateError, PersistDevice};
        let mut rng = Rng::new();
        let mut saved = rng.save_state().unwrap();
        rng.restore_state(&saved).unwrap();
        saved.bytes.clear();
        assert!(matches!(
            rng.restore_state(&saved),
            Err(DeviceStateError::Decode { .. })
        ));
        assert!(matches!(
            rng.process_queue(0),
            Err(DeviceError::NotActivated)
        ));
    }

    #[test]
    fn clones_of_one_snapshot_get_distinct_generations_and_a_config_interrupt() {
        use crate::virtio::interrupt::INTERRUPT_CONFIG_CHANGE;
        use crate::virtio::mmio::MmioTransport;
        use crate::virtio::test_driver::RecordingLine;
        use std::sync::Arc;
        let (d, ring) = running();
        assert_eq!(d.read32(regs::CONFIG), 0);
        let state = d.transport.save().unwrap();
        assert_eq!(state.device_state.bytes, [0]);
        let mut generations = Vec::new();
        for _ in 0..2 {
            let line = Arc::new(RecordingLine::default());
            let mut clone = MmioTransport::restore(
                Box::new(Rng::new()),
                ring.mem.clone(),
                line.clone(),
                &state,
            )
            .unwrap();
            clone.mark_cloned().unwrap();
            let mut data = [0u8; 8];
            clone.read(regs::CONFIG, &mut data);
            let generation = u64::from_le_bytes(data);
            assert_ne!(generation, 0);
            let mut word = [0u8; 4];
            clone.read(regs::CONFIG_GENERATION, &mut word);
            assert_eq!(u32::from_le_bytes(word), 1);
            clone.read(regs::INTERRUPT_STATUS, &mut word);
            assert_eq!(u32::from_le_bytes(word), INTERRUPT_CONFIG_CHANGE);
            assert!(line.asserted());
            // The generation survives the clone's own snapshot.
            let again = clone.save().unwrap();
            let saved: RngState = postcard::from_bytes(&again.device_state.bytes).unwrap();
            assert_eq!(saved.generation, generation);
            let restored = MmioTransport::restore(
                Box::new(Rng::new()),
                ring.mem.clone(),
                Arc::new(RecordingLine::default()),
                &again,
            )
            .unwrap();
            restored.read(regs::CONFIG, &mut data);
            assert_eq!(u64::from_le_bytes(data), generation);
            generations.push(generation);
        }
        assert_ne!(generations[0], generations[1]);
    }
}
