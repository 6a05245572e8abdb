//! Checksummed metadata files, replaced atomically.
//!
//! Sandbox, snapshot and template state lives in small files that a crash, a full
//! disk or a stray editor can damage. Each one is wrapped in an envelope that names
//! what it holds and carries a CRC32, and is written to a temporary file that is
//! synced and renamed over the old one, so a reader sees the old version or the new
//! one, never half of either, and a damaged file is rejected rather than trusted.
//!
//! Envelope layout (integers little endian):
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `CUBEMETA` |
//! | 2 | format version (1) |
//! | 2 | kind length `k` |
//! | k | kind, e.g. `sandbox`, `snapshot` |
//! | 8 | payload length `n` |
//! | 4 | CRC32 (IEEE) of kind followed by payload |
//! | n | payload |

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::durability::Durability;
use crate::random_id::random_hex;
use crate::removal_guard::RemovalGuard;

/// First eight bytes of every metadata file.
pub const MAGIC: [u8; 8] = *b"CUBEMETA";

/// The envelope format version this build writes and reads.
pub const FORMAT_VERSION: u16 = 1;

/// Longest kind string accepted, in bytes.
pub const MAX_KIND_LEN: usize = 64;

/// Payload limit used by [`read_verified`]: metadata is small, so anything larger
/// is damage or an attack.
pub const DEFAULT_MAX_PAYLOAD_LEN: u64 = 16 << 20;

/// Magic, version and kind length.
const PREFIX_LEN: usize = 8 + 2 + 2;
/// Payload length and checksum, after the kind.
const SUFFIX_LEN: usize = 8 + 4;
/// The largest header the format can express (kind length is a u16).
const MAX_HEADER_LEN: usize = PREFIX_LEN + u16::MAX as usize + SUFFIX_LEN;

/// Errors from writing and reading metadata files.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    /// The kind string is empty, too long or not printable ASCII.
    #[error("Invalid metadata kind {kind:?}: must be 1 to 64 printable ASCII characters")]
    InvalidKind {
        /// The kind given.
        kind: String,
    },
    /// The path has no file name component.
    #[error("Invalid metadata path {path}: no file name")]
    InvalidPath {
        /// The path given.
        path: PathBuf,
    },
    /// The path exists but is not a regular file.
    #[error("Metadata path {path} is not a regular file")]
    NotRegularFile {
        /// The path given.
        path: PathBuf,
    },
    /// Opening or reading the file failed.
    #[error("Cannot read metadata file {path}")]
    Read {
        /// The file read.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Creating, writing or syncing the temporary file failed.
    #[error("Cannot write metadata temp file {path}")]
    Write {
        /// The temporary file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Renaming the temporary file over the destination failed.
    #[error("Cannot rename {from} to {to}")]
    Rename {
        /// The temporary file.
        from: PathBuf,
        /// The destination.
        to: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The new file is in place but its directory could not be synced, so the
    /// replacement may not survive a crash.
    #[error("Cannot sync directory {path}")]
    SyncDir {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The bytes do not start with [`MAGIC`]: not a metadata file.
    #[error("Not a Cube metadata file (bad magic)")]
    BadMagic,
    /// Written by a build with another envelope format.
    #[error("Unsupported metadata format version {found} (this build reads {supported})")]
    UnsupportedVersion {
        /// The version in the file.
        found: u16,
        /// The version this build reads.
        supported: u16,
    },
    /// Intact metadata of another kind, e.g. a snapshot read as a sandbox.
    #[error("Metadata is of kind {found:?}, expected {expected:?}")]
    WrongKind {
        /// The kind asked for.
        expected: String,
        /// The kind in the file (lossily decoded).
        found: String,
    },
    /// Fewer bytes than the header says.
    #[error("Metadata is truncated: its header says {expected} bytes, it has {actual}")]
    Truncated {
        /// Length the header implies (at least the header itself).
        expected: u64,
        /// Length actually present.
        actual: u64,
    },
    /// More bytes than the header says.
    #[error("Metadata has {actual} bytes where its header says {expected}")]
    TrailingBytes {
        /// Length the header implies.
        expected: u64,
        /// Length actually present.
        actual: u64,
    },
    /// The stored CRC32 does not match the kind and payload: the file is damaged.
    #[error("Metadata checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    ChecksumMismatch {
        /// The checksum in the header.
        stored: u32,
        /// The checksum of the bytes present.
        computed: u32,
    },
    /// The header declares a payload larger than the caller allows.
    #[error("Metadata payload of {len} bytes exceeds the limit of {max}")]
    PayloadTooLarge {
        /// The declared payload length.
        len: u64,
        /// The caller's limit.
        max: u64,
    },
    /// The payload passed its checksum but is not JSON of the expected type.
    #[error("Metadata payload is not valid JSON for the expected type")]
    InvalidJson {
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// The value could not be serialized to JSON.
    #[error("Cannot serialize metadata to JSON")]
    Serialize {
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
}

/// The parsed fixed part of an envelope.
struct Header<'a> {
    kind: &'a [u8],
    payload_len: u64,
    checksum: u32,
    /// Bytes from the start of the envelope to the start of the payload.
    len: usize,
}

/// Encodes `payload` in an envelope of kind `kind`.
pub fn encode_envelope(kind: &str, payload: &[u8]) -> Result<Vec<u8>, MetadataError> {
    let mut out = encode_header(kind, payload)?;
    out.extend_from_slice(payload);
    Ok(out)
}

/// Checks an envelope and returns its payload. Pure: no I/O, no allocation.
///
/// Checks, in order: magic, version, that the length matches the header exactly,
/// the checksum, then the kind (so a damaged kind reads as damage, not as a
/// different kind).
pub fn decode_envelope<'a>(bytes: &'a [u8], kind: &str) -> Result<&'a [u8], MetadataError> {
    validate_kind(kind)?;
    let header = parse_header(bytes)?;
    let actual = bytes.len() as u64;
    let expected = (header.len as u64).saturating_add(header.payload_len);
    if actual < expected {
        return Err(MetadataError::Truncated { expected, actual });
    }
    if actual > expected {
        return Err(MetadataError::TrailingBytes { expected, actual });
    }
    let payload = &bytes[header.len..];
    let computed = checksum(header.kind, payload);
    if computed != header.checksum {
        return Err(MetadataError::ChecksumMismatch {
            stored: header.checksum,
            computed,
        });
    }
    if header.kind != kind.as_bytes() {
        return Err(MetadataError::WrongKind {
            expected: kind.to_owned(),
            found: String::from_utf8_lossy(header.kind).into_owned(),
        });
    }
    Ok(payload)
}

/// Atomically replaces (or creates) `path` with `payload` in an envelope of kind
/// `kind`.
///
/// Writes a uniquely named temporary file in the same directory, syncs it, renames
/// it over `path` and syncs the directory. The file has mode 0600. On error the
/// temporary file is removed and `path` keeps its previous content, except after a
/// [`MetadataError::SyncDir`], where the new content is in place but possibly not
/// yet durable.
pub fn write_atomic_bytes(path: &Path, kind: &str, payload: &[u8]) -> Result<(), MetadataError> {
    write_atomic_bytes_with(path, kind, payload, Durability::Synced)
}

/// [`write_atomic_bytes`] with a choice of durability: with
/// [`Durability::Deferred`] neither the file nor the directory is synced (the rename
/// is still atomic for every reader on this host).
pub fn write_atomic_bytes_with(
    path: &Path,
    kind: &str,
    payload: &[u8],
    durability: Durability,
) -> Result<(), MetadataError> {
    let header = encode_header(kind, payload)?;
    if path.file_name().is_none() {
        return Err(MetadataError::InvalidPath {
            path: path.to_owned(),
        });
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tag = random_hex(8).map_err(|source| MetadataError::Write {
        path: dir.to_owned(),
        source,
    })?;
    let tmp_path = dir.join(format!(".cube-meta-{tag}.tmp"));
    let write_err = |source| MetadataError::Write {
        path: tmp_path.clone(),
        source,
    };

    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(&tmp_path)
        .map_err(write_err)?;
    let guard = RemovalGuard::file(&tmp_path);
    file.write_all(&header).map_err(write_err)?;
    file.write_all(payload).map_err(write_err)?;
    if durability == Durability::Synced {
        file.sync_all().map_err(write_err)?;
    }
    drop(file);

    fs::rename(&tmp_path, path).map_err(|source| MetadataError::Rename {
        from: tmp_path.clone(),
        to: path.to_owned(),
        source,
    })?;
    guard.disarm();
    if durability == Durability::Deferred {
        return Ok(());
    }
    sync_dir(dir).map_err(|source| MetadataError::SyncDir {
        path: dir.to_owned(),
        source,
    })
}

/// Reads `path`, checks its envelope against `kind` and returns the payload.
///
/// Payloads declared longer than `max_len` are refused before anything is
/// allocated for them, and the declared length must match the file's real size.
pub fn read_verified_bytes(
    path: &Path,
    kind: &str,
    max_len: u64,
) -> Result<Vec<u8>, MetadataError> {
    validate_kind(kind)?;
    // Non-blocking: a FIFO put where a record was (a snapshot's directory may be a VM
    // supervisor's uid's) must not hang whoever lists the store; it is refused below
    // as not a regular file.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|source| MetadataError::Read {
            path: path.to_owned(),
            source,
        })?;
    read_verified_from(file, path, kind, max_len)
}

/// [`read_verified_bytes`] of a file in a store's directory (`<area>/<id>/<name>`)
/// with neither it nor its directory a symbolic link ([`crate::no_follow::open_file`]):
/// a snapshot's state, whose directory a VM supervisor's uid owns.
pub fn read_verified_bytes_no_follow(
    path: &Path,
    kind: &str,
    max_len: u64,
) -> Result<Vec<u8>, MetadataError> {
    validate_kind(kind)?;
    let file = crate::no_follow::open_file(path).map_err(|source| MetadataError::Read {
        path: path.to_owned(),
        source,
    })?;
    read_verified_from(file, path, kind, max_len)
}

/// The checks and reads of [`read_verified_bytes`] on `file`, already open (named
/// `path` in errors), for an envelope of a kind already validated.
fn read_verified_from(
    mut file: File,
    path: &Path,
    kind: &str,
    max_len: u64,
) -> Result<Vec<u8>, MetadataError> {
    let read_err = |source| MetadataError::Read {
        path: path.to_owned(),
        source,
    };
    let meta = file.metadata().map_err(read_err)?;
    if !meta.file_type().is_file() {
        return Err(MetadataError::NotRegularFile {
            path: path.to_owned(),
        });
    }
    let file_len = meta.len();

    // The header alone is bounded by the format; read it to learn the payload length.
    let prefix_len = usize::try_from(file_len).map_or(MAX_HEADER_LEN, |n| n.min(MAX_HEADER_LEN));
    let mut buf = vec![0u8; prefix_len];
    file.read_exact(&mut buf).map_err(read_err)?;
    let header = parse_header(&buf)?;
    if header.payload_len > max_len {
        return Err(MetadataError::PayloadTooLarge {
            len: header.payload_len,
            max: max_len,
        });
    }
    let expected = (header.len as u64).saturating_add(header.payload_len);
    if file_len < expected {
        return Err(MetadataError::Truncated {
            expected,
            actual: file_len,
        });
    }
    if file_len > expected {
        return Err(MetadataError::TrailingBytes {
            expected,
            actual: file_len,
        });
    }

    // Now bounded by both the real size and header + max_len.
    let total = usize::try_from(expected).map_err(|_| MetadataError::PayloadTooLarge {
        len: header.payload_len,
        max: max_len,
    })?;
    buf.resize(total, 0);
    file.read_exact(&mut buf[prefix_len..]).map_err(read_err)?;
    let payload = decode_envelope(&buf, kind)?;
    Ok(payload.to_vec())
}

/// Serializes `value` as JSON and writes it with [`write_atomic_bytes`].
pub fn write_atomic<T: Serialize>(path: &Path, kind: &str, value: &T) -> Result<(), MetadataError> {
    let payload =
        serde_json::to_vec(value).map_err(|source| MetadataError::Serialize { source })?;
    write_atomic_bytes(path, kind, &payload)
}

/// Reads `path` with [`read_verified_bytes`] (limit [`DEFAULT_MAX_PAYLOAD_LEN`]) and
/// parses the payload as JSON.
pub fn read_verified<T: DeserializeOwned>(path: &Path, kind: &str) -> Result<T, MetadataError> {
    let payload = read_verified_bytes(path, kind, DEFAULT_MAX_PAYLOAD_LEN)?;
    serde_json::from_slice(&payload).map_err(|source| MetadataError::InvalidJson { source })
}

fn validate_kind(kind: &str) -> Result<(), MetadataError> {
    let valid =
        (1..=MAX_KIND_LEN).contains(&kind.len()) && kind.bytes().all(|b| b.is_ascii_graphic());
    if valid {
        Ok(())
    } else {
        Err(MetadataError::InvalidKind {
            kind: kind.to_owned(),
        })
    }
}

fn encode_header(kind: &str, payload: &[u8]) -> Result<Vec<u8>, MetadataError> {
    validate_kind(kind)?;
    // validate_kind bounds the length well below u16::MAX.
    let kind_len = kind.len() as u16;
    let mut out = Vec::with_capacity(PREFIX_LEN + kind.len() + SUFFIX_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&kind_len.to_le_bytes());
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&checksum(kind.as_bytes(), payload).to_le_bytes());
    Ok(out)
}

/// Parses the header at the start of `bytes`, which may hold more than the header.
fn parse_header(bytes: &[u8]) -> Result<Header<'_>, MetadataError> {
    let magic_present = &bytes[..bytes.len().min(MAGIC.len())];
    if magic_present != &MAGIC[..magic_present.len()] {
        return Err(MetadataError::BadMagic);
    }
    let truncated = |expected: usize| MetadataError::Truncated {
        expected: expected as u64,
        actual: bytes.len() as u64,
    };
    let (Some(version), Some(kind_len)) = (le_u16(bytes, 8), le_u16(bytes, 10)) else {
        return Err(truncated(PREFIX_LEN));
    };
    if version != FORMAT_VERSION {
        return Err(MetadataError::UnsupportedVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let kind_end = PREFIX_LEN + usize::from(kind_len);
    let len = kind_end + SUFFIX_LEN;
    let (Some(kind), Some(payload_len), Some(checksum)) = (
        bytes.get(PREFIX_LEN..kind_end),
        le_u64(bytes, kind_end),
        le_u32(bytes, kind_end + 8),
    ) else {
        return Err(truncated(len));
    };
    Ok(Header {
        kind,
        payload_len,
        checksum,
        len,
    })
}

fn le_u16(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(bytes.get(at..at + 2)?.try_into().ok()?))
}

fn le_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn le_u64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

fn checksum(kind: &[u8], payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(kind);
    hasher.update(payload);
    hasher.finalize()
}

/// Makes a rename in `dir` durable.
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct SandboxState {
        id: String,
        vcpus: u32,
        memory_mib: u64,
    }

    fn state() -> SandboxState {
        SandboxState {
            id: "sb-0123456789abcdef".into(),
            vcpus: 2,
            memory_mib: 512,
        }
    }

    fn write_sample(dir: &Path) -> PathBuf {
        let path = dir.join("sandbox.meta");
        write_atomic(&path, "sandbox", &state()).unwrap();
        path
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn json_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_sample(dir.path());
        let back: SandboxState = read_verified(&path, "sandbox").unwrap();
        assert_eq!(back, state());
        assert_eq!(
            entries(dir.path()),
            ["sandbox.meta"],
            "temp file left behind"
        );
    }

    #[test]
    fn bytes_round_trip_and_replace() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("blob");
        write_atomic_bytes(&path, "snapshot", b"first").unwrap();
        write_atomic_bytes(&path, "snapshot", b"").unwrap();
        assert_eq!(read_verified_bytes(&path, "snapshot", 100).unwrap(), b"");
        let big = vec![7u8; 100_000];
        write_atomic_bytes(&path, "snapshot", &big).unwrap();
        assert_eq!(
            read_verified_bytes(&path, "snapshot", 100_000).unwrap(),
            big
        );
        assert_eq!(entries(dir.path()), ["blob"]);
    }

    #[test]
    fn layout_is_as_documented() {
        let bytes = encode_envelope("sandbox", b"{}").unwrap();
        assert_eq!(&bytes[..8], b"CUBEMETA");
        assert_eq!(&bytes[8..10], &1u16.to_le_bytes());
        assert_eq!(&bytes[10..12], &7u16.to_le_bytes());
        assert_eq!(&bytes[12..19], b"sandbox");
        assert_eq!(&bytes[19..27], &2u64.to_le_bytes());
        assert_eq!(&bytes[27..31], &crc32fast::hash(b"sandbox{}").to_le_bytes());
        assert_eq!(&bytes[31..], b"{}");
        assert_eq!(decode_envelope(&bytes, "sandbox").unwrap(), b"{}");
    }

    #[test]
    fn truncated_file_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_sample(dir.path());
        let len = fs::metadata(&path).unwrap().len();
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len - 5)
            .unwrap();
        let err = read_verified::<SandboxState>(&path, "sandbox").unwrap_err();
        match err {
            MetadataError::Truncated { expected, actual } => {
                assert_eq!((expected, actual), (len, len - 5));
            }
            other => panic!("expected Truncated, got {other:?}"),
        }
    }

    #[test]
    fn every_prefix_of_an_envelope_is_rejected() {
        let bytes = encode_envelope("sandbox", b"payload").unwrap();
        for cut in 0..bytes.len() {
            let err = decode_envelope(&bytes[..cut], "sandbox").unwrap_err();
            assert!(
                matches!(err, MetadataError::Truncated { actual, .. } if actual == cut as u64),
                "prefix of {cut} bytes: {err:?}"
            );
        }
    }

    #[test]
    fn empty_and_header_only_files_are_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m");
        fs::write(&path, b"").unwrap();
        let err = read_verified_bytes(&path, "sandbox", 100).unwrap_err();
        assert!(
            matches!(
                err,
                MetadataError::Truncated {
                    expected: 12,
                    actual: 0
                }
            ),
            "{err:?}"
        );
        fs::write(&path, &encode_envelope("sandbox", b"abc").unwrap()[..20]).unwrap();
        let err = read_verified_bytes(&path, "sandbox", 100).unwrap_err();
        assert!(
            matches!(
                err,
                MetadataError::Truncated {
                    expected: 31,
                    actual: 20
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m");
        let mut bytes = encode_envelope("sandbox", b"abc").unwrap();
        bytes.push(0);
        fs::write(&path, &bytes).unwrap();
        let err = read_verified_bytes(&path, "sandbox", 100).unwrap_err();
        assert!(
            matches!(err, MetadataError::TrailingBytes { .. }),
            "{err:?}"
        );
    }

    #[test]
    fn flipped_payload_byte_fails_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_sample(dir.path());
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 3;
        bytes[last] ^= 0x01;
        fs::write(&path, &bytes).unwrap();
        let err = read_verified::<SandboxState>(&path, "sandbox").unwrap_err();
        assert!(
            matches!(err, MetadataError::ChecksumMismatch { .. }),
            "{err:?}"
        );
    }

    #[test]
    fn flipped_kind_byte_fails_checksum_not_kind() {
        let mut bytes = encode_envelope("sandbox", b"x").unwrap();
        bytes[12] = b'S';
        let err = decode_envelope(&bytes, "sandbox").unwrap_err();
        assert!(
            matches!(err, MetadataError::ChecksumMismatch { .. }),
            "{err:?}"
        );
    }

    #[test]
    fn wrong_kind_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_sample(dir.path());
        let err = read_verified::<SandboxState>(&path, "snapshot").unwrap_err();
        match err {
            MetadataError::WrongKind { expected, found } => {
                assert_eq!((expected.as_str(), found.as_str()), ("snapshot", "sandbox"));
            }
            other => panic!("expected WrongKind, got {other:?}"),
        }
    }

    #[test]
    fn bad_magic_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m");
        fs::write(&path, b"{\"id\": \"not an envelope\"}").unwrap();
        let err = read_verified::<SandboxState>(&path, "sandbox").unwrap_err();
        assert!(matches!(err, MetadataError::BadMagic), "{err:?}");
        assert!(matches!(
            decode_envelope(b"CUBX", "sandbox"),
            Err(MetadataError::BadMagic)
        ));
    }

    #[test]
    fn unsupported_version_is_rejected() {
        let mut bytes = encode_envelope("sandbox", b"x").unwrap();
        bytes[8..10].copy_from_slice(&2u16.to_le_bytes());
        let err = decode_envelope(&bytes, "sandbox").unwrap_err();
        assert!(
            matches!(
                err,
                MetadataError::UnsupportedVersion {
                    found: 2,
                    supported: 1
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn oversized_payload_is_rejected_before_allocation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m");
        write_atomic_bytes(&path, "sandbox", &[1u8; 1000]).unwrap();
        let err = read_verified_bytes(&path, "sandbox", 999).unwrap_err();
        assert!(
            matches!(
                err,
                MetadataError::PayloadTooLarge {
                    len: 1000,
                    max: 999
                }
            ),
            "{err:?}"
        );

        // A header claiming an absurd length on a tiny file: refused by the limit,
        // then (with no limit) by the real size; allocating it would abort the test.
        let mut bytes = encode_envelope("sandbox", b"").unwrap();
        bytes[19..27].copy_from_slice(&(u64::MAX - 1).to_le_bytes());
        fs::write(&path, &bytes).unwrap();
        let err = read_verified_bytes(&path, "sandbox", 1 << 20).unwrap_err();
        assert!(
            matches!(err, MetadataError::PayloadTooLarge { .. }),
            "{err:?}"
        );
        let err = read_verified_bytes(&path, "sandbox", u64::MAX).unwrap_err();
        assert!(matches!(err, MetadataError::Truncated { .. }), "{err:?}");
        let err = decode_envelope(&bytes, "sandbox").unwrap_err();
        assert!(matches!(err, MetadataError::Truncated { .. }), "{err:?}");
    }

    #[test]
    fn invalid_json_payload_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m");
        write_atomic_bytes(&path, "sandbox", b"{\"id\": 3}").unwrap();
        let err = read_verified::<SandboxState>(&path, "sandbox").unwrap_err();
        assert!(matches!(err, MetadataError::InvalidJson { .. }), "{err:?}");
    }

    #[test]
    fn invalid_kinds_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m");
        for kind in ["", "has space", "näme", &"k".repeat(MAX_KIND_LEN + 1)] {
            let err = write_atomic_bytes(&path, kind, b"x").unwrap_err();
            assert!(
                matches!(err, MetadataError::InvalidKind { .. }),
                "{kind:?}: {err:?}"
            );
        }
        assert!(!path.exists());
    }

    #[test]
    fn failed_rename_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        // A non-empty directory cannot be replaced by a file.
        let path = dir.path().join("occupied");
        fs::create_dir(&path).unwrap();
        fs::write(path.join("inner"), b"x").unwrap();
        let err = write_atomic_bytes(&path, "sandbox", b"x").unwrap_err();
        assert!(matches!(err, MetadataError::Rename { .. }), "{err:?}");
        assert_eq!(entries(dir.path()), ["occupied"]);
    }

    #[test]
    fn missing_directory_and_non_files_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_atomic_bytes(&dir.path().join("no/such/m"), "sandbox", b"x").unwrap_err();
        assert!(matches!(err, MetadataError::Write { .. }), "{err:?}");
        let err = read_verified_bytes(&dir.path().join("none"), "sandbox", 10).unwrap_err();
        assert!(matches!(err, MetadataError::Read { .. }), "{err:?}");
        let err = read_verified_bytes(dir.path(), "sandbox", 10).unwrap_err();
        assert!(
            matches!(err, MetadataError::NotRegularFile { .. }),
            "{err:?}"
        );
        let err = write_atomic_bytes(Path::new("/"), "sandbox", b"x").unwrap_err();
        assert!(matches!(err, MetadataError::InvalidPath { .. }), "{err:?}");
    }

    #[test]
    fn a_fifo_in_a_records_place_is_refused_without_waiting_for_a_writer() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("snapshot.meta");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(read_verified_bytes(&fifo, "snapshot", 100).map(|_| ()));
        });
        let read = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("reading a FIFO record waited for a writer");
        assert!(
            matches!(read, Err(MetadataError::NotRegularFile { .. })),
            "{read:?}"
        );
    }
}
