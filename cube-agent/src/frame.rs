//! Length-delimited frames: a `u32` little-endian length, then that many bytes of a
//! postcard-encoded message.
//!
//! The length is checked against [`MAX_FRAME_LEN`] before anything is allocated, so a
//! peer cannot make the reader reserve gigabytes; an oversized frame is skipped byte by
//! byte so the stream stays in step and the next frame can still be read.

use std::io::{self, Read, Write};

use serde::Serialize;

/// The largest frame body either side accepts, in bytes.
pub const MAX_FRAME_LEN: u32 = 4 * 1024 * 1024;

/// How many leading bytes of an oversized frame are read to recover its request id
/// (a postcard varint `u64` takes at most 10 bytes).
const ID_PREFIX_LEN: u64 = 10;

/// Errors of reading or writing frames.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The underlying stream failed.
    #[error("frame stream i/o failed")]
    Io(#[source] io::Error),
    /// The stream ended part way through a frame.
    #[error("stream ended inside a frame")]
    Truncated,
    /// A frame announced a body larger than [`MAX_FRAME_LEN`]; its bytes were skipped.
    #[error("frame of {len} bytes exceeds the {MAX_FRAME_LEN}-byte limit")]
    Oversized {
        /// The length the frame announced.
        len: u32,
        /// The request id read from the start of the body, when it could be read.
        id: Option<u64>,
    },
    /// A message could not be encoded.
    #[error("message could not be encoded")]
    Encode(#[source] postcard::Error),
    /// An encoded message is larger than [`MAX_FRAME_LEN`].
    #[error("encoded message of {0} bytes exceeds the frame limit")]
    TooLargeToSend(usize),
}

/// Reads one frame body into `buf` (replacing its contents).
///
/// Returns `Ok(false)` when the stream ended cleanly before a new frame began.
pub fn read_frame<R: Read>(reader: &mut R, buf: &mut Vec<u8>) -> Result<bool, FrameError> {
    let mut len_bytes = [0u8; 4];
    let mut got = 0;
    while got < len_bytes.len() {
        match reader.read(&mut len_bytes[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(FrameError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let len = u32::from_le_bytes(len_bytes);
    if len > MAX_FRAME_LEN {
        return Err(skip_oversized(reader, len));
    }
    buf.clear();
    let read = reader
        .take(u64::from(len))
        .read_to_end(buf)
        .map_err(FrameError::Io)?;
    if read != len as usize {
        return Err(FrameError::Truncated);
    }
    Ok(true)
}

/// Consumes the body of an oversized frame, keeping only enough of it to learn the id.
fn skip_oversized<R: Read>(reader: &mut R, len: u32) -> FrameError {
    let mut prefix = Vec::with_capacity(ID_PREFIX_LEN as usize);
    match reader.take(ID_PREFIX_LEN).read_to_end(&mut prefix) {
        Ok(n) if n as u64 == ID_PREFIX_LEN => {}
        Ok(_) => return FrameError::Truncated,
        Err(e) => return FrameError::Io(e),
    }
    let id = postcard::take_from_bytes::<u64>(&prefix)
        .ok()
        .map(|(id, _)| id);
    let rest = u64::from(len) - ID_PREFIX_LEN;
    match io::copy(&mut reader.take(rest), &mut io::sink()) {
        Ok(n) if n == rest => FrameError::Oversized { len, id },
        Ok(_) => FrameError::Truncated,
        Err(e) => FrameError::Io(e),
    }
}

/// Encodes `msg` into a complete frame (length prefix included).
pub fn encode_frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let mut out = postcard::to_extend(msg, vec![0u8; 4]).map_err(FrameError::Encode)?;
    let body_len = out.len() - 4;
    let len = u32::try_from(body_len)
        .ok()
        .filter(|l| *l <= MAX_FRAME_LEN)
        .ok_or(FrameError::TooLargeToSend(body_len))?;
    out[..4].copy_from_slice(&len.to_le_bytes());
    Ok(out)
}

/// Writes a raw body as one frame; the body must not exceed [`MAX_FRAME_LEN`].
pub fn write_raw_frame<W: Write>(writer: &mut W, body: &[u8]) -> Result<(), FrameError> {
    let len = u32::try_from(body.len())
        .ok()
        .filter(|l| *l <= MAX_FRAME_LEN)
        .ok_or(FrameError::TooLargeToSend(body.len()))?;
    let mut out = Vec::with_capacity(body.len() + 4);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(body);
    writer.write_all(&out).map_err(FrameError::Io)?;
    writer.flush().map_err(FrameError::Io)
}

/// Encodes `msg` and writes it as one frame.
pub fn write_frame<W: Write, T: Serialize>(writer: &mut W, msg: &T) -> Result<(), FrameError> {
    let frame = encode_frame(msg)?;
    writer.write_all(&frame).map_err(FrameError::Io)?;
    writer.flush().map_err(FrameError::Io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    #[test]
    fn round_trips_frames_back_to_back() {
        let mut stream = Vec::new();
        write_frame(&mut stream, &(7u64, "hello".to_string())).unwrap();
        write_raw_frame(&mut stream, b"").unwrap();
        let mut r = Cursor::new(stream);
        let mut buf = Vec::new();
        assert!(read_frame(&mut r, &mut buf).unwrap());
        let (id, s): (u64, String) = postcard::from_bytes(&buf).unwrap();
        assert_eq!((id, s.as_str()), (7, "hello"));
        assert!(read_frame(&mut r, &mut buf).unwrap());
        assert!(buf.is_empty());
        assert!(!read_frame(&mut r, &mut buf).unwrap());
    }

    #[test]
    fn oversized_frame_is_skipped_and_its_id_recovered() {
        let len = MAX_FRAME_LEN + 1;
        let mut stream = len.to_le_bytes().to_vec();
        let mut body = postcard::to_allocvec(&300u64).unwrap();
        body.resize(len as usize, 0xAB);
        stream.extend_from_slice(&body);
        write_raw_frame(&mut stream, b"next").unwrap();
        let mut r = Cursor::new(stream);
        let mut buf = Vec::new();
        match read_frame(&mut r, &mut buf) {
            Err(FrameError::Oversized { len: l, id }) => {
                assert_eq!(l, len);
                assert_eq!(id, Some(300));
            }
            other => panic!("expected oversized, got {other:?}"),
        }
        assert!(read_frame(&mut r, &mut buf).unwrap());
        assert_eq!(buf, b"next");
    }

    #[test]
    fn truncated_frames_are_reported() {
        let mut buf = Vec::new();
        let mut r = Cursor::new(vec![5u8, 0]);
        assert!(matches!(
            read_frame(&mut r, &mut buf),
            Err(FrameError::Truncated)
        ));
        let mut r = Cursor::new(vec![5u8, 0, 0, 0, 1, 2]);
        assert!(matches!(
            read_frame(&mut r, &mut buf),
            Err(FrameError::Truncated)
        ));
    }

    #[test]
    fn refuses_to_send_oversized_messages() {
        let big = vec![0u8; MAX_FRAME_LEN as usize + 1];
        assert!(matches!(
            write_raw_frame(&mut Vec::new(), &big),
            Err(FrameError::TooLargeToSend(_))
        ));
    }
}
