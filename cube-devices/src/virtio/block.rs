//! virtio-blk (virtio spec 5.2): a disk backed by a host file.
//!
//! Each sandbox gets its own copy of the template's image ([`Block::from_template`]
//! clones it by reflink where the filesystem can, through cube-storage), so guests
//! never share writes. Requests are served to completion when the queue is notified:
//! there is never a request half-done inside the device, so a snapshot taken between
//! notifications holds every request either used or still in the available ring.
//! Supported: read, write, flush (`fdatasync`), get-id; a read-only disk refuses writes.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::chain_io::Segments;
use super::device::{copy_config, ActiveQueues, DeviceError, VirtioDevice};
use super::device_state::{DeviceKind, DeviceStateError, Persist};
use super::queue::{Chain, ChainError, Queue};
use super::{VirtioMemory, VIRTIO_F_VERSION_1};

/// Virtio device type of a block device.
pub const VIRTIO_ID_BLOCK: u32 = 2;
/// Feature: the device reports the most segments a request may have.
pub const VIRTIO_BLK_F_SEG_MAX: u32 = 2;
/// Feature: the disk is read-only.
pub const VIRTIO_BLK_F_RO: u32 = 5;
/// Feature: the device takes flush requests.
pub const VIRTIO_BLK_F_FLUSH: u32 = 9;
/// Request type: read.
pub const VIRTIO_BLK_T_IN: u32 = 0;
/// Request type: write.
pub const VIRTIO_BLK_T_OUT: u32 = 1;
/// Request type: flush.
pub const VIRTIO_BLK_T_FLUSH: u32 = 4;
/// Request type: get the device id string.
pub const VIRTIO_BLK_T_GET_ID: u32 = 8;
/// Status: done.
pub const VIRTIO_BLK_S_OK: u8 = 0;
/// Status: failed.
pub const VIRTIO_BLK_S_IOERR: u8 = 1;
/// Status: request type not supported.
pub const VIRTIO_BLK_S_UNSUPP: u8 = 2;
/// Sector size of the virtio-blk protocol.
pub const SECTOR_SIZE: u64 = 512;
/// Length of the id string a get-id request returns.
pub const VIRTIO_BLK_ID_BYTES: usize = 20;
/// Size of the request queue.
pub const BLOCK_QUEUE_SIZE: u16 = 256;

const QUEUE_SIZES: [u16; 1] = [BLOCK_QUEUE_SIZE];
const HEADER_LEN: u64 = 16;
/// Data moves through the host in pieces of this size, whatever a request's length.
const CHUNK: usize = 1 << 20;

/// Why a block device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The image cannot be opened.
    #[error("Opening disk image {path}")]
    Open {
        /// The image.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The image size is not a whole number of sectors.
    #[error("Disk image {path} is {len} bytes, not a multiple of {SECTOR_SIZE}")]
    Size {
        /// The image.
        path: PathBuf,
        /// Its length.
        len: u64,
    },
    /// The sandbox's copy of the template image could not be made.
    #[error("Copying the template disk image")]
    Clone(#[from] cube_storage::reflink::CloneError),
}

/// What a block device is, beyond its image.
#[derive(Clone, Debug, Default)]
pub struct BlockOptions {
    /// Refuse writes, and tell the driver so.
    pub read_only: bool,
    /// The id string returned by get-id (up to 20 bytes; longer ids are cut).
    pub id: String,
}

/// Device state in a snapshot: what the restored device must match.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    /// Size of the disk in 512-byte sectors.
    pub capacity_sectors: u64,
    /// Whether the device refused writes.
    pub read_only: bool,
}

/// The virtio block device.
pub struct Block {
    file: File,
    capacity_sectors: u64,
    options: BlockOptions,
    active: Option<ActiveQueues>,
}

impl Block {
    /// A device serving the image at `path`.
    pub fn open(path: &Path, options: BlockOptions) -> Result<Self, BlockError> {
        let open_err = |source| BlockError::Open {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!options.read_only)
            .open(path)
            .map_err(open_err)?;
        let len = file.metadata().map_err(open_err)?.len();
        if !len.is_multiple_of(SECTOR_SIZE) {
            return Err(BlockError::Size {
                path: path.to_path_buf(),
                len,
            });
        }
        Ok(Block {
            file,
            capacity_sectors: len / SECTOR_SIZE,
            options,
            active: None,
        })
    }

    /// A device serving a fresh copy of `template_image` made at `sandbox_image`
    /// (a reflink where the filesystem supports one, else a sparse copy).
    pub fn from_template(
        template_image: &Path,
        sandbox_image: &Path,
        options: BlockOptions,
    ) -> Result<Self, BlockError> {
        cube_storage::reflink::clone_file(template_image, sandbox_image)?;
        Self::open(sandbox_image, options)
    }

    /// The disk size in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.capacity_sectors
    }

    fn config_bytes(&self) -> [u8; 16] {
        let mut config = [0u8; 16];
        config[..8].copy_from_slice(&self.capacity_sectors.to_le_bytes());
        // size_max (offset 8) is 0: no limit on one segment's size.
        let seg_max = u32::from(BLOCK_QUEUE_SIZE - 2);
        config[12..16].copy_from_slice(&seg_max.to_le_bytes());
        config
    }

    /// Serves one request; returns the status and the bytes written into the chain's
    /// writable part (status byte included).
    fn serve(&self, mem: &VirtioMemory, chain: &Chain) -> Result<u32, &'static str> {
        let readable = Segments::readable(chain);
        let writable = Segments::writable(chain);
        if readable.len() < HEADER_LEN || writable.is_empty() {
            return Err("request without header or status byte");
        }
        let mut header = [0u8; HEADER_LEN as usize];
        readable
            .read_at(mem, 0, &mut header)
            .map_err(|_| "header unreadable")?;
        let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let sector = u64::from_le_bytes([
            header[8], header[9], header[10], header[11], header[12], header[13], header[14],
            header[15],
        ]);
        let status_at = writable.len() - 1;
        let (status, written) = match kind {
            VIRTIO_BLK_T_IN => match self.read(mem, sector, &writable, status_at) {
                Ok(()) => (VIRTIO_BLK_S_OK, status_at),
                Err(e) => {
                    tracing::debug!(sector, "virtio-blk: read refused: {e}");
                    (VIRTIO_BLK_S_IOERR, 0)
                }
            },
            VIRTIO_BLK_T_OUT => match self.write(mem, sector, &readable) {
                Ok(()) => (VIRTIO_BLK_S_OK, 0),
                Err(e) => {
                    tracing::debug!(sector, "virtio-blk: write refused: {e}");
                    (VIRTIO_BLK_S_IOERR, 0)
                }
            },
            VIRTIO_BLK_T_FLUSH => match self.file.sync_data() {
                Ok(()) => (VIRTIO_BLK_S_OK, 0),
                Err(e) => {
                    tracing::warn!("virtio-blk: fdatasync failed: {e}");
                    (VIRTIO_BLK_S_IOERR, 0)
                }
            },
            VIRTIO_BLK_T_GET_ID => {
                let mut id = [0u8; VIRTIO_BLK_ID_BYTES];
                let bytes = self.options.id.as_bytes();
                let n = bytes.len().min(VIRTIO_BLK_ID_BYTES);
                id[..n].copy_from_slice(&bytes[..n]);
                let n = (status_at as usize).min(VIRTIO_BLK_ID_BYTES);
                match writable.write_at(mem, 0, &id[..n]) {
                    Ok(()) => (VIRTIO_BLK_S_OK, n as u64),
                    Err(_) => (VIRTIO_BLK_S_IOERR, 0),
                }
            }
            _ => (VIRTIO_BLK_S_UNSUPP, 0),
        };
        writable
            .write_at(mem, status_at, &[status])
            .map_err(|_| "status byte unwritable")?;
        // `written` is below the chain's total length, which parse_chain bounds to u32.
        Ok(u32::try_from(written + 1).unwrap_or(u32::MAX))
    }

    /// The byte offset of `sector`, if `len` bytes from there lie inside the disk.
    fn disk_range(&self, sector: u64, len: u64) -> Result<u64, String> {
        if !len.is_multiple_of(SECTOR_SIZE) {
            return Err(format!("length {len} is not a whole number of sectors"));
        }
        let end = sector
            .checked_add(len / SECTOR_SIZE)
            .filter(|end| *end <= self.capacity_sectors)
            .ok_or_else(|| format!("sectors {sector}+{} are past the disk's end", len / 512))?;
        debug_assert!(end <= self.capacity_sectors);
        Ok(sector * SECTOR_SIZE)
    }

    fn read(
        &self,
        mem: &VirtioMemory,
        sector: u64,
        out: &Segments,
        len: u64,
    ) -> Result<(), String> {
        let start = self.disk_range(sector, len)?;
        let mut chunk = vec![0u8; CHUNK.min(len as usize)];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(CHUNK as u64) as usize;
            self.file
                .read_exact_at(&mut chunk[..n], start + done)
                .map_err(|e| e.to_string())?;
            out.write_at(mem, done, &chunk[..n])
                .map_err(|e| e.to_string())?;
            done += n as u64;
        }
        Ok(())
    }

    fn write(&self, mem: &VirtioMemory, sector: u64, input: &Segments) -> Result<(), String> {
        if self.options.read_only {
            return Err("the disk is read-only".into());
        }
        let len = input.len() - HEADER_LEN;
        let start = self.disk_range(sector, len)?;
        let mut chunk = vec![0u8; CHUNK.min(len as usize)];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(CHUNK as u64) as usize;
            input
                .read_at(mem, HEADER_LEN + done, &mut chunk[..n])
                .map_err(|e| e.to_string())?;
            self.file
                .write_all_at(&chunk[..n], start + done)
                .map_err(|e| e.to_string())?;
            done += n as u64;
        }
        Ok(())
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn features(&self) -> u64 {
        let mut features =
            1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_BLK_F_FLUSH | 1 << VIRTIO_BLK_F_SEG_MAX;
        if self.options.read_only {
            features |= 1 << VIRTIO_BLK_F_RO;
        }
        features
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.config_bytes();
        copy_config(&config, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // Every field this device offers is read-only.
    }

    fn active_queues(&mut self) -> &mut Option<ActiveQueues> {
        &mut self.active
    }

    fn process_queue(&mut self, index: u16) -> Result<(), DeviceError> {
        let mut active = self.active.take().ok_or(DeviceError::NotActivated)?;
        let result = self.serve_queue(&mut active, index);
        self.active = Some(active);
        result
    }

    fn queues(&self) -> &[Queue] {
        self.active.as_ref().map_or(&[], |a| a.queues.as_slice())
    }
}

impl Persist for Block {
    type State = BlockState;
    const KIND: DeviceKind = DeviceKind::Block;
    const VERSION: u16 = 1;

    fn save(&self) -> Result<BlockState, DeviceStateError> {
        Ok(BlockState {
            capacity_sectors: self.capacity_sectors,
            read_only: self.options.read_only,
        })
    }

    fn restore(&mut self, saved: BlockState) -> Result<(), DeviceStateError> {
        if saved.capacity_sectors != self.capacity_sectors {
            return Err(DeviceStateError::mismatch(
                Self::KIND,
                "capacity in sectors",
                saved.capacity_sectors,
                self.capacity_sectors,
            ));
        }
        if saved.read_only != self.options.read_only {
            return Err(DeviceStateError::mismatch(
                Self::KIND,
                "read-only setting",
                saved.read_only,
                self.options.read_only,
            ));
        }
        Ok(())
    }
}

impl Block {
    fn serve_queue(&self, active: &mut ActiveQueues, index: u16) -> Result<(), DeviceError> {
        let queue = active
            .queues
            .get_mut(usize::from(index))
            .ok_or(DeviceError::NoSuchQueue(index))?;
        let mem = &active.memory;
        let queue_err = |source| DeviceError::Queue { index, source };
        let mut used_any = false;
        while let Some(head) = queue.pop_avail(mem).map_err(queue_err)? {
            let len = match queue.parse_chain(mem, head) {
                Ok(chain) => self.serve(mem, &chain).unwrap_or_else(|e| {
                    tracing::warn!(head, "virtio-blk: request refused: {e}");
                    0
                }),
                Err(ChainError::HeadOutOfRange { .. }) => {
                    tracing::warn!(head, "virtio-blk: available ring names no descriptor");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "virtio-blk: malformed descriptor chain refused");
                    0
                }
            };
            queue.add_used(mem, head, len).map_err(queue_err)?;
            used_any = true;
        }
        if used_any && queue.wants_interrupt(mem).map_err(queue_err)? {
            active
                .interrupt
                .signal_used_buffer()
                .map_err(DeviceError::Interrupt)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::mmio::{regs, MmioTransport};
    use crate::virtio::persist::VirtioMmioState;
    use crate::virtio::queue::{VIRTQ_DESC_F_NEXT as N, VIRTQ_DESC_F_WRITE as W};
    use crate::virtio::test_driver::RecordingLine;
    use crate::virtio::test_driver::{memory, Driver, Ring, BUF, REGION_SIZE};
    use std::sync::Arc;
    use vm_memory::{Bytes, GuestAddress};

    const HDR: u64 = BUF;
    const DATA: u64 = BUF + 0x1000;
    const STATUS: u64 = BUF + 0x9000;

    fn image(sectors: u64) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        let pattern: Vec<u8> = (0..sectors * SECTOR_SIZE)
            .map(|i| (i / 512) as u8)
            .collect();
        std::fs::write(f.path(), pattern).unwrap();
        f
    }

    fn device(path: &Path, read_only: bool) -> Driver {
        let blk = Block::open(
            path,
            BlockOptions {
                read_only,
                id: "cube-disk-0".into(),
            },
        )
        .unwrap();
        Driver::new(Box::new(blk), &memory())
    }

    fn features(read_only: bool) -> u64 {
        let ro = if read_only { 1 << VIRTIO_BLK_F_RO } else { 0 };
        1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_BLK_F_FLUSH | ro
    }

    /// Writes a request header and lays out header → data (split in two) → status.
    fn request(ring: &mut Ring, kind: u32, sector: u64, data_len: u32, head: u16) {
        let mem = &ring.mem;
        mem.write_obj(kind, GuestAddress(HDR)).unwrap();
        mem.write_obj(0u32, GuestAddress(HDR + 4)).unwrap();
        mem.write_obj(sector, GuestAddress(HDR + 8)).unwrap();
        mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let data_flags = if kind == VIRTIO_BLK_T_IN { W } else { 0 };
        let h = head;
        ring.set_desc(h, HDR, 16, N, h + 1);
        if data_len > 0 {
            let first = data_len / 2;
            ring.set_desc(h + 1, DATA, first, data_flags | N, h + 2);
            ring.set_desc(
                h + 2,
                DATA + u64::from(first),
                data_len - first,
                data_flags | N,
                h + 3,
            );
            ring.set_desc(h + 3, STATUS, 1, W, 0);
        } else {
            ring.set_desc(h + 1, STATUS, 1, W, 0);
        }
        ring.publish(h);
    }

    fn status(ring: &Ring) -> u8 {
        ring.mem.read_obj(GuestAddress(STATUS)).unwrap()
    }

    #[test]
    fn features_and_config_space_describe_the_disk() {
        let img = image(8);
        let mut d = device(img.path(), false);
        let offered = d.device_features();
        assert_eq!(offered, features(false) | 1 << VIRTIO_BLK_F_SEG_MAX);
        assert_eq!(d.read32(regs::DEVICE_ID), VIRTIO_ID_BLOCK);
        // capacity (u64, in two reads as Linux does), seg_max.
        assert_eq!(d.read32(regs::CONFIG), 8);
        assert_eq!(d.read32(regs::CONFIG + 4), 0);
        assert_eq!(d.read32(regs::CONFIG + 12), 254);
        let mut byte = [0xAAu8; 1];
        d.transport.read(regs::CONFIG, &mut byte);
        assert_eq!(byte, [8]);
        assert_eq!(d.read32(regs::CONFIG + 0x40), 0);
        // Config writes change nothing.
        assert!(d.negotiate(features(false)));
        d.write32(regs::CONFIG, 99);
        assert_eq!(d.read32(regs::CONFIG), 8);
        // A read-only disk says so; the driver may not claim RO on a writable one.
        let mut ro = device(img.path(), true);
        assert_eq!(
            ro.device_features() & 1 << VIRTIO_BLK_F_RO,
            1 << VIRTIO_BLK_F_RO
        );
        assert!(!d.negotiate(features(true)));
        // A size that is not whole sectors is refused.
        std::fs::write(img.path(), [0u8; 700]).unwrap();
        assert!(matches!(
            Block::open(img.path(), BlockOptions::default()),
            Err(BlockError::Size { len: 700, .. })
        ));
    }

    #[test]
    fn write_read_flush_and_get_id_reach_the_file() {
        let img = image(16);
        let mut d = device(img.path(), false);
        let mut ring = Ring::new(&d.transport_memory(), 64);
        d.bring_up_queues(features(false), &[&ring]);

        let payload: Vec<u8> = (0..1024u32).map(|i| (i * 7) as u8).collect();
        ring.mem.write_slice(&payload, GuestAddress(DATA)).unwrap();
        request(&mut ring, VIRTIO_BLK_T_OUT, 3, 1024, 0);
        d.notify(0);
        assert_eq!(ring.used(0), (0, 1));
        assert_eq!(status(&ring), VIRTIO_BLK_S_OK);
        let on_disk = std::fs::read(img.path()).unwrap();
        assert_eq!(&on_disk[3 * 512..5 * 512], payload.as_slice());
        assert_eq!(on_disk[5 * 512], 5, "the next sector is untouched");

        ring.mem
            .write_slice(&[0u8; 1536], GuestAddress(DATA))
            .unwrap();
        request(&mut ring, VIRTIO_BLK_T_IN, 2, 1536, 4);
        d.notify(0);
        assert_eq!(ring.used(1), (4, 1537));
        assert_eq!(status(&ring), VIRTIO_BLK_S_OK);
        let read = ring.read_buf(DATA, 1536);
        assert!(read[..512].iter().all(|b| *b == 2));
        assert_eq!(&read[512..], payload.as_slice());

        request(&mut ring, VIRTIO_BLK_T_FLUSH, 0, 0, 8);
        d.notify(0);
        assert_eq!(ring.used(2), (8, 1));
        assert_eq!(status(&ring), VIRTIO_BLK_S_OK);

        request(&mut ring, VIRTIO_BLK_T_GET_ID, 0, 20, 12);
        // get-id's buffer is device-writable.
        ring.set_desc(13, DATA, 20, W | N, 14);
        ring.set_desc(14, STATUS, 1, W, 0);
        ring.set_desc(12, HDR, 16, N, 13);
        d.notify(0);
        assert_eq!(ring.used(3), (12, 21));
        assert_eq!(&ring.read_buf(DATA, 12), b"cube-disk-0\0");
        // Each used chain raised the interrupt.
        assert_eq!(d.line.raises(), 4);
    }

    #[test]
    fn bad_requests_fail_with_a_status_and_never_touch_the_disk() {
        let img = image(4);
        let before = std::fs::read(img.path()).unwrap();
        let mut d = device(img.path(), true);
        let mut ring = Ring::new(&d.transport_memory(), 64);
        d.bring_up_queues(features(true), &[&ring]);
        let mut n = 0u16;
        let mut expect = |d: &mut Driver, ring: &mut Ring, kind, sector, len, want: u8| {
            request(ring, kind, sector, len, 0);
            d.notify(0);
            n += 1;
            assert_eq!(ring.used_idx(), n);
            assert_eq!(status(ring), want, "type {kind} sector {sector} len {len}");
        };
        // Writes to a read-only disk.
        expect(
            &mut d,
            &mut ring,
            VIRTIO_BLK_T_OUT,
            0,
            512,
            VIRTIO_BLK_S_IOERR,
        );
        // Reads past the end, across the end, at a sector that overflows, of half sectors.
        expect(
            &mut d,
            &mut ring,
            VIRTIO_BLK_T_IN,
            4,
            512,
            VIRTIO_BLK_S_IOERR,
        );
        expect(
            &mut d,
            &mut ring,
            VIRTIO_BLK_T_IN,
            3,
            1024,
            VIRTIO_BLK_S_IOERR,
        );
        expect(
            &mut d,
            &mut ring,
            VIRTIO_BLK_T_IN,
            u64::MAX,
            512,
            VIRTIO_BLK_S_IOERR,
        );
        expect(
            &mut d,
            &mut ring,
            VIRTIO_BLK_T_IN,
            0,
            100,
            VIRTIO_BLK_S_IOERR,
        );
        // Unknown request types.
        expect(&mut d, &mut ring, 0xdead, 0, 0, VIRTIO_BLK_S_UNSUPP);
        assert_eq!(std::fs::read(img.path()).unwrap(), before);
    }

    #[test]
    fn malformed_chains_are_refused_without_a_panic() {
        let img = image(4);
        let mut d = device(img.path(), false);
        let mut ring = Ring::new(&d.transport_memory(), 16);
        d.bring_up_queues(features(false), &[&ring]);
        // A loop: 0 → 1 → 0.
        ring.set_desc(0, HDR, 16, N, 1);
        ring.set_desc(1, STATUS, 1, W | N, 0);
        ring.publish(0);
        // A buffer outside guest memory (in the hole between the regions).
        ring.set_desc(2, REGION_SIZE + 0x100, 16, N, 3);
        ring.set_desc(3, STATUS, 1, W, 0);
        ring.publish(2);
        // An oversized length running off the end of memory.
        ring.set_desc(4, HDR, u32::MAX, N, 5);
        ring.set_desc(5, STATUS, 1, W, 0);
        ring.publish(4);
        // A link past the table.
        ring.set_desc(6, HDR, 16, N, 200);
        ring.publish(6);
        // No header at all, only a status byte.
        ring.set_desc(7, STATUS, 1, W, 0);
        ring.publish(7);
        // A head index past the table: consumed, nothing to return.
        ring.publish(300);
        d.notify(0);
        assert_eq!(ring.used_idx(), 5);
        for (n, head) in [0u32, 2, 4, 6, 7].iter().enumerate() {
            assert_eq!(ring.used(n as u16), (*head, 0));
        }
        // The device still serves a good request afterwards.
        request(&mut ring, VIRTIO_BLK_T_IN, 1, 512, 8);
        d.notify(0);
        assert_eq!(ring.used(5), (8, 513));
        assert_eq!(status(&ring), VIRTIO_BLK_S_OK);
    }

    #[test]
    fn a_request_pending_at_snapshot_is_served_after_restore() {
        let img = image(8);
        let mut d = device(img.path(), false);
        let mem = d.transport_memory();
        let mut ring = Ring::new(&mem, 16);
        d.bring_up_queues(features(false), &[&ring]);
        request(&mut ring, VIRTIO_BLK_T_IN, 0, 512, 0);
        d.notify(0);
        // The guest makes a write available; the snapshot comes before the device sees it.
        ring.mem
            .write_slice(&[0x5a; 512], GuestAddress(DATA))
            .unwrap();
        request(&mut ring, VIRTIO_BLK_T_OUT, 6, 512, 4);
        let state = d.transport.save().unwrap();
        let bytes = postcard::to_allocvec(&state).unwrap();
        drop(d);
        let state: VirtioMmioState = postcard::from_bytes(&bytes).unwrap();

        let blk = Block::open(img.path(), BlockOptions::default()).unwrap();
        let line = Arc::new(RecordingLine::default());
        let mut restored =
            MmioTransport::restore(Box::new(blk), mem.clone(), line, &state).unwrap();
        restored.write(regs::QUEUE_NOTIFY, &0u32.to_le_bytes());
        assert_eq!(ring.used_idx(), 2);
        assert_eq!(ring.used(1), (4, 1));
        assert_eq!(
            &std::fs::read(img.path()).unwrap()[6 * 512..7 * 512],
            &[0x5a; 512]
        );

        // State from a disk of another size, or another read-only setting, is refused.
        std::fs::OpenOptions::new()
            .write(true)
            .open(img.path())
            .unwrap()
            .set_len(16 * 512)
            .unwrap();
        let bigger = Block::open(img.path(), BlockOptions::default()).unwrap();
        let err = MmioTransport::restore(
            Box::new(bigger),
            mem.clone(),
            Arc::new(RecordingLine::default()),
            &state,
        )
        .err()
        .unwrap();
        assert!(format!("{:?}", err).contains("sectors"), "{err:?}");
        let mut garbage = state.clone();
        garbage.device_state.bytes = vec![0xff; 3];
        let blk = Block::open(img.path(), BlockOptions::default()).unwrap();
        assert!(MmioTransport::restore(
            Box::new(blk),
            mem,
            Arc::new(RecordingLine::default()),
            &garbage
        )
        .is_err());
    }

    #[test]
    fn each_sandbox_writes_its_own_copy_of_the_template() {
        let dir = tempfile::tempdir().unwrap();
        let template = dir.path().join("template.img");
        std::fs::write(&template, vec![7u8; 4096]).unwrap();
        let copy = dir.path().join("sandbox.img");
        let blk = Block::from_template(&template, &copy, BlockOptions::default()).unwrap();
        assert_eq!(blk.capacity_sectors(), 8);
        let mut d = Driver::new(Box::new(blk), &memory());
        let mut ring = Ring::new(&d.transport_memory(), 16);
        d.bring_up_queues(features(false), &[&ring]);
        ring.mem
            .write_slice(&[1u8; 512], GuestAddress(DATA))
            .unwrap();
        request(&mut ring, VIRTIO_BLK_T_OUT, 0, 512, 0);
        d.notify(0);
        assert_eq!(status(&ring), VIRTIO_BLK_S_OK);
        assert_eq!(std::fs::read(&copy).unwrap()[0], 1);
        assert_eq!(std::fs::read(&template).unwrap(), vec![7u8; 4096]);
        // A second sandbox may not reuse the path.
        assert!(Block::from_template(&template, &copy, BlockOptions::default()).is_err());
    }
}
