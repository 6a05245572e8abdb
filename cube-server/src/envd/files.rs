//! envd's HTTP file routes: `GET /files` streams a file out (gzip when asked for),
//! `POST /files` streams uploads in (multipart form parts, or an octet-stream body,
//! gzip-encoded or not) through the agent's chunked writes, one chunk in memory at a
//! time, up to the configured size.

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use cube_agent::client::ClientError;
use cube_agent::protocol::{RequestBody, ResponseBody};
use futures_util::StreamExt as _;
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use super::filesystem::resolve;
use crate::error::ApiError;
use crate::service::{Entry, Service};

/// Chunks queued between the HTTP body and the agent.
const QUEUE: usize = 8;

/// envd's error body for the file routes.
fn err(status: StatusCode, message: impl Into<String>) -> Response {
    ApiError::new(status, message).into_response()
}

fn path_of(query: &std::collections::HashMap<String, String>) -> Result<String, ApiError> {
    let raw = query.get("path").map(String::as_str).unwrap_or("");
    resolve(raw).map_err(|e| ApiError::bad_request(e.message))
}

/// `GET /files?path=...`.
pub async fn read(
    service: Arc<Service>,
    entry: Arc<Entry>,
    query: std::collections::HashMap<String, String>,
    headers: &HeaderMap,
) -> Response {
    let path = match path_of(&query) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    if query.get("path").is_none_or(|p| p.is_empty()) {
        return err(
            StatusCode::BAD_REQUEST,
            "The path query parameter is required",
        );
    }
    let gzip = headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("gzip"));
    let client = match service.agent(&entry).await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let (first_tx, first_rx) = oneshot::channel::<Result<(), ApiError>>();
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(QUEUE);
    let file = path.clone();
    let spawned = std::thread::Builder::new()
        .name("envd-read".into())
        .spawn(move || {
            let mut call = match client.start(RequestBody::ReadFile {
                path: file,
                offset: 0,
                len: None,
            }) {
                Ok(c) => c,
                Err(e) => {
                    let _ = first_tx.send(Err(ApiError::from_agent(&e)));
                    return;
                }
            };
            let mut first = Some(first_tx);
            let mut encoder = gzip
                .then(|| flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
            loop {
                let item = call.recv();
                if let Some(f) = first.take() {
                    match &item {
                        Ok(Some(ResponseBody::Error(e))) => {
                            let _ =
                                f.send(Err(ApiError::from_agent(&ClientError::Agent(e.clone()))));
                            return;
                        }
                        Err(e) => {
                            let _ = f.send(Err(ApiError::from_agent(e)));
                            return;
                        }
                        _ => {
                            let _ = f.send(Ok(()));
                        }
                    }
                }
                let chunk = match item {
                    Ok(Some(ResponseBody::FileChunk(b))) => match encoder.as_mut() {
                        Some(enc) => {
                            use std::io::Write as _;
                            let _ = enc.write_all(&b);
                            std::mem::take(enc.get_mut())
                        }
                        None => b,
                    },
                    Ok(Some(ResponseBody::FileEnd { .. })) => {
                        if let Some(enc) = encoder.take() {
                            if let Ok(rest) = enc.finish() {
                                let _ = tx.blocking_send(Ok(Bytes::from(rest)));
                            }
                        }
                        return;
                    }
                    Ok(Some(ResponseBody::Error(e))) => {
                        let _ = tx.blocking_send(Err(std::io::Error::other(e.message)));
                        return;
                    }
                    Ok(Some(_)) => continue,
                    Ok(None) => return,
                    Err(e) => {
                        let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
                        return;
                    }
                };
                if !chunk.is_empty() && tx.blocking_send(Ok(Bytes::from(chunk))).is_err() {
                    return;
                }
            }
        });
    if spawned.is_err() {
        return err(StatusCode::SERVICE_UNAVAILABLE, "No thread for the read");
    }
    match first_rx.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            let status = match e.status {
                StatusCode::NOT_FOUND => StatusCode::NOT_FOUND,
                StatusCode::BAD_REQUEST | StatusCode::CONFLICT => StatusCode::BAD_REQUEST,
                other => other,
            };
            return err(status, e.message);
        }
        Err(_) => return err(StatusCode::INTERNAL_SERVER_ERROR, "The read ended early"),
    }
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut resp = Response::new(Body::from_stream(body));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    let name = path.rsplit('/').next().unwrap_or("file").replace('"', "");
    if let Ok(v) = HeaderValue::from_str(&format!("inline; filename=\"{name}\"")) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    if gzip {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    resp
}

/// Reads queued chunks as a byte stream (on a blocking thread).
struct ChannelReader {
    rx: mpsc::Receiver<Bytes>,
    current: Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                Some(b) => self.current = b,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        self.current = self.current.slice(n..);
        Ok(n)
    }
}

/// Streams one file's bytes (fed into the returned sender) into `path` in the sandbox.
fn start_write(
    client: Arc<cube_agent::client::Client>,
    path: String,
    gunzip: bool,
) -> (
    mpsc::Sender<Bytes>,
    tokio::task::JoinHandle<Result<u64, ClientError>>,
) {
    let (tx, rx) = mpsc::channel::<Bytes>(QUEUE);
    let handle = tokio::task::spawn_blocking(move || {
        let reader = ChannelReader {
            rx,
            current: Bytes::new(),
        };
        if gunzip {
            client.write_file(&path, &mut flate2::read::GzDecoder::new(reader))
        } else {
            let mut reader = reader;
            client.write_file(&path, &mut reader)
        }
    });
    (tx, handle)
}

fn written(path: &str) -> serde_json::Value {
    json!({
        "name": path.rsplit('/').next().unwrap_or(""),
        "type": "file",
        "path": path,
    })
}

/// Feeds a body stream into a write, counting against the upload limit.
/// How much of a refused upload is still read, and for how long, before the refusal is
/// sent: a server that answers and closes while the client is still sending makes the
/// client's kernel take a reset, which can throw the answer away before the client
/// reads it (the client then sees a broken pipe instead of 413). nginx's lingering
/// close does the same.
const LINGER_BYTES: u64 = 64 << 20;
const LINGER_TIME: Duration = Duration::from_secs(5);

/// Reads and drops what is left of a refused upload, within [`LINGER_BYTES`] and
/// [`LINGER_TIME`].
async fn linger<S, E>(mut chunks: S)
where
    S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
{
    let mut read = 0u64;
    let _ = tokio::time::timeout(LINGER_TIME, async {
        while let Some(Ok(chunk)) = chunks.next().await {
            read += chunk.len() as u64;
            if read > LINGER_BYTES {
                break;
            }
        }
    })
    .await;
}

async fn feed<S, E>(
    mut chunks: S,
    tx: mpsc::Sender<Bytes>,
    total: &mut u64,
    limit: u64,
) -> Result<(), Response>
where
    S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    while let Some(chunk) = chunks.next().await {
        let chunk =
            chunk.map_err(|e| err(StatusCode::BAD_REQUEST, format!("Reading the upload: {e}")))?;
        *total += chunk.len() as u64;
        if *total > limit {
            linger(&mut chunks).await;
            return Err(err(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("Upload larger than the {limit} bytes this server accepts"),
            ));
        }
        if tx.send(chunk).await.is_err() {
            // The write failed; its own error is reported below.
            break;
        }
    }
    Ok(())
}

async fn finish_write(
    handle: tokio::task::JoinHandle<Result<u64, ClientError>>,
) -> Result<(), Response> {
    match handle.await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => {
            let api = ApiError::from_agent(&e);
            let status = match api.status {
                StatusCode::NOT_FOUND | StatusCode::CONFLICT => StatusCode::BAD_REQUEST,
                other => other,
            };
            Err(err(status, api.message))
        }
        Err(e) => Err(err(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("A worker failed: {e}"),
        )),
    }
}

/// `POST /files`.
pub async fn write(
    service: Arc<Service>,
    entry: Arc<Entry>,
    query: std::collections::HashMap<String, String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let limit = service.config.max_upload_bytes;
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        if len > limit.saturating_add(64 * 1024) {
            linger(body.into_data_stream()).await;
            return err(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("Upload of {len} bytes is larger than the {limit} this server accepts"),
            );
        }
    }
    let client = match service.agent(&entry).await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let gzip = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("gzip"));
    let named = query.get("path").filter(|p| !p.is_empty()).cloned();
    let mut total = 0u64;
    let mut results = Vec::new();
    if let Ok(boundary) = multer::parse_boundary(&content_type) {
        let mut parts = multer::Multipart::new(body.into_data_stream(), boundary);
        loop {
            let field = match parts.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return err(StatusCode::BAD_REQUEST, format!("Bad multipart body: {e}")),
            };
            let target = match (&named, field.file_name()) {
                (Some(p), _) if results.is_empty() => p.clone(),
                (_, Some(name)) if !name.is_empty() => name.to_string(),
                _ => {
                    return err(
                        StatusCode::BAD_REQUEST,
                        "A file part needs a path (the path parameter or the part's file name)",
                    )
                }
            };
            let path = match resolve(&target) {
                Ok(p) => p,
                Err(e) => return err(StatusCode::BAD_REQUEST, e.message),
            };
            let (tx, handle) = start_write(Arc::clone(&client), path.clone(), false);
            let fed = feed(field, tx, &mut total, limit).await;
            let done = finish_write(handle).await;
            if let Err(r) = fed {
                return r;
            }
            if let Err(r) = done {
                return r;
            }
            results.push(written(&path));
        }
        if results.is_empty() {
            return err(
                StatusCode::BAD_REQUEST,
                "The multipart body has no file part",
            );
        }
    } else {
        let Some(target) = named else {
            return err(
                StatusCode::BAD_REQUEST,
                "The path query parameter is required for an octet-stream upload",
            );
        };
        let path = match resolve(&target) {
            Ok(p) => p,
            Err(e) => return err(StatusCode::BAD_REQUEST, e.message),
        };
        let (tx, handle) = start_write(client, path.clone(), gzip);
        let fed = feed(body.into_data_stream(), tx, &mut total, limit).await;
        let done = finish_write(handle).await;
        if let Err(r) = fed {
            return r;
        }
        if let Err(r) = done {
            return r;
        }
        results.push(written(&path));
    }
    (StatusCode::OK, axum::Json(results)).into_response()
}
