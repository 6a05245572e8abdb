//! Traffic for any other sandbox port (what `sandbox.get_host(port)` hands out, for web
//! servers started in the sandbox): each HTTP request is sent over a TCP connection to
//! that port on the sandbox's loopback, which the agent carries over its own stream
//! ([`cube_agent::protocol::RequestBody::TcpConnect`]), so sandboxes need no network
//! of their own and both engines work the same.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderName, Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use cube_agent::client::Client;
use cube_agent::protocol::{RequestBody, ResponseBody};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot};

use crate::error::ApiError;
use crate::service::{Entry, Service};

/// A byte stream to a port in the sandbox.
pub struct TunnelStream {
    incoming: mpsc::Receiver<io::Result<Bytes>>,
    pending: Bytes,
    outgoing: std::sync::mpsc::Sender<Vec<u8>>,
    shut: bool,
}

impl TunnelStream {
    /// Connects to `port` on the sandbox's loopback.
    pub async fn open(client: Arc<Client>, port: u16) -> Result<TunnelStream, ApiError> {
        let (ready_tx, ready_rx) = oneshot::channel::<Result<(), ApiError>>();
        let (in_tx, in_rx) = mpsc::channel::<io::Result<Bytes>>(16);
        let (out_tx, out_rx) = std::sync::mpsc::channel::<Vec<u8>>();
        let mut call = client
            .start(RequestBody::TcpConnect { port })
            .map_err(|e| ApiError::from_agent(&e))?;
        let id = call.id;
        let writer = Arc::clone(&client);
        std::thread::Builder::new()
            .name(format!("proxy-{port}-read"))
            .spawn(move || {
                let mut ready = Some(ready_tx);
                loop {
                    match call.recv() {
                        Ok(Some(ResponseBody::Started { .. })) => {
                            if let Some(r) = ready.take() {
                                let _ = r.send(Ok(()));
                            }
                        }
                        Ok(Some(ResponseBody::Stdout(b))) => {
                            if in_tx.blocking_send(Ok(Bytes::from(b))).is_err() {
                                return;
                            }
                        }
                        Ok(Some(ResponseBody::Error(e))) => {
                            let err = ApiError::new(
                                StatusCode::BAD_GATEWAY,
                                format!("Port {port} in the sandbox: {}", e.message),
                            );
                            match ready.take() {
                                Some(r) => {
                                    let _ = r.send(Err(err));
                                }
                                None => {
                                    let _ = in_tx.blocking_send(Err(io::Error::other(err.message)));
                                }
                            }
                            return;
                        }
                        Ok(Some(_)) | Ok(None) => return,
                        Err(e) => {
                            if let Some(r) = ready.take() {
                                let _ = r.send(Err(ApiError::from_agent(&e)));
                            }
                            return;
                        }
                    }
                }
            })
            .map_err(|e| ApiError::internal(format!("No thread for the proxy: {e}")))?;
        std::thread::Builder::new()
            .name(format!("proxy-{port}-write"))
            .spawn(move || {
                while let Ok(data) = out_rx.recv() {
                    let last = data.is_empty();
                    if writer.send(id, RequestBody::TcpSend { data }).is_err() || last {
                        return;
                    }
                }
                // Dropped without a shutdown: end the sandbox side's input.
                let _ = writer.send(id, RequestBody::TcpSend { data: Vec::new() });
            })
            .map_err(|e| ApiError::internal(format!("No thread for the proxy: {e}")))?;
        ready_rx.await.map_err(|_| {
            ApiError::new(StatusCode::BAD_GATEWAY, "The sandbox's agent went away")
        })??;
        Ok(TunnelStream {
            incoming: in_rx,
            pending: Bytes::new(),
            outgoing: out_tx,
            shut: false,
        })
    }
}

impl AsyncRead for TunnelStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        while self.pending.is_empty() {
            match self.incoming.poll_recv(cx) {
                Poll::Ready(Some(Ok(b))) => self.pending = b,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
        let n = buf.remaining().min(self.pending.len());
        buf.put_slice(&self.pending[..n]);
        self.pending = self.pending.slice(n..);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for TunnelStream {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        match self.outgoing.send(buf.to_vec()) {
            Ok(()) => Poll::Ready(Ok(buf.len())),
            Err(_) => Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.shut {
            self.shut = true;
            let _ = self.outgoing.send(Vec::new());
        }
        Poll::Ready(Ok(()))
    }
}

/// Headers that belong to one hop, or to E2B's routing and auth, never passed on.
const DROPPED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "x-access-token",
    "e2b-traffic-access-token",
    "e2b-sandbox-id",
    "e2b-sandbox-port",
    "x-api-key",
];

/// Sends one request to `port` in the sandbox and returns its answer.
pub async fn forward(
    service: Arc<Service>,
    entry: Arc<Entry>,
    port: u16,
    req: Request<Body>,
) -> Response {
    match forward_inner(&service, &entry, port, req).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

async fn forward_inner(
    service: &Arc<Service>,
    entry: &Arc<Entry>,
    port: u16,
    req: Request<Body>,
) -> Result<Response, ApiError> {
    let client = service.agent(entry).await?;
    let stream = match TunnelStream::open(Arc::clone(&client), port).await {
        Ok(s) => s,
        Err(e) if e.status == StatusCode::BAD_GATEWAY && e.message.contains("agent") => {
            // A stale shared connection (the sandbox was restored): once more.
            service.reset_agent(entry);
            TunnelStream::open(service.agent(entry).await?, port).await?
        }
        Err(e) => return Err(e),
    };
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, format!("Port {port}: {e}")))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "proxied connection ended");
        }
    });
    let (mut parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    parts.uri = path
        .parse::<Uri>()
        .map_err(|e| ApiError::bad_request(format!("Bad path: {e}")))?;
    for name in DROPPED {
        parts.headers.remove(HeaderName::from_static(name));
    }
    parts.headers.insert(
        header::HOST,
        header::HeaderValue::from_str(&format!("localhost:{port}"))
            .map_err(|e| ApiError::internal(e.to_string()))?,
    );
    let outgoing = Request::from_parts(parts, body);
    let resp = sender
        .send_request(outgoing)
        .await
        .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, format!("Port {port}: {e}")))?;
    let (parts, body) = resp.into_parts();
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// A request body as bytes, up to `limit` (for routes that need it whole).
pub async fn collect(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("Request body too large or unreadable: {e}"),
        )
    })
}
