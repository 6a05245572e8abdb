//! Each virtio device's own snapshot state: a typed state struct per device, saved
//! in an envelope that names the device kind and the state's version.
//!
//! In the manner of Firecracker's per-device `persist.rs`: a device implements
//! [`Persist`] with its own `State` type and checks a saved state field by field
//! against itself before taking it. The envelope ([`SavedDeviceState`]) lets a
//! snapshot reader refuse a state of another kind or of a version this build does not
//! know before anything is decoded, and each device's state can change layout (its
//! [`Persist::VERSION`] bumped) without touching the other devices'.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Which virtio device a saved state belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceKind {
    /// virtio-blk.
    Block,
    /// virtio-vsock.
    Vsock,
    /// virtio-net.
    Net,
    /// virtio-rng.
    Rng,
}

impl DeviceKind {
    /// The device's usual name (virtio-blk, ...).
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Block => "virtio-blk",
            DeviceKind::Vsock => "virtio-vsock",
            DeviceKind::Net => "virtio-net",
            DeviceKind::Rng => "virtio-rng",
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a device's state could not be saved or restored.
#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    /// The state belongs to another kind of device.
    #[error("Device state is for a {state} device, the device is a {device}")]
    WrongKind {
        /// Kind named in the state.
        state: DeviceKind,
        /// Kind of the device.
        device: DeviceKind,
    },
    /// The state was written in a layout this build does not read.
    #[error("{kind} state version {found} is not supported (this build reads {supported})")]
    Version {
        /// The device kind.
        kind: DeviceKind,
        /// Version in the state.
        found: u16,
        /// The version this build reads and writes.
        supported: u16,
    },
    /// The state could not be encoded.
    #[error("Encoding the {kind} state failed")]
    Encode {
        /// The device kind.
        kind: DeviceKind,
        /// The encoder's error.
        #[source]
        source: postcard::Error,
    },
    /// The state does not decode (truncated, corrupt or crafted).
    #[error("{kind} state does not decode")]
    Decode {
        /// The device kind.
        kind: DeviceKind,
        /// The decoder's error.
        #[source]
        source: postcard::Error,
    },
    /// Bytes follow the encoded state.
    #[error("{kind} state has {count} trailing bytes")]
    TrailingBytes {
        /// The device kind.
        kind: DeviceKind,
        /// How many bytes follow the state.
        count: usize,
    },
    /// The state describes a different device than the one it is restored into.
    #[error("{kind} {what} was {saved} when saved, the device has {device}")]
    Mismatch {
        /// The device kind.
        kind: DeviceKind,
        /// The setting that differs.
        what: &'static str,
        /// Its value in the state.
        saved: String,
        /// Its value on the device.
        device: String,
    },
}

impl DeviceStateError {
    /// A [`DeviceStateError::Mismatch`] of setting `what`.
    pub fn mismatch(
        kind: DeviceKind,
        what: &'static str,
        saved: impl std::fmt::Display,
        device: impl std::fmt::Display,
    ) -> Self {
        DeviceStateError::Mismatch {
            kind,
            what,
            saved: saved.to_string(),
            device: device.to_string(),
        }
    }
}

/// A device whose state goes into snapshots.
pub trait Persist {
    /// Everything of the device a restore needs (beyond the transport's registers and
    /// queues, which [`super::persist::VirtioMmioState`] holds).
    type State: Serialize + DeserializeOwned;

    /// Which device this is; a state of another kind is refused.
    const KIND: DeviceKind;

    /// Layout version of [`Persist::State`]: bumped whenever the state's fields
    /// change, so a state written by another build is refused instead of misread.
    const VERSION: u16;

    /// The device's state now.
    fn save(&self) -> Result<Self::State, DeviceStateError>;

    /// Takes back a state [`Persist::save`] produced, before activation; checks it
    /// against the device first and changes nothing when it is refused.
    fn restore(&mut self, state: Self::State) -> Result<(), DeviceStateError>;
}

/// A device's state as a snapshot stores it: kind and version, then the encoded
/// [`Persist::State`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedDeviceState {
    /// The device the state belongs to.
    pub kind: DeviceKind,
    /// [`Persist::VERSION`] of the device that wrote it.
    pub version: u16,
    /// The encoded state.
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
}

impl SavedDeviceState {
    /// Checks kind and version against a device of kind `kind` that reads `version`,
    /// without decoding the state.
    pub fn check_header(&self, kind: DeviceKind, version: u16) -> Result<(), DeviceStateError> {
        if self.kind != kind {
            return Err(DeviceStateError::WrongKind {
                state: self.kind,
                device: kind,
            });
        }
        if self.version != version {
            return Err(DeviceStateError::Version {
                kind,
                found: self.version,
                supported: version,
            });
        }
        Ok(())
    }
}

/// The object-safe face of [`Persist`], which the transport calls through
/// `dyn VirtioDevice`; every [`Persist`] device has it.
pub trait PersistDevice {
    /// The device's state, encoded in its envelope.
    fn save_state(&self) -> Result<SavedDeviceState, DeviceStateError>;

    /// Checks kind and version, decodes and restores a state
    /// [`PersistDevice::save_state`] produced.
    fn restore_state(&mut self, saved: &SavedDeviceState) -> Result<(), DeviceStateError>;
}

impl<D: Persist> PersistDevice for D {
    fn save_state(&self) -> Result<SavedDeviceState, DeviceStateError> {
        let state = self.save()?;
        let bytes = postcard::to_allocvec(&state).map_err(|source| DeviceStateError::Encode {
            kind: D::KIND,
            source,
        })?;
        Ok(SavedDeviceState {
            kind: D::KIND,
            version: D::VERSION,
            bytes,
        })
    }

    fn restore_state(&mut self, saved: &SavedDeviceState) -> Result<(), DeviceStateError> {
        saved.check_header(D::KIND, D::VERSION)?;
        let (state, rest) =
            postcard::take_from_bytes::<D::State>(&saved.bytes).map_err(|source| {
                DeviceStateError::Decode {
                    kind: D::KIND,
                    source,
                }
            })?;
        if !rest.is_empty() {
            return Err(DeviceStateError::TrailingBytes {
                kind: D::KIND,
                count: rest.len(),
            });
        }
        self.restore(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::block::{Block, BlockOptions};
    use crate::virtio::rng::Rng;
    use std::io::Write;

    fn block(sectors: u64) -> (Block, tempfile::NamedTempFile) {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(&vec![0; sectors as usize * 512]).unwrap();
        let device = Block::open(file.path(), BlockOptions::default()).unwrap();
        (device, file)
    }

    #[test]
    fn a_state_round_trips() {
        let (saved_from, _file) = block(8);
        let saved = saved_from.save_state().unwrap();
        assert_eq!(saved.kind, DeviceKind::Block);
        assert_eq!(saved.version, <Block as Persist>::VERSION);
        let (mut fresh, _other) = block(8);
        fresh.restore_state(&saved).unwrap();
        assert_eq!(fresh.save_state().unwrap(), saved);
        // Through the snapshot encoding too.
        let bytes = postcard::to_allocvec(&saved).unwrap();
        let back: SavedDeviceState = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, saved);
    }

    #[test]
    fn a_state_of_another_kind_is_refused() {
        let (device, _file) = block(8);
        let saved = device.save_state().unwrap();
        let mut rng = Rng::new();
        assert!(matches!(
            rng.restore_state(&saved),
            Err(DeviceStateError::WrongKind {
                state: DeviceKind::Block,
                device: DeviceKind::Rng
            })
        ));
    }

    #[test]
    fn an_unknown_version_is_refused() {
        let (device, _file) = block(8);
        let mut saved = device.save_state().unwrap();
        saved.version += 1;
        let (mut fresh, _other) = block(8);
        let err = fresh.restore_state(&saved).unwrap_err();
        assert!(
            matches!(err, DeviceStateError::Version { found, .. } if found == saved.version),
            "{err}"
        );
        assert!(err.to_string().contains("not supported"), "{err}");
    }

    #[test]
    fn truncated_or_padded_states_are_refused() {
        let (device, _file) = block(8);
        let saved = device.save_state().unwrap();
        let (mut fresh, _other) = block(8);
        for len in 0..saved.bytes.len() {
            let mut cut = saved.clone();
            cut.bytes.truncate(len);
            assert!(
                matches!(
                    fresh.restore_state(&cut),
                    Err(DeviceStateError::Decode { .. })
                ),
                "{len} bytes accepted"
            );
        }
        let mut padded = saved.clone();
        padded.bytes.push(0);
        assert!(matches!(
            fresh.restore_state(&padded),
            Err(DeviceStateError::TrailingBytes { count: 1, .. })
        ));
    }

    #[test]
    fn a_state_of_another_device_of_the_kind_is_refused() {
        let (device, _file) = block(8);
        let saved = device.save_state().unwrap();
        let (mut bigger, _other) = block(16);
        assert!(matches!(
            bigger.restore_state(&saved),
            Err(DeviceStateError::Mismatch {
                what: "capacity in sectors",
                ..
            })
        ));
    }
}
