//! The Connect protocol (connectrpc.com/docs/protocol) as envd's clients speak it:
//! unary calls (`application/json`, `application/proto`) and server-streaming calls
//! (`application/connect+json`, `application/connect+proto`: 5-byte envelopes, an
//! end-of-stream message carrying the error, if any), identity or gzip bodies, the
//! `connect-timeout-ms` deadline and errors as `{code, message}`.

use std::io::Read as _;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use futures_util::Stream;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Envelope flag: the payload is compressed with the stream's encoding.
const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: this is the end-of-stream message.
const FLAG_END_STREAM: u8 = 0x02;

/// The largest request message accepted (envd's requests are small; file contents go
/// over `/files`).
pub const MAX_MESSAGE: usize = 4 << 20;

/// Connect's error codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// The caller went away.
    Canceled,
    /// Anything else.
    Unknown,
    /// A bad argument.
    InvalidArgument,
    /// The deadline passed.
    DeadlineExceeded,
    /// No such thing.
    NotFound,
    /// It exists already.
    AlreadyExists,
    /// Not allowed.
    PermissionDenied,
    /// A limit was hit.
    ResourceExhausted,
    /// The state does not allow it.
    FailedPrecondition,
    /// Not implemented here.
    Unimplemented,
    /// The server failed.
    Internal,
    /// Unreachable for now.
    Unavailable,
    /// No or wrong credentials.
    Unauthenticated,
}

impl Code {
    /// The code's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code.
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// A failed call: its code and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RpcError {
    /// The code.
    pub code: Code,
    /// What went wrong, for people.
    pub message: String,
}

impl RpcError {
    /// An error with this code and message.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.as_str(), "message": self.message })
    }
}

/// The message codec a call uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// Protobuf's JSON mapping.
    Json,
    /// Binary protobuf.
    Proto,
}

/// A call's framing, read off its headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallShape {
    /// The codec.
    pub codec: Codec,
    /// Whether the body is enveloped (streaming content types).
    pub streaming: bool,
    /// Whether bodies (or envelopes) are gzip-compressed.
    pub gzip: bool,
    /// The client's deadline (`connect-timeout-ms`).
    pub timeout: Option<Duration>,
}

/// Reads the call's framing from its headers.
pub fn call_shape(headers: &HeaderMap) -> Result<CallShape, RpcError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json");
    let mime = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let (codec, streaming) = match mime.as_str() {
        "application/json" => (Codec::Json, false),
        "application/proto" | "application/protobuf" => (Codec::Proto, false),
        "application/connect+json" => (Codec::Json, true),
        "application/connect+proto" => (Codec::Proto, true),
        other => {
            return Err(RpcError::new(
                Code::Unimplemented,
                format!("Content type {other:?} is not a Connect codec this server speaks"),
            ))
        }
    };
    let encoding_header = if streaming {
        "connect-content-encoding"
    } else {
        "content-encoding"
    };
    let gzip = match headers
        .get(encoding_header)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
    {
        None | Some("") | Some("identity") => false,
        Some("gzip") => true,
        Some(other) => {
            return Err(RpcError::new(
                Code::Unimplemented,
                format!("Compression {other:?} is not supported (identity, gzip)"),
            ))
        }
    };
    let timeout = headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis);
    Ok(CallShape {
        codec,
        streaming,
        gzip,
        timeout,
    })
}

fn gunzip(data: &[u8]) -> Result<Vec<u8>, RpcError> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data)
        .take(MAX_MESSAGE as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("Bad gzip body: {e}")))?;
    if out.len() > MAX_MESSAGE {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("Message larger than {MAX_MESSAGE} bytes"),
        ));
    }
    Ok(out)
}

/// Splits an enveloped body into its messages (for a client stream, several; a
/// server-streaming request has one). An end-of-stream envelope ends the list.
pub fn unenvelope(shape: &CallShape, mut body: &[u8]) -> Result<Vec<Vec<u8>>, RpcError> {
    let mut messages = Vec::new();
    while !body.is_empty() {
        if body.len() < 5 {
            return Err(RpcError::new(
                Code::InvalidArgument,
                "Truncated envelope: fewer than 5 header bytes",
            ));
        }
        let flags = body[0];
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        if len > MAX_MESSAGE {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("Envelope of {len} bytes is larger than {MAX_MESSAGE}"),
            ));
        }
        if body.len() < 5 + len {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!(
                    "Truncated envelope: {len} bytes announced, {} sent",
                    body.len() - 5
                ),
            ));
        }
        let data = &body[5..5 + len];
        body = &body[5 + len..];
        if flags & FLAG_END_STREAM != 0 {
            break;
        }
        if flags & !(FLAG_COMPRESSED | FLAG_END_STREAM) != 0 {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!("Unknown envelope flags {flags:#04x}"),
            ));
        }
        if flags & FLAG_COMPRESSED != 0 {
            if !shape.gzip {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    "Compressed envelope on a stream without an encoding",
                ));
            }
            messages.push(gunzip(data)?);
        } else {
            messages.push(data.to_vec());
        }
    }
    Ok(messages)
}

/// The one request message of a unary or server-streaming call.
pub fn request_message(shape: &CallShape, body: &[u8]) -> Result<Vec<u8>, RpcError> {
    if body.len() > MAX_MESSAGE + 5 {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("Request larger than {MAX_MESSAGE} bytes"),
        ));
    }
    if !shape.streaming {
        return if shape.gzip {
            gunzip(body)
        } else {
            Ok(body.to_vec())
        };
    }
    let mut messages = unenvelope(shape, body)?;
    match messages.len() {
        1 => Ok(messages.remove(0)),
        0 => Err(RpcError::new(
            Code::InvalidArgument,
            "Streaming request without a message",
        )),
        n => Err(RpcError::new(
            Code::InvalidArgument,
            format!("Server-streaming request with {n} messages (1 expected)"),
        )),
    }
}

/// Decodes a message with the call's codec (an empty JSON body is the empty message).
pub fn decode<M>(codec: Codec, data: &[u8]) -> Result<M, RpcError>
where
    M: prost::Message + Default + DeserializeOwned,
{
    match codec {
        Codec::Proto => M::decode(data)
            .map_err(|e| RpcError::new(Code::InvalidArgument, format!("Bad protobuf: {e}"))),
        Codec::Json if data.iter().all(u8::is_ascii_whitespace) => Ok(M::default()),
        Codec::Json => serde_json::from_slice(data)
            .map_err(|e| RpcError::new(Code::InvalidArgument, format!("Bad JSON message: {e}"))),
    }
}

/// Encodes a message with the call's codec.
pub fn encode<M: prost::Message + Serialize>(codec: Codec, message: &M) -> Vec<u8> {
    match codec {
        Codec::Proto => message.encode_to_vec(),
        // Serialising these plain structs to a Vec cannot fail.
        Codec::Json => serde_json::to_vec(message).unwrap_or_else(|_| b"{}".to_vec()),
    }
}

fn content_type(codec: Codec, streaming: bool) -> HeaderValue {
    HeaderValue::from_static(match (codec, streaming) {
        (Codec::Json, false) => "application/json",
        (Codec::Proto, false) => "application/proto",
        (Codec::Json, true) => "application/connect+json",
        (Codec::Proto, true) => "application/connect+proto",
    })
}

/// A unary call's error response: JSON `{code, message}` with the code's status.
pub fn unary_error(err: &RpcError) -> Response {
    let mut resp = (err.code.http_status(), err.json().to_string()).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// A unary call's response.
pub fn unary_response<M: prost::Message + Serialize>(
    codec: Codec,
    result: Result<M, RpcError>,
) -> Response {
    match result {
        Ok(message) => {
            let mut resp = (StatusCode::OK, encode(codec, &message)).into_response();
            resp.headers_mut()
                .insert(header::CONTENT_TYPE, content_type(codec, false));
            resp
        }
        Err(e) => unary_error(&e),
    }
}

/// One envelope.
pub fn envelope(flags: u8, data: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + data.len());
    b.put_u8(flags);
    b.put_u32(data.len() as u32);
    b.put_slice(data);
    b.freeze()
}

/// The end-of-stream envelope: `{}` or `{"error": {...}}`.
pub fn end_of_stream(error: Option<&RpcError>) -> Bytes {
    let body = match error {
        Some(e) => serde_json::json!({ "error": e.json() }),
        None => serde_json::json!({}),
    };
    envelope(FLAG_END_STREAM, body.to_string().as_bytes())
}

/// A streaming call's response: every item becomes an envelope; the stream's first
/// error (or its end) becomes the end-of-stream message.
pub fn stream_response<M, S>(codec: Codec, items: S) -> Response
where
    M: prost::Message + Serialize + Send + 'static,
    S: Stream<Item = Result<M, RpcError>> + Send + 'static,
{
    use futures_util::StreamExt as _;
    let body = futures_util::stream::unfold(
        (Box::pin(items), false),
        move |(mut items, done)| async move {
            if done {
                return None;
            }
            let chunk = match items.next().await {
                Some(Ok(message)) => (envelope(0, &encode(codec, &message)), false),
                Some(Err(e)) => (end_of_stream(Some(&e)), true),
                None => (end_of_stream(None), true),
            };
            Some((
                Ok::<Bytes, std::convert::Infallible>(chunk.0),
                (items, chunk.1),
            ))
        },
    );
    let mut resp = Response::new(Body::from_stream(body));
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, content_type(codec, true));
    resp
}

/// A streaming call that failed before it started: an end-of-stream error alone.
pub fn stream_error(codec: Codec, err: &RpcError) -> Response {
    let mut resp = Response::new(Body::from(end_of_stream(Some(err))));
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, content_type(codec, true));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(streaming: bool) -> CallShape {
        CallShape {
            codec: Codec::Json,
            streaming,
            gzip: false,
            timeout: None,
        }
    }

    #[test]
    fn envelopes_round_trip_and_bad_frames_are_refused() {
        let mut body = envelope(0, b"{\"a\":1}").to_vec();
        body.extend_from_slice(&end_of_stream(None));
        assert_eq!(
            request_message(&shape(true), &body).unwrap(),
            b"{\"a\":1}".to_vec()
        );
        let err = request_message(&shape(true), &[0, 0, 0, 0, 9, b'{']).unwrap_err();
        assert_eq!(err.code, Code::InvalidArgument);
        let err = request_message(&shape(true), &[0, 0]).unwrap_err();
        assert_eq!(err.code, Code::InvalidArgument);
        let err = request_message(&shape(true), &[0x80, 0, 0, 0, 0]).unwrap_err();
        assert!(err.message.contains("flags"), "{}", err.message);
        let err = request_message(&shape(true), &envelope(1, b"x")).unwrap_err();
        assert!(err.message.contains("Compressed"), "{}", err.message);
        let huge = [0u8, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(
            request_message(&shape(true), &huge).unwrap_err().code,
            Code::ResourceExhausted
        );
    }

    #[test]
    fn headers_pick_the_codec() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            "application/connect+proto".parse().unwrap(),
        );
        h.insert("connect-timeout-ms", "1500".parse().unwrap());
        let s = call_shape(&h).unwrap();
        assert_eq!(s.codec, Codec::Proto);
        assert!(s.streaming);
        assert_eq!(s.timeout, Some(Duration::from_millis(1500)));
        h.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        assert_eq!(call_shape(&h).unwrap_err().code, Code::Unimplemented);
    }

    #[test]
    fn end_of_stream_carries_the_error() {
        let e = end_of_stream(Some(&RpcError::new(Code::NotFound, "no such process")));
        assert_eq!(e[0], FLAG_END_STREAM);
        let v: serde_json::Value = serde_json::from_slice(&e[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
    }
}
