//! The page through which the host drives the synthetic test guest.
//!
//! Every field is a little-endian `u64` at a fixed offset. The host writes through
//! vm-memory (so its writes land in the dirty bitmap like any device write) with atomic
//! stores; the guest polls the fields in its main loop, so no VM exit is needed to hand
//! it work, only to wake it when it idles.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest physical address of the mailbox page.
pub const MAILBOX_ADDR: u64 = 0x10000;
/// Value of the magic field once the guest program is loaded.
pub const MAILBOX_MAGIC: u64 = u64::from_le_bytes(*b"CUBEGST1");

/// Byte offsets of the mailbox fields.
pub mod field {
    /// Constant [`super::MAILBOX_MAGIC`].
    pub const MAGIC: u64 = 0;
    /// Counter the guest increments while spinning; mirrored in register r15.
    pub const COUNTER: u64 = 8;
    /// Generation the host sets before every start or restore.
    pub const HOST_GENERATION: u64 = 16;
    /// Generation the guest has seen: it is running.
    pub const ACK_GENERATION: u64 = 24;
    /// Generation whose working-set pass the guest has finished.
    pub const WORKING_SET_GENERATION: u64 = 32;
    /// Sequence number of the host's latest command.
    pub const COMMAND_SEQ: u64 = 40;
    /// Operation of the latest command.
    pub const COMMAND_OP: u64 = 48;
    /// Argument of the latest command.
    pub const COMMAND_ARG: u64 = 56;
    /// Pattern seed of the latest dirty command.
    pub const COMMAND_PATTERN: u64 = 64;
    /// Sequence number of the last command the guest completed.
    pub const DONE_SEQ: u64 = 72;
    /// Current mode: [`super::Mode`].
    pub const MODE: u64 = 80;
    /// Non-zero once the guest saw its counter and r15 disagree.
    pub const ERROR: u64 = 88;
    /// Counter value in memory at the mismatch.
    pub const ERROR_MEMORY: u64 = 96;
    /// Register r15 at the mismatch.
    pub const ERROR_REGISTER: u64 = 104;
    /// Pages of the read working set.
    pub const WORKING_SET_READ_PAGES: u64 = 112;
    /// Pages of the write working set.
    pub const WORKING_SET_WRITE_PAGES: u64 = 120;
}

/// Operations the guest understands.
pub mod op {
    /// Write one word into each of `arg` pages starting at the dirty area.
    pub const DIRTY: u64 = 1;
    /// Switch to the mode in `arg`.
    pub const SET_MODE: u64 = 2;
}

/// Guest physical start of the read working set (16 MiB).
pub const WORKING_SET_READ_ADDR: u64 = 16 << 20;
/// Guest physical start of the write working set (32 MiB).
pub const WORKING_SET_WRITE_ADDR: u64 = 32 << 20;
/// Largest working set either pass may touch (the areas must not overlap).
pub use crate::persist::state::WORKING_SET_MAX_BYTES;
/// Guest physical start of the area `dirty` commands write into (64 MiB).
pub const DIRTY_AREA_ADDR: u64 = 64 << 20;

/// What the guest does between commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Mode {
    /// Wait in the VMM (an MMIO exit) until the host rings the doorbell: costs no CPU.
    Idle = 0,
    /// Increment the counter as fast as it can, checking it against r15 each time.
    Spin = 1,
}

/// Why talking to the guest failed.
#[derive(Debug, thiserror::Error)]
pub enum MailboxError {
    /// The mailbox page is not in guest memory.
    #[error("Mailbox access failed")]
    Memory(#[source] vm_memory::GuestMemoryError),
    /// The guest did not answer in time.
    #[error("Test guest did not {what} within {waited:?}")]
    Timeout {
        /// What the host waited for.
        what: &'static str,
        /// How long it waited.
        waited: Duration,
    },
    /// The guest found its own state inconsistent.
    #[error("Test guest saw counter {memory} in memory but {register} in r15")]
    Inconsistent {
        /// Counter in memory.
        memory: u64,
        /// Counter in the register.
        register: u64,
    },
    /// A request the guest cannot carry out.
    #[error("Cannot dirty {requested_mib} MiB: the dirty area holds {available_mib} MiB")]
    DirtyTooLarge {
        /// Requested size.
        requested_mib: u64,
        /// Size of the dirty area of this guest.
        available_mib: u64,
    },
}

/// Host-side view of the mailbox.
pub struct Mailbox<'a> {
    memory: &'a GuestMemoryMmap<AtomicBitmap>,
}

impl<'a> Mailbox<'a> {
    /// A view of the mailbox in `memory`.
    pub fn new(memory: &'a GuestMemoryMmap<AtomicBitmap>) -> Self {
        Mailbox { memory }
    }

    /// Reads one field.
    pub fn read(&self, offset: u64) -> Result<u64, MailboxError> {
        self.memory
            .load(GuestAddress(MAILBOX_ADDR + offset), Ordering::Acquire)
            .map_err(MailboxError::Memory)
    }

    /// Writes one field (tracked in the VMM's dirty bitmap).
    pub fn write(&self, offset: u64, value: u64) -> Result<(), MailboxError> {
        self.memory
            .store(
                value,
                GuestAddress(MAILBOX_ADDR + offset),
                Ordering::Release,
            )
            .map_err(MailboxError::Memory)
    }

    /// The guest's counter.
    pub fn counter(&self) -> Result<u64, MailboxError> {
        self.read(field::COUNTER)
    }

    /// Fails if the guest reported an inconsistency between memory and registers.
    pub fn check_consistent(&self) -> Result<(), MailboxError> {
        if self.read(field::ERROR)? != 0 {
            return Err(MailboxError::Inconsistent {
                memory: self.read(field::ERROR_MEMORY)?,
                register: self.read(field::ERROR_REGISTER)?,
            });
        }
        Ok(())
    }

    /// Announces a new start or restore; returns the generation to wait for.
    pub fn bump_generation(&self) -> Result<u64, MailboxError> {
        let next = self.read(field::HOST_GENERATION)?.wrapping_add(1);
        self.write(field::HOST_GENERATION, next)?;
        Ok(next)
    }

    /// Queues a command; the caller rings the doorbell. Returns its sequence number.
    pub fn post(&self, operation: u64, arg: u64, pattern: u64) -> Result<u64, MailboxError> {
        let seq = self.read(field::COMMAND_SEQ)?.wrapping_add(1);
        self.write(field::COMMAND_OP, operation)?;
        self.write(field::COMMAND_ARG, arg)?;
        self.write(field::COMMAND_PATTERN, pattern)?;
        // The sequence number goes last: the guest acts once it changes.
        self.write(field::COMMAND_SEQ, seq)?;
        Ok(seq)
    }

    /// Waits until `field` reaches at least `value`.
    pub fn wait_for(
        &self,
        offset: u64,
        value: u64,
        what: &'static str,
        timeout: Duration,
    ) -> Result<(), MailboxError> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if self.read(offset)? >= value {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited > timeout {
                return Err(MailboxError::Timeout { what, waited });
            }
            // Spin briefly (the guest answers in microseconds), then stop hogging a core.
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}
